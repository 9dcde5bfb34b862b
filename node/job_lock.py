"""The cluster's one-job lock, held on the head node for as long as a `fab` launch owns the cluster.

    python job_lock.py LOCK_FILE RUN_ID TASK OWNER

takes the lock and prints `locked`, then holds it until its standard input closes (`fab` closes the
channel when its submit or its job has ended). When another launch holds it, it prints `waiting RUN_ID
TASK OWNER SINCE` (the holder) once, waits its turn, and prints `locked` when it has the lock; a launch
never turns another away. Waiters take the lock in the order they arrived: each holds an flock on a
ticket in LOCK_FILE.queue/ named by its arrival time, and only the first live ticket tries the lock (a
ticket no process holds is a waiter that died, and is removed). A waiter whose input closes (its fab
was stopped) leaves the line and exits 3 without the lock.

The lock is an flock(2) on LOCK_FILE: taking it is atomic, and the kernel releases it when the holder
exits for any reason (its fab ended, the connection dropped, `fab stop` killed it), so there is never a
stale lock to reclaim. The file's text says who took it last, which means something only while the
lock is held. Standard library only; Linux and macOS.
"""

import fcntl
import os
import select
import sys
import time

GAVE_UP_EXIT = 3
POLL_S = 0.05
"""How often a waiter first in line tries the lock, and looks whether its fab has gone."""


def take(path: str, holder: str) -> int | None:
    """An open descriptor holding the lock with `holder` written in the file, or None if it is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, holder.encode() + b"\n")
    return fd


def holder_of(path: str) -> str:
    """Who holds the lock, as the holder wrote it (read while it is held by someone else)."""
    try:
        with open(path) as f:
            return f.read().strip() or "? ? ? ?"
    except OSError:
        return "? ? ? ?"


def ticket(queue: str) -> tuple[int, str]:
    """A place in line: a file named by the arrival time, flock'd by this waiter for as long as it waits
    (made under a private name and renamed, so no other waiter ever sees it unlocked)."""
    os.makedirs(queue, mode=0o700, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}"
    partial = os.path.join(queue, f".{name}")
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(partial, os.path.join(queue, name))
    return fd, name


def first_in_line(queue: str, mine: str) -> bool:
    """Whether no live waiter arrived before `mine`; the tickets of waiters that died are removed."""
    for name in sorted(n for n in os.listdir(queue) if not n.startswith(".")):
        if name >= mine:
            return True
        try:
            fd = os.open(os.path.join(queue, name), os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # alive and ahead of us
        finally:
            os.close(fd)
        try:
            os.unlink(os.path.join(queue, name))  # nobody held it: that waiter is gone
        except FileNotFoundError:
            pass
    return True


def held_by(path: str, run_id: str) -> bool:
    """Whether the lock is held now, by the launch of `run_id`: node/torchrun.py asks before a fab-held run's
    ranks start, so that a launch whose holder `fab stop` ended (it ends the holder first) starts none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder_of(path).split()[0] == run_id
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it
        return False
    finally:
        os.close(fd)


def wait_turn(path: str, holder: str) -> int | None:
    """The lock, taken when this waiter's turn comes; None when its input closed first."""
    queue = f"{path}.queue"
    fd, mine = ticket(queue)
    try:
        while True:
            if first_in_line(queue, mine):
                taken = take(path, holder)
                if taken is not None:
                    return taken
            if select.select([sys.stdin], [], [], POLL_S)[0] and not os.read(sys.stdin.fileno(), 4096):
                return None  # fab closed the channel (Ctrl-C, or its connection dropped)
    finally:
        os.unlink(os.path.join(queue, mine))
        os.close(fd)


def main(argv: list[str]) -> int:
    path, run_id, task, owner = os.path.expanduser(argv[0]), *argv[1:4]
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    holder = f"{run_id} {task} {owner} {time.time():.0f}"
    fd = take(path, holder)
    if fd is None:
        time.sleep(0.1)  # a holder that took the lock this instant writes its name within microseconds
        print(f"waiting {holder_of(path)}", flush=True)
        fd = wait_turn(path, holder)
        if fd is None:
            return GAVE_UP_EXIT
    print("locked", flush=True)
    while sys.stdin.buffer.read(4096):  # until fab closes the channel (or the connection drops)
        pass
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
