"""node/scheduler.py with real daemons: munged, slurmctld and two slurmd on this machine's loopback, each
node in a home of its own as the local provider's nodes are. Skipped, saying why, without slurm-wlm and
munge (.ci/run installs them)."""

import asyncio
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node import calls, procfs, slurm_daemons
from node.slurm_conf import Paths
from tests.support import REPO, network, slurm

CALLS = REPO / "node" / "calls.py"
pytestmark = pytest.mark.skipif(bool(slurm.unavailable()), reason=f"Slurm: {slurm.unavailable()}")


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """A 2-node scheduler, up and idle, for the module's tests; stopped afterwards, pass or fail."""
    cluster = slurm.SlurmCluster(tmp_path_factory.mktemp("slurm"), slurm.description(2, slurm.free_ports()))
    try:
        cluster.start()
        cluster.wait_idle()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_scheduler(tmp_path):
    cluster = slurm.SlurmCluster(tmp_path / "slurm", slurm.description(2, slurm.free_ports()))
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_state(cluster, job_id: str, *states: str) -> dict:
    found = {}

    def reached() -> bool:
        found.update(cluster.job(job_id))
        return found.get("JobState") in states

    slurm.wait_for(reached, f"job {job_id} {' or '.join(states)}", lambda: json.dumps(found))
    return found


def test_comes_up_idle_and_a_second_start_restarts_nothing(scheduler):
    states = [scheduler.state(i) for i in range(2)]
    assert [s["node_state"] for s in states] == ["idle", "idle"], states
    assert set(states[0]["daemons"]) == {"munged", "slurmctld", "slurmd", "spot-watch"}
    assert set(states[1]["daemons"]) == {"munged", "slurmd", "spot-watch"}
    assert all(pid for s in states for pid in s["daemons"].values()), states

    again = scheduler.start()

    assert [a["action"] for a in again] == ["unchanged", "unchanged"], again
    assert [a["daemons"] for a in again] == [s["daemons"] for s in states]


def test_srun_runs_one_task_per_node(scheduler):
    result = scheduler.client("srun", "--nodes=2", "--ntasks-per-node=1", "bash", "-c", 'echo "on $SLURMD_NODENAME"')

    assert sorted(result.stdout.split("\n")[:-1]) == ["on node-0", "on node-1"], result


def test_every_listening_socket_is_on_loopback(scheduler):
    """With a step running, so srun's and the steps' own sockets are there too."""
    job = scheduler.sbatch("--nodes=2", "--wrap", "srun --nodes=2 --ntasks-per-node=1 sleep 60")
    try:
        wait_state(scheduler, job, "RUNNING")
        slurm.wait_for(lambda: "sleep" in _names(scheduler.processes()), "the step's tasks running")
        ours = set(scheduler.processes())
        sockets = [s for s in slurm.listening_sockets() if s[2] in ours]

        assert {_name(pid) for _, _, pid in sockets} >= {"slurmctld", "slurmd", "srun"}, sockets
        for address, port, pid in sockets:
            assert ipaddress.ip_address(address).is_loopback, (address, port, _name(pid))
    finally:
        scheduler.client("scancel", job)


def test_two_jobs_run_one_after_the_other(scheduler, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    log = marks / "log"
    script = f'echo "$SLURM_JOB_ID start" >> {log}; sleep 2; echo "$SLURM_JOB_ID end" >> {log}'
    first = scheduler.sbatch("--nodes=2", "--wrap", script)
    second = scheduler.sbatch("--nodes=2", "--wrap", script)

    for job in (first, second):
        wait_state(scheduler, job, "COMPLETED")

    events = [tuple(line.split()) for line in log.read_text().splitlines()]
    assert events == [
        (first, "start"),
        (first, "end"),
        (second, "start"),
        (second, "end"),
    ]


def test_backfill_runs_a_heterogeneous_job_and_keeps_the_order_of_jobs_that_take_every_node(scheduler):
    """sched/backfill, as torchx's heterogeneous jobs need; runs take every node, so a later run does not
    start before one that waits for a node another job holds."""
    het = scheduler.client("sbatch", "--parsable", "-N1", ":", "-N1", "--wrap", "srun --het-group=0,1 true")
    wait_state(scheduler, het.stdout.strip().split(";")[0], "COMPLETED")
    holder = scheduler.sbatch("--nodes=1", "--nodelist=node-0", "--wrap", "sleep 4")
    wait_state(scheduler, holder, "RUNNING")
    runs = [scheduler.sbatch("--nodes=2", "--exclusive", "--wrap", "sleep 1") for _ in range(2)]

    ended = [wait_state(scheduler, job, "COMPLETED") for job in runs]
    assert ended[0]["EndTime"] <= ended[1]["StartTime"], ended


def test_a_requeued_job_runs_again_within_seconds(scheduler, tmp_path):
    """Slurm holds a requeued job `cred_expire + 1` s (121 s by default) and looks at it again in its main
    loop (every 60 s by default); the scheduler's 10 s credentials and a loop every second start it again
    in about 12 s."""
    job = scheduler.sbatch("--nodes=2", "--requeue", "--wrap", "sleep 120")
    try:
        wait_state(scheduler, job, "RUNNING")
        scheduler.client("scontrol", "requeue", job)
        requeued_at = time.monotonic()
        slurm.wait_for(
            lambda: scheduler.job(job).get("Restarts") == "1" and scheduler.job(job).get("JobState") == "RUNNING",
            f"job {job} running again after its requeue",
            lambda: json.dumps(scheduler.job(job)),
            deadline_s=45,  # generous for a loaded machine, and far under the default hold
        )
        print(f"requeued job running again after {time.monotonic() - requeued_at:.1f} s")
    finally:
        scheduler.client("scancel", job)


def test_stop_leaves_no_process_and_a_changed_description_restarts(own_scheduler):
    cluster = own_scheduler
    first = cluster.start()
    cluster.wait_idle()
    changed = json.loads(json.dumps(cluster.description))
    changed["nodes"][1]["cpus"] = 1

    restarted = cluster.start(changed)

    assert [a["action"] for a in restarted] == ["restarted", "restarted"], restarted
    assert all(
        set(a["daemons"].values()).isdisjoint(b["daemons"].values()) for a, b in zip(first, restarted, strict=True)
    )
    cluster.wait_idle()
    job = cluster.sbatch("--nodes=2", "--wrap", "srun --nodes=2 --ntasks-per-node=1 sleep 300")
    wait_state(cluster, job, "RUNNING")
    slurm.wait_for(lambda: "sleep" in _names(cluster.processes()), "the step's tasks running")

    cluster.stop()

    left = cluster.processes()
    assert left == [], [(pid, _name(pid)) for pid in left]
    sockets = [Paths(str(home)).sockets for home in cluster.homes]
    assert not [s for s, home in zip(sockets, cluster.homes, strict=True) if str(home) not in s and Path(s).exists()]
    assert [cluster.state(i)["daemons"] for i in range(2)] == [{"munged": None, "slurmd": None, "spot-watch": None}] * 2


@pytest.fixture
def hosts_file():
    """Names added to /etc/hosts for one test (root, as in CI), and the file as it was afterwards. The file's
    own lines are never rewritten (other tests resolve names meanwhile): lines go after them and are cut
    off again."""
    path = Path("/etc/hosts")
    if not os.access(path, os.W_OK) or shutil.which("unshare") is None:
        pytest.skip("needs a writable /etc/hosts and unshare (root)")
    length = path.stat().st_size
    newline = "" if path.read_bytes().endswith(b"\n") or length == 0 else "\n"

    def names(mapping: dict) -> None:
        os.truncate(path, length)
        with path.open("a") as f:
            f.write(newline + "".join(f"{address} {name}\n" for name, address in mapping.items()))

    try:
        yield names
    finally:
        os.truncate(path, length)


def test_a_node_known_by_name_comes_back_at_a_new_address_and_slurm_reaches_it(own_scheduler, hosts_file):
    """As an AWS spot worker does: its replacement has another address. Slurm knows such nodes by name
    (NoAddrCache), so the controller and srun find the new address with no change to any configuration.
    A host's name is what its daemons bind: the moved node runs in a UTS namespace of its own."""
    cluster = own_scheduler
    suffix = cluster.description["cluster"]
    names = [f"{suffix}-0", f"{suffix}-1"]
    for node, name in zip(cluster.description["nodes"], names, strict=True):
        node["name"] = node["address"] = name
    hosts_file({names[0]: "127.0.0.1", names[1]: "127.0.0.1"})  # where this host's name resolves (loopback)
    text = json.dumps(cluster.description)
    for index, name in enumerate(names):
        started = cluster.scheduler(index, "start", "--node", name, stdin=text)
        assert started.returncode == 0, (started.stderr, cluster.logs(index))
    cluster.wait_idle()
    assert "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny,NoAddrCache" in cluster.conf.read_text()

    cluster.scheduler(1, "stop")
    hosts_file({names[0]: "127.0.0.1", names[1]: "127.0.0.2"})
    script = shlex.join([sys.executable, str(slurm.SCHEDULER), "start", "--node", names[1]])
    moved = subprocess.run(
        ["unshare", "--uts", "sh", "-c", f"hostname {names[1]} && exec {script}"],
        input=text,
        env={**os.environ, "HOME": str(cluster.homes[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert moved.returncode == 0, (moved.stderr, cluster.logs(1))

    listening = [s for s in slurm.listening_sockets() if s[0] == "127.0.0.2"]
    assert listening, slurm.listening_sockets()
    cluster.wait_idle()
    ran = cluster.client("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c", "echo $SLURMD_NODENAME")
    assert sorted(line.replace(" ", "") for line in ran.stdout.splitlines()) == [f"0:{names[0]}", f"1:{names[1]}"]


def test_powering_off_a_local_node_ends_its_daemons_steps_and_tasks(own_scheduler):
    """The local provider's node server ends what its node started (`ProcessTable.end_all`): the
    registered daemons, and the steps slurmd forks into sessions of their own with an empty environment."""
    from infra.providers.local.node_server import ProcessTable

    cluster = own_scheduler
    cluster.start()
    cluster.wait_idle()
    job = cluster.sbatch("--nodes=2", "--wrap", "srun --nodes=2 --ntasks-per-node=1 sleep 300")
    wait_state(cluster, job, "RUNNING")
    slurm.wait_for(lambda: "sleep" in _names(slurm.node_processes(cluster, 1)), "node-1's task running")

    asyncio.run(ProcessTable(cluster.homes[1], token="unused").end_all())

    # Killed: each is gone once the kernel has finished its exit (a moment on a loaded machine).
    slurm.wait_for(
        lambda: slurm.node_processes(cluster, 1) == [],
        "node-1's processes gone",
        lambda: str([(pid, _name(pid)) for pid in slurm.node_processes(cluster, 1)]),
        deadline_s=10,
    )
    assert "slurmctld" in _names(slurm.node_processes(cluster, 0))


def test_accounting_lists_runs_across_restarts_and_torchx_submits_and_follows_a_job(tmp_path, monkeypatch):
    """slurmdbd over a MariaDB of the head node's own: `sacct` lists a completed job and a run whose node
    exited 3 (with 3), after slurmdbd restarts and after a changed description restarts every daemon (as
    `fab bootstrap` does); slurmdbd listens on loopback, the database on no TCP port at all. torchx's Slurm
    scheduler (a heterogeneous job, followed through squeue and then sacct) sees its job succeed on both."""
    cluster = slurm.SlurmCluster(tmp_path / "slurm", slurm.description(2, slurm.free_ports(), accounting=True))
    try:
        started = time.monotonic()
        cluster.start()
        cluster.wait_idle()
        print(f"2 nodes with accounting up and idle in {time.monotonic() - started:.1f} s")
        done = cluster.sbatch("--nodes=2", "--wrap", "srun true")
        run = tmp_path / "run"
        run.mkdir()
        failed = submit(cluster, run_spec(cluster, run, ["exec sleep 300", "sleep 1; exit 3"]))
        for job in (done, failed):
            wait_state(cluster, job, "COMPLETED", "FAILED")
        ours = set(cluster.processes())
        sockets = [s for s in slurm.listening_sockets() if s[2] in ours]
        assert "slurmdbd" in _names([pid for _, _, pid in sockets]), sockets
        assert "mariadbd" not in _names([pid for _, _, pid in sockets]), sockets
        assert all(ipaddress.ip_address(address).is_loopback for address, _, _ in sockets), sockets

        cluster.scheduler(0, "start", stdin=json.dumps(cluster.description))  # unchanged: nothing restarts
        pid = slurm_daemons.running_daemon(Paths(str(cluster.homes[0])), "slurmdbd")
        os.kill(pid, signal.SIGKILL)  # a slurmdbd that died: the next start starts it again
        slurm.wait_for(lambda: not procfs.alive(pid), "slurmdbd gone")
        changed = json.loads(json.dumps(cluster.description))
        changed["nodes"][1]["cpus"] = 1
        assert [a["action"] for a in cluster.start(changed)] == ["restarted", "restarted"]
        cluster.wait_idle()

        def listed() -> dict:
            out = cluster.client(
                "sacct",
                "--allocations",
                "--noheader",
                "--parsable2",
                "--format=JobID,State,ExitCode,NodeList,Start,End",
            ).stdout
            return {row[0]: row[1:] for row in (line.split("|") for line in out.splitlines())}

        slurm.wait_for(lambda: {done, failed} <= set(listed()), "both jobs in sacct", lambda: str(listed()))
        rows = listed()
        assert rows[done][:3] == ["COMPLETED", "0:0", "node-[0-1]"], rows
        assert rows[failed][:3] == ["FAILED", "3:0", "node-[0-1]"], rows
        assert all(rows[job][3] <= rows[job][4] for job in (done, failed)), rows  # start and end times

        for attempt in range(3):
            app_id = _torchx_job(cluster, tmp_path, monkeypatch)
            seen = _torchx_follow(cluster, app_id)
            srun_said = "".join(path.read_text() for path in tmp_path.glob(f"slurm-{app_id}.out"))
            # With the suite's other clusters up, srun once found every port of this cluster's SrunPortRange
            # taken ("sock_bind_listen_range: all ports in range ... exhausted"): a clash of the tests' random
            # port blocks, not torchx's or ours; a job that failed so is submitted again.
            if "ports in range" not in srun_said or attempt == 2:
                break
        replicas = seen.roles_statuses[0].replicas
        assert seen.state.name == "SUCCEEDED" and {r.state.name for r in replicas} == {"SUCCEEDED"}, seen
        assert sorted(r.hostname for r in replicas) == ["node-0", "node-1"], seen
    finally:
        cluster.stop()
    assert cluster.processes() == []


def _torchx_job(cluster, folder, monkeypatch) -> str:
    """A 2-replica job through torchx's Slurm scheduler, as on node-0 (its SLURM_CONF); its app id."""
    from torchx import specs
    from torchx.schedulers.slurm_scheduler import create_scheduler

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(folder)
    role = specs.Role(
        name="trainer",
        image=str(folder),
        entrypoint="bash",
        args=["-c", "echo hello from $SLURM_PROCID"],
        num_replicas=2,
        resource=specs.Resource(cpu=1, gpu=0, memMB=100),
    )
    scheduler = create_scheduler("test")
    return scheduler.schedule(scheduler.submit_dryrun(specs.AppDef("hello", roles=[role]), {}))


def _torchx_follow(cluster, app_id: str):
    """torchx's describe until the job ended. Not while it waits: torchx reads `squeue --json` of a pending
    job as later Slurm releases write it (`job_resources`, which 22.05 gives only once it runs)."""
    from torchx import specs
    from torchx.schedulers.slurm_scheduler import create_scheduler

    scheduler, seen = create_scheduler("test"), []
    wait_state(cluster, app_id, "RUNNING", "COMPLETED", "FAILED")

    def ended() -> bool:
        seen[:] = [scheduler.describe(app_id)]
        return seen[0] is not None and seen[0].state in (specs.AppState.SUCCEEDED, specs.AppState.FAILED)

    slurm.wait_for(ended, f"torchx sees job {app_id} end", lambda: str(seen))
    return seen[0]


def _name(pid: int) -> str:
    argv = procfs.command_line(pid)
    return argv[0].split("/")[-1].split(":")[0] if argv else "?"


def _names(pids: list) -> set:
    return {_name(pid) for pid in pids}


def run_spec(cluster, folder, commands: list) -> dict:
    """A run of node/slurm_run.py: one command per node, the log in `folder`."""
    return {
        "run_id": f"run-{folder.name}",
        "log": str(folder / "output.log"),
        "python": sys.executable,
        "nodes": [
            {"name": f"node-{i}", "home": str(home), "command": command}
            for i, (home, command) in enumerate(zip(cluster.homes, commands, strict=True))
        ],
    }


def submit(cluster, spec: dict) -> str:
    """The run's job id: submitted as fab does, through a node call."""
    request = calls.SubmitRun(spec)  # on stdin, as a spec's commands may carry secrets
    result = cluster.scheduler(0, "-", stdin=calls.encoded(request, calls.code_version()), program=CALLS)
    return calls.reply_from(request, result.returncode, result.stdout, result.stderr).job_id


def hello_command(cluster, index: int, run_id: str, port: int) -> str:
    """torchrun through node/torchrun.py on node `index`, as a launch starts it, then a progress bar."""
    addresses = [node["address"] for node in cluster.description["nodes"]]
    variables = {
        "NODE_RANK": str(index),
        "MASTER_ADDR": addresses[0],
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    torchrun = [
        sys.executable,
        str(REPO / "node" / "torchrun.py"),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={addresses[0]}:{port}",
        f"--rdzv-conf=is_host={int(index == 0)}",
        f"--rdzv-id={run_id}",
        f"--local-addr={addresses[index]}",
        "--max-restarts=0",
        str(REPO / "examples" / "distributed_hello.py"),
        "--expect-world-size=2",
    ]
    environment = " ".join(f"{key}={shlex.quote(value)}" for key, value in variables.items())
    return f"env {environment} {shlex.join(torchrun)} && printf 'bar 1\\rbar 2\\rbar 3\\n'"


def test_a_run_trains_on_every_node_with_its_output_prefixed_in_the_log(scheduler, tmp_path):
    port = network.free_port()
    spec = run_spec(scheduler, tmp_path, [hello_command(scheduler, i, f"run-{tmp_path.name}", port) for i in range(2)])

    job = submit(scheduler, spec)
    final = wait_state(scheduler, job, "COMPLETED", "FAILED", "CANCELLED")

    log = (tmp_path / "output.log").read_bytes().decode()  # read_text would turn each \r into \n
    assert final["JobState"] == "COMPLETED", log
    assert "all-reduce, broadcast and all-gather checked, all correct" in log
    for name in ("node-0", "node-1"):
        assert f"[{name}] bar 1\r[{name}] bar 2\r[{name}] bar 3\n" in log
    assert all(line.startswith(("[node-0] ", "[node-1] ")) for line in log.splitlines() if line), log


def test_a_failing_node_ends_the_others_and_slurm_records_its_exit_code(scheduler, tmp_path):
    """The node that failed ends the others (which exit 143); Slurm's books say the run's code, 3, not 143."""
    marker = tmp_path / "still-running"
    spec = run_spec(
        scheduler, tmp_path, [f"touch {marker}; exec sleep 300", f"until [ -e {marker} ]; do sleep 0.1; done; exit 3"]
    )

    job = submit(scheduler, spec)
    final = wait_state(scheduler, job, "FAILED", "COMPLETED", "CANCELLED")

    log = (tmp_path / "output.log").read_text()
    assert final["JobState"] == "FAILED", final
    assert "node-1: task 1: Exited with exit code 3" in log, log
    assert final["ExitCode"] == "3:0", final
    slurm.wait_for(lambda: "sleep" not in _names(scheduler.processes()), "node-0's command ended")
