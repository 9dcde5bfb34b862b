"""Clusters for the integration tests: real local clusters on free loopback ports, stock OpenSSH hosts."""

import subprocess

import pytest

from tests.support.cli import run_cli
from tests.support.clusters import LocalCluster, start_local_cluster
from tests.support.network import free_endpoint


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
