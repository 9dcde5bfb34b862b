"""End every job on this node: `python -c <this file> JOB_FILE GRACE_S [RUN_ID]`; prints `stopped RUN...` or
`idle`. With RUN_ID, only that run's processes (a launch waiting its turn for the job lock is a run of
its own, and goes on).

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


def recorded_job(job_file: Path) -> tuple[int, str] | None:
    """(pid, run id) of the job JOB_FILE records, if it still runs."""
    try:
        pid, run_id = job_file.read_text().split()[:2]
        return (int(pid), run_id) if procfs.alive(int(pid)) else None
    except (OSError, ValueError):
        return None


def job_processes(home: str, me: set[int]) -> dict[int, str]:
    """pid -> run id of every process of a job with this HOME (none where /proc is missing)."""
    found = {}
    for pid, variables in procfs.environments(exclude=me):
        run_id = variables.get(contract.RUN_ID_VARIABLE)
        if run_id and variables.get("HOME") == home:
            found[pid] = run_id
    return found


def signal_all(groups: list[int], pids: list[int], sig: int) -> None:
    for target, kill in [(g, os.killpg) for g in groups] + [(p, os.kill) for p in pids]:
        try:
            kill(target, sig)
        except OSError:  # already gone
            pass


def stop(job_file: Path, grace_s: float, home: str, only: str = "") -> list[str]:
    """Stop every job (`only`: that run's); the run ids stopped, in the order found."""
    me = {os.getpid(), os.getppid()}
    job = recorded_job(job_file)
    job = job if job is None or not only or job[1] == only else None
    strays = {pid: run for pid, run in job_processes(home, me).items() if not only or run == only}
    groups = [job[0]] if job else []
    runs = list(dict.fromkeys(([job[1]] if job else []) + list(strays.values())))
    signal_all(groups, list(strays), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(procfs.alive(p) for p in groups + list(strays)):
        time.sleep(0.1)
    signal_all(groups, list(strays), signal.SIGKILL)
    for pid, run_id in job_processes(home, me).items():  # started while we were stopping
        if not only or run_id == only:
            signal_all([], [pid], signal.SIGKILL)
            runs = list(dict.fromkeys(runs + [run_id]))
    if job is not None or not only:
        job_file.unlink(missing_ok=True)
    return runs


def main() -> None:
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    runs = stop(Path(os.path.expanduser(sys.argv[1])), float(sys.argv[2]), os.environ.get("HOME", ""), only)
    print("stopped " + " ".join(runs) if runs else "idle")


if __name__ == "__main__":
    main()
