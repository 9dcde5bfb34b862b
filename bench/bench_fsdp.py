"""FSDP's per-rank optimizer state against DDP's for the same model, on 4 ranks.

examples/fsdp_training.py measures every rank's optimizer state from its local shards and DDP's from
the same tensors whole (what every DDP rank holds), in one job. A 3.2M-parameter transformer whose
sizes divide by 4, so the ideal share is exactly 1/4 and any excess is FSDP's own.

Requirement (issue 12): the fullest rank holds at most 1/N + 10% of DDP's optimizer state (1.1/N).
"""

import tempfile
from pathlib import Path

from bench.common import Check, scratch_env, summary, torchrun

RANKS = 4
ARGS = [
    "--d-model",
    "256",
    "--n-layers",
    "4",
    "--n-heads",
    "8",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--steps",
    "2",
    "--log-every",
    "100",
]


def run() -> list[Check]:
    run_dir = Path(tempfile.mkdtemp(prefix="fsdp-"))
    torchrun("examples/fsdp_training.py", *ARGS, env={**scratch_env(), "CLUSTER_RUN_DIR": str(run_dir)}, nproc=RANKS)
    figures = summary(run_dir)
    ddp = figures["ddp_memory"]
    checks = []
    for key, label in (
        ("optimizer_bytes", "optimizer state"),
        ("parameters_bytes", "parameters"),
        ("gradients_bytes", "gradients"),
    ):
        share = max(rank[key] for rank in figures["memory_per_rank"]) / ddp[key]
        print(f"{label:16s} fullest rank {share:.4f} of DDP's (1/N = {1 / RANKS:.4f})")
        if key == "optimizer_bytes":
            checks.append(
                Check(
                    f"fsdp: per-rank optimizer state vs DDP ({RANKS} ranks)",
                    f"{share:.4f}",
                    f"<= 1/N + 10% ({1.1 / RANKS:.3f})",
                    share <= 1.1 / RANKS,
                )
            )
    return checks
