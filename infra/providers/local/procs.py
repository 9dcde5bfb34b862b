"""Is a process of ours still running? Zombies count as gone (node/procfs.py reads /proc).

An exited process stays a zombie until its parent reaps it; node servers are re-parented to PID 1,
which on some machines (containers) reaps late, so `kill(pid, 0)` alone would report them alive. Where
the process is this one's own child, it is reaped here.
"""

import os

from node import procfs


def alive(pid: int) -> bool:
    return not _reaped_child(pid) and procfs.alive(pid)


def _reaped_child(pid: int) -> bool:
    """Reap `pid` if it is an exited child of this process; True if it was."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        return reaped == pid
    except ChildProcessError:
        return False
