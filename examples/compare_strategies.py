"""torchrun --standalone --nproc-per-node 4 examples/compare_strategies.py
fab compare --nproc-per-node 2

The strategy table: the same transformer on the same global batch under DDP, DDP with PowerSGD,
FSDP in ZeRO-2 and ZeRO-3 style, tensor parallel, and hybrid (dp x tp, from 4 ranks), each built by
the example that teaches it. For each it measures, per rank: the memory held for parameters (and
whole parameters kept from forward for backward), gradients, optimizer state and activations, summed
from the tensors themselves (on GPUs also the peak CUDA memory); the bytes each rank sends per step
(counted as the collectives are issued); and the step time. The course's estimate, 4 bytes of
weights + 4 of gradients + 8 of Adam state per parameter, divided as the strategy divides them, plus
activations, stands beside the measured total.

Output: a rich table, a PNG (`--plot`, default strategies.png) and a JSON (`--json`, default
strategies.json), both in the results folder ($CLUSTER_RESULTS_DIR, else $CLUSTER_RUN_DIR, else here).
"""

import argparse
import gc
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from examples._plots import NO_MATPLOTLIB, pyplot
from examples._tables import render_table
from examples.fsdp_training import shard
from examples.tensor_parallel import split_blocks
from harness.args import (
    ExampleParser,
    add_results_arguments,
    add_run_arguments,
    add_training_arguments,
    non_negative_int,
    positive_int,
)
from harness.comm_bytes import CollectiveCounter, CommTally, bucket_cap_mb, register_counted_hook
from harness.dist import DistEnv, cleanup, fail, init_distributed, print0, run
from harness.memory import (
    MemoryBreakdown,
    SavedForBackward,
    Sharing,
    activation_estimate_bytes,
    breakdown,
    course_estimate_bytes,
    format_bytes,
)
from harness.metrics import MetricsWriter
from harness.parallel import (
    Batches,
    MeshShape,
    ModelConfig,
    add_model_arguments,
    build_mesh,
    layout_problem,
    mesh_shape,
    model_config,
    timed,
    train_step,
)
from harness.results import results_path, write_json

DEFAULT_MODEL = ModelConfig(vocab=64, seq_len=32, d_model=128, n_heads=4, n_layers=2)
STRATEGIES = ("ddp", "ddp-powersgd", "fsdp-zero2", "fsdp-zero3", "tp", "hybrid")
RESULTS_JSON, RESULTS_PNG = "strategies.json", "strategies.png"
POWERSGD_START = 2  # PowerSGD compresses from this step on: the warm-up covers the plain steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"a subset of {','.join(STRATEGIES)}")
    add_model_arguments(parser, DEFAULT_MODEL)
    add_training_arguments(
        parser,
        steps=5,
        steps_help="timed steps per strategy",
        batch_size=16,
        batch_help="sequences per global batch",
        lr=3e-3,
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=POWERSGD_START,
        help=f"untimed steps first (default {POWERSGD_START}: PowerSGD's plain steps)",
    )
    parser.add_argument(
        "--powersgd-rank", type=positive_int, default=1, help="PowerSGD's approximation rank (default 1)"
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel ranks of hybrid (default: the ranks on a node, else 2)",
    )
    add_results_arguments(parser, json_name=RESULTS_JSON, plot_what="the table", plot_name=RESULTS_PNG)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    args.strategies = args.strategies.split(",")
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown --strategies {', '.join(sorted(unknown))}; choose from {', '.join(STRATEGIES)}")
    args.model = model_config(args, parser)
    return args


@dataclass
class Built:
    """One strategy, ready to train."""

    model: torch.nn.Module
    """The model, wrapped, split or sharded."""
    optimizer: torch.optim.Optimizer
    """AdamW over its (local) parameters."""
    replica: int
    """Which slice of the global batch this rank trains on."""
    replicas: int
    """Into how many slices the global batch is cut."""
    tp: int
    """Tensor-parallel degree (activations split by it)."""
    sharing: Sharing
    """How the course's estimate divides the parameters' memory."""
    ddp_tally: CommTally | None = None
    """DDP's counting hook's tally; None where the collectives are counted by CollectiveCounter."""


def hybrid_shape(args, env: DistEnv) -> MeshShape | None:
    """dp x tp for the hybrid row (both above 1), or None where this world size has no such layout."""
    tp = args.tp or (env.local_world_size if 1 < env.local_world_size < env.world_size else 2)
    shape = mesh_shape(env.world_size, env.local_world_size, tp=tp)
    if shape.dp < 2 or shape.tp < 2 or layout_problem(shape, env.world_size, args.model, args.batch_size):
        return None
    return shape


def build(name: str, args, ctx, hybrid: MeshShape | None) -> Built:
    n = ctx.world_size
    model = args.model.build(args.seed, ctx.device)
    if name in ("ddp", "ddp-powersgd"):
        ddp = DDP(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb(model, ctx.backend),
        )
        tally = CommTally()
        register_counted_hook(
            ddp,
            "none" if name == "ddp" else "powersgd",
            tally,
            powersgd_rank=args.powersgd_rank,
            start_iter=POWERSGD_START,
        )
        return Built(ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr), ctx.rank, n, 1, Sharing(1, 1, 1), tally)
    if name in ("fsdp-zero2", "fsdp-zero3"):
        zero = 2 if name == "fsdp-zero2" else 3
        model = shard(model, init_device_mesh(ctx.device.type, (n,)), zero, "fp32")
        sharing = Sharing(1, 1 / n, 1 / n) if zero == 2 else Sharing(1 / n, 1 / n, 1 / n)
        return Built(model, torch.optim.AdamW(model.parameters(), lr=args.lr), ctx.rank, n, 1, sharing)
    if name == "tp":
        model = split_blocks(model, init_device_mesh(ctx.device.type, (n,)))
        return Built(model, torch.optim.AdamW(model.parameters(), lr=args.lr), 0, 1, n, Sharing(1 / n, 1 / n, 1 / n))
    if hybrid is None:
        raise ValueError(f"hybrid: no dp x tp layout with both above 1 on {n} ranks")
    mesh = build_mesh(hybrid, ctx.device)
    model = shard(split_blocks(model, mesh["tp"]), mesh["dp"], zero=3, precision="fp32")
    return Built(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        mesh["dp"].get_local_rank(),
        hybrid.dp,
        hybrid.tp,
        Sharing(1 / n, 1 / n, 1 / n),
    )


def train_on(built: Built, batches: Batches, step: int, device: torch.device, forward_context=None) -> torch.Tensor:
    """One optimizer step of `built` on its slice of global batch `step`."""
    inputs, targets = batches.replica_batch(step, built.replica, built.replicas, device)
    return train_step(built.model, built.optimizer, inputs, targets, forward_context)


def measure(name: str, args, ctx, batches: Batches, hybrid: MeshShape | None) -> dict:
    """Warm up, time, then one step counted and one measured; the figures of the fullest rank."""
    built = build(name, args, ctx, hybrid)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(args.warmup):
        train_on(built, batches, step, ctx.device)
    seconds = []
    for step in range(args.warmup, args.warmup + args.steps):
        _, step_s = timed(partial(train_on, built, batches, step, ctx.device), ctx.device)
        seconds.append(step_s)
    counted, measured = args.warmup + args.steps, args.warmup + args.steps + 1
    counter = CollectiveCounter()
    if built.ddp_tally is not None:
        built.ddp_tally.reset()
        train_on(built, batches, counted, ctx.device)
    else:
        with counter:
            train_on(built, batches, counted, ctx.device)
    sent = (built.ddp_tally or counter.tally).sent_bytes
    saved = SavedForBackward(built.model)
    train_on(built, batches, measured, ctx.device, saved)
    figures = {
        "memory": breakdown(built.model, built.optimizer, saved),
        "sent_bytes": sent,
        "step_s": sum(seconds) / len(seconds),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None,
    }
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, figures)
    local_batch = args.batch_size // built.replicas
    estimate = course_estimate_bytes(
        args.model.parameter_count(),
        built.sharing,
        activation_estimate_bytes(
            local_batch, args.model.seq_len, args.model.d_model, args.model.n_layers, args.model.vocab, built.tp
        ),
    )
    del built  # and collect its reference cycles (hooks, meshes): the next strategy's peak is its own
    gc.collect()
    return fullest(name, everyone, estimate)


def fullest(name: str, everyone: list[dict], estimate_bytes: int) -> dict:
    """Each figure as its largest over the ranks: the rank that runs out of memory first, the slowest."""
    memory = MemoryBreakdown(
        *(
            max(getattr(f["memory"], field) for f in everyone)
            for field in (
                "parameters_bytes",
                "gathered_bytes",
                "gradients_bytes",
                "optimizer_bytes",
                "activations_bytes",
            )
        )
    )
    peaks = [f["peak_cuda_bytes"] for f in everyone if f["peak_cuda_bytes"] is not None]
    return {
        "strategy": name,
        "memory": memory.as_dict(),
        "estimate_bytes": estimate_bytes,
        "sent_bytes_per_step": max(f["sent_bytes"] for f in everyone),
        "ms_per_step": max(f["step_s"] for f in everyone) * 1000,
        "peak_cuda_bytes": max(peaks) if peaks else None,
    }


def table(rows: list[dict], title: str) -> str:
    gpu = any(r["peak_cuda_bytes"] is not None for r in rows)
    columns = [
        "strategy",
        "parameters",
        "gathered",
        "gradients",
        "optimizer",
        "activations",
        "total",
        "course estimate",
        "sent/step",
        "ms/step",
    ] + (["peak CUDA"] if gpu else [])
    lines = []
    for r in rows:
        m = r["memory"]
        cells = [
            r["strategy"],
            *(
                format_bytes(m[k])
                for k in (
                    "parameters_bytes",
                    "gathered_bytes",
                    "gradients_bytes",
                    "optimizer_bytes",
                    "activations_bytes",
                    "total_bytes",
                )
            ),
            format_bytes(r["estimate_bytes"]),
            format_bytes(r["sent_bytes_per_step"]),
            f"{r['ms_per_step']:.1f}",
        ]
        lines.append(cells + ([format_bytes(r["peak_cuda_bytes"] or 0)] if gpu else []))
    return render_table(title, columns, lines)


def plot(path: Path, rows: list[dict], title: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    names = [r["strategy"] for r in rows]
    figure, (memory_axes, comm_axes, time_axes) = plt.subplots(1, 3, figsize=(15, 4.5))
    left = [0.0] * len(rows)
    for key, label in (
        ("parameters_bytes", "parameters"),
        ("gathered_bytes", "gathered"),
        ("gradients_bytes", "gradients"),
        ("optimizer_bytes", "optimizer"),
        ("activations_bytes", "activations"),
    ):
        widths = [r["memory"][key] / 2**20 for r in rows]
        memory_axes.barh(names, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    memory_axes.scatter(
        [r["estimate_bytes"] / 2**20 for r in rows], names, marker="x", color="black", zorder=3, label="course estimate"
    )
    memory_axes.set(xlabel="MiB per rank", title="memory (fullest rank)")
    memory_axes.invert_yaxis()
    memory_axes.legend(fontsize=7)
    comm_axes.barh(names, [r["sent_bytes_per_step"] / 2**20 for r in rows])
    comm_axes.set(xlabel="MiB sent per rank per step", title="communication")
    comm_axes.invert_yaxis()
    time_axes.barh(names, [r["ms_per_step"] for r in rows])
    time_axes.set(xlabel="ms per step", title="step time")
    time_axes.invert_yaxis()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"plot: {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    problem = layout_problem(
        MeshShape(env.world_size, 1), env.world_size, args.model, args.batch_size
    ) or layout_problem(MeshShape(1, env.world_size), env.world_size, args.model, args.batch_size)
    if problem:
        fail(problem, code=2)
    hybrid = hybrid_shape(args, env)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        batches = Batches(args.model, args.batch_size, args.seed)
        title = f"{args.model.describe()}; global batch {args.batch_size}, {ctx.world_size} ranks ({ctx.backend})"
        rows = []
        for name in args.strategies:
            if name == "hybrid" and hybrid is None:
                print0(f"hybrid: skipped, no dp x tp layout with both above 1 on {ctx.world_size} ranks (try 4)")
                continue
            rows.append(measure(name, args, ctx, batches, hybrid))
            label = f"hybrid dp({hybrid.dp}) x tp({hybrid.tp})" if name == "hybrid" and hybrid else name
            rows[-1]["strategy"] = label
            print0(
                f"{label}: {rows[-1]['ms_per_step']:.1f} ms/step, {format_bytes(rows[-1]['memory']['total_bytes'])} "
                "on the fullest rank"
            )
        print0(table(rows, title))
        if ctx.is_rank0:
            report = {
                "world_size": ctx.world_size,
                "backend": ctx.backend,
                "model": vars(args.model),
                "batch_size": args.batch_size,
                "strategies": rows,
            }
            print(f"results: {write_json(report, results_path(args.json, RESULTS_JSON))}", flush=True)
            print(plot(results_path(args.plot, RESULTS_PNG), rows, title), flush=True)
        MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write("summary", example="compare_strategies", strategies=rows)
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
