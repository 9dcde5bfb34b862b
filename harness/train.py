"""Training pieces the examples share: precision, checkpoints, the data-parallel loop, and checks.

The loop resumes exactly: data order comes from `DistributedSampler(seed).set_epoch(epoch)`, and a
checkpoint records the global step, so a restarted run skips the batches it already trained on and
ends with the parameters an uninterrupted run would have.
"""

import contextlib
import hashlib
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from harness import metrics
from harness.dist import Distributed
from harness.metrics import StepLogger
from harness.models import loss_fn, unwrap
from harness.preemption import Preemption

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Precision:
    """How the forward pass computes and whether gradients need scaling."""

    name: str
    """fp32, fp16 or bf16."""
    dtype: torch.dtype | None
    """The autocast dtype; None for plain fp32."""

    def autocast(self, device: torch.device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """A GradScaler for fp16 (small gradients would underflow); disabled otherwise."""
        return torch.amp.GradScaler(device.type, enabled=self.name == "fp16")


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The precision asked for, or ValueError where this device cannot do it (bf16 on a T4)."""
    if name not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")
    if name == "bf16" and device.type == "cuda" and not _gpu_has_bf16(device):
        gpu = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"bf16 needs an Ampere or newer GPU; this is {gpu} (sm_{major}{minor}): use --precision fp16")
    return Precision(name, {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[name])


def _gpu_has_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8  # emulated bf16 on older GPUs is slow


# ---------------------------------------------------------------------------------------- checkpoints


def checkpoint_path(directory: Path) -> Path:
    return directory / "latest.pt"


def save_checkpoint(directory: Path, step: int, model: nn.Module, optimizer, scaler) -> None:
    """Rank 0 writes `latest.pt` atomically: a crash mid-write leaves the previous checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    target = checkpoint_path(directory)
    tmp = target.with_name(f".latest.{os.getpid()}.tmp")
    torch.save(
        {
            "step": step,
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
        },
        tmp,
    )
    os.replace(tmp, target)


def load_checkpoint(directory: Path | None, model: nn.Module, optimizer, scaler, device: torch.device) -> int:
    """Every rank loads the latest checkpoint if there is one; returns the step to continue from."""
    if directory is None or not checkpoint_path(directory).exists():
        return 0
    state = torch.load(checkpoint_path(directory), map_location=device, weights_only=True)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    return int(state["step"])


# ------------------------------------------------------------------------------------------- checks


def parameter_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes: equal digests mean bit-identical parameters."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def digests_across_ranks(digest: str) -> list[str]:
    gathered: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(gathered, digest)
    return gathered


# ---------------------------------------------------------------------------------------- the loop


def build_loader(
    dataset: Dataset, ctx: Distributed, batch_size: int, seed: int
) -> tuple[DataLoader, DistributedSampler[int]]:
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=True, pin_memory=ctx.device.type == "cuda"
    )
    return loader, sampler


@dataclass
class LoopResult:
    """What the loop did."""

    first_loss: float | None
    """Loss of the first step this process trained (after a resume: of the first step after it)."""
    last_loss: float | None
    """Loss of the last step."""
    steps: int
    """The global step reached."""
    started_at_step: int
    """The step it resumed from (0 for a fresh start)."""
    elapsed_s: float
    """Wall time of the loop on this rank."""


@dataclass(frozen=True)
class LoopConfig:
    """How long to train and when to log, checkpoint or fail on purpose."""

    max_steps: int
    """Stop at this global step."""
    log_every: int
    """Print a step line every this many steps (and at the last)."""
    checkpoint_dir: Path | None
    """Where rank 0 saves and every rank resumes from; None: no checkpoints."""
    checkpoint_every: int
    """Save every this many steps (and at the end)."""
    fail_at_step: int | None = None
    """Crash the last rank once at this step, to show a torchrun restart resuming (`--max-restarts`)."""


def train_loop(
    ctx: Distributed,
    model: nn.Module,
    optimizer,
    scaler,
    precision: Precision,
    loader: DataLoader,
    sampler: DistributedSampler,
    config: LoopConfig,
    logger: StepLogger,
    start_step: int = 0,
    profiler=None,
    preemption: Preemption | None = None,
) -> LoopResult:
    step, first_loss, last_loss = start_step, None, None
    steps_per_epoch = len(loader)
    started = time.perf_counter()
    while step < config.max_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for inputs, targets in itertools.islice(loader, skip, None):
            step_started = time.perf_counter()
            loss = train_step(ctx, model, optimizer, scaler, precision, inputs, targets)
            step += 1
            last_loss = loss
            first_loss = loss if first_loss is None else first_loss
            done = step >= config.max_steps
            logger.step(step, loss, time.perf_counter() - step_started, log=done or step % config.log_every == 0)
            saved = _maybe_checkpoint(ctx, config, step, done, model, optimizer, scaler)
            _maybe_fail(ctx, config, step)
            if profiler is not None:
                profiler.step()
            if done:
                break
            if preemption is not None and preemption.agreed(ctx.device):  # every rank stops at this step
                if not saved and config.checkpoint_dir is not None:
                    _maybe_checkpoint(ctx, config, step, True, model, optimizer, scaler)
                preemption.stop(step)
                break
        if preemption is not None and preemption.stopped_at is not None:
            break
    return LoopResult(first_loss, last_loss, step, start_step, time.perf_counter() - started)


def train_step(
    ctx: Distributed,
    model: nn.Module,
    optimizer,
    scaler,
    precision: Precision,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    inputs = inputs.to(ctx.device, non_blocking=True)
    targets = targets.to(ctx.device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    with metrics.ForwardTimer(ctx.device) as forward, precision.autocast(ctx.device):
        loss = loss_fn(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    value = loss.item()
    metrics.forward_s = forward.seconds()  # the rank's own compute, for the straggler verdict
    return value


def _maybe_checkpoint(ctx, config: LoopConfig, step: int, done: bool, model, optimizer, scaler) -> bool:
    """Save at every `checkpoint_every` steps and at the end; whether it saved."""
    if config.checkpoint_dir is None or not (done or step % config.checkpoint_every == 0):
        return False
    if ctx.is_rank0:
        save_checkpoint(config.checkpoint_dir, step, model, optimizer, scaler)
    dist.barrier()  # nobody runs ahead of a checkpoint it might have to resume from
    return True


def _maybe_fail(ctx, config: LoopConfig, step: int) -> None:
    if config.fail_at_step != step or ctx.rank != ctx.world_size - 1 or config.checkpoint_dir is None:
        return
    marker = config.checkpoint_dir / f".failed-once-at-{step}"
    if marker.exists():
        return
    marker.touch()
    print(f"rank {ctx.rank}: failing on purpose at step {step} (--simulate-failure-at-step)", flush=True)
    os._exit(1)


@contextlib.contextmanager
def maybe_profile(profile_dir: str | None, rank: int, device: torch.device):
    """torch.profiler writing TensorBoard traces to `profile_dir` (steps 2-4), or nothing."""
    if not profile_dir:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(profile_dir, worker_name=f"rank{rank}"),
        profile_memory=True,
    ) as profiler:
        yield profiler
