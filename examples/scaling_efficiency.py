"""torchrun --standalone --nproc-per-node 2 examples/scaling_efficiency.py --plot scaling.png
fab run --script examples/scaling_efficiency.py

How well does DDP scale here? Within one job of N ranks, the same model trains on the first 1, 2, ..,
N ranks (a process group per size) with the same per-rank batch (weak scaling). For each size it
prints samples/s, scaling efficiency = throughput(k) / (k x throughput(1)), and where a step's time
goes: compute (forward and backward with no gradient sync) and exposed communication (the rest).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from examples._plots import NO_MATPLOTLIB, pyplot
from harness import data
from harness.args import (
    ExampleParser,
    add_results_arguments,
    add_run_arguments,
    add_training_arguments,
    non_negative_int,
    positive_int,
)
from harness.comm_bench import synchronize
from harness.dist import cleanup, init_distributed, print0, run
from harness.metrics import MetricsWriter
from harness.models import MLP, loss_fn
from harness.results import results_path, write_json

RESULTS_JSON = "scaling.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    add_training_arguments(
        parser, steps=20, steps_help="timed steps per size", batch_size=64, batch_help="samples per rank per step"
    )
    parser.add_argument("--hidden", type=positive_int, default=512, help="MLP width (default 512)")
    parser.add_argument("--layers", type=positive_int, default=1, help="MLP hidden layers (default 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps per size (default 3)")
    add_results_arguments(parser, json_name=RESULTS_JSON, plot_what="throughput and efficiency")
    add_run_arguments(parser, seed=False)
    return parser.parse_args(argv)


def timed_steps(model, optimizer, inputs, targets, steps: int, sync: bool, device) -> float:
    """Mean seconds per step; with sync=False the backward passes skip DDP's all-reduce."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if sync:
            loss_fn(model(inputs), targets).backward()
        else:
            with model.no_sync():
                loss_fn(model(inputs), targets).backward()
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - started) / steps


def measure_size(args, ctx, ranks: int, group, inputs, targets) -> dict | None:
    """Train on the first `ranks` ranks; returns this rank's figures, None where it sat out."""
    if ctx.rank >= ranks:
        return None
    torch.manual_seed(0)
    model = DDP(
        MLP(hidden=args.hidden, layers=args.layers).to(ctx.device),
        process_group=group,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    timed_steps(model, optimizer, inputs, targets, args.warmup, True, ctx.device)
    step_s = timed_steps(model, optimizer, inputs, targets, args.steps, True, ctx.device)
    compute_s = timed_steps(model, optimizer, inputs, targets, args.steps, False, ctx.device)
    return {"ranks": ranks, "step_s": step_s, "compute_s": compute_s}


def slowest(figures: list[dict | None]) -> dict:
    """A size's figures as its slowest rank saw them (DDP moves at the pace of the slowest)."""
    present = [f for f in figures if f]
    return max(present, key=lambda f: f["step_s"])


def table(results: list[dict]) -> str:
    lines = [f"{'ranks':>5} {'samples/s':>11} {'efficiency':>10} {'ms/step':>8} {'compute ms':>10} {'comm ms':>8}"]
    for r in results:
        lines.append(
            f"{r['ranks']:>5d} {r['samples_per_s']:>11.1f} {r['efficiency']:>10.1%} {r['step_s'] * 1e3:>8.2f} "
            f"{r['compute_s'] * 1e3:>10.2f} {r['comm_s'] * 1e3:>8.2f}"
        )
    return "\n".join(lines)


def plot(path: Path, results: list[dict], backend: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    ranks = [r["ranks"] for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ranks, [r["samples_per_s"] for r in results], marker="o", label="measured")
    left.plot(ranks, [results[0]["samples_per_s"] * k for k in ranks], linestyle="--", label="linear")
    left.set(xlabel="ranks", ylabel="samples/s", title=f"DDP throughput ({backend})")
    left.legend()
    right.bar(ranks, [r["compute_s"] * 1e3 for r in results], label="compute")
    right.bar(
        ranks,
        [r["comm_s"] * 1e3 for r in results],
        bottom=[r["compute_s"] * 1e3 for r in results],
        label="exposed communication",
    )
    right.set(xlabel="ranks", ylabel="ms per step", title="where a step goes")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"plot: {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        inputs, targets = (
            t[: args.batch_size].to(ctx.device)
            for t in data.teacher_classification(samples=args.batch_size, seed=ctx.rank).tensors
        )
        results = []
        for ranks in range(1, ctx.world_size + 1):
            group = dist.new_group(list(range(ranks)))
            mine = measure_size(args, ctx, ranks, group, inputs, targets)
            figures: list = [None] * ctx.world_size
            dist.all_gather_object(figures, mine)
            row = slowest(figures)
            row["samples_per_s"] = ranks * args.batch_size / row["step_s"]
            row["comm_s"] = max(row["step_s"] - row["compute_s"], 0.0)
            results.append(row)
        for row in results:
            row["efficiency"] = row["samples_per_s"] / (row["ranks"] * results[0]["samples_per_s"])
        print0(f"DDP weak scaling, {args.batch_size} samples per rank, {ctx.backend}:")
        print0(table(results))
        if ctx.is_rank0:
            report = {"backend": ctx.backend, "results": results}
            print(f"results: {write_json(report, results_path(args.json, RESULTS_JSON))}", flush=True)
            if args.plot:
                print(plot(results_path(args.plot, "scaling.png"), results, ctx.backend), flush=True)
        MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write("summary", example="scaling_efficiency", results=results)
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
