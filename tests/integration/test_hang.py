"""Hung jobs on a real 2-node local cluster: the verdict names the rank, the collective and the frame.

Each user script uses plain torch.distributed (nothing of this project); rank 1 misbehaves at step 3. A rank
that dies is fail-fast's, not the watch's: test_remote's failing rank ends its job, the watch on (its default
timeout), FAILED with the rank's own exit code, never HUNG.
"""

import json
import re
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from tests.support.clusters import bootstrapped_cluster, run_processes

HANG_TIMEOUT_S = 3
SCRIPT = """
import os, signal, sys, time
import torch
import torch.distributed as dist


def load_batch(step):
    if CASE == "sleep" and RANK == 1 and step == 3:
        time.sleep(600)
    if CASE == "stop" and RANK == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    if CASE == "slow":
        time.sleep(1.5 * HANG_TIMEOUT_S)  # every rank computes longer than the hang timeout
    return torch.ones(1024)


dist.init_process_group("gloo")
CASE, RANK, HANG_TIMEOUT_S = sys.argv[1], dist.get_rank(), float(sys.argv[2])
for step in range(3 if CASE == "slow" else 6):
    batch = load_batch(step)
    if CASE == "op" and RANK == 1 and step == 3:
        dist.broadcast(batch, 0)
    elif CASE == "shape" and RANK == 1 and step == 3:
        dist.all_reduce(torch.ones(4096))
    else:
        dist.all_reduce(batch)
print(f"rank {RANK} done", flush=True)
dist.destroy_process_group()
"""
LINE = {
    name: number
    for number, text in enumerate(SCRIPT.splitlines(), start=1)
    for name, needle in (("sleep", "time.sleep(600)"), ("stop", "signal.SIGSTOP)"), ("op", "dist.broadcast("))
    if needle in text
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with bootstrapped_cluster(tmp_path_factory, "hang") as handle:
        handle.script = tmp_path_factory.mktemp("scripts") / "hangcase.py"
        handle.script.write_text(SCRIPT)
        yield handle


def launch(cluster, case: str, *extra: str, timeout_s: float = HANG_TIMEOUT_S):
    started = time.monotonic()
    result = cluster.fab(
        "run",
        "--script",
        str(cluster.script),
        "--args",
        f"{case} {timeout_s}",
        "--hang-timeout",
        str(timeout_s),
        *extra,
        timeout=420,
    )
    run_id = re.search(r"fab: run (\S+):", result.stdout).group(1)
    return result, run_id, time.monotonic() - started


def verdict_of(result) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("HANG run=")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


@contextmanager
def busy_cores():
    """Two processes that spin for as long as the block runs: the machine as loaded as it gets."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def assert_hung_and_cleaned_up(cluster, result, run_id):
    assert result.returncode == 1 and "hung and was stopped on every node" in result.stderr, result.stderr
    summary = json.loads((cluster.state_dir / "local" / "runs" / run_id / "summary.json").read_text())
    # Named within the timeout + 60 s of the moment progress stopped, however long start-up took.
    assert summary["hang"]["detected_at"] - summary["hang"]["stalled_at"] < HANG_TIMEOUT_S + 60, summary["hang"]
    deadline = time.monotonic() + 20
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes(run_id) == []
    run = next(r for r in json.loads(cluster.cli("cost", "--json").stdout)["runs"] if r["run_id"] == run_id)
    assert run["hung"] and run["hang_verdict"] == verdict_of(result) and run["stalled_at"] is not None
    assert run["usd_since_stall"] == 0.0  # a local cluster costs nothing; the figure is there
    evidence = cluster.state_dir / "local" / "runs" / run_id / "hang"
    assert (evidence / "verdict.txt").read_text().strip() == verdict_of(result)
    shown = cluster.fab("logs", "--run", run_id, "--lines", "1")
    assert shown.stdout.splitlines()[-1] == verdict_of(result), shown.stdout  # fab logs says why it ended
    assert {"rank-0.py-spy.txt", "rank-1.py-spy.txt"} <= {p.name for p in evidence.iterdir()}
    return evidence


def test_a_rank_sleeping_before_a_collective_is_named_with_its_frame(cluster):
    result, run_id, _ = launch(cluster, "sleep")
    line = verdict_of(result)
    assert re.fullmatch(
        rf"HANG run={run_id}: rank 1 \(node-1, pid \d+\) never entered all_reduce #4 "
        rf"\(1024 x float32\); rank 0 waiting since \d\d:\d\d:\d\d UTC; "
        rf"rank 1 is in load_batch \(hangcase.py:{LINE['sleep']}\)",
        line,
    ), line
    evidence = assert_hung_and_cleaned_up(cluster, result, run_id)
    assert "load_batch" in (evidence / "rank-1.py-spy.txt").read_text()
    assert json.loads((evidence / "rank-0.flight-recorder.json").read_text())["trace"]["entries"]


def test_a_rank_calling_a_different_collective_is_named_with_both_on_a_loaded_machine(cluster):
    with busy_cores():
        result, run_id, _ = launch(cluster, "op")
    line = verdict_of(result)
    assert "rank 1 (node-1, pid" in line, line  # the culprit is named, whatever gloo made of the two calls
    if "which the others left" not in line:
        # The usual outcome: each rank waits inside its own call, and both calls are named.
        assert "called broadcast #4 (1024 x float32) where rank 0 called all_reduce #4 (1024 x float32)" in line, line
        assert line.endswith(f"rank 1 is in <module> (hangcase.py:{LINE['op']})"), line
    # Seen once in four loaded runs: rank 1's count went past #4 while rank 0 still waited in it; past the
    # grace the verdict says so ("... which the others left: rank 1 (node-1, pid N) ... entered #6 ...").
    assert_hung_and_cleaned_up(cluster, result, run_id)


def test_a_stopped_rank_is_said_to_be_stopped_and_is_ended(cluster):
    result, run_id, _ = launch(cluster, "stop")
    line = verdict_of(result)
    assert "rank 1 (node-1, pid" in line and "is stopped (SIGSTOP) and never entered all_reduce #4" in line, line
    assert line.endswith(f"rank 1 is in load_batch (hangcase.py:{LINE['stop']})"), line
    assert_hung_and_cleaned_up(cluster, result, run_id)


def test_a_shape_mismatch_is_caught_by_gloo_and_named(cluster):
    """gloo checks sizes and aborts the rank that receives the wrong amount (NCCL would hang instead,
    which the verdict covers: see unit/test_hang.py), so fail-fast ends the job and fab names the mismatch."""
    result, run_id, _ = launch(cluster, "shape", timeout_s=30)
    assert result.returncode == 1 and "HANG" not in result.stdout, result.stdout
    mismatch = [line for line in result.stdout.splitlines() if line.startswith("fab: collective mismatch")]
    assert len(mismatch) == 1 and re.search(r"gloo received \d+ bytes where \d+ were expected", mismatch[0]), (
        result.stdout
    )
    # The rank comes from torchrun's report, which fail-fast can cut short; the node and frame are always there.
    assert re.search(
        r"(rank \d \(node-\d\)|a rank on node-\d) aborted in <module> \(hangcase\.py:\d+\)", mismatch[0]
    ), mismatch[0]


def test_a_slow_healthy_job_is_never_flagged(cluster):
    # Steps 1.5 x the timeout apart; 4 s, since ranks of a loaded machine enter a collective seconds apart.
    result, run_id, _ = launch(cluster, "slow", timeout_s=4)
    assert result.returncode == 0 and "HANG" not in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("done") == 2
    watched = json.loads((cluster.state_dir / cluster.stack / "runs" / run_id / "summary.json").read_text())
    assert watched["hang_watch"]["polls"] >= 3 and watched["hang_watch"]["ranks_seen"] == 2, watched  # it looked
