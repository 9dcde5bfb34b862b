"""The cluster's one-job lock, held on the head node for as long as a `fab` launch runs its job.

    python job_lock.py LOCK_FILE RUN_ID TASK OWNER

takes the lock and prints `locked`, then holds it until its standard input closes (`fab` closes the
channel when the job has ended); when another launch holds it, prints `held RUN_ID TASK OWNER SINCE`
and exits 3. The lock is an flock(2) on LOCK_FILE: taking it is atomic, and the kernel releases it
when the holder exits for any reason (its fab ended, the connection dropped, `fab stop` killed it),
so there is never a stale lock to reclaim. The file's text says who took it last, which means
something only while the lock is held. Standard library only; Linux and macOS.
"""

import fcntl
import os
import sys
import time

HELD_EXIT = 3


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


def main(argv: list[str]) -> int:
    path, run_id, task, owner = os.path.expanduser(argv[0]), *argv[1:4]
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = take(path, f"{run_id} {task} {owner} {time.time():.0f}")
    if fd is None:
        time.sleep(0.1)  # a holder that took the lock this instant writes its name within microseconds
        print(f"held {holder_of(path)}", flush=True)
        return HELD_EXIT
    print("locked", flush=True)
    while sys.stdin.buffer.read(4096):  # until fab closes the channel (or the connection drops)
        pass
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
