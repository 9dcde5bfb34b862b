"""Shared fixtures: an isolated `.cluster/`, real local clusters on free loopback ports, OpenSSH hosts; and
the xdist groups. Helpers that are not fixtures live in tests/support."""

import subprocess
from pathlib import Path

import pytest

from tests.support.clusters import LocalCluster, start_local_cluster
from tests.support.cli import run_cli
from tests.support.network import free_endpoint


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    """A private `.cluster/` for this test; `CLUSTER_STACK` cleared so only the test picks stacks."""
    path = tmp_path / "cluster-state"
    monkeypatch.setenv("CLUSTER_STATE_DIR", str(path))
    monkeypatch.delenv("CLUSTER_STACK", raising=False)
    return path


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


@pytest.fixture(scope="module")
def openssh_hosts(tmp_path_factory):
    """Two machines for the `ssh` provider: stock OpenSSH sshd on loopback, one Unix user each
    (gcnode0, gcnode1) with a home of its own. Skipped, saying why, where sshd or root is missing."""
    from tests.support import openssh

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
