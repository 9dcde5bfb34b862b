"""Synthetic data that can really be learned: labels come from a fixed random "teacher".

The same seed gives the same data on every rank and every run, so a resumed run sees exactly the
batches an uninterrupted one would, and the loss falls far below chance.
"""

import torch
from torch.utils.data import TensorDataset


def teacher_classification(samples: int = 8192, features: int = 784, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random two-layer network (a learnable rule, not noise)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    hidden = torch.randn(features, 64, generator=generator) / features**0.5
    readout = torch.randn(64, classes, generator=generator)
    labels = (torch.tanh(inputs @ hidden) @ readout).argmax(dim=1)
    return TensorDataset(inputs, labels)


def teacher_sequences(samples: int = 2048, seq_len: int = 64, vocab: int = 64, seed: int = 0) -> TensorDataset:
    """Token sequences from a fixed random Markov chain whose next token is nearly determined.

    Each token has 2 likely successors, so a model that learns the chain reaches a loss near ln 2
    from ln(vocab) at the start.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 2), generator=generator)
    tokens = torch.empty(samples, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (samples,), generator=generator)
    for t in range(seq_len):
        choice = torch.randint(2, (samples,), generator=generator)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
