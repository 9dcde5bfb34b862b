"""Fault-tolerant runs (issue 30) on a 2-node `up --local --spot` cluster under Slurm: `fab run --replicas 2`
of examples/ft_training.py, one torchft replica group per node, the Lighthouse on node-0.

Requirements (the issue's goals):
- kill -9 of node-1's server mid-run: 0 steps redone by the survivor; its longest gap between two steps at
  most 2 s; the replacement's group back in the quorum, with its peer's params_sha at that step, within
  the replacement's join time (the kill to `rejoined` in the supervisor's log) + 15 s;
- no failure: throughput at least 0.9x plain DDP of the same model and batch on the same nodes
  (bench/ddp_baseline_worker.py), median of 5 alternated pairs;
- a spot notice on node-1's group: 0 steps lost (the group leaves at a step boundary; the survivor redoes
  none) and no stall of the survivor beyond 2 s;
- the kill again with the run held by fab's connections (`--scheduler none`, attached): the same three figures.
Every figure is read from the run's metrics.jsonl (the contract's line per step: `step`, `time`, `replica`,
`participants`, `params_sha`). Each step does STEP_SLEEP_S of pretend work (a GPU step's compute), so the
throughput ratio prices torchft's per-step quorum and all-reduce against DDP's all-reduce.
"""

import json
import os
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

from bench.common import Check, deploy, fab, fab_started, median, scratch_env, without_slurm

STEP_SLEEP_S = 0.05
PAIRS = 5
PAIR_STEPS = 80
WARMUP_STEPS = 10
LONG = "--steps 100000000 --step-sleep {sleep}"
NOTICE_S = 10
REJOINED = re.compile(r"^(\S+) node-1: rejoined in", re.M)


def lines_of(metrics: Path, kind: str = "ft_step") -> list[dict]:
    if not metrics.exists():
        return []
    found = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == kind:
            found.append(record)
    return found


def wait_until(condition, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


def steps_per_s(lines: list[dict]) -> float:
    """Steps per second after the warm-up steps, from the lines' times."""
    timed = sorted((line["step"], line["time"]) for line in lines if line["step"] > WARMUP_STEPS)
    (first_step, first_at), (last_step, last_at) = timed[0], timed[-1]
    return (last_step - first_step) / (last_at - first_at)


def survivor_figures(lines: list[dict], since: float) -> tuple[int, float]:
    """(steps redone or skipped by replica 0, its longest gap between two steps after `since`)."""
    steps = [line["step"] for line in lines if line["replica"] == 0]
    bad = sum(1 for a, b in zip(steps, steps[1:], strict=False) if b != a + 1)
    times = [line["time"] for line in lines if line["replica"] == 0 and line["time"] >= since - 2]
    return bad, max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def first_back(run_dir: Path, lines: list[dict]) -> dict:
    """Group 1's first line after it was started again (the run's heals.jsonl says when: the old ranks
    write on for a moment after their node's server is killed, until the replacement ends them)."""
    heal = json.loads((run_dir / "heals.jsonl").read_text().splitlines()[0])
    return min((r for r in lines if r["replica"] == 1 and r["time"] >= heal["at"]), key=lambda r: r["time"])


class Bench:
    def __init__(self, env: dict, state: Path):
        self.env, self.state = env, state

    def run_dir(self, run_id: str) -> Path:
        return self.state / "local" / "shared" / "runs" / run_id

    def detached(self, *args: str) -> str:
        return fab("run", *args, "--detach", env=self.env).stdout.strip().splitlines()[-1]

    def ft(self, steps_args: str) -> str:
        return self.detached("--script", "examples/ft_training.py", "--replicas", "2", "--args", steps_args)

    def stop(self, run_id: str) -> None:
        fab("stop", "--run", run_id, env=self.env, check=False)

    def kill_node_1(self) -> float:
        pid_file = self.state / "local" / "nodes" / "node-1" / "sshd.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        return time.time()

    def rejoined_after(self, at: float) -> float:
        """When the supervisor's log says node-1 rejoined, the first time after `at` (its 1 s resolution)."""
        log = self.state / "local" / "supervisor.log"
        for stamp in REJOINED.findall(log.read_text() if log.exists() else ""):
            when = datetime.fromisoformat(stamp).timestamp()
            if when >= int(at):
                return when + 1  # the line's second, at its end
        return float("nan")


def kill_figures(bench: Bench) -> list[Check]:
    run_id = bench.ft(LONG.format(sleep=STEP_SLEEP_S))
    metrics = bench.run_dir(run_id) / "metrics.jsonl"
    wait_until(lambda: sum(line["replica"] == 1 for line in lines_of(metrics)) >= 20, "group 1's 20th step")
    killed = bench.kill_node_1()
    wait_until(lambda: (bench.run_dir(run_id) / "heals.jsonl").exists(), "group 1 back")
    time.sleep(3)
    bench.stop(run_id)
    lines = lines_of(metrics)
    redone, gap = survivor_figures(lines, killed)
    back = first_back(bench.run_dir(run_id), lines)
    peer = {line["step"]: line["params_sha"] for line in lines if line["replica"] == 0}
    equal = peer.get(back["step"]) == back["params_sha"]
    rejoined = bench.rejoined_after(killed) - killed
    healed = back["time"] - killed
    print(f"kill: survivor redid {redone} steps, longest gap {gap:.2f} s; node-1 rejoined {rejoined:.0f} s after")
    print(f"kill: group 1 back at step {back['step']} {healed:.1f} s after the kill, params_sha equal: {equal}")
    return kill_checks("kill -9 node-1", redone, gap, healed, rejoined, equal)


def throughput_figures(bench: Bench) -> list[Check]:
    args = f"--steps {PAIR_STEPS} --step-sleep {STEP_SLEEP_S}"
    ratios, ft_rates, ddp_rates = [], [], []
    for _ in range(PAIRS):
        ft_run = bench.ft(args)
        wait_until(lambda run=ft_run: _ended(bench, run), "the ft run's end", 300)
        ddp_run = bench.detached("--script", "bench/ddp_baseline_worker.py", "--args", args)
        wait_until(lambda run=ddp_run: _ended(bench, run), "the DDP run's end", 300)
        ft_rate = steps_per_s([r for r in lines_of(bench.run_dir(ft_run) / "metrics.jsonl") if r["replica"] == 0])
        ddp_rate = steps_per_s(lines_of(bench.run_dir(ddp_run) / "metrics.jsonl", "ddp_step"))
        ft_rates.append(ft_rate)
        ddp_rates.append(ddp_rate)
        ratios.append(ft_rate / ddp_rate)
    ratio = median(ratios)
    ft_ms, ddp_ms = 1000 / median(ft_rates), 1000 / median(ddp_rates)
    print(
        f"throughput: --replicas 2 / DDP per pair {[round(r, 3) for r in ratios]}; {ft_ms:.1f} / {ddp_ms:.1f} ms/step"
    )
    return [
        Check(
            f"no failure: --replicas 2 / plain DDP steps/s ({STEP_SLEEP_S * 1000:.0f} ms work/step, median of {PAIRS})",
            f"{ratio:.3f}x ({ft_ms:.1f} / {ddp_ms:.1f} ms/step)",
            ">= 0.9x",
            ratio >= 0.9,
        )
    ]


def _ended(bench: Bench, run_id: str) -> bool:
    rows = json.loads(fab("jobs", "--json", env=bench.env).stdout)
    return next(row for row in rows if row["run_id"] == run_id)["state"] not in ("PENDING", "RUNNING")


def notice_figures(bench: Bench) -> list[Check]:
    run_id = bench.ft(LONG.format(sleep=STEP_SLEEP_S))
    metrics = bench.run_dir(run_id) / "metrics.jsonl"
    log = bench.run_dir(run_id) / "output.log"
    wait_until(lambda: sum(line["replica"] == 1 for line in lines_of(metrics)) >= 20, "group 1's 20th step")
    posted = time.time()
    deploy("drill", "spot", "node-1", "--notice", str(NOTICE_S), env=bench.env)
    left = re.compile(r"replica 1 preempted \(SIGUSR1\) at step (\d+)")
    found: list[re.Match] = []

    def has_left() -> bool:
        found[:] = list(left.finditer(log.read_text(errors="replace") if log.exists() else ""))
        return bool(found)

    wait_until(has_left, "group 1 leaving")
    wait_until(lambda: (bench.run_dir(run_id) / "heals.jsonl").exists(), "group 1 back on the replacement", 240)
    time.sleep(3)
    bench.stop(run_id)
    lines = lines_of(metrics)
    redone, gap = survivor_figures(lines, posted)
    left_at = int(found[0].group(1))
    back = first_back(bench.run_dir(run_id), lines)
    print(f"notice: group 1 back at step {back['step']}, {back['time'] - posted - NOTICE_S:.1f} s after the reclaim")
    survivor = {line["step"] for line in lines if line["replica"] == 0}
    lost = 0 if left_at in survivor else 1  # the group's last step is one its peer committed too
    print(f"notice: group 1 left at step {left_at}; survivor redid {redone}, longest gap {gap:.2f} s")
    return [
        Check("spot notice on group 1: steps lost", str(lost + redone), "0", lost + redone == 0),
        Check("spot notice on group 1: survivor's longest step gap", f"{gap:.2f} s", "<= 2 s", gap <= 2),
    ]


def fab_held_kill_figures(bench: Bench) -> list[Check]:
    """The kill figures again with the run held by fab's connections (`--scheduler none`): the launch starts
    group 1 again on the replacement (remote/heal.py). Attached, so it ends with Ctrl-C."""
    fab("bootstrap", "--scheduler", "none", env=bench.env)
    args = ("--replicas", "2", "--args", LONG.format(sleep=STEP_SLEEP_S))
    job = fab_started("run", "--script", "examples/ft_training.py", *args, env=bench.env)
    said: list[str] = []
    heard: dict[str, float] = {}  # when the launch said it started group 1 again
    out = job.stdout
    assert out is not None

    def read() -> None:
        for line in iter(out.readline, ""):
            said.append(line)
            if "back in service after a replacement" in line:
                heard.setdefault("started", time.time())

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    try:
        wait_until(lambda: any(line.startswith("fab: run ") for line in said), "the run's id")
        run_id = next(line.split()[2].rstrip(":") for line in said if line.startswith("fab: run "))
        metrics = bench.run_dir(run_id) / "metrics.jsonl"
        wait_until(lambda: sum(line["replica"] == 1 for line in lines_of(metrics)) >= 20, "group 1's 20th step")
        killed = bench.kill_node_1()
        wait_until(lambda: any(r["participants"] == 1 for r in lines_of(metrics) if r["time"] > killed), "1/2")
        dropped = max(r["time"] for r in lines_of(metrics) if r["replica"] == 0 and r["participants"] == 1)

        def back_lines() -> list[dict]:
            return [r for r in lines_of(metrics) if r["replica"] == 1 and r["time"] > dropped]

        wait_until(lambda: len(back_lines()) >= 3, "group 1 back on the replacement", 240)
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
    finally:
        job.kill()
        reading.join(timeout=10)
    lines = lines_of(metrics)
    redone, gap = survivor_figures(lines, killed)
    back = min(back_lines(), key=lambda r: r["time"])
    peer = {line["step"]: line["params_sha"] for line in lines if line["replica"] == 0}
    equal = peer.get(back["step"]) == back["params_sha"]
    rejoined = bench.rejoined_after(killed) - killed
    healed = back["time"] - killed
    print(f"fab-held kill: survivor redid {redone} steps, longest gap {gap:.2f} s; node-1 rejoined {rejoined:.0f} s")
    started = heard.get("started", float("nan")) - killed
    print(f"fab-held kill: group 1 started again {started:.1f} s after the kill (node-1 rejoined {rejoined:.0f} s)")
    print(f"fab-held kill: group 1 back at step {back['step']} {healed:.1f} s after the kill, equal: {equal}")
    return kill_checks("fab-held kill -9 node-1", redone, gap, healed, rejoined, equal)


def kill_checks(what: str, redone: int, gap: float, healed: float, rejoined: float, equal: bool) -> list:
    """The kill's three goals: no step redone, no gap over 2 s, the group back within its join + 15 s."""
    return [
        Check(f"{what}: steps redone by the survivor", str(redone), "0", redone == 0),
        Check(f"{what}: survivor's longest step gap", f"{gap:.2f} s", "<= 2 s", gap <= 2),
        Check(
            f"{what}: back in the quorum after the kill (params_sha equal)",
            f"{healed:.1f} s (join {rejoined:.0f} s; {'equal' if equal else 'DIFFERENT'})",
            "<= join + 15 s, equal",
            equal and healed <= rejoined + 15,
        ),
    ]


def run() -> list[Check]:
    from tests.support import slurm
    from tests.support.network import free_endpoint

    if without_slurm():
        return []
    env = scratch_env()
    bench = Bench(env, Path(env["CLUSTER_STATE_DIR"]))
    address, port = free_endpoint(2)
    deploy("up", "--local", "--spot", "--nodes", "2", "--bind", address, "--ssh-port", str(port), env=env)
    try:
        fab("bootstrap", "--scheduler", "slurm", "--master-port", str(slurm.free_ports()), env=env)
        print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        checks = kill_figures(bench)
        checks += notice_figures(bench)
        checks += throughput_figures(bench)
        checks += fab_held_kill_figures(bench)  # last: it turns Slurm off
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        return checks
    finally:
        deploy("down", "--stack", "local", env=env, check=False)
