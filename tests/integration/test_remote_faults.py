"""`fab` against clusters in trouble, each test with a cluster of its own: no cluster, an unreachable
node, no bootstrap yet, a stage failing on one node, a connection dropped during bootstrap (and a
second bootstrap meanwhile)."""

import json
import os
import signal
import time
from pathlib import Path

from tests.support.cli import assert_one_line_error, lock_held, popen_fab, run_fab
from tests.support.network import CuttingProxy, free_port

# ---------------------------------------------------------------------------------------- faults


def test_without_a_cluster_fab_says_so(state_dir):
    assert_one_line_error(run_fab("hello"), "no cluster", "deploy.py up")
    assert_one_line_error(run_fab("bootstrap"), "no cluster")


def test_an_unreachable_node_is_named_before_anything_starts(state_dir, make_cluster):
    make_cluster()
    pid_file = state_dir / "local" / "nodes" / "node-1" / "sshd.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    result = run_fab("bootstrap")
    assert_one_line_error(result, "node-1", "unreachable", "connection refused")
    assert not (state_dir / "local" / "bootstrap.json").exists()


def test_launching_before_bootstrap_says_what_to_do(state_dir, make_cluster):
    make_cluster()
    assert_one_line_error(run_fab("hello"), "bootstrap")


def test_a_stage_failing_on_one_node_is_reported_and_stops_the_bootstrap(state_dir, make_cluster):
    make_cluster()
    # A file where node-1's venv must go: the deps stage cannot make the venv there, on node-1 only.
    planted = state_dir / "local" / "nodes" / "node-1" / ".gpu-cluster" / "venv"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("planted by the test\n")
    result = run_fab("bootstrap", "--master-port", str(free_port()), "--scheduler", "none")
    assert result.returncode == 1
    assert "node-1: deps failed" in result.stdout and ".gpu-cluster/venv" in result.stdout, result.stdout
    states = {
        node: json.loads((state_dir / "local" / "nodes" / node / ".gpu-cluster" / "state.json").read_text())
        for node in ("node-0", "node-1")
    }
    assert all("probe" in state for state in states.values())  # the stage before it is complete on every node
    assert "deps" in states["node-0"] and "deps" not in states["node-1"]  # every node finished the failing one
    assert not any((state_dir / "local" / "nodes" / node / ".gpu-cluster" / "env").exists() for node in states)
    assert not (state_dir / "local" / "bootstrap.json").exists()


def test_a_connection_dropped_during_bootstrap_is_retried(state_dir, make_cluster):
    make_cluster()
    inventory_path = state_dir / "local" / "inventory.json"
    inventory = json.loads(inventory_path.read_text())
    node1 = inventory["nodes"][1]
    proxy = CuttingProxy(node1["public_ip"], (node1["public_ip"], node1["ssh_port"]), cut_first_after_s=1.0)
    try:
        known_hosts = Path(inventory["known_hosts"])
        host_key = next(t for t in known_hosts.read_text().splitlines() if t.startswith(f"[{node1['public_ip']}]"))
        known_hosts.write_text(
            known_hosts.read_text() + f"[{node1['public_ip']}]:{proxy.port} {' '.join(host_key.split()[1:])}\n"
        )
        node1["ssh_port"] = proxy.port
        inventory_path.write_text(json.dumps(inventory))
        first = popen_fab("bootstrap", "--master-port", str(free_port()), "--scheduler", "none")
        lock = state_dir / ".locks" / "local.bootstrap.lock"
        deadline = time.monotonic() + 60
        while not lock_held(lock) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # A second bootstrap meanwhile is refused in one line naming the first (they would fight over ports).
        assert_one_line_error(run_fab("bootstrap", "--force"), "fab bootstrap of stack 'local' (pid", "under way")
        output, _ = first.communicate(timeout=300)
    finally:
        proxy.close()
    assert first.returncode == 0, output
    # A cut in the middle of a command is retried with a word ("node-1: connection lost ... retry 1");
    # a cut between commands is mended silently, as Fabric reopens a closed connection. Either way the
    # bootstrap went on over a new connection.
    assert proxy.connections >= 2
