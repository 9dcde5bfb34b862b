"""End to end on real local clusters: SSH servers on loopback, reached the way users reach them."""

import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node import procfs
from tests.support import REPO, slurm
from tests.support.cli import assert_one_line_error, child_env, run_cli, run_fab
from tests.support.clusters import LocalCluster, fabric_connection, node_server_processes, run_processes
from tests.support.network import free_endpoint

FAKE_SECRET = "AKIA-fake-secret-for-the-scrub-test"


def openssh_argv(inventory: dict, node: dict, command: str, key: str | None = None) -> list[str]:
    return [
        "ssh", "-i", key or inventory["ssh_key"], "-p", str(node["ssh_port"]),
        "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        "-o", f"UserKnownHostsFile={inventory['known_hosts']}", "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes", f"{node['ssh_user']}@{node['public_ip']}", command,
    ]  # fmt: skip


def test_up_writes_the_inventory_head_first_and_pins_host_keys(local_cluster, state_dir):
    inv = local_cluster.inventory
    assert inv["provider"] == "local" and inv["hourly_usd"] == 0
    assert [n["name"] for n in inv["nodes"]] == ["node-0", "node-1"]
    first, second = (n["private_ip"] for n in inv["nodes"])
    assert int(second.rsplit(".", 1)[1]) == int(first.rsplit(".", 1)[1]) + 1
    assert stat.S_IMODE(os.stat(inv["ssh_key"]).st_mode) == 0o600
    known = open(inv["known_hosts"]).read().splitlines()
    assert [line.split()[0] for line in known] == [f"[{n['public_ip']}]:{n['ssh_port']}" for n in inv["nodes"]]
    assert (state_dir / "current").read_text().strip() == "local"
    timeline = inv["timeline"]  # how the up spent its time, phase by phase, summing to its wall time
    names = [phase["phase"] for phase in timeline["phases"]]
    assert names[0] == "startup" and names.index("keys") < names.index("node servers") < names.index("ssh ready")
    assert abs(timeline["total_s"] - timeline["wall_s"]) <= 0.05 * timeline["wall_s"], timeline
    for node in inv["nodes"]:  # bound to its own loopback address only: not 0.0.0.0, not another address
        same_port = [n["public_ip"] for n in inv["nodes"] if n["ssh_port"] == node["ssh_port"]]
        assert sorted(listening_addresses(node["ssh_port"])) == sorted(same_port)
        elsewhere = node["public_ip"].rsplit(".", 1)[0] + ".250"
        with socket.socket() as sock:
            assert sock.connect_ex((node["public_ip"], node["ssh_port"])) == 0
        with socket.socket() as sock:
            assert sock.connect_ex((elsewhere, node["ssh_port"])) != 0


def test_ssh_config_lets_stock_ssh_scp_and_rsync_reach_every_node(local_cluster, tmp_path):
    made = run_cli("ssh-config")
    assert made.returncode == 0, made.stderr
    config = tmp_path / "cluster.ssh"
    config.write_text(made.stdout)
    for node in local_cluster.inventory["nodes"]:  # by name, and by the stack-qualified alias
        for alias in (node["name"], f"local-{node['name']}"):
            answer = subprocess.run(["ssh", "-F", str(config), alias, "echo", "$PWD"], capture_output=True, text=True)
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout.strip().endswith(node["name"])  # the node's own home
    sent = tmp_path / "weights with spaces.bin"
    sent.write_bytes(os.urandom(2048))
    copied = subprocess.run(["scp", "-F", str(config), str(sent), "node-1:weights.bin"], capture_output=True, text=True)
    assert copied.returncode == 0, copied.stderr
    back = tmp_path / "back.bin"
    assert subprocess.run(["scp", "-F", str(config), "node-1:weights.bin", str(back)]).returncode == 0
    assert back.read_bytes() == sent.read_bytes()
    if shutil.which("rsync"):
        synced = tmp_path / "synced.bin"
        rsync = ["rsync", "-e", f"ssh -F {config}", "node-1:weights.bin", str(synced)]
        assert subprocess.run(rsync, capture_output=True).returncode == 0
        assert synced.read_bytes() == sent.read_bytes()
    text = config.read_text()  # the policy: the cluster's key only, the pinned hosts only
    assert "IdentitiesOnly yes" in text and "StrictHostKeyChecking yes" in text
    assert f"UserKnownHostsFile {local_cluster.inventory['known_hosts']}" in text


def listening_addresses(port: int) -> list[str]:
    """The IPv4 addresses with a socket listening on `port` (from /proc/net/tcp; 0.0.0.0 for any)."""
    found = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_fabric_runs_commands_moves_files_and_shares_a_folder(local_cluster, tmp_path):
    inv = local_cluster.inventory
    node0, node1 = (fabric_connection(inv, n) for n in inv["nodes"])
    result = node0.run("echo out; echo oops >&2; exit 7", warn=True, hide=True)
    assert (result.exited, result.stdout, result.stderr) == (7, "out\n", "oops\n")
    assert node1.run("pwd", hide=True).stdout.strip().endswith("nodes/node-1")

    source = tmp_path / "payload.bin"
    source.write_bytes(os.urandom(200_000))
    node0.put(str(source), "payload.bin")
    back = io.BytesIO()
    node0.get("payload.bin", back)
    assert back.getvalue() == source.read_bytes()

    node0.run('echo "written on node-0" > "$CLUSTER_SHARED_DIR/note.txt"', hide=True)
    assert node1.run('cat "$CLUSTER_SHARED_DIR/note.txt"', hide=True).stdout == "written on node-0\n"
    for conn in (node0, node1):
        conn.close()


def test_stock_openssh_client_logs_in_with_strict_host_key_checking(local_cluster):
    inv = local_cluster.inventory
    node1 = inv["nodes"][1]
    result = subprocess.run(
        openssh_argv(inv, node1, 'echo "$USER on $CLUSTER_NODE"; exit 3'), capture_output=True, text=True
    )
    assert result.returncode == 3 and result.stdout.strip() == f"{inv['ssh_user']} on node-1"

    via_cli = run_cli("ssh", "node-1", "--", "echo", "hi-from", "$CLUSTER_NODE")
    assert via_cli.returncode == 0 and via_cli.stdout.strip() == "hi-from node-1"
    # options before -- are deploy.py's (the stack is used, not sent); after it, the node's, untouched
    options = run_cli(
        "ssh", "node-1", "--stack", local_cluster.stack, "--", "echo", "--stack", "x", CLUSTER_STACK="other"
    )
    assert options.returncode == 0 and options.stdout.strip() == "--stack x", options.stderr


def test_another_key_and_a_changed_host_key_are_refused(local_cluster, tmp_path):
    inv = local_cluster.inventory
    node0 = inv["nodes"][0]
    other_key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    refused = subprocess.run(openssh_argv(inv, node0, "true", key=str(other_key)), capture_output=True, text=True)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr

    bad_known_hosts = tmp_path / "known_hosts"
    other_pub = (tmp_path / "other.pub").read_text().split()
    bad_known_hosts.write_text(f"[{node0['public_ip']}]:{node0['ssh_port']} {other_pub[0]} {other_pub[1]}\n")
    tampered = dict(inv, known_hosts=str(bad_known_hosts))
    mismatch = subprocess.run(openssh_argv(tampered, node0, "true"), capture_output=True, text=True)
    assert mismatch.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in mismatch.stderr


def test_up_on_a_running_cluster_changes_nothing_and_refuses_a_resize(local_cluster, state_dir):
    before = (state_dir / "local" / "inventory.json").read_text()
    pids = sorted(node_server_processes(state_dir))
    for same in (["--nodes", "2"], []):
        again = run_cli("up", "--local", *same)
        assert again.returncode == 0 and "already up" in again.stdout
    assert_one_line_error(
        run_cli("up", "--local", "--nodes", "3"),
        "--nodes 3 (it has 2)",
        "python deploy.py down --stack local, then python deploy.py up --local --nodes 3",
    )
    assert_one_line_error(run_cli("up", "--local", "--instance-type", "g5.xlarge"), "--instance-type g5.xlarge")
    assert (state_dir / "local" / "inventory.json").read_text() == before
    assert sorted(node_server_processes(state_dir)) == pids


def test_two_ups_of_one_stack_at_once_make_one_cluster_and_one_ledger_row(state_dir):
    address, port = free_endpoint(1)
    argv = [sys.executable, "deploy.py", "up", "--local", "--stack", "race", "--nodes", "1"]
    argv += ["--bind", address, "--ssh-port", str(port)]
    try:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        ups = [subprocess.Popen(argv, cwd=REPO, env=child_env(), **pipes) for _ in range(2)]
        outputs = [(up.wait(timeout=120), *up.communicate()) for up in ups]
        assert [code for code, _, _ in outputs] == [0, 0], outputs
        assert sum("already up" in out for _, out, _ in outputs) == 1, outputs  # the second waited, then found it
        clusters = json.loads(run_cli("cost", "--json").stdout)["clusters"]
        assert [c["stack"] for c in clusters] == ["race"]  # priced once
        assert len(node_server_processes(state_dir)) == 1
    finally:
        run_cli("down", "--stack", "race")


def test_a_dropped_session_takes_its_processes_with_it(local_cluster):
    inv = local_cluster.inventory
    marker = f"sleep {int(time.time()) % 1000 + 4000}"
    client = subprocess.Popen(openssh_argv(inv, inv["nodes"][0], f"{marker} & {marker}; echo never"))
    deadline = time.monotonic() + 10
    while not _processes_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_matching(marker)) == 2
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while _processes_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_matching(marker) == []


def test_status_reports_a_dead_node_and_down_still_cleans_up(state_dir, make_cluster):
    cluster = make_cluster()
    pid_file = state_dir / "local" / "nodes" / "node-1" / "sshd.pid"
    killed = subprocess.run(["sh", "-c", f"kill -KILL $(cat {pid_file})"], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr  # the pid alone, as daemons write it
    status = run_cli("status", "--json")
    assert status.returncode == 1
    nodes = {n["name"]: n for n in json.loads(status.stdout)["nodes"]}
    assert nodes["node-0"]["state"] == "up" and nodes["node-1"]["state"] == "down"
    assert nodes["node-1"]["error"]

    down = run_cli("down")
    assert down.returncode == 0, down.stderr
    assert node_server_processes(state_dir) == []
    assert not (state_dir / cluster.stack / "nodes").exists()


def test_down_leaves_no_process_no_port_and_keeps_run_logs(state_dir, make_cluster):
    cluster = make_cluster()
    run_dir = state_dir / "local" / "runs" / "some-run"
    run_dir.mkdir(parents=True)
    (run_dir / "node-0.log").write_text("kept\n")
    killed_writer = run_dir / f".summary.json.{dead_pid()}.tmp"
    killed_writer.write_text("{")
    daemon = fabric_connection(cluster.inventory, cluster.inventory["nodes"][0])
    daemon.run(  # a detached daemon that registers itself, like the watchdog does
        "setsid sleep 4321 >/dev/null 2>&1 < /dev/null & echo $! > .gpu-cluster/pids/sleeper.pid", hide=True
    )
    daemon.run(
        'head -c 3000 /dev/zero > "$CLUSTER_SHARED_DIR/checkpoint.pt"; echo hi > "$CLUSTER_SHARED_DIR/note"', hide=True
    )
    daemon.close()
    assert _processes_matching("sleep 4321")
    other = state_dir / "hosts"  # a second stack still up (its inventory is all `down` looks at)
    other.mkdir(mode=0o700)
    (other / "inventory.json").write_text(json.dumps({**cluster.inventory, "stack": "hosts", "provider": "ssh"}))

    down = run_cli("down", "--stack", "local")
    assert down.returncode == 0, down.stderr
    removing = down.stdout.index("removing")
    assert "shared: 2 files, 2.9 KiB" in down.stdout and removing < down.stdout.index("is down")
    assert "no port left listening" in down.stdout
    assert node_server_processes(state_dir) == []
    assert _processes_matching("sleep 4321") == []
    for node in cluster.inventory["nodes"]:
        with socket.socket() as sock:
            assert sock.connect_ex((node["public_ip"], node["ssh_port"])) != 0
    assert (run_dir / "node-0.log").read_text() == "kept\n" and not killed_writer.exists()
    assert sorted(p.name for p in (state_dir / "local").iterdir()) == ["runs"]
    assert (state_dir / "current").read_text().strip() == "hosts"  # the one stack left is current now
    assert "stack 'hosts' is still up and is now the current stack" in down.stdout

    again = run_cli("down", "--stack", "local")
    assert again.returncode == 0 and "nothing to do" in again.stdout


# ------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("nodes", ["0", "17", "two"])
def test_bad_node_counts_are_refused_before_anything_exists(state_dir, nodes):
    result = run_cli("up", "--local", "--nodes", nodes)
    assert_one_line_error(result, "nodes")
    assert not (state_dir / "local").exists()


def test_a_port_in_use_is_refused_and_nothing_is_left(state_dir):
    address, port = free_endpoint(2)
    with socket.socket() as squatter:
        squatter.bind((address.rsplit(".", 1)[0] + ".11", port))
        squatter.listen()
        result = run_cli("up", "--local", "--bind", address, "--ssh-port", str(port))
    assert_one_line_error(result, f"port {port}", "in use")
    assert not (state_dir / "local").exists()
    assert node_server_processes(state_dir) == []


@pytest.mark.parametrize("address", ["10.1.2.3", "127.0.0.300", "localhost"])
def test_addresses_that_cannot_be_bound_are_refused(state_dir, address):
    result = run_cli("up", "--local", "--bind", address)
    assert_one_line_error(result, "--bind")
    assert not (state_dir / "local").exists()


def test_a_corrupt_inventory_is_one_line_and_down_still_works(state_dir, make_cluster):
    make_cluster()
    (state_dir / "local" / "inventory.json").write_text('{"stack": "local", "nodes": [')
    status = run_cli("status")
    assert_one_line_error(status, "corrupt", "deploy.py down")
    assert run_cli("down").returncode == 0
    assert node_server_processes(state_dir) == []


def test_ssh_to_a_node_that_does_not_exist(local_cluster):
    assert_one_line_error(run_cli("ssh", "node-5"), "node-5", "node-0, node-1")


def test_commands_without_a_cluster_say_what_to_do(state_dir):
    assert_one_line_error(run_cli("status"), "no cluster", "deploy.py up")
    assert_one_line_error(run_cli("ssh"), "no cluster")


def test_an_unknown_flag_is_one_line(state_dir):
    assert_one_line_error(run_cli("up", "--nodez", "2"), "--nodez")


def _processes_matching(text: str) -> list[int]:
    found = []
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
            state = open(f"/proc/{proc}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == text and state != "Z":
            found.append(int(proc))
    return found


# ------------------------------------------------------------------------- a cluster started with secrets


@pytest.fixture(scope="module")
def secret_cluster(tmp_path_factory):
    """One cluster started by a caller whose environment holds credentials; for tests that only look."""
    state_dir = tmp_path_factory.mktemp("secret") / "cluster-state"
    address, port = free_endpoint(2)
    env = {"CLUSTER_STATE_DIR": str(state_dir), "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "GITHUB_TOKEN": FAKE_SECRET}
    try:
        run_cli("up", "--local", "--bind", address, "--ssh-port", str(port), check=True, **env)
        yield LocalCluster("local", state_dir, json.loads((state_dir / "local" / "inventory.json").read_text()))
    finally:
        run_cli("down", "--stack", "local", CLUSTER_STATE_DIR=str(state_dir))


def test_node_servers_and_their_commands_get_none_of_the_callers_secrets(secret_cluster):
    servers = node_server_processes(secret_cluster.state_dir)
    assert len(servers) == 2
    for pid in servers:
        environ = open(f"/proc/{pid}/environ", "rb").read()
        assert FAKE_SECRET.encode() not in environ and b"PATH=" in environ
    inv = secret_cluster.inventory
    on_node = subprocess.run(openssh_argv(inv, inv["nodes"][1], "env"), capture_output=True, text=True)
    assert on_node.returncode == 0 and "CLUSTER_NODE=node-1" in on_node.stdout
    assert FAKE_SECRET not in on_node.stdout
    # The node's own metadata service (spot notices) is the one AWS_ variable a node has, as on EC2
    aws = [line for line in on_node.stdout.splitlines() if line.startswith("AWS_")]
    assert [line.split("=")[0] for line in aws] == ["AWS_EC2_METADATA_SERVICE_ENDPOINT"]
    assert aws[0].startswith(f"AWS_EC2_METADATA_SERVICE_ENDPOINT=http://{inv['nodes'][1]['public_ip']}:")


def test_host_private_keys_are_out_of_reach_of_jobs(secret_cluster):
    inv = secret_cluster.inventory
    host_keys = secret_cluster.stack_dir / "host_keys"
    assert stat.S_IMODE(host_keys.stat().st_mode) == 0o700 and sorted(p.name for p in host_keys.iterdir()) == [
        "node-0",
        "node-1",
    ]
    # The pattern is written so that sshd.log, which records the command, does not match it.
    search = 'grep -rlE "PRIVATE[ ]KEY" "$HOME" "$CLUSTER_SHARED_DIR" 2>/dev/null; echo "home=$HOME"'
    result = subprocess.run(openssh_argv(inv, inv["nodes"][0], search), capture_output=True, text=True)
    assert result.stdout.strip().splitlines() == [f"home={secret_cluster.stack_dir / 'nodes' / 'node-0'}"]


@pytest.mark.parametrize("protocol", [[], ["-O"]], ids=["sftp", "legacy"])
def test_stock_scp_copies_both_ways_and_exits_with_the_transfers_status(secret_cluster, tmp_path, protocol):
    inv = secret_cluster.inventory
    node = inv["nodes"][0]
    options = [
        *protocol,
        "-i",
        inv["ssh_key"],
        "-P",
        str(node["ssh_port"]),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        f"UserKnownHostsFile={inv['known_hosts']}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
    ]
    remote = f"{inv['ssh_user']}@{node['public_ip']}"
    source, back = tmp_path / "data.bin", tmp_path / "back.bin"
    source.write_bytes(os.urandom(100_000))
    target = f"{remote}:scp{len(protocol)}.bin"
    sent = subprocess.run(["scp", *options, str(source), target], capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    fetched = subprocess.run(["scp", *options, target, str(back)], capture_output=True, text=True)
    assert fetched.returncode == 0 and back.read_bytes() == source.read_bytes(), fetched.stderr
    missing = subprocess.run(["scp", *options, f"{remote}:no-such-file", str(back)], capture_output=True, text=True)
    assert missing.returncode == 1 and "no-such-file" in missing.stderr


# ------------------------------------------------------------------------------------ the cluster key


def test_a_missing_or_loose_key_is_refused_by_every_command_and_down_still_cleans_up(state_dir, make_cluster):
    cluster = make_cluster()
    key = cluster.inventory["ssh_key"]
    os.chmod(key, 0o644)
    for result in (run_cli("status"), run_cli("ssh", "node-1", "--", "true"), run_fab("hello")):
        assert_one_line_error(result, "readable by others", f"chmod 600 {key}")
    os.chmod(key, 0o600)
    assert run_cli("status").returncode == 0
    os.unlink(key)
    for result in (run_cli("status"), run_cli("ssh"), run_fab("stop")):
        assert_one_line_error(result, f"the cluster key {key} is missing", "down --stack local")
    down = run_cli("down")
    assert down.returncode == 0 and "is down" in down.stdout, down.stderr
    assert node_server_processes(state_dir) == [] and not (state_dir / "local" / "nodes").exists()


# --------------------------------------------------------------------------------- an interrupted up


def test_an_up_killed_after_starting_its_nodes_is_found_and_cleaned_up(state_dir):
    address, port = free_endpoint(2)
    up = subprocess.Popen(
        [sys.executable, "deploy.py", "up", "--local", "--bind", address, "--ssh-port", str(port)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pid_files = [state_dir / "local" / "nodes" / f"node-{i}" / "sshd.pid" for i in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in pid_files) and up.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    up.kill()  # SIGKILL: no cleanup of its own, before the inventory and `current` are written
    up.wait()
    try:
        assert len(node_server_processes(state_dir)) == 2
        assert not (state_dir / "local" / "inventory.json").exists() and not (state_dir / "current").exists()
        stray = state_dir / f".current.{dead_pid()}.tmp"
        stray.write_text("local\n")
        assert_one_line_error(run_cli("status"), "interrupted up", "down --stack local")
        assert_one_line_error(run_cli("up", "--local"), "no inventory", "down --stack local")
        down = run_cli("down")
        assert down.returncode == 0 and "left by an interrupted up" in down.stdout, down.stdout + down.stderr
        assert node_server_processes(state_dir) == []
        assert not stray.exists() and not (state_dir / "local").exists()
    finally:
        run_cli("down", "--stack", "local")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


# ------------------------------------------------------------------------------------------ make demo

FAILING_FAB = """#!/usr/bin/env bash
# Stands in for fab: records what the demo asked and what it was given, names a node's log, fails.
echo "$*" >> "$DEMO_RECORD/fab-argv"
cp "$CLUSTER_STATE_DIR/local/inventory.json" "$DEMO_RECORD/inventory.json"
echo "error: bootstrap failed; see $CLUSTER_STATE_DIR/local/nodes/node-0/sshd.log" >&2
exit 1
"""


def demo(state_dir, tmp_path, **variables: str) -> subprocess.CompletedProcess:
    """scripts/demo.sh as `make demo VAR=...` runs it, with a `fab` that fails its first step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "fab").write_text(FAILING_FAB)
    (bin_dir / "fab").chmod(0o755)
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # make demo's PATH: the venv's bin
    env = child_env(PATH=path, CLUSTER_STATE_DIR=str(state_dir), DEMO_RECORD=str(tmp_path), **variables)
    return subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_make_demo_takes_the_users_addresses_and_keeps_the_log_a_failed_step_names(state_dir, tmp_path):
    address, port = free_endpoint(2)
    master_port = port + 100
    result = demo(state_dir, tmp_path, BIND=address, SSH_PORT=str(port), MASTER_PORT=str(master_port))
    assert result.returncode == 1, result.stderr
    assert (tmp_path / "fab-argv").read_text() == f"bootstrap --master-port {master_port}\n"
    head = json.loads((tmp_path / "inventory.json").read_text())["nodes"][0]
    assert (head["public_ip"], head["ssh_port"]) == (address, port)
    assert not (state_dir / "local" / "inventory.json").exists()  # the demo's own down ran
    assert node_server_processes(state_dir) == []
    stack, kept = (
        result.stderr.split("the logs a failed step names are kept: ")[1].split("\n")[0].split("/PATH is now ")
    )
    kept = kept.removesuffix("/PATH")
    assert stack == str((state_dir / "local").resolve())
    assert (Path(kept) / "nodes" / "node-0" / "sshd.log").read_text()


@pytest.mark.parametrize(
    "variable,value",
    [("MASTER_PORT", "80"), ("SSH_PORT", "2222x"), ("BIND", "10.0.0.1"), ("MASTER_PORT", " 29500")],
)
def test_make_demo_refuses_a_bad_address_before_anything_is_created(state_dir, tmp_path, variable, value):
    result = demo(state_dir, tmp_path, **{variable: value})
    assert_one_line_error(result, f"{variable}='{value}'", f"make demo {variable}=")
    assert not state_dir.exists() and not (tmp_path / "fab-argv").exists()


# ----------------------------------------------------------------------------- a deleted state folder


@pytest.mark.skipif(slurm.unavailable() is not None, reason=f"Slurm: {slurm.unavailable()}")
def test_down_of_a_stack_whose_state_folder_was_deleted_stops_it_and_spares_a_users_shell(
    state_dir, make_cluster, tmp_path
):
    """`rm -rf` of a running stack's state folder (its nodes, Slurm's daemons and a run going), then
    `down --stack`: it says what it stopped, and nothing of the stack runs or listens afterwards; a shell of the
    user's that sits in a node's folder (no node session started it) is left alone."""
    cluster = make_cluster("r2")
    env = {"CLUSTER_STATE_DIR": str(state_dir)}
    ports = str(slurm.free_ports())
    booted = run_fab("bootstrap", "--stack", "r2", "--master-port", ports, "--accounting", "none", **env)
    assert booted.returncode == 0, booted.stdout + booted.stderr
    work = tmp_path / "sleep.py"
    work.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    submitted = run_fab("run", "--stack", "r2", "--script", str(work), "--detach", **env)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    slurm.wait_for(lambda: len(run_processes(run_id)) >= 2, f"run {run_id}'s ranks on both nodes")
    addresses = {node["public_ip"] for node in cluster.inventory["nodes"]}
    block = range(int(ports), int(ports) + slurm.PORT_BLOCK)  # Slurm's daemons: on the ports bootstrap was given

    def stacks_sockets() -> list:
        return [s for s in slurm.listening_sockets() if s[0] in addresses or s[1] in block]

    ours = stacks_sockets()
    assert len({s[2] for s in ours}) >= 4, ours  # the node servers, slurmctld, the slurmds
    users_shell = subprocess.Popen(["sleep", "4322"], cwd=cluster.stack_dir / "nodes" / "node-0")
    try:
        shutil.rmtree(cluster.stack_dir)
        down = run_cli("down", "--stack", "r2")
        assert down.returncode == 0, down.stdout + down.stderr
        said = " ".join(down.stdout.split())  # as wrapped to the terminal's width
        assert "its state folder" in said and "was gone" in said and "2 node servers" in said, said
        assert node_server_processes(state_dir) == [] and run_processes(run_id) == []
        assert stacks_sockets() == []
        assert [pid for _, _, pid in ours if procfs.alive(pid)] == []  # zombies aside: init reaps them
        assert users_shell.poll() is None, "down killed a process the stack did not start"
    finally:
        users_shell.kill()
        users_shell.wait()
