"""One timed loop of small all-reduces, run under torchrun by bench_flight_recorder.py.

Prints `elapsed_s=<wall seconds> cpu_s=<this process's CPU seconds>` from rank 0 for ITERS
all-reduces of 1 KB after a warm-up.
"""

import sys
import time

import torch
import torch.distributed as dist

ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000


def main() -> None:
    dist.init_process_group("gloo")
    tensor = torch.ones(256)
    for _ in range(50):
        dist.all_reduce(tensor)
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(ITERS):
        dist.all_reduce(tensor)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if dist.get_rank() == 0:
        print(f"elapsed_s={elapsed:.6f} cpu_s={cpu:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
