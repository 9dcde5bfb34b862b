"""torchrun --nproc-per-node 1 harness/fitness.py --expect-world-size N
fab preflight

The preflight's job, one process per node: each node's compute (a matmul, one node at a time, so that
nodes sharing a machine do not measure each other), memory, free disk, GPU health (node/fitness.py
reads nvidia-smi, dcgmi and the kernel log), then a pairwise all-reduce bandwidth matrix (rounds of
disjoint pairs, or one pair at a time where nodes share a machine) and each node's clock against the
head node's. Rank 0 prints the whole report on one
line after `node.fitness.REPORT_MARKER`; the verdicts are fab's (`node.fitness.judge`). Any rank that
cannot take part fails the job, as the all-reduce check of bootstrap's health stage did.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from harness.args import ExampleParser, positive_float, positive_int
from harness.dist import Distributed, cleanup, init_distributed, run
from node import fitness

MATMUL_SIZE = {"cpu": 256, "cuda": 8192}
"""Square matmul sizes: small enough on one CPU thread for many multiplications per window."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--expect-world-size", type=positive_int, help="fail unless the job has this many ranks")
    parser.add_argument(
        "--compute-s", type=positive_float, default=0.1, help="seconds of matmul per node per round (default 0.1)"
    )
    parser.add_argument("--rounds", type=positive_int, default=6, help="compute rounds per node, best kept (default 6)")
    parser.add_argument("--pair-mb", type=positive_float, default=1.0, help="all-reduce size per pair in MB")
    parser.add_argument("--pair-iterations", type=positive_int, default=10, help="timed all-reduces per pair")
    parser.add_argument("--timeout", type=positive_float, default=120.0, help="rendezvous timeout in seconds")
    return parser.parse_args(argv)


def matmul_gflops(device: torch.device, seconds: float) -> float:
    """Multiply square matrices for `seconds` of wall time: throughput as this node delivers it (a node
    whose processes are throttled, or a slow GPU, delivers less)."""
    size = MATMUL_SIZE[device.type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    _sync(device)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.matmul(a, b)
        count += 1
        if device.type == "cuda" and count % 10 == 0:
            _sync(device)
    _sync(device)
    return 2 * size**3 * count / (time.perf_counter() - started) / 1e9


def compute_in_turn(ctx: Distributed, seconds: float, rounds: int) -> list[float]:
    """Each node measures while the others wait, `rounds` times: this node's rate in each round (a round's
    turns follow each other within a fraction of a second, so the verdict sets each round against the other
    nodes' same round: a busy neighbour costs a round, a throttled node is slow in every one)."""
    found = []
    for _ in range(rounds):
        for turn in range(ctx.world_size):
            dist.barrier()
            if turn == ctx.rank:
                found.append(round(matmul_gflops(ctx.device, seconds), 2))
    dist.barrier()
    return found


def pair_bandwidth(ctx: Distributed, megabytes: float, iterations: int, one_at_a_time: bool) -> list[dict]:
    """All-reduce bus bandwidth of every pair of ranks (one per node): in rounds of disjoint pairs at once,
    or one pair at a time where nodes share a machine (pairs measured at once would share its cores)."""
    rounds = fitness.pair_rounds(ctx.world_size)
    if one_at_a_time:
        rounds = [[pair] for pairs in rounds for pair in pairs]
    groups = {pair: dist.new_group(list(pair)) for pairs in rounds for pair in pairs}  # every rank, same order
    tensor = torch.ones(int(megabytes * 1e6 / 4), device=ctx.device)
    measured = []
    for pairs in rounds:
        dist.barrier()
        mine = next((p for p in pairs if ctx.rank in p), None)
        if mine is None:
            continue
        group = groups[mine]
        dist.all_reduce(tensor, group=group)  # the connection is made by the first one
        _sync(ctx.device)
        times = []
        for _ in range(iterations):
            started = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            _sync(ctx.device)
            times.append(time.perf_counter() - started)
        if ctx.rank == mine[0]:  # busbw = algbw * 2(n-1)/n, n = 2: algbw; the median all-reduce, so that one
            seconds = statistics.median(times)  # hiccup of a busy host does not name a link
            measured.append({"a": mine[0], "b": mine[1], "gbps": round(tensor.numel() * 4 / seconds / 1e9, 4)})
    dist.barrier()
    return measured


def machine_id() -> str:
    """What tells machines apart: nodes that share one (the local provider's) share their boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def clock_offset_s() -> float:
    """This node's clock minus rank 0's, read as a barrier lets every rank go (to within its release)."""
    dist.barrier()
    now = torch.tensor([time.time()], dtype=torch.float64)
    clocks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(clocks, now, group=_cpu_group())
    return float(now.item() - clocks[0].item())


_CPU_GROUP: list = []


def _cpu_group():
    """A gloo group for the small CPU exchanges: the default group where it is gloo's, else one made once
    (on GPUs the default group is nccl's)."""
    if dist.get_backend() == "gloo":
        return None
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.new_group(backend="gloo"))
    return _CPU_GROUP[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    ctx = init_distributed(args.timeout)
    if args.expect_world_size and ctx.world_size != args.expect_world_size:
        print(f"rank {ctx.rank}: world size {ctx.world_size}, expected {args.expect_world_size}", flush=True)
        return 1
    total = torch.ones(1, device=ctx.device)
    dist.all_reduce(total)
    if int(total.item()) != ctx.world_size:
        print(f"rank {ctx.rank}: all-reduce of ones gave {total.item()}, not {ctx.world_size}", flush=True)
        return 1
    node = os.environ.get("CLUSTER_NODE", f"node-{ctx.env.node_rank}")
    facts = {"node": node, **fitness.host_facts(os.path.expanduser("~")), "gpu": fitness.gpu_facts()}
    facts.update(fitness.cpu_allowance())
    facts["clock_offset_s"] = round(clock_offset_s(), 4)
    facts["gflops_rounds"] = compute_in_turn(ctx, args.compute_s, args.rounds)
    facts["gflops"] = max(facts["gflops_rounds"])
    machines: list = [None] * ctx.world_size
    dist.all_gather_object(machines, machine_id(), group=_cpu_group())
    pairs = pair_bandwidth(ctx, args.pair_mb, args.pair_iterations, len(set(machines)) < ctx.world_size)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"facts": facts, "pairs": pairs}, group=_cpu_group())
    if ctx.is_rank0:
        names = [g["facts"]["node"] for g in gathered]
        report = {
            "nodes": [g["facts"] for g in gathered],
            "pairs": [{**p, "a": names[p["a"]], "b": names[p["b"]]} for g in gathered for p in g["pairs"]],
            "backend": ctx.backend,
            "shared_machine": len(set(machines)) < ctx.world_size,
            "seconds": round(time.monotonic() - started, 2),
        }
        print(fitness.REPORT_MARKER + json.dumps(report), flush=True)
    cleanup()
    return 0


if __name__ == "__main__":
    run(main)
