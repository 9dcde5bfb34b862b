"""The one line every `--check` prints, and its exit code.

    check: <what> max diff <x> (tolerance <t>) ok      -> exit 0
    check: <what> max diff <x> (tolerance <t>) FAIL    -> exit 1

The difference is the largest over every rank, so every rank agrees on the outcome and exits alike.
"""

import math

import torch
import torch.distributed as dist

from harness.dist import print0


def check_line(what: str, max_diff: float, tolerance: float, holds: bool = True) -> tuple[str, bool]:
    """The line and whether it passed: within tolerance (a NaN never is) and `holds`, any further
    condition that `what` states (e.g. "4x fewer bytes")."""
    passed = holds and math.isfinite(max_diff) and max_diff <= tolerance
    return f"check: {what} max diff {max_diff:.3e} (tolerance {tolerance:g}) {'ok' if passed else 'FAIL'}", passed


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest `value` any rank holds; NaN counts as infinite, so a broken rank is never hidden."""
    value = value if math.isfinite(value) else math.inf
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def report_check(what: str, max_diff: float, tolerance: float, device: torch.device, holds: bool = True) -> int:
    """Print the check line on rank 0 and return the exit code every rank should end with (`holds`
    must be the same on every rank)."""
    line, passed = check_line(what, max_over_ranks(max_diff, device), tolerance, holds)
    print0(line)
    return 0 if passed else 1


def gradient(parameter: torch.Tensor) -> torch.Tensor:
    """`parameter.grad` for a check to compare: one that backward never reached is an error, not a zero."""
    if parameter.grad is None:
        raise ValueError(f"a parameter of shape {tuple(parameter.shape)} has no gradient: backward never reached it")
    return parameter.grad


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0
