"""`deploy.py drill spot` on a real local cluster: the notice on the node's metadata service, the
watcher on the node sees it, the node is reclaimed, and `down` leaves nothing."""

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

from infra import inventory
from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env, run_cli
from tests.support.clusters import node_server_processes
from tests.support.inventories import cluster as aws_cluster
from tests.support.network import free_endpoint


def accepts(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((address, port)) == 0


def endpoints(state_dir, stack: str) -> list[tuple[str, int]]:
    """Every node's SSH and metadata endpoints, from what `up` told the node servers."""
    found = []
    for path in sorted((state_dir / stack / "nodes").glob("node-*/node.json")):
        config = json.loads(path.read_text())
        found += [(config["address"], config["port"]), (config["address"], config["metadata_port"])]
    return found


def lines_of(proc: subprocess.Popen) -> "queue.Queue[str]":
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout or ():
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_line(lines: "queue.Queue[str]", text: str, within_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            break
        if text in seen[-1]:
            return seen
    raise AssertionError(f"no line with {text!r} within {within_s:g} s: {seen}")


def wait_until(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_drill_spot_notice_reaches_the_watcher_then_the_node_is_reclaimed(make_cluster, state_dir):
    cluster = make_cluster("spot", 2)
    node0, node1 = cluster.inventory["nodes"]
    # Polled every second: a 3 s notice would pass between two of the default 5 s polls; the endpoint from the env
    watch_command = f"cd {REPO} && {sys.executable} node/spot_watch.py --interval-s 1"
    watcher = subprocess.Popen(
        [sys.executable, "deploy.py", "ssh", "node-1", "--stack", "spot", "--", watch_command],
        cwd=REPO,
        env=child_env(CLUSTER_STATE_DIR=str(state_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = lines_of(watcher)
        wait_for_line(lines, "spot-watch node-1: watching http://", 30)

        # Without --spot nothing replaces the node: refused in one line, no notice posted, unless --yes
        refused = run_cli("drill", "spot", "node-1", "--notice", "3", "--stack", "spot")
        assert_one_line_error(refused, "without --spot", "nothing will replace node-1", "--yes")
        assert not (state_dir / "spot" / "notices").exists() and accepts(node1["public_ip"], node1["ssh_port"])
        drilled = run_cli("drill", "spot", "node-1", "--notice", "3", "--stack", "spot", "--yes")
        assert drilled.returncode == 0, drilled.stderr
        assert "node-1: spot interruption notice posted" in drilled.stdout

        wait_for_line(lines, "spot-watch node-1: spot interruption notice: terminate at ", 10)
        assert wait_until(lambda: not accepts(node1["public_ip"], node1["ssh_port"]), 15), "node-1 still answers"
        assert watcher.wait(timeout=15) != 0  # its session ended with the node
        assert accepts(node0["public_ip"], node0["ssh_port"])  # the other node lives on
        again = run_cli("drill", "spot", "node-1", "--stack", "spot")
        assert_one_line_error(again, "node-1 is not running")
    finally:
        if watcher.poll() is None:
            watcher.kill()
        watcher.wait()

    every = endpoints(state_dir, "spot")
    down = run_cli("down", "--stack", "spot")
    assert down.returncode == 0, down.stdout + down.stderr
    assert [e for e in every if accepts(*e)] == []
    assert node_server_processes(state_dir) == []
    assert not (state_dir / "spot").exists() or [p.name for p in (state_dir / "spot").iterdir()] == ["runs"]


def test_two_spot_ups_at_once_find_one_stack_and_a_bad_drill_is_one_line(state_dir):
    """The `up` that waits on the stack lock finds the stack up, with --spot, as a later `up --spot` does."""
    address, port = free_endpoint(1)
    up = [sys.executable, "deploy.py", "up", "--local", "--spot", "--stack", "spot", "--nodes", "1"]
    up += ["--bind", address, "--ssh-port", str(port)]
    env = child_env(CLUSTER_STATE_DIR=str(state_dir))
    ups = [subprocess.Popen(up, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    ups.append(subprocess.Popen(up, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        ended = [(job.wait(timeout=120), *job.communicate()) for job in ups]
        assert [code for code, _, _ in ended] == [0, 0], ended
        assert len(node_server_processes(state_dir)) == 1
        assert_one_line_error(run_cli("drill", "spot", "node-7", "--stack", "spot"), "no node 'node-7'")
        assert_one_line_error(run_cli("drill", "spot", "node-0", "--notice", "-1", "--stack", "spot"), "--notice")
        role = ["--fis-role", "arn:aws:iam::123456789012:role/fis-spot"]
        assert_one_line_error(run_cli("drill", "spot", "node-0", *role, "--stack", "spot"), "--fis-role is for AWS")
        assert not (state_dir / "spot" / "notices").exists()
    finally:
        for job in ups:
            if job.poll() is None:
                job.kill()
        run_cli("down", "--stack", "spot")


def test_drill_on_aws_says_what_it_would_need(state_dir, tmp_path):
    (tmp_path / "key").write_text("a key\n")
    (tmp_path / "key").chmod(0o600)
    (tmp_path / "known_hosts").write_text("")
    inventory.save(replace(aws_cluster(), ssh_key=str(tmp_path / "key"), known_hosts=str(tmp_path / "known_hosts")))
    result = run_cli("drill", "spot", "node-1", "--stack", "dev")
    assert_one_line_error(result, "AWS FIS", "aws:ec2:send-spot-instance-interruptions", "node-1", "--fis-role ARN")
    role = ["--fis-role", "arn:aws:iam::123456789012:role/fis-spot"]
    assert_one_line_error(run_cli("drill", "spot", "node-1", "--notice", "3", *role, "--stack", "dev"), "2 to 15")
    assert_one_line_error(run_cli("drill", "spot", "node-9", "--stack", "dev"), "no node 'node-9'")
