"""The models the examples train: the course's MLP and a small causal transformer language model."""

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP and torch.compile wrappers (`module`, `_orig_mod`), however nested."""
    for wrapped in ("module", "_orig_mod"):
        inner = getattr(model, wrapped, None)
        if isinstance(inner, nn.Module):
            return unwrap(inner)
    return model


class MLP(nn.Module):
    """784-512-10 by default (the course's), deeper or wider on request for benchmarks."""

    def __init__(
        self,
        in_features: int = 784,
        hidden: int = 512,
        classes: int = 10,
        layers: int = 1,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        widths = [in_features] + [hidden] * layers
        self.hidden = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in pairwise(widths))
        self.head = nn.Linear(widths[-1], classes)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for block in self.hidden:
            x = checkpoint(block, x, use_reentrant=False) if self._recompute else block(x)
        return self.head(x)

    @property
    def _recompute(self) -> bool:
        return self.activation_checkpointing and self.training and torch.is_grad_enabled()


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP.

    q, k and v are separate projections and the heads are counted from the width a projection
    returns, so tensor parallelism can split them column-wise (each rank computing whole heads) and
    split `proj` row-wise, with no change here (examples/tensor_parallel.py).
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        # No bias on k: it would add the same amount to every score of a query, which softmax ignores,
        # so its gradient is rounding noise (and Adam turns noise into full-size steps).
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.norm1(x)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (self.q(h), self.k(h), self.v(h)))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.mlp(self.norm2(x))


class TinyTransformerLM(nn.Module):
    """A GPT-style language model small enough to train on two CPU ranks in a minute."""

    def __init__(
        self,
        vocab: int = 64,
        seq_len: int = 64,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.activation_checkpointing = activation_checkpointing
        self.shape = (vocab, seq_len, d_model, n_heads, n_layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.norm(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x parameters plus attention (PaLM appendix B's estimate)."""
        _, seq_len, d_model, _, n_layers = self.shape
        params = sum(p.numel() for p in self.parameters()) - self.position.weight.numel()
        return 6 * params + 12 * n_layers * d_model * seq_len


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifier logits [B, C] or language-model logits [B, T, V], in float32 at least
    (16-bit logits are upcast; float64 ones, a check's, keep their bits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def initial_loss(classes: int) -> float:
    """The loss of a model that knows nothing: ln(classes)."""
    return math.log(classes)
