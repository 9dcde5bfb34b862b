"""`fab hybrid` on 2 local nodes x 2 processes: the lab's 4-rank mesh through the real launcher, and a
checkpoint it saves resumed on 2 ranks."""

import re

import pytest

from conftest import assert_one_line_error
from test_lab import TINY
from test_remote import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One bootstrapped 2-node local cluster for the fab tests of this module."""
    handle = Cluster(tmp_path_factory.mktemp("lab") / "state")
    try:
        bootstrapped = handle.fab("bootstrap", "--master-port", str(handle.master_port))
        assert bootstrapped.returncode == 0, bootstrapped.stdout + bootstrapped.stderr
        yield handle
    finally:
        handle.down()


def test_fab_hybrid_runs_2_nodes_x_2_processes_and_resumes_on_2_ranks(cluster):
    args = " ".join(TINY) + " --steps 2 --checkpoint-dir ckpt/hybrid"
    four = cluster.fab("hybrid", "--nproc-per-node", "2", "--args", args)
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr
    assert "[node-0] mesh dp(2) x tp(2):" in four.stdout
    assert "[node-0]   replica 0: ranks 0, 1 on node-0" in four.stdout  # global rank 0 is on node-0
    assert "[node-0]   replica 1: ranks 2, 3 on node-1" in four.stdout
    two = cluster.fab("hybrid", "--args", args)  # one process per CPU node: dp(2) x tp(1)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr
    assert "saved by 4 ranks, loaded onto 2" in two.stdout
    digest = lambda out: re.search(r"parameters sha256 (\w+) at step 2", out).group(1)  # noqa: E731
    assert digest(two.stdout) == digest(four.stdout)


def test_fab_refuses_a_process_count_below_1_before_anything_runs(cluster):
    before = cluster.runs()
    assert_one_line_error(cluster.fab("hybrid", "--nproc-per-node", "0"), "--nproc-per-node", ">= 1")
    assert_one_line_error(cluster.fab("hello", "--nproc-per-node", "two"), "--nproc-per-node", "whole number")
    assert cluster.runs() == before
