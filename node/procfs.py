"""Processes as /proc shows them: alive or not, their state, their environment, their arguments.

The one place that reads /proc: the node scripts (hang.py, stop_jobs.py, cleanup.py), the head node's
watchdog, the ledger and the local node servers all ask here. A zombie (exited, not yet reaped) counts
as gone everywhere. Where there is no /proc (macOS) the kernel is asked (`kill(pid, 0)`) and the scans
find nothing. A non-root user reads only its own processes' environments, which is enough: every job
runs as the node's login user.

Standard library only, and written for Python 3.7 syntax: cleanup.py, sent on stdin to a host whose
Python may be too old for the project, carries this file's text (see standalone.py).
"""

from __future__ import annotations

import json
import os

PROC = "/proc"


def has_proc() -> bool:
    return os.path.isdir(os.path.join(PROC, "self"))


def stat_fields(pid) -> list | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...); None when gone."""
    try:
        with open(os.path.join(PROC, str(pid), "stat")) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The state letter (`R`, `S`, `T`, `Z`, ...), or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def alive(pid: int) -> bool:
    """A process runs with this pid; zombies count as gone."""
    if has_proc():
        return state(pid) not in (None, "Z", "X")
    try:  # no /proc (macOS): ask the kernel
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def process_state(pid: int) -> str:
    """`running`, `stopped` (SIGSTOP or traced), `gone` (exited or a zombie)."""
    letter = state(pid)
    if letter in ("T", "t"):
        return "stopped"
    return "gone" if letter in (None, "Z", "X") else "running"


def group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the process group."""
    if not has_proc():
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False
    for pid in pids():
        fields = stat_fields(pid)
        if fields and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def pids() -> list:
    """Every process id /proc lists (none without /proc)."""
    try:
        return [int(name) for name in os.listdir(PROC) if name.isdigit()]
    except OSError:
        return []


WARM_RANKS = ".gpu-cluster/warm/ranks"
"""contract.WARM_RANKS (this file is inlined where contract.py is not importable; a test holds them equal)."""


def warm_rank_environment(pid: int) -> dict | None:
    """A rank forked by the warm launcher (node/warm.py): the environment it runs with, from the
    launcher's record (/proc shows the launcher's own). None where the pid is no such rank."""
    try:
        with open(os.path.join(os.path.expanduser("~"), WARM_RANKS, str(pid))) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    fields = stat_fields(pid)
    if not fields or len(fields) < 20 or record.get("start_time") != fields[19]:
        return None  # a stale record: the pid is another process now
    return dict(record.get("env") or {})


def environment(pid: int) -> dict | None:
    """The process's environment, or None where it is gone or not this user's."""
    recorded = warm_rank_environment(pid)
    if recorded is not None:
        return recorded
    try:
        with open(os.path.join(PROC, str(pid), "environ"), "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    return dict(os.fsdecode(e).split("=", 1) for e in entries if b"=" in e)


def environments(exclude=()) -> list:
    """(pid, environment) of every live process this user may read, but those in `exclude`."""
    found = []
    for pid in pids():
        if pid in exclude:
            continue
        variables = environment(pid)
        if variables is not None and alive(pid):
            found.append((pid, variables))
    return found


def pids_with_environment(*entries: str, exclude=None) -> list:
    """Live processes whose environment holds every `NAME=value` of `entries` exactly (this one aside,
    and those in `exclude`); empty without /proc."""
    wanted = [entry.split("=", 1) for entry in entries]
    skip = {os.getpid(), *(exclude or ())}
    return [pid for pid, variables in environments(skip) if all(variables.get(name) == value for name, value in wanted)]


def command_line(pid: int) -> list:
    """The process's argv, or [] when it is gone or unreadable."""
    try:
        with open(os.path.join(PROC, str(pid), "cmdline"), "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def pids_with_argument(argument: str) -> list:
    """Live processes with `argument` as one whole element of their argv (this one aside); empty without /proc."""
    return [pid for pid in pids() if pid != os.getpid() and argument in command_line(pid) and alive(pid)]


def working_directory(pid: int) -> str | None:
    """The process's current folder, or None when it is gone or not this user's."""
    try:
        return os.readlink(os.path.join(PROC, str(pid), "cwd"))
    except OSError:
        return None


DELETED = " (deleted)"
"""What /proc adds to the path of a current folder removed since."""


def pids_working_in(folder: str) -> list:
    """Live processes whose current folder is `folder` or below it (this one aside); empty without /proc."""
    inside = folder.rstrip("/") + "/"
    found = []
    for pid in pids():
        cwd = working_directory(pid)
        if cwd and cwd.endswith(DELETED):  # a folder removed since (a stack's state deleted while it ran)
            cwd = cwd[: -len(DELETED)]
        if pid != os.getpid() and cwd and (cwd + "/").startswith(inside) and alive(pid):
            found.append(pid)
    return found


def descendants(roots) -> list:
    """Every live process below `roots` (children, theirs, ...), from /proc's parent links."""
    children: dict = {}
    for pid in pids():
        fields = stat_fields(pid)
        if fields and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found
