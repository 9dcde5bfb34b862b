"""Shared fixtures: an isolated `.cluster/`, real local clusters on free loopback ports, the CLIs."""

import json
import os
import random
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    """A private `.cluster/` for this test; `CLUSTER_STACK` cleared so only the test picks stacks."""
    path = tmp_path / "cluster-state"
    monkeypatch.setenv("CLUSTER_STATE_DIR", str(path))
    monkeypatch.delenv("CLUSTER_STACK", raising=False)
    return path


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_cli(*args: str, timeout: float = 120, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`python deploy.py ARGS` as a user runs it, in the repository, with the test's state dir."""
    result = subprocess.run(
        [sys.executable, "deploy.py", *args],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"deploy.py {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def run_fab(*args: str, timeout: float = 300, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`fab ARGS` from the repository, as a user runs it."""
    fab = Path(sys.executable).with_name("fab")
    result = subprocess.run(
        [str(fab), *args], cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"fab {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2 and a single `error: ...` line that mentions `words`."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def free_endpoint(nodes: int) -> tuple[str, int]:
    """A loopback /24 and a port where every node's (address, port) is free right now."""
    for _ in range(200):
        base = f"127.0.{random.randint(1, 250)}.10"
        port = random.randint(20000, 60000)
        prefix = base.rsplit(".", 1)[0]
        if all(_bindable(f"{prefix}.{10 + i}", port) for i in range(nodes)):
            return base, port
    raise RuntimeError("no free loopback endpoint")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
            return True
        except OSError:
            return False


@dataclass
class LocalCluster:
    """A running local cluster made by the real `deploy.py up --local`."""

    stack: str
    state_dir: Path
    inventory: dict

    @property
    def stack_dir(self) -> Path:
        return self.state_dir / self.stack


def start_local_cluster(stack: str, state_dir: Path, nodes: int = 2, *extra: str) -> LocalCluster:
    address, port = free_endpoint(nodes)
    run_cli("up", "--local", "--stack", stack, "--nodes", str(nodes), "--bind", address, "--ssh-port", str(port), *extra, check=True)
    inventory = json.loads((state_dir / stack / "inventory.json").read_text())
    return LocalCluster(stack, state_dir, inventory)


@pytest.fixture
def make_cluster(state_dir):
    """Start local clusters in the test's state dir; every one is taken down afterwards, pass or fail."""
    started: list[str] = []

    def make(stack: str = "local", nodes: int = 2, *extra: str) -> LocalCluster:
        started.append(stack)
        return start_local_cluster(stack, state_dir, nodes, *extra)

    yield make
    for stack in started:
        run_cli("down", "--stack", stack)


@pytest.fixture
def local_cluster(make_cluster):
    """A 2-node local cluster for one test, always taken down afterwards."""
    return make_cluster()


def processes_of(module: str, state_dir: Path) -> list[int]:
    """Live (non-zombie) processes running `python -m module` for this state dir."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if module.encode() in cmdline and str(state_dir).encode() in cmdline and stat[0] != "Z":
            pids.append(int(proc.name))
    return pids


def node_server_processes(state_dir: Path) -> list[int]:
    return processes_of("infra.local.node_server", state_dir)


def fabric_connection(inventory: dict, node: dict):
    """A Fabric connection built only from the inventory: its key, its pinned host keys."""
    import paramiko
    from fabric import Config, Connection

    conn = Connection(
        node["public_ip"],
        port=node["ssh_port"],
        user=node.get("ssh_user") or inventory["ssh_user"],
        connect_kwargs={"key_filename": inventory["ssh_key"], "look_for_keys": False, "allow_agent": False},
        config=Config(overrides={"run": {"in_stream": False}, "load_ssh_configs": False}),
    )
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    conn.client.load_host_keys(inventory["known_hosts"])
    return conn


@pytest.fixture(scope="module")
def openssh_hosts(tmp_path_factory):
    """Two machines for the `ssh` provider: stock OpenSSH sshd on loopback, one Unix user each
    (gcnode0, gcnode1) with a home of its own. Skipped, saying why, where sshd or root is missing."""
    import openssh

    why = openssh.unavailable()
    if why:
        pytest.skip(f"OpenSSH hosts: {why}")
    try:
        openssh.build_node_python()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"OpenSSH hosts: the node Python (torch for the node users) could not be built: {exc}")
    address, port = free_endpoint(2)
    hosts = openssh.start_hosts(tmp_path_factory.mktemp("openssh"), address, port)
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under xdist (`make test` runs `pytest -n ... --dist loadgroup`), a module whose tests share a
    module-scoped fixture (a running cluster) runs whole on one worker, in order, as it would alone;
    every other test is handed out on its own."""
    shared = {item.module.__name__ for item in items if _uses_a_shared_fixture(item)}
    for item in items:
        if item.module.__name__ in shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _uses_a_shared_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    ours = [d for defs in (info.name2fixturedefs.values() if info else ()) for d in defs if d.baseid]
    return bool({d.scope for d in ours} & {"module", "package", "session"})


class CuttingProxy:
    """A TCP proxy on `address` to `target` whose connections can be cut: all open ones at once (`cut()`),
    or the first one `cut_first_after_s` after it opened. New connections still pass; `connections`
    counts those accepted."""

    def __init__(self, address: str, target: tuple[str, int], cut_first_after_s: float | None = None):
        self.listener = socket.create_server((address, 0))
        self.port, self.target, self.cut_first_after_s = self.listener.getsockname()[1], target, cut_first_after_s
        self.open: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            pair = [client, socket.create_connection(self.target)]
            self.open += pair
            for source, sink in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()
            if self.connections == 1 and self.cut_first_after_s is not None:
                threading.Timer(self.cut_first_after_s, self._cut, args=pair).start()

    @classmethod
    def _pump(cls, source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:  # one side closing closes the other, as a real connection would
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        cut, self.open = self.open, []
        self._cut(*cut)

    @staticmethod
    def _cut(*sockets):
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass

    def close(self):
        self.listener.close()
        self.cut()
