"""The harness's pure pieces, directly: schedules, bandwidth arithmetic, formats, data, digests."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from harness import comm_bench, data, pipeline
from harness.cost import CostMeter
from harness.dist import DistEnv
from harness.metrics import STEP_HEADER, format_step, peak_tflops
from harness.models import MLP, TinyTransformerLM
from harness.train import parameter_digest, resolve_precision
from tests.support import REPO


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 8), (4, 4), (4, 2), (3, 7)])
def test_schedules_run_every_micro_batch_once_each_way_forward_first(schedule, stages, micro):
    for stage in range(stages):
        order = pipeline.schedule_order(schedule, stage, stages, micro)
        assert sorted(i for a, i in order if a == "F") == list(range(micro))
        assert sorted(i for a, i in order if a == "B") == list(range(micro))
        for i in range(micro):
            assert order.index(("F", i)) < order.index(("B", i))


def test_1f1b_keeps_at_most_p_minus_stage_activations_alive():
    stages, micro = 4, 8
    for stage in range(stages):
        alive = peak = 0
        for action, _ in pipeline.schedule_order("1f1b", stage, stages, micro):
            alive += 1 if action == "F" else -1
            peak = max(peak, alive)
        assert peak == stages - stage
        gpipe_peak = sum(1 for a, _ in pipeline.schedule_order("gpipe", stage, stages, micro) if a == "F")
        assert gpipe_peak == micro


def test_bubble_theory():
    assert pipeline.bubble_theory(2, 1) == pytest.approx(0.5)
    assert pipeline.bubble_theory(2, 8) == pytest.approx(1 / 9)
    assert pipeline.bubble_theory(4, 8) == pytest.approx(3 / 11)


def test_stages_split_the_model_evenly_and_refuse_uneven_splits():
    model = pipeline.build_full_model(width=8, layers=4, classes=3, seed=0)
    first, last = pipeline.stage_slice(model, 0, 2), pipeline.stage_slice(model, 1, 2)
    assert len(first) == 2 and len(last) == 3  # the head rides with the last stage
    x = torch.randn(5, 8)
    assert torch.equal(last(first(x)), model(x))
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline.stage_slice(model, 0, 3)


@pytest.mark.parametrize(
    "op,n,factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("broadcast", 8, 1.0),
    ],
)
def test_bus_factors_follow_nccl_tests(op, n, factor):
    assert comm_bench.bus_factor(op, n) == pytest.approx(factor)


def test_message_sizes_and_element_counts():
    assert comm_bench.sizes(1024, 8192) == [1024, 2048, 4096, 8192]
    assert comm_bench.element_count(1024, 2) == 256
    assert comm_bench.element_count(8, 3) == 3  # rounded up so every rank gets an equal chunk


def test_step_lines_are_fixed_width_under_their_header():
    line = format_step(12, 2.3456, 123.4, 4567.8, 0.5, 1.504, 0.012345)
    long_line = format_step(123456, 0.0001, 99999.9, 9999999.9, 123.45, 98.32, 1234.5)
    assert len(line) == len(long_line) == len(STEP_HEADER)
    assert line.split() == ["12", "2.3456", "123.4", "4567.8", "0.50", "1.504", "0.0123"]


@pytest.mark.parametrize(
    "name,precision,peak",
    [
        ("Tesla T4", "fp16", 65.0),
        ("Tesla T4", "bf16", None),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_datasheet_peaks_are_found_by_the_name_cuda_reports(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_cost_meter_prices_elapsed_time_and_samples():
    now = [100.0]
    meter = CostMeter(hourly_usd=1.504, clock=lambda: now[0])
    now[0] += 1800
    assert meter.usd_so_far() == pytest.approx(0.752)
    assert meter.usd_per_million_samples(1_000_000) == pytest.approx(0.752)
    assert meter.usd_per_million_samples(0) is None


def test_dist_env_reads_the_node_environment():
    env = DistEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "NODE_RANK": "1",
            "NNODES": "2",
            "CLUSTER_HOURLY_USD": "1.504",
            "CLUSTER_RUN_DIR": "/r",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.nnodes) == (3, 1, 4, 1, 2)
    assert env.hourly_usd == 1.504 and str(env.run_dir) == "/r" and env.shared_dir is None


def test_teacher_data_is_deterministic_and_not_noise():
    a, b = data.teacher_classification(512, seed=3), data.teacher_classification(512, seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert len(a.tensors[1].unique()) > 3  # several classes are used
    tokens, targets = data.teacher_sequences(64, seq_len=16, vocab=32, seed=1).tensors
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next tokens


def test_parameter_digest_sees_a_one_bit_change():
    model = MLP()
    before = parameter_digest(model)
    assert parameter_digest(model) == before
    with torch.no_grad():
        flat = model.head.bias.view(torch.int32)
        flat[0] ^= 1
    assert parameter_digest(model) != before


def test_precision_choices():
    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu).dtype is None
    assert resolve_precision("bf16", cpu).dtype is torch.bfloat16
    assert resolve_precision("fp16", cpu).scaler(cpu).is_enabled()
    with pytest.raises(ValueError):
        resolve_precision("fp8", cpu)


def test_transformer_is_causal():
    model = TinyTransformerLM(vocab=16, seq_len=8, d_model=16, n_heads=2, n_layers=1).eval()
    tokens = torch.randint(16, (1, 8))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 16
    assert torch.allclose(model(tokens)[0, :-1], model(changed)[0, :-1])


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_harness_imports_only_torch_nvml_the_node_contract_and_the_standard_library():
    allowed = {"torch", "torchft", "pynvml", "harness", "node"} | set(sys.stdlib_module_names)
    for path in (REPO / "harness").glob("*.py"):
        assert _imported_modules(path) <= allowed, path.name


def test_the_node_side_imports_only_the_standard_library_and_itself():
    """It runs before bootstrap has installed anything (torch only where a rank has imported it, torchft
    only where a fault-tolerant run's head node serves the Lighthouse)."""
    rankhook = {"sitecustomize", "gpu_cluster_rank_monitor", "gpu_cluster_forward_steps"}
    allowed = {"node", "torch", "torchft", *rankhook} | set(sys.stdlib_module_names)
    for path in (REPO / "node").rglob("*.py"):
        assert _imported_modules(path) <= allowed, path.relative_to(REPO)


def test_infra_never_imports_remote():
    for path in (REPO / "infra").rglob("*.py"):
        assert "remote" not in _imported_modules(path), path.relative_to(REPO)


def test_examples_build_only_on_the_harness():
    allowed = {"torch", "torchft", "harness", "examples", "matplotlib", "rich"} | set(sys.stdlib_module_names)
    for path in (REPO / "examples").glob("*.py"):
        assert _imported_modules(path) <= allowed, path.name
        if path.name.startswith("_"):
            continue  # a helper module, not an example
        first_line = path.read_text().split('"""')[1].strip().splitlines()[0]
        assert first_line.startswith("torchrun ") and path.name in first_line, path.name
