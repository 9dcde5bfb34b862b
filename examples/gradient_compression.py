"""torchrun --standalone --nproc-per-node 2 examples/gradient_compression.py --hook powersgd --rank 2
fab compress --args "--hook fp16"

Gradient compression with DDP communication hooks. DDP hands every gradient bucket to a hook, and the
hook decides what crosses the wire: `--hook fp16` all-reduces the bucket in half precision (half the
bytes); `--hook powersgd` all-reduces a rank-r approximation of each gradient matrix, two thin
matrices P (m x r) and Q (n x r) instead of m x n, and feeds the error it made back into the next
step (plain all-reduce for the first `--start-iter` steps). `--hook bf16` needs NCCL (GPUs).

The job trains the uncompressed run (`none`) and then the chosen hook, from the same weights on the
same batches, and prints for each the bytes per optimizer step (counted as the hook issues its
all-reduces, by the counting process group it is given), the loss at equal steps and ms/step.
`--check` runs none, fp16 and powersgd and fails unless fp16's loss stays within 0.001 of the
uncompressed loss at every step and PowerSGD sends at least 4x fewer bytes.
"""

import argparse
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
    positive_int,
)
from harness.checks import report_check
from harness.comm_bytes import HOOKS, CommTally, bf16_problem, bucket_cap_mb, register_counted_hook
from harness.cost import CostMeter
from harness.dist import DistEnv, cleanup, fail, init_distributed, pick_device, print0, run
from harness.memory import format_bytes
from harness.metrics import MetricsWriter, StepLogger
from harness.parallel import (
    Batches,
    ModelConfig,
    add_model_arguments,
    mean_over_ranks,
    model_config,
    timed,
    train_step,
)

DEFAULT_MODEL = ModelConfig(vocab=64, seq_len=32, d_model=128, n_heads=4, n_layers=2)
LOSS_TOLERANCE = 1e-3  # fp16 gradients moved the loss by about 1e-5 over 20 steps here
MIN_COMPRESSION = 4.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--hook", choices=HOOKS, default="powersgd", help="what DDP sends (default powersgd)")
    parser.add_argument("--rank", type=positive_int, default=1, help="PowerSGD's approximation rank r (default 1)")
    parser.add_argument(
        "--start-iter",
        type=positive_int,
        default=2,
        help="PowerSGD compresses from this step on, plain all-reduce before (default 2, at least 2)",
    )
    add_model_arguments(parser, DEFAULT_MODEL)
    add_training_arguments(
        parser,
        steps=20,
        steps_help="optimizer steps per hook",
        batch_size=16,
        batch_help="sequences per global batch, split over the ranks",
        lr=3e-3,
    )
    add_run_arguments(parser, log_every=5, check="compare fp16 and powersgd with none; one line, exit 0/1")
    args = parser.parse_args(argv)
    if args.start_iter < 2:
        parser.error("--start-iter must be at least 2: PowerSGD's error feedback starts from a plain step")
    args.model = model_config(args, parser)
    return args


@dataclass
class HookRun:
    """One hook's run."""

    hook: str
    """none, fp16, bf16 or powersgd."""
    losses: list[float]
    """The global batch's loss at every step."""
    size_bytes: int
    """What the hook handed to all-reduce in the last step (all-reduced tensor sizes)."""
    sent_bytes: float
    """What each rank sent for it in a ring, 2(n-1)/n x the size."""
    ms_per_step: float
    """Mean step time after the first step."""


def build(args, ctx, hook: str) -> tuple[DDP, torch.optim.Optimizer, CommTally]:
    model = args.model.build(args.seed, ctx.device)
    ddp = DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb(model, ctx.backend),
    )
    tally = CommTally()
    register_counted_hook(ddp, hook, tally, powersgd_rank=args.rank, start_iter=args.start_iter)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr), tally


def train(args, ctx, hook: str, batches: Batches, logger: StepLogger | None) -> HookRun:
    ddp, optimizer, tally = build(args, ctx, hook)
    losses: list[torch.Tensor] = []
    step_times: list[float] = []
    for step in range(args.steps):
        inputs, targets = batches.replica_batch(step, ctx.rank, ctx.world_size, ctx.device)
        tally.reset()  # what is left in it after the loop is the last step's traffic
        loss, seconds = timed(partial(train_step, ddp, optimizer, inputs, targets), ctx.device)
        losses.append(loss)
        step_times.append(seconds)
        log = logger is not None and (step + 1 == args.steps or (step + 1) % args.log_every == 0)
        if logger is not None:
            logger.step(step + 1, mean_over_ranks(loss) if log else 0.0, seconds, log=log)
    global_losses = torch.stack(losses).float()
    torch.distributed.all_reduce(global_losses)
    later = step_times[1:] or step_times
    return HookRun(
        hook,
        (global_losses / ctx.world_size).tolist(),
        tally.size_bytes,
        tally.sent_bytes,
        sum(later) / len(later) * 1000,
    )


def table(runs: list[HookRun]) -> str:
    baseline = runs[0]
    lines = [f"{'hook':<10} {'size/step':>11} {'sent/rank':>11} {'fewer bytes':>11} {'loss':>9} {'ms/step':>8}"]
    for r in runs:
        fewer = baseline.size_bytes / r.size_bytes if r.size_bytes else float("inf")
        lines.append(
            f"{r.hook:<10} {format_bytes(r.size_bytes):>11} {format_bytes(r.sent_bytes):>11} "
            f"{fewer:>10.1f}x {r.losses[-1]:>9.4f} {r.ms_per_step:>8.1f}"
        )
    return "\n".join(lines)


def check(args, ctx, batches: Batches) -> int:
    none, fp16, powersgd = (train(args, ctx, hook, batches, None) for hook in ("none", "fp16", "powersgd"))
    worst = max(abs(a - b) for a, b in zip(none.losses, fp16.losses, strict=True))
    fewer = none.size_bytes / max(powersgd.size_bytes, 1)
    what = (
        f"fp16 loss vs uncompressed over {args.steps} steps, PowerSGD rank {args.rank} sending "
        f"{fewer:.1f}x fewer bytes (at least {MIN_COMPRESSION:g}x),"
    )
    return report_check(what, worst, LOSS_TOLERANCE, ctx.device, holds=fewer >= MIN_COMPRESSION)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    problem = bf16_problem(args.hook, pick_device(env.local_rank)[1])
    if problem or args.batch_size % env.world_size:
        fail(problem or f"--batch-size {args.batch_size} must split evenly over {env.world_size} ranks", code=2)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        batches = Batches(args.model, args.batch_size, args.seed)
        if args.check:
            return check(args, ctx, batches)
        print0(
            f"{args.model.describe()}; DDP on {ctx.world_size} ranks ({ctx.backend}), global batch {args.batch_size}"
        )
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        runs = []
        for hook in dict.fromkeys(("none", args.hook)):
            print0(f"hook {hook}:")
            runs.append(
                train(args, ctx, hook, batches, StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size))
            )
        print0(
            f"per optimizer step, counted as the hook issued its all-reduces ({ctx.world_size} ranks; "
            "sent/rank is what a ring sends, 2(n-1)/n x the size):"
        )
        print0(table(runs))
        metrics.write(
            "summary",
            example="gradient_compression",
            world_size=ctx.world_size,
            rank=args.rank,
            runs=[asdict(r) for r in runs],
            usd=meter.usd_so_far(),
        )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
