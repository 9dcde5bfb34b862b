"""The parallelism lab's pure pieces, directly: the fab task table, mesh validation, byte accounting,
the check line, memory accounting and the sharded checkpoints' commit marker."""

import pytest

from conftest import REPO
from infra.inventory import ClusterInfo, NodeInfo
from remote import commands, tasks


def test_the_task_table_registers_every_example_task_with_its_help():
    registered = tasks.ns.task_names
    for example in tasks.EXAMPLE_TASKS:
        assert example.name in registered, example.name
        assert (REPO / example.script).is_file(), example.script
        fab_task = tasks.ns[example.name]
        assert fab_task.__doc__ == example.help
        assert set(fab_task.help) >= {"args", "max-restarts", "stack"}
    assert len({example.name for example in tasks.EXAMPLE_TASKS}) == len(tasks.EXAMPLE_TASKS)


def _nodes(*gpus: int):
    return tuple(NodeInfo(f"node-{i}", f"54.0.0.{i + 1}", f"10.0.1.{10 + i}", 22, g) for i, g in enumerate(gpus))


@pytest.mark.parametrize("gpus,requested,problem", [
    ((0, 0), None, None), ((0, 0), 2, None), ((0, 0), 5, None), ((4, 4), 4, None), ((4, 4), 2, None),
    ((4, 4), 8, "more than node-0's 4 GPU(s)"), ((4, 2), 4, "more than node-1's 2 GPU(s)"),
    ((0, 0), 0, "at least 1"), ((1, 1), -1, "at least 1"),
])
def test_nproc_per_node_is_refused_above_the_gpu_count_and_below_one(gpus, requested, problem):
    found = commands.nproc_problem(_nodes(*gpus), requested)
    assert (found is None) if problem is None else (problem in found), found


def test_nproc_per_node_reaches_torchrun_and_the_job_environment():
    cluster = ClusterInfo("dev", "local", "local", "cpu", 0.0, "u", "/k", "/kh", "/shared",
                          "2026-11-21T00:00:00+00:00", _nodes(0, 0))
    default = commands.launch_command(cluster, cluster.nodes[1], "r1", "hybrid", "x.py", [], 0, 29500)
    assert "--nproc-per-node=1" in default and "NPROC_PER_NODE=1 " in default
    two = commands.launch_command(cluster, cluster.nodes[1], "r1", "hybrid", "x.py", [], 0, 29500, nproc=2)
    assert "--nproc-per-node=2" in two and "NPROC_PER_NODE=2 " in two
    gpu_nodes = _nodes(4, 4)
    assert commands.nproc_per_node(gpu_nodes[0].gpus) == 4 and commands.nproc_per_node(0) == 1
