"""Own machines that already run Slurm (`slurm: existing` in the hosts file), end to end: `up --hosts`
adopts two machines (local node servers, each with a home of its own, standing in for them) whose Slurm
(real slurmctld and slurmd, started here as an administrator would have, with node names of its own)
is not ours: bootstrap finds each host's node there and starts no daemon, runs go to its partition
under its own names with our `[node-i]` output, and down cancels this stack's queued runs there and
leaves that Slurm running."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from node import contract, procfs
from tests.support import slurm
from tests.support.cli import assert_one_line_error, run_cli, run_fab
from tests.support.clusters import start_local_cluster_in

pytestmark = pytest.mark.skipif(slurm.unavailable() is not None, reason=f"Slurm: {slurm.unavailable()}")

NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    """Two machines (a local cluster of another state folder) and the Slurm they run: nodes alpha and beta
    at the machines' addresses, partition `main`."""
    folder = tmp_path_factory.mktemp("existing-slurm")
    machines_state = folder / "machines-state"
    inventory = start_local_cluster_in(machines_state, "machines")
    description = slurm.description(2, slurm.free_ports())
    for node, name, machine in zip(description["nodes"], NAMES, inventory["nodes"], strict=True):
        node.update(name=name, address=machine["public_ip"])
    theirs = slurm.SlurmCluster(folder / "their-slurm", description)
    try:
        for index, name in enumerate(NAMES):
            started = theirs.scheduler(index, "start", "--node", name, stdin=json.dumps(description))
            assert started.returncode == 0, (started.stdout, started.stderr, theirs.logs(index))
        theirs.wait_idle()
        yield inventory, theirs
    finally:
        theirs.stop()
        run_cli("down", "--stack", "machines", CLUSTER_STATE_DIR=str(machines_state))


@pytest.fixture(scope="module")
def adopted(machines, tmp_path_factory):
    """`up --hosts` on the machines with `slurm: existing`, bootstrapped; down afterwards."""
    inventory, theirs = machines
    folder = tmp_path_factory.mktemp("adopting")
    env = {"CLUSTER_STATE_DIR": str(folder / "state")}
    hosts_file = folder / "hosts.yaml"
    hosts_file.write_text(
        yaml.safe_dump(
            {
                "key": inventory["ssh_key"],
                "user": inventory["ssh_user"],
                "python": inventory["python"],
                "slurm": "existing",
                "partition": "main",
                "slurm_conf": str(theirs.conf),
                # On one machine every Slurm node's NodeAddr is the address the host's name resolves to, so
                # the hosts name their nodes (finding them by address or host name: tests/unit/test_scheduler).
                "hosts": [
                    {"address": n["public_ip"], "port": n["ssh_port"], "slurm_name": name}
                    for n, name in zip(inventory["nodes"], NAMES, strict=True)
                ],
            }
        )
    )
    up = run_cli("up", "--hosts", str(hosts_file), **env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        bootstrap = run_fab("bootstrap", "--master-port", str(slurm.free_ports()), **env)
        assert bootstrap.returncode == 0, bootstrap.stdout + bootstrap.stderr
        yield env, bootstrap
    finally:
        run_cli("down", "--stack", "hosts", **env)


def test_a_held_hello_is_clean_and_their_stopped_controller_is_named_as_such(machines, adopted):
    """Item 22 of issue 28: a plain attached hello on their Slurm prints no stray Slurm line and no false
    warning; with their controller stopped, status says that (not "daemons down") and exits 1, and a launch
    is refused in one line that does not offer to restart daemons that are not ours."""
    _, theirs = machines
    env, _ = adopted
    hello = run_fab("hello", **env)
    assert hello.returncode == 0, hello.stdout + hello.stderr
    assert "couldn't chdir" not in hello.stdout + hello.stderr, hello.stdout + hello.stderr
    assert "joined a process group" not in hello.stdout + hello.stderr, hello.stdout + hello.stderr

    controller = theirs.state(0)["daemons"]["slurmctld"]
    os.kill(controller, signal.SIGTERM)
    slurm.wait_for(lambda: not procfs.alive(controller), "their controller gone")
    try:
        status = run_cli("status", **env)
        assert status.returncode == 1, status.stdout + status.stderr
        assert "daemons down" not in status.stdout, status.stdout
        assert "their Slurm controller does not answer" in status.stdout, status.stdout
        # A launch meanwhile: one line, exit 1, nothing queued, and no advice to restart daemons not ours.
        refused = run_fab("hello", timeout=120, **env)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "Unable to contact slurm controller" in refused.stderr, refused.stderr
        assert "its administrator runs that Slurm" in refused.stderr, refused.stderr
    finally:
        started = theirs.scheduler(0, "start", "--node", NAMES[0], stdin=json.dumps(theirs.description))
        assert started.returncode == 0, (started.stdout, started.stderr, theirs.logs(0))
        theirs.wait_idle()


def test_runs_go_to_the_existing_slurm_under_its_names_and_down_leaves_it_running(machines, adopted, tmp_path):
    _, theirs = machines
    env, bootstrap = adopted
    # Each host recorded its node's name in their Slurm (the bootstrap table says `existing Slurm: alpha (main)`)
    setup = json.loads((Path(env["CLUSTER_STATE_DIR"]) / "hosts" / "bootstrap.json").read_text())
    for node in ("node-0", "node-1"):
        record = json.loads((Path(setup["nodes"][node]["probe"]["home"]) / contract.SLURM_EXISTING).read_text())
        assert record["names"] == dict(zip(("node-0", "node-1"), NAMES, strict=True)), record
        assert record["partition"] == "main", record
    assert "slurmctld" not in bootstrap.stdout  # nothing of ours started
    status = json.loads(run_cli("status", "--json", **env).stdout)
    assert [n["scheduler"] for n in status["nodes"]] == ["idle", "idle"], status

    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n")
    submitted = run_fab("run", "--script", str(script), "--detach", **env)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    followed = run_fab("logs", "-f", "--run", run_id, **env)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "[node-0] rank 0 of 2" in followed.stdout and "[node-1] rank 1 of 2" in followed.stdout, followed.stdout
    rows = {row["run_id"]: row for row in json.loads(run_fab("jobs", "--json", **env).stdout)}
    assert rows[run_id]["state"] == "COMPLETED"
    # Their controller ran it, on their nodes, in their partition, tagged as this stack's.
    completions = (theirs.homes[0] / ".gpu-cluster" / "slurm" / "jobcomp.log").read_text()
    line = next(line for line in completions.splitlines() if f"Name={run_id}" in line)
    assert "alpha" in line and "beta" in line and "Partition=main" in line, line

    # A run that cannot start (its nodes held by their own job) waits in their queue; down cancels it.
    blocker = theirs.sbatch("--nodes=2", "--exclusive", "--wrap", "sleep 300")
    try:
        queued = run_fab("run", "--script", str(script), "--detach", **env)
        assert queued.returncode == 0, queued.stdout + queued.stderr
        queued_id = queued.stdout.strip().splitlines()[-1]
        assert _queue(theirs).get(queued_id) == "PENDING", _queue(theirs)
        down = run_cli("down", "--stack", "hosts", **env)
        assert down.returncode == 0 and "cancelled Slurm job(s)" in down.stdout, down.stdout + down.stderr
        assert f"run {queued_id}, queued, was cancelled with the cluster" in down.stdout, down.stdout
        assert down.stdout.count("cancelled Slurm job(s)") == 1, down.stdout  # their one controller: said once
        deadline = time.monotonic() + slurm.DEADLINE_S
        while queued_id in _queue(theirs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert queued_id not in _queue(theirs)
        assert theirs.job(blocker).get("JobState") in ("RUNNING", "PENDING")  # their own job is theirs
    finally:
        theirs.client("scancel", blocker, check=False)
    for index in range(2):  # their Slurm goes on
        assert all(pid for pid in theirs.state(index)["daemons"].values()), theirs.state(index)


@pytest.mark.parametrize(
    "wrong, words",
    [
        ({"partition": "nosuch"}, ["partition nosuch is not in its Slurm (its partitions: main)"]),
        ({"slurm_name": "gamma"}, ["slurm_name gamma is not a node of partition main (its nodes: alpha, beta)"]),
        ({"slurm_conf": "/nonexistent/slurm.conf"}, ["slurm_conf /nonexistent/slurm.conf is not a file"]),
    ],
)
def test_adoption_mistakes_are_refused_at_up_in_one_line(machines, tmp_path, wrong, words):
    inventory, theirs = machines
    hosts = [
        {"address": n["public_ip"], "port": n["ssh_port"], "slurm_name": name}
        for n, name in zip(inventory["nodes"], NAMES, strict=True)
    ]
    if "slurm_name" in wrong:
        hosts[1]["slurm_name"] = wrong["slurm_name"]
    data = {
        "key": inventory["ssh_key"],
        "user": inventory["ssh_user"],
        "python": inventory["python"],
        "slurm": "existing",
        "partition": wrong.get("partition", "main"),
        "slurm_conf": wrong.get("slurm_conf", str(theirs.conf)),
        "hosts": hosts,
    }
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(data))
    env = {"CLUSTER_STATE_DIR": str(tmp_path / "state")}
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file), **env), *words)
    assert not (tmp_path / "state" / "hosts").exists()


def _queue(theirs) -> dict:
    """{job name: state} of their queue."""
    out = theirs.client("squeue", "--noheader", "--format=%j %T", check=False).stdout
    return dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)
