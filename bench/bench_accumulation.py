"""Gradient accumulation, communication-bound (a 16M-parameter MLP, micro-batches of 4): k=4 with
`no_sync` for the first k-1 backward passes against the naive version that all-reduces every time.

Requirement (issue 4): no_sync at least 1.5x faster per optimizer step. Both runs in this script,
alternated twice; the figure is the ratio of the medians.
"""

import tempfile
from pathlib import Path

from bench.common import Check, median, scratch_env, summary, torchrun

ARGS = ["--hidden", "2048", "--layers", "4", "--micro-batch-size", "4", "-k", "4", "--steps", "8"]


def run() -> list[Check]:
    env = scratch_env()
    times: dict[str, list[float]] = {"no_sync": [], "naive": []}
    for _ in range(2):
        for mode, extra in (("no_sync", []), ("naive", ["--sync-every-micro-step"])):
            run_dir = Path(tempfile.mkdtemp(prefix=f"accumulate-{mode}-"))
            torchrun("examples/gradient_accumulation.py", *ARGS, *extra, env={**env, "CLUSTER_RUN_DIR": str(run_dir)})
            times[mode].append(summary(run_dir)["ms_per_step"])
    for mode, values in times.items():
        print(f"{mode:8s} ms per optimizer step: {' '.join(f'{v:.1f}' for v in values)}")
    speedup = median(times["naive"]) / median(times["no_sync"])
    return [Check("accumulation k=4: no_sync vs naive", f"{speedup:.2f}x faster", ">= 1.5x", speedup >= 1.5)]
