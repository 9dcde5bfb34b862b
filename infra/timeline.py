"""A command's timeline: named phases on one clock, each ending where the next begins.

Every `up`, bootstrap and launch keeps one (`summary.json`, `bootstrap.json`, the inventory) and prints
it in one line at its end. Phases are contiguous by construction: a phase is the time from the end of
the one before to its own end (`mark`), and an end another clock reported (a node's, Slurm's) is
clamped between the last end and now (`event`), so the phases always sum to the time since the start.
`wall_s` is measured apart, on the monotonic clock from the process's own start, which is what the sum
is checked against (`within`).
"""

import os
import time
from dataclasses import dataclass, field

TOLERANCE = 0.05
"""The phases' sum may differ from the wall time by this fraction."""
SHOWN_S = 0.05
"""A phase shorter than this is kept in the record but left out of the printed line."""


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat against the boot-time clock), else 0."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@dataclass
class Timeline:
    """Named phases from `started_at` (epoch seconds), in order, with no gap between them."""

    started_at: float
    phases: list = field(default_factory=list)
    """[[name, seconds], ...] in order."""
    wall_s: float | None = None
    """The wall time at `close`, measured on this process's monotonic clock (None until closed)."""
    nodes: dict = field(default_factory=dict)
    """Per node, where the phases ran on every node at once: {node: {phase: seconds}}."""
    clock: float | None = field(default=None, repr=False, compare=False)
    """time.monotonic() at `started_at`, in the process that started it (not saved)."""

    @classmethod
    def since_process_start(cls, first: str = "startup") -> "Timeline":
        """A timeline from this process's start: its first phase (`first`) is the interpreter's start,
        imports and option checks up to now."""
        age = process_age_s()
        timeline = cls(time.time() - age, clock=time.monotonic() - age)
        timeline.mark(first)
        return timeline

    @property
    def at(self) -> float:
        """Where the last phase ended (epoch seconds)."""
        return self.started_at + sum(seconds for _, seconds in self.phases)

    def mark(self, name: str) -> None:
        """Phase `name` ends now."""
        self.phases.append([name, max(0.0, time.time() - self.at)])

    def event(self, name: str, at: float | None) -> None:
        """Phase `name` ended at `at` (another clock's epoch seconds), clamped between the last end and now;
        nothing where `at` is unknown (the next phase takes its time)."""
        if at is None:
            return
        self.phases.append([name, min(max(0.0, at - self.at), max(0.0, time.time() - self.at))])

    def close(self, name: str) -> "Timeline":
        """The last phase ends now; the wall time is taken (monotonic where this process started it)."""
        self.mark(name)
        self.wall_s = time.monotonic() - self.clock if self.clock is not None else self.total_s
        return self

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def within(self, tolerance: float = TOLERANCE) -> bool:
        """The phases sum to the wall time within `tolerance` (of the wall time)."""
        wall = self.total_s if self.wall_s is None else self.wall_s
        return abs(self.total_s - wall) <= tolerance * max(wall, 1e-9)

    def line(self) -> str:
        """`timeline: sync 0.2 s · submit 0.1 s · ... = 5.1 s` (phases under SHOWN_S left out)."""
        shown = " · ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases if seconds >= SHOWN_S)
        return f"timeline: {shown or 'nothing'} = {self.total_s:.1f} s"

    def as_dict(self) -> dict:
        return {
            "started_at": round(self.started_at, 3),
            "phases": [{"phase": name, "s": round(seconds, 3)} for name, seconds in self.phases],
            "total_s": round(self.total_s, 3),
            "wall_s": None if self.wall_s is None else round(self.wall_s, 3),
            **({"nodes": self.nodes} if self.nodes else {}),
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> "Timeline | None":
        if not data:
            return None
        try:
            phases = [[str(p["phase"]), float(p["s"])] for p in data.get("phases", [])]
            wall = data.get("wall_s")
            return cls(
                float(data["started_at"]), phases, None if wall is None else float(wall), data.get("nodes") or {}
            )
        except (KeyError, TypeError, ValueError):
            return None


def latest(values) -> float | None:
    """The latest of the known times (a phase on every node ends when its last node's does)."""
    known = [v for v in values if isinstance(v, (int, float))]
    return max(known) if known else None


def job_phases(timeline: Timeline, node_times: list[dict], exited_at: list, queued_until: float | None = None) -> None:
    """A launch's phases from the job's own clocks, after the job: Slurm's queue (`queued_until`, its start),
    the nodes' start (node/torchrun.py), the rendezvous and the first step (the rank monitors' records),
    training (to the last node's exit), then `exit`: until this command saw the job end."""
    timeline.event("queue wait", queued_until)
    timeline.event("start", latest(t.get("started") for t in node_times))
    timeline.event("rendezvous", latest(t.get("group") for t in node_times))
    timeline.event("first step", latest(t.get("first_step") for t in node_times))
    timeline.event("training", latest(exited_at))
    timeline.mark("exit")
