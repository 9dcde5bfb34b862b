"""Per-rank memory, summed from the tensors a rank really holds, beside the course's estimate.

Parameters, gradients and optimizer state are counted from their local shards (a DTensor's local
tensor, so FSDP and tensor parallelism show what this rank keeps). Activations are what autograd
saved for backward during one forward pass, seen through `saved_tensors_hooks` and measured when the
forward pass ends: so FSDP's ZeRO-3 style, which frees the gathered parameters right after forward,
shows none kept, and the ZeRO-2 style shows the whole parameters it keeps until backward.
"""

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

WEIGHT_BYTES = 4  # fp32 weights
GRADIENT_BYTES = 4  # fp32 gradients
ADAM_BYTES = 8  # Adam's two fp32 moments per parameter


@dataclass(frozen=True)
class MemoryBreakdown:
    """What one rank holds for training, in bytes."""

    parameters_bytes: int
    """This rank's parameters (its shards, where they are sharded)."""
    gathered_bytes: int
    """Whole parameters gathered for forward and kept for backward, beyond this rank's shards (FSDP)."""
    gradients_bytes: int
    """This rank's gradients."""
    optimizer_bytes: int
    """This rank's optimizer state (Adam: two moments per parameter)."""
    activations_bytes: int
    """What the forward pass saved for backward, parameters excluded."""

    @property
    def total_bytes(self) -> int:
        return (
            self.parameters_bytes
            + self.gathered_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor that lives on this rank."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    shard = local(tensor)
    return shard.numel() * shard.element_size()


def parameter_bytes(model: nn.Module) -> int:
    return sum(nbytes(p) for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return sum(nbytes(p.grad) for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor in the optimizer's state (Adam's moments; its step counters are scalars)."""
    return sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _storage(tensor: torch.Tensor):
    return local(tensor).untyped_storage()


def _root(tensor: torch.Tensor) -> torch.Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


class SavedForBackward:
    """A `with` block around one forward pass (loss included) that measures what it saves for backward."""

    def __init__(self, model: nn.Module):
        self.own_storages = {_storage(p).data_ptr() for p in model.parameters()}
        self.saved: list[torch.Tensor] = []
        self.activations_bytes = 0
        self.gathered_bytes = 0

    def __enter__(self) -> "SavedForBackward":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        seen: set[int] = set()
        for tensor in self.saved:
            storage = _storage(tensor)
            if storage.data_ptr() in self.own_storages or storage.data_ptr() in seen:
                continue  # a parameter's own storage is counted with the parameters; views count once
            seen.add(storage.data_ptr())
            root = _root(local(tensor))
            if root.is_leaf and root.requires_grad:
                self.gathered_bytes += storage.nbytes()  # a whole parameter gathered by FSDP
            else:
                self.activations_bytes += storage.nbytes()
        self.saved.clear()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved.append(tensor)
        return tensor


def breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, saved: SavedForBackward) -> MemoryBreakdown:
    """This rank's figures after a step measured with `saved` (gradients and optimizer state present)."""
    return MemoryBreakdown(
        parameter_bytes(model),
        saved.gathered_bytes,
        gradient_bytes(model),
        optimizer_bytes(optimizer),
        saved.activations_bytes,
    )


def whole_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, activations_bytes: int) -> MemoryBreakdown:
    """What DDP holds on every rank for the same model and optimizer: every tensor whole (a DTensor's
    global size), with the same activations (the same batch per rank)."""

    def whole(tensor):
        return 0 if tensor is None else tensor.numel() * tensor.element_size()

    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return MemoryBreakdown(
        sum(whole(p) for p in model.parameters()),
        0,
        sum(whole(p.grad) for p in model.parameters()),
        sum(whole(v) for v in states),
        activations_bytes,
    )


@dataclass(frozen=True)
class Sharing:
    """How a strategy divides the parameters' memory: the fraction of each that one rank holds."""

    weights: float
    """Of the weights (1 for DDP, 1/N for ZeRO-3)."""
    gradients: float
    """Of the gradients (1/N from ZeRO-2 on)."""
    optimizer: float
    """Of Adam's moments (1/N from ZeRO-1 on)."""


def course_estimate_bytes(parameters: int, sharing: Sharing, activations_bytes: int) -> int:
    """The course's estimate: weights (4 B/param) + gradients (4 B/param) + Adam (8 B/param), each
    divided as the strategy divides it, + activations."""
    return (
        round(
            parameters
            * (WEIGHT_BYTES * sharing.weights + GRADIENT_BYTES * sharing.gradients + ADAM_BYTES * sharing.optimizer)
        )
        + activations_bytes
    )


def activation_estimate_bytes(
    batch: int, seq_len: int, d_model: int, n_layers: int, vocab: int, tp: int = 1, value_bytes: int = 4
) -> int:
    """About what a pre-norm block keeps for backward, per token: the two LayerNorms' inputs and
    outputs (4 x d, replicated under tensor parallelism), q, k, v, the attention output and its
    reshaped copy (5 x d) and the MLP's two 4d-wide activations (8 x d), these 13 x d split by tensor
    parallelism; plus the last norm and head input (2 x d) and the logits (V)."""
    per_token = n_layers * (4 * d_model + 13 * d_model / tp) + 2 * d_model + vocab
    return round(batch * seq_len * per_token * value_bytes)


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB': binary units, as memory is sized."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"
