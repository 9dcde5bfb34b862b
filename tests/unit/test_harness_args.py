"""Every example refuses a bad argument in one line with exit 2, before it starts (issue 11, item 15),
and writes its results where the results folder helper says."""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from harness.args import non_negative_int, positive_float, positive_int
from harness.results import results_dir, results_path
from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env

# One bad value per example, each a value that used to crash (or hang) the job after it started.
BAD_ARGUMENTS = {
    "distributed_hello.py": (["--expect-world-size", "0"], "--expect-world-size"),
    "ddp_training.py": (["--log-every", "0"], "--log-every"),
    "gradient_accumulation.py": (["--micro-batch-size", "4096", "-k", "2"], "below the 8192 samples"),
    "model_parallelism.py": (["--micro-batches", "0"], "--micro-batches"),
    "profile_communication.py": (["--factor", "1"], "--factor"),
    "scaling_efficiency.py": (["--steps", "-3"], "--steps"),
    "gradient_compression.py": (["--start-iter", "1"], "--start-iter"),
    "fsdp_training.py": (["--checkpoint-every", "0"], "--checkpoint-every"),
    "tensor_parallel.py": (["--d-model", "30", "--n-heads", "4"], "does not split into --n-heads 4"),
    "hybrid_parallel.py": (["--tp", "0"], "--tp"),
    "compare_strategies.py": (["--strategies", "ddp,zero4"], "unknown --strategies zero4"),
    "ft_training.py": (["--checkpoint-every", "0"], "--checkpoint-every"),
}


def test_every_example_has_a_bad_argument_case():
    examples = {p.name for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_")}
    assert examples == set(BAD_ARGUMENTS)


def test_log_every_0_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    """The reported case, through the whole command line (the `run()` wrapper every example shares)."""
    result = subprocess.run(
        [sys.executable, "examples/ddp_training.py", "--log-every", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=child_env(CLUSTER_RUN_DIR=str(tmp_path)),
        timeout=120,
    )
    assert_one_line_error(result, "--log-every", "at least 1", "'0'")
    assert result.stdout == "" and list(tmp_path.iterdir()) == []  # nothing ran


def test_ddp_training_refuses_its_plain_ddp_flags_in_a_replica_group(monkeypatch, capsys, tmp_path):
    """Under `fab run-ddp --replicas N` (NUM_REPLICA_GROUPS set) flags only plain DDP takes are one line,
    exit 2, before torchft starts."""
    from examples import ddp_training
    from node import contract

    monkeypatch.setenv(contract.REPLICAS_VARIABLE, "2")
    monkeypatch.setenv("CLUSTER_RUN_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        ddp_training.main(["--precision", "bf16", "--compile"])
    err = capsys.readouterr().err.strip()
    assert (
        exited.value.code == 2
        and err == "error: --precision, --compile train plain DDP only: leave them out with --replicas"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("example", sorted(BAD_ARGUMENTS))
def test_each_example_refuses_its_bad_argument_in_one_line(example, capsys):
    args, named = BAD_ARGUMENTS[example]
    module = importlib.import_module(f"examples.{example[:-3]}")
    with pytest.raises(SystemExit) as exited:
        module.parse_args(args)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exited.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines


@pytest.mark.parametrize("example", ["gradient_accumulation", "model_parallelism"])
def test_an_example_that_saves_synchronously_refuses_async_save(example, capsys):
    """It would be ignored: these save whole tensors (rank 0) or each stage's own layers, not with DCP."""
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"examples.{example}").parse_args(["--async-save"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exited.value.code == 2 and len(lines) == 1 and "--async-save" in lines[0], lines


@pytest.mark.parametrize(
    "check,good,bad",
    [
        (positive_int, {"1": 1, "40": 40}, ["0", "-1", "2.5", "ten", ""]),
        (non_negative_int, {"0": 0, "7": 7}, ["-1", "1e3", "x"]),
        (positive_float, {"0.5": 0.5, "300": 300.0, "1e-3": 1e-3}, ["0", "-2", "nan", "inf", "fast"]),
    ],
)
def test_argument_types_accept_what_they_mean_and_say_why_not(check, good, bad):
    for text, value in good.items():
        assert check(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            check(text)
        assert repr(text) in str(refused.value)


def test_results_go_to_the_results_dir_else_the_run_dir_else_a_folder_git_ignores_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert results_dir({}) == tmp_path / "results"  # plain torchrun in the checkout leaves it clean:
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/profile.json"], cwd=REPO)
    assert ignored.returncode == 0  # git ignores what lands there
    assert results_dir({"CLUSTER_RUN_DIR": "/runs/r1"}) == Path("/runs/r1")
    both = {"CLUSTER_RUN_DIR": str(tmp_path / "run"), "CLUSTER_RESULTS_DIR": str(tmp_path / "results")}
    assert results_dir(both) == tmp_path / "results"
    assert results_path(None, "profile.json", both) == tmp_path / "results" / "profile.json"
    assert results_path("plots/busbw.png", "x", both) == tmp_path / "results" / "plots" / "busbw.png"
    assert (tmp_path / "results" / "plots").is_dir()
    assert results_path(tmp_path / "elsewhere.json", "x", both) == tmp_path / "elsewhere.json"
