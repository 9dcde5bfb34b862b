"""The watchdog end to end on the local provider: an idle cluster powers itself off."""

import json
import time
from pathlib import Path

import pytest

from tests.support.cli import assert_one_line_error, run_cli, run_fab
from tests.support.clusters import node_server_processes, processes_of
from tests.support.network import free_port


def watchdog_processes(state_dir: Path) -> list[int]:
    return processes_of("harness.watchdog", state_dir)


def test_an_idle_local_cluster_brings_itself_down_and_says_why(state_dir, make_cluster):
    make_cluster("local", 2, "--idle-minutes", "0.1")  # 6 seconds
    assert json.loads((state_dir / "local" / "guards.json").read_text())["idle_minutes"] == 0.1
    bootstrap = run_fab("bootstrap", "--master-port", str(free_port()), "--scheduler", "none")
    assert bootstrap.returncode == 0, bootstrap.stdout + bootstrap.stderr
    assert "idle 0.1 min" in bootstrap.stdout
    # The marker is written first and every node powers itself off when it sees it: wait for both.
    deadline, report = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        status = run_cli("status", "--json")
        report = json.loads(status.stdout) if status.returncode == 1 else {}
        if "idle" in report.get("stopped_reason", "") and all(n["state"] == "down" for n in report["nodes"]):
            break
        time.sleep(1)
    assert "idle: no job and idle GPUs" in report.get("stopped_reason", ""), report
    assert all(n["state"] == "down" for n in report["nodes"]), report["nodes"]
    # A node stops answering at once and ends what runs on it before its server exits (a few seconds).
    deadline = time.monotonic() + 30
    while (node_server_processes(state_dir) or watchdog_processes(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert node_server_processes(state_dir) == [] and watchdog_processes(state_dir) == []
    text = run_cli("status")
    assert "the cluster stopped itself: idle" in text.stdout

    [cluster] = json.loads(run_cli("cost", "--json").stdout)["clusters"]
    assert not cluster["up"] and cluster["intervals"][-1]["end_reason"].startswith("stopped itself: idle")
    down = run_cli("down")
    assert down.returncode == 0
    [cluster] = json.loads(run_cli("cost", "--json").stdout)["clusters"]
    assert len(cluster["intervals"]) == 1 and cluster["intervals"][0]["end_reason"].startswith("stopped itself")


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--max-total-usd", "-5", ["maxTotalUsd", "positive"]),
        ("--max-total-usd", "lots", ["maxTotalUsd", "positive number"]),
        ("--idle-minutes", "0", ["idleMinutes", "positive"]),
    ],
)
def test_bad_budgets_are_refused_before_anything_starts(state_dir, flag, value, words):
    assert_one_line_error(run_cli("up", "--local", flag, value), *words)
    assert not (state_dir / "local").exists() and node_server_processes(state_dir) == []


STEPS_SCRIPT = """
import sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
stall, step_s = sys.argv[1] == "stall", float(sys.argv[2])
for step in range(5):
    time.sleep(step_s)  # slow: a collective every step_s
    if stall and step == 2 and dist.get_rank() == 1:
        time.sleep(600)  # rank 1 never comes back; rank 0 waits in the all-reduce
    dist.all_reduce(torch.ones(8))
dist.destroy_process_group()
"""


def idle_window_s() -> float:
    """An idle window this machine can keep apart from a launch right now. Between two launches nothing
    holds the cluster for as long as a new `fab` takes to start and take the job lock: a few times what
    `fab --list` takes now, which is a second when the machine is quiet and several under load."""
    started = time.monotonic()
    run_fab("--list", check=True)
    return max(6.0, 8 * (time.monotonic() - started))


def test_a_stalled_job_stops_billing_and_a_slow_healthy_one_does_not(state_dir, make_cluster, tmp_path):
    window_s = idle_window_s()
    make_cluster("local", 2, "--idle-minutes", f"{window_s / 60:.4f}")
    assert run_fab("bootstrap", "--master-port", str(free_port()), "--scheduler", "none").returncode == 0
    script = tmp_path / "steps.py"
    script.write_text(STEPS_SCRIPT)
    step_s = f"{window_s / 4:.2f}"
    slow = run_fab("run", "--script", str(script), "--args", f"healthy {step_s}", "--hang-timeout", "600")
    assert slow.returncode == 0, slow.stdout + slow.stderr  # 5 slow steps: longer than the idle window
    stalled = run_fab(
        "run", "--script", str(script), "--args", f"stall {step_s}", "--hang-timeout", "600", timeout=180 + 4 * window_s
    )
    assert stalled.returncode != 0  # the nodes powered off under it
    report = json.loads(run_cli("status", "--json").stdout)
    assert report["stopped_reason"].startswith("stalled: job ") and "made no progress" in report["stopped_reason"]
    [cluster] = json.loads(run_cli("cost", "--json").stdout)["clusters"]
    assert cluster["intervals"][-1]["end_reason"].startswith("stopped itself: stalled")
    # The nodes power off under the stalled job: every node server and the watchdog end (within seconds
    # on a busy machine, so the check waits for it rather than asking at one instant)
    deadline = time.monotonic() + 60
    while (node_server_processes(state_dir) or watchdog_processes(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert node_server_processes(state_dir) == [] and watchdog_processes(state_dir) == []
