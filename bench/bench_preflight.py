"""The preflight and the straggler verdict (issue 33), on local clusters with one node really slowed (its
processes in a CPU cgroup with a low quota, tests/support/throttle.py; needs root and cgroup v1).

Requirements:
- `fab preflight` takes at most 60 s on 2 nodes and at most 120 s on 16 (wall clock, fab's start
  included), and names the throttled node (10% of one CPU) every time, and no other node;
- a node throttled (to 10% of a core, BENCH_STRAGGLER_PERCENT) once a DDP run trains is named as the
  straggler within 30 steps, by a fab-held run's watch and by a Slurm-held run's (STRAGGLER_RUNS runs
  each): two figures per run, counted from the step rank 0 was at when the throttle began (its
  metrics.jsonl, every step with its time): the step at which the rule was met (the verdict's window),
  and the step rank 0 was at when the line was said;
- a healthy run is never named (0 of RUNS, on this shared machine as it is).

    python -m bench preflight            # 10 throttled preflights, 3+3 throttled runs, 10 healthy, 16 nodes
    BENCH_PREFLIGHTS=0 BENCH_HEALTHY_RUNS=0 BENCH_SIXTEEN=0 python -m bench preflight   # the stragglers only
"""

import json
import os
import time
from pathlib import Path

from bench.common import Check, deploy, fab, fab_started, scratch_env
from tests.support import slurm

PREFLIGHTS = int(os.environ.get("BENCH_PREFLIGHTS", "10"))
RUNS = int(os.environ.get("BENCH_HEALTHY_RUNS", "10"))
SIXTEEN = os.environ.get("BENCH_SIXTEEN", "1") != "0"
STRAGGLER_RUNS = int(os.environ.get("BENCH_STRAGGLER_RUNS", "3"))
# A tenth of a core, as the integration test: at 30% the throttled rank's forward (24 to 55 ms here) is not
# reliably 1.3x the other's on this loaded 2-core machine, where the unthrottled rank's own swings 9 to 43 ms.
STRAGGLER_PERCENT = int(os.environ.get("BENCH_STRAGGLER_PERCENT", "10"))
DDP = ("--hang-timeout", "20", "--args", "--steps 150 --batch-size 1024 --log-every 50")
# Every step in metrics.jsonl, with its time: the step rank 0 was at when the throttle began and when the
# verdict was said are read from it.
STRAGGLER_DDP = ("--hang-timeout", "20", "--args", "--steps 150 --batch-size 1024 --log-every 1")


def _cluster(nodes: int) -> dict[str, str]:
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


def _straggler_run(env: dict[str, str], holder: str) -> dict:
    """One run-ddp whose node-1 is throttled once it trains: the step rank 0 was at when the
    throttle began, the window the verdict named, and the step rank 0 was at when the line was said."""
    from tests.support.throttle import throttled

    run = fab_started("run-ddp", "--skip-preflight", *STRAGGLER_DDP, env=env)
    assert run.stdout is not None
    seen = []
    for line in run.stdout:
        seen.append(line)
        if "ms/step" in line:
            break
    with throttled(_home(env, 1), STRAGGLER_PERCENT):
        throttled_at = time.time()
        seen.append(run.stdout.read())
    run.wait()
    run_id = next(line.split()[2].rstrip(":") for line in "".join(seen).splitlines() if line.startswith("fab: run "))
    metrics = Path(env["CLUSTER_STATE_DIR"]) / "local" / "runs" / run_id / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [(r["time"], r["step"]) for r in steps if r.get("kind") == "step"]
    found = _stragglers(env, "".join(seen))

    def step_at(moment: float) -> int:
        return next((step for at, step in steps if at >= moment), steps[-1][1])

    figures = {"holder": holder, "throttled_at_step": step_at(throttled_at), "named": found}
    if found:
        figures["rule_met_step"] = found[0]["steps"][1]
        figures["said_at_step"] = step_at(found[0]["named_at"])
    print(f"{holder}-held throttled run: {figures}")
    return figures


def _straggler_checks(env: dict[str, str], holder: str) -> list[Check]:
    measured = [_straggler_run(env, holder) for _ in range(STRAGGLER_RUNS)]
    named = [m for m in measured if m["named"] and m["named"][0]["node"] == "node-1"]
    rule = [m["rule_met_step"] - m["throttled_at_step"] for m in named]
    said = [m["said_at_step"] - m["throttled_at_step"] for m in named]
    return [
        Check(
            f"{holder}-held: throttled node-1 named, steps from the throttle to the rule met (runs)",
            f"{len(named)}/{len(measured)} named; {rule}",
            "all named, each <= 30",
            len(named) == len(measured) and all(n <= 30 for n in rule),
        ),
        Check(
            f"{holder}-held: steps from the throttle to the STRAGGLER line said (rank 0's step then)",
            f"{said}",
            "each <= 30",
            len(named) == len(measured) and all(n <= 30 for n in said),
        ),
    ]


def _healthy_checks(env: dict[str, str]) -> list[Check]:
    cleared = fab("preflight", "--json", env=env, check=False)  # the throttled node's CRITICAL is lifted
    print(f"unthrottled preflight: exit {cleared.returncode}, named {json.loads(cleared.stdout)['named']}")
    flagged = 0
    for _ in range(RUNS):
        healthy = fab("run-ddp", *DDP, env=env)
        flagged += bool(_stragglers(env, healthy.stdout))
    return [Check("healthy runs named as stragglers", f"{flagged}/{RUNS}", f"0/{RUNS}", flagged == 0)]


def run() -> list[Check]:
    from tests.support.throttle import unavailable

    why = unavailable()
    if why:
        return [Check("preflight bench", f"not run: {why}", "root and cgroup v1", False)]
    checks = []
    env = _cluster(2)
    try:
        if PREFLIGHTS:
            checks += _preflight_checks(env, 2, 1, PREFLIGHTS, 60)
        checks += _straggler_checks(env, "fab")
        if RUNS:
            checks += _healthy_checks(env)
        if STRAGGLER_RUNS and not slurm.unavailable():
            fab("bootstrap", "--scheduler", "slurm", env=env)
            checks += _straggler_checks(env, "Slurm")
    finally:
        deploy("down", env=env, check=False)
    if SIXTEEN:
        env = _cluster(16)
        try:
            checks += _preflight_checks(env, 16, 5, 1, 120)
        finally:
            deploy("down", env=env, check=False)
    return checks
