"""End every job on this node: `python -c <this file> JOB_FILE GRACE_S [RUN_ID] [--leave-slurm]`; prints
`stopped RUN...` or `idle`. With RUN_ID, only that run's processes (a launch waiting its turn for the job
lock is a run of its own, and goes on); with --leave-slurm, none of a Slurm job (`scancel` ends those).

A job is the process group JOB_FILE records (the launch command, torchrun in it) and every process
whose environment carries a CLUSTER_RUN_ID and this node's HOME: torchrun's workers, which start
sessions of their own, the head node's job lock holder, and any job started beside the recorded one.
HOME keeps other nodes' jobs apart where several local nodes share one machine. Each gets SIGTERM,
then SIGKILL after GRACE_S. Sent by `fab stop` and by fail-fast; standard library only. Processes are
found in /proc; where there is none (macOS), only the recorded group is stopped.

Sent as source (the node's synced code may be stale or missing), it cannot import its siblings from a
folder: the sender inlines the `from node import ...` line's modules (node/standalone.py).
"""

import os
import signal
import sys
import time
from pathlib import Path

from node import contract, procfs

SLURM_JOB_VARIABLE = "SLURM_JOB_ID"
"""Slurm's own, in the environment of every process of a Slurm job: with `--leave-slurm`, Slurm's to cancel."""
LOCK_PROGRAM = "job_lock.py"
"""The job lock's holder and its waiters (node/job_lock.py): a launch being prepared, or waiting its turn."""


def recorded_job(job_file: Path) -> tuple[int, str] | None:
    """(pid, run id) of the job JOB_FILE records, if it still runs."""
    recorded = recorded_run(job_file)
    return recorded if recorded is not None and procfs.alive(recorded[0]) else None


def recorded_run(job_file: Path) -> tuple[int, str] | None:
    """(pid, run id) JOB_FILE records, whether or not that job still runs."""
    try:
        pid, run_id = job_file.read_text().split()[:2]
        return int(pid), run_id
    except (OSError, ValueError):
        return None


def job_processes(home: str, me: set[int], leave_slurm: bool = False) -> dict[int, str]:
    """pid -> run id of every process of a job with this HOME (none where /proc is missing); `leave_slurm`:
    not those of a Slurm job."""
    found = {}
    for pid, variables in procfs.environments(exclude=me):
        run_id = variables.get(contract.RUN_ID_VARIABLE)
        if run_id and variables.get("HOME") == home and not (leave_slurm and SLURM_JOB_VARIABLE in variables):
            found[pid] = run_id
    return found


def holds_lock(pid: int) -> bool:
    """Whether the process is the job lock's holder or one of its waiters."""
    return any(os.path.basename(word) == LOCK_PROGRAM for word in procfs.command_line(pid)[:3])


def signal_all(groups: list[int], pids: list[int], sig: int) -> None:
    for target, kill in [(g, os.killpg) for g in groups] + [(p, os.kill) for p in pids]:
        try:
            kill(target, sig)
        except OSError:  # already gone
            pass


def end(groups: list[int], pids: list[int], grace_s: float) -> None:
    """SIGTERM, then SIGKILL to what is left after `grace_s`."""
    signal_all(groups, pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(procfs.alive(p) for p in groups + pids):
        time.sleep(0.1)
    signal_all(groups, pids, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(procfs.alive(p) for p in pids):  # a lock goes with its process
        time.sleep(0.01)


def stop(job_file: Path, grace_s: float, home: str, only: str = "", leave_slurm: bool = False) -> list[str]:
    """Stop every job (`only`: that run's; `leave_slurm`: not Slurm's jobs, which `scancel` ends); the run ids
    stopped, in the order found.

    The job lock's holders and waiters go first, and are gone before the jobs are looked for: a launch whose
    holder is ended starts no job after (node/torchrun.py) and submits none (remote/scheduled.py), so every
    job it did start is found below. Such a run is named stopped unless JOB_FILE shows its job had run here
    and ended (its launch was fetching results)."""
    me = {os.getpid(), os.getppid()}
    ran = recorded_run(job_file)
    locks = {
        pid: run
        for pid, run in job_processes(home, me, leave_slurm).items()
        if (not only or run == only) and holds_lock(pid)
    }
    end([], list(locks), grace_s)
    job = recorded_job(job_file)
    if job is not None and ((only and job[1] != only) or (leave_slurm and _slurms(job[0]))):
        job = None
    strays = {pid: run for pid, run in job_processes(home, me, leave_slurm).items() if not only or run == only}
    groups = [job[0]] if job else []
    runs = list(dict.fromkeys(([job[1]] if job else []) + list(strays.values())))
    end(groups, list(strays), grace_s)
    for pid, run_id in job_processes(home, me, leave_slurm).items():  # started while we were stopping
        if not only or run_id == only:
            signal_all([], [pid], signal.SIGKILL)
            runs = list(dict.fromkeys(runs + [run_id]))
    if job is not None or (not only and not leave_slurm):
        job_file.unlink(missing_ok=True)
    ended_here = ran[1] if ran is not None and ran[1] not in runs else None
    return list(dict.fromkeys(runs + [run for run in locks.values() if run != ended_here]))


def _slurms(pid: int) -> bool:
    return SLURM_JOB_VARIABLE in (procfs.environment(pid) or {})


def main() -> None:
    args = [arg for arg in sys.argv[1:] if arg != "--leave-slurm"]
    only = args[2] if len(args) > 2 else ""
    home = os.environ.get("HOME", "")
    runs = stop(Path(os.path.expanduser(args[0])), float(args[1]), home, only, "--leave-slurm" in sys.argv)
    print("stopped " + " ".join(runs) if runs else "idle")


if __name__ == "__main__":
    main()
