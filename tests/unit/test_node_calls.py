"""node/calls.py, the one typed node call, run for real as fab runs it: `python node/calls.py REQUEST` in
the node user's home, its reply read back by the caller's side of the same module."""

import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from infra.errors import NodeCallError, OperationError, UsageError
from node import calls
from remote import nodecall
from tests.support import REPO, inventories

CALLS = REPO / "node" / "calls.py"


def ask(request: calls.Request, home, version: str | None = None):
    words = calls.command_words(request, version or calls.code_version())
    result = subprocess.run([sys.executable, str(CALLS), *words], capture_output=True, text=True, cwd=home, timeout=60)
    return calls.reply_from(request, result.returncode, result.stdout, result.stderr), result


def test_a_request_gets_its_typed_reply(tmp_path):
    runs = tmp_path / ".gpu-cluster" / "runs"
    for run_id, size in (("20260101-000000-a", 5), ("20260102-000000-b", 7)):
        (runs / run_id / "workdir").mkdir(parents=True)
        (runs / run_id / "workdir" / "f").write_bytes(b"x" * size)
    reply, _ = ask(calls.CleanRuns(".gpu-cluster/runs", 1), tmp_path)
    assert reply == calls.Cleaned(removed=1, runs=2, freed_bytes=5)
    assert not (runs / "20260101-000000-a").exists() and (runs / "20260102-000000-b" / "workdir" / "f").exists()


@pytest.mark.parametrize(
    ("words", "exit_code", "says"),
    [
        (["not base64 at all"], 2, "not one fab sends"),
        ([], 2, "usage"),
    ],
)
def test_a_request_that_is_not_one_is_one_line_and_exit_2(tmp_path, words, exit_code, says):
    result = subprocess.run([sys.executable, str(CALLS), *words], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == exit_code and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and says in result.stderr and result.stdout == ""


def test_other_node_code_is_refused_naming_bootstrap(tmp_path):
    with pytest.raises(calls.CallError) as refused:
        ask(calls.CleanRuns(".gpu-cluster/runs", 1), tmp_path, version="0123456789abcdef")
    assert refused.value.bad_input and "run fab bootstrap" in refused.value.line


def test_a_failure_of_the_work_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "cache").mkdir()
    with pytest.raises(calls.CallError) as failed:  # no such bundle: the work fails, the request was fine
        ask(calls.ApplyBundle("cache", "no-such-bundle.tar.gz"), tmp_path)
    assert (
        failed.value.exit_code == 1 and "no-such-bundle.tar.gz" in failed.value.line and "\n" not in failed.value.line
    )


def test_the_version_is_the_node_codes_and_changes_with_it(tmp_path):
    copy = tmp_path / "node"
    shutil.copytree(REPO / "node", copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert calls.code_version(str(copy)) == calls.code_version()  # what bootstrap sends is what fab speaks
    (copy / "sync.py").write_text((copy / "sync.py").read_text() + "\n# changed\n")
    assert calls.code_version(str(copy)) != calls.code_version()


def test_a_request_with_a_secret_goes_on_stdin_never_on_the_command_line(tmp_path):
    request = calls.SubmitRun({"run_id": "r", "nodes": [{"command": "env TOKEN=s3cret python train.py"}]})
    words = ["-"] if request.SECRET else calls.command_words(request, calls.code_version())
    assert words == ["-"] and "s3cret" not in " ".join(words)
    result = subprocess.run(  # the dispatcher reads it from stdin (it fails later: no Slurm here)
        [sys.executable, str(CALLS), "-"],
        input=calls.encoded(request, calls.code_version()),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode in (1, 2) and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "not one fab sends" not in result.stderr  # read and understood; the work itself failed


def test_every_verb_names_a_node_function_that_takes_its_fields_and_the_probe_answers_through_it(tmp_path):
    import dataclasses
    import importlib
    import inspect

    verbs = [v for v in vars(calls).values() if isinstance(v, type) and issubclass(v, calls.Request)]
    for verb in (v for v in verbs if v is not calls.Request):
        module, function = verb.HANDLER.split(":")
        handler = getattr(importlib.import_module(f"node.{module}"), function)
        inspect.signature(handler).bind(**{f.name: None for f in dataclasses.fields(verb)})  # raises if they differ
    reply, _ = ask(calls.ProbeNode("127.0.0.1"), tmp_path)
    assert reply.facts["interface"] == "lo" and reply.facts["home"]


@pytest.mark.parametrize(("exit_code", "kind"), [(2, UsageError), (1, OperationError)])
def test_fabs_side_raises_one_typed_error_naming_the_node_the_verb_the_code_and_the_line(exit_code, kind):
    known = inventories.cluster()
    said = "error: this node runs other node code (a) than fab speaks (b): run fab bootstrap"

    class Session:  # a node whose answer is one error line
        node, cluster = known.nodes[0], known

        def run(self, command, **options):
            return SimpleNamespace(exited=exit_code, stdout="", stderr=f"Traceback...\n{said}\n")

    with pytest.raises(NodeCallError) as raised:
        nodecall.call(Session(), "python3", calls.CleanRuns(".gpu-cluster/runs", 1))  # type: ignore[arg-type]
    error = raised.value
    assert (error.node, error.verb, error.exit_code) == (known.nodes[0].name, "CleanRuns", exit_code)
    assert error.line == said.removeprefix("error: ") and str(error) == f"{error.node}: {error.line}"
    assert isinstance(error, kind)  # the command's exit code: 2 for a refusal, 1 for a failure


def test_a_handlers_refusal_is_exit_2_naming_what_is_wrong(tmp_path):
    # the dispatcher runs as a file: a refusal the handler raised (node.calls.BadInput) was once taken for
    # a failure (exit 1), the file's own BadInput being another class
    request = calls.SubmitRun({"run_id": "r", "nodes": [{"name": "node-0", "home": "/h", "command": "true"}]})
    result = subprocess.run(
        [sys.executable, str(CALLS), "-"],
        input=calls.encoded(request, calls.code_version()),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert (result.returncode, result.stderr) == (2, "error: run spec: missing key 'log'\n")
