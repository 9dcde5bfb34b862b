"""PowerSGD against no hook at a bandwidth-bound size: a 12.6M-parameter transformer whose gradients
are one 48 MiB all-reduce per step (far past the sizes where latency dominates), on 2 ranks.

Both runs are one job of examples/gradient_compression.py (it trains `none`, then `powersgd`, from the
same weights on the same batches); the job runs twice and the figures are medians.

Requirement (issue 12): PowerSGD (rank 1) sends at least 4x fewer bytes per step, counted as its
all-reduces are issued. Its time ratio is recorded: it is the trade a link decides (see RESULTS.md).
On a machine with a GPU the bf16 hook is measured against none too.
"""

import tempfile
from pathlib import Path

import torch

from bench.common import Check, median, scratch_env, summary, torchrun

ARGS = [
    "--d-model",
    "512",
    "--n-layers",
    "4",
    "--n-heads",
    "8",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--steps",
    "8",
    "--log-every",
    "100",
]


def hook_runs(hook: str, nproc: int) -> dict[str, list[dict]]:
    env = scratch_env()
    runs: dict[str, list[dict]] = {}
    for _ in range(2):
        run_dir = Path(tempfile.mkdtemp(prefix=f"compression-{hook}-"))
        torchrun(
            "examples/gradient_compression.py",
            *ARGS,
            "--hook",
            hook,
            env={**env, "CLUSTER_RUN_DIR": str(run_dir)},
            nproc=nproc,
        )
        for run in summary(run_dir)["runs"]:
            runs.setdefault(run["hook"], []).append(run)
    return runs


def ratios(runs: dict[str, list[dict]], hook: str) -> tuple[float, float]:
    """(how many times fewer bytes, the hook's time per step / none's), medians."""
    fewer = median([n["size_bytes"] / h["size_bytes"] for n, h in zip(runs["none"], runs[hook], strict=True)])
    slower = median([h["ms_per_step"] / n["ms_per_step"] for n, h in zip(runs["none"], runs[hook], strict=True)])
    for name in ("none", hook):
        times = " ".join(f"{r['ms_per_step']:.1f}" for r in runs[name])
        print(f"{name:9s} bytes/step {runs[name][0]['size_bytes']:>11,d}  ms/step {times}")
    return fewer, slower


def run() -> list[Check]:
    fewer, slower = ratios(hook_runs("powersgd", 2), "powersgd")
    checks = [
        Check("compression: PowerSGD bytes/step vs none (48 MiB grads)", f"{fewer:.1f}x fewer", ">= 4x", fewer >= 4),
        Check("compression: PowerSGD time/step vs none", f"{slower:.2f}x", "recorded (link-dependent)", True),
    ]
    if torch.cuda.is_available():
        fewer, slower = ratios(hook_runs("bf16", torch.cuda.device_count()), "bf16")
        checks.append(
            Check(
                "compression: bf16 hook bytes and time vs none (GPU)",
                f"{fewer:.1f}x fewer, {slower:.2f}x time",
                "2x fewer; time recorded",
                abs(fewer - 2) < 0.01,
            )
        )
    else:
        print("no CUDA GPU: the bf16 hook (NCCL only) is not measured here")
    return checks
