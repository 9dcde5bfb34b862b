"""The parallelism lab's pure pieces, directly: the fab task table, mesh validation, byte accounting,
the check line, memory accounting and the sharded checkpoints' commit marker."""

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.checks import check_line
from harness.comm_bytes import (
    CommTally,
    bf16_problem,
    bucket_cap_mb,
    collective_size,
    register_counted_hook,
)
from harness.memory import (
    SavedForBackward,
    Sharing,
    activation_estimate_bytes,
    breakdown,
    course_estimate_bytes,
    format_bytes,
    whole_breakdown,
)
from harness.models import loss_fn
from harness.parallel import MeshShape, ModelConfig, layout_problem, mesh_shape, train_step
from harness.sharded_checkpoint import checkpoint_root, committed_steps, latest_committed, step_dir, write_marker
from infra.inventory import ClusterInfo, NodeInfo
from remote import job_command, tasks, tasks_launch
from tests.support import REPO


def test_the_task_table_registers_every_example_task_with_its_help():
    registered = tasks.ns.task_names
    for example in tasks_launch.EXAMPLE_TASKS:
        assert example.name in registered, example.name
        assert (REPO / example.script).is_file(), example.script
        fab_task = tasks.ns[example.name]
        assert fab_task.__doc__ == example.help
        assert set(fab_task.help) >= {"args", "max-restarts", "stack"}
    assert len({example.name for example in tasks_launch.EXAMPLE_TASKS}) == len(tasks_launch.EXAMPLE_TASKS)


def _nodes(*gpus: int):
    return tuple(NodeInfo(f"node-{i}", f"54.0.0.{i + 1}", f"10.0.1.{10 + i}", 22, g) for i, g in enumerate(gpus))


@pytest.mark.parametrize(
    "gpus,requested,problem",
    [
        ((0, 0), None, None),
        ((0, 0), 2, None),
        ((0, 0), 5, None),
        ((4, 4), 4, None),
        ((4, 4), 2, None),
        ((4, 4), 8, "more than node-0's 4 GPU(s)"),
        ((4, 2), 4, "more than node-1's 2 GPU(s)"),
        ((0, 0), 0, "at least 1"),
        ((1, 1), -1, "at least 1"),
    ],
)
def test_nproc_per_node_is_refused_above_the_gpu_count_and_below_one(gpus, requested, problem):
    found = job_command.nproc_problem(_nodes(*gpus), requested)
    assert (found is None) if problem is None else (problem in found), found


def test_nproc_per_node_reaches_torchrun_and_the_job_environment():
    cluster = ClusterInfo(
        "dev", "local", "local", "cpu", 0.0, "u", "/k", "/kh", "/shared", "2026-11-21T00:00:00+00:00", _nodes(0, 0)
    )
    default = job_command.launch_command(cluster, cluster.nodes[1], "r1", "hybrid", "x.py", [], 0, 29500)
    # By default the node environment (sourced first) says NPROC_PER_NODE; the launch does not repeat it.
    assert "--nproc-per-node=1" in default and "NPROC_PER_NODE=" not in default
    assert job_command.node_environment(cluster, 1, "lo", "python3")["NPROC_PER_NODE"] == "1"
    two = job_command.launch_command(cluster, cluster.nodes[1], "r1", "hybrid", "x.py", [], 0, 29500, nproc=2)
    assert "--nproc-per-node=2" in two and "NPROC_PER_NODE=2 " in two
    gpu_nodes = _nodes(4, 4)
    assert job_command.nproc_per_node(gpu_nodes[0].gpus) == 4 and job_command.nproc_per_node(0) == 1


# ------------------------------------------------------------------------------------------ the mesh

TINY = ModelConfig(vocab=32, seq_len=16, d_model=32, n_heads=4, n_layers=1)


def test_a_mesh_that_does_not_fill_the_world_is_refused_with_the_whole_product():
    assert layout_problem(MeshShape(2, 2), 3, TINY, 8).startswith("dp(2) x tp(2) = 4 != WORLD_SIZE(3)")
    assert "must divide --n-heads 4" in layout_problem(MeshShape(1, 3), 3, TINY, 8)
    assert "split evenly over dp(3)" in layout_problem(MeshShape(3, 1), 3, TINY, 8)
    assert layout_problem(MeshShape(2, 2), 4, TINY, 8) is None


def test_the_default_mesh_puts_tp_within_a_node_and_dp_across_nodes():
    assert mesh_shape(world_size=4, local_world_size=2) == MeshShape(dp=2, tp=2)
    assert mesh_shape(world_size=8, local_world_size=4) == MeshShape(dp=2, tp=4)
    assert mesh_shape(world_size=4, local_world_size=4, dp=2) == MeshShape(dp=2, tp=2)
    assert mesh_shape(world_size=4, local_world_size=2, tp=4) == MeshShape(dp=1, tp=4)


# ------------------------------------------------------------------------------------- the check line


@pytest.mark.parametrize(
    "diff,tolerance,holds,verdict",
    [
        (1e-7, 1e-5, True, "ok"),
        (2e-5, 1e-5, True, "FAIL"),
        (float("nan"), 1e-5, True, "FAIL"),
        (0.0, 1e-5, False, "FAIL"),
    ],
)
def test_the_check_line_says_what_how_far_and_ok_or_fail(diff, tolerance, holds, verdict):
    line, passed = check_line("fp16 loss vs none over 4 steps,", diff, tolerance, holds)
    assert line.startswith("check: fp16 loss vs none over 4 steps, max diff ")
    assert line.endswith(f"(tolerance {tolerance:g}) {verdict}") and passed == (verdict == "ok")
    assert "\n" not in line


# ---------------------------------------------------------------------------------- counting bytes


def test_ring_accounting_of_each_collective():
    tally = CommTally()
    tally.add("all_reduce", 1000, 4)
    tally.add("all_gather", 1000, 4)
    tally.add("reduce_scatter", 1000, 4)
    assert tally.sent_bytes == pytest.approx(1500 + 750 + 750)
    assert tally.size_bytes == 3000 and tally.calls == 3
    shard, whole = torch.zeros(250), torch.zeros(1000)
    assert collective_size("_allgather_base_", (whole, shard, None, False)) == ("all_gather", 4000, 4)
    assert collective_size("_reduce_scatter_base_", (shard, whole, None, None, False)) == ("reduce_scatter", 4000, 4)
    assert collective_size("all_gather_into_tensor", (shard, 4, "0")) == ("all_gather", 4000, 4)
    assert collective_size("mm", (shard, shard)) is None


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


def _hook_bytes(hook: str, steps: int) -> int:
    torch.manual_seed(0)
    model = TINY.build(0, torch.device("cpu"))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb(model, "gloo"))
    tally = CommTally()
    register_counted_hook(ddp, hook, tally, powersgd_rank=1, start_iter=2)
    tokens = torch.randint(TINY.vocab, (2, TINY.seq_len))
    for _ in range(steps):
        tally.reset()
        loss_fn(ddp(tokens), tokens).backward()
    # Free DDP and its hook state here, in the main thread: the last reference to a gloo group dropped in
    # one of gloo's own threads (a hook's future callback) makes its destructor join that very thread,
    # which aborts the process ("Resource deadlock avoided").
    del ddp
    gc.collect()
    return tally.size_bytes


def test_the_wrapped_hooks_count_what_they_all_reduce(world_of_one):
    parameter_bytes = sum(p.numel() * 4 for p in TINY.build(0, torch.device("cpu")).parameters())
    assert _hook_bytes("none", 1) == parameter_bytes
    assert _hook_bytes("fp16", 1) == parameter_bytes // 2
    assert _hook_bytes("powersgd", 1) == parameter_bytes  # before --start-iter: plain all-reduce
    compressed = _hook_bytes("powersgd", 3)
    assert compressed < parameter_bytes / 4
    assert bf16_problem("bf16", "gloo") and bf16_problem("bf16", "nccl") is None
    assert bf16_problem("fp16", "gloo") is None


# -------------------------------------------------------------------------------------------- memory


def test_memory_is_summed_from_the_tensors_and_ddp_holds_16_bytes_per_parameter():
    model = TINY.build(0, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(TINY.vocab, (4, TINY.seq_len))
    saved = SavedForBackward(model)
    train_step(model, optimizer, tokens, tokens, saved)
    figures = breakdown(model, optimizer, saved)
    count = TINY.parameter_count()
    assert figures.parameters_bytes == figures.gradients_bytes == 4 * count
    assert 8 * count <= figures.optimizer_bytes <= 8 * count + 8 * len(list(model.parameters()))  # + step counters
    assert figures.gathered_bytes == 0  # a plain model's weights are its own
    estimate = activation_estimate_bytes(4, TINY.seq_len, TINY.d_model, TINY.n_layers, TINY.vocab)
    assert 0.7 * estimate < figures.activations_bytes < 1.3 * estimate
    assert whole_breakdown(model, optimizer, saved.activations_bytes) == figures
    assert course_estimate_bytes(count, Sharing(1, 1, 1), 0) == 16 * count
    assert course_estimate_bytes(count, Sharing(0.25, 0.25, 0.25), 0) == 4 * count


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**20, 5 * 2**30)] == ["512 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]


# ------------------------------------------------------------------------------ sharded checkpoints


def test_only_committed_checkpoints_are_loaded(tmp_path):
    for step in (10, 20, 30):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / "__0_0.distcp").write_bytes(b"shard")
    write_marker(step_dir(tmp_path, 10), 10, 4)
    write_marker(step_dir(tmp_path, 20), 20, 4)  # step 30 was interrupted: no marker
    assert committed_steps(tmp_path) == [10, 20]
    assert latest_committed(tmp_path) == step_dir(tmp_path, 20)
    assert [p.name for p in step_dir(tmp_path, 20).iterdir() if p.name.startswith(".")] == []
    assert latest_committed(tmp_path / "none") is None


def test_checkpoint_dir_relative_to_the_shared_dir_else_the_run_folder():
    shared, run = Path("/shared"), Path("/shared/runs/r1")
    assert checkpoint_root(Path("ckpt/fsdp"), shared, run) == Path("/shared/ckpt/fsdp")
    assert checkpoint_root(Path("/abs/ckpt"), shared, run) == Path("/abs/ckpt")
    assert checkpoint_root(None, shared, run) == Path("/shared/runs/r1/checkpoints")
    assert checkpoint_root(None, None, None) is None
