"""The scheduler's pure parts (node/scheduler.py and node/slurm_*.py): the description's checks, slurm.conf and
gres.conf, the socket folder, the programs a node needs, a Slurm the hosts already run, a run's step."""

import base64
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from node import (
    contract,
    replicas,
    scheduler,
    slurm_batch,
    slurm_conf,
    slurm_daemons,
    slurm_existing,
    slurm_restarts,
    slurm_run,
    slurm_step,
)
from node.run_spec import RunSpec

KEY = base64.b64encode(b"k" * 1024).decode()


def description(*addresses: str, gpus=(0, 0), **changes) -> dict:
    data = {
        "cluster": "gc",
        "munge_key": KEY,
        "ports": {"slurmctld": 7000, "slurmd": 7001, "srun": [7100, 7199]},
        "nodes": [
            {"name": f"node-{i}", "address": a, "cpus": 4, "memory_mb": 8000, "gpus": g}
            for i, (a, g) in enumerate(zip(addresses, gpus, strict=True))
        ],
    }
    data.update(changes)
    return data


def conf_lines(cluster, node_index=0, home="/home/u", bound="127.0.0.1") -> list:
    text = slurm_conf.slurm_conf(cluster, cluster.nodes[node_index], slurm_conf.Paths(home), bound, "u")
    return text.splitlines()


def test_one_machine_nodes_are_reached_where_the_daemons_bind_each_on_its_own_port():
    cluster = slurm_conf.parse_cluster(description("127.0.0.10", "127.0.0.11"))

    lines = conf_lines(cluster)

    assert "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny" in lines
    nodes = [line for line in lines if line.startswith("NodeName=")]
    assert [line.split()[2:4] for line in nodes] == [
        ["NodeAddr=127.0.0.1", "Port=7001"],
        ["NodeAddr=127.0.0.1", "Port=7002"],
    ]
    assert any(line.startswith("SlurmctldHost=") and line.endswith("(127.0.0.1)") for line in lines)


def test_nodes_on_several_machines_are_reached_at_their_own_addresses():
    cluster = slurm_conf.parse_cluster(description("10.0.0.5", "10.0.0.6", gpus=(4, 0)))

    lines = conf_lines(cluster, node_index=1, bound="10.0.0.6")

    assert "SlurmctldHost=node-0(10.0.0.5)" in lines  # the controller's name matters on the head only
    assert [line.split()[2] for line in lines if line.startswith("NodeName=")] == [
        "NodeAddr=10.0.0.5",
        "NodeAddr=10.0.0.6",
    ]
    assert "GresTypes=gpu" in lines
    assert "Gres=gpu:4" in next(line for line in lines if line.startswith("NodeName=node-0"))
    paths = slurm_conf.Paths("/home/u")
    assert slurm_conf.gres_conf(cluster, cluster.nodes[0], paths).splitlines()[1:] == [
        "NodeName=node-0 Name=gpu File=/dev/nvidia[0-3]"
    ]
    assert slurm_conf.gres_conf(cluster, cluster.nodes[1], paths) is None


def test_one_machine_gpus_are_files_of_the_nodes_own():
    cluster = slurm_conf.parse_cluster(description("127.0.0.10", "127.0.0.11", gpus=(1, 2)))
    paths = slurm_conf.Paths("/home/n1")

    files = slurm_conf.configuration(cluster, cluster.nodes[1], paths, "127.0.0.1", "u")

    folder = "/home/n1/.gpu-cluster/slurm/gpus"
    assert files[paths.gres][0].decode().splitlines()[1:] == [f"NodeName=node-1 Name=gpu File={folder}/nvidia[0-1]"]
    assert slurm_conf.gpu_files(cluster, cluster.nodes[1], paths) == [f"{folder}/nvidia0", f"{folder}/nvidia1"]


def test_nodes_known_by_name_are_looked_up_at_every_connection(monkeypatch):
    # AWS spot workers come back at a new address: Slurm knows them by name, each node's /etc/hosts maps it.
    cluster = slurm_conf.parse_cluster(description("node-0", "node-1"))

    lines = conf_lines(cluster, node_index=1, bound="10.0.0.9")

    assert "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny,NoAddrCache" in lines
    assert "SlurmctldHost=node-0(node-0)" in lines
    assert [line.split()[2] for line in lines if line.startswith("NodeName=")] == ["NodeAddr=node-0", "NodeAddr=node-1"]
    monkeypatch.setattr(slurm_conf.socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("10.0.0.7", 0))])
    with pytest.raises(slurm_conf.UsageError, match=r"node-1 resolves to 10\.0\.0\.7, not to 10\.0\.0\.9"):
        slurm_conf.check_binding(cluster, cluster.nodes[1], "10.0.0.9")
    slurm_conf.check_binding(cluster, cluster.nodes[1], "10.0.0.7")


def test_requeue_and_order_settings():
    lines = conf_lines(slurm_conf.parse_cluster(description("127.0.0.10", "127.0.0.11")))

    assert f"AuthInfo=socket=/home/u/.gpu-cluster/slurm/munge.socket,cred_expire={10}" in lines
    for setting in ("SchedulerType=sched/backfill", "ReturnToService=2", "JobCompType=jobcomp/filetxt"):
        assert setting in lines
    assert "OverSubscribe=EXCLUSIVE" in lines[-1] and "Nodes=node-0,node-1" in lines[-1]


def test_accounting_points_every_node_at_the_head_nodes_slurmdbd_with_its_own_munge():
    ports = {"slurmctld": 7000, "slurmd": 7001, "srun": [7100, 7199], "slurmdbd": 7018}
    cluster = slurm_conf.parse_cluster(description("10.0.0.5", "10.0.0.6", ports=ports))

    lines = conf_lines(cluster, node_index=1, home="/home/v", bound="10.0.0.6")

    assert "AccountingStorageType=accounting_storage/slurmdbd" in lines
    assert {"AccountingStorageHost=10.0.0.5", "AccountingStoragePort=7018"} <= set(lines)
    assert "AccountingStoragePass=/home/v/.gpu-cluster/slurm/munge.socket" in lines
    assert slurm_daemons.daemons_of(cluster, cluster.nodes[0])[:3] == ["munged", "mariadbd", "slurmdbd"]
    assert "slurmdbd" not in slurm_daemons.daemons_of(cluster, cluster.nodes[1])
    plain = slurm_conf.parse_cluster(description("10.0.0.5", gpus=(0,)))
    assert slurm_daemons.daemons_of(plain, plain.nodes[0]) == ["munged", "slurmctld", "slurmd", "spot-watch"]


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"cluster": "Bad Name"}, "cluster"),
        ({"nodes": []}, "nodes"),
        ({"munge_key": "!!"}, "base64"),
        ({"munge_key": base64.b64encode(b"short").decode()}, "32"),
        ({"ports": {"slurmctld": 7000, "slurmd": 7000, "srun": [7100, 7199]}}, "overlap"),
        ({"ports": {"slurmctld": 7000, "slurmd": 7001}}, "ports"),
        ({"ports": {"slurmctld": 7000, "slurmd": 7001, "srun": [7100, 7199], "slurmdbd": 7150}}, "overlap"),
        ({"nodes": [{"name": "node-0", "address": "db.example", "cpus": 1, "memory_mb": 1}]}, "nor the node's name"),
    ],
)
def test_a_bad_description_names_what_is_wrong(changes, words):
    with pytest.raises(slurm_conf.UsageError, match=words):
        slurm_conf.parse_cluster(description("127.0.0.10", "127.0.0.11", **changes))


def test_check_names_the_first_missing_program_and_its_package(tmp_path, monkeypatch, capsys):
    """What bootstrap's default (--scheduler auto) asks each node before choosing Slurm."""
    monkeypatch.setattr(slurm_daemons, "SBIN", (str(tmp_path),))
    monkeypatch.setattr(slurm_existing, "SITE_CONFS", ())
    monkeypatch.setattr(slurm_existing, "PROC", str(tmp_path / "proc"))
    (tmp_path / "proc").mkdir()
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    for name in slurm_daemons.NEEDED:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert scheduler.main(["check"]) == 0 and capsys.readouterr().out == "ok\n"
    assert scheduler.main(["check", "--head"]) == 2  # the controller is not there
    assert capsys.readouterr().err == (
        "error: slurmctld is not installed on this node: install slurm-wlm (Debian/Ubuntu: apt-get install "
        "slurm-wlm munge)\n"
    )
    (tmp_path / "site.conf").write_text("ClusterName=theirs\n")  # a host that runs a Slurm of its own
    monkeypatch.setattr(slurm_existing, "SITE_CONFS", ("/nonexistent/slurm.conf", str(tmp_path / "site.conf")))
    assert scheduler.main(["check"]) == 2
    assert f"already runs Slurm ({tmp_path / 'site.conf'}): add slurm: existing" in capsys.readouterr().err
    monkeypatch.setattr(slurm_existing, "SITE_CONFS", ())
    (tmp_path / "munged").unlink()
    assert scheduler.main(["check"]) == 2 and "munged is not installed" in capsys.readouterr().err


def test_check_finds_a_site_slurm_where_slurm_itself_looks(tmp_path, monkeypatch, capsys):
    """Not only at /etc/slurm: SLURM_CONF, a running daemon's -f, what scontrol reads; never a conf of ours."""
    monkeypatch.setattr(slurm_daemons, "SBIN", (str(tmp_path),))
    monkeypatch.setattr(slurm_existing, "SITE_CONFS", ())
    monkeypatch.setattr(slurm_existing, "PROC", str(tmp_path / "proc"))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    for name in (*slurm_daemons.NEEDED, "scontrol"):
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / name).chmod(0o755)
    site, ours = tmp_path / "site" / "slurm.conf", tmp_path / "ours.conf"
    site.parent.mkdir()
    site.write_text("ClusterName=theirs\n")
    ours.write_text(slurm_existing.OURS + " (node/scheduler.py)\nClusterName=gc\n")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    (tmp_path / "proc" / "4243").mkdir(parents=True)
    (tmp_path / "proc" / "4243" / "cmdline").write_bytes(b"/usr/sbin/slurmd\0-D\0-f\0" + bytes(ours) + b"\0")
    assert scheduler.main(["check"]) == 0  # another stack's slurmd of ours is no site Slurm
    capsys.readouterr()
    monkeypatch.setenv("SLURM_CONF", str(site))
    assert scheduler.main(["check"]) == 2 and f"already runs Slurm ({site})" in capsys.readouterr().err
    monkeypatch.delenv("SLURM_CONF")
    (tmp_path / "proc" / "4242" / "cmdline").write_bytes(b"/opt/slurm/sbin/slurmctld\0-f\0" + bytes(site) + b"\0")
    assert scheduler.main(["check"]) == 2 and f"already runs Slurm ({site})" in capsys.readouterr().err
    (tmp_path / "proc" / "4242" / "cmdline").unlink()
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\necho 'SLURM_CONF              = {site}'\n")
    assert scheduler.main(["check"]) == 2 and f"already runs Slurm ({site})" in capsys.readouterr().err


def fake_sinfo(folder, listing: str, monkeypatch) -> None:
    """An `sinfo` that prints `listing` (NodeName|NodeHostname|NodeAddr|state lines) whatever it is asked."""
    monkeypatch.setattr(slurm_daemons, "SBIN", (str(folder),))
    monkeypatch.setenv("PATH", str(folder))
    (folder / "sinfo").write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")  # a builtin: PATH has no cat
    (folder / "sinfo").chmod(0o755)


def test_a_host_finds_its_node_in_an_existing_slurm_by_name_address_or_host_name(tmp_path, monkeypatch):
    host = slurm_existing.socket.gethostname()
    fake_sinfo(tmp_path, f"gpu1|gpu1|10.0.0.5|idle\ngpu2|{host}|10.0.0.6|mixed\ngpu3|gpu3|10.0.0.7|idle\n", monkeypatch)
    assert slurm_existing.identify("gpu", "", "gpu3", []) == {"name": "gpu3", "state": "idle"}  # the hosts file's
    assert slurm_existing.identify("gpu", "", "", ["192.0.2.1", "10.0.0.5"])["name"] == "gpu1"  # its address
    assert slurm_existing.identify("gpu", "", "", ["192.0.2.1"])["name"] == "gpu2"  # its host name
    with pytest.raises(slurm_conf.UsageError, match="slurm_name 'gpu9' is not in partition gpu .*gpu1, gpu2, gpu3"):
        slurm_existing.identify("gpu", "", "gpu9", [])
    with pytest.raises(slurm_conf.UsageError, match="slurm_conf /nowhere is not a file"):
        slurm_existing.identify("gpu", "/nowhere", "", [])


def test_a_host_matching_no_node_or_two_is_told_to_name_its_node(tmp_path, monkeypatch):
    fake_sinfo(tmp_path, "a|h|10.0.0.5|idle\nb|h|10.0.0.5|idle\n", monkeypatch)
    with pytest.raises(slurm_conf.UsageError, match="a, b all match it: one must be in the existing Slurm"):
        slurm_existing.identify("", "", "", ["10.0.0.5"])
    with pytest.raises(slurm_conf.UsageError, match="no node at its address or host name is in .*slurm_name:"):
        slurm_existing.identify("", "", "", ["10.0.0.9"])
    fake_sinfo(tmp_path, "", monkeypatch)
    with pytest.raises(slurm_conf.UsageError, match="partition nope has no nodes"):
        slurm_existing.identify("nope", "", "", [])


def adopted_home(tmp_path, monkeypatch, squeue: str) -> Path:
    """A home whose runs go to an existing Slurm (tag gpu-cluster:hosts:abc), with fake `squeue` (this
    shell text) and `scancel` (it notes its arguments in `cancelled`)."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    for name, text in (("squeue", squeue), ("scancel", f'echo "$@" > {tmp_path}/cancelled')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr(slurm_daemons, "SBIN", (str(bin_dir),))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HOME", str(home))
    adopted = {"partition": "gpu", "conf": "", "tag": "gpu-cluster:hosts:abc", "names": {"node-0": "gpu1"}}
    slurm_existing.adopt(slurm_conf.Paths(str(home)), adopted)
    return home


def test_stop_on_an_existing_slurm_cancels_exactly_this_stacks_jobs(tmp_path, monkeypatch, capsys):
    listing = "11|gpu-cluster:hosts:abc\n12|gpu-cluster:hosts:zzz\n13|gpu-cluster:hosts:abc extra\n14|\n"
    home = adopted_home(tmp_path, monkeypatch, f"printf '{listing}'")
    assert scheduler.main(["stop"]) == 0
    assert capsys.readouterr().out == "cancelled 11\n"  # another stack of the same name has another tag
    assert (tmp_path / "cancelled").read_text() == "11\n"
    assert not (home / ".gpu-cluster" / "slurm" / "existing.json").exists()


def test_stop_on_an_existing_slurm_that_does_not_answer_fails_and_keeps_the_record(tmp_path, monkeypatch, capsys):
    home = adopted_home(
        tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1"
    )
    assert scheduler.main(["stop"]) == 1
    assert "squeue failed: slurm_load_jobs error: Unable to contact slurm controller" in capsys.readouterr().err
    assert (home / ".gpu-cluster" / "slurm" / "existing.json").exists()  # down keeps the stack: ask again
    assert not (tmp_path / "cancelled").exists()


def test_loopback_and_other_nodes_do_not_mix():
    with pytest.raises(slurm_conf.UsageError, match="loopback"):
        slurm_conf.parse_cluster(description("127.0.0.10", "10.0.0.6"))


def test_sockets_move_to_a_short_folder_where_the_home_is_deep():
    assert slurm_conf.Paths("/home/u").sockets == "/home/u/.gpu-cluster/slurm"
    deep = slurm_conf.Paths("/x" * 40).sockets

    assert deep.startswith("/tmp/gpu-cluster-") and len(deep) + slurm_conf.SOCKET_NAME_ROOM <= 107


def test_the_step_prefixes_the_shells_lines_and_leaves_the_ranks_own_prefixes_alone():
    from node.slurm_step import Prefixer

    prefix = Prefixer(b"[node-1] ", own=b"[node-1")
    stream = b"mkdir: oops\n[node-1 rank 3] step 1\r[node-1 rank 3] step 2\n__gpu_cluster_exit__ 0 1.5\n[node-1] done\n"
    for cut in (1, 3, 7, len(stream)):  # however the bytes arrive
        prefix = Prefixer(b"[node-1] ", own=b"[node-1")
        out = b"".join(prefix(stream[i : i + cut]) for i in range(0, len(stream), cut))
        assert out == (
            b"[node-1] mkdir: oops\n[node-1 rank 3] step 1\r[node-1 rank 3] step 2\n"
            b"[node-1] __gpu_cluster_exit__ 0 1.5\n[node-1] done\n"
        ), cut


# ------------------------------------------------------------------------ a job's state, as Slurm says it

PENDING_JOB = (
    "JobId=2 JobName=20261125-001712-run-3592 UserId=root(0) JobState=PENDING Reason=Resources Dependency=(null) "
    "Requeue=1 Restarts=0 ExitCode=0:0 SubmitTime=2026-11-25T00:17:12 EligibleTime=2026-11-25T00:17:12 "
    "StartTime=2027-11-25T00:16:51 EndTime=2027-11-25T00:16:51 Deadline=N/A"
)
RUNNING_JOB = (
    "JobId=1 JobName=20261125-001650-run-c3b5 JobState=RUNNING Reason=None Requeue=1 Restarts=1 ExitCode=0:0 "
    "SubmitTime=2026-11-25T00:16:50 StartTime=2026-11-25T00:16:51 EndTime=2027-11-25T00:16:51"
)
COMPLETION = (
    "JobId=1 UserId=root(0) GroupId=root(0) Name=20261125-001650-run-c3b5 JobState=FAILED Partition=cluster "
    "TimeLimit=UNLIMITED StartTime=2026-11-25T00:16:51 EndTime=2026-11-25T00:17:21 NodeList=node-[0-1] "
    "NodeCnt=2 ProcCnt=4 WorkDir=/r ReservationName= Tres=cpu=4 Account= QOS= WcKey= Cluster=gc "
    "SubmitTime=2026-11-25T00:16:50 EligibleTime=2026-11-25T00:16:50 DerivedExitCode=0:0 ExitCode=3:0"
)


def test_a_waiting_job_has_no_start_and_a_running_one_no_end_or_exit_code():
    waiting = slurm_run.job_fields(PENDING_JOB)
    assert waiting["state"] == "PENDING" and waiting["submitted_at"] is not None
    assert (waiting["started_at"], waiting["ended_at"], waiting["exit_code"]) == (None, None, None)
    running = slurm_run.job_fields(RUNNING_JOB)
    assert running["started_at"] is not None and (running["ended_at"], running["exit_code"]) == (None, None)
    assert running["requeues"] == 1


@pytest.mark.parametrize(
    "reason, words",
    [
        ("Resources", "its nodes, busy with another job"),
        ("ReqNodeNotAvail,_UnavailableNodes:beta", "node(s) beta to be available (down, drained or reserved in Slurm)"),
        ("Priority", "jobs ahead of it in the queue"),
        ("QOSMaxJobsPerUserLimit", "Slurm: QOSMaxJobsPerUserLimit"),
    ],
)
def test_a_waiting_run_says_in_words_what_slurm_says_it_waits_for(monkeypatch, reason, words):
    """Under an adopted Slurm none of the nodes is out of service by our reasons: Slurm's own reason tells."""
    monkeypatch.setattr(
        slurm_run, "job_state", lambda job, log="": slurm_run.job_fields(PENDING_JOB.replace("Resources", reason))
    )
    monkeypatch.setattr(
        slurm_run.slurm_nodes, "node_reasons", lambda paths: {"alpha": ("idle", ""), "beta": ("down", "theirs")}
    )
    monkeypatch.setattr(slurm_run.slurm_existing, "existing", lambda paths: {"partition": "gpu"})  # the site's
    shown = slurm_run.shown_state("2")
    assert (shown["state"], shown["waiting_for"]) == ("PENDING", words)


def test_a_run_queued_behind_another_on_our_slurm_waits_for_busy_nodes_not_down_ones(monkeypatch):
    """Slurm gives a job that names its nodes "required nodes are DOWN, DRAINED or reserved" while another
    job holds them; with every node of ours in service, that is a busy cluster, and is said so."""
    reason = "Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved_for_jobs_in_higher_priority_partitions"
    monkeypatch.setattr(
        slurm_run, "job_state", lambda job, log="": slurm_run.job_fields(PENDING_JOB.replace("Resources", reason))
    )
    monkeypatch.setattr(
        slurm_run.slurm_nodes, "node_reasons", lambda paths: {"node-0": ("allocated", ""), "node-1": ("allocated", "")}
    )
    monkeypatch.setattr(slurm_run.slurm_existing, "existing", lambda paths: None)  # ours
    assert slurm_run.shown_state("2")["waiting_for"] == "its nodes, busy with another job"


def test_an_ended_job_has_its_times_and_exit_code_from_the_completion_log():
    ended = slurm_run.job_fields(COMPLETION)
    assert ended["state"] == "FAILED" and ended["exit_code"] == 3 and ended["signal"] == 0
    assert ended["ended_at"] - ended["started_at"] == 30


@pytest.mark.parametrize("code, state", [(0, "COMPLETED"), (143, "CANCELLED"), (137, "CANCELLED"), (3, "FAILED")])
def test_a_forgotten_job_ends_as_its_batch_job_recorded(tmp_path, code, state):
    """An existing Slurm without accounting forgets an ended job: the run's own end record tells."""
    log = tmp_path / "output.log"
    assert slurm_run.ended_state(str(log)) is None  # none yet: still unknown, never guessed
    (tmp_path / "ended.json").write_text(json.dumps({"exit_code": code, "at": 1795000000.5, "restarts": 1}))
    ended = slurm_run.ended_state(str(log))
    assert (ended["state"], ended["exit_code"], ended["ended_at"], ended["requeues"]) == (state, code, 1795000000.5, 1)
    assert ended["state"] in slurm_run.FINAL_STATES


def test_a_job_ended_by_a_signal_has_the_shells_code_for_it():
    cancelled = slurm_run.job_fields(
        COMPLETION.replace("JobState=FAILED", "JobState=CANCELLED").replace("=3:0", "=0:15")
    )
    assert cancelled["state"] == "CANCELLED" and (cancelled["exit_code"], cancelled["signal"]) == (143, 15)


def test_a_nodes_output_goes_into_the_run_log_in_whole_lines_when_it_comes_in_pieces():
    """srun gathers every node's output into one log: an unbuffered print (its text, then its newline)
    must not let another node's line in between; a bar redrawn with \\r goes out at each \\r."""
    pieces = [(b"rank 1 step 0", 0.05), (b"\n", 0.05), (b"10%\r", 0.05), (b"20%", 2.5), (b"\n", 0)]
    writes = _copied(pieces, hold_s=1.0)
    # The bar's last state, held past hold_s, went out as a redraw; its line end redrew it whole.
    assert b"".join(writes) == b"[node-1] rank 1 step 0\n[node-1] 10%\r[node-1] 20%\r[node-1] 20%\n"
    assert any(w.endswith(b"[node-1] rank 1 step 0\n") for w in writes)  # its two pieces in one write
    assert all(w.endswith((b"\n", b"\r")) for w in writes), writes  # no write leaves a line open


def _copied(pieces: list[tuple[bytes, float]], hold_s: float = 0.2) -> list[bytes]:
    """What copy_whole_lines writes of a node's output that comes as `pieces` (bytes, then a pause)."""
    read_fd, write_fd = os.pipe()
    writes: list[bytes] = []

    class Out:
        def write(self, data: bytes) -> None:
            writes.append(data)

        def flush(self) -> None:
            pass

    def node() -> None:
        for piece, pause in pieces:
            os.write(write_fd, piece)
            time.sleep(pause)
        os.close(write_fd)

    writer = threading.Thread(target=node)
    writer.start()
    slurm_step.copy_whole_lines(read_fd, slurm_step.Prefixer(b"[node-1] ", own=b"[node-1"), Out(), hold_s=hold_s)
    writer.join()
    os.close(read_fd)
    return writes


def test_a_slow_bar_goes_into_the_run_log_as_whole_redraws_that_no_other_node_can_join():
    """tqdm starts each redraw with \\r and writes nothing more until the next: each state, held past
    hold_s, goes out ended by \\r, and the next redraw's own \\r is not doubled."""
    bar = [(b"[node-1 rank 3] start\n", 0.01)] + [(b"\r[node-1 rank 3] %d%%" % n, 0.35) for n in (10, 20)]
    writes = _copied([*bar, (b"\n", 0)])

    assert b"".join(writes) == (
        b"[node-1 rank 3] start\n[node-1 rank 3] 10%\r[node-1 rank 3] 20%\r[node-1 rank 3] 20%\n"
    )
    assert all(w.endswith((b"\n", b"\r")) for w in writes), writes


def test_a_line_finished_late_goes_out_again_whole_with_its_prefix():
    writes = _copied([(b"loading...", 0.35), (b" done\nnext\n", 0)])

    assert b"".join(writes) == b"[node-1] loading...\r[node-1] loading... done\n[node-1] next\n"
    assert all(w.endswith((b"\n", b"\r")) for w in writes), writes


def test_the_last_words_without_a_line_end_still_end_a_line():
    assert b"".join(_copied([(b"Killed", 0)])) == b"[node-1] Killed\n"


def test_a_waiting_run_says_what_it_waits_for_and_a_requeue_says_what_happens_next():
    from node.slurm_nodes import out_of_service

    assert [out_of_service(s) for s in ("idle", "allocated", "down*", "idle*", "drained", "mixed")] == [
        False,
        False,
        True,
        True,
        True,
        False,
    ]
    waiting = slurm_run.waiting_line({"state": "PENDING", "waiting_for": "node-1: Not responding"})
    assert waiting == "[cluster] the run is pending: waits for node-1: Not responding"
    requeued = slurm_run.waiting_line(
        {
            "state": "PREEMPTED",
            "requeues": 2,
            "waiting_for": "node-1: node lost: gone",
            "preempted": {"nodes": ["node-1"], "reason": "node lost: gone", "restart": 2},
        }
    )
    assert requeued.startswith("[cluster] the run was requeued (restart 2): node-1: node lost: gone; it starts again")


def test_a_fault_tolerant_runs_step_and_job_outlive_a_failed_node_and_a_plain_runs_do_not():
    """One node's death must not end the other replica groups: the job and its step are --no-kill,
    and a task that fails ends no other (--kill-on-bad-exit=0)."""
    nodes = [{"name": "node-0", "home": "/h", "command": "true"}, {"name": "node-1", "home": "/h", "command": "true"}]
    plain = RunSpec.from_dict({"run_id": "r", "log": "/l/run.log", "python": "py", "nodes": nodes})
    replicated = plain.replace(replicas=2)
    assert slurm_batch.step_options(plain) == ("--kill-on-bad-exit=1",)
    assert slurm_batch.step_options(replicated) == ("--kill-on-bad-exit=0", "--no-kill")
    assert "--no-kill" not in slurm_run.sbatch_argv(plain, "sbatch", "s")
    assert "--no-kill" in slurm_run.sbatch_argv(replicated, "sbatch", "s")
    assert "--requeue" in slurm_run.sbatch_argv(replicated, "sbatch", "s")  # every group lost: the checkpoint


def test_a_replica_groups_nodes_are_back_in_service_once_slurm_shows_them_idle_and_only_then():
    """The run's job holds its nodes exclusively: a node of it seen idle has left the --no-kill allocation
    (lost) and is back in service (its replacement joined)."""
    nodes = [{"name": f"node-{i}", "home": "/h", "command": "true"} for i in range(4)]
    spec = RunSpec.from_dict({"run_id": "r", "log": "/l/run.log", "python": "py", "nodes": nodes, "replicas": 2})
    groups = slurm_restarts.replica_groups(spec)
    assert [[n.name for n in g] for g in groups] == [["node-0", "node-1"], ["node-2", "node-3"]]
    busy = {f"node-{i}": ("allocated", "") for i in range(4)}
    back = {**busy, "node-2": ("idle", ""), "node-3": ("idle", "")}
    assert slurm_restarts.back_in_service(groups, busy) == set()
    assert slurm_restarts.back_in_service(groups, back) == {"node-2", "node-3"}
    half = {**back, "node-3": ("down", "node lost: its server is gone")}  # one of the group's nodes is not back
    assert slurm_restarts.back_in_service(groups, half) == {"node-2"}
    drained = {**back, "node-3": ("idle", "spot interruption notice: terminate at 10:00")}
    assert slurm_restarts.back_in_service(groups, drained) == {"node-2"}


def test_a_running_fault_tolerant_runs_participants_are_its_newest_contract_lines(tmp_path):
    log = tmp_path / "output.log"
    metrics = tmp_path / contract.METRICS_FILE
    assert replicas.participants(str(log)) is None  # no step yet
    lines = [
        {"kind": "ft_step", "step": 7, "time": 100.0, "replica": 1, "participants": 2, "params_sha": "a"},
        {"kind": "step", "step": 8, "time": 102.0, "loss": 0.1},  # not the contract's
        {"kind": "ft_step", "step": 8, "time": 101.5, "replica": 0, "participants": 1, "params_sha": "b"},
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"cut')
    assert replicas.participants(str(log)) == 1
    assert replicas.first_step_after(str(metrics), 1, 99.0) == 100.0
    assert replicas.first_step_after(str(metrics), 1, 100.5) is None


def test_a_fault_tolerant_run_completed_where_a_groups_every_node_last_exited_0(tmp_path):
    """The batch job's end (and so Slurm's state, and no requeue) follows the one rule, from each node's
    last exit marker in the run's log: a group started again on a replaced node writes one after its first."""
    log = tmp_path / "output.log"
    nodes = [{"name": f"node-{i}", "home": "/h", "command": "true"} for i in range(2)]
    spec = RunSpec.from_dict({"run_id": "r", "log": str(log), "python": "py", "nodes": nodes, "replicas": 2})
    assert not slurm_restarts.survived(spec)  # no log
    log.write_text(f"[node-0] step 1\n[node-1] {contract.EXIT_MARKER} 137 1.0\n[node-0] {contract.EXIT_MARKER} 1 2.0\n")
    assert not slurm_restarts.survived(spec)
    with log.open("a") as f:
        f.write(f"[node-1] {contract.EXIT_MARKER} 0 3.0\n")  # its group, started again, trained to the end
    assert slurm_restarts.survived(spec)


def test_a_daemon_killed_on_the_head_node_fails_a_client_at_once_and_one_stopped_or_never_ours_does_not(
    tmp_path, monkeypatch
):
    """A pid file left by a daemon that is gone (killed: `stop` removes the file) answers a client at once,
    where Slurm's would wait MessageTimeout; no pid file (stopped, a worker's slurmctld, an existing Slurm) asks."""
    paths = slurm_conf.Paths(str(tmp_path))
    os.makedirs(os.path.dirname(paths.pid("munged")), exist_ok=True)
    assert slurm_daemons.gone(paths) == []
    ended = subprocess.Popen(["true"])
    ended.wait()
    slurm_daemons.write_private(paths.pid("slurmctld"), f"{ended.pid}\n".encode(), 0o600)
    assert slurm_daemons.gone(paths) == ["slurmctld"]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(slurm_existing, "client", lambda *args: pytest.fail("Slurm's client was run"))
    with pytest.raises(slurm_conf.DaemonError, match="controller cannot answer scontrol: slurmctld on the head node"):
        slurm_run.job_state("12")


def _followed(monkeypatch, tmp_path, capfdbinary, answers: list) -> bytes:
    """`slurm_run.follow` of a run whose batch job wrote its end record (exit 0, in its first start),
    with Slurm answering `answers` in turn (the last one again and again); what it wrote."""
    log = tmp_path / "output.log"
    log.write_bytes(b"[node-0] trained\n")
    (tmp_path / contract.END_RECORD).write_text(json.dumps({"exit_code": 0, "at": 100.0, "restarts": 0}))
    asked = iter(answers)
    last: list = []

    def job_state(job, log=""):
        last[:] = [next(asked, last[0] if last else None)]
        return last[0]

    monkeypatch.setattr(slurm_run, "job_state", job_state)
    monkeypatch.setattr(slurm_run, "shown_state", lambda job, log="", found=None: found)
    assert slurm_run.follow(str(log), "7") == 0
    return capfdbinary.readouterr().out


def test_a_follow_ends_at_the_end_record_while_slurm_still_shows_the_job_running(monkeypatch, tmp_path, capfdbinary):
    out = _followed(monkeypatch, tmp_path, capfdbinary, [{"state": "RUNNING", "requeues": 0}])
    assert out.endswith(f"{contract.RUN_END_MARKER} COMPLETED 0 17\n".encode())


def test_a_follow_goes_on_past_the_record_of_a_start_slurm_requeued(monkeypatch, tmp_path, capfdbinary):
    """A node failed: Slurm requeued the job, and the batch job still wrote its end record on the way out.
    The run starts again, so the follow goes on until Slurm says the job's end."""
    requeued = {"state": "PENDING", "requeues": 1, "reason": "BeginTime"}
    ended = {"state": "FAILED", "requeues": 1, "exit_code": 1}
    out = _followed(monkeypatch, tmp_path, capfdbinary, [requeued, requeued, ended])
    assert out.endswith(f"{contract.RUN_END_MARKER} FAILED 1 17\n".encode())


def test_a_straggler_step_that_outlives_the_grace_after_its_ranks_were_told_is_ended_by_the_watch(
    tmp_path, monkeypatch, capsys
):
    # --on-straggler replace told the straggler's ranks to save and exit; a script that ignores SIGUSR1 under
    # --max-restarts is started again in place by torchrun, and the step would never end (nor the node go).
    import signal

    from node import slurm_watch, straggler

    spec = RunSpec.from_dict(
        {
            "run_id": "r1",
            "log": str(tmp_path / contract.RUN_LOG),
            "python": "py",
            "nodes": [{"name": "node-0", "home": str(tmp_path), "command": "true"}],
            "watch": {"status": {"node-0": "true"}, "timeout_s": 20, "poll_s": 0.1, "on_straggler": "replace"},
        }
    )
    assert spec.watch is not None
    monkeypatch.setattr(slurm_watch, "ask_nodes", lambda *args, **kwargs: [])  # the polls find every rank stepping
    replacing = slurm_watch.StragglerReplacement(spec, spec.watch, "srun")
    monkeypatch.setattr(slurm_watch, "StragglerReplacement", lambda spec, options, srun: replacing)
    replacing.told_at = time.monotonic()
    assert not replacing.overdue()  # told just now: the ranks are saving
    replacing.told_at = time.monotonic() - slurm_watch.STRAGGLER_EXIT_GRACE_S
    main = subprocess.Popen(["sleep", "30"])
    try:
        code = slurm_watch.watch(spec, spec.watch, main, "srun")
    finally:
        main.kill()
    assert code == 128 + signal.SIGTERM and replacing.overdue() is None  # ended once
    replacing.told_at -= slurm_watch.STRAGGLER_KILL_AFTER_S  # a step that outlives SIGTERM too
    assert replacing.overdue() == signal.SIGKILL and replacing.overdue() is None
    capsys.readouterr()
    replacing.take_out([straggler.Straggler(1, "node-0", 2.0, 1, 20)])
    assert replacing.taken_out == [] and "[watch]" not in capsys.readouterr().out  # not even looked at


def test_a_slurm_held_runs_watch_that_fails_says_so_once_in_the_log_and_the_run_ends_as_its_own(
    tmp_path, monkeypatch, capsys
):
    # The batch job's watch once raised out of `supervise`, and Slurm ended a healthy run's step (exit 143).
    from node import slurm_watch

    spec = RunSpec.from_dict(
        {
            "run_id": "r1",
            "log": str(tmp_path / contract.RUN_LOG),
            "python": "py",
            "nodes": [{"name": "node-0", "home": str(tmp_path), "command": "true"}],
            "watch": {"status": {"node-0": "true"}, "timeout_s": 20, "poll_s": 0.05},
        }
    )
    assert spec.watch is not None
    monkeypatch.setattr(slurm_watch, "ask_nodes", lambda *args, **kwargs: [{"ranks": [{"rank": "x"}]}])
    main = subprocess.Popen(["sleep", "0.5"])
    assert slurm_watch.watch(spec, spec.watch, main, "srun") == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[watch]")]
    assert len(said) == 1 and said[0].startswith("[watch] hang watch: ValueError"), said


@pytest.mark.parametrize(
    "before, requeued_for",
    [
        ("spot interruption notice: terminate at 2026-11-28T08:00:00Z", "spot interruption notice: terminate at"),
        ("", "node lost: no answer"),
    ],
)
def test_a_run_on_a_node_told_lost_after_its_notice_drained_it_is_requeued_for_the_notice(
    monkeypatch, tmp_path, before, requeued_for
):
    """A drill's short notice: the watcher drained node-1 while its run saved; then the supervisor finds the
    machine gone and tells Slurm. The run's requeue record stays the notice's (its log and `fab jobs` said
    "node lost" for a drill); the node itself is DOWN as lost, with why (what a waiting run waits for)."""
    from node import slurm_nodes

    told: list = []
    monkeypatch.setattr(slurm_nodes, "node_reasons", lambda paths: {"node-1": ("drained", before)})
    monkeypatch.setattr(slurm_nodes, "_runs_on", lambda paths, node: [(str(tmp_path), 1)])
    monkeypatch.setattr(
        slurm_nodes, "scontrol", lambda paths, *args: told.append(args) or subprocess.CompletedProcess(args, 0)
    )
    assert slurm_nodes.mark_lost(None, "node-1", "no answer") == "down"
    assert told == [("update", "NodeName=node-1", "State=DOWN", "Reason=node lost: no answer")]
    record = json.loads((tmp_path / contract.PREEMPTED_RECORD).read_text())
    assert record["reason"].startswith(requeued_for) and record["restart"] == 2
