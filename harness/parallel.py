"""What the parallelism lab's examples share: the model config, the device mesh, the batches, and
whole parameters gathered back from any layout.

Every strategy trains the same transformer from the same seed on the same global batches, so any two
can be compared step for step: a global batch of B sequences is cut into dp equal slices, one per
data-parallel replica, and the tensor-parallel ranks of a replica all see its slice. The world size
then changes the layout of the work, never the work.
"""

import argparse
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from harness import data
from harness.args import positive_int
from harness.models import TinyTransformerLM, loss_fn, unwrap

T = TypeVar("T")


@dataclass(frozen=True)
class ModelConfig:
    """The transformer the lab trains (harness.models.TinyTransformerLM), sized by flags."""

    vocab: int
    """Tokens in the vocabulary."""
    seq_len: int
    """Tokens per sequence."""
    d_model: int
    """Width of the residual stream."""
    n_heads: int
    """Attention heads (tensor parallelism gives each rank whole heads)."""
    n_layers: int
    """Transformer blocks."""

    def build(self, seed: int, device: torch.device) -> TinyTransformerLM:
        """The model with the weights `seed` gives, the same on every rank and in every strategy."""
        torch.manual_seed(seed)
        return TinyTransformerLM(
            vocab=self.vocab, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers
        ).to(device)

    def parameter_count(self) -> int:
        with torch.device("meta"):
            model = TinyTransformerLM(
                vocab=self.vocab,
                seq_len=self.seq_len,
                d_model=self.d_model,
                n_heads=self.n_heads,
                n_layers=self.n_layers,
            )
        return sum(p.numel() for p in model.parameters())

    def describe(self) -> str:
        return (
            f"transformer d_model {self.d_model}, {self.n_layers} layers, {self.n_heads} heads, "
            f"seq {self.seq_len}, vocab {self.vocab}: {self.parameter_count():,} parameters"
        )


def add_model_arguments(parser: argparse.ArgumentParser, defaults: ModelConfig) -> None:
    group = parser.add_argument_group("model")
    for field, help_text in (
        ("vocab", "tokens in the vocabulary"),
        ("seq_len", "tokens per sequence"),
        ("d_model", "model width"),
        ("n_heads", "attention heads"),
        ("n_layers", "transformer blocks"),
    ):
        default = getattr(defaults, field)
        group.add_argument(
            f"--{field.replace('_', '-')}", type=positive_int, default=default, help=f"{help_text} (default {default})"
        )


def model_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelConfig:
    """The config the flags describe; a width that does not split into the heads is refused."""
    if args.d_model % args.n_heads:
        parser.error(f"--d-model {args.d_model} does not split into --n-heads {args.n_heads} equal heads")
    return ModelConfig(args.vocab, args.seq_len, args.d_model, args.n_heads, args.n_layers)


# ------------------------------------------------------------------------------------------ the mesh


@dataclass(frozen=True)
class MeshShape:
    """How the ranks are laid out: dp data-parallel replicas x tp tensor-parallel shards each.

    Ranks are numbered node by node, so the tp ranks of a replica (consecutive ranks) share a node
    and the dp replicas talk across nodes: the per-layer all-reduces of tensor parallelism stay on
    the fast links inside a node.
    """

    dp: int
    """Data-parallel replicas (across nodes)."""
    tp: int
    """Tensor-parallel shards of each replica (within a node)."""

    @property
    def size(self) -> int:
        return self.dp * self.tp


def mesh_shape(world_size: int, local_world_size: int, dp: int | None = None, tp: int | None = None) -> MeshShape:
    """`--dp`/`--tp` as given; by default tp = the ranks on a node and dp = what is left (the nodes)."""
    if tp is None:
        tp = max(1, world_size // dp) if dp else local_world_size
    if dp is None:
        dp = max(1, world_size // tp)
    return MeshShape(dp, tp)


def layout_problem(shape: MeshShape, world_size: int, config: ModelConfig, batch_size: int) -> str | None:
    """Why this layout cannot run, with the whole picture; None where it can."""
    if shape.size != world_size:
        return (
            f"dp({shape.dp}) x tp({shape.tp}) = {shape.size} != WORLD_SIZE({world_size}): "
            "choose --dp and --tp whose product is the number of ranks"
        )
    if config.n_heads % shape.tp:
        return f"tp({shape.tp}) must divide --n-heads {config.n_heads}: each rank computes whole heads"
    if batch_size % shape.dp:
        return f"--batch-size {batch_size} must split evenly over dp({shape.dp}) replicas"
    return None


def build_mesh(shape: MeshShape, device: torch.device) -> DeviceMesh:
    """The 2-D mesh ("dp", "tp"): mesh["tp"] is this rank's replica, mesh["dp"] its peers in others."""
    return init_device_mesh(device.type, (shape.dp, shape.tp), mesh_dim_names=("dp", "tp"))


# --------------------------------------------------------------------------------------- the batches


class Batches:
    """Global batches of the teacher's sequences, the same for every strategy and world size."""

    def __init__(self, config: ModelConfig, batch_size: int, seed: int, samples: int = 1024):
        self.batch_size = batch_size
        self.inputs, self.targets = data.teacher_sequences(
            samples=max(samples, batch_size), seq_len=config.seq_len, vocab=config.vocab, seed=seed
        ).tensors

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * self.batch_size) % (len(self.inputs) - self.batch_size + 1)
        return self.inputs[start : start + self.batch_size], self.targets[start : start + self.batch_size]

    def replica_batch(self, step: int, replica: int, replicas: int, device: torch.device):
        """Replica `replica`'s slice of step `step`'s global batch, on `device`."""
        inputs, targets = self.global_batch(step)
        return inputs.chunk(replicas)[replica].to(device), targets.chunk(replicas)[replica].to(device)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    forward_context=None,
) -> torch.Tensor:
    """One optimizer step; returns the loss of this rank's slice (a tensor: no sync with the device).
    `forward_context` wraps the forward pass (a `memory.SavedForBackward` to measure it)."""
    optimizer.zero_grad(set_to_none=True)
    with forward_context if forward_context is not None else contextlib.nullcontext():
        loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks: the global batch's loss when every replica's slice is equal
    (tensor-parallel ranks of a replica hold the same loss, so they do not tilt it)."""
    total = value.detach().to(torch.float64).reshape(1).clone()  # a float64 check's loss keeps its bits
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """What one call of `step()` returns, and the seconds it took, the device's queued work included."""
    started = time.perf_counter()
    result = step()
    synchronize(device)
    return result, time.perf_counter() - started


# -------------------------------------------------------------------------------- whole parameters


def full_parameters(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name, on every rank, whatever shards it (FSDP, tensor parallel, both),
    as `dtype` (float32 for digests; a float64 check keeps its own).

    Gathering FSDP-over-TP shards takes two all-gathers, which torch logs as a performance warning on
    every call; a check or a digest runs it once, so that warning is kept out of the output.
    """
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    whole = {}
    for name, parameter in unwrap(model).named_parameters():
        tensor = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        whole[name] = tensor.detach().to(dtype).cpu()
    return whole


def digest(parameters: dict[str, torch.Tensor]) -> str:
    """sha256 over names and fp32 values: equal digests mean equal parameters, whatever the layout."""
    hasher = hashlib.sha256()
    for name in sorted(parameters):
        hasher.update(name.encode())
        hasher.update(parameters[name].contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def max_parameter_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    return max((a[name] - b[name]).abs().max().item() for name in a)
