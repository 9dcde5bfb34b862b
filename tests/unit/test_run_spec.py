"""A Slurm-held run's spec (node/run_spec.py): what fab writes is what the batch job and every step read
back, and a spec that does not fit says which key, once, before anything runs."""

import base64
import json
import subprocess
import sys

import pytest

from node.run_spec import RunSpec, SpecError, SpecNode, WatchSpec
from tests.support import REPO


def full_spec() -> RunSpec:
    return RunSpec(
        run_id="run-1",
        log="/home/u/.gpu-cluster/runs/run-1/output.log",
        python="/usr/bin/python3",
        nodes=(SpecNode("node-0", "/home/u", "echo 0", slurm_name="gpu-a"), SpecNode("node-1", "/home/v", "echo 1")),
        watch=WatchSpec(
            timeout_s=30,
            poll_s=2.5,
            on_hang="wait",
            on_straggler="replace",
            overdue_grace_s=30,
            shared_dir="/shared",
            status={"node-0": "s0", "node-1": "s1"},
            collect={"node-0": "c0", "node-1": "c1"},
            tell_ranks={"node-0": "t0", "node-1": "t1"},
        ),
        replicas=2,
    )


def test_a_spec_reads_back_as_it_was_written_through_a_dict_and_through_a_command_line():
    spec = full_spec()
    assert RunSpec.from_dict(spec.as_dict()) == spec
    assert RunSpec.decoded(spec.encoded()) == spec
    plain = spec.replace(watch=None, replicas=0)
    assert set(plain.as_dict()) == {"run_id", "log", "python", "nodes"}  # what fab sent before the spec was typed
    assert RunSpec.from_dict(plain.as_dict()) == plain
    assert spec.folder == "/home/u/.gpu-cluster/runs/run-1"
    assert [n.in_slurm for n in spec.nodes] == ["gpu-a", "node-1"]


def test_a_watch_spec_fab_wrote_without_a_shared_folder_reads_as_none():
    data = {**full_spec().as_dict(), "watch": {"timeout_s": 5, "poll_s": 1, "shared_dir": None}}
    watch = RunSpec.from_dict(data).watch
    assert watch == WatchSpec(timeout_s=5, poll_s=1)
    assert watch.shared_dir == "" and watch.overdue_grace_s is None and watch.tell_ranks == {}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d.pop("log"), "run spec: missing key 'log'"),
        (lambda d: d.update(logs="x"), "run spec: unknown key 'logs'"),
        (lambda d: d["nodes"][1].pop("home"), "run spec: nodes[]: missing key 'home'"),
        (lambda d: d["nodes"][0].update(command=["echo"]), "run spec: nodes[]: 'command' is not a string"),
        (lambda d: d.update(nodes=[]), "run spec: 'nodes' is not a list of nodes"),
        (lambda d: d["watch"].pop("poll_s"), "run spec: watch: missing key 'poll_s'"),
        (lambda d: d["watch"].update(timeout="5"), "run spec: watch: unknown key 'timeout'"),
        (lambda d: d["watch"].update(timeout_s="5"), "run spec: watch: 'timeout_s': not a number"),
        (lambda d: d["watch"].update(status={"node-0": 1}), "run spec: watch: 'status': not a {node: command} object"),
        (lambda d: d.update(replicas="2"), "run spec: 'replicas' is not a count"),
    ],
)
def test_a_spec_that_does_not_fit_names_its_key(change, said):
    data = full_spec().as_dict()
    change(data)
    with pytest.raises(SpecError) as raised:
        RunSpec.from_dict(data)
    assert str(raised.value) == said


@pytest.mark.parametrize(("script", "verb"), [("slurm_step.py", "step"), ("slurm_batch.py", "supervise")])
def test_a_node_script_given_a_bad_spec_says_which_key_in_one_line_and_exits_2(script, verb):
    broken = full_spec().as_dict()
    del broken["python"]
    argv = [sys.executable, str(REPO / "node" / script), base64.b64encode(json.dumps(broken).encode()).decode()]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {verb}: run spec: missing key 'python'"]
