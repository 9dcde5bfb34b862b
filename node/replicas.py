"""A fault-tolerant run's replica groups started again on replaced nodes, for both holders, and the metrics
readers of its contract lines.

`GroupRestarter` is the one restarter: given which nodes are back in service now (`back`) and how to start a
group again (`start`), each `look` applies the rule (`contract.groups_to_restart`) and keeps the bookkeeping:
the starts running and their exit codes, when each group's nodes left, and each heal's pricing record, from
when its nodes left until its first step back in the metrics (`heal_records`). fab's launch
(remote/heal.py) gives it its SSH sessions' answers and the launch's own steps; a Slurm-held run's batch job
(node/slurm_restarts.py) Slurm's node states and srun.

The metrics readers: the fault-tolerant contract's lines (those with `participants`) in a run's metrics file,
the groups in the quorum now (`fab jobs`' participants, for both holders) and a group's first step after a
time.

Standard library only: the Slurm batch job runs it on the head node.
"""

import json
import os
import threading
import time
from collections.abc import Callable

from node import contract


class GroupRestarter:
    """One run's replica groups (lists of node names) started again where every node of one is `back`."""

    def __init__(self, groups: list, back: Callable[[], set], start: Callable[[int], bool]):
        """`back()`: the nodes back in service now (asked only where some group is due to be asked about);
        `start(number)`: start that group again, True where it started."""
        self.groups, self.back, self.start = groups, back, start
        self.lock = threading.Lock()
        self.running: set = set()
        """Groups whose start again runs now."""
        self.ended: dict = {}
        """group: its starts' exit codes."""
        self.left_at: dict = {}
        """group: when its nodes were first seen gone, until it starts again."""
        self.heals: list = []
        """(group, its nodes left at, started again at), each start again, for its pricing record."""
        self.recorded: set = set()
        """The indexes in `heals` that `heal_records` has given."""

    def left(self, number: int, at: float | None = None) -> None:
        """Group `number`'s nodes were seen gone (its job session dropped, or its node left the allocation)."""
        with self.lock:
            if number not in self.running:
                self.left_at.setdefault(number, time.time() if at is None else at)

    def ended_start(self, number: int, code: int | None) -> None:
        """A start again of group `number` ended with `code` (None: unknown)."""
        with self.lock:
            self.running.discard(number)
            if code is not None:
                self.ended.setdefault(number, []).append(code)

    def look(self) -> list:
        """The groups due now started again (`contract.groups_to_restart`); those started."""
        back = self.back()
        with self.lock:
            due = contract.groups_to_restart(self.groups, back, set(self.running), self.ended)
        started = []
        for number in due:
            at = time.time()
            if not self.start(number):
                continue
            with self.lock:
                self.running.add(number)
                self.heals.append((number, self.left_at.pop(number, None), at))
            started.append(number)
        return started

    def not_rejoined(self, records: list) -> list:
        """The groups started again that run now and have written no step since that start (`records`: the
        contract lines, `contract_lines`). Once the run's other groups have ended they have no live peer to
        heal from and never rejoin: the holder stops them rather than wait for torchft's quorum timeout, which
        left a finished run RUNNING at 1/2."""
        with self.lock:
            starts = {number: at for number, _, at in self.heals if number in self.running}
        return sorted(
            number
            for number, at in starts.items()
            if not any(r.get("replica") == number and r.get("time", 0) >= at for r in records)
        )

    def heal_records(self, metrics: str, tail_bytes: int = 1 << 16, last: bool = False) -> list:
        """The pricing record of each start again not given yet whose first step back is in `metrics` (with
        `last`, every one: back at its start where it made none): {group, nodes, stopped_at, at}, `at` when
        it was back in the quorum."""
        found = []
        with self.lock:
            pending = [(index, heal) for index, heal in enumerate(self.heals) if index not in self.recorded]
        for index, (number, left, at) in pending:
            back = first_step_after(metrics, number, at, tail_bytes)
            if back is None and not last:
                continue
            found.append({"group": number, "nodes": list(self.groups[number]), "stopped_at": left, "at": back or at})
            self.recorded.add(index)
        return found


def contract_lines(path: str, tail_bytes: int = 0) -> list:
    """The fault-tolerant contract's lines (those with `participants`) of a metrics file, oldest first;
    `tail_bytes`: only its last bytes (a running run's file grows a line per group per step)."""
    try:
        with open(path, "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - tail_bytes) if tail_bytes else 0
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return contract_records(text, cut=bool(start))


def contract_records(text: str, cut: bool = False) -> list:
    """The contract's lines in metrics text, oldest first; `cut`: the text starts mid-file (a tail), so its
    first line is no line."""
    lines = text.splitlines()[1:] if cut else text.splitlines()
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "participants" in record and "replica" in record:
            found.append(record)
    return found


def newest_participants(records: list):
    """The groups in the quorum at the newest contract line; None where there is none yet. The one reading
    of `participants` that `fab jobs` shows, for both holders."""
    return max(records, key=lambda r: r["time"])["participants"] if records else None


def first_step_after(path: str, replica: int, at: float, tail_bytes: int = 1 << 16):
    """When replica group `replica` wrote its first step line after `at` (epoch s); None if not yet.
    `tail_bytes`: only the file's last bytes (a running run's; 0: all of it)."""
    times = [r["time"] for r in contract_lines(path, tail_bytes) if r["replica"] == replica and r["time"] >= at]
    return min(times) if times else None


def participants(log: str):
    """A running fault-tolerant run's participants now: the newest contract line's (in the metrics beside
    the run's log); None where it has none."""
    return newest_participants(contract_lines(os.path.join(os.path.dirname(log), contract.METRICS_FILE), 1 << 14))
