"""Room on the nodes for a run, asked in the launch's first round trip and checked before anything starts.

A run writes on each node's own disk (its folder under `~/.gpu-cluster/runs`: the job's workdir, results,
Slurm's spool beside them) and into the shared folder (its log, metrics, stage). Where either has less free
than a run needs, the launch is refused in one line, exit 2, naming the node, the folder, what is free and
what is needed: a run started there would lose its output, and Slurm would drain the node."""

import errno
import os
from dataclasses import dataclass

from infra.errors import UsageError
from node import contract

TAG = "space"
"""The launch status's line: `space NODE_KB SHARED_KB` (an empty word where a folder could not be asked)."""
NEEDED_MB = contract.RUN_ROOM_MB
NODE_FOLDER = contract.RUNS
SHARED_FOLDER = "runs"


def command() -> str:
    """Prints the free kilobytes (POSIX `df -Pk`) in the node's run folder and in the shared folder's (or the
    nearest folder above that exists: nothing is made); the shared folder from the node's environment file."""
    free = 'd=$1; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; df -Pk "$d" 2>/dev/null | awk \'NR==2 {print $4}\''
    node = contract.shell(NODE_FOLDER)
    env = contract.shell(contract.ENV)
    return (
        f"( free() {{ {free}; }}; [ -f {env} ] && . {env} 2>/dev/null; "
        f'printf "{TAG} %s %s\\n" "$(free {node})" '
        f'"$([ -n "$CLUSTER_SHARED_DIR" ] && free "$CLUSTER_SHARED_DIR/{SHARED_FOLDER}")" )'
    )


@dataclass(frozen=True)
class Room:
    """What a node said it has free (kilobytes; None where it could not say)."""

    node_kb: int | None
    shared_kb: int | None


def parse(output: str) -> Room:
    for line in output.splitlines():
        words = line.split()
        if words[:1] == [TAG]:
            numbers = [int(w) if w.isdigit() else None for w in words[1:3]] + [None, None]
            return Room(numbers[0], numbers[1])
    return Room(None, None)


def check(names: list[str], statuses: list[str], needed_mb: int = NEEDED_MB) -> None:
    """UsageError naming the first node (or the shared folder) with less than `needed_mb` free."""
    for name, output in zip(names, statuses, strict=True):
        room = parse(output)
        where = [(room.node_kb, f"its run folder ~/{NODE_FOLDER}"), (room.shared_kb, "the shared folder's runs/")]
        for free_kb, folder in where:
            if free_kb is not None and free_kb < needed_mb * 1024:
                raise UsageError(
                    f"{name} has no room for a run: {folder} has {free_kb / 1024:.1f} MiB free, a run needs "
                    f"{needed_mb} MiB (its log, the ranks' files, results); free space there (fab clean-runs "
                    "removes old runs' copies), then launch again"
                )


FULL = os.strerror(errno.ENOSPC)
"""How a process says its disk is full ("No space left on device")."""


def full_disk_line(node: str, log_text: str) -> str | None:
    """One line naming the node and its full disk, where its log says a write failed for want of space."""
    found = next((line.strip() for line in log_text.splitlines() if FULL in line), None)
    if found is None:
        return None
    return f"fab: {node} ran out of disk space during the run ({FULL}): {found[-240:]}"
