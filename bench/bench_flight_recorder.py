"""What the hang detector's recording costs a job: small all-reduces with and without it.

Requirement (issue 13): a loop of 1 KB all-reduces on 2 gloo ranks with torch's flight recorder on
(`TORCH_FR_BUFFER_SIZE`, as every `fab` launch sets it) and the rank monitor running (the
sitecustomize that `fab` puts on PYTHONPATH, writing progress every second) takes at most 5% longer
than the same loop with neither. Rounds alternate off/on; the figure is the ratio of the medians of
wall time. The ratio of rank 0's CPU time is printed beside it: the recorder's cost is CPU work in the
calling thread, and CPU time is less disturbed by whatever else the machine runs.
"""

import re
import tempfile
from pathlib import Path

from bench.common import REPO, Check, median, scratch_env, torchrun

ROUNDS = 9
ITERS = 2000
RANKHOOK = REPO / "node" / "rankhook"


def timed_loop(env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of rank 0's loop."""
    result = torchrun(str(REPO / "bench" / "recorder_worker.py"), str(ITERS), env=env)
    found = re.search(r"elapsed_s=([\d.]+) cpu_s=([\d.]+)", result.stdout)
    if found is None:
        raise RuntimeError(f"recorder_worker.py printed no timing line:\n{result.stdout}")
    return float(found.group(1)), float(found.group(2))


def run() -> list[Check]:
    plain = scratch_env()
    plain.pop("TORCH_FR_BUFFER_SIZE", None)
    recording = {
        **plain,
        "TORCH_FR_BUFFER_SIZE": "2000",
        "CLUSTER_RUN_ID": "bench-recorder",
        "CLUSTER_PROGRESS_DIR": tempfile.mkdtemp(prefix="gpu-cluster-progress-"),
        "PYTHONPATH": f"{RANKHOOK}:{plain.get('PYTHONPATH', '')}".rstrip(":"),
    }
    off, on = [], []
    for _ in range(ROUNDS):
        off.append(timed_loop(plain))
        on.append(timed_loop(recording))
    wrote = sorted(p.name for p in Path(recording["CLUSTER_PROGRESS_DIR"]).glob("rank-*.json"))
    print(f"recorder off, wall (s): {' '.join(f'{t:.3f}' for t, _ in off)}")
    files = ", ".join(wrote) or "none"
    print(f"recorder on,  wall (s): {' '.join(f'{t:.3f}' for t, _ in on)}   (progress files: {files})")
    wall = median([t for t, _ in on]) / median([t for t, _ in off])
    cpu = median([c for _, c in on]) / median([c for _, c in off])
    per_call_us = (median([t for t, _ in on]) - median([t for t, _ in off])) / ITERS * 1e6
    return [
        Check(
            f"{ITERS} 1 KB all-reduces, recorder + monitor on / off (median of {ROUNDS})",
            f"{wall:.3f}x wall ({per_call_us:+.1f} us per collective), {cpu:.3f}x CPU",
            "<= 1.05x wall",
            wall <= 1.05 and len(wrote) == 2,
        )
    ]
