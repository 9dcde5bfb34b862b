"""End every job on this node: `python -c <this file> JOB_FILE GRACE_S`; prints `stopped RUN...` or `idle`.

A job is the process group JOB_FILE records (the launch command, torchrun in it) and every process
whose environment carries a CLUSTER_RUN_ID and this node's HOME: torchrun's workers, which start
sessions of their own, the head node's job lock holder, and any job started beside the recorded one.
HOME keeps other nodes' jobs apart where several local nodes share one machine. Each gets SIGTERM,
then SIGKILL after GRACE_S. Sent by `fab stop` and by fail-fast; standard library only. Processes are
found in /proc; where there is none (macOS), only the recorded group is stopped.
"""

import os
import signal
import sys
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    if os.path.isdir("/proc/self"):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:  # no /proc (macOS): ask the kernel
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def recorded_job(job_file: Path) -> tuple[int, str] | None:
    """(pid, run id) of the job JOB_FILE records, if it still runs."""
    try:
        pid, run_id = job_file.read_text().split()[:2]
        return (int(pid), run_id) if alive(int(pid)) else None
    except (OSError, ValueError):
        return None


def job_processes(home: str, me: set[int]) -> dict[int, str]:
    """pid -> run id of every process of a job with this HOME (none where /proc is missing)."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        if pid in me:
            continue
        try:
            variables = dict(v.split(b"=", 1) for v in environ.read_bytes().split(b"\0") if b"=" in v)
        except OSError:  # gone, or another user's
            continue
        run_id = variables.get(b"CLUSTER_RUN_ID")
        if run_id and variables.get(b"HOME") == home.encode() and alive(pid):
            found[pid] = run_id.decode(errors="replace")
    return found


def signal_all(groups: list[int], pids: list[int], sig: int) -> None:
    for target, kill in [(g, os.killpg) for g in groups] + [(p, os.kill) for p in pids]:
        try:
            kill(target, sig)
        except OSError:  # already gone
            pass


def stop(job_file: Path, grace_s: float, home: str) -> list[str]:
    """Stop every job; the run ids stopped, in the order found."""
    me = {os.getpid(), os.getppid()}
    job = recorded_job(job_file)
    strays = job_processes(home, me)
    groups = [job[0]] if job else []
    runs = list(dict.fromkeys(([job[1]] if job else []) + list(strays.values())))
    signal_all(groups, list(strays), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in groups + list(strays)):
        time.sleep(0.1)
    signal_all(groups, list(strays), signal.SIGKILL)
    for pid, run_id in job_processes(home, me).items():  # started while we were stopping
        signal_all([], [pid], signal.SIGKILL)
        runs = list(dict.fromkeys(runs + [run_id]))
    job_file.unlink(missing_ok=True)
    return runs


def main() -> None:
    runs = stop(Path(os.path.expanduser(sys.argv[1])), float(sys.argv[2]), os.environ.get("HOME", ""))
    print("stopped " + " ".join(runs) if runs else "idle")


if __name__ == "__main__":
    main()
