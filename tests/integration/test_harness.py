"""The examples under real torchrun with gloo on CPU: each correctness claim of issue 4, checked (those a
fab launch shows as well, a restart resuming to the same parameters, the pipeline bubble, hello on two
nodes, are proven through fab in test_remote.py)."""

import json
import re
import subprocess

import pytest
import torch

from tests.support.examples import torchrun


def records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# ------------------------------------------------------------------------------------------ hello


def test_hello_fails_on_a_wrong_expectation():
    result = torchrun("distributed_hello.py", "--expect-world-size", "3")
    assert result.returncode != 0
    assert "MISMATCH on rank" in result.stdout and "expected 6" in result.stdout


# -------------------------------------------------------------------------------------------- DDP


def test_ddp_trains_in_bf16_the_loss_falls_parameters_stay_identical_and_steps_are_priced(tmp_path):
    # bf16 autocast on CPU; fp32 is what every fab launch test trains in. $3.60/h is $0.001 per second.
    result = ok(
        torchrun("ddp_training.py", "--steps", "60", "--precision", "bf16", run_dir=tmp_path, CLUSTER_HOURLY_USD="3.6")
    )
    summary = records(tmp_path, "summary")[0]
    assert summary["precision"] == "bf16" and summary["parameters_identical"] is True
    assert summary["last_loss"] < 0.8 * summary["first_loss"]
    assert "parameters identical on all 2 ranks" in result.stdout
    steps = records(tmp_path, "step")
    assert [s["step"] for s in steps] == [10, 20, 30, 40, 50, 60]
    header = next(line for line in result.stdout.splitlines() if "samples/s" in line)
    assert header.split() == ["step", "loss", "ms/step", "samples/s", "mem", "GiB", "$/h", "$", "so", "far"]
    assert summary["usd"] == pytest.approx(summary["elapsed_s"] * 0.001, rel=0.5)
    assert summary["usd_per_million_samples"] > 0
    assert all(step["hourly_usd"] == 3.6 for step in steps)


def test_a_crash_without_restarts_fails_the_job(tmp_path):
    result = torchrun(
        "ddp_training.py",
        "--steps",
        "20",
        "--checkpoint-every",
        "5",
        "--simulate-failure-at-step",
        "7",
        run_dir=tmp_path,
    )
    assert result.returncode == 1  # torchrun's own code for a failed worker group
    assert "rank 1: failing on purpose at step 7" in result.stdout
    # torchrun's failure report names the crashed rank with the exit code the crash chose (a misspelt
    # flag would show argparse's 2 on every rank instead), and the run never got to its summary.
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: 1 ", result.stderr), result.stderr[-2000:]
    assert "parameters identical" not in result.stdout


def test_the_transformer_learns_the_teacher_chain_in_fp16_with_activation_checkpointing(tmp_path):
    ok(
        torchrun(
            "ddp_training.py",
            "--model",
            "transformer",
            "--steps",
            "16",
            "--d-model",  # fp16 on a CPU is emulated: a narrow, short model keeps this under 10 CPU-s
            "64",
            "--seq-len",
            "32",
            "--activation-checkpointing",
            "--precision",
            "fp16",
            run_dir=tmp_path,
        )
    )
    summary = records(tmp_path, "summary")[0]
    assert summary["precision"] == "fp16" and summary["parameters_identical"]
    assert summary["last_loss"] < 0.5 * summary["first_loss"]


# ----------------------------------------------------------------------------------- accumulation


def test_the_accumulated_gradient_equals_the_full_batch_one_and_no_sync_all_reduces_once_not_k_times(tmp_path):
    checks = {}
    for mode, extra in (("no_sync", []), ("naive", ["--sync-every-micro-step"])):
        result = ok(
            torchrun("gradient_accumulation.py", "--check-gradient", "-k", "4", *extra, run_dir=tmp_path / mode)
        )
        assert "tolerance 1e-05" in result.stdout
        checks[mode] = records(tmp_path / mode, "gradient_check")[0]
        assert checks[mode]["ok"] and checks[mode]["max_abs_diff"] <= 1e-5
    # counted at run time by a hook around DDP's all-reduce: once per optimizer step, or once per micro-batch
    assert (checks["no_sync"]["synchronisations"], checks["naive"]["synchronisations"]) == (1, 4)
    assert checks["naive"]["allreduce_calls"] == 4 * checks["no_sync"]["allreduce_calls"] > 0


# --------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_staged_model_has_the_loss_and_gradients_of_the_unsplit_one(tmp_path, schedule):
    ok(torchrun("model_parallelism.py", "--check", "--schedule", schedule, "-m", "4", run_dir=tmp_path))
    check = records(tmp_path, "pipeline_check")[0]
    assert check["ok"] and check["loss_diff"] <= 1e-5 and check["grad_diff"] <= 1e-5


# ---------------------------------------------------------------------------------------- scaling


def test_scaling_efficiency_reports_every_size(tmp_path):
    result = ok(torchrun("scaling_efficiency.py", "--steps", "5", "--plot", str(tmp_path / "s.png"), run_dir=tmp_path))
    rows = json.loads((tmp_path / "scaling.json").read_text())["results"]
    assert [r["ranks"] for r in rows] == [1, 2]
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert all(r["step_s"] >= r["comm_s"] >= 0 for r in rows)
    assert "efficiency" in result.stdout and (tmp_path / "s.png").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ddp_on_gpus_uses_nccl_and_amp(tmp_path):
    precision = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp16"
    result = ok(
        torchrun(
            "ddp_training.py",
            "--steps",
            "20",
            "--precision",
            precision,
            nproc=torch.cuda.device_count(),
            run_dir=tmp_path,
        )
    )
    assert "(nccl)" in result.stdout
    assert records(tmp_path, "summary")[0]["parameters_identical"]
