"""torchrun --standalone --nproc-per-node 2 examples/fsdp_training.py --zero 3
fab fsdp --args "--zero 2 --mixed-precision bf16 --checkpoint-dir ckpt/fsdp"

Fully sharded data parallel (FSDP2's `fully_shard`), the course's ZeRO. Where DDP keeps the whole
model, its gradients and Adam's two moments on every rank, each rank here keeps 1/N of them and
all-gathers a block's weights just before it computes (one block at a time), then reduce-scatters
its gradients so every rank gets the summed gradient of its own shard. `--zero 3` frees the gathered
weights after forward and gathers them again for backward (`reshard_after_forward=True`); `--zero 2`
keeps them until backward: less communication, more memory. `--mixed-precision bf16` computes with
bf16 weights while the shards and the optimizer stay fp32.

At the end every rank's bytes for parameters, gradients and optimizer state are printed, measured
from its local shards, next to DDP's for the same model (the same tensors, whole): about 1/N.
`--check` trains DDP beside it on the same batches and compares losses and parameters.

Checkpoints are sharded (torch.distributed.checkpoint): every rank writes its shards into
`--checkpoint-dir` (relative: inside `$CLUSTER_SHARED_DIR`), a commit marker last (`--async-save` writes
while training goes on). A run started with the same `--checkpoint-dir` resumes from the newest
committed checkpoint, on any number of ranks: saved by 4, it loads on 2.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
)
from harness.checks import report_check
from harness.cost import CostMeter
from harness.dist import DistEnv, cleanup, fail, init_distributed, print0, run
from harness.memory import MemoryBreakdown, SavedForBackward, breakdown, format_bytes, whole_breakdown
from harness.metrics import MetricsWriter, StepLogger
from harness.models import TinyTransformerLM
from harness.parallel import (
    Batches,
    ModelConfig,
    add_model_arguments,
    digest,
    full_parameters,
    max_parameter_diff,
    mean_over_ranks,
    model_config,
    timed,
    train_step,
)
from harness.preemption import Preemption
from harness.sharded_checkpoint import ShardedCheckpointer, add_checkpoint_arguments, checkpoint_root

DEFAULT_MODEL = ModelConfig(vocab=64, seq_len=32, d_model=128, n_heads=4, n_layers=2)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp32 FSDP and DDP differ only in the order of summation; with 16-bit weights they differ by rounding.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument(
        "--zero",
        type=int,
        choices=(2, 3),
        default=3,
        help="3: free gathered weights after forward; 2: keep them until backward (default 3)",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=PRECISIONS,
        default="fp32",
        help="weights' dtype in forward and backward; shards and Adam stay fp32 (default fp32)",
    )
    add_model_arguments(parser, DEFAULT_MODEL)
    add_training_arguments(
        parser,
        steps=20,
        steps_help="train up to this step",
        batch_size=16,
        batch_help="sequences per global batch, split over the ranks",
        lr=3e-3,
    )
    add_checkpoint_arguments(parser)
    add_run_arguments(parser, log_every=5, check="compare losses and parameters with DDP; one line, exit 0/1")
    args = parser.parse_args(argv)
    args.model = model_config(args, parser)
    return args


def shard(model: TinyTransformerLM, mesh, zero: int, precision: str) -> TinyTransformerLM:
    """Shard each block (its weights are gathered together, one block at a time), then the rest."""
    # fp32 keeps the parameters' own dtype throughout (a float64 check's too); 16-bit reduces in float32
    reduce_dtype = None if PRECISIONS[precision] is None else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy)
    return model  # sharded in place: the same module, now also an FSDPModule


def build(args, ctx) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = shard(args.model.build(args.seed, ctx.device), mesh, args.zero, args.mixed_precision)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train(
    args, ctx, model, optimizer, batches: Batches, start: int, checkpointer, logger, preemption: Preemption
) -> SavedForBackward:
    """Steps start+1..args.steps; the last one's forward pass is measured."""
    saved = SavedForBackward(model)
    save = partial(checkpointer.save, model=model, optimizer=optimizer) if checkpointer else None
    for step in range(start, args.steps):
        inputs, targets = batches.replica_batch(step, ctx.rank, ctx.world_size, ctx.device)
        measure = saved if step + 1 == args.steps else None
        loss, seconds = timed(partial(train_step, model, optimizer, inputs, targets, measure), ctx.device)
        done = step + 1 == args.steps
        log = done or (step + 1) % args.log_every == 0
        logger.step(step + 1, mean_over_ranks(loss) if log else 0.0, seconds, log=log)
        due = done or (step + 1) % args.checkpoint_every == 0
        if preemption.step_ended(step + 1, done, due, save, ctx.device):
            break  # a spot notice: every rank stopped at this step, saved
    if checkpointer:
        checkpointer.wait()
    return saved


def memory_table(everyone: list[MemoryBreakdown], ddp: MemoryBreakdown) -> str:
    columns = ("parameters", "gathered", "gradients", "optimizer", "activations", "total")
    lines = [f"{'rank':>6} " + " ".join(f"{c:>12}" for c in columns)]
    for name, figures in [*enumerate(everyone), ("DDP", ddp)]:
        values = (
            figures.parameters_bytes,
            figures.gathered_bytes,
            figures.gradients_bytes,
            figures.optimizer_bytes,
            figures.activations_bytes,
            figures.total_bytes,
        )
        lines.append(f"{name:>6} " + " ".join(f"{format_bytes(v):>12}" for v in values))
    sharded = max(f.parameters_bytes + f.gradients_bytes + f.optimizer_bytes for f in everyone)
    whole = ddp.parameters_bytes + ddp.gradients_bytes + ddp.optimizer_bytes
    lines.append(
        f"sharded state (parameters + gradients + optimizer) on the fullest rank: {sharded / whole:.3f} "
        f"of DDP's (1/N = {1 / len(everyone):.3f})"
    )
    return "\n".join(lines)


def check(args, ctx, batches: Batches) -> int:
    """FSDP and DDP from the same weights on the same batches: losses at every step, parameters at the end."""
    model, optimizer = build(args, ctx)
    reference = DDP(
        args.model.build(args.seed, ctx.device), device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
    )
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    worst = 0.0
    for step in range(args.steps):
        inputs, targets = batches.replica_batch(step, ctx.rank, ctx.world_size, ctx.device)
        sharded_loss = train_step(model, optimizer, inputs, targets)
        ddp_loss = train_step(reference, reference_optimizer, inputs, targets)
        worst = max(worst, abs(mean_over_ranks(sharded_loss) - mean_over_ranks(ddp_loss)))
    worst = max(worst, max_parameter_diff(full_parameters(model), full_parameters(reference)))
    what = f"FSDP ZeRO-{args.zero} ({args.mixed_precision}) vs DDP, losses and parameters over {args.steps} steps,"
    return report_check(what, worst, TOLERANCE[args.mixed_precision], ctx.device)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    if args.batch_size % env.world_size:
        fail(f"--batch-size {args.batch_size} must split evenly over {env.world_size} ranks", code=2)
    preemption = Preemption()  # SIGUSR1 (a spot notice): save at the next step and exit
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        batches = Batches(args.model, args.batch_size, args.seed)
        if args.check:
            return check(args, ctx, batches)
        model, optimizer = build(args, ctx)
        root = checkpoint_root(args.checkpoint_dir, ctx.env.shared_dir, ctx.env.run_dir)
        checkpointer = ShardedCheckpointer(root, args.async_save) if root else None
        start, saved_by = checkpointer.load_latest(model, optimizer) if checkpointer else (0, 0)
        print0(
            f"{args.model.describe()}; FSDP ZeRO-{args.zero} on {ctx.world_size} ranks ({ctx.backend}), "
            f"{args.mixed_precision}, global batch {args.batch_size}"
        )
        if start:
            print0(f"resumed from step {start} ({root}), saved by {saved_by} ranks, loaded onto {ctx.world_size}")
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size)
        saved = train(args, ctx, model, optimizer, batches, start, checkpointer, logger, preemption)
        if preemption.stopped_at is not None:
            print0(preemption.line(root))
            return 0
        summary = {
            "example": "fsdp_training",
            "zero": args.zero,
            "precision": args.mixed_precision,
            "world_size": ctx.world_size,
            "steps": args.steps,
            "resumed_from": start,
        }
        if start < args.steps:
            everyone: list = [None] * ctx.world_size
            dist.all_gather_object(everyone, breakdown(model, optimizer, saved))
            ddp = whole_breakdown(model, optimizer, saved.activations_bytes)
            print0("bytes held per rank, from the local shards (DDP: the same tensors, whole, on every rank):")
            print0(memory_table(everyone, ddp))
            summary.update(memory_per_rank=[m.as_dict() for m in everyone], ddp_memory=ddp.as_dict())
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
