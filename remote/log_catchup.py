"""What `fab logs` shows of a run held by Slurm is its whole log (so far), or it says it is not.

The run's log lives on the head node; here is a copy (infra/runlog.py) that whoever holds it brings up to
date. `fab logs` first brings the rest into it, finished run or not (a follower that stopped early may have
left it short). Where another command holds the copy (the launching fab, a `fab logs -f`, the dashboard:
each follows the run, and may lag far behind it), the copy is left to it and the whole log is read from the
head node here, for showing only. Where the head node cannot be asked, what is shown is said to be only
what is here."""

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from infra import inventory, runlog
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from remote.connect import CONNECTION_ERRORS, NodeSession, describe
from remote.runs import Run
from remote.stream import say


@dataclass
class Caught:
    """How far the log shown is the run's."""

    lines: dict[str, list[str]] | None = None
    """Each writer's last lines (`node-<i>`, `cluster`), read from the head node where another command holds
    the copy here; None: the copy here is the one to show."""
    note: str = ""
    """A line saying what is shown is not the whole log, or where it came from; '' where the copy is whole."""


@dataclass
class _Lines:
    """Each writer's last `count` lines (0: all) of a log read through a copy that writes nothing."""

    count: int
    found: dict[str, deque] = field(default_factory=dict)

    def add(self, prefix: str, piece: str) -> None:
        writer = prefix.strip("[]").split(" ", 1)[0] if prefix else "cluster"
        kept = self.found.setdefault(writer, deque(maxlen=self.count or None))
        kept.append(runlog.as_line(piece).rstrip("\n"))

    def by_writer(self) -> dict[str, list[str]]:
        nodes = sorted(name for name in self.found if name != "cluster")
        return {name: list(self.found[name]) for name in [*nodes, "cluster"] if name in self.found}


def catch_up(stack: str, folder: Path, run: Run, count: int) -> Caught:
    """The rest of a Slurm-held run's log: into the copy here where this command may take it, else read
    whole from the head node for showing (`count` last lines per writer, 0: all)."""
    if not run.log:  # held by fab's connections: every line came here as it was written
        return Caught()
    copy = runlog.LogCopy(folder)
    if not copy.hold():
        return _read_past_the_holder(stack, folder, run, count)
    try:
        copy.resume()
        copy.add(_tail(inventory.load(stack), run, copy.offset))
    except (UsageError, OperationError, *CONNECTION_ERRORS) as exc:
        if not run.finished:  # a finished run's copy was made whole when it ended, or `down` brought it
            return Caught(note=f"fab: showing the log as far as it is here ({describe(exc)})")
    finally:
        copy.close(ended=run.ended)
    return Caught()


def _read_past_the_holder(stack: str, folder: Path, run: Run, count: int) -> Caught:
    lines = _Lines(count)
    reader = runlog.LogCopy(folder, echo=lines.add, write=False)
    reader.resume()
    here = reader.offset
    try:
        cluster = inventory.load(stack)
        rest = _tail(cluster, run, here)
    except (UsageError, OperationError, *CONNECTION_ERRORS) as exc:
        return Caught(
            note=f"fab: the log shown may stop short of the run's: another command (a `fab logs -f`, the "
            f"dashboard) is still bringing it here ({here:,} bytes so far), and the rest could not be read "
            f"({describe(exc)}); fab logs again shows more"
        )
    reader.add(rest)
    reader.close(ended=run.ended)
    return Caught(
        lines.by_writer(),
        f"fab: another command (a `fab logs -f`, the dashboard) is still bringing run {run.run_id}'s log here "
        f"({here:,} of {here + len(rest):,} bytes so far); shown whole from {cluster.head.name}",
    )


def _tail(cluster: ClusterInfo, run: Run, offset: int) -> bytes:
    """The run's log on the head node from byte `offset` on."""
    head = NodeSession(cluster, cluster.head)
    received = _Bytes()
    try:
        head.stream(f"cd && {runlog.tail_command(run.log, offset)}", received)
    finally:
        head.close()
    return bytes(received.data).partition(b"\n")[2]  # the first line: the end record


class _Bytes:
    def __init__(self):
        self.data = bytearray()

    def feed(self, data: bytes) -> None:
        self.data += data


def show(caught: Caught, node: str | None) -> bool:
    """The lines read from the head node (only `node`'s where one is named), then the note; False where the
    copy here is the one to show (the caller shows it, then the note is said here too)."""
    if caught.lines is not None:
        for writer, lines in caught.lines.items():
            if node is None or writer == node:
                for line in lines:
                    say(line)
    if caught.note:
        say(caught.note)
    return caught.lines is not None
