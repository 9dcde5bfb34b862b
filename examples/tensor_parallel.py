"""torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py
fab tensor-parallel --nproc-per-node 2

Tensor parallelism (Megatron-style, torch's `parallelize_module` over a 1-D device mesh): where FSDP
splits the batch and gathers whole weights, this splits each block's matrices and never gathers them.
q, k, v and the MLP's first layer are split column-wise, so each rank computes n_heads/N whole heads
and 4d/N of the MLP's hidden units from the whole input; `proj` and the MLP's second layer are split
row-wise, so each rank holds a partial sum of the block's output and one all-reduce adds them up.
That is two all-reduces per block forward and, for the gradient of the split layers' input, one per
column-wise layer in backward. Every rank sees the same batch; norms, embeddings and the head stay
whole on every rank.

The collectives of one training step are counted with CommDebugMode and printed as a table, with the
bytes they carry. `--check` compares the split model's outputs and gradients with the unsplit model.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
)
from harness.checks import gradient, max_abs_diff, report_check
from harness.comm_bytes import CollectiveCounter
from harness.cost import CostMeter
from harness.dist import DistEnv, cleanup, fail, init_distributed, print0, run
from harness.memory import format_bytes
from harness.metrics import MetricsWriter, StepLogger
from harness.models import TinyTransformerLM, loss_fn
from harness.parallel import (
    Batches,
    MeshShape,
    ModelConfig,
    add_model_arguments,
    layout_problem,
    mean_over_ranks,
    model_config,
    timed,
    train_step,
)
from harness.preemption import Preemption
from harness.sharded_checkpoint import ShardedCheckpointer, add_checkpoint_arguments, checkpoint_root

DEFAULT_MODEL = ModelConfig(vocab=64, seq_len=32, d_model=128, n_heads=4, n_layers=2)
TOLERANCE = 1e-5  # the split model sums the same products in another order

# Which way each of a block's layers is split. Column-wise layers take the whole input and return
# their slice of the features; row-wise layers take a slice and return a partial sum, all-reduced.
TP_PLAN = {
    "q": ColwiseParallel(),
    "k": ColwiseParallel(),
    "v": ColwiseParallel(),
    "proj": RowwiseParallel(),
    "mlp.0": ColwiseParallel(),
    "mlp.2": RowwiseParallel(),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    add_model_arguments(parser, DEFAULT_MODEL)
    add_training_arguments(
        parser, steps=20, batch_size=8, batch_help="sequences per step, the same on every rank", lr=3e-3
    )
    add_checkpoint_arguments(parser)
    add_run_arguments(parser, log_every=5, check="compare outputs and gradients with the unsplit model")
    args = parser.parse_args(argv)
    args.model = model_config(args, parser)
    return args


def split_blocks(model: TinyTransformerLM, mesh) -> TinyTransformerLM:
    """Split every block's attention and MLP over `mesh` (its ranks share a node in a hybrid job)."""
    for block in model.blocks:
        parallelize_module(block, mesh, TP_PLAN)
    return model


def build(args, ctx) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = split_blocks(args.model.build(args.seed, ctx.device), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def collective_table(counter: CollectiveCounter) -> str:
    """CommDebugMode's counts, forward and backward, with the bytes each kind carried."""
    counts = counter.comm_module_counts["Global"]
    kinds = sorted({str(op) for op in [*counts["forward"], *counts["backward"]]})
    lines = [f"{'collective':<32} {'forward':>8} {'backward':>9}"]
    for kind in kinds:
        forward = sum(n for op, n in counts["forward"].items() if str(op) == kind)
        backward = sum(n for op, n in counts["backward"].items() if str(op) == kind)
        lines.append(f"{kind:<32} {forward:>8} {backward:>9}")
    for op, tally in counter.tally.ops.items():
        lines.append(
            f"{op}: {tally.calls} calls, {format_bytes(tally.size_bytes)} in all, "
            f"{format_bytes(tally.sent_bytes)} sent per rank (ring)"
        )
    return "\n".join(lines)


def check(args, ctx, batches: Batches) -> int:
    """One forward and backward pass, split and unsplit: the logits and every gradient must agree."""
    model, _ = build(args, ctx)
    reference = args.model.build(args.seed, ctx.device)
    inputs, targets = batches.replica_batch(0, 0, 1, ctx.device)
    logits, reference_logits = model(inputs), reference(inputs)
    loss_fn(logits, targets).backward()
    loss_fn(reference_logits, targets).backward()
    worst = max_abs_diff(logits, reference_logits)
    split = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        split_gradient = gradient(split[name])
        whole = split_gradient.full_tensor() if isinstance(split_gradient, DTensor) else split_gradient
        worst = max(worst, max_abs_diff(whole, gradient(parameter)))
    what = f"tensor parallel over {ctx.world_size} ranks vs the unsplit model, outputs and gradients,"
    return report_check(what, worst, TOLERANCE, ctx.device)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    problem = layout_problem(MeshShape(1, env.world_size), env.world_size, args.model, args.batch_size)
    if problem:
        fail(problem, code=2)
    preemption = Preemption()  # SIGUSR1 (a spot notice): save at the next step and exit
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        batches = Batches(args.model, args.batch_size, args.seed)
        if args.check:
            return check(args, ctx, batches)
        model, optimizer = build(args, ctx)
        print0(
            f"{args.model.describe()}; tensor parallel over {ctx.world_size} ranks ({ctx.backend}), "
            f"batch {args.batch_size} on every rank"
        )
        root = checkpoint_root(args.checkpoint_dir, ctx.env.shared_dir, ctx.env.run_dir)
        checkpointer = ShardedCheckpointer(root, args.async_save) if root else None
        save = partial(checkpointer.save, model=model, optimizer=optimizer) if checkpointer else None
        start, _ = checkpointer.load_latest(model, optimizer) if checkpointer else (0, 0)
        if start:
            print0(f"resumed from step {start} ({root})")
        counter = CollectiveCounter()
        with counter:  # the first step trained here, counted
            inputs, targets = batches.replica_batch(start, 0, 1, ctx.device)
            train_step(model, optimizer, inputs, targets)
        print0(f"collectives in one training step (CommDebugMode; {args.model.n_layers} blocks):")
        print0(collective_table(counter))
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size)
        for step in range(start + 1, args.steps):
            inputs, targets = batches.replica_batch(step, 0, 1, ctx.device)
            loss, seconds = timed(partial(train_step, model, optimizer, inputs, targets), ctx.device)
            done = step + 1 == args.steps
            log = done or (step + 1) % args.log_every == 0
            logger.step(step + 1, mean_over_ranks(loss) if log else 0.0, seconds, log=log)
            # Periodic saves only where asked (--checkpoint-dir): this lab measures; a notice saves regardless.
            due = args.checkpoint_dir is not None and (done or (step + 1) % args.checkpoint_every == 0)
            if preemption.step_ended(step + 1, done, due, save, ctx.device):
                break  # a spot notice: every rank stopped at this step, saved
        if checkpointer:
            checkpointer.wait()
        if preemption.stopped_at is not None:
            print0(preemption.line(root))
            return 0
        metrics.write(
            "summary",
            example="tensor_parallel",
            world_size=ctx.world_size,
            steps=args.steps,
            collectives={op: vars(t) for op, t in counter.tally.ops.items()},
            usd=meter.usd_so_far(),
        )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
