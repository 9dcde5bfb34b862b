"""What the hang detector's recording costs a job: small all-reduces with and without it.

Requirement (issue 13): a loop of 1 KB all-reduces on 2 gloo ranks with torch's flight recorder on
(`TORCH_FR_BUFFER_SIZE`, as every `fab` launch sets it) and the rank monitor running (the
sitecustomize that `fab` puts on PYTHONPATH, writing progress every second) takes at most 5% longer
than the same loop with neither. Rounds alternate off/on; the figure is the ratio of the medians.
"""

import re
import tempfile
from pathlib import Path

from bench.common import REPO, Check, median, scratch_env, torchrun

ROUNDS = 5
ITERS = 2000
RANKHOOK = REPO / "remote" / "node" / "rankhook"


def timed_loop(env: dict[str, str]) -> float:
    result = torchrun(str(REPO / "bench" / "recorder_worker.py"), str(ITERS), env=env)
    return float(re.search(r"elapsed_s=([\d.]+)", result.stdout).group(1))


def run() -> list[Check]:
    plain = scratch_env()
    plain.pop("TORCH_FR_BUFFER_SIZE", None)
    recording = {**plain, "TORCH_FR_BUFFER_SIZE": "2000", "CLUSTER_RUN_ID": "bench-recorder",
                 "CLUSTER_PROGRESS_DIR": tempfile.mkdtemp(prefix="gpu-cluster-progress-"),
                 "PYTHONPATH": f"{RANKHOOK}:{plain.get('PYTHONPATH', '')}".rstrip(":")}
    off, on = [], []
    for _ in range(ROUNDS):
        off.append(timed_loop(plain))
        on.append(timed_loop(recording))
    wrote = sorted(p.name for p in Path(recording["CLUSTER_PROGRESS_DIR"]).glob("rank-*.json"))
    print(f"recorder off (s): {' '.join(f'{t:.3f}' for t in off)}")
    print(f"recorder on  (s): {' '.join(f'{t:.3f}' for t in on)}   (progress files: {', '.join(wrote) or 'none'})")
    ratio = median(on) / median(off)
    per_call_us = (median(on) - median(off)) / ITERS * 1e6
    return [Check(f"{ITERS} 1 KB all-reduces, recorder + monitor on / off (median of {ROUNDS})",
                  f"{ratio:.3f}x ({per_call_us:+.1f} us per collective)", "<= 1.05x",
                  ratio <= 1.05 and len(wrote) == 2)]
