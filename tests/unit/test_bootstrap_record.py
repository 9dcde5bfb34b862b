"""bootstrap.json, one typed record (infra/state.py's BootstrapRecord): what bootstrap writes is what every
reader gets back, whether Slurm holds the runs is a field, and a stack never bootstrapped says so."""

import json

import pytest

from infra import state
from infra.errors import UsageError
from remote.job_spec import NodeSetup


def test_a_record_bootstrap_writes_reads_back_whole_and_the_file_keeps_its_keys(state_dir):
    record = state.BootstrapRecord(
        master_port=29600,
        python={"node-0": "/v/bin/python", "node-1": "/w/bin/python"},
        code_dir="$HOME/.gpu-cluster/code",
        slurm_holds=True,
        scheduler_choice="auto",
        accounting="auto",
        nodes={"node-0": {"probe": {"home": "/home/a"}, "deps": {}}, "node-1": {"probe": {"home": "/home/b"}}},
        completed_at="2026-11-28T08:00:00Z",
        timeline={"phases": [{"name": "probe", "s": 1.0}]},
    )
    record.write("local")
    assert state.bootstrap_record("local") == record
    written = json.loads(state.stack_file("local", state.BOOTSTRAP).read_text())
    assert (written["scheduler"], written["scheduler_choice"]) == ("slurm", "auto")  # the file's format as before
    state.BootstrapRecord(master_port=29600, python={"node-0": "p"}).write("local")
    assert json.loads(state.stack_file("local", state.BOOTSTRAP).read_text())["scheduler"] == ""
    assert record.homes == {"node-0": "/home/a", "node-1": "/home/b"}
    setup = NodeSetup.load("local")
    assert (setup.master_port, setup.slurm_holds, setup.homes) == (29600, False, {})


def test_a_stack_never_bootstrapped_or_with_a_broken_record_is_told_to_run_bootstrap(state_dir):
    assert state.bootstrap_record("local") == state.BootstrapRecord()
    assert not state.bootstrap_record("local").bootstrapped
    path = state.stack_file("local", state.BOOTSTRAP)
    for text in ("{not json", "[1, 2]", json.dumps({"master_port": 29500, "python": ["p"]})):
        state.write_atomic(path, text)
        assert state.bootstrap_record("local") == state.BootstrapRecord(), text
        with pytest.raises(UsageError, match="not bootstrapped: run fab bootstrap"):
            NodeSetup.load("local")


def test_a_record_an_earlier_bootstrap_wrote_still_loads(state_dir):
    earlier = {"master_port": 29500, "python": {"node-0": "python3"}, "nodes": {"node-0": {"probe": {"home": "/h"}}}}
    state.write_atomic(state.stack_file("local", state.BOOTSTRAP), json.dumps({**earlier, "gone_key": 1}))
    setup = NodeSetup.load("local")
    assert (setup.master_port, setup.python, setup.homes, setup.slurm_holds) == (
        29500,
        earlier["python"],
        {"node-0": "/h"},
        False,
    )
