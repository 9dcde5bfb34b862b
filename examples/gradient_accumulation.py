"""torchrun --standalone --nproc-per-node 2 examples/gradient_accumulation.py --accumulation-steps 4
fab accumulate --args "--accumulation-steps 8"

Gradient accumulation with DDP: k micro-batches per optimizer step, each loss divided by k, and
`DDP.no_sync()` around the first k-1 backward passes, so gradients are all-reduced once per optimizer
step instead of k times. The all-reduces are counted at run time by a DDP communication hook and
printed per optimizer step; `--sync-every-micro-step` runs the naive version for comparison.

`--check-gradient` compares, on one batch, the accumulated gradient with the gradient of the whole
global batch in one backward pass (a plain model on rank 0): they must agree within 1e-5.
"""

import argparse
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import data
from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
    positive_int,
)
from harness.cost import CostMeter
from harness.dist import cleanup, init_distributed, keep_until_exit, print0, run
from harness.metrics import MetricsWriter, StepLogger
from harness.models import MLP, loss_fn
from harness.preemption import Preemption
from harness.sharded_checkpoint import add_checkpoint_arguments, checkpoint_root
from harness.train import load_checkpoint, save_checkpoint

GRADIENT_TOLERANCE = 1e-5
SAMPLES = 8192


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument(
        "--accumulation-steps", "-k", type=positive_int, default=4, help="micro-batches per optimizer step (default 4)"
    )
    parser.add_argument(
        "--micro-batch-size", type=positive_int, default=16, help="samples per rank per micro-batch (default 16)"
    )
    add_training_arguments(parser, steps=30)
    parser.add_argument(
        "--hidden", type=positive_int, default=512, help="MLP width (default 512; larger = more to all-reduce)"
    )
    parser.add_argument("--layers", type=positive_int, default=1, help="hidden layers (default 1)")
    parser.add_argument(
        "--sync-every-micro-step", action="store_true", help="naive: all-reduce after every micro-batch"
    )
    parser.add_argument("--check-gradient", action="store_true", help="compare with the full-batch gradient and exit")
    add_checkpoint_arguments(parser, async_save=False)  # rank 0 saves DDP's whole tensors, synchronously
    add_run_arguments(parser, log_every=10, log_help="print a step line every N optimizer steps")
    args = parser.parse_args(argv)
    if args.accumulation_steps * args.micro_batch_size >= SAMPLES:
        parser.error(
            f"-k {args.accumulation_steps} x --micro-batch-size {args.micro_batch_size} must stay below the "
            f"{SAMPLES} samples of the dataset"
        )
    return args


class AllReduceCounter:
    """A DDP communication hook that counts the all-reduces DDP really issues (one per bucket)."""

    def __init__(self):
        self.calls = 0
        self.synced_backwards = 0
        self._last_seen = -1
        self.backward_index = 0

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.calls += 1
        if self._last_seen != self.backward_index:
            self._last_seen = self.backward_index
            self.synced_backwards += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def build(args, ctx):
    torch.manual_seed(args.seed)
    model = MLP(hidden=args.hidden, layers=args.layers).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    counter = AllReduceCounter()
    ddp.register_comm_hook(None, counter.hook)
    keep_until_exit(ddp)  # its hook is Python's: freeing it at exit can deadlock
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return ddp, counter, optimizer


def micro_batches(dataset: tuple[torch.Tensor, torch.Tensor], ctx, args, step: int):
    """The k micro-batches of this rank for optimizer step `step`: disjoint across ranks and steps."""
    k, size = args.accumulation_steps, args.micro_batch_size
    all_inputs, all_targets = dataset
    per_step = k * size * ctx.world_size
    start = (step * per_step + ctx.rank * k * size) % (len(all_inputs) - k * size)
    inputs, targets = (t[start : start + k * size].to(ctx.device) for t in (all_inputs, all_targets))
    return list(zip(inputs.split(size), targets.split(size), strict=True))


def accumulate(ddp, counter: AllReduceCounter, batches, sync_every_micro_step: bool) -> float:
    """One optimizer step's backward passes; returns the summed (already divided) loss."""
    k, total = len(batches), 0.0
    for index, (inputs, targets) in enumerate(batches):
        last = index == k - 1
        counter.backward_index += 1
        context = nullcontext() if (last or sync_every_micro_step) else ddp.no_sync()
        with context:
            loss = loss_fn(ddp(inputs), targets) / k
            loss.backward()
        total += loss.item()
    return total


def check_gradient(args, ctx, ddp, counter, dataset) -> int:
    """Accumulated DDP gradient vs. one backward pass over the whole global batch."""
    batches = micro_batches(dataset, ctx, args, step=0)
    ddp.zero_grad(set_to_none=True)
    syncs, calls = counter.synced_backwards, counter.calls
    accumulate(ddp, counter, batches, args.sync_every_micro_step)
    syncs, calls = counter.synced_backwards - syncs, counter.calls - calls
    accumulated = [p.grad.detach().clone() for p in ddp.module.parameters()]
    everything: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]] * ctx.world_size
    dist.all_gather_object(everything, [(x.cpu(), y.cpu()) for x, y in batches])
    worst = torch.zeros(1, device=ctx.device)
    if ctx.is_rank0:
        reference = MLP(hidden=args.hidden, layers=args.layers).to(ctx.device)
        reference.load_state_dict(ddp.module.state_dict())
        inputs = torch.cat([x for rank_batches in everything for x, _ in rank_batches]).to(ctx.device)
        targets = torch.cat([y for rank_batches in everything for _, y in rank_batches]).to(ctx.device)
        loss_fn(reference(inputs), targets).backward()
        worst[0] = max(
            (a - p.grad).abs().max().item() for a, p in zip(accumulated, reference.parameters(), strict=True)
        )
    dist.broadcast(worst, src=0)
    ok = worst.item() <= GRADIENT_TOLERANCE
    print0(
        f"accumulated gradient vs full-batch gradient: max abs difference {worst.item():.3e} "
        f"(tolerance {GRADIENT_TOLERANCE:g}): {'equal' if ok else 'MISMATCH'}; "
        f"{syncs} gradient synchronisation(s), {calls} all-reduce call(s) for {args.accumulation_steps} micro-batches"
    )
    MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write(
        "gradient_check", max_abs_diff=worst.item(), ok=ok, synchronisations=syncs, allreduce_calls=calls
    )
    return 0 if ok else 1


def save_checkpoint_on_rank0(ctx, root: Path, model, optimizer, step: int) -> None:
    if ctx.is_rank0:
        save_checkpoint(root, step, model, optimizer, None)
    dist.barrier()  # no rank goes on (or exits) before the checkpoint it would resume from is whole


def main(argv=None) -> int:
    args = parse_args(argv)
    preemption = Preemption()  # SIGUSR1 (a spot notice): save at the next step and exit
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        ddp, counter, optimizer = build(args, ctx)
        inputs, labels = data.teacher_classification(samples=SAMPLES, seed=args.seed).tensors
        dataset = (inputs, labels)
        if args.check_gradient:
            return check_gradient(args, ctx, ddp, counter, dataset)
        mode = "naive: all-reduce every micro-step" if args.sync_every_micro_step else "no_sync for k-1 micro-steps"
        k = args.accumulation_steps
        print0(f"k={k} micro-batches of {args.micro_batch_size} per rank, {ctx.world_size} ranks, {mode}")
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, k * args.micro_batch_size * ctx.world_size)
        # DDP's parameters are whole on every rank: rank 0 saves them (harness/train.py's checkpoints).
        root = checkpoint_root(args.checkpoint_dir, ctx.env.shared_dir, ctx.env.run_dir)
        start = load_checkpoint(root, ddp, optimizer, None, ctx.device)
        save = partial(save_checkpoint_on_rank0, ctx, root, ddp, optimizer) if root else None
        if start:
            print0(f"resumed from step {start} ({root})")
        started = time.perf_counter()
        for step in range(start, args.steps):
            step_started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = accumulate(ddp, counter, micro_batches(dataset, ctx, args, step), args.sync_every_micro_step)
            optimizer.step()
            done = step + 1 == args.steps
            logger.step(
                step + 1, loss, time.perf_counter() - step_started, log=done or (step + 1) % args.log_every == 0
            )
            # Periodic saves only where asked (--checkpoint-dir): this lab measures; a notice saves regardless.
            due = args.checkpoint_dir is not None and (done or (step + 1) % args.checkpoint_every == 0)
            if preemption.step_ended(step + 1, done, due, save, ctx.device):
                break  # a spot notice: every rank stopped at this step, saved
        if preemption.stopped_at is not None:
            print0(preemption.line(root))
            return 0
        elapsed = time.perf_counter() - started
        trained = max(args.steps - start, 1)
        per_step_calls = counter.calls / trained
        per_step_syncs = counter.synced_backwards / trained
        buckets = counter.calls / max(counter.synced_backwards, 1)
        print0(
            f"all-reduce per optimizer step: {per_step_syncs:g} gradient synchronisation(s), "
            f"{per_step_calls:g} all-reduce call(s) ({buckets:g} bucket(s) each), counted at run time"
        )
        print0(f"{elapsed / trained * 1000:.1f} ms per optimizer step")
        metrics.write(
            "summary",
            example="gradient_accumulation",
            k=k,
            naive=args.sync_every_micro_step,
            steps=args.steps,
            allreduce_calls_per_step=per_step_calls,
            synchronisations_per_step=per_step_syncs,
            buckets=buckets,
            ms_per_step=elapsed / trained * 1000,
            usd=meter.usd_so_far(),
        )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
