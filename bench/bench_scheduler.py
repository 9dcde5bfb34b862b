"""Runs held by Slurm (issue 18) on a 2-node local cluster, ratios against a baseline measured in the same run.

Requirements:
- `fab run --detach` returns in under 3 s (the median of 3);
- the same short 2-node torchrun script through the scheduler (`fab run`, submitted and followed to its
  end) against two raw `torchrun` processes started by hand: at most 1.3x (median of 3 alternated runs);
- the first `fab bootstrap --scheduler slurm` against the first `fab bootstrap` without it, each on a
  fresh cluster, alternated, the quickest of each: at most 1.25x; a second bootstrap with the scheduler at
  most 25% of its first.
"""

import tempfile
import time
from pathlib import Path

from bench.bench_launch import SCRIPT, raw_torchrun
from bench.common import Check, deploy, fab, median, scratch_env, without_slurm

ROUNDS = 3


def _bootstrap(env: dict, port: int, *extra: str) -> float:
    started = time.perf_counter()
    fab("bootstrap", "--master-port", str(port), *extra, env=env)
    return time.perf_counter() - started


def run() -> list[Check]:
    from tests.support import slurm

    if without_slurm():
        return []
    script = Path(tempfile.mkdtemp()) / "allreduce.py"
    script.write_text(SCRIPT)
    # First bootstraps, alternated on fresh clusters, the quickest of each kept (a busy machine only adds).
    firsts: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(2):
        for kind, extra in (("without", ("--scheduler", "none")), ("with", ("--scheduler", "slurm"))):
            fresh = scratch_env()
            deploy("up", "--local", "--nodes", "2", "--bind", "127.0.202.10", "--ssh-port", "2432", env=fresh)
            try:
                firsts[kind].append(_bootstrap(fresh, slurm.free_ports(), *extra))
            finally:
                deploy("down", "--stack", "local", env=fresh, check=False)
    without = min(firsts["without"])
    env = scratch_env()
    port = slurm.free_ports()
    deploy("up", "--local", "--nodes", "2", "--bind", "127.0.203.10", "--ssh-port", "2442", env=env)
    try:
        first = _bootstrap(env, port, "--scheduler", "slurm")
        second = _bootstrap(env, port)
        first = min(first, *firsts["with"])
        node_like = {**env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        scheduled, raw, detach = [], [], []
        for round_ in range(ROUNDS):
            started = time.perf_counter()
            fab("run", "--script", str(script), env=env)
            scheduled.append(time.perf_counter() - started)
            raw.append(raw_torchrun(script, node_like, 29720 + round_))
            started = time.perf_counter()
            run_id = fab("run", "--script", str(script), "--detach", env=env).stdout.strip().splitlines()[-1]
            detach.append(time.perf_counter() - started)
            fab("logs", "-f", "--run", run_id, env=env)  # let it end before the next round
    finally:
        deploy("down", "--stack", "local", env=env, check=False)
    print(f"bootstrap without the scheduler {without:.2f} s; with it: first {first:.2f} s, second {second:.2f} s")
    print(f"fab run via Slurm (s): {' '.join(f'{t:.2f}' for t in scheduled)}")
    print(f"raw torchrun x2 (s):   {' '.join(f'{t:.2f}' for t in raw)}")
    print(f"fab run --detach (s):  {' '.join(f'{t:.2f}' for t in detach)}")
    overhead = median(scheduled) / median(raw)
    return [
        Check("fab run --detach returns", f"{median(detach):.2f} s", "< 3 s", median(detach) < 3),
        Check(
            "fab run via Slurm vs raw torchrun x2",
            f"{overhead:.2f}x ({median(scheduled):.2f} / {median(raw):.2f} s)",
            "<= 1.3x",
            overhead <= 1.3,
        ),
        Check(
            "first bootstrap with the scheduler / without",
            f"{first / without:.2f}x ({first:.2f} / {without:.2f} s)",
            "<= 1.25x",
            first / without <= 1.25,
        ),
        Check(
            "second bootstrap / first (with the scheduler)",
            f"{second / first:.0%} ({second:.2f} / {first:.2f} s)",
            "<= 25%",
            second / first <= 0.25,
        ),
    ]
