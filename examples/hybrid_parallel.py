"""torchrun --standalone --nproc-per-node 4 examples/hybrid_parallel.py --dp 2 --tp 2
fab hybrid --nproc-per-node 2

Hybrid (2-D) parallelism, the course's third challenge, on a dp x tp device mesh: tensor parallelism
splits every block over the tp ranks of a node (its all-reduces, two per block each way, stay on the
node's fast links) and FSDP shards each replica over the dp ranks across nodes (an all-gather and a
reduce-scatter per block per step cross the network). It is tensor_parallel.py's `split_blocks` on
mesh["tp"], then fsdp_training.py's `shard` on mesh["dp"]; each replica trains on its slice of the
global batch.

By default tp is the number of ranks on a node and dp the number of nodes; `--dp` and `--tp` set them,
and a layout that does not multiply to the world size is refused with the whole picture, e.g.
`dp(2) x tp(2) = 4 != WORLD_SIZE(3)`. The default "medium" transformer trains on 4 CPU ranks in under
a minute; the README gives a size for GPUs.

`--check` trains the layout and a single-process reference (on rank 0) in float64, from the same seed
on the same batches, and compares the losses of every step and the parameters at the end. In float32 the
layout's sums in another order round differently, and AdamW divides each gradient entry by its own
magnitude, so an entry about as small as its eps moves by a part of `lr` that its last bits decide: how
far depends on the CPU's kernels. In float64 that drift is some 1e-13 on any CPU, far below `TOLERANCE`,
while a split that is wrong (a replica trained on another's slice, a block not reduced) moves parameters
by a part of `lr` (about 1e-4 or more).

Checkpoints as in fsdp_training.py (`--checkpoint-dir`, `--async-save`): saved on a 2 x 2 mesh, they
load on 1 x 2.
"""

import argparse
import contextlib
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from examples.fsdp_training import shard
from examples.tensor_parallel import split_blocks
from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
    positive_int,
)
from harness.checks import report_check
from harness.comm_bytes import CollectiveCounter
from harness.cost import CostMeter
from harness.dist import DistEnv, cleanup, fail, init_distributed, print0, run
from harness.memory import SavedForBackward, breakdown, format_bytes
from harness.metrics import MetricsWriter, StepLogger
from harness.parallel import (
    Batches,
    MeshShape,
    ModelConfig,
    add_model_arguments,
    build_mesh,
    digest,
    full_parameters,
    layout_problem,
    max_parameter_diff,
    mean_over_ranks,
    mesh_shape,
    model_config,
    timed,
    train_step,
)
from harness.preemption import Preemption
from harness.sharded_checkpoint import ShardedCheckpointer, add_checkpoint_arguments, checkpoint_root

DEFAULT_MODEL = ModelConfig(vocab=128, seq_len=32, d_model=256, n_heads=8, n_layers=4)
# float64 rounding reordered (eps 2.2e-16 over a few thousand summands, through AdamW's division by eps 1e-8)
# stays under 1e-10; one step of a wrong split moves parameters by a part of lr 3e-3.
TOLERANCE = 1e-8
CHECK_DTYPE = torch.float64


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--dp", type=positive_int, default=None, help="data-parallel replicas (default: the nodes)")
    parser.add_argument(
        "--tp", type=positive_int, default=None, help="tensor-parallel ranks per replica (default: the ranks on a node)"
    )
    add_model_arguments(parser, DEFAULT_MODEL)
    add_training_arguments(
        parser,
        steps=10,
        steps_help="train up to this step",
        batch_size=16,
        batch_help="sequences per global batch, split over the dp replicas",
        lr=3e-3,
    )
    add_checkpoint_arguments(parser)
    add_run_arguments(parser, log_every=5, check="compare with a single-process reference; one line, exit 0/1")
    args = parser.parse_args(argv)
    args.model = model_config(args, parser)
    return args


def build(args, ctx, shape: MeshShape, dtype: torch.dtype = torch.float32):
    mesh = build_mesh(shape, ctx.device)
    model = args.model.build(args.seed, ctx.device).to(dtype)
    model = shard(split_blocks(model, mesh["tp"]), mesh["dp"], zero=3, precision="fp32")
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr), mesh


def layout(ctx, mesh, shape: MeshShape) -> str:
    """Which ranks form each replica and on which nodes they run; a replica spanning nodes is named."""
    node = os.environ.get("CLUSTER_NODE", f"node-{ctx.env.node_rank}")
    nodes: list = [None] * ctx.world_size
    dist.all_gather_object(nodes, node)
    lines = [f"mesh dp({shape.dp}) x tp({shape.tp}):"]
    for replica in range(shape.dp):
        ranks = list(range(replica * shape.tp, (replica + 1) * shape.tp))
        on = sorted({nodes[r] for r in ranks})
        note = "" if len(on) == 1 else "  (spans nodes: its per-layer all-reduces cross the network)"
        lines.append(f"  replica {replica}: ranks {', '.join(map(str, ranks))} on {', '.join(on)}{note}")
    return "\n".join(lines)


def single_process(args, ctx, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The whole model and its optimizer in one process: what the dp x tp layout must reproduce."""
    reference = args.model.build(args.seed, ctx.device).to(dtype)
    return reference, torch.optim.AdamW(reference.parameters(), lr=args.lr)


def check(args, ctx, shape: MeshShape, batches: Batches) -> int:
    """Hybrid vs one process training the whole model on the whole global batch (on rank 0), both in
    float64, so that only a wrong split (not the CPU's rounding) can tell them apart."""
    model, optimizer, mesh = build(args, ctx, shape, CHECK_DTYPE)
    replica = mesh["dp"].get_local_rank()
    reference = single_process(args, ctx, CHECK_DTYPE) if ctx.is_rank0 else None
    worst = 0.0
    for step in range(args.steps):
        inputs, targets = batches.replica_batch(step, replica, shape.dp, ctx.device)
        loss = mean_over_ranks(train_step(model, optimizer, inputs, targets))
        if reference is not None:
            inputs, targets = batches.replica_batch(step, 0, 1, ctx.device)
            worst = max(worst, abs(loss - train_step(*reference, inputs, targets).item()))
    whole = full_parameters(model, CHECK_DTYPE)
    if reference is not None:
        worst = max(worst, max_parameter_diff(whole, full_parameters(reference[0], CHECK_DTYPE)))
    what = f"dp({shape.dp}) x tp({shape.tp}) vs one process in float64, losses and parameters over {args.steps} steps,"
    return report_check(what, worst, TOLERANCE, ctx.device)


def train(
    args, ctx, model, optimizer, replica: int, shape: MeshShape, batches, start, checkpointer, logger, preemption
):
    """Steps start+1..args.steps; the first one is measured (memory and collectives), as it pays for
    warming up anyway: the steps the lines show are not slowed by the counting."""
    saved, counter = SavedForBackward(model), CollectiveCounter()
    save = partial(checkpointer.save, model=model, optimizer=optimizer) if checkpointer else None
    for step in range(start, args.steps):
        inputs, targets = batches.replica_batch(step, replica, shape.dp, ctx.device)
        first, done = step == start, step + 1 == args.steps
        with counter if first else contextlib.nullcontext():
            loss, seconds = timed(
                partial(train_step, model, optimizer, inputs, targets, saved if first else None), ctx.device
            )
        log = done or (step + 1) % args.log_every == 0
        logger.step(step + 1, mean_over_ranks(loss) if log else 0.0, seconds, log=log)
        due = done or (step + 1) % args.checkpoint_every == 0
        if preemption.step_ended(step + 1, done, due, save, ctx.device):
            break  # a spot notice: every rank stopped at this step, saved
    if checkpointer:
        checkpointer.wait()
    return saved, counter


def step_report(model, optimizer, saved, counter) -> tuple[str, dict]:
    memory = breakdown(model, optimizer, saved)
    traffic = ", ".join(f"{op} x{t.calls} {format_bytes(t.size_bytes)}" for op, t in counter.tally.ops.items())
    text = (
        f"rank 0 holds parameters {format_bytes(memory.parameters_bytes)}, gradients "
        f"{format_bytes(memory.gradients_bytes)}, optimizer {format_bytes(memory.optimizer_bytes)}, activations "
        f"{format_bytes(memory.activations_bytes)}; one step's collectives: {traffic}; "
        f"{format_bytes(counter.tally.sent_bytes)} sent per rank (ring)"
    )
    return text, {"memory": memory.as_dict(), "sent_bytes_per_step": counter.tally.sent_bytes}


def main(argv=None) -> int:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    shape = mesh_shape(env.world_size, env.local_world_size, args.dp, args.tp)
    problem = layout_problem(shape, env.world_size, args.model, args.batch_size)
    if problem:
        fail(problem, code=2)
    preemption = Preemption()  # SIGUSR1 (a spot notice): save at the next step and exit
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        batches = Batches(args.model, args.batch_size, args.seed)
        if args.check:
            return check(args, ctx, shape, batches)
        model, optimizer, mesh = build(args, ctx, shape)
        print0(f"{args.model.describe()}; {ctx.world_size} ranks ({ctx.backend}), global batch {args.batch_size}")
        print0(layout(ctx, mesh, shape))
        root = checkpoint_root(args.checkpoint_dir, ctx.env.shared_dir, ctx.env.run_dir)
        checkpointer = ShardedCheckpointer(root, args.async_save) if root else None
        start, saved_by = checkpointer.load_latest(model, optimizer) if checkpointer else (0, 0)
        if start:
            print0(f"resumed from step {start} ({root}), saved by {saved_by} ranks, loaded onto {ctx.world_size}")
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size)
        saved, counter = train(
            args,
            ctx,
            model,
            optimizer,
            mesh["dp"].get_local_rank(),
            shape,
            batches,
            start,
            checkpointer,
            logger,
            preemption,
        )
        if preemption.stopped_at is not None:
            print0(preemption.line(root))
            return 0
        summary = {
            "example": "hybrid_parallel",
            "dp": shape.dp,
            "tp": shape.tp,
            "steps": args.steps,
            "resumed_from": start,
        }
        if start < args.steps:
            text, figures = step_report(model, optimizer, saved, counter)
            print0(text)
            summary.update(figures)
        parameters_digest = digest(full_parameters(model))
        print0(
            f"parameters sha256 {parameters_digest[:16]} at step {args.steps} (gathered whole, "
            f"world size {ctx.world_size})"
        )
        metrics.write("summary", **summary, parameter_digest=parameters_digest, usd=meter.usd_so_far())
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
