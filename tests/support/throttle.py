"""Real slowness for one local node: its processes in a CPU cgroup (v1) with a low quota, as root.

A node's processes are found by their `HOME` (the node server and whatever it started; a daemon that
was reparented to init keeps it too); the node server's children inherit the cgroup, so every command
the node runs from then on is throttled. The period is short (10 ms) so that even a step of a few
milliseconds is slowed evenly, not in bursts.
"""

import os
import time
from contextlib import contextmanager
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
"""The least quota the kernel takes (cpu.cfs_quota_us)."""


def unavailable() -> str:
    """Why a node cannot be throttled here ('' where it can)."""
    if os.geteuid() != 0:
        return "not root"
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}"
    return ""


def processes_with_home(home: Path) -> list[int]:
    wanted = f"HOME={home}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@contextmanager
def throttled(home: Path, percent: int):
    """Every process of the node whose home is `home` gets `percent` of one CPU while the block runs."""
    group = CPU_CGROUP / f"gpu-cluster-test-{os.getpid()}-{home.name}"
    group.mkdir()
    try:
        period = max(PERIOD_US, MIN_QUOTA_US * 100 // percent)  # 5% of a core: 1 ms in every 20
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(period * percent // 100))
        pids = processes_with_home(home)
        assert pids, f"no process runs with HOME={home}"
        for pid in pids:
            _move(pid, group)
        yield pids
    finally:
        _empty_and_remove(group)


def _empty_and_remove(group: Path) -> None:
    """Move out what is left and remove the group. Again while it is busy: a process the node forked
    while the others were moved out stays in, and one still exiting keeps it busy for a moment."""
    for _ in range(100):
        for pid in (group / "cgroup.procs").read_text().split():
            _move(int(pid), CPU_CGROUP)
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    group.rmdir()


def _move(pid: int, group: Path) -> None:
    try:
        (group / "cgroup.procs").write_text(str(pid))
    except (ProcessLookupError, OSError):  # it ended meanwhile
        pass
