"""Pipeline parallelism with explicit send/recv: one stage per rank, micro-batches, GPipe or 1F1B.

Every rank builds the same full model from the same seed and keeps only its slice, so the unsplit
model is at hand to check the pipeline against. Activations flow forward with tag = micro-batch,
gradients flow back with tag = OFFSET + micro-batch; sends are non-blocking and receives blocking, so
any order that respects the data dependencies (GPipe's and 1F1B's do) cannot deadlock.

The bubble is measured per stage as the part of the step it spent not computing (waiting for a
neighbour), and compared with the theory for equal stages: (p - 1) / (m + p - 1).
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harness.models import loss_fn

GRADIENT_TAG_OFFSET = 100_000
SCHEDULES = ("gpipe", "1f1b")


def build_full_model(width: int, layers: int, classes: int, seed: int) -> nn.Sequential:
    """`layers` equal Linear+ReLU blocks, then a classifier head: evenly splittable stages."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def stage_slice(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """This stage's blocks; the head rides with the last stage."""
    blocks = list(model)[:-1]
    if len(blocks) % stages:
        raise ValueError(f"{len(blocks)} layers do not split evenly into {stages} stages")
    per_stage = len(blocks) // stages
    mine = blocks[stage * per_stage : (stage + 1) * per_stage]
    if stage == stages - 1:
        mine.append(model[-1])
    return nn.Sequential(*mine)


def bubble_theory(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_order(name: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) actions of one stage for one step."""
    m = micro_batches
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if name == "1f1b":
        warmup = min(stages - stage - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", i) for i in range(m - warmup, m)]
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}")


@dataclass
class StepTiming:
    """Where one stage's step time went."""

    total_s: float
    """From the common start (a barrier) to this stage's last action."""
    busy_s: float
    """Time spent computing forward and backward passes."""


class PipelineStage:
    """One rank's stage: runs its schedule's actions, exchanging tensors with its neighbours."""

    def __init__(self, module: nn.Module, stage: int, stages: int, device: torch.device):
        self.module, self.stage, self.stages, self.device = module, stage, stages, device
        self.first, self.last = stage == 0, stage == stages - 1
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pending: list = []
        self.busy_s = 0.0

    def run_step(self, order, micro_inputs, micro_targets, activation_shape) -> tuple[float, StepTiming]:
        """One optimizer step's forward and backward passes; returns (loss on the last stage, timing)."""
        self.busy_s, total_loss = 0.0, 0.0
        dist.barrier()
        started = time.perf_counter()
        for action, micro in order:
            if action == "F":
                total_loss += self.forward(micro, micro_inputs, micro_targets, activation_shape, len(micro_targets))
            else:
                self.backward(micro)
        for work in self.pending:
            work.wait()
        self.pending.clear()
        return total_loss, StepTiming(time.perf_counter() - started, self.busy_s)

    def forward(self, micro: int, micro_inputs, micro_targets, shape, micro_batches: int) -> float:
        if self.first:
            x = micro_inputs[micro]
        else:
            x = torch.empty(shape, device=self.device)
            dist.recv(x, src=self.stage - 1, tag=micro)
            x.requires_grad_(True)
        with self._computing():
            out = self.module(x)
            if self.last:
                out = loss_fn(out, micro_targets[micro]) / micro_batches
        self.inputs[micro], self.outputs[micro] = x, out
        if not self.last:
            self.pending.append(dist.isend(out.detach(), dst=self.stage + 1, tag=micro))
            return 0.0
        return out.item()

    def backward(self, micro: int) -> None:
        out = self.outputs.pop(micro)
        if self.last:
            gradient = None
        else:
            gradient = torch.empty_like(out)
            dist.recv(gradient, src=self.stage + 1, tag=GRADIENT_TAG_OFFSET + micro)
        with self._computing():
            out.backward(gradient)
        x = self.inputs.pop(micro)
        if not self.first:
            if x.grad is None:
                raise RuntimeError(f"stage {self.stage}: backward left no gradient on micro-batch {micro}'s input")
            self.pending.append(dist.isend(x.grad, dst=self.stage - 1, tag=GRADIENT_TAG_OFFSET + micro))

    def _computing(self):
        return _Stopwatch(self, self.device)


class _Stopwatch:
    """Adds the time of a `with` block (device work included) to the stage's busy time."""

    def __init__(self, stage: PipelineStage, device: torch.device):
        self.stage, self.device = stage, device

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stage.busy_s += time.perf_counter() - self.started


def measured_bubble(timing: StepTiming, device: torch.device) -> float:
    """Mean over stages of the idle part of the step, the step being as long as its slowest stage."""
    totals = torch.tensor([timing.total_s], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    idle = torch.tensor([1.0 - timing.busy_s / totals.item()], dtype=torch.float64, device=device)
    dist.all_reduce(idle)
    return idle.item() / dist.get_world_size()
