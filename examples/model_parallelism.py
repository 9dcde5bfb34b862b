"""torchrun --standalone --nproc-per-node 2 examples/model_parallelism.py --schedule 1f1b --micro-batches 8
fab model-parallel --args "--schedule gpipe"

Pipeline (model) parallelism: the model is cut into one stage per rank (so it works with one GPU per
node), each batch into m micro-batches, and activations and gradients travel between neighbouring
ranks with send/recv. GPipe runs all forwards then all backwards; 1F1B interleaves them after a
warm-up and keeps fewer activations alive. The measured bubble (time a stage waits) is printed beside
the theory (p-1)/(m+p-1). `--check` verifies, on one batch, that the staged model's loss and gradients
equal the unsplit model's. `--two-device-split` also runs the course's classic split of one model over
two GPUs of one node (skipped where a node has fewer than two).
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from harness import data
from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
    positive_int,
)
from harness.checks import gradient, max_abs_diff
from harness.cost import CostMeter
from harness.dist import cleanup, init_distributed, print0, run
from harness.metrics import MetricsWriter, StepLogger
from harness.models import loss_fn
from harness.pipeline import (
    SCHEDULES,
    PipelineStage,
    bubble_theory,
    build_full_model,
    measured_bubble,
    schedule_order,
    stage_slice,
)
from harness.preemption import Preemption
from harness.sharded_checkpoint import StageCheckpointer, add_checkpoint_arguments, checkpoint_root

CHECK_TOLERANCE = 1e-5
CLASSES = 10
SAMPLES = 4096


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    parser.add_argument(
        "--micro-batches", "-m", type=positive_int, default=8, help="micro-batches per step (default 8)"
    )
    add_training_arguments(
        parser, steps=20, batch_size=256, batch_help="samples per optimizer step", lr=0.05, lr_help="SGD learning rate"
    )
    parser.add_argument("--width", type=positive_int, default=256, help="layer width (default 256)")
    parser.add_argument(
        "--layers-per-stage", type=positive_int, default=2, help="Linear+ReLU blocks per stage (default 2)"
    )
    parser.add_argument("--two-device-split", action="store_true", help="also run the two-GPU split on node 0")
    add_checkpoint_arguments(parser, async_save=False)  # each stage saves its own layers, synchronously
    add_run_arguments(parser, log_every=5, check="compare loss and gradients with the unsplit model, then exit")
    args = parser.parse_args(argv)
    if args.batch_size > SAMPLES:
        parser.error(f"--batch-size {args.batch_size} is more than the {SAMPLES} samples of the dataset")
    if args.batch_size % args.micro_batches:
        parser.error(f"--batch-size {args.batch_size} must divide into {args.micro_batches} equal micro-batches")
    return args


def batch(dataset, args, step: int, device):
    inputs, targets = dataset
    start = (step * args.batch_size) % (len(inputs) - args.batch_size + 1)
    return inputs[start : start + args.batch_size].to(device), targets[start : start + args.batch_size].to(device)


def make_stage(args, ctx) -> tuple[PipelineStage, nn.Sequential]:
    full = build_full_model(args.width, args.layers_per_stage * ctx.world_size, CLASSES, args.seed)
    module = stage_slice(full, ctx.rank, ctx.world_size).to(ctx.device)
    return PipelineStage(module, ctx.rank, ctx.world_size, ctx.device), full


def check_against_unsplit(args, ctx, dataset) -> int:
    stage, full = make_stage(args, ctx)
    inputs, targets = batch(dataset, args, 0, ctx.device)
    order = schedule_order(args.schedule, ctx.rank, ctx.world_size, args.micro_batches)
    loss, _ = stage.run_step(
        order,
        inputs.chunk(args.micro_batches),
        targets.chunk(args.micro_batches),
        (args.batch_size // args.micro_batches, args.width),
    )
    reference = full.to(ctx.device)
    reference_loss = loss_fn(reference(inputs), targets)
    reference_loss.backward()
    mine = stage_slice(reference, ctx.rank, ctx.world_size)
    grad_diff = max(
        max_abs_diff(gradient(a), gradient(b))
        for a, b in zip(stage.module.parameters(), mine.parameters(), strict=True)
    )
    loss_diff = abs(loss - reference_loss.item()) if stage.last else 0.0
    worst = torch.tensor([grad_diff, loss_diff], device=ctx.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.max().item() <= CHECK_TOLERANCE
    print0(
        f"{args.schedule}, {ctx.world_size} stages, m={args.micro_batches}: staged vs unsplit model: "
        f"loss differs by {worst[1].item():.2e}, gradients by at most {worst[0].item():.2e} "
        f"(tolerance {CHECK_TOLERANCE:g}): {'equal' if ok else 'MISMATCH'}"
    )
    MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write(
        "pipeline_check", schedule=args.schedule, loss_diff=worst[1].item(), grad_diff=worst[0].item(), ok=ok
    )
    return 0 if ok else 1


def train(args, ctx, dataset, preemption: Preemption) -> int:
    stage, _ = make_stage(args, ctx)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=args.lr)
    # Each stage saves its own layers (harness/sharded_checkpoint.py's StageCheckpointer); periodically only
    # where asked (--checkpoint-dir): this lab measures the bubble; a spot notice saves regardless.
    root = checkpoint_root(args.checkpoint_dir, ctx.env.shared_dir, ctx.env.run_dir)
    checkpointer = StageCheckpointer(root) if root else None
    start = checkpointer.load_latest(stage.module, optimizer, ctx.device) if checkpointer else 0
    if start:
        print0(f"resumed from step {start} ({root})")
    save = (lambda step: checkpointer.save(step, stage.module, optimizer)) if checkpointer else None
    order = schedule_order(args.schedule, ctx.rank, ctx.world_size, args.micro_batches)
    meter = CostMeter(ctx.env.hourly_usd)
    metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
    logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size)
    shape = (args.batch_size // args.micro_batches, args.width)
    bubbles, step_times = [], []
    print0(
        f"{ctx.world_size} stages x {args.layers_per_stage} layers of width {args.width}, {args.schedule}, "
        f"m={args.micro_batches} micro-batches of {shape[0]}"
    )
    for step in range(start, args.steps):
        inputs, targets = batch(dataset, args, step, ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss, timing = stage.run_step(order, inputs.chunk(args.micro_batches), targets.chunk(args.micro_batches), shape)
        optimizer.step()
        loss_on_rank0 = torch.tensor([loss], device=ctx.device)
        dist.broadcast(loss_on_rank0, src=ctx.world_size - 1)
        bubble = measured_bubble(timing, ctx.device)
        if step > start:  # the first step pays for warm-up
            bubbles.append(bubble)
            step_times.append(timing.total_s)
        done = step + 1 == args.steps
        logger.step(step + 1, loss_on_rank0.item(), timing.total_s, log=done or (step + 1) % args.log_every == 0)
        due = args.checkpoint_dir is not None and (done or (step + 1) % args.checkpoint_every == 0)
        if preemption.step_ended(step + 1, done, due, save, ctx.device):
            print0(preemption.line(root))
            return 0  # a spot notice: every stage stopped at this step and saved it
    return report(args, ctx, bubbles, step_times, metrics, meter)


def stage_nodes(ctx) -> list[str]:
    """The node each stage (rank) ran on, in stage order."""
    nodes: list = [None] * ctx.world_size
    dist.all_gather_object(nodes, os.environ.get("CLUSTER_NODE", f"node-{ctx.env.node_rank}"))
    return nodes


def report(args, ctx, bubbles, step_times, metrics, meter) -> int:
    theory = bubble_theory(ctx.world_size, args.micro_batches)
    nodes = stage_nodes(ctx)
    print0("stages: " + ", ".join(f"{stage} on {node}" for stage, node in enumerate(nodes)))
    measured = sum(bubbles) / len(bubbles) if bubbles else float("nan")
    samples_per_s = args.batch_size / (sum(step_times) / len(step_times)) if step_times else float("nan")
    print0(f"bubble: measured {measured:.1%} (mean over steps 2..{args.steps}), theory (p-1)/(m+p-1) = {theory:.1%}")
    print0(f"throughput: {samples_per_s:.1f} samples/s")
    metrics.write(
        "summary",
        example="model_parallelism",
        schedule=args.schedule,
        stages=ctx.world_size,
        stage_nodes=nodes,
        micro_batches=args.micro_batches,
        bubble_measured=measured,
        bubble_theory=theory,
        samples_per_s=samples_per_s,
        usd=meter.usd_so_far(),
    )
    return 0


def two_device_split(args, ctx) -> None:
    """The course's model parallelism: one model, first half on cuda:0, second half on cuda:1."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print0(f"two-device split: skipped, it needs 2 GPUs on one node (this node has {gpus})")
        return
    if ctx.env.local_rank == 0 and ctx.env.node_rank == 0:
        full = build_full_model(args.width, 2 * args.layers_per_stage, CLASSES, args.seed)
        first = stage_slice(full, 0, 2).to("cuda:0")
        second = stage_slice(full, 1, 2).to("cuda:1")
        optimizer = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=args.lr)
        inputs, targets = (
            t[: args.batch_size]
            for t in data.teacher_classification(samples=args.batch_size, features=args.width, seed=args.seed).tensors
        )
        started = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            logits = second(first(inputs.to("cuda:0")).to("cuda:1"))
            loss = loss_fn(logits, targets.to("cuda:1"))
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        print(
            f"two-device split on node 0 (cuda:0 -> cuda:1): {args.steps} steps, "
            f"{args.steps * args.batch_size / elapsed:.1f} samples/s, loss {loss.item():.4f}",
            flush=True,
        )
    dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    preemption = Preemption()  # SIGUSR1 (a spot notice): save at the next step and exit
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        dataset = data.teacher_classification(
            samples=SAMPLES, features=args.width, classes=CLASSES, seed=args.seed
        ).tensors
        if args.check:
            return check_against_unsplit(args, ctx, dataset)
        code = train(args, ctx, dataset, preemption)
        if args.two_device_split:
            two_device_split(args, ctx)
        return code
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
