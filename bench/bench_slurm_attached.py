"""A run held by Slurm, followed to its end, against the same run held by fab's connections (issue 27).

Requirement: an attached `fab run --script` (2 nodes, a 3-second script) on a cluster bootstrapped with
`--scheduler slurm` takes at most 1.1x the same launch on a cluster bootstrapped with `--scheduler none`,
the median of the per-pair ratios of PAIRS alternated pairs (the order flips each pair, so a load that
grows or fades costs both sides alike). Wall clock, fab's start and its exit included.

Two 2-node local clusters side by side, one per holder, each bootstrapped once and warmed by one run:
re-bootstrapping one cluster between the runs would restart Slurm before each run, which no user does.
Also printed: how long Slurm held the cluster for each run (`fab jobs`' started to ended, Slurm's own
times, whole seconds) beside the fab-held run's own duration.

    python -m bench slurm_attached
"""

import json
import tempfile
import time
from pathlib import Path

from bench.common import Check, bootstrapped_local_cluster, deploy, fab, median, without_slurm

PAIRS = 8
LIMIT = 1.1
SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
time.sleep(3)
dist.destroy_process_group()
"""


def _timed_run(env: dict[str, str], script: Path) -> tuple[float, float]:
    """One attached `fab run --script`: its wall time, and the run's own duration from its summary."""
    started = time.perf_counter()
    result = fab("run", "--script", str(script), env=env)
    took = time.perf_counter() - started
    run_id = next(
        line.split()[2].rstrip(":")
        for line in (result.stderr + result.stdout).splitlines()
        if line.startswith("fab: run ")
    )
    summary = json.loads((Path(env["CLUSTER_STATE_DIR"]) / "local" / "runs" / run_id / "summary.json").read_text())
    return took, float(summary["duration_s"])


def run() -> list[Check]:
    if without_slurm():
        return []
    script = Path(tempfile.mkdtemp()) / "three_seconds.py"
    script.write_text(SCRIPT)
    envs: dict[str, dict[str, str]] = {}
    try:
        for holder, scheduler in (("slurm", "slurm"), ("fab", "none")):
            envs[holder] = bootstrapped_local_cluster(scheduler)
            _timed_run(envs[holder], script)  # warm: the first run after a bootstrap pays cold caches
        walls: dict[str, list[float]] = {"slurm": [], "fab": []}
        held: dict[str, list[float]] = {"slurm": [], "fab": []}
        for pair in range(PAIRS):
            for holder in ("slurm", "fab") if pair % 2 == 0 else ("fab", "slurm"):
                wall, duration = _timed_run(envs[holder], script)
                walls[holder].append(wall)
                held[holder].append(duration)
    finally:
        for env in envs.values():
            deploy("down", "--stack", "local", env=env, check=False)
    ratios = [s / f for s, f in zip(walls["slurm"], walls["fab"], strict=True)]
    print(f"held by Slurm (s): {' '.join(f'{t:.2f}' for t in walls['slurm'])}")
    print(f"held by fab (s):   {' '.join(f'{t:.2f}' for t in walls['fab'])}")
    print(f"ratios:            {' '.join(f'{r:.2f}' for r in ratios)}")
    print(
        f"the run's own duration (summary): Slurm's start to end {median(held['slurm']):.1f} s, "
        f"fab's {median(held['fab']):.1f} s (medians)"
    )
    ratio = median(ratios)
    return [
        Check(
            "attached fab run held by Slurm / by fab (2 nodes, 3-second script)",
            f"{ratio:.2f}x (median of {PAIRS} pairs; {median(walls['slurm']):.2f} / {median(walls['fab']):.2f} s)",
            f"<= {LIMIT}x",
            ratio <= LIMIT,
        )
    ]
