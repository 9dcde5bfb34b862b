"""The command builders and parsers of remote/, directly (and the stop command run for real in bash)."""

import copy
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from infra.inventory import ClusterInfo
from node import contract, probe, standalone
from node.outcome import first_failure
from remote import job_command, node_paths, protocol, results
from remote.bootstrap_stage import REPO, SYNCED, digest, local_manifest
from remote.launch import JobStream
from remote.stream import NodeStream, RankOutcome, say
from tests.support.inventories import cluster


def test_node_environment_names_the_head_and_the_routed_interface():
    c = cluster()
    env0 = job_command.node_environment(c, 0, "ens5", "/venv/bin/python")
    env1 = job_command.node_environment(c, 1, "ens5", "/venv/bin/python", master_port=29555)
    assert (env0["NODE_RANK"], env1["NODE_RANK"]) == ("0", "1")
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "10.0.1.10"
    assert env1["MASTER_PORT"] == "29555" and env1["NNODES"] == "2" and env1["NPROC_PER_NODE"] == "1"
    assert env1["NCCL_SOCKET_IFNAME"] == env1["GLOO_SOCKET_IFNAME"] == "ens5"
    assert env1["CLUSTER_HOURLY_USD"] == "1.504" and env1["CLUSTER_SHARED_DIR"] == "/shared"
    assert "OMP_NUM_THREADS" not in env1
    threads = ClusterInfo(**{**cluster().__dict__, "env": {"OMP_NUM_THREADS": "1"}})
    assert job_command.node_environment(threads, 0, "lo", "py")["OMP_NUM_THREADS"] == "1"


def test_env_file_is_sourceable_and_quotes_what_needs_quoting(tmp_path):
    env = {"A": "plain", "B": "with space", "C": "$(rm -rf /)", "D": "$HOME/code"}
    path = tmp_path / "env"
    path.write_text(job_command.env_file_text(env))
    out = subprocess.run(
        ["bash", "-c", f'. {path} && printf \'%s|\' "$A" "$B" "$C" "$D"'],
        capture_output=True,
        text=True,
        env={"HOME": "/home/u", "PATH": os.environ["PATH"]},
    )
    assert out.stdout == "plain|with space|$(rm -rf /)|/home/u/code|"


def test_torchrun_uses_c10d_on_the_head_with_a_fresh_id_and_node_addresses():
    c = cluster(gpus=(4, 4))
    argv = job_command.torchrun_argv(c, c.nodes[1], "run-1", 2, 29500)
    # torchrun, with the job's stores bound to one address, started by its path: a project's own
    # remote/ package in the job's working directory cannot hide it
    assert argv[0] == "$CLUSTER_CODE_DIR/node/torchrun.py" and "-m" not in argv
    assert "--rdzv-conf=is_host=0" in argv and "--rdzv-conf=is_host=1" in job_command.torchrun_argv(
        c, c.nodes[0], "r", 0, 1
    )
    assert "--nnodes=2" in argv and "--nproc-per-node=4" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=10.0.1.10:29500" in argv
    assert "--rdzv-id=run-1" in argv and "--local-addr=10.0.1.11" in argv and "--max-restarts=2" in argv


def test_replica_groups_are_torchrun_jobs_of_their_own_with_the_lighthouse_on_the_head_node():
    c = cluster(gpus=(0, 0, 0, 0))
    assert [[n.name for n in g] for g in job_command.replica_groups(c.nodes, 2)] == [
        ["node-0", "node-1"],
        ["node-2", "node-3"],
    ]
    argv = job_command.torchrun_argv(c, c.nodes[3], "run-1", 1, 29500, replicas=2)
    assert "--nnodes=2" in argv and "--rdzv-endpoint=10.0.1.12:29500" in argv  # the group's first node
    assert "--rdzv-conf=is_host=0" in argv and "--rdzv-id=run-1-replica-1" in argv
    assert "--rdzv-conf=is_host=1" in job_command.torchrun_argv(c, c.nodes[2], "run-1", 1, 29500, replicas=2)
    variables = job_command.job_variables(c, c.nodes[3], "run-1", replicas=2, master_port=29500)
    assert (variables["MASTER_ADDR"], variables["NODE_RANK"], variables["NNODES"]) == ("10.0.1.12", "1", "2")
    assert variables[contract.LIGHTHOUSE_VARIABLE] == "http://10.0.1.10:29561"  # the head node's private address
    assert (variables[contract.REPLICA_VARIABLE], variables[contract.REPLICAS_VARIABLE]) == ("1", "2")
    assert contract.LIGHTHOUSE_BIND_VARIABLE not in variables
    head = job_command.job_variables(c, c.nodes[0], "run-1", replicas=2, master_port=29500)
    assert head[contract.LIGHTHOUSE_BIND_VARIABLE] == "10.0.1.10:29561"  # never [::] or 0.0.0.0
    plain = job_command.job_variables(c, c.nodes[3], "run-1")
    assert "MASTER_ADDR" not in plain and contract.LIGHTHOUSE_VARIABLE not in plain


@pytest.mark.parametrize(
    ("nodes", "replicas", "said"),
    [
        (2, 1, "--replicas must be at least 2"),
        (2, 3, "more than the cluster's 2 node(s)"),
        (4, 3, "does not split the cluster's 4 nodes"),
    ],
)
def test_replicas_that_do_not_fit_the_nodes_are_refused(nodes, replicas, said):
    assert said in job_command.replicas_problem(nodes, replicas)
    assert job_command.replicas_problem(4, 2) is None and job_command.replicas_problem(2, 0) is None


def test_a_fault_tolerant_run_completes_while_one_replica_group_trained_to_the_end():
    groups = job_command.group_names(["node-0", "node-1", "node-2", "node-3"], 2)
    assert groups == [["node-0", "node-1"], ["node-2", "node-3"]]
    one_dropped = {"node-0": 0, "node-1": 0, "node-2": 1, "node-3": 143}
    assert job_command.surviving_group(groups, one_dropped)
    assert job_command.dropped_nodes(groups, one_dropped) == ["node-2", "node-3"]
    both_hit = {"node-0": 0, "node-1": 1, "node-2": 1, "node-3": 0}
    assert not job_command.surviving_group(groups, both_hit) and job_command.dropped_nodes(groups, both_hit) == []


def test_a_replica_group_starts_again_where_every_node_of_it_is_back_for_either_holder():
    """contract.groups_to_restart, the rule both holders apply (the fab holder's `back`: lost nodes that
    answer bootstrapped with no job; Slurm's: nodes it shows idle)."""
    groups = job_command.group_names(["node-0", "node-1", "node-2", "node-3"], 2)
    assert contract.groups_to_restart(groups, {"node-2", "node-3"}, set(), {}) == [1]
    assert contract.groups_to_restart(groups, {"node-2"}, set(), {}) == []  # node-3 not back yet
    assert contract.groups_to_restart(groups, {"node-0", "node-1"}, set(), {}) == []  # group 0: the Lighthouse
    assert contract.groups_to_restart(groups, {"node-2", "node-3"}, {1}, {}) == []  # its new start runs
    assert contract.groups_to_restart(groups, {"node-2", "node-3"}, set(), {1: [255]}) == [1]  # lost again
    assert contract.groups_to_restart(groups, {"node-2", "node-3"}, set(), {1: [0]}) == []  # trained to the end
    failed = {1: [1] * contract.MAX_GROUP_STARTS}
    assert contract.groups_to_restart(groups, {"node-2", "node-3"}, set(), failed) == []  # a fault of its own


def test_launch_command_quotes_arguments_and_records_the_job():
    c = cluster()
    command = job_command.launch_command(
        c, c.nodes[0], "r1", "run", "$CLUSTER_CODE_DIR/examples/x.py", ["--msg", "a b; rm -rf /"], 0, 29500
    )
    assert f'"$CLUSTER_CODE_DIR"/examples/x.py --msg {shlex.quote("a b; rm -rf /")} 2>&1;' in command
    assert 'cd "$HOME"/.gpu-cluster/runs/r1/workdir' in command  # each node's own folder, not the shared one
    assert command.startswith(f". {node_paths.ENV_FILE} && ")
    assert "export CLUSTER_RUN_ID=r1 CLUSTER_RUN_DIR=/shared/runs/r1" in command
    assert f"> {node_paths.JOB_FILE}" in command


def test_launch_command_passes_the_exit_code_and_reports_when_the_node_saw_it(tmp_path):
    home, shared = tmp_path / "home", tmp_path / "shared"
    (home / ".gpu-cluster").mkdir(parents=True)
    fake_python = tmp_path / "python"  # stands in for torchrun: shows its arguments, fails with 3
    fake_python.write_text('#!/bin/bash\necho "args: $*"\nexit 3\n')
    fake_python.chmod(0o755)
    (home / ".gpu-cluster" / "env").write_text(f"export CLUSTER_PYTHON={fake_python}\nexport CLUSTER_CODE_DIR=/code\n")
    c = cluster(shared=str(shared))
    command = job_command.launch_command(c, c.nodes[1], "r1", "run", "x.py", ["--a", "b c"], 0, 29500)
    before = time.time()
    result = subprocess.run(
        ["bash", "-c", command],
        env={"HOME": str(home), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 3, result.stdout + result.stderr
    assert lines[0].startswith("args: /code/node/torchrun.py ") and lines[0].endswith("x.py --a b c")
    code, seen_at = job_command.parse_exit_marker(lines[-1])
    assert code == 3 and before <= seen_at <= time.time()
    assert (shared / "runs" / "r1").is_dir()


def test_a_workdir_job_runs_in_its_own_copy_with_its_variables_taken_literally(tmp_path):
    """The launch command run for real in bash, a fake interpreter reporting what the job would see."""
    home = tmp_path / "home"
    cache = home / ".gpu-cluster" / "workdirs" / "proj-1" / "files"
    (cache / "pkg").mkdir(parents=True)
    (cache / "pkg" / "config.json").write_text("cached")
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/bash\n"
        'echo "cwd=$PWD"; echo "path=$PYTHONPATH"; echo "results=$CLUSTER_RESULTS_DIR"\n'
        "printf 'value=%s|\\n' \"$GREETING\"; echo changed > pkg/config.json\n"
    )
    fake_python.chmod(0o755)
    (home / ".gpu-cluster" / "env").write_text(f"export CLUSTER_PYTHON={fake_python}\nexport CLUSTER_CODE_DIR=/code\n")
    c = cluster(shared=str(tmp_path / "shared"))
    value = "a b; $HOME \"q\" 's' $(touch /tmp/never) `x`\nline two"
    values = job_command.EnvValues(f"{home}/.gpu-cluster/runs/r1/{contract.RUN_ENV_VALUES}", once=True)
    (home / ".gpu-cluster" / "runs" / "r1").mkdir(parents=True)
    Path(values.path).write_text(job_command.env_values_text({"GREETING": value}))
    command = job_command.launch_command(
        c,
        c.nodes[0],
        "r1",
        "run",
        "$HOME/.gpu-cluster/runs/r1/workdir/t.py",
        [],
        0,
        29500,
        workdir_key="proj-1",
        env={"GREETING": value},
        values=values,
    )
    assert "a b;" not in command and "line two" not in command  # values are read from the file only
    result = subprocess.run(
        ["bash", "-c", command],
        env={"HOME": str(home), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = home / ".gpu-cluster" / "runs" / "r1"
    assert f"cwd={job_dir / 'workdir'}" in result.stdout
    assert f"path={job_dir / 'workdir'}:/code" in result.stdout
    assert f"results={job_dir / 'results'}" in result.stdout and (job_dir / "results").is_dir()
    assert f"value={value}|" in result.stdout
    assert (job_dir / "workdir" / "pkg" / "config.json").read_text() == "changed\n"
    assert (cache / "pkg" / "config.json").read_text() == "cached"  # a copy, not links into the cache
    assert not Path(values.path).exists()  # a fab-held run's values: gone once read


@pytest.mark.parametrize("once", [True, False])
def test_env_values_travel_in_a_file_never_on_the_command_line(tmp_path, once):
    """A value of --env under the 65,536-byte limit: the command stays small (Slurm's spec and sh -c carry
    it), the rank sees the value whole, and a Slurm-held run's file stays for its requeues."""
    home = tmp_path / "home"
    (home / ".gpu-cluster").mkdir(parents=True)
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/bash\nprintf "%s" "$BIG" > "$HOME/seen"\n')
    fake_python.chmod(0o755)
    (home / ".gpu-cluster" / "env").write_text(f"export CLUSTER_PYTHON={fake_python}\nexport CLUSTER_CODE_DIR=/code\n")
    big = ("secret-" + "x" * 990 + " $HOME '\"\n") * 60
    values = job_command.EnvValues(f"$HOME/.gpu-cluster/{contract.RUN_ENV_VALUES}", once=once)
    (home / ".gpu-cluster" / contract.RUN_ENV_VALUES).write_text(job_command.env_values_text({"BIG": big}))
    c = cluster(shared=str(tmp_path / "shared"))
    command = job_command.launch_command(
        c, c.nodes[0], "r1", "run", "x.py", [], 0, 29500, env={"BIG": big}, values=values
    )
    assert "secret-" not in command and len(command) < 4_000
    result = subprocess.run(["bash", "-c", command], env={"HOME": str(home), "PATH": os.environ["PATH"]}, cwd=tmp_path)
    assert result.returncode == 0 and (home / "seen").read_text() == big
    assert (home / ".gpu-cluster" / contract.RUN_ENV_VALUES).exists() is not once
    with pytest.raises(ValueError):  # --env without a file for it: never inline
        job_command.launch_command(c, c.nodes[0], "r1", "run", "x.py", [], 0, 29500, env={"BIG": big})


def test_a_queued_job_makes_its_missing_copy_and_environment_from_the_stage_and_keeps_what_it_has(tmp_path):
    """A replaced node's home lacks the run's workdir copy and requirements environment: the job's own command
    (the same for a first start and a requeue) makes them from the run's stage on the shared folder."""
    home, shared = tmp_path / "home", tmp_path / "shared"
    stage = shared / "runs" / "r1" / contract.RUN_STAGE
    (stage / contract.STAGE_FILES).mkdir(parents=True)
    (stage / contract.STAGE_FILES / "train.py").write_text("submitted")
    (stage / contract.STAGE_REQUIREMENTS).write_text("gc-tinypkg==0.1\n")
    (home / ".gpu-cluster").mkdir(parents=True)
    calls = tmp_path / "calls"
    fake_python = tmp_path / "python"  # job_env.py's exit from $ENV_EXIT; as torchrun, shows the job's copy
    fake_python.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\ncase "$1" in */job_env.py) exit "${{ENV_EXIT:-0}}";; esac\ncat train.py\n'
    )
    fake_python.chmod(0o755)
    (home / ".gpu-cluster" / "env").write_text(f"export CLUSTER_PYTHON={fake_python}\nexport CLUSTER_CODE_DIR=/code\n")
    c = cluster(shared=str(shared))
    staged = job_command.Stage(node_paths.run_stage(c, "r1") or "", files=True, env_dir=contract.job_env("abc"))
    command = job_command.launch_command(
        c, c.nodes[1], "r1", "run", "$HOME/.gpu-cluster/runs/r1/workdir/train.py", [], 0, 29500, stage=staged
    )

    def start(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command],
            env={"HOME": str(home), "PATH": os.environ["PATH"], **env},
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )

    node_run = home / ".gpu-cluster" / "runs" / "r1"
    (node_run / contract.RUN_WORKDIR_PARTIAL).mkdir(parents=True)  # a copy cut short by an earlier start
    (node_run / contract.RUN_WORKDIR_PARTIAL / "junk").write_text("")
    first = start()
    assert first.returncode == 0 and "submitted" in first.stdout, first.stdout + first.stderr
    assert sorted(p.name for p in (node_run / contract.RUN_WORKDIR).iterdir()) == ["train.py"]
    assert not (node_run / contract.RUN_WORKDIR_PARTIAL).exists()
    env_dir = home / contract.job_env("abc")
    made = f"/code/node/job_env.py --job {env_dir} {stage / contract.STAGE_REQUIREMENTS} {env_dir}.log "
    assert calls.read_text().splitlines()[0] == made + str(stage / contract.STAGE_FILES)

    (node_run / contract.RUN_WORKDIR / "train.py").write_text("written by the job")
    again = start()  # a requeue on a node that kept its copy: the copy stays as the job left it
    assert again.returncode == 0 and "written by the job" in again.stdout, again.stdout + again.stderr
    calls.write_text("")
    failed = start(ENV_EXIT="1")  # no environment: torchrun never starts, the exit marker says why
    assert job_command.parse_exit_marker(failed.stdout.splitlines()[-1]) is not None and failed.returncode == 1
    assert len(calls.read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "line,parsed",
    [
        (f"{job_command.EXIT_MARKER} 1 1700000000.250000", (1, 1700000000.25)),
        (f"{job_command.EXIT_MARKER} 0 1700000000,5", (0, 1700000000.5)),  # a locale with a decimal comma
        (f"{job_command.EXIT_MARKER} 1 1700000000.N", (1, None)),  # date(1) without %N
        ("step 10 loss 2.3", None),
        (f"say {job_command.EXIT_MARKER} 1 2", None),
    ],
)
def test_exit_marker_parsing(line, parsed):
    assert job_command.parse_exit_marker(line) == parsed


def test_folders_fall_back_to_each_home_without_shared_storage():
    assert node_paths.code_dir(cluster(shared="")) == "$HOME/.gpu-cluster/code"
    assert node_paths.remote_run_dir(cluster(shared="/shared/"), "r") == "/shared/runs/r"
    assert node_paths.shell_path("$HOME/a b") == "\"$HOME\"/'a b'"


@pytest.mark.parametrize(
    "output,interface",
    [
        ("10.0.1.10 dev ens5 src 10.0.1.11 uid 1000\n    cache", "ens5"),
        ("local 127.0.0.10 dev lo src 127.0.0.1 uid 0", "lo"),
        ("RTNETLINK answers: Network is unreachable", None),
    ],
)
def test_route_interface_is_read_from_ip_route_get(output, interface):
    assert probe.parse_route_interface(output) == interface


def test_job_status_parsing():
    assert protocol.parse_job_status("running 123 r-1 run-ddp\nbootstrapped\n") == (
        {"pid": 123, "run_id": "r-1", "task": "run-ddp"},
        True,
    )
    assert protocol.parse_job_status("idle\n") == (None, False)


def test_run_ids_sort_by_time_and_name_the_task():
    early = job_command.new_run_id("hello", datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    late = job_command.new_run_id("hello", datetime(2026, 1, 2, 3, 4, 6, tzinfo=timezone.utc))
    assert early.startswith("20260102-030405-hello-") and early < late


def test_stop_command_ends_every_job_of_the_node_and_nothing_else(tmp_path):
    home, other_home = tmp_path / "home", tmp_path / "other"
    (home / ".gpu-cluster").mkdir(parents=True)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    # A job as launch_command makes one: a group leader recording itself, a child in its group, and a
    # "worker" in a session of its own that only the run id in its environment ties to the job.
    job = subprocess.Popen(
        [
            "bash",
            "-c",
            f'echo "$$ run-x task" > {node_paths.JOB_FILE}; CLUSTER_RUN_ID=run-x setsid sleep 301 & sleep 302 & wait',
        ],
        env=env,
        start_new_session=True,
    )
    # A second job started beside it, which JOB_FILE does not record, and another node's job (same
    # machine, another HOME), which this node's stop must leave alone.
    beside = subprocess.Popen(["sleep", "303"], env={**env, "CLUSTER_RUN_ID": "run-y"}, start_new_session=True)
    elsewhere = subprocess.Popen(
        ["sleep", "304"], env={**env, "HOME": str(other_home), "CLUSTER_RUN_ID": "run-z"}, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 10
        while not (home / ".gpu-cluster" / "job").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = subprocess.run(
            ["bash", "-c", protocol.stop_command(grace_s=2)], env=env, capture_output=True, text=True
        )
        assert result.stdout.split()[0] == "stopped", result.stdout + result.stderr
        assert sorted(result.stdout.split()[1:]) == ["run-x", "run-y"]
        job.wait(timeout=5)
        beside.wait(timeout=5)
        leftovers = subprocess.run(["pgrep", "-f", "sleep 30[123]"], capture_output=True, text=True).stdout.split()
        assert leftovers == []
        assert elsewhere.poll() is None
        again = subprocess.run(["bash", "-c", protocol.stop_command()], env=env, capture_output=True, text=True)
        assert again.stdout.strip() == "idle"
    finally:
        for proc in (job, beside, elsewhere):
            proc.kill()


def shown(capsysbinary, until: bytes, wait_s: float = 5.0) -> bytes:
    """What fab's output shows, read until it ends with `until` (or `wait_s` passed)."""
    out, deadline = b"", time.monotonic() + wait_s
    while not out.endswith(until) and time.monotonic() < deadline:
        time.sleep(0.02)
        out += capsysbinary.readouterr().out
    return out


def test_node_stream_copies_bytes_as_they_come_and_keeps_the_log(tmp_path, capsysbinary):
    """The nodes prefix their own lines: fab copies what arrives, a line redrawn with `\\r` at once, an
    unfinished line after a moment (a prompt, `loading...`), and starts a line of its own on a fresh line."""
    stream = NodeStream("node-1", 1, tmp_path / "node-1.log")
    stream.feed(b"[node-1] first li")
    assert shown(capsysbinary, b"[node-1] first li") == b"[node-1] first li"  # shown before its line ends
    stream.feed(b"ne\n[node-1] \r[node-1] 10%")
    stream.feed(b"\r[node-1] 20%")
    assert capsysbinary.readouterr().out == b"ne\n[node-1] \r[node-1] 10%\r[node-1] 20%"
    stream.write("fab: connection lost\n")
    stream.close()
    assert capsysbinary.readouterr().out == b"\n[node-1] fab: connection lost\n"
    log = (tmp_path / "node-1.log").read_bytes()
    assert log == b"[node-1] first line\n[node-1] \r[node-1] 10%\r[node-1] 20%\n[node-1] fab: connection lost\n"
    assert stream.tail[-1] == "[node-1] fab: connection lost"


def test_two_nodes_lines_arriving_in_pieces_stay_whole_and_never_run_into_each_other(capsysbinary):
    zero, one = NodeStream("node-0", 0, None), NodeStream("node-1", 1, None)
    zero.feed(b"[node-0 rank 1] imported: tiny")  # SSH delivered half a line
    one.feed(b"[node-1] ready\n")
    zero.feed(b" package\n[node-0 rank 1] loading")
    say("fab: a line of its own")
    shown_first = shown(capsysbinary, b"loading")  # a line left unfinished is shown after a moment...
    one.feed(b"[node-1] steady\n")  # ...and another node's line starts on a line of its own
    zero.feed(b" done\n")
    zero.close(), one.close()
    assert (shown_first + capsysbinary.readouterr().out).splitlines() == [
        b"[node-1] ready",
        b"[node-0 rank 1] imported: tiny package",
        b"fab: a line of its own",
        b"[node-0 rank 1] loading",
        b"[node-1] steady",
        b"[node-0 rank 1]  done",
    ]


def test_the_code_manifest_is_what_git_has_in_the_synced_folders_with_their_hashes():
    """The manifest against an independent account: git's list of files in the synced folders (tracked
    or new, never ignored ones such as __pycache__), and each file's sha256 read here."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SYNCED],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    expected = {path for path in listed.stdout.splitlines() if (REPO / path).is_file()}
    manifest = local_manifest()
    assert set(manifest) == expected
    assert "node/job_lock.py" in manifest and "examples/ddp_training.py" in manifest
    assert not any(path.startswith(("infra/", "tests/", "remote/tasks")) for path in manifest)
    for path, sha in manifest.items():
        assert sha == hashlib.sha256((REPO / path).read_bytes()).hexdigest(), path
    changed = {**manifest, "harness/dist.py": "0" * 64}
    assert digest(changed) != digest(manifest) == digest(dict(reversed(list(manifest.items()))))


def test_a_dropped_connection_is_retried_but_a_missing_file_is_not(tmp_path):
    from remote.connect import NodeSession

    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    c = cluster()
    session = NodeSession(ClusterInfo(**{**c.__dict__, "known_hosts": str(known_hosts)}), c.nodes[0])
    calls = []

    def drops_once(_):
        calls.append("drop")
        if len(calls) == 1:
            raise ConnectionResetError("connection reset")
        return "ok"

    assert session.retrying(drops_once, delays_s=(0,)) == "ok" and len(calls) == 2

    def missing_file(_):
        calls.append("missing")
        raise FileNotFoundError("no such file: requirements-node.txt")

    with pytest.raises(FileNotFoundError):
        session.retrying(missing_file, delays_s=(0, 0, 0))
    assert calls.count("missing") == 1


def test_code_hashes_come_from_coreutils_and_name_paths_under_the_synced_folders(tmp_path):
    (tmp_path / "harness" / "__pycache__").mkdir(parents=True)
    (tmp_path / "harness" / "dist.py").write_text("x = 1\n")
    (tmp_path / "harness" / "__pycache__" / "dist.pyc").write_bytes(b"cache")
    (tmp_path / "mine.txt").write_text("the user's own file\n")
    out = subprocess.run(
        ["bash", "-c", protocol.hash_files_command(str(tmp_path), ("harness", "node"))], capture_output=True, text=True
    )
    assert out.returncode == 0
    assert protocol.parse_hashes(out.stdout) == {"harness/dist.py": hashlib.sha256(b"x = 1\n").hexdigest()}
    missing = subprocess.run(
        ["bash", "-c", protocol.hash_files_command(str(tmp_path / "none"), ("harness",))],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 0 and protocol.parse_hashes(missing.stdout) == {}


def test_a_command_killed_by_a_signal_is_an_exit_status_not_a_lost_connection():
    import paramiko

    import remote.connect  # noqa: F401  (installs the handler)

    class Channel:
        exit_status = -1
        status_event = threading.Event()

    message = paramiko.Message()
    message.add_string("exit-signal")
    message.add_boolean(False)
    message.add_string("KILL")
    message.add_boolean(False)
    message.add_string("")
    message.add_string("")
    message.rewind()
    channel = Channel()
    paramiko.Transport._channel_handler_table[paramiko.common.MSG_CHANNEL_REQUEST](channel, message)
    assert channel.exit_status == 137 and channel.status_event.is_set()


def ranks_said(codes: dict, exited_at: dict | None = None) -> RankOutcome:
    return RankOutcome.parse(json.dumps({"exit_codes": codes, "exited_at": exited_at or {}}))


def first_of(codes: dict, ranks: dict, exited_at: dict, order: list | None = None):
    """node/outcome.py's rule fed as remote/runs.py feeds it, from each node's ranks line."""
    rank_codes = {node: said.exit_codes for node, said in ranks.items()}
    return first_failure(codes, rank_codes, {node: said.exited_at for node, said in ranks.items()}, exited_at, order)


def test_the_first_failure_is_the_rank_that_exited_first_by_its_nodes_clock_whatever_the_order_of_nodes():
    # Rank 1 exits 3; rank 0 fails 2 s later (its peer is gone) and node-0's job ends first anyway.
    codes = {"node-0": 1, "node-1": 1}
    ranks = {"node-0": ranks_said({"0": 1}, {"0": 102.0}), "node-1": ranks_said({"1": 3}, {"1": 100.0})}
    first = first_of(codes, ranks, {"node-0": 102.1, "node-1": 103.0}, ["node-0", "node-1"])
    assert (first.node, first.exit_code, first.evidence) == ("node-1", 3, "rank 1 exited first by its clock")
    # A node stopped because another failed (its ranks killed by SIGTERM later) is not the first.
    ranks = {"node-0": ranks_said({"0": 3}, {"0": 50.0}), "node-1": ranks_said({"1": -15}, {"1": 51.0})}
    assert first_of({"node-0": 1, "node-1": 1}, ranks, {}, ["node-1", "node-0"]).node == "node-0"


def test_without_rank_times_the_nodes_own_clocks_then_their_codes_decide():
    codes = {"node-0": 1, "node-1": 1, "node-2": 143}
    # node-1's call returned first, but node-0's own clock saw its job end 0.4 s earlier.
    first = first_of(codes, {}, {"node-0": 100.1, "node-1": 100.5, "node-2": None}, ["node-1", "node-2", "node-0"])
    assert (first.node, first.evidence) == ("node-0", "its job ended first by its clock")
    # No times at all: a node whose ranks failed by themselves before one that was stopped.
    first = first_of({"node-0": 143, "node-1": 1}, {"node-1": ranks_said({"1": 4})}, {}, ["node-0", "node-1"])
    assert (first.node, first.exit_code) == ("node-1", 4) and "no exit times" in first.evidence
    assert first_of({"node-0": 0, "node-1": 0}, {}, {"node-0": 1.0, "node-1": 2.0}) is None


def test_a_ranks_line_keeps_only_finite_exit_times_of_failed_ranks():
    said = ranks_said({"1": 3}, {"1": 100.5, "0": 99.0})
    assert said.exited_at == {"1": 100.5}
    assert RankOutcome.parse('{"exit_codes": {"1": 3}, "exited_at": {"1": NaN}}').exited_at == {}
    assert RankOutcome.parse('{"exit_codes": {"1": 3}, "exited_at": ["x"]}') == RankOutcome({"1": 3})


@pytest.mark.parametrize("cut", [1, 5, 12, 20, 40])
def test_the_markers_are_kept_out_of_the_stream_and_the_log_wherever_a_read_ends(tmp_path, capsysbinary, cut):
    stream = JobStream("node-0", 0, tmp_path / "node-0.log")
    sent = (
        b"[node-0] last words\n"
        + f'{contract.RANKS_MARKER} {{"exit_codes": {{"1": 3}}, "process_group": null}}\n'.encode()
        + f"{job_command.EXIT_MARKER} 1 1700000000.5\n".encode()
    )
    for start in range(0, len(sent), cut):
        stream.feed(sent[start : start + cut])
    stream.close()
    assert stream.exit == (1, 1700000000.5)
    assert stream.ranks == RankOutcome({"1": 3}, None) and stream.ranks.describe() == "rank 1 exited 3"
    assert capsysbinary.readouterr().out == b"[node-0] last words\n"
    assert (tmp_path / "node-0.log").read_bytes() == b"[node-0] last words\n"


def test_a_line_that_only_starts_like_a_marker_is_shown_whole(capsysbinary):
    stream = JobStream("node-0", 0, None)
    stream.feed(b"__gpu")
    stream.feed(b"_cluster is a fine name\n__init__\n")
    stream.close()
    assert capsysbinary.readouterr().out == b"__gpu_cluster is a fine name\n__init__\n"


@pytest.mark.parametrize(
    "line,codes,described,group",
    [
        (
            '{"exit_codes": {"1": 3, "2": -9}, "process_group": null}',
            {"1": 3, "2": -9},
            "rank 1 exited 3, rank 2 was killed by SIGKILL",
            None,
        ),
        ('{"exit_codes": {}, "process_group": false}', {}, "", False),
        ("not json", {}, "", None),
        (None, {}, "", None),
    ],
)
def test_the_ranks_line_names_each_failed_ranks_own_code(line, codes, described, group):
    outcome = RankOutcome.parse(line)
    assert (outcome.exit_codes, outcome.describe(), outcome.process_group) == (codes, described, group)


@pytest.mark.parametrize(
    "reply,parsed",
    [
        ("locked", ("locked", None)),
        (
            "waiting 20260101-000000-hello-ab12 hello laptop:4242 1700000000",
            (
                "waiting",
                {
                    "run_id": "20260101-000000-hello-ab12",
                    "task": "hello",
                    "owner": "laptop:4242",
                    "since": "1700000000",
                },
            ),
        ),
        ("", ("failed", None)),
        ("python3: can't open file 'job_lock.py'", ("failed", None)),
    ],
)
def test_lock_replies(reply, parsed):
    assert protocol.parse_lock_reply(reply) == parsed


def test_the_job_lock_is_taken_once_and_launches_wait_their_turn_in_arrival_order(tmp_path):
    """Holders of node/job_lock.py for real: a second and a third wait (naming the holder) instead of
    being refused, take the lock in the order they came once the one before releases it (its input
    closes: fab ended), a waiter that gives up (its input closes) leaves the line, and a holder that
    dies without a word releases the lock too."""
    lock = tmp_path / "job.lock"
    holder = [sys.executable, str(node_paths.NODE_CODE / "job_lock.py"), str(lock)]

    def take(run_id: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*holder, run_id, "hello", f"laptop:{run_id}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    taken = []
    try:
        taken.append(take("run-a"))
        assert taken[0].stdout.readline().strip() == "locked"
        for run_id in ("run-b", "gives-up", "run-c"):
            taken.append(take(run_id))
            state, held = protocol.parse_lock_reply(taken[-1].stdout.readline().strip())
            assert state == "waiting" and (held["run_id"], held["owner"]) == ("run-a", "laptop:run-a")
        first, second, quitter, third = taken
        quitter.stdin.close()  # Ctrl-C of a waiting fab
        assert quitter.wait(timeout=30) == 3
        first.stdin.close()
        assert first.wait(timeout=30) == 0
        assert second.stdout.readline().strip() == "locked"  # b came before c
        assert third.poll() is None
        second.kill()  # dies holding it: released all the same
        assert third.stdout.readline().strip() == "locked"
        third.stdin.close()
        assert third.wait(timeout=30) == 0
        assert list((tmp_path / "job.lock.queue").iterdir()) == []  # nobody is left in line
    finally:
        for process in taken:
            process.kill()
            process.wait()


def test_node_files_sent_as_source_carry_their_siblings(tmp_path):
    """cleanup.py (stdin) and stop_jobs.py (`-c`) run where no `node` package can be imported."""
    for name in ("cleanup", "stop_jobs"):
        assert "\nfrom node import" not in standalone.source(name)
    result = subprocess.run(
        [sys.executable, "-", str(tmp_path / "state")],
        input=standalone.source("cleanup"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"job": "idle", "daemons": [], "removed": []}


def test_procfs_tells_running_stopped_and_gone_processes_and_finds_them_by_environment():
    from node import procfs

    child = subprocess.Popen(["sleep", "30"], env={"PATH": os.environ["PATH"], "CLUSTER_RUN_ID": "run-procfs"})
    try:
        assert procfs.alive(child.pid) and procfs.process_state(child.pid) == "running"
        deadline = time.monotonic() + 5  # a loaded machine may show the new program's environ a moment late
        while procfs.pids_with_environment("CLUSTER_RUN_ID=run-procfs") != [child.pid] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.pids_with_environment("CLUSTER_RUN_ID=run-procfs") == [child.pid]
        assert procfs.environment(child.pid)["CLUSTER_RUN_ID"] == "run-procfs"
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while procfs.process_state(child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.process_state(child.pid) == "stopped"
        child.kill()
        deadline = time.monotonic() + 5
        while procfs.state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not procfs.alive(child.pid) and procfs.process_state(child.pid) == "gone"  # a zombie is gone
        assert procfs.pids_with_environment("CLUSTER_RUN_ID=run-procfs") == []
    finally:
        child.kill()
        child.wait()


def test_a_fetch_the_disk_cut_short_says_so_and_never_that_there_was_nothing(monkeypatch, tmp_path):
    said: list[str] = []
    monkeypatch.setattr(results, "say", said.append)
    failed = results.Fetched([], 0, [], failed=("results/big.bin", "No space left on device"))
    results.report_fetched(failed, tmp_path, "node-0", 50_000_000)
    assert len(said) == 1 and said[0].startswith("fab: could not fetch results/big.bin from node-0: No space"), said
    said.clear()
    results.report_fetched(results.Fetched([], 0, []), tmp_path, "node-0", 50_000_000)
    assert said == ["fab: nothing to fetch: node-0's $CLUSTER_RESULTS_DIR is empty and the run wrote no metrics.jsonl"]


def test_ranks_write_their_step_times_on_the_shared_folder_only_where_there_is_one_and_the_watch_is_on():
    from remote.hangwatch import HangPolicy, job_environment

    variables = job_environment(cluster(shared="/mnt/our share"), "run-1", HangPolicy())
    said = subprocess.run(
        ["bash", "-c", f'X={variables[contract.STEP_TIMES_VARIABLE]}; echo "$X"'],
        capture_output=True,
        text=True,
    )  # a shell word: a folder with a space stays one path
    assert said.stdout.strip() == f"/mnt/our share/runs/run-1/{contract.STEP_TIMES}"
    assert contract.STEP_TIMES_VARIABLE not in job_environment(cluster(shared=""), "run-1", HangPolicy())
    assert job_environment(cluster(), "run-1", HangPolicy(timeout_s=0)) == {}  # no watch, no monitor


def test_next_hints_carry_fab_r_where_fab_started_there_would_not_find_this_fabfile(tmp_path, monkeypatch, capsys):
    from infra import hints, report
    from tests.support import REPO

    root = shlex.quote(str(REPO))
    assert hints.fab("bootstrap", cwd=REPO) == hints.fab("bootstrap", cwd=REPO / "infra") == "fab bootstrap"
    assert hints.fab("logs -f --run r1", cwd=tmp_path) == f"fab -r {root} logs -f --run r1"
    (tmp_path / "fabfile.py").write_text("")  # the user's own project, with a fabfile of its own
    assert hints.fab("hello", cwd=tmp_path / ".") == f"fab -r {root} hello"
    monkeypatch.chdir(tmp_path)  # as `python ~/gpu-cluster/deploy.py up` from the user's project
    report.up_summary(cluster(), False, 1.0, tmp_path / "inventory.json")
    assert f"next: fab -r {root} bootstrap" in capsys.readouterr().out


def test_every_fab_flag_has_a_name_fab_help_can_show():
    """invoke gave `--on-straggler` the dash as its short flag: `fab --help run-ddp` listed `--=STRING`."""
    from remote.tasks import ns

    flags = {}
    for name in ns.task_names:
        task = copy.copy(ns[name])  # invoke's get_arguments pops the task's help: leave the real task whole
        task.help = dict(task.help)
        for argument in task.get_arguments():
            assert all(len(flag) > 1 or flag.isalnum() for flag in argument.names), (name, argument.names)
            flags[(name, argument.name)] = argument.names
    assert flags[("run-ddp", "on_straggler")] == ("on-straggler",)
    assert flags[("run-ddp", "skip_preflight")] == ("skip-preflight", "s")  # the short flags users have keep


def test_a_slurm_held_runs_log_gives_the_batch_job_the_same_first_failure_as_the_operators_record():
    from node import contract
    from node.outcome import from_log

    log = (
        "[node-0] step 1\n"
        f'[node-1] {contract.RANKS_MARKER} {{"exit_codes": {{"1": 3}}, "exited_at": {{"1": 100.0}}}}\n'
        f"[node-1] {contract.EXIT_MARKER} 1 100,5\n"
        "srun: error: node-1: task 1: Exited with exit code 1\n"
        f'[node-0] {contract.RANKS_MARKER} {{"exit_codes": {{"0": -15}}, "exited_at": {{"0": 101.0}}}}\n'
        f"[node-0] {contract.EXIT_MARKER} 1 99.0\n"
    )
    first = from_log(log, ["node-0", "node-1"])
    assert (first.node, first.exit_code) == ("node-1", 3)
    assert from_log("[node-0] no markers at all\n") is None
    assert from_log(f"[node-0] {contract.EXIT_MARKER} 143 x\n").exit_code == 143  # no time: stopped first


def test_the_batch_jobs_code_for_a_rank_a_signal_ended_is_as_a_shell_says_it(tmp_path):
    from node import contract, slurm_exit

    log = tmp_path / "output.log"
    log.write_text(
        f'[node-1] {contract.RANKS_MARKER} {{"exit_codes": {{"1": -9}}, "exited_at": {{"1": 5.0}}}}\n'
        f"[node-1] {contract.EXIT_MARKER} 1 6.0\n"
    )
    assert slurm_exit.run_code(str(log), 0, 1, ["node-0", "node-1"]) == 128 + 9
    log.write_text(
        f'[node-1] {contract.RANKS_MARKER} {{"exit_codes": {{"1": 1e999}}}}\n[node-1] {contract.EXIT_MARKER} 1 x\n'
    )
    assert slurm_exit.run_code(str(log), 0, 1) == 1  # an overflowing code is bad data, not a crash


def _lock_holder(lock: Path, run_id: str, home: Path, first_line: str) -> subprocess.Popen:
    """node/job_lock.py for real, as a launch's channel runs it (CLUSTER_RUN_ID, the node's HOME); its first
    line read (`locked`, or `waiting` behind another)."""
    holder = subprocess.Popen(
        [sys.executable, str(node_paths.NODE_CODE / "job_lock.py"), str(lock), run_id, "run", f"laptop:{run_id}"],
        env={"HOME": str(home), "PATH": os.environ["PATH"], contract.RUN_ID_VARIABLE: run_id},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().split()[0] == first_line
    return holder


def test_stop_ends_launches_being_prepared_first_and_names_only_runs_it_stopped(tmp_path):
    """The job lock's holder and its waiters are launches being prepared: stop ends them before it looks for
    jobs, and names their runs, but not the run whose job had ended here (its launch was fetching results);
    a Slurm job's processes are left to scancel with --leave-slurm."""
    from node import job_lock

    home = tmp_path / "home"
    (home / ".gpu-cluster").mkdir(parents=True)
    lock = home / ".gpu-cluster" / "job.lock"
    done = subprocess.Popen(["true"])  # a job that ran here and ended: JOB_FILE still names it
    done.wait()
    (home / ".gpu-cluster" / "job").write_text(f"{done.pid} run-done run\n")
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    finishing = _lock_holder(lock, "run-done", home, "locked")
    waiting = _lock_holder(lock, "run-next", home, "waiting")
    slurms = subprocess.Popen(
        ["sleep", "305"],
        env={**env, contract.RUN_ID_VARIABLE: "run-slurm", "SLURM_JOB_ID": "7"},
        start_new_session=True,
    )
    try:
        assert job_lock.held_by(str(lock), "run-done") and not job_lock.held_by(str(lock), "run-next")
        result = subprocess.run(
            ["bash", "-c", protocol.stop_command(grace_s=2, leave_slurm=True)], env=env, capture_output=True, text=True
        )
        assert result.stdout.split() == ["stopped", "run-next"], result.stdout + result.stderr
        assert finishing.wait(timeout=5) != 0 and waiting.wait(timeout=5) != 0
        assert not job_lock.held_by(str(lock), "run-done")  # the lock went with its holder
        assert slurms.poll() is None  # Slurm's, for scancel
        again = subprocess.run(
            ["bash", "-c", protocol.stop_command(grace_s=2)], env=env, capture_output=True, text=True
        )
        assert again.stdout.split() == ["stopped", "run-slurm"]
    finally:
        for process in (finishing, waiting, slurms):
            process.kill()
            process.wait()


def test_a_fab_held_runs_head_node_starts_no_rank_once_its_launch_lost_the_job_lock(tmp_path, monkeypatch):
    """node/torchrun.py, first thing on the head node of a fab-held run (`launch_command(locked=True)` names
    the lock there only): it goes on while the launch holds the lock, and exits as stopped once it does not."""
    from node import torchrun

    c = cluster()
    head = job_command.launch_command(c, c.nodes[0], "run-a", "run", "x.py", [], 0, 29500, locked=True)
    other = job_command.launch_command(c, c.nodes[1], "run-a", "run", "x.py", [], 0, 29500, locked=True)
    assert f'{contract.JOB_LOCK_VARIABLE}="$HOME"/.gpu-cluster/job.lock' in head
    assert contract.JOB_LOCK_VARIABLE not in other
    assert contract.JOB_LOCK_VARIABLE not in job_command.launch_command(c, c.nodes[0], "run-a", "run", "x.py", [], 0, 1)
    lock = tmp_path / "job.lock"
    monkeypatch.setenv(contract.JOB_LOCK_VARIABLE, str(lock))
    holder = _lock_holder(lock, "run-a", tmp_path, "locked")
    try:
        torchrun.refuse_without_the_lock("node-0", "run-a")  # held: goes on
        with pytest.raises(SystemExit) as refused:
            torchrun.refuse_without_the_lock("node-0", "run-b")
        assert refused.value.code == 128 + signal.SIGTERM
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(SystemExit):  # its holder ended (fab stop): no rank starts
        torchrun.refuse_without_the_lock("node-0", "run-a")


def test_stop_knows_the_stacks_runs_in_slurms_queue_by_their_job_names():
    from node import slurm_cancel

    run_id = job_command.new_run_id("run-ddp")
    assert re.fullmatch(contract.RUN_ID_PATTERN, run_id)
    queue = "\n".join(
        [
            f"11|{run_id}|RUNNING|(null)",
            "12|20261128-081210-hello-4570|PENDING|(null)",
            "13|my-own-job|RUNNING|(null)",  # a user's own sbatch: not a run of ours
            "14|20261128-081211-run-aaaa|COMPLETING|(null)",  # past a cancel
            "garbage",
        ]
    )
    assert slurm_cancel.listed(queue) == [("11", run_id, "RUNNING"), ("12", "20261128-081210-hello-4570", "PENDING")]
    tagged = f"21|{run_id}|PENDING|stack-tag\n22|20261128-081210-hello-4570|PENDING|another-stack"
    assert slurm_cancel.listed(tagged, "stack-tag") == [("21", run_id, "PENDING")]


def test_a_runs_end_is_its_last_nodes_own_end_where_every_node_said_it():
    """Slurm's end can be when a restarted controller learned of it; the nodes' own clocks say when the run
    really ended: a node's exit marker, else its torchrun's ranks line (a node stopped whole says neither)."""
    from node.outcome import ended_at

    nodes = ["node-0", "node-1"]
    assert ended_at(nodes, {"node-0": 100.0, "node-1": 101.5}, {}) == 101.5
    assert ended_at(nodes, {"node-0": 100.0}, {"node-1": 102.0}) == 102.0  # the marker where there is one
    assert ended_at(nodes, {"node-0": 100.0}, {}) is None  # node-1 said nothing: Slurm's end stands
    assert ended_at(nodes, {"node-0": "nan", "node-1": 1.0}, {}) is None
