"""torchrun --nnodes 1 --nproc-per-node 2 examples/distributed_hello.py
fab hello

Every rank reports in (node, host, rank, local rank, device, backend); then all-reduce, broadcast and
all-gather run and their results are checked against the values they must have. Any mismatch on any
rank makes every rank exit 1. `--expect-world-size N` states how many ranks you expect: a wrong
expectation fails the checks, which is how to assert a cluster's size in a script.
"""

import argparse
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from harness.args import ExampleParser, add_run_arguments, positive_int
from harness.dist import cleanup, init_distributed, print0, run
from harness.metrics import MetricsWriter


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument(
        "--expect-world-size", type=positive_int, help="fail unless the job has exactly this many ranks"
    )
    add_run_arguments(parser, seed=False, timeout_s=120)
    return parser.parse_args(argv)


def report(ctx) -> dict:
    return {
        "rank": ctx.rank,
        "local_rank": ctx.env.local_rank,
        "node": os.environ.get("CLUSTER_NODE", f"node-{ctx.env.node_rank}"),
        "host": socket.gethostname(),
        "device": str(ctx.device),
        "backend": ctx.backend,
    }


def run_checks(ctx, world_size: int) -> list[str]:
    """Each collective against the value it must produce with `world_size` ranks; the failures."""
    failures = []
    rank_plus_one = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(rank_plus_one)
    expected_sum = world_size * (world_size + 1) / 2
    if rank_plus_one.item() != expected_sum:
        failures.append(f"all_reduce(rank+1) gave {rank_plus_one.item():g}, expected {expected_sum:g}")

    value = torch.tensor([42.0 if ctx.rank == 0 else -1.0], device=ctx.device)
    dist.broadcast(value, src=0)
    if value.item() != 42.0:
        failures.append(f"broadcast from rank 0 gave {value.item():g}, expected 42")

    gathered = [torch.zeros(1, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor([float(ctx.rank)], device=ctx.device))
    ranks = [int(t.item()) for t in gathered]
    if ranks != list(range(world_size)):
        failures.append(f"all_gather(rank) gave {ranks}, expected {list(range(world_size))}")
    return failures


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        reports: list[dict] = [{}] * ctx.world_size
        dist.all_gather_object(reports, report(ctx))
        for r in reports:
            print0(
                f"rank {r['rank']}/{ctx.world_size} on {r['node']} (host {r['host']}, local rank {r['local_rank']}, "
                f"{r['device']}, {r['backend']}) reporting in"
            )
        expected_world = args.expect_world_size or ctx.world_size
        failures = run_checks(ctx, expected_world)
        all_failures: list[list[str]] = [[]] * ctx.world_size
        dist.all_gather_object(all_failures, failures)
        bad = {rank: f for rank, f in enumerate(all_failures) if f}
        nodes = len({r["node"] for r in reports})
        MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write(
            "summary",
            example="distributed_hello",
            world_size=ctx.world_size,
            nodes=nodes,
            failures={str(k): v for k, v in bad.items()},
            ranks=reports,
        )
        if bad:
            for rank, messages in bad.items():
                for message in messages:
                    print0(f"MISMATCH on rank {rank}: {message}")
            return 1
        print0(
            f"hello from {ctx.world_size} ranks on {nodes} nodes: "
            "all-reduce, broadcast and all-gather checked, all correct"
        )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
