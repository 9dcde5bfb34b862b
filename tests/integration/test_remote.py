"""`fab` end to end on a real 2-node local cluster: bootstrap, launches, failures, stop, Ctrl-C."""

import json
import os
import re
import signal
import socket
import stat
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from node import contract
from tests.support import REPO, disks
from tests.support.cli import assert_one_line_error
from tests.support.clusters import (
    bootstrapped_cluster,
    metrics_of,
    processes_of,
    results_fetched_again,
    run_id_in,
    run_processes,
)
from tests.support.examples import TINY
from tests.support.network import free_port
from tests.support.outcomes import assert_rank_1_failed_first, failing_rank_script
from tests.support.races import assert_stop_ended_a_launch_being_prepared, stop_a_launch_being_prepared

PLAIN_SCRIPT = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
t = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("REPORT " + " ".join(f"{k}={os.environ[k]}" for k in
      ("RANK", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "CLUSTER_NODE")) + f" SUM={t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One bootstrapped 2-node cluster for the launch tests of this module."""
    with bootstrapped_cluster(tmp_path_factory, "remote") as handle:
        yield handle


def wait_for_output(proc: subprocess.Popen, *texts: str, timeout_s: float = 60) -> str:
    """Read a running fab's output until every one of `texts` has appeared."""
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(text in seen for text in texts):
        seen += proc.stdout.readline()
    if not all(text in seen for text in texts):
        raise AssertionError(f"{texts!r} not all seen in:\n{seen}")
    return seen


# ------------------------------------------------------------------------------------- bootstrap


def test_bootstrap_prepares_every_node_and_a_second_run_changes_nothing(cluster):
    first = cluster.first_bootstrap.stdout
    assert "all-reduce ok (2 ranks)" in first and "ready" in first
    assert "no guard set" in first and processes_of("harness.watchdog", cluster.state_dir) == []  # none asked for
    second = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
    assert second.returncode == 0
    for stage in ("probe", "deps", "code", "env", "health"):
        line = next(t for t in second.stdout.splitlines() if t.startswith(f"bootstrap: {stage}"))
        assert "done" not in line and "up to date" in line, line
    assert "nodes up to date" in second.stdout
    timeline = json.loads((cluster.state_dir / "local" / "bootstrap.json").read_text())["timeline"]
    names = [phase["phase"] for phase in timeline["phases"]]
    assert names == [
        "startup",
        "connect",
        "code",
        "probe",
        "deps",
        "env",
        "health",
        "scheduler",
        "watchdog",
        "preflight",
        "record",
    ]
    assert abs(timeline["total_s"] - timeline["wall_s"]) <= 0.05 * timeline["wall_s"], timeline
    assert set(timeline["nodes"]) == {"node-0", "node-1"} and "deps" in timeline["nodes"]["node-1"]
    assert "bootstrap: timeline: " in second.stdout


def test_ctrl_c_of_bootstrap_in_its_health_check_says_interrupted_and_exits_130(cluster):
    """Not `health failed` and exit 1, as a node that failed its all-reduce would read; the stages done
    before it stay recorded, so the next bootstrap finds them up to date."""
    boot = cluster.popen_fab("bootstrap", "--force", "--master-port", str(cluster.master_port))
    lines = []
    for line in boot.stdout:
        lines.append(line)
        if line.startswith("bootstrap: env"):
            time.sleep(1.5)  # into the health stage's all-reduce job
            boot.send_signal(signal.SIGINT)
            break
    lines += boot.stdout.readlines()
    output = "".join(lines)
    assert boot.wait(timeout=60) == 130, output
    assert output.rstrip().endswith("fab: interrupted (Ctrl-C)"), output
    assert "failed" not in output.lower(), output
    again = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
    assert again.returncode == 0 and "nodes up to date" in again.stdout, again.stdout + again.stderr


def test_every_node_gets_its_rank_and_the_same_master(cluster):
    shared = Path(cluster.info["shared_dir"])
    envs = {}
    for node in cluster.info["nodes"]:
        env_file = cluster.state_dir / "local" / "nodes" / node["name"] / ".gpu-cluster" / "env"
        envs[node["name"]] = dict(
            line[len("export ") :].split("=", 1)
            for line in env_file.read_text().splitlines()
            if line.startswith("export ")
        )
    assert [envs[n]["NODE_RANK"] for n in ("node-0", "node-1")] == ["0", "1"]
    assert envs["node-0"]["MASTER_ADDR"] == envs["node-1"]["MASTER_ADDR"] == cluster.info["nodes"][0]["private_ip"]
    assert envs["node-1"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert (shared / "code" / "harness" / "dist.py").read_bytes() == (REPO / "harness" / "dist.py").read_bytes()


def test_plain_ssh_shells_on_a_local_node_have_the_node_environment(cluster):
    inventory, node = cluster.info, cluster.info["nodes"][1]
    ssh = [
        "ssh",
        "-i",
        inventory["ssh_key"],
        "-p",
        str(node["ssh_port"]),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"UserKnownHostsFile={inventory['known_hosts']}",
        "-o",
        "StrictHostKeyChecking=yes",
        f"{node['ssh_user']}@{node['public_ip']}",
    ]
    wanted = ["1", inventory["nodes"][0]["private_ip"]]
    command = subprocess.run(ssh + ["echo $NODE_RANK $MASTER_ADDR $CLUSTER_PYTHON"], capture_output=True, text=True)
    assert command.stdout.split()[:2] == wanted and command.stdout.strip().endswith("/venv/bin/python"), command
    login = subprocess.run(ssh + ["bash -lc 'echo $NODE_RANK $MASTER_ADDR'"], capture_output=True, text=True)
    assert login.stdout.split() == wanted, login
    interactive = subprocess.run(
        ["ssh", "-tt", *ssh[1:]], input="echo RANK=$NODE_RANK\nexit\n", capture_output=True, text=True, timeout=30
    )
    assert "RANK=1" in interactive.stdout, interactive


def test_a_master_port_in_use_or_an_ssh_port_is_refused_before_anything_is_written(cluster):
    nodes = cluster.info["nodes"]
    written = [cluster.state_dir / "local" / "nodes" / n["name"] / ".gpu-cluster" / "env" for n in nodes]
    written.append(cluster.state_dir / "local" / "bootstrap.json")
    before = [(path.read_bytes(), path.stat().st_mtime_ns) for path in written]
    assert_one_line_error(cluster.fab("bootstrap", "--master-port", str(nodes[1]["ssh_port"])), "SSH port of node-")
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind((nodes[0]["private_ip"], port))
        squatter.listen()
        refused = cluster.fab("bootstrap", "--master-port", str(port))
    assert_one_line_error(refused, f"MASTER_PORT {port}", "node-0", nodes[0]["private_ip"], "in use", "--master-port")
    assert [(path.read_bytes(), path.stat().st_mtime_ns) for path in written] == before


# --------------------------------------------------------------------------------------- launches


def test_hello_runs_on_both_nodes_keeps_logs_and_a_summary_and_is_priced_in_the_ledger(cluster):
    began = time.monotonic()
    result = cluster.fab("hello")
    took = time.monotonic() - began
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[node-0] hello from 2 ranks on 2 nodes" in result.stdout and "all correct" in result.stdout
    assert "rank 0/2 on node-0" in result.stdout and "rank 1/2 on node-1" in result.stdout
    run_dir = cluster.runs()[-1]
    [checked] = metrics_of(run_dir, "summary")  # the example's own record, fetched with the run
    assert checked["world_size"] == 2 and checked["failures"] == {}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"] == "hello" and summary["exit_codes"] == {"node-0": 0, "node-1": 0}
    assert summary["cost_usd"] == 0 and summary["nodes"] == ["node-0", "node-1"]
    timeline = summary["timeline"]  # each phase named, contiguous, summing to the command's wall time
    names = [phase["phase"] for phase in timeline["phases"]]
    assert names[:2] == ["startup", "connect"] and names[-2:] == ["fetch", "record"], names
    assert "training" in names, names  # hello may end its collectives before its monitors first look
    assert abs(timeline["total_s"] - timeline["wall_s"]) <= 0.05 * timeline["wall_s"], timeline
    assert timeline["wall_s"] <= took and all(phase["s"] >= 0 for phase in timeline["phases"])
    [line] = [t for t in result.stdout.splitlines() if t.startswith("fab: timeline: ")]
    assert line.endswith(f"= {timeline['total_s']:.1f} s") and " · " in line, line
    assert "reporting in" in (run_dir / "node-0.log").read_text()
    assert (run_dir / "node-1.log").exists()
    logs = cluster.fab("logs", "--run", run_dir.name, "--lines", "5")
    shown = [line for line in logs.stdout.splitlines() if line.startswith("[node-0] ")]  # rank 0 prints for all
    assert logs.returncode == 0 and 0 < len(shown) <= 5 and "exit codes {'node-0': 0, 'node-1': 0}" in logs.stdout, (
        logs.stdout
    )

    report = json.loads(cluster.cli("cost", "--json").stdout)  # the run is in the ledger, priced
    [run] = [r for r in report["runs"] if r["run_id"] == summary["run_id"]]
    assert run["task"] == "hello" and run["exit_codes"] == {"node-0": 0, "node-1": 0} and run["cost_usd"] == 0
    [local] = report["clusters"]
    assert local["up"] and local["cost_usd"] == 0 and local["would_have_cost_usd"] > 0
    assert report["total_usd"] == 0
    assert "on AWS it would cost" in cluster.cli("cost").stdout


def test_run_ddp_trains_over_a_corrupt_ledger_and_max_restarts_resumes_both_nodes_to_the_same_parameters(cluster):
    """One straight run (the metrics fetched, the ledger set aside) and the same run crashed once at step 15
    under --max-restarts 1: it resumes from its step-10 checkpoint and ends with the straight run's weights."""
    for path in cluster.state_dir.glob("ledger.sqlite*"):
        path.unlink()
    (cluster.state_dir / "ledger.sqlite").write_bytes(b"garbage" * 1000)
    args = "--steps 30 --checkpoint-every 10"
    straight = cluster.fab("run-ddp", "--args", args + " --log-every 5")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert "warning: the ledger" in straight.stdout and "corrupt" in straight.stdout  # set aside, a new one begun
    assert list(cluster.state_dir.glob("ledger.sqlite.corrupt-*"))
    assert "parameters identical on all 2 ranks" in straight.stdout
    metrics = [json.loads(t) for t in (cluster.runs()[-1] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "step"] == [5, 10, 15, 20, 25, 30]
    phases = json.loads((cluster.runs()[-1] / "summary.json").read_text())["timeline"]["phases"]
    names = [p["phase"] for p in phases]  # the harness's first step is its own phase, after the model's setup
    assert names.index("start") < names.index("rendezvous") < names.index("first step") < names.index("training")
    assert phases[names.index("first step")]["s"] > 0, phases
    straight_summary = metrics_of(cluster.runs()[-1], "summary")[-1]

    restarted = cluster.fab("run-ddp", "--max-restarts", "1", "--args", args + " --simulate-failure-at-step 15")
    assert restarted.returncode == 0, restarted.stdout[-2000:] + restarted.stderr
    assert "[node-1] rank 1: failing on purpose at step 15" in restarted.stdout
    assert "resuming from step 10" in restarted.stdout
    restarted_dir = cluster.runs()[-1]
    assert json.loads((restarted_dir / "summary.json").read_text())["exit_codes"] == {"node-0": 0, "node-1": 0}
    resumed = metrics_of(restarted_dir, "summary")[-1]
    assert (resumed["resumed_from"], resumed["steps"]) == (10, 30)
    assert resumed["parameter_digest"] == straight_summary["parameter_digest"]


MULTINODE_SCRIPT = """
# In the style of pytorch/examples' distributed/ddp-tutorial-series/multinode.py: global rank 0 saves a
# snapshot every epoch; at start every rank loads it where it exists. Here the ranks also check, each
# epoch, that they are at the same one, and the last rank crashes once at epoch 2.
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
where, total_epochs = sys.argv[1], 4
snapshot_path = "snapshot.pt" if where == "cwd" else os.path.join(os.environ["CLUSTER_RUN_DIR"], "snapshot.pt")
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, epochs_run = torch.nn.Linear(4, 1), 0
if os.path.exists(snapshot_path):
    snapshot = torch.load(snapshot_path)
    model.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
    print(f"rank {rank}: resuming training from snapshot at epoch {epochs_run}", flush=True)
model = DDP(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
crashed = os.path.join(os.environ["CLUSTER_RUN_DIR"], "crashed")
for epoch in range(epochs_run, total_epochs):
    seen = torch.tensor([epoch, -epoch], dtype=torch.float)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen[0] != -seen[1]:
        print(f"rank {rank}: epochs out of step: {int(-seen[1])} to {int(seen[0])}", flush=True)
        sys.exit(5)
    optimizer.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    optimizer.step()
    if rank == 0:  # atomically, so a restart never reads half a file
        torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, snapshot_path + ".tmp")
        os.replace(snapshot_path + ".tmp", snapshot_path)
    dist.barrier()
    if epoch == 2 and rank == world - 1 and not os.path.exists(crashed):
        open(crashed, "w").close()
        sys.exit(1)
print(f"rank {rank}: trained to epoch {total_epochs}", flush=True)
dist.destroy_process_group()
"""


def test_max_restarts_resumes_a_multinode_style_snapshot_only_from_the_shared_run_dir(cluster, tmp_path):
    """The README's claim about pytorch/examples' multinode.py: a snapshot in the working directory is
    on node-0 only (rank 0 saves it), so after a restart node-0 resumes and node-1 starts over, and the
    ranks fall out of step; the same snapshot in $CLUSTER_RUN_DIR (shared storage) resumes every node."""
    script = tmp_path / "multinode.py"
    script.write_text(MULTINODE_SCRIPT)
    in_cwd = cluster.fab("run", "--script", str(script), "--max-restarts", "1", "--args", "cwd", timeout=300)
    assert in_cwd.returncode == 1, in_cwd.stdout[-3000:]
    assert "[node-0] rank 0: resuming training from snapshot at epoch 3" in in_cwd.stdout, in_cwd.stdout[-3000:]
    assert "[node-1] rank 1: resuming" not in in_cwd.stdout and "epochs out of step: 0 to 3" in in_cwd.stdout
    shared = cluster.fab("run", "--script", str(script), "--max-restarts", "1", "--args", "run", timeout=300)
    assert shared.returncode == 0, shared.stdout[-3000:] + shared.stderr
    for node in (0, 1):
        assert f"[node-{node}] rank {node}: resuming training from snapshot at epoch 3" in shared.stdout
        assert f"[node-{node}] rank {node}: trained to epoch 4" in shared.stdout


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+float\s+(\w+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$")


def parse_tables(lines: list[str]) -> dict[str, list[tuple]]:
    tables, current = {}, None
    for line in lines:
        heading = re.match(r"^# (\w+): \d+ ranks", line)
        if heading:
            current = tables.setdefault(heading.group(1), [])
        elif current is not None and (match := ROW.match(line)):
            current.append(match.groups())
    return tables


def test_profile_prints_nccl_tests_tables_that_agree_with_its_json_and_fetches_both_and_a_plot(cluster):
    result = cluster.fab("profile", "--args", "--max-bytes 8K --warmup 1 --iters 2 --plot busbw.png")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    head = [line[len("[node-0] ") :] for line in result.stdout.splitlines() if line.startswith("[node-0] ")]
    tables = parse_tables(head)
    assert set(tables) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert sum(line.startswith("# Avg bus bandwidth") for line in head) == 4
    results = cluster.run_dir(result.stdout) / "results"  # by declaration
    report = json.loads((results / "profile.json").read_text())
    n = report["world_size"]
    assert n == 2 and len(report["results"]) == 4 * 4  # 1K, 2K, 4K and 8K for each collective
    for row in report["results"]:
        factor = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0,
        }[row["op"]]
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["wrong"] == 0
    for op, rows in tables.items():
        json_rows = [r for r in report["results"] if r["op"] == op]
        assert len(rows) == len(json_rows) == 4
        for printed, data in zip(rows, json_rows, strict=True):
            assert int(printed[0]) == data["size_bytes"] and int(printed[1]) == data["count"]
            assert float(printed[4]) == pytest.approx(data["time_us"], abs=0.051)
            assert float(printed[6]) == pytest.approx(data["busbw_gbps"], abs=0.0051)
            assert int(printed[7]) == data["wrong"] == 0
    assert (results / "busbw.png").read_bytes()[:4] == b"\x89PNG"


def test_accumulate_all_reduces_once_per_optimizer_step_across_the_nodes(cluster):
    result = cluster.fab("accumulate", "--args", "-k 2 --steps 2 --log-every 1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "[node-0] all-reduce per optimizer step: 1 gradient synchronisation(s)" in result.stdout
    summary = metrics_of(cluster.run_dir(result.stdout), "summary")[-1]
    assert (summary["k"], summary["steps"], summary["synchronisations_per_step"]) == (2, 2, 1)


def test_model_parallel_runs_one_pipeline_stage_per_node(cluster):
    result = cluster.fab("model-parallel", "--args", "--steps 2 -m 2 --log-every 1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "[node-0] 2 stages x 2 layers" in result.stdout
    assert "theory (p-1)/(m+p-1) = 33.3%" in result.stdout  # p = 2 nodes, m = 2 micro-batches
    assert "[node-0] stages: 0 on node-0, 1 on node-1" in result.stdout
    summary = metrics_of(cluster.run_dir(result.stdout), "summary")[-1]
    assert summary["stages"] == 2 and summary["stage_nodes"] == ["node-0", "node-1"]  # one stage per node
    assert summary["bubble_theory"] == pytest.approx(1 / 3) and 0 <= summary["bubble_measured"] < 1


def test_fab_hybrid_runs_2_nodes_x_2_processes_and_resumes_on_2_ranks(cluster):
    """The lab's 4-rank mesh through the real launcher, and a checkpoint it saves resumed on 2 ranks."""
    args = " ".join(TINY) + " --steps 2 --checkpoint-dir ckpt/hybrid"
    four = cluster.fab("hybrid", "--nproc-per-node", "2", "--args", args)
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr
    assert "[node-0 rank 0] mesh dp(2) x tp(2):" in four.stdout  # 2 ranks a node: each line names its rank
    assert "[node-0 rank 0]   replica 0: ranks 0, 1 on node-0" in four.stdout  # global rank 0 is on node-0
    assert "[node-0 rank 0]   replica 1: ranks 2, 3 on node-1" in four.stdout
    two = cluster.fab("hybrid", "--args", args)  # one process per CPU node: dp(2) x tp(1)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr
    assert "saved by 4 ranks, loaded onto 2" in two.stdout
    digest = lambda out: re.search(r"parameters sha256 (\w+) at step 2", out).group(1)  # noqa: E731
    assert digest(two.stdout) == digest(four.stdout)


def test_fab_refuses_a_process_count_below_1_before_anything_runs(cluster):
    before = cluster.runs()
    assert_one_line_error(cluster.fab("hybrid", "--nproc-per-node", "0"), "--nproc-per-node", "from 1 to 256")
    assert_one_line_error(cluster.fab("hello", "--nproc-per-node", "two"), "--nproc-per-node", "whole number")
    assert cluster.runs() == before


def test_fab_refuses_replicas_that_do_not_fit_before_anything_runs(cluster):
    before = cluster.runs()
    assert_one_line_error(cluster.fab("run", "--script", FT_SCRIPT, "--replicas", "1"), "--replicas", ">= 2")
    assert_one_line_error(cluster.fab("run", "--script", FT_SCRIPT, "--replicas", "3"), "--replicas 3", "2 node(s)")
    conflict = cluster.fab("run", "--script", FT_SCRIPT, "--replicas", "2", "--hang-timeout", "60")
    assert_one_line_error(conflict, "--replicas runs without the hang watch", "--hang-timeout")
    # an example that does not follow the contract would train each group alone: refused, with the ones that do
    alone = cluster.fab("accumulate", "--replicas", "2")
    assert_one_line_error(alone, "--replicas needs a script that follows torchft's contract", "fab run-ddp --replicas")
    assert cluster.runs() == before


def test_a_plain_torchrun_script_sees_distinct_node_ranks_and_one_master(cluster, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(PLAIN_SCRIPT)
    result = cluster.fab("run", "--script", str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [
        dict(kv.split("=") for kv in line.split("REPORT ")[1].split())
        for line in result.stdout.splitlines()
        if "REPORT " in line
    ]
    assert len(reports) == 2
    assert sorted(r["NODE_RANK"] for r in reports) == ["0", "1"]
    assert {r["MASTER_ADDR"] for r in reports} == {cluster.info["nodes"][0]["private_ip"]}
    assert all(r["SUM"] == "3" for r in reports)
    by_node = {r["CLUSTER_NODE"]: r for r in reports}
    assert by_node["node-0"]["RANK"] == "0" and by_node["node-0"]["GROUP_RANK"] == "0"
    assert "ok in" in result.stdout and "process group" not in result.stdout  # its group lived a few ms


def test_a_failing_rank_ends_the_whole_job_quickly_and_leaves_nothing(cluster, tmp_path):
    started = time.monotonic()
    result = cluster.fab("run", "--script", str(failing_rank_script(tmp_path)), timeout=120)
    elapsed = time.monotonic() - started
    row = assert_rank_1_failed_first(result, cluster.fab("jobs", "--json").stdout)  # as a Slurm-held run says
    assert row["holder"] == "fab", row
    assert "fab: node-1 exited 1 (rank 1 exited 3): stopping the job on node-0" in result.stdout
    assert "[node-1] Traceback" not in result.stdout  # its torchrun's failure record, not a Python traceback
    assert elapsed < 60, elapsed  # without fail-fast node-0 waits out the 10-minute rendezvous timeout
    run_dir = cluster.runs()[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_codes"]["node-1"] == 1 and summary["rank_exit_codes"]["node-1"] == {"1": 3}
    assert run_processes(summary["run_id"]) == []


PROGRESS_SCRIPT = """
import os, sys, time
rank, go = os.environ["RANK"], sys.argv[1]
sys.stdout.write(f"\\rLIVE {rank} 10%"); sys.stdout.flush()  # a progress bar, redrawn with \\r
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:  # the test has seen every bar
    time.sleep(0.1)
print(f"\\rLIVE {rank} 100%", flush=True)
"""


def read_until(proc: subprocess.Popen, *texts: bytes, timeout_s: float = 120) -> bytes:
    """A running fab's raw output until every one of `texts` has appeared, unfinished lines included."""
    seen, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(text in seen for text in texts):
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        seen += chunk
    if not all(text in seen for text in texts):
        raise AssertionError(f"{texts!r} not all seen in:\n{seen!r}")
    return seen


def test_each_rank_is_named_its_progress_shows_live_and_a_job_without_a_process_group_is_said(cluster, tmp_path):
    """2 ranks per node: each line says node and rank; a bar redrawn with \\r arrives before its line
    ends (the script waits for the test to see it); no rank formed a process group, and fab says so."""
    script, go = tmp_path / "progress.py", tmp_path / "go"
    script.write_text(PROGRESS_SCRIPT)
    job = cluster.popen_fab("run", "--script", str(script), "--nproc-per-node", "2", "--args", str(go), text=False)
    try:
        bars = [f"[node-{rank // 2} rank {rank}] LIVE {rank} 10%".encode() for rank in range(4)]
        seen = read_until(job, *bars)
        go.write_text("")
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    text = (seen + out).decode()
    assert job.returncode == 0, text
    for rank in range(4):
        assert f"[node-{rank // 2} rank {rank}] LIVE {rank} 100%" in text, text
    assert len(re.findall(r"LIVE \d+ 100%", text)) == 4, text  # 2 processes per node, no more
    assert "ok in" in text and "but no rank joined a process group" in text, text
    summary = json.loads((cluster.run_dir(text) / "summary.json").read_text())
    assert summary["rank_exit_codes"] == {}


def start_sleeping_job(cluster, tmp_path) -> tuple[subprocess.Popen, str]:
    """`fab run` of a script that sleeps on every rank, returned with its run id once it runs everywhere."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    job = cluster.popen_fab("run", "--script", str(script))
    return job, run_id_in(wait_for_output(job, "[node-0] sleeping", "[node-1] sleeping"))


FLOOD_SCRIPT = """
import sys
line = "x" * 99 + "\\n"
while True:
    sys.stdout.write(line * 1000)
"""


def test_ctrl_c_during_a_flood_of_output_stops_cleanly(cluster, tmp_path):
    """A job writing as fast as it can: Ctrl-C stops it everywhere (exit 130, no process of the run left)
    and fab ends in its own words, with no traceback from output still arriving while fab closes its streams."""
    script = tmp_path / "flood.py"
    script.write_text(FLOOD_SCRIPT)
    job = cluster.popen_fab("run", "--script", str(script), text=False)
    flood = b"x" * 99
    try:
        seen = read_until(job, b"[node-0] " + flood, b"[node-1] " + flood).replace(flood, b"")
        job.send_signal(signal.SIGINT)
        while chunk := os.read(job.stdout.fileno(), 1 << 20):
            seen += chunk.replace(flood, b"")  # what is left besides the flood: fab's own lines
        assert job.wait(timeout=60) == 130
    finally:
        job.kill()
    text = seen.decode(errors="replace")
    # fab's own lines only: torchrun itself may print a traceback as it is stopped (its SIGTERM handler
    # raising inside a finalizer, seen once in CI), and that is the job's output, kept as it came.
    own = "\n".join(line for line in text.splitlines() if not line.startswith("[node-"))
    assert "interrupted: stopping the job on every node" in own, text[-3000:]
    assert "Traceback" not in own and "Error" not in own, own[-3000:]
    assert "ValueError: I/O operation on closed file" not in text, text[-3000:]
    assert run_processes(run_id_in(text)) == []


def test_launches_at_the_same_moment_wait_their_turn_and_run_one_after_another(cluster, tmp_path):
    script = tmp_path / "stamp.py"  # node-0 records when each run's script ran
    script.write_text(
        "import os, sys, time\n"
        "start = time.time()\n"
        "time.sleep(1.5)\n"
        "if os.environ['CLUSTER_NODE'] == 'node-0':\n"
        "    with open(sys.argv[1], 'a') as f:\n"
        "        f.write(f\"{os.environ['CLUSTER_RUN_ID']} {start} {time.time()}\\n\")\n"
    )
    stamps = tmp_path / "stamps"
    before = cluster.runs()
    trio = [cluster.popen_fab("run", "--script", str(script), "--args", str(stamps)) for _ in range(3)]
    outcomes = [(job.communicate(timeout=300), job.returncode) for job in trio]
    assert [code for _, code in outcomes] == [0, 0, 0], outcomes  # all accepted, none refused
    said = [out for (out, _), _ in outcomes]
    assert any("waits its turn (Ctrl-C gives up)" in out for out in said), said
    ran = sorted(
        (float(start), float(end), run_id)
        for run_id, start, end in (line.split() for line in stamps.read_text().splitlines())
    )
    assert sorted(r for _, _, r in ran) == sorted(run_id_in(out) for out in said)
    assert all(later[0] >= earlier[1] for earlier, later in zip(ran, ran[1:], strict=False)), ran  # never at once
    assert len(cluster.runs()) == len(before) + 3


def test_fail_fast_names_the_node_that_failed_first_by_its_own_clock(cluster, tmp_path):
    script = tmp_path / "both_fail.py"
    # node-0 fails first, but a child holds its SSH output open (the launch shell's, whose pid the job
    # file records: a rank's own output goes through node/torchrun.py), so its SSH call returns last.
    script.write_text(
        "import os, subprocess, sys, time\n"
        "if os.environ['CLUSTER_NODE'] == 'node-0':\n"
        f"    shell = open(os.path.expanduser('~/{contract.JOB}')).read().split()[0]\n"
        "    subprocess.Popen(['sleep', '30'], stdout=open(f'/proc/{shell}/fd/1', 'w'))\n"
        "    sys.exit(3)\n"
        "time.sleep(2)\n"
        "sys.exit(4)\n"
    )
    result = cluster.fab("run", "--script", str(script), timeout=120)
    assert result.returncode == 1
    assert "fab: node-1 exited" in result.stdout  # fab saw node-1's call return first...
    assert "(first: node-0, rank 0 exited first by its clock, log: " in result.stderr  # ...and names node-0
    assert "node-0.log" in result.stderr
    assert "__gpu_cluster_exit__" not in result.stdout + (cluster.runs()[-1] / "node-0.log").read_text()


def listening_addresses(pids: list[int]) -> list[str]:
    """`address:port` of every listening TCP socket the processes hold (from /proc/net/tcp and tcp6)."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                listening[fields[9]] = f"{socket.inet_ntop(*_raw_address(address))}:{int(port, 16)}"
    found = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.append(listening[target[8:-1]])
    return found


def _raw_address(hex_address: str) -> tuple[int, bytes]:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return (socket.AF_INET if len(raw) == 4 else socket.AF_INET6), words


def test_a_running_job_listens_on_loopback_only_a_second_waits_and_stop_ends_both(cluster, tmp_path):
    script = tmp_path / "listen.py"
    script.write_text(
        "import time, torch.distributed as dist\n"
        "dist.init_process_group('gloo'); dist.barrier()\n"
        "print('joined', flush=True); time.sleep(600)\n"
    )
    job = cluster.popen_fab("run", "--script", str(script))
    try:
        run_id = run_id_in(wait_for_output(job, "[node-0] joined"))  # past the barrier: every rank is up
        addresses = listening_addresses(run_processes(run_id))
        head = cluster.info["nodes"][0]["private_ip"]
        assert f"{head}:{cluster.master_port}" in addresses  # the rendezvous store, on MASTER_ADDR only
        assert len(addresses) >= 3  # with the workers' store and gloo's sockets
        assert all(a.startswith("127.") for a in addresses), addresses

        second = cluster.popen_fab(
            "hello", stderr=subprocess.PIPE
        )  # waits its turn, saying so, and fab stop ends it too
        wait_for_output(second, f"busy with run {run_id}", "waits its turn")
        stopped = cluster.fab("stop")
        assert stopped.returncode == 0 and stopped.stdout.count("stopped") == 2
        assert job.wait(timeout=30) == 1
        said = job.stdout.read()
        assert f"run {run_id} was stopped from outside" in said, said  # not "failed: node-0 exited 143"
        _, refused = second.communicate(timeout=60)
        assert second.returncode == 1 and "nothing was started" in refused, refused
    finally:
        job.kill()
    assert run_processes(run_id) == []


def test_fab_stop_names_a_launch_it_finds_preparing_and_that_launch_starts_nothing(cluster, tmp_path):
    """fab stop racing a launch (issue 40): stop ends the job lock's holder first and names its run, and
    that launch, let go on after the stop, starts no rank (the same for the Slurm holder:
    test_scheduled_runs.py); it said it stopped the run, not one that then ran to completion."""
    assert_stop_ended_a_launch_being_prepared(*stop_a_launch_being_prepared(cluster, tmp_path))


def test_a_killed_fab_leaves_no_run_open_in_the_ledger(cluster, tmp_path):
    job, run_id = start_sleeping_job(cluster, tmp_path)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    killed_at = time.time()
    [run] = [r for r in json.loads(cluster.cli("cost", "--json").stdout)["runs"] if r["run_id"] == run_id]
    assert run["ended_at"] is not None and "gone" in run["end_reason"], run
    ended = datetime.fromisoformat(run["ended_at"]).timestamp()
    assert datetime.fromisoformat(run["started_at"]).timestamp() <= ended <= killed_at
    assert "gone" in cluster.cli("cost").stdout  # the table says why instead of "running"
    deadline = time.monotonic() + 60  # its SSH sessions closed: the nodes end the job and free the lock
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes(run_id) == []


def test_logs_of_an_unknown_run_are_refused_and_gpus_reports_cpu_nodes(cluster):
    assert_one_line_error(cluster.fab("logs", "--run", "no-such-run"), "no run")
    gpus = cluster.fab("gpus")
    assert gpus.returncode == 0 and gpus.stdout.count("no GPU (CPU node, gloo)") == 2


def test_a_missing_script_or_a_node_without_room_is_refused_before_anything_starts(cluster, tmp_path):
    before = cluster.runs()
    assert_one_line_error(cluster.fab("run", "--script", "/no/such/script.py"), "no such script")
    assert cluster.runs() == before
    if disks.unavailable():
        pytest.skip(disks.unavailable())
    script = tmp_path / "fine.py"
    script.write_text("print('never runs')\n")
    node_runs = cluster.state_dir / cluster.stack / "nodes" / "node-1" / contract.RUNS
    with disks.small_filesystem(node_runs, "2m"):  # node-1's own disk, nearly full
        refused = cluster.fab("run", "--script", str(script))
    assert_one_line_error(refused, "node-1 has no room for a run", "MiB free, a run needs 64 MiB")
    assert cluster.runs() == before


# ------------------------------------------------------------------------ fault tolerance (torchft)

FT_SCRIPT = str(REPO / "examples" / "ft_training.py")


def ft_steps(cluster, run_id: str) -> dict[int, list[dict]]:
    """Each replica group's lines of the contract (`$CLUSTER_RUN_DIR/metrics.jsonl`), by replica."""
    path = Path(cluster.info["shared_dir"]) / "runs" / run_id / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_replica: dict[int, list[dict]] = {}
    for line in lines:
        if line.get("kind") == "ft_step":
            by_replica.setdefault(line["replica"], []).append(line)
    return by_replica


def kill_ranks_of(run_id: str, node: str) -> list[int]:
    """SIGKILL the ranks (not torchrun's agent) that `node` runs for the run."""
    killed = []
    for pid in run_processes(run_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"CLUSTER_NODE={node}".encode() in environ and any(v.startswith(b"LOCAL_RANK=") for v in environ):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def test_replicas_a_group_whose_ranks_are_killed_is_dropped_and_the_other_goes_on_without_redoing_a_step(cluster):
    from tests.support.slurm import listening_sockets

    job = cluster.popen_fab("run", "--script", FT_SCRIPT, "--replicas", "2", "--args", "--steps 60 --step-sleep 0.1")
    try:
        run_id = run_id_in(wait_for_output(job, "replica 1 step   10", timeout_s=120))
        pids = set(run_processes(run_id))
        sockets = [(address, port) for address, port, pid in listening_sockets() if pid in pids]
        nodes = {node["private_ip"] for node in cluster.info["nodes"]}
        lighthouse = (
            cluster.info["nodes"][0]["private_ip"],
            cluster.master_port + contract.LIGHTHOUSE_PORT_ABOVE_MASTER,
        )
        assert lighthouse in sockets, sockets
        assert len(sockets) >= 6, sockets  # per group: rendezvous, workers' store, Manager, checkpoint server
        assert {address for address, _ in sockets} <= nodes, [s for s in listening_sockets() if s[2] in pids]
        killed_at = time.time()
        assert kill_ranks_of(run_id, "node-1")
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "replica group 1 (node-1) dropped; replica group(s) on node-0 go on" in out, out[-3000:]
    assert "without the replica group(s) on node-1 (dropped)" in out
    survivor = ft_steps(cluster, run_id)[0]
    first = survivor[0]["step"]  # a group that joins the first quorum late heals to its peer's step
    assert [line["step"] for line in survivor] == list(range(first, 61))  # every step once: none repeated
    after = [line for line in survivor if line["time"] > killed_at]
    assert after and after[-1]["participants"] == 1 and any(line["participants"] == 2 for line in survivor)
    gaps = [b["time"] - a["time"] for a, b in zip(survivor, survivor[1:], strict=False)]
    print(f"survivor's longest step gap: {max(gaps):.2f} s (steps {len(survivor)}, none repeated)")
    assert max(gaps) < 15, gaps
    summary = json.loads((cluster.runs()[-1] / "summary.json").read_text())
    assert summary["exit_codes"]["node-0"] == 0 and summary["exit_codes"]["node-1"] != 0


def test_replicas_a_restarted_group_heals_live_from_its_peer_and_rejoins_with_equal_weights(cluster):
    job = cluster.popen_fab(
        "run", "--script", FT_SCRIPT, "--replicas", "2", "--max-restarts", "1", "--args", "--steps 150 --step-sleep 0.1"
    )
    try:
        run_id = run_id_in(wait_for_output(job, "replica 1 step   10", timeout_s=120))
        killed_at = time.time()
        assert kill_ranks_of(run_id, "node-1")
        out, _ = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "dropped" not in out and "resumed from" not in out  # no checkpoint read: healed from the peer
    steps = ft_steps(cluster, run_id)
    survivor, healed = steps[0], steps[1]
    assert [line["step"] for line in survivor] == list(range(survivor[0]["step"], 151))
    healed_steps = [line["step"] for line in healed]
    assert healed_steps == sorted(set(healed_steps)), healed_steps  # it redid no step either
    missed = [b - a for a, b in zip(healed_steps, healed_steps[1:], strict=False) if b - a > 1]
    assert missed, healed_steps  # it rejoined at its peer's step, not where it had died
    assert healed[-1]["participants"] == 2 and healed_steps[-1] == 150
    by_step = {line["step"]: line["params_sha"] for line in survivor}
    back = next(
        b for a, b in zip(healed, healed[1:], strict=False) if b["step"] - a["step"] > 1
    )  # its first step healed
    assert back["params_sha"] == by_step[back["step"]]  # the peer's weights, exactly, at its first step back
    shared = [line for line in healed if line["step"] in by_step]
    assert all(line["params_sha"] == by_step[line["step"]] for line in shared), "weights differ from the peer's"
    took = back["time"] - killed_at
    print(f"healed group: back at step {back['step']} {took:.1f} s after the kill, {max(missed) - 1} steps missed")


def test_replicas_run_ddp_trains_as_replica_groups_and_writes_the_contract(cluster):
    # The course's DDP example follows the contract: under --replicas its groups train the same model in
    # harness/fault_tolerance.py's loop, each group's first rank writing one line per committed step.
    result = cluster.fab("run-ddp", "--replicas", "2", "--args", "--steps 12 --samples 512 --log-every 4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    steps = ft_steps(cluster, run_id_in(result.stdout))
    assert sorted(steps) == [0, 1], steps
    assert "[node-1] replica 1 step   12 loss" in result.stdout
    for lines in steps.values():
        numbers = [line["step"] for line in lines]
        assert numbers == list(range(numbers[0], 13)), numbers  # each committed step once, to the last
        assert set(lines[0]) >= {"step", "time", "replica", "participants", "params_sha"}
    by_step = {line["step"]: line for line in steps[0]}
    assert all(
        line["params_sha"] == by_step[line["step"]]["params_sha"] for line in steps[1] if line["step"] in by_step
    )
    assert any(line["participants"] == 2 for line in steps[1])  # trained together, the same weights


# ------------------------------------------------------------------------------------- private state


def test_every_file_of_the_state_folder_stays_private_through_the_runs_and_down(cluster, tmp_path):
    """Last in this module: the launches above wrote runs, logs, results and the ledger; this one writes a
    result and passes an argument that lands in the nodes' logs."""
    script = tmp_path / "job.py"
    script.write_text('import os\nopen(os.environ["CLUSTER_RESULTS_DIR"] + "/result.txt", "w").write("ok")\n')
    run = cluster.fab("run", "--script", str(script), "--args", "--secret-looking-argument")
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = cluster.run_dir(run.stdout)
    assert (run_dir / "results" / "result.txt").read_text() == "ok" and (run_dir / "summary.json").exists()
    assert results_fetched_again(cluster, run_dir, "result.txt") == "ok"  # as test_scheduled_runs' for Slurm's
    assert not_private(cluster.state_dir) == []
    assert cluster.cli("down", "--stack", cluster.stack).returncode == 0
    assert (run_dir / "node-0.log").exists() and (cluster.state_dir / "ledger.sqlite").exists()
    assert not_private(cluster.state_dir) == []


def not_private(root) -> list[str]:
    """Everything under `root` (itself included) that its group or others may read, write or enter."""
    found = []
    for folder, dirs, files in os.walk(root):
        if os.path.basename(folder) == "venv" and os.path.basename(os.path.dirname(folder)) == ".gpu-cluster":
            dirs[:] = []  # a node's venv is what `python -m venv` makes on any machine; the home around it is 0700
            files = []
        for path in [folder, *(os.path.join(folder, name) for name in files)]:
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                found.append(f"{stat.S_IMODE(mode):04o} {path}")
    return found
