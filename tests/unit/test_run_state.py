"""A run's states (node/run_state.py): Slurm's job states onto them, and which are final."""

import json

from node.run_state import RunState


def test_slurms_job_states_map_onto_a_runs_and_an_unknown_one_has_not_ended():
    assert RunState.from_slurm("REQUEUED") is RunState.PENDING
    assert RunState.from_slurm("COMPLETING") is RunState.RUNNING  # a slurmctld restart shows it for a while
    assert RunState.from_slurm("NODE_FAIL") is RunState.FAILED
    assert RunState.from_slurm("PREEMPTED") is RunState.PREEMPTED and not RunState.PREEMPTED.is_final  # requeued
    assert RunState.from_slurm("SOMETHING_NEW") is RunState.RUNNING
    assert {s for s in RunState if s.is_final} == {"COMPLETED", "FAILED", "CANCELLED", "HUNG"}


def test_a_state_reads_and_writes_as_its_name():
    assert json.dumps({"state": RunState.HUNG}) == '{"state": "HUNG"}'
    assert f"{RunState.FAILED} {RunState.FAILED:>8}" == "FAILED   FAILED" and str(RunState.FAILED) == "FAILED"
