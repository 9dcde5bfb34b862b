"""Hang detection and diagnosis for a running job, from what each node's ranks report.

Each rank's monitor (node/rankhook/) records, every second, the last collective it entered
and completed in each process group and the collectives it is inside. `find_hang` is the rule:
a job hangs when some rank has been inside an incomplete collective for longer than the hang
timeout while at least one other rank of that group has not entered it, or entered a different
collective (another op, sizes or dtypes) under the same sequence number. Ranks that all compute
between collectives, however long, are never a hang. `verdict` turns the evidence (the progress
records, the flight-recorder dumps, the stacks) into the one line a person reads first.
"""

import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from node.output import unprefixed

DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Byte": "uint8",
    "Char": "int8",
    "Bool": "bool",
    "Short": "int16",
}


@dataclass(frozen=True)
class Collective:
    """One collective a rank is inside: which group, which one, what it moves, since when."""

    group: str
    """The process group's name ("0" is the default group)."""
    seq: int
    """The group's collective sequence number (1 for its first collective)."""
    op: str
    """all_reduce, broadcast, allgather, ..."""
    sizes: tuple
    """Input tensor shapes."""
    dtypes: tuple
    """Input dtypes as torch names them (Float, Half, ...)."""
    since: float
    """When the rank entered it (epoch seconds, the rank's node clock)."""

    @property
    def signature(self) -> tuple:
        return self.op, self.sizes, self.dtypes

    def describe(self) -> str:
        shapes = ", ".join(" x ".join(str(d) for d in s) or "scalar" for s in self.sizes)
        dtypes = ", ".join(sorted({DTYPES.get(d, d.lower()) for d in self.dtypes}))
        what = f"{shapes} x {dtypes}" if len(self.sizes) == 1 else f"{shapes}; {dtypes}"
        group = "" if self.group == "0" else f" in group {self.group}"
        return f"{self.op} #{self.seq}{group} ({what})"


@dataclass(frozen=True)
class Frame:
    """One Python frame of a rank's main thread."""

    function: str
    file: str
    line: int
    library: bool
    """The standard library or an installed package (torch), not the user's code."""

    def describe(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class RankView:
    """One rank as its node last reported it."""

    rank: int
    node: str
    pid: int
    state: str
    """running, stopped (SIGSTOP), gone, or finished (its script ended normally)."""
    waiting_s: dict
    """(group, seq) -> seconds inside that collective, by the node's clock."""
    entered: dict
    """group name -> the last collective sequence number the rank entered."""
    members: dict
    """group name -> the global ranks in it."""
    active: tuple
    """The Collectives the rank is inside."""
    stack: tuple
    """Main-thread Frames, innermost last."""

    def user_frame(self) -> Frame | None:
        """The innermost frame of the user's own code: where the rank really is."""
        return self.user_frame_of(self.stack)

    @staticmethod
    def user_frame_of(stack: tuple) -> Frame | None:
        for frame in reversed(stack):
            if not frame.library:
                return frame
        return stack[-1] if stack else None


@dataclass(frozen=True)
class Hang:
    """What the rule found: the collective some ranks wait in, and the ranks that did not join."""

    collective: Collective
    """The collective, as the waiting ranks called it."""
    waiting: tuple
    """RankViews inside it for longer than the timeout (or as long as the longest-waiting one)."""
    missing: tuple
    """RankViews of the group that have not entered it."""
    mismatched: tuple = ()
    """(RankView, Collective): ranks that called something else under the same sequence number."""
    waiting_s: float = 0.0
    """How long the longest-waiting rank has been inside it."""
    silent: tuple = ()
    """Ranks of the group that no node reported (their node did not answer) when the wait ran past the grace."""
    elsewhere: tuple = ()
    """RankViews of the group's other members when the wait ran past the grace: past the collective by
    their own count, yet not inside it (a rank that finished, or whose collectives no longer match)."""


@dataclass
class Evidence:
    """What `collect` brought back from every node, for the verdict and the run folder."""

    ranks: list = field(default_factory=list)
    """RankViews after the dump request."""
    py_spy: dict = field(default_factory=dict)
    """str(rank) -> py-spy's text."""
    dumps: dict = field(default_factory=dict)
    """str(rank) -> the rank's answer to the dump request: recorder buffer and thread stacks."""

    @classmethod
    def from_collected(cls, payloads: list[dict]) -> "Evidence":
        """From every node's `hang.py collect` JSON."""
        evidence = cls()
        for payload in payloads:
            evidence.ranks += parse_ranks(payload)
            evidence.py_spy.update(payload.get("py_spy", {}))
            evidence.dumps.update(payload.get("dumps", {}))
        return evidence

    def stack_of(self, rank: int, last_reported: tuple) -> tuple[tuple, bool]:
        """(frames, fresh): the rank's main-thread stack now, from its own answer to the dump
        request, else from py-spy (which also reads a stopped process), else as last reported."""
        answer = self.dumps.get(str(rank), {}).get("threads", {}).get("MainThread")
        if answer:
            return tuple(_frame(f) for f in answer), True
        spied = py_spy_main_thread(self.py_spy.get(str(rank), ""))
        if spied:
            return spied, True
        return last_reported, False


PY_SPY_FRAME = re.compile(r"^\s+(?P<function>\S.*?) \((?P<file>[^():]+):(?P<line>\d+)\)\s*$")
LIBRARY_TOPS = set(sys.stdlib_module_names) | {"torch", "numpy", "site-packages", "dist-packages"}


def py_spy_main_thread(text: str) -> tuple[Frame, ...]:
    """The main thread's frames from `py-spy dump` output, innermost last (py-spy prints it first).

    py-spy shortens an installed package's path to the package (`torch/distributed/...`) and a
    standard-library module to its file name, so those are recognised by their first component."""
    frames, inside = [], False
    for line in text.splitlines():
        if line.startswith("Thread "):
            inside = '"MainThread"' in line
            continue
        match = PY_SPY_FRAME.match(line) if inside else None
        if match:
            top = match["file"].split("/")[0].removesuffix(".py")
            frames.append(
                Frame(
                    match["function"],
                    match["file"].rsplit("/", 1)[-1],
                    int(match["line"]),
                    top in LIBRARY_TOPS or top.startswith("<"),
                )
            )
    return tuple(reversed(frames))


def parse_ranks(payload: dict) -> list[RankView]:
    """RankViews from one node's `hang.py status` (or `collect`) JSON."""
    now = float(payload.get("now", time.time()))
    views = []
    for record in payload.get("ranks", []):
        finished = bool(record.get("finished"))  # its script ended: inside nothing, whatever its process does
        active = () if finished else tuple(_collective(entry) for entry in record.get("active", []))
        views.append(
            RankView(
                rank=int(record["rank"]),
                node=str(record.get("node", "")),
                pid=int(record.get("pid", 0)),
                state="finished" if finished else str(record.get("state", "running")),
                # Waiting time by the node's own clock: the operator's clock may disagree with it.
                waiting_s={(c.group, c.seq): now - c.since for c in active if c.since > 0},
                entered={name: int(g.get("enqueued", -1)) for name, g in record.get("groups", {}).items()},
                members={name: tuple(g.get("ranks", [])) for name, g in record.get("groups", {}).items()},
                active=active,
                stack=tuple(_frame(f) for f in record.get("stack", [])),
            )
        )
    return views


def _frame(record) -> Frame:
    """A frame as a rank reported it, whatever it lacks: a frame object's `f_lineno` can be None (a frame
    that is starting or ending), and a record may miss a field; such a part reads `?` or 0, never an error."""
    record = record if isinstance(record, dict) else {}
    line = record.get("line")
    return Frame(
        str(record.get("function") or "?"),
        str(record.get("file") or "?"),
        int(line) if isinstance(line, int) or (isinstance(line, str) and line.isdigit()) else 0,
        bool(record.get("library")),
    )


def _collective(entry: dict) -> Collective:
    return Collective(
        str(entry.get("group", "0")),
        int(entry.get("seq", -1)),
        str(entry.get("op", "?")),
        tuple(tuple(s) for s in entry.get("sizes", [])),
        tuple(entry.get("dtypes", [])),
        float(entry.get("since", 0)),
    )


def find_hang(ranks: list[RankView], hang_timeout_s: float, overdue_s: float | None = None) -> Hang | None:
    """The longest-stalled collective that some member of its group has not joined, or None.

    With `overdue_s`, a collective some rank has waited in that long is a hang whatever the others
    report: every member inside it and none finishing (a transport that stopped moving), or members
    whose node does not answer (`silent`). The watch passes the hang timeout plus a grace, so that a
    job is always named in the end instead of waiting for evidence that never comes."""
    by_rank = _one_view_per_rank(ranks)
    candidates = []
    for view in by_rank.values():
        for collective in view.active:
            waited = view.waiting_s.get((collective.group, collective.seq), 0.0)
            if waited >= hang_timeout_s:
                candidates.append((waited, view, collective))
    ordered = sorted(candidates, key=lambda c: -c[0])
    for waited, view, collective in ordered:
        hang = _judge(collective, view, by_rank, waited)
        if hang is not None:
            return hang
    for waited, view, collective in ordered:
        if overdue_s is not None and waited >= overdue_s:
            return _overdue(collective, view, by_rank, waited)
    return None


def _one_view_per_rank(ranks: list[RankView]) -> dict[int, RankView]:
    """One view per rank; one that has reported beats one found only as a process."""
    by_rank: dict[int, RankView] = {}
    for view in ranks:
        if view.rank not in by_rank or (view.entered and not by_rank[view.rank].entered):
            by_rank[view.rank] = view
    return by_rank


def _overdue(collective: Collective, seen_by: RankView, by_rank: dict, waited: float) -> Hang:
    """A collective waited in past the grace: the members inside it wait, the ones not reported are silent."""
    members = seen_by.members.get(collective.group) or tuple(sorted(by_rank))
    waiting = tuple(
        by_rank[r]
        for r in members
        if r in by_rank and any((c.group, c.seq) == (collective.group, collective.seq) for c in by_rank[r].active)
    )
    silent = tuple(r for r in members if r not in by_rank)
    inside = {v.rank for v in waiting}
    elsewhere = tuple(by_rank[r] for r in members if r in by_rank and r not in inside)
    return Hang(collective, waiting or (seen_by,), (), (), waited, silent, elsewhere)


def _judge(collective: Collective, seen_by: RankView, by_rank: dict, waited: float) -> Hang | None:
    members = seen_by.members.get(collective.group) or tuple(sorted(by_rank))
    calls = {}
    missing = []
    for rank in members:
        view = by_rank.get(rank)
        if view is None:
            continue  # no report from this rank yet: nothing to say about it
        call = next((c for c in view.active if (c.group, c.seq) == (collective.group, collective.seq)), None)
        if call is not None:
            calls[rank] = call
        elif view.entered.get(collective.group, -1) < collective.seq:
            missing.append(view)
    if not calls:
        return None
    reference = _majority_signature(calls)
    waiting = tuple(by_rank[r] for r, c in sorted(calls.items()) if c.signature == reference)
    mismatched = tuple((by_rank[r], c) for r, c in sorted(calls.items()) if c.signature != reference)
    if not missing and not mismatched:
        return None
    called = next(c for r, c in sorted(calls.items()) if c.signature == reference)
    return Hang(called, waiting, tuple(missing), mismatched, waited)


def _majority_signature(calls: dict) -> tuple:
    """What most ranks called; on a tie, what the lowest rank called."""
    counts = Counter(c.signature for c in calls.values())
    best = max(counts.values())
    return next(c.signature for r, c in sorted(calls.items()) if counts[c.signature] == best)


def verdict(run_id: str, hang: Hang, evidence: Evidence | None = None) -> str:
    """`HANG run=<id>: rank 1 (node-1, pid 4711) never entered all_reduce #6 (1024 x float32); ...`"""
    latest = {v.rank: v for v in (evidence.ranks if evidence else [])}
    parts = []
    for view in hang.missing:
        view = latest.get(view.rank, view)
        parts.append(f"rank {view.rank} ({_where(view)}){_state(view)} never entered {hang.collective.describe()}")
    for view, call in hang.mismatched:
        view = latest.get(view.rank, view)
        parts.append(
            f"rank {view.rank} ({_where(view)}){_state(view)} called {call.describe()} where "
            f"{_ranks(hang.waiting)} called {hang.collective.describe()}"
        )
    if not hang.missing and not hang.mismatched:
        parts.append(_overdue_part(hang))
    since = min(
        c.since
        for v in hang.waiting
        for c in v.active
        if (c.group, c.seq) == (hang.collective.group, hang.collective.seq)
    )
    parts.append(f"{_ranks(hang.waiting)} waiting since {time.strftime('%H:%M:%S', time.gmtime(since))} UTC")
    for view in [*hang.missing, *(v for v, _ in hang.mismatched)] or [*hang.elsewhere, *hang.waiting]:
        view = latest.get(view.rank, view)
        stack, fresh = evidence.stack_of(view.rank, view.stack) if evidence else (view.stack, False)
        frame = RankView.user_frame_of(stack)
        if frame is not None:
            parts.append(f"rank {view.rank} {'is' if fresh else 'was last seen'} in {frame.describe()}")
    return f"HANG run={run_id}: " + "; ".join(parts)


def _overdue_part(hang: Hang) -> str:
    """Why a hang with no rank to blame was declared: silent nodes, or a collective nobody finishes."""
    what = hang.collective.describe()
    if hang.silent:
        return (
            f"{_ranks_numbers(hang.silent)} of {what} not reported (their node did not answer) while "
            f"{_ranks(hang.waiting)} waited {hang.waiting_s:.0f} s"
        )
    if hang.elsewhere:
        others = "; ".join(
            f"rank {v.rank} ({_where(v)}){_state(v)} is past it by its own count "
            f"(entered #{v.entered.get(hang.collective.group, -1)}) and inside {_inside(v)}"
            for v in hang.elsewhere
        )
        return f"{_ranks(hang.waiting)} waited {hang.waiting_s:.0f} s in {what}, which the others left: {others}"
    return f"{_ranks(hang.waiting)} entered {what} and none finished it in {hang.waiting_s:.0f} s (a stalled transport)"


def _inside(view: RankView) -> str:
    return ", ".join(c.describe() for c in view.active) or "no collective"


def stalled_since(hang: Hang) -> float:
    """When progress stopped: the moment the first waiting rank entered the collective."""
    return min(
        c.since
        for v in hang.waiting
        for c in v.active
        if (c.group, c.seq) == (hang.collective.group, hang.collective.seq)
    )


def _where(view: RankView) -> str:
    return f"{view.node or '?'}, pid {view.pid}"


def _state(view: RankView) -> str:
    return {
        "stopped": " is stopped (SIGSTOP) and",
        "gone": " is dead (its process is gone) and",
        "finished": " finished its script and",
    }.get(view.state, "")


def _ranks(views) -> str:
    return _ranks_numbers(v.rank for v in views)


def _ranks_numbers(ranks) -> str:
    numbers = sorted(ranks)
    return ("rank " if len(numbers) == 1 else "ranks ") + _ranges(numbers)


def _ranges(numbers: list[int]) -> str:
    spans, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(spans)


GLOO_MISMATCH = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)\. Received data size doesn't match")
FAULT_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
ROOT_CAUSE_RANK = re.compile(r"^\s+rank\s+:\s+(\d+)\b.*\n\s+exitcode\s+:\s+-6\b", re.M)


def mismatch_line(node: str, log: str) -> str | None:
    """For a node whose log shows gloo aborting a rank over a collective's size, the line that says
    which rank, where (from the Python stack PYTHONFAULTHANDLER printed) and what gloo saw; else None.
    gloo checks sizes and aborts, so on CPU a shape mismatch ends the job instead of hanging it."""
    log = unprefixed(log)  # the nodes prefix their lines (`[node-1 rank 3] `)
    sizes = GLOO_MISMATCH.search(log)
    if sizes is None:
        return None
    rank = ROOT_CAUSE_RANK.search(log)
    frames = _aborted_thread_frames(log)
    frame = RankView.user_frame_of(tuple(reversed(frames)))
    who = f"rank {rank.group(1)} ({node})" if rank else f"a rank on {node}"
    where = f" in {frame.describe()}" if frame else ""
    return (
        f"fab: collective mismatch: {who} aborted{where}: gloo received {sizes.group(1)} bytes where "
        f"{sizes.group(2)} were expected; the ranks called one collective with different sizes"
    )


def _aborted_thread_frames(log: str) -> list[Frame]:
    """From PYTHONFAULTHANDLER's report of an abort: the frames (innermost first) of the thread that
    was inside a torch.distributed call, else of the last thread listed that is not our monitor."""
    section = log.split("Fatal Python error: Aborted", 1)[1] if "Fatal Python error: Aborted" in log else ""
    threads: list[list[Frame]] = []
    for text in section.splitlines():
        if re.match(r"^(Current thread|Thread) 0x", text):
            threads.append([])
            continue
        match = FAULT_FRAME.match(text)
        if match and threads:
            path = match["path"]
            threads[-1].append(
                Frame(match["function"], path.rsplit("/", 1)[-1], int(match["line"]), _library_path(path))
            )
        elif text.startswith("Extension modules:"):
            break
    in_collective = [t for t in threads if any(f.file == "distributed_c10d.py" for f in t)]
    if in_collective:
        return in_collective[0]
    users = [t for t in threads if not any(f.file == "gpu_cluster_rank_monitor.py" for f in t)]
    return users[-1] if users else []


def _library_path(path: str) -> bool:
    """An installed package or the standard library of whatever interpreter the node ran (its frozen
    modules too: `<frozen importlib._bootstrap_external>`)."""
    if path.startswith("<"):
        return True
    parts = path.split("/")
    return "site-packages" in parts or "dist-packages" in parts or bool(re.search(r"/lib/python3\.\d+/", path))
