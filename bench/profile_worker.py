"""One torchrun job that measures all-reduce bus bandwidth two ways, interleaved, for bench_profile:
the harness's `measure()` and an independent timer (torch.utils.benchmark.Timer, which synchronises
the device itself). Rank 0 prints one JSON line per round."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.benchmark import Timer  # noqa: E402

from harness.comm_bench import bus_factor, measure  # noqa: E402
from harness.dist import cleanup, init_distributed, run  # noqa: E402

# Bandwidth-bound sizes: at 1 MB this machine's ~1.2 ms gloo latency dominates and both timers are noise.
SIZES = [4 * 2**20, 16 * 2**20, 64 * 2**20]
ROUNDS = 4
ITERS = 20


def independent_busbw(size: int, device) -> float:
    x = torch.randn(size // 4, device=device)
    dist.all_reduce(x)
    dist.barrier()
    seconds = Timer("dist.all_reduce(x)", globals={"dist": dist, "x": x}).timeit(ITERS).mean
    timings = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(timings)
    seconds = timings.item() / dist.get_world_size()
    return size / seconds / 1e9 * bus_factor("all_reduce", dist.get_world_size())


def main() -> int:
    ctx = init_distributed()
    try:
        for round_ in range(ROUNDS):
            for size in SIZES:
                harness = measure("all_reduce", size, ctx.device, warmup=2, iters=ITERS).busbw_gbps
                independent = independent_busbw(size, ctx.device)
                if ctx.is_rank0:
                    print(
                        json.dumps({"round": round_, "size": size, "harness": harness, "independent": independent}),
                        flush=True,
                    )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
