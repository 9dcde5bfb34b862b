"""torchrun --nnodes 1 --nproc-per-node 2 examples/ddp_training.py
fab run-ddp --args "--model transformer --precision bf16"

Data-parallel training with DistributedDataParallel: every rank holds the whole model, trains on its
own shard of each epoch (DistributedSampler, reshuffled by set_epoch), and gradients are averaged by
all-reduce during backward, so parameters stay bit-identical on every rank (checked at the end).

Models: the course's 784-512-10 MLP (`--model mlp`) or a small causal transformer LM
(`--model transformer`), on synthetic data labelled by a fixed random teacher, so the loss really falls.
`--precision fp16` uses a GradScaler; bf16 is refused on GPUs without it (T4: use fp16).
With `--checkpoint-dir` (default `$CLUSTER_RUN_DIR/checkpoints` under `fab`), rank 0 saves atomically
and every rank resumes from the latest checkpoint, so a torchrun restart (`--max-restarts`) continues
where it stopped; `--simulate-failure-at-step N` crashes one rank once to show it. On SIGUSR1 (a spot
notice, harness/preemption.py) the ranks stop together at the next step, save, and exit 0; the cluster
requeues the run and it resumes from that step.

`fab run-ddp --replicas N` trains the same model and data as N torchft replica groups instead (README,
"Fault-tolerant runs"): no DDP wrapper; harness/fault_tolerance.py's loop averages the gradients across the
groups that are alive, drops a dead one and heals a returning one from a live peer, and each group's first
rank writes the contract's line per step to `$CLUSTER_RUN_DIR/metrics.jsonl`. Each group trains on its own
slice of every step's batch, drawn from the step's number, so a step is the same whenever it is trained.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from harness import data
from harness.args import (
    ExampleParser,
    add_run_arguments,
    add_training_arguments,
    positive_float,
    positive_int,
)
from harness.cost import CostMeter
from harness.dist import Distributed, cleanup, fail, init_distributed, print0, run
from harness.fault_tolerance import Replica, ReplicaConfig, replica_group, replicated
from harness.metrics import MetricsWriter, StepLogger, peak_memory_gib, peak_tflops
from harness.models import MLP, TinyTransformerLM, count_parameters, loss_fn, unwrap
from harness.preemption import Preemption, restart_count
from harness.train import (
    PRECISIONS,
    LoopConfig,
    build_loader,
    digests_across_ranks,
    load_checkpoint,
    maybe_profile,
    parameter_digest,
    resolve_precision,
    train_loop,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp", help="what to train (default mlp)")
    add_training_arguments(
        parser, steps=60, steps_help="optimizer steps in all", batch_size=64, batch_help="samples per rank per step"
    )
    parser.add_argument(
        "--lr", type=positive_float, default=None, help="learning rate (default: 0.05 mlp, 3e-3 transformer)"
    )
    parser.add_argument(
        "--samples", type=positive_int, default=8192, help="size of the synthetic dataset (default 8192)"
    )
    parser.add_argument("--d-model", type=positive_int, default=128, help="transformer width (default 128)")
    parser.add_argument("--n-layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="transformer context length (default 64)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="fp32, fp16 (+GradScaler) or bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save and resume here (default: $CLUSTER_RUN_DIR/checkpoints when set)",
    )
    parser.add_argument("--checkpoint-every", type=positive_int, default=20, help="save every N steps (default 20)")
    parser.add_argument(
        "--simulate-failure-at-step",
        type=positive_int,
        default=None,
        metavar="N",
        help="crash the last rank once at step N (to see a torchrun restart resume)",
    )
    parser.add_argument("--profile-dir", default=None, help="write torch.profiler TensorBoard traces here")
    add_run_arguments(parser, log_every=10)
    args = parser.parse_args(argv)
    if args.model == "transformer" and args.d_model % heads(args.d_model):
        parser.error(
            f"--d-model {args.d_model} must divide into {heads(args.d_model)} heads of 64 (use a multiple of 64)"
        )
    if dataset_size(args) < args.batch_size:
        parser.error(
            f"--samples {args.samples} gives {dataset_size(args)} training examples, fewer than one "
            f"--batch-size of {args.batch_size}"
        )
    return args


def heads(d_model: int) -> int:
    return max(1, d_model // 64)


def dataset_size(args) -> int:
    """The transformer's sequences are 4x longer examples, so it gets a quarter of them."""
    return args.samples if args.model == "mlp" else args.samples // 4


def build_module(args) -> tuple[torch.nn.Module, TensorDataset]:
    """The model and its data, the same on every rank and every replica group (seeded)."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model: torch.nn.Module
    if args.model == "mlp":
        model = MLP(activation_checkpointing=args.activation_checkpointing)
        dataset = data.teacher_classification(samples=args.samples, seed=args.seed)
    else:
        model = TinyTransformerLM(
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_heads=heads(args.d_model),
            n_layers=args.n_layers,
            activation_checkpointing=args.activation_checkpointing,
        )
        dataset = data.teacher_sequences(samples=dataset_size(args), seq_len=args.seq_len, seed=args.seed)
    return model, dataset


def build_model(args, ctx: Distributed) -> tuple[torch.nn.Module, TensorDataset]:
    model, dataset = build_module(args)
    model = model.to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if args.compile:
        # torch.compile(module) returns an OptimizedModule, a Module; its annotation says only a callable.
        return cast(torch.nn.Module, torch.compile(ddp)), dataset
    return ddp, dataset


def build_optimizer(args, model) -> torch.optim.Optimizer:
    if args.model == "mlp":
        return torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3, weight_decay=0.0)


def default_checkpoint_dir(args, ctx: Distributed) -> Path | None:
    if args.checkpoint_dir:
        return args.checkpoint_dir
    return ctx.env.run_dir / "checkpoints" if ctx.env.run_dir else None


def utilisation(args, ctx, result, model, samples: int) -> dict:
    """Tokens/s and model FLOPs utilisation of the transformer against the GPU's datasheet peak."""
    transformer = unwrap(model)
    if not isinstance(transformer, TinyTransformerLM) or not result.elapsed_s:
        return {}
    tokens_per_s = samples * args.seq_len / result.elapsed_s
    achieved_tflops = tokens_per_s * transformer.flops_per_token() / 1e12
    figures = {"tokens_per_s": tokens_per_s, "model_tflops": achieved_tflops}
    if ctx.device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(ctx.device), args.precision)
        if peak:
            figures["mfu"] = achieved_tflops / ctx.world_size / peak
    return figures


def summarize(args, ctx, result, meter: CostMeter, logger: StepLogger, metrics: MetricsWriter, model) -> int:
    digests = digests_across_ranks(parameter_digest(model))
    identical = len(set(digests)) == 1
    per_million = meter.usd_per_million_samples(logger.samples)
    trained = (result.steps - result.started_at_step) * args.batch_size * ctx.world_size
    speed = utilisation(args, ctx, result, model, trained)
    metrics.write(
        "summary",
        example="ddp_training",
        model=args.model,
        precision=args.precision,
        world_size=ctx.world_size,
        steps=result.steps,
        resumed_from=result.started_at_step,
        first_loss=result.first_loss,
        last_loss=result.last_loss,
        samples=logger.samples,
        elapsed_s=round(result.elapsed_s, 3),
        usd=meter.usd_so_far(),
        usd_per_million_samples=per_million,
        parameter_digest=digests[0],
        parameters_identical=identical,
        peak_mem_gib=peak_memory_gib(ctx.device),
        ms_per_step=result.elapsed_s / max(result.steps - result.started_at_step, 1) * 1000,
        **speed,
    )
    if result.first_loss is not None:
        print0(
            f"trained steps {result.started_at_step + 1}..{result.steps} on {ctx.world_size} ranks in "
            f"{result.elapsed_s:.1f} s: loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
        )
    if "mfu" in speed:
        print0(
            f"{speed['tokens_per_s']:.0f} tokens/s, {speed['model_tflops']:.1f} model TFLOP/s, "
            f"MFU {speed['mfu']:.1%} of {torch.cuda.get_device_name(ctx.device)}'s {args.precision} peak"
        )
    price = f"${per_million:.4f} per million samples" if per_million is not None else "no samples trained"
    print0(f"cost: ${meter.usd_so_far():.6f} at ${meter.hourly_usd:.3f}/h; {price}")
    if not identical:
        print0(f"MISMATCH: parameters differ across ranks: {digests}")
        return 1
    print0(f"parameters identical on all {ctx.world_size} ranks (sha256 {digests[0][:16]})")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    preemption = Preemption()  # before anything slow: a notice during setup is kept for the first step
    if replicated():
        return train_replica_group(args, preemption)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        try:
            precision = resolve_precision(args.precision, ctx.device)
        except ValueError as exc:
            fail(str(exc), code=2)
        model, dataset = build_model(args, ctx)
        optimizer = build_optimizer(args, model)
        scaler = precision.scaler(ctx.device)
        checkpoints = default_checkpoint_dir(args, ctx)
        start = load_checkpoint(checkpoints, model, optimizer, scaler, ctx.device)
        if start:
            print0(f"resuming from step {start} ({checkpoints}; restart {restart_count()})")
        loader, sampler = build_loader(dataset, ctx, args.batch_size, args.seed)
        if len(loader) == 0:
            fail(
                f"--samples {args.samples} is too few for {ctx.world_size} ranks x --batch-size {args.batch_size}",
                code=2,
            )
        print0(
            f"{args.model}: {count_parameters(model):,} parameters, {ctx.world_size} ranks ({ctx.backend}), "
            f"{args.precision}, global batch {args.batch_size * ctx.world_size}"
        )
        meter = CostMeter(ctx.env.hourly_usd)
        metrics = MetricsWriter(ctx.env.run_dir, ctx.is_rank0)
        logger = StepLogger(ctx.is_rank0, ctx.device, meter, metrics, args.batch_size * ctx.world_size)
        config = LoopConfig(
            args.steps, args.log_every, checkpoints, args.checkpoint_every, args.simulate_failure_at_step
        )
        with maybe_profile(args.profile_dir, ctx.rank, ctx.device) as profiler:
            result = train_loop(
                ctx,
                model,
                optimizer,
                scaler,
                precision,
                loader,
                sampler,
                config,
                logger,
                start_step=start,
                profiler=profiler,
                preemption=preemption,
            )
        if preemption.stopped_at is not None:
            print0(preemption.line(checkpoints))
            return 0
        return summarize(args, ctx, result, meter, logger, metrics, model)
    finally:
        cleanup()


PLAIN_ONLY = ("precision", "compile", "profile_dir", "simulate_failure_at_step")
"""Flags of a plain DDP run that a replica group's loop does not take."""


def train_replica_group(args, preemption: Preemption) -> int:
    """Under `fab run-ddp --replicas N`: this replica group's part, in harness/fault_tolerance.py's loop
    (the checkpoint for when every group is lost in `--checkpoint-dir`)."""
    given = [f"--{name.replace('_', '-')}" for name in PLAIN_ONLY if getattr(args, name) not in (None, False, "fp32")]
    if given:
        fail(f"{', '.join(given)} train plain DDP only: leave them out with --replicas", code=2)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    model, dataset = build_module(args)
    model = model.to(device)
    optimizer = build_optimizer(args, model)
    folder = args.checkpoint_dir or Path(os.environ.get("CLUSTER_RUN_DIR") or ".") / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    config = ReplicaConfig(args.steps, folder / "ft-checkpoint.pt", args.checkpoint_every, log_every=args.log_every)
    inputs, targets = dataset.tensors
    replica = replica_group()

    def loss_at(step: int) -> torch.Tensor:
        """This group's slice of step `step`'s batch, drawn from the step's number and the group's."""
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1000 + replica)
        picked = torch.randint(len(inputs), (args.batch_size,), generator=generator)
        return loss_fn(model(inputs[picked].to(device)), targets[picked].to(device))

    first = int(os.environ.get("RANK", "0")) == 0  # the group's first rank speaks for it
    if first:
        print(f"replica {replica}: {args.model}, {count_parameters(model):,} parameters, batch {args.batch_size}")
    reached = Replica(model, optimizer, config).train(loss_at, preemption)
    if first:
        print(f"replica {replica}: trained to step {reached}", flush=True)
    return 0


if __name__ == "__main__":
    run(main)
