"""node/slurm_exit.py: a Slurm-held run's exit code is its first failed node's, as srun said it."""

from node import slurm_exit

KILLED_BY_THE_FAILURE = (
    b"[node-0] step 3\n"
    b"srun: error: node-1: task 1: Exited with exit code 3\n"
    b"srun: launch/slurm: _step_signal: Terminating StepId=1.0\n"
    b"slurmstepd-node-0: error: *** STEP 1.0 ON node-0 CANCELLED AT 2026-11-28T05:03:00 ***\n"
    b"srun: error: node-0: task 0: Exited with exit code 143\n"
)


def test_the_first_task_srun_says_failed_gives_the_code_and_a_signal_its_shell_code():
    assert slurm_exit.first_failure(KILLED_BY_THE_FAILURE) == 3
    assert slurm_exit.first_failure(b"srun: error: node-0: task 0: Killed\n") == 137
    assert slurm_exit.first_failure(b"srun: error: node-[0-1]: tasks 0-1: Segmentation fault (core dumped)\n") == 139
    assert slurm_exit.first_failure(b"[node-0] srun: error: node-0: task 0: Exited with exit code 5\n") is None


def test_the_run_code_reads_only_what_the_step_wrote_and_keeps_srun_s_where_srun_said_nothing(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"srun: error: node-0: task 0: Exited with exit code 7\n")  # an earlier start's
    offset = slurm_exit.log_size(str(log))
    with log.open("ab") as f:
        f.write(KILLED_BY_THE_FAILURE)

    assert slurm_exit.run_code(str(log), offset, 143) == 3
    assert slurm_exit.run_code(str(log), log.stat().st_size, 143) == 143  # cancelled: srun is quiet
    assert slurm_exit.run_code(str(log), 0, 0) == 0
