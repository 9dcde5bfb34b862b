"""On a machine with NVIDIA GPUs: DDP of the transformer in bf16 (fp16 where the GPU has no bf16, as
on a T4) against fp32, in one script: speed-up, peak memory of each, and model FLOPs utilisation
against the GPU's datasheet peak. Record the figures, the GPU and the date in bench/RESULTS.md.

Without a GPU it measures nothing and says so.
"""

import tempfile
from datetime import date
from pathlib import Path

import torch

from bench.common import Check, scratch_env, summary, torchrun

ARGS = [
    "--model",
    "transformer",
    "--d-model",
    "1024",
    "--n-layers",
    "8",
    "--seq-len",
    "512",
    "--batch-size",
    "8",
    "--steps",
    "40",
    "--log-every",
    "10",
    "--samples",
    "2048",
]


def run() -> list[Check]:
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: nothing measured (see bench/RESULTS.md)")
        return [Check("DDP mixed precision vs fp32 (GPU)", "not measured: no GPU", "GPU figures in RESULTS.md", True)]
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    low = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    env = scratch_env()
    results = {}
    for precision in ("fp32", low):
        run_dir = Path(tempfile.mkdtemp(prefix=f"gpu-{precision}-"))
        torchrun(
            "examples/ddp_training.py",
            *ARGS,
            "--precision",
            precision,
            env={**env, "CLUSTER_RUN_DIR": str(run_dir)},
            nproc=gpus,
        )
        results[precision] = summary(run_dir)
    speedup = results["fp32"]["ms_per_step"] / results[low]["ms_per_step"]
    print(
        f"| {date.today()} | {gpus}x {name} | {low} vs fp32 speed-up {speedup:.2f}x | "
        f"peak GiB fp32 {results['fp32']['peak_mem_gib']:.2f} / {low} {results[low]['peak_mem_gib']:.2f} | "
        f"MFU fp32 {results['fp32'].get('mfu', 0):.1%} / {low} {results[low].get('mfu', 0):.1%} |"
    )
    return [
        Check(f"DDP {low} vs fp32 speed-up ({name})", f"{speedup:.2f}x", "recorded in RESULTS.md", True),
        Check(
            f"peak memory fp32 / {low}",
            f"{results['fp32']['peak_mem_gib']:.2f} / {results[low]['peak_mem_gib']:.2f} GiB",
            "recorded",
            True,
        ),
        Check(
            f"transformer MFU fp32 / {low}",
            f"{results['fp32'].get('mfu', 0):.1%} / {results[low].get('mfu', 0):.1%}",
            "recorded",
            True,
        ),
    ]
