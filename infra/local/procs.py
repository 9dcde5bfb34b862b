"""Is a process, or a process group, still running? Zombies count as gone.

An exited process stays a zombie until its parent reaps it; node servers are re-parented to PID 1,
which on some machines (containers) reaps late, so `kill(pid, 0)` alone would report them alive.
"""

import os
from pathlib import Path

PROC = Path("/proc")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if _reaped_child(pid):
        return False
    state = _state(pid)
    return state is None or state != "Z"


def group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group."""
    if not PROC.exists():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in PROC.glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _reaped_child(pid: int) -> bool:
    """Reap `pid` if it is an exited child of this process; True if it was."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        return reaped == pid
    except ChildProcessError:
        return False


def _state(pid: int) -> str | None:
    fields = _stat_fields(PROC / str(pid) / "stat")
    return fields[0] if fields else None


def _stat_fields(path: Path) -> list[str] | None:
    """Fields after the command name of /proc/<pid>/stat: state, ppid, pgrp, ..."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def pids_with_environment(entry: str) -> list[int]:
    """Live processes whose environment holds `entry` (NAME=value) exactly; empty without /proc."""
    needle = entry.encode()
    found = []
    for path in PROC.glob("[0-9]*/environ"):
        try:
            if needle in path.read_bytes().split(b"\0"):
                pid = int(path.parent.name)
                if pid != os.getpid() and alive(pid):
                    found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def command_line(pid: int) -> list[str]:
    """The process's argv, or [] when it is gone or unreadable."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def pids_with_argument(argument: str) -> list[int]:
    """Live processes with `argument` as one whole element of their argv; empty without /proc."""
    found = []
    for path in PROC.glob("[0-9]*/cmdline"):
        try:
            pid = int(path.parent.name)
        except ValueError:
            continue
        if pid != os.getpid() and argument in command_line(pid) and alive(pid):
            found.append(pid)
    return found
