"""The preflight and the straggler verdict (issue 33), on local clusters with one node really slowed (its
processes in a CPU cgroup with a low quota, tests/support/throttle.py; needs root and cgroup v1).

Requirements:
- `fab preflight` takes at most 60 s on 2 nodes and at most 120 s on 16 (wall clock, fab's start
  included), and names the throttled node (10% of one CPU) every time, and no other node;
- a node throttled to 30% during a DDP run is named as the straggler within 30 steps: the figure is the
  last step every rank had reported when the hang watch named it (the rule itself needs 20; the watch
  looks every --hang-timeout/5 s, here 4 s, so with steps of tens of milliseconds the naming comes
  later than the rule allows);
- a healthy run is never named (0 of RUNS, on this shared machine as it is).

    python -m bench preflight            # 10 throttled preflights, 10 healthy runs, then 16 nodes
    BENCH_PREFLIGHTS=1 BENCH_HEALTHY_RUNS=3 BENCH_SIXTEEN=0 python -m bench preflight   # fewer, no 16 nodes
"""

import json
import os
import time
from pathlib import Path

from bench.common import Check, deploy, fab, scratch_env

PREFLIGHTS = int(os.environ.get("BENCH_PREFLIGHTS", "10"))
RUNS = int(os.environ.get("BENCH_HEALTHY_RUNS", "10"))
SIXTEEN = os.environ.get("BENCH_SIXTEEN", "1") != "0"
DDP = ("--hang-timeout", "20", "--args", "--steps 150 --batch-size 1024 --log-every 50")


def _cluster(nodes: int) -> dict[str, str]:
    from tests.support import slurm
    from tests.support.network import free_endpoint

    env = scratch_env()
    address, port = free_endpoint(nodes)
    deploy("up", "--local", "--nodes", str(nodes), "--bind", address, "--ssh-port", str(port), env=env)
    fab("bootstrap", "--master-port", str(slurm.free_ports()), "--scheduler", "none", env=env)
    return env


def _home(env: dict[str, str], index: int) -> Path:
    return Path(env["CLUSTER_STATE_DIR"]) / "local" / "nodes" / f"node-{index}"


def _preflight(env: dict[str, str], slow: int) -> tuple[float, list[str]]:
    """One throttled preflight: its wall time and the nodes it named."""
    from tests.support.throttle import throttled

    with throttled(_home(env, slow), 10):
        started = time.perf_counter()
        result = fab("preflight", "--json", env=env, check=False)
        took = time.perf_counter() - started
    return took, json.loads(result.stdout)["named"]


def _stragglers(env: dict[str, str], output: str) -> list:
    run_id = next(line.split()[2].rstrip(":") for line in output.splitlines() if line.startswith("fab: run "))
    rows = json.loads(fab("jobs", "--json", env=env).stdout)
    return next(row["stragglers"] for row in rows if row["run_id"] == run_id)


def _preflight_checks(env: dict[str, str], nodes: int, slow: int, times: int, limit_s: float) -> list[Check]:
    measured = [_preflight(env, slow) for _ in range(times)]
    right = sum(named == [f"node-{slow}"] for _, named in measured)
    worst = max(took for took, _ in measured)
    print(f"preflight on {nodes} nodes: {[round(t, 1) for t, _ in measured]} s, named {[n for _, n in measured]}")
    return [
        Check(
            f"fab preflight, {nodes} nodes (slowest of {times})",
            f"{worst:.1f} s",
            f"<= {limit_s:.0f} s",
            worst <= limit_s,
        ),
        Check(
            f"throttled node-{slow} named alone, {nodes} nodes", f"{right}/{times}", f"{times}/{times}", right == times
        ),
    ]


def _straggler_checks(env: dict[str, str]) -> list[Check]:
    from tests.support.throttle import throttled

    with throttled(_home(env, 1), 30):
        slowed = fab("run-ddp", "--skip-preflight", *DDP, env=env)
    found = _stragglers(env, slowed.stdout)
    named_at = found[0]["steps"][1] if found else None
    print(f"throttled run: stragglers {found}")
    cleared = fab("preflight", "--json", env=env, check=False)  # the throttled node's CRITICAL is lifted
    print(f"unthrottled preflight: exit {cleared.returncode}, named {json.loads(cleared.stdout)['named']}")
    flagged = 0
    for _ in range(RUNS):
        healthy = fab("run-ddp", *DDP, env=env)
        flagged += bool(_stragglers(env, healthy.stdout))
    return [
        Check(
            "throttled node-1 named as straggler (last step seen at the naming poll)",
            f"rank {found[0]['rank']} on {found[0]['node']} at step {named_at}" if found else "not named",
            "node-1, <= step 30",
            bool(found) and found[0]["node"] == "node-1" and named_at is not None and named_at <= 30,
        ),
        Check("healthy runs named as stragglers", f"{flagged}/{RUNS}", f"0/{RUNS}", flagged == 0),
    ]


def run() -> list[Check]:
    from tests.support.throttle import unavailable

    why = unavailable()
    if why:
        return [Check("preflight bench", f"not run: {why}", "root and cgroup v1", False)]
    checks = []
    env = _cluster(2)
    try:
        checks += _preflight_checks(env, 2, 1, PREFLIGHTS, 60)
        checks += _straggler_checks(env)
    finally:
        deploy("down", env=env, check=False)
    if SIXTEEN:
        env = _cluster(16)
        try:
            checks += _preflight_checks(env, 16, 5, 1, 120)
        finally:
            deploy("down", env=env, check=False)
    return checks
