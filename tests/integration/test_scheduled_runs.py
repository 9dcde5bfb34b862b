"""Runs held by Slurm on the cluster (`fab bootstrap`'s default where the nodes have Slurm), end to end on a
local cluster with real slurmctld and slurmd: a run outlives its fab, runs queue one at a time in order, a cancel leaves
nothing, and a run that ended while nothing was connected is priced."""

import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from node import contract
from node.slurm_conf import Paths
from tests.support import REPO, disks, slurm, throttle
from tests.support.cli import assert_one_line_error
from tests.support.clusters import (
    CMDLINE_LEAKS,
    Cluster,
    bootstrapped_cluster,
    files_holding,
    results_fetched_again,
    run_id_in,
    run_processes,
)
from tests.support.network import free_port
from tests.support.outcomes import assert_rank_1_failed_first, failing_rank_script
from tests.support.races import assert_stop_ended_a_launch_being_prepared, stop_a_launch_being_prepared

pytestmark = pytest.mark.skipif(slurm.unavailable() is not None, reason=f"Slurm: {slurm.unavailable()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with bootstrapped_cluster(
        tmp_path_factory,
        "scheduled",
        master_port=slurm.free_ports(),
        scheduler=None,  # auto finds Slurm
        up_args=("--gpus", "1"),  # a fake GPU each, in Slurm: one process per node, as on CPU nodes
    ) as handle:
        yield handle


def detached(cluster, *args: str) -> str:
    """Submit with --detach; the run id, the last line of stdout."""
    result = cluster.fab(*args, "--detach")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def jobs(cluster) -> dict:
    result = cluster.fab("jobs", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return {row["run_id"]: row for row in json.loads(result.stdout)}


def wait_for_state(cluster, run_id: str, *states: str) -> dict:
    seen: dict = {}

    def reached() -> bool:
        seen.update(jobs(cluster)[run_id])
        return seen["state"] in states

    slurm.wait_for(reached, f"run {run_id} {' or '.join(states)}", lambda: json.dumps(seen))
    return seen


def script(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return path


def test_bootstrap_starts_slurm_on_every_node_on_loopback_only(cluster):
    assert "scheduler" in cluster.first_bootstrap.stdout and "slurmctld" in cluster.first_bootstrap.stdout
    setup = json.loads((cluster.state_dir / cluster.stack / "bootstrap.json").read_text())
    assert (setup["scheduler_choice"], setup["scheduler"], setup["scheduler_why"]) == ("auto", "slurm", "")
    again = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))  # the choice is remembered
    assert again.returncode == 0 and "scheduler up to date" in again.stdout, again.stdout
    ours = {pid for pid in _slurm_pids(cluster)}
    sockets = [s for s in slurm.listening_sockets() if s[2] in ours]
    assert sockets, "no Slurm daemon listens"
    assert all(ipaddress.ip_address(address).is_loopback for address, _, _ in sockets), sockets
    status = json.loads(cluster.cli("status", "--json").stdout)  # each node's Slurm state
    assert [n["scheduler"] for n in status["nodes"]] == ["idle", "idle"], status


def test_a_second_stack_with_the_same_master_port_is_refused_before_it_writes(cluster, tmp_path):
    """Another stack on other loopback addresses, same --master-port: its MASTER_ADDR port is free, but
    Slurm's daemons listen at the host name's address, where this stack's already do."""
    other = Cluster(tmp_path / "state", stack="other")
    try:
        refused = other.fab("bootstrap", "--master-port", str(cluster.master_port))
        assert_one_line_error(refused, "a port Slurm's daemons need on node-0 is taken", "--master-port")
        assert not (other.state_dir / "other" / "bootstrap.json").exists()
        written = [p for p in other.state_dir.rglob("code") if p.parent.name == ".gpu-cluster"]
        assert not written, written  # no stage ran: no code synced to its nodes
    finally:
        other.down()


def test_slurms_clients_work_as_typed_in_a_login_through_deploy_ssh_and_ssh_config(cluster, tmp_path):
    """A Slurm user's reflexes, with no environment line first: `squeue`, `sinfo`, `sbatch`, `scontrol`,
    `srun` in a login on node-0 (`deploy.py ssh`) and on node-1 (plain `ssh -F` with the file
    `deploy.py ssh-config` writes); a job's NAME (a run id) is shown whole, not cut to its date."""
    commands = (
        "sbatch --job-name=20990101-000000-hello-abcd --wrap 'sleep 20' >/dev/null && squeue && sinfo --noheader "
        "--format=%T && scontrol show partition >/dev/null && "
        "scancel --name=20990101-000000-hello-abcd"
    )
    result = cluster.cli("ssh", "node-0", "--", "bash", "-c", shlex.quote(commands))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "20990101-000000-hello-abcd" in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1].strip() in ("idle", "allocated", "mixed"), result.stdout
    config = tmp_path / "cluster.ssh"
    config.write_text(cluster.cli("ssh-config").stdout)
    answer = subprocess.run(
        [
            "ssh",
            "-F",
            str(config),
            "node-1",
            "sinfo --noheader --format=%D && srun --nodes=2 --ntasks-per-node=1 printenv SLURMD_NODENAME",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stdout + answer.stderr
    words = answer.stdout.split()
    assert words[0] == "2" and sorted(words[1:]) == ["node-0", "node-1"], answer.stdout


STOCK_SCRIPTS = REPO / "tests" / "fixtures" / "slurm"


def test_stock_sbatch_scripts_asking_gpus_per_task_run_on_nodes_with_fake_gpus(cluster):
    """`up --local --gpus 1`: pytorch/examples' sbatch script, submitted with sbatch on node-0 from the shared
    folder as a user would (their venv on PATH), runs to COMPLETED: Slurm gives each task its GPU
    (CUDA_VISIBLE_DEVICES, as --gres=gpu:1 does) and torch trains on the CPU. torchtitan's asks for the
    same and its partition: Slurm would run it now (`--test-only`; a second torchrun start is time)."""
    shared = cluster.state_dir / cluster.stack / "shared"
    for name in ("ddp_tutorial_sbatch_run.sh", "torchtitan_multinode_trainer.slurm"):
        text = (STOCK_SCRIPTS / name).read_text().replace("__PORT__", str(free_port()))
        (shared / name).write_text(text.replace("__SCRIPT__", str(REPO / "examples" / "distributed_hello.py")))
    commands = (
        f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH && cd {shlex.quote(str(shared))} && "
        "srun --nodes=2 --gpus-per-task=1 printenv CUDA_VISIBLE_DEVICES && srun --nodes=1 --gres=gpu:1 true && "
        "sbatch --test-only torchtitan_multinode_trainer.slurm && sbatch --parsable --wait ddp_tutorial_sbatch_run.sh"
    )
    result = cluster.cli("ssh", "node-0", "--", "bash", "-c", shlex.quote(commands))
    job = result.stdout.split()[-1] if result.stdout.split() else "?"
    output = shared / f"slurm-{job}.out"
    log = output.read_text() if output.exists() else "(no output file)"
    assert result.returncode == 0, result.stdout + result.stderr + log
    assert result.stdout.split()[:2] == ["0", "0"], result.stdout
    assert "to start at" in result.stderr, result.stderr  # --test-only: where and when it would run
    assert "all-reduce, broadcast and all-gather checked, all correct" in log, log


def _slurm_pids(cluster) -> list[int]:
    home = str(cluster.state_dir / cluster.stack / "nodes")
    found = []
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                if os.readlink(f"/proc/{proc}/cwd").startswith(home) and "slurm" in open(f"/proc/{proc}/comm").read():
                    found.append(int(proc))
            except OSError:
                continue
    return found


def test_a_detached_run_returns_at_once_and_is_followed_to_its_end_with_results(cluster, tmp_path):
    project = tmp_path / "project"  # a project folder: each node's copy of it is made at submit time
    project.mkdir()
    (project / "steps.py").write_text("COUNT = 3\n")
    script(
        project,
        "work.py",
        "from steps import COUNT\n"
        "for step in range(COUNT):\n"
        "    print(f'rank {rank} step {step}', flush=True); time.sleep(0.5)\n"
        "if rank == 0:\n"
        "    open(os.path.join(os.environ['CLUSTER_RESULTS_DIR'], 'done.txt'), 'w').write('done')\n",
    )
    run_id = detached(cluster, "run", "--workdir", str(project), "--script", "work.py")
    followed = cluster.fab("logs", "-f", "--run", run_id)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "[node-1] rank 1 step 2" in followed.stdout and f"run {run_id} ok" in followed.stdout
    folder = cluster.state_dir / cluster.stack / "runs" / run_id
    assert (folder / "results" / "done.txt").read_text() == "done"
    assert results_fetched_again(cluster, folder, "done.txt") == "done"  # as test_remote's for fab's
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["state"] == "COMPLETED" and summary["exit_codes"] == {"node-0": 0, "node-1": 0}
    assert "rank 0 step 0" in (folder / "node-0.log").read_text()
    again = cluster.fab("logs", "-f", "--run", run_id)  # following again: the same end, the same code
    assert again.returncode == 0 and f"run {run_id} ok" in again.stdout
    assert "\n[node-1] rank 1 step 2\n" in again.stdout and "[node-1] [node-1]" not in again.stdout  # one prefix
    # A follower far behind the finished run (the dashboard's, say) still holds the copy here: fab logs says so
    # and shows the whole log from the head node; once the copy is free, it brings the rest into it
    for name in ("node-0.log", "node-1.log", "cluster.log"):
        (folder / name).unlink(missing_ok=True)
    with open(folder / "output.log", "r+b") as behind:
        behind.truncate(0)
        fcntl.flock(behind, fcntl.LOCK_EX)
        shown = cluster.fab("logs", "--run", run_id)
    assert shown.returncode == 0 and "[node-1] rank 1 step 2" in shown.stdout, shown.stdout + shown.stderr
    assert "another command" in shown.stdout and "shown whole from node-0" in shown.stdout, shown.stdout
    brought = cluster.fab("logs", "--run", run_id, "--node", "node-1")
    assert brought.returncode == 0 and "another command" not in brought.stdout, brought.stdout + brought.stderr
    assert "rank 1 step 2" in (folder / "node-1.log").read_text()


def test_env_values_reach_every_rank_on_no_command_line_and_leave_no_file_behind(cluster, tmp_path):
    """A 60 kB --env value (under the 65,536-byte limit) runs; an --env-file value is in no process's
    arguments (srun, the steps, bash) and, once the run is seen ended, in no file on the cluster."""
    token, big = "tok-51c0e8-never-printed", "b" * 60_000
    env_file = tmp_path / "job.env"
    env_file.write_text(f"TOKEN={token}\n")
    work = script(
        tmp_path,
        "env.py",
        CMDLINE_LEAKS + "import hashlib\n"
        "value = os.environ['TOKEN']\n"
        "print('token', hashlib.sha256(value.encode()).hexdigest(), 'leaks', cmdline_leaks(value), flush=True)\n"
        "print('big', len(os.environ['BIG']), flush=True)\n",
    )
    result = cluster.fab("run", "--script", str(work), "--env", f"BIG={big}", "--env-file", str(env_file))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    digest = hashlib.sha256(token.encode()).hexdigest()
    for node in ("node-0", "node-1"):
        assert f"[{node}] token {digest} leaks 0" in result.stdout and f"[{node}] big 60000" in result.stdout
    homes = [cluster.state_dir / cluster.stack / "nodes" / node for node in ("node-0", "node-1")]
    assert not files_holding(token, *homes, Path(cluster.info["shared_dir"]))


def test_an_attached_run_whose_fab_is_killed_completes_and_is_priced(cluster, tmp_path):
    work = script(tmp_path, "long.py", "print('started', flush=True)\ntime.sleep(4)\nprint('finished', flush=True)\n")
    fab = cluster.popen_fab("run", "--script", str(work))
    seen = ""
    while "[node-0] started" not in seen:
        line = fab.stdout.readline()
        assert line, seen
        seen += line
    run_id = next(line.split()[2].rstrip(":") for line in seen.splitlines() if line.startswith("fab: run "))
    os.kill(fab.pid, signal.SIGKILL)  # a closed lid
    fab.wait(timeout=30)
    row = wait_for_state(cluster, run_id, "COMPLETED", "FAILED", "CANCELLED")
    assert row["state"] == "COMPLETED" and row["ended_at"], row
    runs = {r["run_id"]: r for r in json.loads(cluster.cli("cost", "--json").stdout)["runs"]}
    priced = runs[run_id]  # ended while no fab was connected: its times come from Slurm
    assert priced["ended_at"] is not None and "gone" not in (priced.get("end_reason") or ""), priced
    assert "finished" in (cluster.state_dir / cluster.stack / "runs" / run_id / "node-0.log").read_text()


def test_runs_submitted_at_the_same_moment_are_all_queued_and_run_in_order_without_overlap(cluster, tmp_path):
    order = tmp_path / "order.log"
    work = script(
        tmp_path,
        "order.py",
        f"if rank == 0:\n"
        f"    with open({str(order)!r}, 'a') as f: f.write('start ' + sys.argv[1] + '\\n')\n"
        f"time.sleep(1)\n"
        f"if rank == 0:\n"
        f"    with open({str(order)!r}, 'a') as f: f.write('end ' + sys.argv[1] + '\\n')\n",
    )
    ids = []
    for pair in ("a", "b"):  # two at the same moment, then two more: none refused, each pair after the one before
        launches = [cluster.popen_fab("run", "--script", str(work), "--args", f"{pair}{n}", "--detach") for n in (1, 2)]
        for job in launches:
            out, _ = job.communicate(timeout=180)
            assert job.returncode == 0, out
            ids.append(out.strip().splitlines()[-1])
    for run_id in ids:
        assert cluster.fab("logs", "-f", "--run", run_id).returncode == 0
    lines = order.read_text().split("\n")[:-1]
    assert lines[0::2] == [line.replace("end", "start") for line in lines[1::2]], lines  # never two at once
    assert [line[-2] for line in lines] == ["a"] * 4 + ["b"] * 4, lines
    rows = jobs(cluster)
    assert [rows[i]["state"] for i in ids] == ["COMPLETED"] * 4


def test_fab_stop_names_a_launch_it_finds_preparing_and_that_launch_queues_nothing(cluster, tmp_path):
    """fab stop racing a launch (issue 40): the one outcome of test_remote.py's fab-held race; the launch
    submits nothing and leaves no run folder behind."""
    run_id, *rest = stop_a_launch_being_prepared(cluster, tmp_path, "--detach")
    assert_stop_ended_a_launch_being_prepared(run_id, *rest)
    assert run_id not in jobs(cluster)
    assert not (Path(cluster.info["shared_dir"]) / "runs" / run_id).exists()


def test_a_ranks_own_exit_code_and_first_node_are_in_fabs_line_and_in_jobs(cluster, tmp_path):
    """As a fab-held run says them (test_remote.py): rank 1 exits 3, rank 0 ends after it."""
    result = cluster.fab("run", "--script", str(failing_rank_script(tmp_path)), timeout=120)
    row = assert_rank_1_failed_first(result, cluster.fab("jobs", "--json").stdout)
    assert row["rank_exit_codes"]["node-1"] == {"1": 3}, row


def test_a_cancel_leaves_nothing_and_bad_run_ids_are_one_line(cluster, tmp_path):
    work = script(tmp_path, "sleep.py", "print('sleeping', flush=True)\ntime.sleep(600)\n")
    run_id = detached(cluster, "run", "--script", str(work))
    running = wait_for_state(cluster, run_id, "RUNNING")
    assert running["exit_code"] is None and running["ended_at"] is None, running  # null until known
    slurm.wait_for(lambda: run_processes(run_id), "the run's processes")
    # One cancelled while it waits behind it never started: no start, no exit code, here and in the ledger;
    # its --env-file values are gone from the shared folder as the stop (of every run) returns
    token = "tok-9e1f-cancelled-never-read"
    env_file = tmp_path / "queued.env"
    env_file.write_text(f"TOKEN={token}\n")
    queued = detached(cluster, "run", "--script", str(work), "--env-file", str(env_file))
    shared = Path(cluster.info["shared_dir"])
    assert files_holding(token, shared)  # staged for the start that now never comes
    assert wait_for_state(cluster, queued, "PENDING")["started_at"] is None
    stopped = cluster.fab("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for cancelled, was in ((run_id, "RUNNING"), (queued, "PENDING")):  # Slurm's queue says what it cancelled
        assert f"fab: run {cancelled} cancelled (it was {was})" in stopped.stdout, stopped.stdout
    assert not files_holding(token, shared)
    row = wait_for_state(cluster, queued, "CANCELLED")
    assert (row["started_at"], row["exit_code"], row["exit_codes"], row["cost_usd"]) == (None, None, {}, 0.0), row
    priced = {r["run_id"]: r for r in json.loads(cluster.cli("cost", "--json").stdout)["runs"]}[queued]
    assert (priced["started_at"], priced["exit_codes"], priced["cost_usd"]) == (None, None, 0.0), priced
    wait_for_state(cluster, run_id, "CANCELLED")
    slurm.wait_for(lambda: not run_processes(run_id), "no process of the run left", lambda: str(run_processes(run_id)))
    again = cluster.fab("stop", "--run", run_id)
    assert again.returncode == 0 and "already ended (CANCELLED)" in again.stdout
    assert cluster.fab("logs", "-f", "--run", run_id).returncode == 1
    assert_one_line_error(cluster.fab("stop", "--run", "no-such-run"), "no run 'no-such-run'", "fab jobs")
    assert_one_line_error(cluster.fab("logs", "-f", "--run", "no-such-run"), "no run 'no-such-run'")


def test_ctrl_c_of_a_followed_run_cancels_it_and_a_hangup_or_ctrl_c_of_logs_f_only_detaches(cluster, tmp_path):
    work = script(tmp_path, "sleep2.py", "print('sleeping', flush=True)\ntime.sleep(600)\n")

    def followed_until_sleeping(fab) -> str:
        seen = ""
        while "[node-1] sleeping" not in seen:
            line = fab.stdout.readline()
            assert line, seen
            seen += line
        return seen

    for sent, code, state in ((signal.SIGHUP, 0, "RUNNING"), (signal.SIGINT, 130, "CANCELLED")):
        fab = cluster.popen_fab("run", "--script", str(work))
        seen = followed_until_sleeping(fab)
        run_id = next(line.split()[2].rstrip(":") for line in seen.splitlines() if line.startswith("fab: run "))
        fab.send_signal(sent)
        assert fab.wait(timeout=60) == code, fab.stdout.read()
        assert wait_for_state(cluster, run_id, state)["state"] == state
        if state == "RUNNING":  # the hangup left it running; Ctrl-C of a `fab logs -f` leaves it too
            follower = cluster.popen_fab("logs", "-f", "--run", run_id)
            followed_until_sleeping(follower)
            follower.send_signal(signal.SIGINT)
            assert follower.wait(timeout=60) == 130 and "goes on on the cluster" in follower.stdout.read()
            assert wait_for_state(cluster, run_id, "RUNNING")["state"] == "RUNNING"
            assert cluster.fab("stop", "--run", run_id).returncode == 0
            wait_for_state(cluster, run_id, "CANCELLED")
        slurm.wait_for(lambda run_id=run_id: not run_processes(run_id), "no process of the run left")


def test_a_hung_run_is_found_and_stopped_on_the_cluster_while_no_fab_follows_it(cluster, tmp_path):
    work = script(
        tmp_path,
        "hang.py",
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(1))  # a step that goes well\n"
        "if rank == 1:\n"
        "    time.sleep(600)  # never enters the all-reduce rank 0 waits in\n"
        "dist.all_reduce(torch.ones(1))\n",
    )
    run_id = detached(cluster, "run", "--script", str(work), "--hang-timeout", "4")
    row = wait_for_state(cluster, run_id, "HUNG", "COMPLETED", "FAILED", "CANCELLED")
    assert row["state"] == "HUNG", row
    summary = json.loads((cluster.state_dir / cluster.stack / "runs" / run_id / "summary.json").read_text())
    verdict = summary["hang"]["verdict"]
    assert "rank 1" in verdict and "never entered" in verdict and "all_reduce" in verdict, verdict
    # the batch script's own lines (no node wrote them) are kept here too
    cluster_log = (cluster.state_dir / cluster.stack / "runs" / run_id / "cluster.log").read_text()
    assert f"[watch] {verdict}" in cluster_log and "[watch] stopping the hung run" in cluster_log, cluster_log
    evidence = cluster.state_dir / cluster.stack / "runs" / run_id / "hang"  # what the cluster's watch collected
    assert summary["hang"]["evidence"] == str(evidence) and (evidence / "verdict.txt").read_text() == verdict + "\n"
    assert sorted(p.name for p in evidence.glob("node-*.progress.json")) == [
        "node-0.progress.json",
        "node-1.progress.json",
    ]
    slurm.wait_for(lambda: not run_processes(run_id), "no process of the run left")


# A user's own DDP script, not on the harness: its ranks meet in DDP's all-reduces, and the model's forward
# passes are what the rank monitor times (node/rankhook/gpu_cluster_forward_steps.py).
OWN_DDP = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs, targets = torch.randn(1024, 784), torch.randint(0, 10, (1024,))
for step in range(1, 301):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    if step % 10 == 0 and dist.get_rank() == 0:
        print(f"trained step {step}", flush=True)
"""


def test_a_throttled_nodes_rank_in_a_users_own_script_is_named_a_straggler_by_the_clusters_watch(cluster, tmp_path):
    why = throttle.unavailable()
    if why:
        pytest.skip(f"a node cannot be throttled here: {why}")
    # Forward passes of ~8 ms (the course's MLP at batch 1024, as tests/integration/test_fitness.py's run on the
    # harness), the watch polling every 4 s; node-1's processes (its slurmd, and the run's ranks there) at 10% of
    # one CPU once training has begun (step 10's line), so its ranks import torch and meet at full speed. The
    # run is cancelled (Ctrl-C) once fab, following its log, has shown the verdict.
    own = tmp_path / "own_ddp.py"
    own.write_text(OWN_DDP)
    fab = cluster.popen_fab("run", "--script", str(own), "--hang-timeout", "20")
    seen = []
    for line in fab.stdout:
        seen.append(line)
        if "trained step 10" in line:
            break
    with throttle.throttled(cluster.state_dir / cluster.stack / "nodes" / "node-1", 10):
        for line in fab.stdout:
            seen.append(line)
            if "STRAGGLER run=" in line:
                fab.send_signal(signal.SIGINT)
                break
    seen.append(fab.communicate(timeout=120)[0])
    output = "".join(seen)
    run_id = run_id_in(output)
    (found,) = wait_for_state(cluster, run_id, "CANCELLED")["stragglers"]
    assert (found["rank"], found["node"]) == (1, "node-1") and found["ratio"] > 1.3, found
    assert found["steps"][1] - found["steps"][0] + 1 >= 20, found
    line = f"[watch] STRAGGLER run={run_id}: rank 1 on node-1: {found['why']}"
    cluster_log = (cluster.state_dir / cluster.stack / "runs" / run_id / "cluster.log").read_text()
    assert [seen for seen in cluster_log.splitlines() if "STRAGGLER" in seen] == [line], cluster_log
    assert line in output, output
    slurm.wait_for(lambda: not run_processes(run_id), "no process of the run left")


def test_two_ranks_progress_bars_stay_in_lines_and_logs_of_their_own(cluster, tmp_path):
    work = script(  # tqdm's way: each redraw starts with `\r`; slower than a node holds an unfinished line
        tmp_path,
        "bar.py",
        "for step in range(5):\n"
        "    sys.stdout.write(f'\\rrank {rank} bar {step}'); sys.stdout.flush(); time.sleep(0.35)\n"
        "sys.stdout.write('\\n')\n",
    )
    fab = cluster.popen_fab("run", "--script", str(work), text=False)
    shown = fab.stdout.read()
    assert fab.wait(timeout=120) == 0, shown
    for line in shown.split(b"\n"):  # a redraw replaces only its own rank's bar
        assert not (b"rank 0 bar" in line and b"rank 1 bar" in line), shown
    folder = cluster.run_dir(shown.decode())
    for node, rank in (("node-0", 0), ("node-1", 1)):
        log = (folder / f"{node}.log").read_text()
        assert f"[{node}] rank {rank} bar 4" in log and f"rank {1 - rank} bar" not in log, log
        assert all(line.count(" bar ") <= 1 for line in log.splitlines()), log


def test_many_fast_lines_from_two_nodes_each_arrive_whole_with_their_nodes_prefix(cluster, tmp_path):
    """Both nodes print as fast as a buffered `print` goes (lines of 120 bytes, and some of 5,000, longer
    than one of Slurm's I/O messages): every line of the cluster's log, of fab's output and of each node's
    log is one whole line of one rank, under its own node's prefix."""
    lines, long_every = 4000, 500
    work = script(
        tmp_path,
        "fast.py",
        f"for i in range({lines}):\n"
        f"    print(f'r{{rank}} line {{i:08d}} ' + ('L' * 5000 if i % {long_every} == 0 else 'x' * 100) + ' end')\n",
    )
    fab = cluster.popen_fab("run", "--script", str(work), stderr=subprocess.PIPE)
    shown, errors = fab.communicate(timeout=300)
    assert fab.returncode == 0, shown[-3000:] + errors
    whole = re.compile(r"\[node-(\d)\] r(\d) line (\d{8}) (?:L{5000}|x{100}) end")
    folder = cluster.run_dir(shown)
    on_cluster = cluster.state_dir / cluster.stack / "shared" / "runs" / folder.name / contract.RUN_LOG
    for name, text in (("the cluster's log", on_cluster.read_text()), ("fab's output", shown)):
        ours = [line for line in text.splitlines() if " line " in line]
        torn = [line[:160] for line in ours if not (m := whole.fullmatch(line)) or m[1] != m[2]]
        assert not torn and len(ours) == 2 * lines, (name, len(ours), torn[:5])
    for node in (0, 1):
        numbers = [int(m[3]) for m in whole.finditer((folder / f"node-{node}.log").read_text())]
        assert numbers == list(range(lines)), (node, len(numbers))


def _kill_daemon(cluster, node: str, name: str) -> None:
    pid_file = Path(Paths(str(cluster.state_dir / cluster.stack / "nodes" / node)).pid(name))
    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


def _slurm_client(cluster, *argv: str) -> str:
    """One of Slurm's clients against the cluster's controller, as node-0's user; its output."""
    conf = Paths(str(cluster.state_dir / cluster.stack / "nodes" / "node-0")).conf
    result = subprocess.run(argv, env={**os.environ, "SLURM_CONF": conf}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def _one_line_failure(result, *words: str) -> None:
    """Exit 1 and one `error: ...` line naming `words`: no traceback, nothing else on stderr."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr and "TimeoutExpired" not in result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_a_dead_controller_or_munged_is_one_line_and_bootstrap_brings_slurm_back(cluster, tmp_path):
    """slurmctld killed while a run runs and one waits: fab jobs, stop --run of the waiting one and logs -f say
    so in one line, exit 1; a submit fails leaving no run folder; status exits 1 naming the daemon. Bootstrap
    refuses while the run holds MASTER_PORT, and stop --run of it is the way out (issue 40): stopped on its
    nodes without the controller. Bootstrap then restarts it, the queue kept, and the stopped run is priced to
    its own end, not to when the restarted controller learned of it. Then munged killed: status names it,
    bootstrap (--force too) restarts it and a run completes."""
    work = script(tmp_path, "sleep3.py", "print('sleeping', flush=True)\ntime.sleep(600)\n")
    running = detached(cluster, "run", "--script", str(work))
    on_cluster = Path(cluster.info["shared_dir"]) / "runs" / running / contract.RUN_LOG
    slurm.wait_for(lambda: on_cluster.exists() and "sleeping" in on_cluster.read_text(), "the first run's ranks")
    blocker = _slurm_client(
        cluster, "sbatch", "--parsable", "--exclusive", "--nodes=2", "--output=/dev/null", "--wrap", "sleep 600"
    )
    run_id = detached(cluster, "run", "--script", str(work))  # waits behind both: it holds no port
    waits = wait_for_state(cluster, run_id, "PENDING")["waiting_for"]  # its turn, in Slurm's words
    assert waits in ("its nodes, busy with another job", "jobs ahead of it in the queue"), waits
    shared_runs = cluster.state_dir / cluster.stack / "shared" / "runs"
    folders = set(os.listdir(shared_runs))
    # slurmctld saves its queue a moment after a submit (what it had not saved, a kill loses): until the run
    # (its job name) is in the saved job state
    saved = Path(cluster.info["shared_dir"]) / contract.SCHEDULER_STATE / "job_state"
    slurm.wait_for(lambda: saved.exists() and run_id.encode() in saved.read_bytes(), "the run in the saved queue")
    _kill_daemon(cluster, "node-0", "slurmctld")
    try:
        for args in (("jobs",), ("stop", "--run", run_id), ("logs", "-f", "--run", run_id)):
            _one_line_failure(cluster.fab(*args), "controller")
        _one_line_failure(cluster.fab("run", "--script", str(work), "--detach"), "sbatch failed")
        assert set(os.listdir(shared_runs)) == folders  # no orphan run folder
        status = cluster.cli("status")
        assert status.returncode == 1 and "slurmctld down" in status.stdout, status.stdout + status.stderr
        refused = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
        assert_one_line_error(refused, f"job {running}", "fab stop")  # its run holds MASTER_PORT
        stopped = cluster.fab("stop", "--run", running)  # the way out: the controller is not needed
        stopped_at = time.time()
        said = stopped.stdout.strip().splitlines()
        assert stopped.returncode == 0 and len(said) == 1, stopped.stdout + stopped.stderr
        assert f"run {running} stopped on node-0, node-1" in said[0] and "fab bootstrap" in said[0], said
        assert run_processes(running) == []
    finally:
        healed = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
    try:
        assert healed.returncode == 0 and "scheduler done" in healed.stdout, healed.stdout + healed.stderr
        assert wait_for_state(cluster, run_id, "PENDING")["state"] == "PENDING"  # the queue outlived its controller
        ended = wait_for_state(cluster, running, "CANCELLED")  # stopped: as a scancel reads
        ended_at = datetime.fromisoformat(ended["ended_at"].replace("Z", "+00:00")).timestamp()
        # Priced to its nodes' own end held in one full run of two; the other priced it 43 s late (issue 40, 16).
        assert ended_at >= stopped_at - 60, (ended, stopped_at)
    finally:
        _slurm_client(cluster, "scancel", blocker.split(";")[0])
        cluster.fab("stop", "--run", run_id)
    wait_for_state(cluster, run_id, "CANCELLED")

    _kill_daemon(cluster, "node-0", "munged")
    try:
        status = cluster.cli("status", "--json")
        assert status.returncode == 1, status.stdout + status.stderr
        head = json.loads(status.stdout)["nodes"][0]
        assert head["scheduler_daemons"]["munged"] == "down" and not head["scheduler_serves"], head
    finally:
        healed = cluster.fab("bootstrap", "--force", "--master-port", str(cluster.master_port))
    assert healed.returncode == 0 and "scheduler done" in healed.stdout, healed.stdout + healed.stderr
    quick = script(tmp_path, "quick.py", "print('ok', flush=True)\n")
    assert cluster.fab("run", "--script", str(quick)).returncode == 0
    # a node the controller could not ping while munged was down may read `idle*` until its next ping
    slurm.wait_for(lambda: cluster.cli("status").returncode == 0, "status exit 0 once Slurm serves again")
    status = cluster.cli("status", "--json")
    assert all(set(n["scheduler_daemons"].values()) == {"up"} for n in json.loads(status.stdout)["nodes"])
    assert "spot-watch" in json.loads(status.stdout)["nodes"][1]["scheduler_daemons"]


def test_a_failed_run_whose_log_cannot_be_read_ends_with_slurms_state_not_exit_0(cluster, tmp_path):
    """The run's log on the shared folder goes unreadable mid-run (as on a full or failing disk): the
    follower cannot see the run's end in it, and the launch ends with Slurm's end of the run all the same."""
    work = script(
        tmp_path,
        "cut.py",
        "log = os.path.join(os.environ['CLUSTER_SHARED_DIR'], 'runs', os.environ['CLUSTER_RUN_ID'], 'output.log')\n"
        "print('cutting', flush=True); time.sleep(1)\n"
        "if rank == 0:\n"
        "    os.rename(log, log + '.moved'); os.mkdir(log)\n"
        "time.sleep(2)\n"
        "sys.exit(3 if rank == 1 else 0)\n",
    )
    result = cluster.fab("run", "--script", str(work))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the run's log cannot be read" in result.stdout + result.stderr
    run_id = result.stdout.split("fab: run ")[1].split(":")[0]
    assert jobs(cluster)[run_id]["state"] == "FAILED"


def test_replicas_under_slurm_a_group_whose_ranks_are_killed_is_dropped_and_the_other_trains_to_the_end(cluster):
    """One Slurm job, --no-kill, one task per replica group: a group's failure ends no other."""
    from tests.support import REPO

    ft_script = str(REPO / "examples" / "ft_training.py")
    run_id = detached(cluster, "run", "--script", ft_script, "--replicas", "2", "--args", "--steps 60 --step-sleep 0.1")
    metrics = Path(cluster.info["shared_dir"]) / "runs" / run_id / "metrics.jsonl"

    def steps_of(replica: int) -> list[int]:
        if not metrics.exists():
            return []
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        return [line["step"] for line in lines if line["replica"] == replica]

    slurm.wait_for(lambda: len(steps_of(1)) >= 5, "replica 1's fifth step")
    killed = []
    for pid in run_processes(run_id):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"CLUSTER_NODE=node-1" in environ and any(v.startswith(b"LOCAL_RANK=") for v in environ):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    assert killed
    row = wait_for_state(cluster, run_id, "COMPLETED", "FAILED")
    assert row["state"] == "COMPLETED", row
    survivor = steps_of(0)
    assert survivor == list(range(survivor[0], 61))  # none repeated, none skipped, to the end
    summary = json.loads((cluster.state_dir / cluster.stack / "runs" / run_id / "summary.json").read_text())
    assert summary["dropped"] == ["node-1"] and summary["exit_codes"]["node-0"] == 0, summary


@pytest.mark.skipif(disks.unavailable() is not None, reason=str(disks.unavailable()))
def test_a_disk_that_fills_during_a_run_is_named_and_a_node_drained_for_it_comes_back(cluster, tmp_path):
    """node-1's disk fills during a run (its rank writes results until there is no space): the node's lines and
    its rank's error still reach the log (the node's output spool is on that disk), and fab names the node and
    the full disk. A node Slurm drained for a full disk (a reason Slurm never lifts: every run would wait for
    it until down) is back in service after bootstrap, which says so."""
    work = script(
        tmp_path,
        "fill.py",
        "print(f'rank {rank} before', flush=True)\n"
        "if rank == 1:\n"
        "    with open(os.path.join(os.environ['CLUSTER_RESULTS_DIR'], 'big'), 'wb') as f:\n"
        "        for _ in range(200):\n"
        "            f.write(b'x' * 1_000_000); f.flush()\n"
        "print(f'rank {rank} after', flush=True)\n",
    )
    node_runs = cluster.state_dir / cluster.stack / "nodes" / "node-1" / contract.RUNS
    with disks.small_filesystem(node_runs, "80m"):  # room enough to launch (64 MiB), not for the results
        result = cluster.fab("run", "--script", str(work), timeout=300)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, said
    assert "[node-1] rank 1 before" in said and "OSError: [Errno 28] No space left on device" in said, said
    assert "fab: node-1 ran out of disk space during the run (No space left on device)" in said, said
    assert "[node-0] rank 0 after" in said, said

    drain = "scontrol update NodeName=node-1 State=DRAIN Reason='batch job complete failure'"  # as Slurm drains
    assert cluster.cli("ssh", "node-0", "--", "bash", "-c", shlex.quote(drain)).returncode == 0
    booted = cluster.fab("bootstrap", "--master-port", str(cluster.master_port), "--accounting", "none")
    shown = " ".join(booted.stdout.split())
    assert booted.returncode == 0 and "back in service:" in shown and "Slurm drained it" in shown, shown  # a table cell

    def states():
        return cluster.cli("ssh", "node-0", "--", "sinfo", "--noheader", "--Node", "--format=%N_%T").stdout.split()

    # back in service; `idle*` (not responding) until the controller's next ping of a restarted slurmd
    slurm.wait_for(lambda: "node-1_idle" in states(), "node-1 idle in sinfo", details=states)


def _announced(launch) -> str:
    """A followed launch's output up to its `fab: run <id>: ...` line."""
    seen = ""
    while "fab: run " not in seen:
        line = launch.stdout.readline()
        assert line, seen
        seen += line
    return seen


def test_down_mid_run_keeps_its_log_here_and_names_the_run_it_cancelled(cluster, tmp_path):
    """Last: it takes the module's cluster down. Both launches are followed, one running and one queued: down
    cancels both, and neither says its run goes on (issue 40)."""
    gate = tmp_path / "go"  # the later lines wait for the test, not for a time a loaded machine may overrun
    work = script(
        tmp_path,
        "long2.py",
        "print(f'rank {rank} started', flush=True)\n"
        f"while not os.path.exists({str(gate)!r}): time.sleep(0.1)\n"
        "print(f'rank {rank} later', flush=True)\n"
        "time.sleep(600)\n",
    )
    running = cluster.popen_fab("run", "--script", str(work))  # followed
    said = _announced(running)
    run_id = run_id_in(said)
    on_cluster = cluster.state_dir / cluster.stack / "shared" / "runs" / run_id / "output.log"  # the local provider's

    def cluster_log_has(text: str) -> bool:
        return on_cluster.exists() and text in on_cluster.read_text()

    slurm.wait_for(lambda: cluster_log_has("rank 1 started"), "the run's first lines")
    shown = cluster.fab("logs", "--run", run_id)  # a running run: its lines so far
    assert shown.returncode == 0 and "[node-1] rank 1 started" in shown.stdout, shown.stdout + shown.stderr
    assert "rank 1 later" not in shown.stdout
    gate.touch()
    slurm.wait_for(lambda: cluster_log_has("rank 1 later"), "the run's later lines")
    attached = cluster.popen_fab("run", "--script", str(work))  # queued behind it, and followed
    seen = _announced(attached)
    down = cluster.cli("down", "--stack", cluster.stack)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"run {run_id}, running, was cancelled with the cluster" in down.stdout, down.stdout
    for launch, output in ((running, said), (attached, seen)):
        output += launch.communicate(timeout=120)[0]
        assert launch.returncode == 1 and "was cancelled by the cluster's down" in output, output  # not "goes on"
        assert "goes on" not in output, output
    assert not on_cluster.exists()
    folder = cluster.state_dir / cluster.stack / "runs" / run_id
    assert "[node-1] rank 1 later" in (folder / "node-1.log").read_text()
    kept = cluster.fab("logs", "--run", run_id, "--stack", cluster.stack)
    assert kept.returncode == 0 and "[node-0] rank 0 later" in kept.stdout, kept.stdout + kept.stderr
    assert json.loads((folder / "run.json").read_text())["state"] == "CANCELLED"
    priced = {r["run_id"]: r for r in json.loads(cluster.cli("cost", "--json").stdout)["runs"]}
    queued = priced[run_id_in(seen)]  # it only waited in the queue: no node worked for it
    assert (queued["started_at"], queued["cost_usd"]) == (None, 0.0), queued
