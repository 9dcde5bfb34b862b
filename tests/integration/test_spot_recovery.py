"""A spot cluster heals itself while nothing is connected (`up --local --spot`, runs held by Slurm): a notice
ends a run at a checkpoint and requeues it, the reclaimed node is replaced and rejoins, the run resumes at
the step it saved; a node killed without notice is replaced too, and the run resumes from its last
periodic checkpoint. The training script is the course's own ddp_training, the drill the user's command.
A whole project with its own requirements (`fab run --workdir --requirements`) is requeued onto a replaced
node too: the new node makes its copy and environment from the run's stage on the shared folder. A `--replicas`
run's group whose node is killed starts again on the replacement, under Slurm and, with the runs held by fab's
connections for one test, under the launch that holds it."""

import json
import os
import re
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from node import contract, procfs
from tests.support import slurm, throttle
from tests.support.clusters import bootstrapped_cluster, node_server_processes
from tests.support.packages import tiny_wheel

pytestmark = pytest.mark.skipif(slurm.unavailable() is not None, reason=f"Slurm: {slurm.unavailable()}")

CHECKPOINT_EVERY = 200
RESUMED = re.compile(r"\[node-0\] resuming from step (\d+) \(.*; restart (\d+)\)")
PREEMPTED = re.compile(r"\[node-0\] preempted \(SIGUSR1\) at step (\d+): checkpoint at step \1 saved")
STEP = re.compile(r"^\[node-0\]\s+(\d+)\s+\d", re.M)
STRAGGLER = re.compile(r"^\[watch\] STRAGGLER run=\S+: rank 1 on node-1: compute ", re.M)
PROJECT_STEPS = 200
PROJECT_TRAIN = """\
import json, os, sys, time
import torch, torch.distributed as dist
import gc_tinypkg  # from the run's --requirements
from harness.preemption import Preemption, restart_count

steps = int(sys.argv[1])
preemption = Preemption()
dist.init_process_group("gloo")
rank = dist.get_rank()
saved = os.path.join(os.environ["CLUSTER_RUN_DIR"], "step.json")
start = json.load(open(saved))["step"] if os.path.exists(saved) else 0
print(f"project at step {start} (restart {restart_count()}) with {gc_tinypkg.MESSAGE}", flush=True)


def save(step):
    if rank == 0:
        with open(saved + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(saved + ".tmp", saved)


for step in range(start + 1, steps + 1):
    time.sleep(0.05)
    if rank == 0 and step % 10 == 0:
        print(f"project step {step}", flush=True)
    if preemption.step_ended(step, step == steps, step % 50 == 0 or step == steps, save, torch.device("cpu")):
        sys.exit(0)
if rank == 0:
    print(f"project done at step {steps}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with bootstrapped_cluster(
        tmp_path_factory, "spot", scheduler="slurm", master_port=slurm.free_ports(), up_args=("--spot",)
    ) as handle:
        yield handle


def log_of(cluster, run_id: str) -> str:
    path = cluster.state_dir / cluster.stack / "shared" / "runs" / run_id / contract.RUN_LOG
    return path.read_text(errors="replace") if path.exists() else ""


def log_of_folder(cluster, run_id: str) -> Path:
    return cluster.state_dir / cluster.stack / "shared" / "runs" / run_id


def wait_for_log(cluster, run_id: str, pattern: re.Pattern, after: int = 0, deadline_s: float = 180) -> re.Match:
    found: list[re.Match] = []

    def seen() -> bool:
        found[:] = list(pattern.finditer(log_of(cluster, run_id)))[after:]
        return bool(found)

    slurm.wait_for(seen, f"{pattern.pattern} in the run's log", lambda: log_of(cluster, run_id)[-3000:], deadline_s)
    return found[0]


def job(cluster, run_id: str) -> dict:
    result = cluster.fab("jobs", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return next(row for row in json.loads(result.stdout) if row["run_id"] == run_id)


def pinned_key(cluster, node: dict) -> str:
    host = f"[{node['public_ip']}]:{node['ssh_port']}"
    lines = (cluster.state_dir / cluster.stack / "known_hosts").read_text().splitlines()
    return next(line for line in lines if line.split()[0] == host)


def events_of(cluster) -> list[tuple[str, str]]:
    """The stack's replacement events in the ledger, oldest first: (node, kind)."""
    cost = json.loads(cluster.cli("cost", "--json").stdout)
    return [(e["node"], e["kind"]) for e in cost["events"] if e["stack"] == cluster.stack]


def test_a_fab_held_replica_group_whose_node_dies_starts_again_on_its_replacement_and_heals_from_its_peer(cluster):
    # First in the module (no node replaced yet, so turning Slurm off reruns no health check): a `--replicas 2`
    # run held by fab's connections (--scheduler none) loses node-1's server to kill -9; the replacement joins
    # from the shared folder's kit (its venv and env file: no Slurm), the launch finds it back and starts group 1
    # there, healed from its peer. The Slurm-held twin is below.
    assert cluster.fab("bootstrap", "--scheduler", "none").returncode == 0
    try:
        kit = Path(cluster.info["shared_dir"]) / contract.JOIN_KIT
        assert json.loads(kit.read_text())["scheduler"] is None and oct(kit.stat().st_mode & 0o777) == "0o600"
        _fab_held_group_heals(cluster)
    finally:
        assert cluster.fab("bootstrap", "--scheduler", "slurm").returncode == 0  # the module's runs are Slurm's


def _fab_held_group_heals(cluster) -> None:
    from tests.support import REPO

    earlier = len(events_of(cluster))
    ft_script = str(REPO / "examples" / "ft_training.py")
    launch = cluster.popen_fab(
        "run", "--script", ft_script, "--replicas", "2", "--args", "--steps 100000 --step-sleep 0.05"
    )
    said: list[str] = []
    reading = threading.Thread(target=lambda: said.extend(iter(launch.stdout.readline, "")), daemon=True)
    reading.start()
    try:
        slurm.wait_for(
            lambda: any(line.startswith("fab: run ") for line in said), "the run's id", lambda: "".join(said)
        )
        run_id = next(line.split()[2].rstrip(":") for line in said if line.startswith("fab: run "))
        metrics = log_of_folder(cluster, run_id) / contract.METRICS_FILE

        def lines() -> list[dict]:
            return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

        shown: list[str | None] = []

        def participants(wanted: str) -> bool:  # as `fab jobs` shows them, from the launching fab's record
            shown.append(job(cluster, run_id).get("participants"))
            return shown[-1] == wanted

        slurm.wait_for(lambda: participants("2/2"), "the run in its quorum, 2/2", lambda: f"{shown[-5:]} {said}")
        pid_file = cluster.state_dir / cluster.stack / "nodes" / "node-1" / "sshd.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed_at = time.time()
        slurm.wait_for(lambda: participants("1/2"), "group 1 dropped, 1/2", lambda: f"{shown[-5:]} {said}")
        dropped_at = max(line["time"] for line in lines() if line["replica"] == 0 and line["participants"] == 1)

        def healed() -> list[dict]:
            return [line for line in lines() if line["replica"] == 1 and line["time"] > dropped_at]

        slurm.wait_for(lambda: participants("2/2"), "group 1 back in the quorum, 2/2", lambda: "".join(said)[-3000:])
        launch.send_signal(signal.SIGINT)  # attached: Ctrl-C cancels the run
        launch.wait(timeout=60)
    finally:
        launch.kill()
        reading.join(timeout=10)
    out = "".join(said)
    assert "replica group 1 (node-1) dropped; replica group(s) on node-0 go on" in out, out[-3000:]
    assert "fab: replica group 1 (node-1): back in service after a replacement" in out, out[-3000:]
    assert "resumed from" not in out  # healed from its peer, not from a checkpoint
    back, survivor = healed()[0], [line for line in lines() if line["replica"] == 0]
    gap = max(b["time"] - a["time"] for a, b in zip(survivor, survivor[1:], strict=False))
    print(f"fab-held: group 1 back {back['time'] - killed_at:.1f} s after the kill; survivor's longest gap {gap:.2f} s")
    peer = {line["step"]: line for line in survivor}
    assert all(line["params_sha"] == peer[line["step"]]["params_sha"] for line in healed() if line["step"] in peer)
    assert back["step"] in peer  # its first step back is its peer's step, with its peer's weights
    both = [line for line in healed() if line["participants"] == 2 == peer.get(line["step"], {}).get("participants")]
    assert both, healed()[-3:]  # 2/2, then 1/2, then 2/2 again
    steps = [line["step"] for line in survivor]
    assert steps == list(range(steps[0], steps[-1] + 1)), steps  # no step redone, none skipped
    events = [e for e in json.loads(cluster.cli("cost", "--json").stdout)["events"] if e["stack"] == cluster.stack]
    assert [(e["node"], e["kind"]) for e in events[earlier:]] == [("node-1", "node lost")], events
    ends = datetime.fromisoformat(events[earlier]["at"]).timestamp() + events[earlier]["seconds"]
    assert ends >= back["time"] - 1, (events[earlier], back)  # priced until the group was back in the quorum


def test_a_project_with_its_requirements_resumes_on_a_replaced_node_and_completes(cluster, tmp_path):
    # The replacement's home is empty: no copy of the project, no environment of the requirements. Its job
    # makes both from the run's stage on the shared folder, copied at submit, and the run resumes there.
    project = tmp_path / "project"
    tiny_wheel(project / "wheels")
    (project / "requirements.txt").write_text("--no-index\n--find-links wheels\ngc-tinypkg==0.1\n")
    (project / "train.py").write_text(PROJECT_TRAIN)
    submitted = cluster.fab(
        *("run", "--workdir", str(project), "--script", "train.py", "--args", str(PROJECT_STEPS)),
        *("--requirements", str(project / "requirements.txt"), "--detach"),
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    stage = cluster.state_dir / cluster.stack / "shared" / "runs" / run_id / contract.RUN_STAGE
    assert (stage / contract.STAGE_FILES / "train.py").read_text() == PROJECT_TRAIN
    wait_for_log(cluster, run_id, re.compile(r"^\[node-0\] project step 60$", re.M))

    pid_file = cluster.state_dir / cluster.stack / "nodes" / "node-1" / "sshd.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    resumed = wait_for_log(
        cluster, run_id, re.compile(r"^\[node-1\] project at step (\d+) \(restart 1\) with tiny", re.M)
    )
    step = int(resumed.group(1))
    assert step >= 50 and step % 50 == 0, resumed.group(0)  # from its last checkpoint
    wait_for_log(cluster, run_id, re.compile(f"^\\[node-0\\] project done at step {PROJECT_STEPS}$", re.M))
    row: dict = {}

    def ended() -> bool:
        row.update(job(cluster, run_id))
        return row["state"] not in ("PENDING", "RUNNING", "PREEMPTED")

    slurm.wait_for(ended, "the run's end", lambda: json.dumps(row))
    assert (row["state"], row["exit_code"], row["requeues"]) == ("COMPLETED", 0, 1), row
    log = log_of(cluster, run_id)
    after_death = log.split("(restart 0)")[-1]
    assert "[node-1] gpu-cluster: requirements installed in" in after_death, log[-3000:]
    assert "[node-0] gpu-cluster: installing" not in log, log[-3000:]  # node-0 kept its environment and copy
    assert ("node-1", "node lost") in events_of(cluster)
    cleaned = cluster.fab("clean-runs", "--keep", "0")  # the stage goes with the copies; the checkpoint stays
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert re.search(r"^shared folder: removed the stages of 1 of \d+ runs", cleaned.stdout, re.M), cleaned.stdout
    assert not stage.exists() and (stage.parent / "step.json").exists()


def test_a_replica_group_whose_node_dies_starts_again_on_its_replacement_and_heals_from_its_peer(cluster):
    # kill -9 of node-1's server in a `--replicas 2` run: the survivor goes on (no step redone), the
    # replacement joins, and the run's batch job starts group 1 there: it heals live (no checkpoint, restart
    # count 0) and is back in the quorum with its peer's parameters. fab jobs shows 2/2, 1/2, 2/2.
    from tests.support import REPO

    earlier = len(events_of(cluster))
    ft_script = str(REPO / "examples" / "ft_training.py")
    submitted = cluster.fab(
        *("run", "--script", ft_script, "--replicas", "2", "--args", "--steps 100000 --step-sleep 0.05", "--detach")
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    metrics = log_of_folder(cluster, run_id) / contract.METRICS_FILE

    def lines() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    shown: list[str | None] = []

    def participants(wanted: str) -> bool:
        shown.append(job(cluster, run_id).get("participants"))
        return shown[-1] == wanted

    slurm.wait_for(lambda: participants("2/2"), "the run in its quorum, 2/2", lambda: str(shown[-5:]))
    pid_file = cluster.state_dir / cluster.stack / "nodes" / "node-1" / "sshd.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed_at = time.time()
    slurm.wait_for(lambda: participants("1/2"), "group 1 dropped, 1/2", lambda: str(shown[-5:]))
    slurm.wait_for(lambda: participants("2/2"), "group 1 back in the quorum, 2/2", lambda: str(shown[-5:]))
    heals = log_of_folder(cluster, run_id) / contract.HEALS_RECORD  # when group 1 was back: its old ranks
    slurm.wait_for(heals.exists, "the heal's record")  # wrote on until the replacement ended them
    back_at = json.loads(heals.read_text().splitlines()[0])["at"]
    healed = [line for line in lines() if line["replica"] == 1 and line["time"] >= back_at > killed_at]
    assert healed, lines()[-4:]
    peer = {line["step"]: line["params_sha"] for line in lines() if line["replica"] == 0}
    assert healed[0]["params_sha"] == peer[healed[0]["step"]], (healed[0], peer.get(healed[0]["step"]))
    survivor = [line["step"] for line in lines() if line["replica"] == 0]
    assert survivor == list(range(survivor[0], survivor[-1] + 1)), survivor  # no step redone, none skipped
    log = log_of(cluster, run_id)
    assert "[cluster] replica group 1 (node-1): back in service after a replacement" in log, log[-3000:]
    assert "resumed from" not in log  # healed from its peer, not from a checkpoint
    assert cluster.fab("stop", "--run", run_id).returncode == 0
    slurm.wait_for(lambda: job(cluster, run_id)["state"] == "CANCELLED", "the run cancelled and finished")
    # the interruption is priced until the group was back in the quorum, not only until the node rejoined
    cost = json.loads(cluster.cli("cost", "--json").stdout)
    lost = [e for e in cost["events"] if e["stack"] == cluster.stack][earlier:]
    assert [(e["node"], e["kind"]) for e in lost] == [("node-1", "node lost")], lost
    ends = datetime.fromisoformat(lost[0]["at"]).timestamp() + lost[0]["seconds"]
    assert ends >= healed[0]["time"] - 1, (lost[0], healed[0])


@pytest.mark.timeout(420)  # a requeue and a replacement, on a machine that may be busy
def test_a_straggler_with_on_straggler_replace_is_drained_replaced_and_the_run_resumes_there(cluster):
    # node-1 throttled (its processes in a CPU cgroup with a tenth of a core) once run-ddp trains: the run's
    # batch job names rank 1, drains node-1 and has its ranks save and exit (a spot notice's SIGUSR1), the
    # run is requeued, node-1 powers itself off and the spot path replaces it (a fresh node, unthrottled),
    # and the run resumes at the saved step there and completes.
    why = throttle.unavailable()
    if why:
        pytest.skip(f"a node cannot be throttled here: {why}")
    earlier = len(events_of(cluster))
    args = "--steps 150 --batch-size 1024 --log-every 10 --checkpoint-every 1000"
    submitted = cluster.fab(
        "run-ddp", "--on-straggler", "replace", "--hang-timeout", "20", "--skip-preflight", "--args", args, "--detach"
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    wait_for_log(cluster, run_id, STEP)
    with throttle.throttled(cluster.state_dir / cluster.stack / "nodes" / "node-1", 10):
        wait_for_log(cluster, run_id, STRAGGLER)
        saved = int(wait_for_log(cluster, run_id, PREEMPTED).group(1))
    resumed = wait_for_log(cluster, run_id, RESUMED)
    assert (int(resumed.group(1)), resumed.group(2)) == (saved, "1"), resumed.group(0)
    row: dict = {}

    def ended() -> bool:
        row.update(job(cluster, run_id))
        return row["state"] not in ("PENDING", "RUNNING", "PREEMPTED")

    slurm.wait_for(ended, "the run's end", lambda: json.dumps(row), deadline_s=300)
    log = log_of(cluster, run_id)
    assert (row["state"], row["exit_code"], row["requeues"]) == ("COMPLETED", 0, 1), (row, log[-4000:])
    assert [(s["rank"], s["node"]) for s in row["stragglers"]] == [(1, "node-1")], row
    assert "[watch] --on-straggler replace: node-1 drained" in log, log[-3000:]
    assert "[cluster] node-1: straggler: compute " in log, log[-3000:]  # requeued for it
    assert events_of(cluster)[earlier:] == [("node-1", "straggler")]


@pytest.mark.timeout(600)  # three interruptions and their replacements, on a machine that may be busy
def test_a_notice_and_a_death_each_cost_at_most_the_steps_since_a_checkpoint_and_the_cluster_heals(cluster):
    node1 = cluster.info["nodes"][1]
    earlier = len(events_of(cluster))
    args = f"--steps 10000000 --checkpoint-every {CHECKPOINT_EVERY} --log-every 50"
    submitted = cluster.fab("run-ddp", "--args", args, "--detach")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    wait_for_log(cluster, run_id, STEP)
    key_before = pinned_key(cluster, node1)

    # A spot notice: every rank stops at one step and saves it, the run waits PREEMPTED, the node is reclaimed
    # and replaced, and the run resumes at the saved step: no step is trained twice. The replacement joins from
    # the shared folder by itself (node/join.py); its first join fails (the join kit there is damaged): the
    # run waits and fab jobs says why; the next try, with the kit whole again, rejoins.
    kit = Path(cluster.info["shared_dir"]) / contract.JOIN_KIT
    whole = kit.read_text()
    assert json.loads(whole)["scheduler"]["munge_key"] and oct(kit.stat().st_mode & 0o777) == "0o600"
    kit.write_text(whole[: len(whole) // 2])
    drilled_at = datetime.now(timezone.utc)
    drilled = cluster.cli("drill", "spot", "node-1", "--notice", "15")
    assert drilled.returncode == 0, drilled.stdout + drilled.stderr
    saved = int(wait_for_log(cluster, run_id, PREEMPTED).group(1))
    supervisor_log = cluster.state_dir / cluster.stack / "supervisor.log"
    try:
        slurm.wait_for(
            lambda: "node-1: did not rejoin" in supervisor_log.read_text(),
            "a failed rejoin",
            supervisor_log.read_text,
            180,
        )
        waiting = cluster.fab("jobs")
        assert f"{run_id} waits for node-1: node lost: its replacement did not rejoin" in waiting.stdout, waiting.stdout
        assert "join failed: error: " in supervisor_log.read_text()  # it joins by itself, no fab bootstrap
        row = job(cluster, run_id)
        assert row["state"] == "PREEMPTED" and "its replacement did not rejoin" in row["waiting_for"], row
    finally:
        kit.write_text(whole)
    resumed = wait_for_log(cluster, run_id, RESUMED)
    assert (int(resumed.group(1)), resumed.group(2)) == (saved, "1")  # CLUSTER_RESTART_COUNT, from Slurm
    row = job(cluster, run_id)
    assert row["state"] == "RUNNING" and row["requeues"] == 1, row
    assert datetime.fromisoformat(row["started_at"]) < drilled_at, row  # priced from its first start
    assert pinned_key(cluster, node1) != key_before  # the fresh node's host key, pinned in place of the old
    assert cluster.cli("ssh", "node-1", "--", "true").returncode == 0  # stock OpenSSH accepts it

    # No notice: node-1's server is killed outright. Slurm is told the node is lost, the run is requeued,
    # and it resumes from its last periodic checkpoint (or the notice's, if none was taken since).
    pid_file = cluster.state_dir / cluster.stack / "nodes" / "node-1" / "sshd.pid"
    slurm.wait_for(lambda: len(STEP.findall(log_of(cluster, run_id).split(resumed.group(0))[-1])) > 0, "a step")
    follower = cluster.popen_fab("logs", "-f", "--run", run_id)  # what a user following it reads
    followed: list[str] = []
    reading = threading.Thread(target=lambda: followed.append(follower.stdout.read()), daemon=True)
    reading.start()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    again = wait_for_log(cluster, run_id, RESUMED, after=1)
    follower.send_signal(signal.SIGINT)  # only stops the following
    follower.wait(timeout=60)
    reading.join(timeout=10)
    # Slurm's `CANCELLED ... DUE TO NODE FAILURE` is followed by what happened and what comes next, as a
    # notice's requeue is: the run waits PREEMPTED, for the node, and starts again by itself
    assert "[cluster] the run was requeued (restart 2): node-1: node lost" in followed[0], followed[0][-3000:]
    assert "once every node is in service" in followed[0]
    before_death = [
        int(s) for s in STEP.findall(log_of(cluster, run_id).split(resumed.group(0))[-1].split(again.group(0))[0])
    ]
    step = int(again.group(1))
    assert again.group(2) == "2" and (step == saved or step % CHECKPOINT_EVERY == 0), again.group(0)
    assert step >= saved and max(before_death) - step < CHECKPOINT_EVERY + 50, (step, before_death[-3:])

    # Notices on both nodes at once, the head node's included: the run resumes once both are back (the head
    # is bootstrapped again; a worker that tried to join before it had a controller joins on a new try).
    slurm.wait_for(lambda: len(STEP.findall(log_of(cluster, run_id).split(again.group(0))[-1])) > 0, "a step")
    for node in ("node-0", "node-1"):
        assert cluster.cli("drill", "spot", node, "--notice", "5").returncode == 0
    both = wait_for_log(cluster, run_id, RESUMED, after=2, deadline_s=300)  # both replaced, the head re-bootstrapped
    assert both.group(2) == "3" and int(both.group(1)) >= step, both.group(0)

    events = events_of(cluster)[earlier:]
    assert events[:2] == [("node-1", "spot interruption"), ("node-1", "node lost")], events
    assert sorted(events[2:]) == [("node-0", "spot interruption"), ("node-1", "spot interruption")], events
    assert cluster.fab("stop", "--run", run_id).returncode == 0
    slurm.wait_for(lambda: job(cluster, run_id)["state"] == "CANCELLED", "the run cancelled and finished")
    # Each interruption lasts, in `cost`, until the run it held started again, not only until the node's
    # replacement rejoined (the run then waits for Slurm to start it again)
    restarts = [json.loads(line) for line in (log_of_folder(cluster, run_id) / contract.RESTARTS_RECORD).open()]
    assert [r["restart"] for r in restarts][:2] == [1, 2], restarts
    cost = json.loads(cluster.cli("cost", "--json").stdout)
    held = [e for e in cost["events"] if e["stack"] == cluster.stack][earlier:]
    for event, restart in zip(held[:2], restarts[:2], strict=True):
        ends = datetime.fromisoformat(event["at"]).timestamp() + event["seconds"]
        assert ends >= restart["at"] - 1, (event, restart)

    # With no run going, a reclaimed node is replaced all the same: the cluster heals.
    supervisor_lines = len(supervisor_log.read_text().splitlines())
    assert cluster.cli("drill", "spot", "node-1", "--notice", "1").returncode == 0
    slurm.wait_for(
        lambda: "node-1: rejoined" in "\n".join(supervisor_log.read_text().splitlines()[supervisor_lines:]),
        "node-1 replaced with no run going",
        supervisor_log.read_text,
    )
    # Slurm may still flag the node as not responding (`idle*`: a ping of the old machine that failed after
    # the new one registered) until its next ping of the node, up to SlurmdTimeout / 3 later.
    status: dict = {}

    def healed() -> bool:
        status.update(json.loads(cluster.cli("status", "--json").stdout))
        return [(n["state"], n["reachable"], n["scheduler"]) for n in status["nodes"]] == [("up", True, "idle")] * 2

    slurm.wait_for(healed, "both nodes up and idle in Slurm", lambda: json.dumps(status))

    # --scheduler none turns Slurm off: its daemons stop, and the join kit loses its scheduler part (nothing joins
    # a Slurm gone; a replacement still makes its venv and env file from it).
    off = cluster.fab("bootstrap", "--scheduler", "none")
    assert off.returncode == 0, off.stdout + off.stderr
    assert json.loads(kit.read_text())["scheduler"] is None
    daemons = ("munged", "slurmctld", "slurmd", "spot_watch")
    left = [" ".join(procfs.command_line(pid)) for pid in procfs.pids_working_in(str(cluster.state_dir))]
    assert not [line for line in left if any(name in line for name in daemons)], left

    down = cluster.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert node_server_processes(cluster.state_dir) == []
    assert _supervisors(cluster) == []
    slurm.wait_for(  # nothing of the replaced or original nodes: their daemons, steps, tasks
        lambda: procfs.pids_working_in(str(cluster.state_dir)) == [],
        "no process left in the cluster's folders",
        lambda: str([procfs.command_line(pid) for pid in procfs.pids_working_in(str(cluster.state_dir))]),
        deadline_s=10,
    )


def _supervisors(cluster) -> list[int]:
    """This cluster's supervisors still alive (found by the state folder in their environment)."""
    return [
        pid
        for pid in procfs.pids_with_environment(f"CLUSTER_STATE_DIR={cluster.state_dir}")
        if "infra.providers.local.supervisor" in (procfs.command_line(pid) or [])
    ]
