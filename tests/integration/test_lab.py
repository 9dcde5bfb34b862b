"""The parallelism lab under real torchrun with gloo (`fab hybrid` on 2 local nodes: test_remote.py).

Models are tiny (one block of width 32) so that each run is a few seconds of work; what is proven is
the same at any size: every `--check` against its reference on 2 and on 4 ranks (tensor parallelism over 4
through hybrid's dp(1) x tp(4)), a checkpoint saved
on 4 ranks resumed on 2 with equal parameters, and the strategy table's figures.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env
from tests.support.examples import TINY, torchrun

CHECK_LINE = re.compile(r"^check: .+ max diff \S+ \(tolerance \S+\) ok$")


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def summary(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "summary"][-1]


CHECKS = {
    "gradient_compression.py": ["--steps", "4"],
    "fsdp_training.py": ["--steps", "2", "--zero", "2"],
    "tensor_parallel.py": [],
    "hybrid_parallel.py": ["--steps", "2", "--tp", "2"],
}


@pytest.mark.parametrize(
    ("example", "nproc"),
    # hybrid's check on 4 ranks (dp 2 x tp 2) is test_the_hybrid_check_holds_on_its_default_model's, on its
    # default model: the same layout and line, one torchrun of 4 ranks fewer; so is tensor parallelism over 4
    # ranks (its dp(1) x tp(4) is tensor_parallel.py's split_blocks over 4 ranks, trained against the unsplit
    # model), while tensor_parallel.py's own check runs here on 2: another torchrun of 4 ranks fewer
    [
        (example, nproc)
        for example in sorted(CHECKS)
        for nproc in (2, 4)
        if (example, nproc) not in (("hybrid_parallel.py", 4), ("tensor_parallel.py", 4))
    ],
)
def test_each_check_prints_one_ok_line(example, nproc, tmp_path):
    result = ok(torchrun(example, "--check", *TINY, *CHECKS[example], nproc=nproc, run_dir=tmp_path))
    assert CHECK_LINE.match(result.stdout.strip()), result.stdout


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]])
def test_the_hybrid_check_holds_on_its_default_model(layout, tmp_path):
    """The default model (not TINY) on 4 ranks, dp(1) x tp(4) and dp(2) x tp(2), in float64: the layout's
    sums in another order agree with one process far inside the tolerance, on any CPU."""
    result = ok(torchrun("hybrid_parallel.py", "--check", "--steps", "2", *layout, nproc=4, run_dir=tmp_path))
    assert CHECK_LINE.match(result.stdout.strip()), result.stdout
    worst = float(re.search(r"max diff (\S+) ", result.stdout).group(1))
    tolerance = float(re.search(r"\(tolerance (\S+)\)", result.stdout).group(1))
    assert worst < tolerance / 1000, result.stdout  # rounding only: the check's margin is not spent by the CPU


def test_the_hybrid_check_fails_a_wrong_split(tmp_path):
    """The same check with the data split broken on purpose (every replica trains on the first replica's
    slice of the global batch) says FAIL and exits 1: it tells a wrong split from rounding."""
    broken = tmp_path / "broken_split.py"
    broken.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from harness.parallel import Batches\n"
        "from examples import hybrid_parallel\n"
        "whole = Batches.replica_batch\n"
        "Batches.replica_batch = lambda self, step, replica, replicas, device: whole(self, step, 0, replicas, device)\n"
        "hybrid_parallel.run(hybrid_parallel.main)\n"
    )
    result = torchrun(str(broken), "--check", *TINY, "--steps", "2", "--dp", "2", "--tp", "1", nproc=2)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert re.match(r"^check: dp\(2\) x tp\(1\) .+ FAIL$", result.stdout.strip()), result.stdout


def test_a_check_that_does_not_hold_says_fail_and_exits_1():
    # A rank-16 approximation of 32-wide matrices is no smaller than they are: PowerSGD sends them
    # whole. (One process, started without torchrun, is a world of one: DDP and its hooks still run.)
    result = subprocess.run(
        [sys.executable, "examples/gradient_compression.py", "--check", *TINY, "--steps", "4", "--rank", "16"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.match(r"^check: .+ 1\.\dx fewer bytes .+ FAIL$", result.stdout.strip()), result.stdout


def test_fsdp_holds_a_quarter_on_4_ranks_and_its_committed_checkpoint_resumes_on_2(tmp_path):
    checkpoints = tmp_path / "ckpt"
    saved = ok(
        torchrun(
            "fsdp_training.py",
            *TINY,
            "--steps",
            "3",
            "--checkpoint-dir",
            str(checkpoints),
            "--async-save",
            nproc=4,
            run_dir=tmp_path / "four",
        )
    )
    four = summary(tmp_path / "four")
    state = ("parameters_bytes", "gradients_bytes", "optimizer_bytes")
    whole = sum(four["ddp_memory"][k] for k in state)
    for rank in four["memory_per_rank"]:
        assert sum(rank[k] for k in state) <= whole / 4 * 1.1, (rank, whole)
    assert (checkpoints / "step-00000003" / "COMMITTED").is_file()
    interrupted = checkpoints / "step-00000009"  # a later save cut short: shards, no commit marker
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"half a shard")
    resumed = ok(
        torchrun(
            "fsdp_training.py",
            *TINY,
            "--steps",
            "3",
            "--checkpoint-dir",
            str(checkpoints),
            nproc=2,
            run_dir=tmp_path / "two",
        )
    )
    assert "resumed from step 3" in resumed.stdout and "saved by 4 ranks, loaded onto 2" in resumed.stdout
    assert summary(tmp_path / "two")["parameter_digest"] == four["parameter_digest"]
    assert "parameters sha256" in saved.stdout


def test_the_strategy_table_measures_every_strategy(tmp_path):
    result = ok(torchrun("compare_strategies.py", *TINY, "--steps", "1", nproc=4, run_dir=tmp_path))
    report = json.loads((tmp_path / "strategies.json").read_text())
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert list(rows) == ["ddp", "ddp-powersgd", "fsdp-zero2", "fsdp-zero3", "tp", "hybrid dp(2) x tp(2)"]
    memory = {name: r["memory"] for name, r in rows.items()}
    sent = {name: r["sent_bytes_per_step"] for name, r in rows.items()}
    assert memory["fsdp-zero3"]["optimizer_bytes"] <= memory["ddp"]["optimizer_bytes"] / 4 * 1.1
    assert memory["fsdp-zero2"]["gathered_bytes"] > 0 == memory["fsdp-zero3"]["gathered_bytes"]
    assert sent["ddp-powersgd"] < sent["ddp"] / 4
    assert sent["fsdp-zero3"] == pytest.approx(1.5 * sent["fsdp-zero2"], rel=0.1)  # weights gathered twice
    assert all(r["estimate_bytes"] > 0 and r["ms_per_step"] > 0 for r in rows.values())
    assert "course estimate" in result.stdout and "fsdp-zero3" in result.stdout
    assert (tmp_path / "strategies.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "script,args,words",
    [
        ("hybrid_parallel.py", ["--dp", "2", "--tp", "2"], ["dp(2) x tp(2) = 4 != WORLD_SIZE(1)"]),
        ("gradient_compression.py", ["--hook", "bf16"], ["--hook bf16 needs NCCL", "gloo"]),
    ],
)
def test_a_job_that_cannot_run_here_is_refused_in_one_line(script, args, words):
    result = subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(result, *words)


# -------------------------------------------------------------------- fab, 2 nodes x 2 processes


# ---------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bf16_hook_halves_the_bytes_on_nccl(tmp_path):
    ok(
        torchrun(
            "gradient_compression.py",
            *TINY,
            "--hook",
            "bf16",
            "--steps",
            "4",
            nproc=torch.cuda.device_count(),
            run_dir=tmp_path,
        )
    )
    runs = {r["hook"]: r for r in summary(tmp_path)["runs"]}
    assert runs["bf16"]["size_bytes"] * 2 == runs["none"]["size_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_strategy_table_reports_peak_cuda_memory(tmp_path):
    ok(
        torchrun(
            "compare_strategies.py",
            *TINY,
            "--steps",
            "1",
            "--strategies",
            "ddp,fsdp-zero3",
            nproc=torch.cuda.device_count(),
            run_dir=tmp_path,
        )
    )
    rows = json.loads((tmp_path / "strategies.json").read_text())["strategies"]
    assert all(r["peak_cuda_bytes"] >= r["memory"]["parameters_bytes"] for r in rows)


@pytest.mark.parametrize(
    "example, model",
    [
        ("fsdp_training.py", TINY),  # sharded (DCP); hybrid_parallel and tensor_parallel share its loop's ending
        ("gradient_accumulation.py", ["--hidden", "32", "--micro-batch-size", "4"]),  # DDP: rank 0 saves
        ("model_parallelism.py", ["--width", "16", "--batch-size", "16", "--micro-batches", "2"]),  # each stage
    ],
)
def test_on_sigusr1_every_rank_stops_at_one_step_saves_it_and_the_next_start_resumes_there(example, model, tmp_path):
    """The spot notice's contract (harness/preemption.py): one rank gets SIGUSR1, every rank stops at the
    same step boundary, the checkpoint of that step is saved (sharded, rank 0's of DDP's whole tensors,
    or each pipeline stage's own), and a restart resumes from it."""
    env = child_env(CLUSTER_RUN_DIR=str(tmp_path))  # unbuffered already
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = [f"examples/{example}", *model, "--checkpoint-every", "100000", "--log-every", "1"]
    job = subprocess.Popen(
        [*command, *args, "--steps", "100000"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        seen = b""
        while not re.search(rb"^\s+2\s+\d", seen, re.M):  # a step line: the loop runs
            chunk = job.stdout.read1(65536)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        os.kill(_rank_pid(tmp_path, "1"), signal.SIGUSR1)  # the last rank only, as on a reclaimed node
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    text = (seen + out).decode(errors="replace")
    assert job.returncode == 0, text
    stopped = re.search(r"preempted \(SIGUSR1\) at step (\d+): checkpoint at step \1 saved in ", text)
    assert stopped, text
    step = int(stopped.group(1))
    resumed = ok(torchrun(example, *model, "--steps", str(step + 1), run_dir=tmp_path))
    assert f"resumed from step {step} " in resumed.stdout, resumed.stdout


def _rank_pid(run_dir, rank: str) -> int:
    """The pid of the example's rank `rank` started for `run_dir` (found in /proc by its environment)."""
    wanted = {f"CLUSTER_RUN_DIR={run_dir}".encode(), f"RANK={rank}".encode()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted <= set(environ.read_bytes().split(b"\0")):
                return int(environ.parent.name)
        except OSError:
            continue
    raise AssertionError(f"no rank {rank} running for {run_dir}")
