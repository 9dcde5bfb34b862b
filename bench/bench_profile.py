"""The communication profiler against an independent timing of the same all-reduce, in one job.

Requirement (issue 4): the harness's busbw within 10% of the independent figure. Sizes 4M, 16M, 64M
(bandwidth-bound; smaller messages measure this machine's latency), four interleaved rounds; the
figure is the median ratio over all of them.
"""

import json

from bench.common import Check, median, scratch_env, torchrun


def run() -> list[Check]:
    result = torchrun("bench/profile_worker.py", env=scratch_env())
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    ratios = [r["harness"] / r["independent"] for r in rows]
    for r in rows:
        print(
            f"{r['size']:>10d} B  harness {r['harness']:.3f} GB/s  independent {r['independent']:.3f} GB/s  "
            f"ratio {r['harness'] / r['independent']:.3f}"
        )
    ratio = median(ratios)
    return [Check("profile: harness busbw / independent", f"{ratio:.3f}", "within 10% (0.9..1.1)", 0.9 <= ratio <= 1.1)]
