"""`fab` refuses bad input as one `error:` line with exit 2, before it touches anything (no cluster needed)."""

import json

import pytest

from tests.support.cli import assert_one_line_error, run_fab
from tests.support.inventories import files_under, unreachable_stack


@pytest.mark.parametrize(
    "argv,words",
    [
        (["no-such-task"], ["no-such-task", "fab --list"]),
        (["hello", "--bogus"], ["--bogus", "fab --help TASK"]),
        (["logs", "--lines"], ["--lines needs a value"]),
        (["run"], ["--script PATH"]),
        (["hello", "--max-restarts", "abc"], ["--max-restarts", "'abc'", "from 0 to 1000"]),
        (["run-ddp", "--max-restarts", "-1"], ["--max-restarts", "-1"]),
        (["bootstrap", "--master-port", "70000"], ["--master-port", "1024 to 65535"]),
        (["bootstrap", "--master-port", "abc"], ["--master-port", "'abc'"]),
        (["logs", "--lines", "-5"], ["--lines", "-5"]),
        (["logs", "--run", "../.."], ["--run", "'../..'"]),
        (["hello", "--args", '"unterminated'], ["--args", "No closing quotation"]),
        (["logs", "--stack", "../x"], ["bad stack name"]),
        (["run", "--workdir", "/no/such/folder", "--script", "x.py"], ["no such folder", "/no/such/folder"]),
        (["run", "--script", "x.py", "--env", "RANK=1"], ["--env RANK", "pick another name"]),
        (["run", "--script", "x.py", "--env", "GREETING"], ["'GREETING' is not KEY=VALUE"]),
        (["run", "--script", "x.py", "--max-sync-mb", "5"], ["--max-sync-mb", "--workdir"]),
        (["run", "--script", "x.py", "--max-result-mb", "0"], ["--max-result-mb", ">= 1"]),
        (["run", "--script", "x.py", "--requirements", "/no/such.txt"], ["no such requirements file"]),
        (["run-ddp", "--hang-timeout", "soon"], ["--hang-timeout", "seconds >= 0", "'soon'"]),
        (["hello", "--hang-timeout", "-3"], ["--hang-timeout", "'-3'"]),
        (["hello", "--on-hang", "panic"], ["--on-hang", "stop or wait", "'panic'"]),
        (["run-ddp", "--on-straggler", "evict"], ["--on-straggler", "report or replace", "'evict'"]),
        (
            ["run-ddp", "--on-straggler", "replace", "--hang-timeout", "0"],
            ["--on-straggler replace", "--hang-timeout 0"],
        ),
        (
            ["run", "--script", "examples/ft_training.py", "--replicas", "2", "--on-straggler", "replace"],
            ["--replicas", "--on-straggler"],
        ),
        (["run-ddp", "--on-straggler", "replace"], ["--on-straggler replace needs a run held by Slurm"]),
        (
            ["run-ddp", "--replicas", "2", "--args", "--precision bf16 --compile"],
            ["--args --compile --precision", "run-ddp --replicas", "torchft replica groups"],
        ),
        (["run-ddp", "--replicas", "2", "--args", "--prec=fp16"], ["--args --precision"]),
        (["run-ddp", "--replicas", "2", "--args", "--steps 3 --simulate-failure-at-step 2"], ["--simulate-failure"]),
        (["run-ddp", "--preflight", "--skip-preflight"], ["--preflight", "--skip-preflight", "give one"]),
        (["run", "--script", "x.py", "--env"], ["--env needs a value"]),
        (["run", "--script", "x.py", "--env", "A=1", "--env"], ["--env needs a value"]),
        (["run", "--script", "x.py", "--workdir", ""], ["--workdir ''", "--workdir ."]),
        (["hello", "--nproc-per-node", "1000000000"], ["--nproc-per-node", "from 1 to 256", "1000000000"]),
        (["hello", "--nproc-per-node", " 2"], ["--nproc-per-node", "' 2'"]),
        (["hello", "--max-restarts", "1_0"], ["--max-restarts", "'1_0'"]),
        (["hello", "--on-hang", "stop\n"], ["--on-hang", "'stop\\n'"]),
        (["hello", "--hang-timeout", "30\n"], ["--hang-timeout", "'30\\n'"]),
        (["hello", "--hang-timeout", "9" * 400], ["--hang-timeout", "seconds >= 0"]),
        (["run", "--script", "fabfile.py", "--env-file", "/no/such.env"], ["no such env file", "/no/such.env"]),
        (
            ["run", "--script", "fabfile.py", "--env-file", "fabfile.py"],
            ["--env-file fabfile.py line 1 is not KEY=VALUE"],
        ),
        (["run", "--script", "fabfile.py", "--env-file", "/dev/zero"], ["--env-file /dev/zero is not a regular file"]),
        (["logs", "--node", ""], ["--node must name a node as node-1 or 1, not ''"]),
        (["hello", "--args", "x" * 130_000], ["--args", "130,00", "limit of 65,536"]),
        (["run", "--script", "fabfile.py", "--env", "BIG=" + "x" * 130_000], ["--env", "limit of 65,536"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2_and_creates_nothing(state_dir, argv, words):
    """With a current stack that looks bootstrapped: input that got past its check would go on to
    connect, make a run folder or write the ledger."""
    unreachable_stack(state_dir)
    before = files_under(state_dir)
    assert_one_line_error(run_fab(*argv), *words)
    assert files_under(state_dir) == before


def test_on_straggler_replace_on_a_stack_that_replaces_no_node_is_refused(state_dir):
    unreachable_stack(state_dir)  # a local stack started without --spot, its runs held by Slurm
    record = state_dir / "local" / "bootstrap.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "scheduler": "slurm"}))
    before = files_under(state_dir)
    assert_one_line_error(
        run_fab("run-ddp", "--on-straggler", "replace"),
        "--on-straggler replace needs a stack whose nodes are replaced",
        "without --spot",
        "up --local --spot",
    )
    assert files_under(state_dir) == before


def test_a_script_that_does_not_compile_is_refused_naming_the_file_and_line(state_dir, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\n\ndef main(:\n    pass\n")
    assert_one_line_error(run_fab("run", "--script", str(script)), "does not compile", f"{script}, line 3")
    assert not state_dir.exists()
    assert not (tmp_path / "__pycache__").exists()  # checked without writing bytecode beside it


def test_logs_of_a_run_with_a_damaged_summary_are_shown_and_the_damage_named(state_dir):
    run_dir = state_dir / "local" / "runs" / "20260101-000000-hello-ab12"
    run_dir.mkdir(parents=True)
    (run_dir / "node-0.log").write_text("first\nlast words\n")
    (run_dir / "summary.json").write_text('{"exit_codes": {"node-0": 1}, "duration_s": ')
    result = run_fab("logs", "--stack", "local", "--lines", "1")
    assert result.returncode == 0, result.stderr
    assert "[node-0] last words" in result.stdout and "[node-0] first" not in result.stdout
    assert "summary.json is damaged" in result.stdout and not result.stderr


@pytest.mark.parametrize(
    "script,words",
    [
        ("train.py", ["does not compile", "train.py, line 2"]),
        ("../outside.py", ["outside --workdir"]),
        ("pkg", ["is a folder"]),
    ],
)
def test_a_workdir_script_is_checked_before_anything_is_created(state_dir, tmp_path, script, words):
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "train.py").write_text("import torch\ndef main(:\n")
    (tmp_path / "outside.py").write_text("print('hi')\n")
    assert_one_line_error(run_fab("run", "--workdir", str(project), "--script", script), *words)
    assert not state_dir.exists()
