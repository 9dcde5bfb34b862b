"""Pure functions that turn what the product records (run rows, metrics.jsonl, log lines, the ledger's
intervals and events, timelines) into what the page draws. No I/O here: `sources.py` reads, this shapes."""

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from node.billing import cost_usd
from node.run_state import FINAL

STEP_LINE = re.compile(
    r"^\[node-0(?: rank 0)?\]\s+(?P<step>\d+)\s+(?P<loss>-?[\d.]+(?:e-?\d+)?|nan|inf)\s+(?P<step_ms>[\d.]+)"
    r"\s+(?P<samples_per_s>[\d.]+)\s"
)
"""Rank 0's step line in node-0's log (harness/metrics.py `format_step`, under `STEP_HEADER`; `[node-0] `
where the node runs one rank, node/output.py): the live
source of a running run's curves, since metrics.jsonl comes to this machine when the run ends."""
FT_LINE = re.compile(
    r"^\[node-\d+(?: rank \d+)?\]\s+replica (?P<replica>\d+) step\s+(?P<step>\d+) loss (?P<loss>\S+)"
    r" participants (?P<participants>\d+)"
)
"""A replica group's step line (harness/fault_tolerance.py, every `log_every` steps, from the group's first
rank on whichever node it runs): a running fault-tolerant run's curves, as `STEP_LINE` is a plain run's."""
VERDICT_KEYS = ("hang", "stragglers", "participants", "waiting_for")
"""What a run's row carries beyond `fab jobs`'s columns where the run has it (None/absent otherwise)."""


def run_row(row: dict, summary: dict | None, hang_verdict: str | None) -> dict:
    """A `fab jobs --json` row (`runs.Run.as_row`) with the verdicts found for it: the hang watch's (the
    run record's, else the summary's, else the ledger's), stragglers and participants where recorded; and
    `final`, whether the run has ended (the page offers no cancel then)."""
    summary = summary or {}
    hang = row.get("hang") or summary.get("hang") or ({"verdict": hang_verdict} if hang_verdict else None)
    shaped = {**row, "hang": (hang or {}).get("verdict") if isinstance(hang, dict) else hang}
    shaped["final"] = row.get("state") in FINAL
    for key in ("stragglers", "participants"):
        shaped[key] = (row.get(key) if row.get(key) is not None else summary.get(key)) or None  # [] says nothing
    return shaped


def queue_counts(rows: list[dict]) -> dict[str, int]:
    """How many runs are in each state, for the header ({'PENDING': 1, 'RUNNING': 1, ...})."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    return counts


@dataclass
class Series:
    """Columns for one plot: x first (epoch seconds), then named y columns of the same length."""

    x: list[float] = field(default_factory=list)
    ys: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, x: float, **values: float | None) -> None:
        for name in values:
            self.ys.setdefault(name, [None] * len(self.x))
        self.x.append(x)
        for name, column in self.ys.items():
            column.append(values.get(name))

    def as_dict(self) -> dict:
        return {"x": self.x, "ys": self.ys}


def step_series(records: Iterable[dict]) -> dict[str, Series]:
    """metrics.jsonl's `step` records as the run page's plots: loss, throughput (samples/s) and step time
    per rank (a record without `rank` is rank 0's: the harness writes from rank 0); a fault-tolerant run's
    `ft_step` records as its loss per replica group."""
    loss, throughput, step_time = Series(), Series(), Series()
    for record in records:
        if "time" not in record:
            continue
        at = float(record["time"])
        if record.get("kind") == "ft_step":
            loss.add(at, **{f"replica {record.get('replica', 0)}": _number(record.get("loss"))})
            continue
        if record.get("kind") != "step":
            continue
        loss.add(at, loss=_number(record.get("loss")))
        throughput.add(at, samples_per_s=_number(record.get("samples_per_s")))
        step_time.add(at, **{f"rank {record.get('rank', 0)}": _number(record.get("step_ms"))})
    return {"loss": loss, "throughput": throughput, "step_ms": step_time}


def steps_from_log(lines: Iterable[str], clock: Iterable[float]) -> list[dict]:
    """Rank 0's step lines of a log as `step` records, and each replica group's step lines as `ft_step`
    records, each at the time its line was seen (`clock`, one time per line): a running run's curves before
    its metrics.jsonl is fetched."""
    found: list[dict] = []
    for line, at in zip(lines, clock, strict=False):
        group = FT_LINE.match(line)
        if group:
            found.append(
                {
                    "kind": "ft_step",
                    "time": at,
                    "step": int(group["step"]),
                    "replica": int(group["replica"]),
                    "loss": _number(group["loss"]),
                    "participants": int(group["participants"]),
                }
            )
            continue
        match = STEP_LINE.match(line)
        if match:
            found.append(
                {
                    "kind": "step",
                    "time": at,
                    "step": int(match["step"]),
                    "loss": _number(match["loss"]),
                    "step_ms": _number(match["step_ms"]),
                    "samples_per_s": _number(match["samples_per_s"]),
                }
            )
    return found


def participants_series(records: Iterable[dict]) -> Series:
    """A fault-tolerant run's participants over time, one column per replica group (`ft_step` lines)."""
    series = Series()
    for record in records:
        if record.get("kind") == "ft_step" and "time" in record:
            series.add(float(record["time"]), **{f"replica {record.get('replica', 0)}": record.get("participants")})
    return series


def interruptions(events: Iterable, started_at: float | None, ended_at: float | None, now: float) -> list[dict]:
    """The ledger's node events (spot interruptions, lost nodes) within a run's time, for its time axis."""
    if started_at is None:
        return []
    end = ended_at or now
    return [
        {"at": e.at, "kind": e.kind, "node": e.node, "detail": e.detail, "seconds": e.seconds}
        for e in events
        if started_at <= e.at <= end
    ]


def cost_series(
    intervals: Iterable, hourly_usd: float, now: float, reference_hourly_usd: float | None = None
) -> Series:
    """A cluster's cost over time from its up intervals: flat while it was down, rising at `hourly_usd`
    while up, so the last point is what `deploy.py cost` says (before the minimum billed minute). With
    `reference_hourly_usd` (a local cluster's AWS equivalent, as the ledger recorded it at `up`), what the
    same time would have cost on AWS, beside it."""
    series, spent, would = Series(), 0.0, 0.0
    for interval in sorted(intervals, key=lambda i: i.started_at):
        end = interval.ended_at or now
        series.add(interval.started_at, **_costs(spent, would, reference_hourly_usd))
        spent += cost_usd(hourly_usd, max(0.0, end - interval.started_at))
        if reference_hourly_usd is not None:
            would += cost_usd(reference_hourly_usd, max(0.0, end - interval.started_at))
        series.add(end, **_costs(spent, would, reference_hourly_usd))
    return series


def _costs(spent: float, would: float, reference_hourly_usd: float | None) -> dict[str, float | None]:
    found: dict[str, float | None] = {"usd": round(spent, 6)}
    if reference_hourly_usd is not None:
        found["aws equivalent usd"] = round(would, 6)
    return found


def timelines(up: dict | None, bootstrap: dict | None, launches: Iterable[tuple[str, dict | None]]) -> list[dict]:
    """The recorded timelines of `up`, bootstrap and each launch (infra/timeline.py's `as_dict`), newest
    launch last; each as {what, started_at, phases: [{phase, s}], total_s}. Unrecorded ones are left out."""
    found = []
    for what, recorded in [("up", up), ("bootstrap", bootstrap), *launches]:
        if recorded and recorded.get("phases"):
            found.append(
                {
                    "what": what,
                    "started_at": recorded.get("started_at"),
                    "phases": recorded["phases"],
                    "total_s": recorded.get("total_s"),
                }
            )
    return found


def node_rows(nodes: list[dict], statuses: dict[str, dict], node_hourly_usd: float) -> list[dict]:
    """The inventory's nodes with what status last found (state, Slurm state, uptime) and each node's $/h;
    a node not asked yet reads `asking`."""
    rows = []
    for node in nodes:
        found = statuses.get(node["name"], {})
        rows.append(
            {
                "name": node["name"],
                "address": found.get("address") or f"{node.get('public_ip')}:{node.get('ssh_port')}",
                "state": found.get("state", "asking"),
                "slurm": found.get("scheduler") or "-",
                "uptime_s": found.get("uptime_s"),
                "hourly_usd": round(node_hourly_usd, 4),
                "error": found.get("error", ""),
            }
        )
    return rows


@dataclass
class LogTail:
    """The last `keep` lines of a run's log as the follow brings them, numbered so a reader asks only for
    what it has not seen (`since`). A writer's unfinished line waits for its rest (the fab holder passes
    the logs' growth as it reads it); a redraw ended by `\\r` is a line of its own, as in the log's copy."""

    keep: int = 2000
    pieces: list[tuple[int, float, str]] = field(default_factory=list)
    """(number, when seen, the line with its writer's prefix)."""
    count: int = 0
    partial: dict[str, list[str]] = field(default_factory=dict)
    """Each writer's unfinished line, in the parts it came in (joined once, when its end comes: linear)."""
    ended: bool = False

    def add(self, writer: str, piece: str, at: float) -> None:
        """Text from the follow (`runlog.Echo`'s arguments: its writer, the text with its prefix in it)."""
        *lines, rest = re.split(r"\r\n|[\r\n]", piece)
        parts = self.partial.setdefault(writer, [])
        if lines:
            lines[0] = "".join([*parts, lines[0]])
            parts.clear()
        if rest:
            parts.append(rest)
        for line in lines:
            self._line(line, at)

    def end(self, at: float) -> None:
        """The follow is over: unfinished lines are lines too."""
        for writer in list(self.partial):
            self._line("".join(self.partial.pop(writer)), at)
        self.ended = True

    def _line(self, line: str, at: float) -> None:
        if line.strip():
            self.count += 1
            self.pieces.append((self.count, at, line))
            del self.pieces[: max(0, len(self.pieces) - self.keep)]

    def since(self, seen: int) -> list[tuple[int, float, str]]:
        """The lines after number `seen` (read from another thread than the follow's: a copy first)."""
        return [p for p in list(self.pieces) if p[0] > seen]


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None
