"""Launch speed (issues 29 and 41): a launch's fixed cost against raw torchrun, on both run holders.

Requirements, each the median of PAIRS alternated rounds (the order turns each round, so a load that
grows or fades costs every side alike), wall clock, fab's start and exit included:
- an attached `fab run --script` of a 10-second 2-node job against two raw `torchrun` processes started
  by hand (bench_launch's), held by fab's connections (`--scheduler none`) and held by Slurm: at most
  0.90x each (issue 41, with ranks forked by the nodes' warm launchers, node/warm.py; issue 29: 1.15x);
- the same with a 3-second job: at most 0.70x held by fab, 0.80x held by Slurm (issue 41); and, for the
  record, the 3-second fab-held job warm against cold (`--env GPU_CLUSTER_WARM_LAUNCH=0`: every rank a
  fresh interpreter, as before);
- a Slurm-held attached run against the same run held by fab: at most 1.05x;
- `fab run --detach` returns in at most 0.3 s (Slurm-held; the run then completes; issue 41: issue 29's
  goal was 0.5 s);
- a `--requirements` env with one small package (a wheel from the project's own folder, new for every
  launch), first launch against the same launch without it (fab-held): at most 1.3x.

    python -m bench launch_speed
"""

import json
import os
import tempfile
import time
from pathlib import Path

from bench.bench_launch import raw_torchrun
from bench.common import Check, bootstrapped_local_cluster, deploy, fab, median, without_slurm

PAIRS = int(os.environ.get("BENCH_LAUNCH_SPEED_PAIRS", "5"))
SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
time.sleep({seconds})
dist.destroy_process_group()
"""
WARM = ("--env", "GPU_CLUSTER_WARM_LAUNCH=1")  # off by default for now: the first warm launch starts the launchers
COLD = ("--env", "GPU_CLUSTER_WARM_LAUNCH=0")
QUICK = "import gc_tinypkg\n"


def _timed(*args: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    fab(*args, env=env)
    return time.perf_counter() - started


def _detached(env: dict[str, str], script: Path) -> float:
    """`fab run --detach`'s return time; the run is then followed to its end (not timed)."""
    started = time.perf_counter()
    result = fab("run", "--detach", "--script", str(script), env=env)
    took = time.perf_counter() - started
    run_id = result.stdout.strip().splitlines()[-1]  # the run id, the last line
    fab("logs", "-f", "--run", run_id, env=env)
    return took


def _project(root: Path, index: int, requirements: bool) -> Path:
    """A one-file project; with `requirements`, a requirements file new to the nodes (a comment makes it
    another env) that installs the tiny wheel from the project's own folder."""
    from tests.support.packages import tiny_wheel

    project = root / f"project-{index}-{requirements}"
    project.mkdir()
    (project / "train.py").write_text(QUICK if requirements else "pass\n")
    if requirements:
        tiny_wheel(project / "wheels")
        (project / "requirements.txt").write_text(
            f"# round {index}\n--no-index\n--find-links wheels\ngc-tinypkg==0.1\n"
        )
    return project


def _project_run(env: dict[str, str], project: Path) -> float:
    extra = ["--requirements", str(project / "requirements.txt")] if (project / "requirements.txt").exists() else []
    return _timed("run", "--workdir", str(project), "--script", "train.py", *extra, env=env)


def run() -> list[Check]:
    from tests.support.network import free_port

    if without_slurm():
        return []
    root = Path(tempfile.mkdtemp(prefix="gpu-cluster-bench-speed-"))
    script, short = root / "ten_seconds.py", root / "three_seconds.py"
    script.write_text(SCRIPT.format(seconds=10))
    short.write_text(SCRIPT.format(seconds=3))
    envs: dict[str, dict[str, str]] = {}
    walls: dict[str, list[float]] = {
        side: [] for side in ("raw", "fab", "slurm", "detach", "raw3", "fab3", "slurm3", "cold3", "plain", "reqs")
    }
    try:
        for holder, scheduler in (("slurm", "slurm"), ("fab", "none")):
            envs[holder] = bootstrapped_local_cluster(scheduler)
            fab("run", *WARM, "--script", str(script), env=envs[holder])  # the first run pays cold caches
        sides = {
            "raw": lambda: raw_torchrun(script, envs["fab"], free_port()),
            "fab": lambda: _timed("run", *WARM, "--script", str(script), env=envs["fab"]),
            "slurm": lambda: _timed("run", *WARM, "--script", str(script), env=envs["slurm"]),
            "detach": lambda: _detached(envs["slurm"], script),
            "raw3": lambda: raw_torchrun(short, envs["fab"], free_port()),
            "fab3": lambda: _timed("run", *WARM, "--script", str(short), env=envs["fab"]),
            "slurm3": lambda: _timed("run", *WARM, "--script", str(short), env=envs["slurm"]),
            "cold3": lambda: _timed("run", *COLD, "--script", str(short), env=envs["fab"]),
        }
        for pair in range(PAIRS):
            order = list(sides)[pair % len(sides) :] + list(sides)[: pair % len(sides)]
            for side in order:
                walls[side].append(sides[side]())
            for side in ("plain", "reqs") if pair % 2 == 0 else ("reqs", "plain"):
                walls[side].append(_project_run(envs["fab"], _project(root, pair, side == "reqs")))
    finally:
        for env in envs.values():
            deploy("down", "--stack", "local", env=env, check=False)
    for side, times in walls.items():
        print(f"{side:7s} (s): {' '.join(f'{t:.2f}' for t in times)}")

    def ratio(a: str, b: str) -> float:
        return median([x / y for x, y in zip(walls[a], walls[b], strict=True)])

    checks = []
    for name, a, b, limit in (
        ("attached fab run held by fab / raw torchrun (2 nodes, 10-second job)", "fab", "raw", 0.90),
        ("attached fab run held by Slurm / raw torchrun (2 nodes, 10-second job)", "slurm", "raw", 0.90),
        ("attached fab run held by fab / raw torchrun (2 nodes, 3-second job)", "fab3", "raw3", 0.70),
        ("attached fab run held by Slurm / raw torchrun (2 nodes, 3-second job)", "slurm3", "raw3", 0.80),
        ("3-second job held by fab, warm ranks / cold ranks", "fab3", "cold3", 1.0),
        ("attached run held by Slurm / held by fab", "slurm", "fab", 1.05),
        ("first launch with a one-package --requirements / without", "reqs", "plain", 1.3),
    ):
        figure = ratio(a, b)
        checks.append(Check(name, f"{figure:.2f}x (median of {PAIRS} rounds)", f"<= {limit}x", figure <= limit))
    detach = median(walls["detach"])
    checks.append(Check("fab run --detach returns (Slurm-held)", f"{detach:.2f} s (median)", "<= 0.3 s", detach <= 0.3))
    print(json.dumps({side: [round(t, 3) for t in times] for side, times in walls.items()}))
    return checks
