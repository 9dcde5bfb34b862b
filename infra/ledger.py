"""The cost ledger, `.cluster/ledger.sqlite`: every cluster's up/down intervals, the lines it is billed
for (instances, volumes, addresses, EFS, transfer: their hours are the intervals), and every run.

Written by `deploy.py` (up, down, and when it notices a cluster stopped itself) and by every `fab`
launch. Each write is one transaction (BEGIN IMMEDIATE), so a crash mid-write leaves the ledger as it
was, and two writers at once wait for each other (WAL journal, busy timeout) instead of failing. A
ledger that is not one any more (not a database, another schema, a row that does not read back) is
kept as `ledger.sqlite.corrupt-<time>` and a new one started. The file is created 0600 (SQLite gives its
-wal and -shm files the same mode); reading commands never create it.

Costs: a cluster is billed per second while up, with a minimum of one minute per interval (EC2 Linux
on-demand billing); a run costs the cluster's hourly rate for its duration. Standard library only
(remote/ writes runs through it too).

A run whose `fab` was killed (SIGKILL, a closed laptop) would stay open and keep costing: each
supervising `fab` records its host and pid and a heartbeat, and whoever opens the ledger next closes
the runs whose owner is gone, at the time the owner was last seen.
"""

import fcntl
import json
import os
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from infra import inventory, state
from infra.errors import UsageError
from node import procfs
from node.billing import cost_usd

IDLE_LOOKBACK_S = 900.0
"""How long before a run's restart an interruption may have begun to be the one that held it (`run_idle`)."""

MINIMUM_BILLED_S = 60
HEARTBEAT_S = 5
"""How often a supervising fab records that its run is alive."""
ABANDONED_AFTER_S = 12 * HEARTBEAT_S
"""A run not seen for this long is over, even where its owner's pid seems alive (reused, or frozen)."""
RUN_OWNER_COLUMNS = {
    "owner_host": "TEXT",
    "owner_pid": "INTEGER",
    "last_seen_at": "REAL",
    "end_reason": "TEXT",
    # a run the hang watch found hung: its verdict, when progress stopped, when it was found
    "hang_verdict": "TEXT",
    "stalled_at": "REAL",
    "hang_detected_at": "REAL",
    # 1 for a run that ended before it ever started (cancelled while it waited): no start, no exit codes
    "never_started": "INTEGER",
}
SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
    id INTEGER PRIMARY KEY,
    stack TEXT NOT NULL,
    provider TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    nodes INTEGER NOT NULL,
    hourly_usd REAL NOT NULL,
    reference_hourly_usd REAL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS intervals (
    id INTEGER PRIMARY KEY,
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    started_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    cluster_id INTEGER REFERENCES clusters(id),
    stack TEXT NOT NULL,
    task TEXT NOT NULL,
    nodes INTEGER NOT NULL,
    hourly_usd REAL NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    exit_codes TEXT
);
CREATE TABLE IF NOT EXISTS billed_lines (
    id INTEGER PRIMARY KEY,
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    kind TEXT NOT NULL,
    usage_type TEXT NOT NULL,
    quantity REAL NOT NULL,
    unit TEXT NOT NULL,
    unit_usd REAL NOT NULL,
    hourly_usd REAL NOT NULL,
    exact INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    stack TEXT NOT NULL,
    kind TEXT NOT NULL,
    node TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL,
    seconds REAL NOT NULL
);
"""  # runs also get RUN_OWNER_COLUMNS, added where an older ledger lacks them


def billed_seconds(seconds: float) -> float:
    return max(seconds, MINIMUM_BILLED_S)


@dataclass
class Interval:
    """A stretch of time a cluster was up."""

    started_at: float
    """Epoch seconds."""
    ended_at: float | None
    """Epoch seconds; None while it is still up."""
    end_reason: str | None
    """down, or why it stopped itself."""

    def seconds(self, now: float) -> float:
        return (self.ended_at or now) - self.started_at


@dataclass(frozen=True)
class LineRecord:
    """One billed line of a cluster (`infra.pricing.BilledLine` as recorded): it is billed while the
    cluster is up, so its hours are the cluster's intervals."""

    kind: str
    usage_type: str
    """The AWS usage type, without the region's prefix."""
    quantity: float
    """Instances, GB, addresses, or GB moved per hour."""
    unit: str
    unit_usd: float
    hourly_usd: float
    exact: bool
    """False: an estimate (EFS, data transfer), whose quantity was assumed."""

    def cost_usd(self, seconds: float) -> float:
        return cost_usd(self.hourly_usd, seconds)


@dataclass
class ClusterRecord:
    """A cluster as the ledger knows it, with its cost."""

    id: int
    stack: str
    provider: str
    instance_type: str
    nodes: int
    hourly_usd: float
    reference_hourly_usd: float | None
    created_at: float
    intervals: list[Interval] = field(default_factory=list)
    lines: list[LineRecord] = field(default_factory=list)
    """What it is billed for, line by line; empty for clusters that AWS does not bill (local, hosts)."""

    def seconds(self, now: float) -> float:
        return sum(i.seconds(now) for i in self.intervals)

    def cost_usd(self, now: float) -> float:
        return sum(cost_usd(self.hourly_usd, billed_seconds(i.seconds(now))) for i in self.intervals)

    def reference_cost_usd(self, now: float) -> float | None:
        """What the same hours cost on the instance type (for local clusters, which cost nothing)."""
        if self.reference_hourly_usd is None:
            return None
        return sum(cost_usd(self.reference_hourly_usd, billed_seconds(i.seconds(now))) for i in self.intervals)

    @property
    def is_up(self) -> bool:
        return any(i.ended_at is None for i in self.intervals)


@dataclass
class RunRecord:
    """One launch."""

    run_id: str
    stack: str
    task: str
    nodes: int
    hourly_usd: float
    started_at: float | None
    """None: it never started (cancelled while it waited in the queue); it cost nothing."""
    ended_at: float | None
    exit_codes: dict | None
    end_reason: str | None = None
    """Why a run ended without its fab, e.g. that fab's process was gone."""
    hang_verdict: str | None = None
    """The hang watch's verdict line, where the run hung."""
    stalled_at: float | None = None
    """When a hung run's progress stopped."""

    def seconds(self, now: float) -> float:
        return 0.0 if self.started_at is None else (self.ended_at or now) - self.started_at

    def cost_usd(self, now: float) -> float:
        return cost_usd(self.hourly_usd, self.seconds(now))

    def usd_since_stall(self, now: float) -> float | None:
        """What the cluster cost from the moment a hung run stopped making progress to its end."""
        if self.stalled_at is None:
            return None
        return cost_usd(self.hourly_usd, max(0.0, (self.ended_at or now) - self.stalled_at))


SCHEDULED_OWNER = "slurm"
"""`owner_host` of a run held by the cluster's scheduler: never closed as abandoned."""


@dataclass(frozen=True)
class Event:
    """Something that happened to a node: a `spot interruption` or a `node lost`, and its replacement."""

    stack: str
    kind: str
    node: str
    detail: str
    """What was done (`replaced; rejoined in 9 s`, or why the replacement failed)."""
    at: float
    """When the node was found gone."""
    seconds: float
    """From then until its replacement rejoined (or gave up): what the cluster paid waiting."""


class Ledger:
    """The ledger file; every public method is one transaction."""

    def __init__(self, path: Path | None = None, clock=time.time):
        self.path = path or state.ledger_path()
        self.clock = clock
        self.warnings: list[str] = []
        state.make_private_dir(self.path.parent)
        try:
            self._open()
        except sqlite3.DatabaseError:
            self._close_quietly()
            # One repairer at a time (two fab commands, a run's heartbeat): the one that waited finds the
            # ledger started over already and opens it, instead of putting the new one aside as corrupt too.
            with open(self.path.with_name(f"{self.path.name}.repair.lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    self._open()
                except sqlite3.DatabaseError as exc:
                    self._start_over(exc)

    @classmethod
    def if_exists(cls, path: Path | None = None, clock=time.time) -> "Ledger | None":
        """The ledger for reading, or None where there is none yet (reading creates nothing)."""
        path = path or state.ledger_path()
        return cls(path, clock) if path.exists() else None

    @classmethod
    def read_only(cls, path: Path | None = None, clock=time.time) -> "Ledger | None":
        """The ledger for a reader that must never hold up or change it (the dashboard): SQLite's read-only
        mode, no schema, repair or abandoned-run sweep, no lock file (a WAL reader blocks no writer); None
        where there is none yet."""
        path = path or state.ledger_path()
        if not path.exists():
            return None
        ledger = cls.__new__(cls)
        ledger.path, ledger.clock, ledger.warnings = path, clock, []
        ledger.db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5, isolation_level=None)
        return ledger

    def _open(self) -> None:
        if not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, state.PRIVATE_FILE_MODE))
        self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA busy_timeout = 30000")
        if self.db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        self.db.execute("PRAGMA journal_mode = WAL")
        with self._transaction():
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self.db.execute(statement)
            self._add_run_owner_columns()
        _check_schema(self.db)
        _check_rows(self.db)
        self.close_abandoned_runs()

    def _add_run_owner_columns(self) -> None:
        present = {row[1] for row in self.db.execute("PRAGMA table_info(runs)")}
        for name, kind in RUN_OWNER_COLUMNS.items():
            if name not in present:
                self.db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")

    def _close_quietly(self) -> None:
        try:
            self.db.close()
        except Exception:  # the connection may never have opened
            pass

    def _start_over(self, exc: Exception) -> None:
        backup = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        self._close_quietly()
        os.replace(self.path, backup)
        os.chmod(backup, 0o600)  # kept in the state folder, private like the rest of it
        for suffix in ("-wal", "-shm"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)
        self._open()
        recovered = self._recover_clusters_up()
        again = (
            f"; the clusters still up ({', '.join(recovered)}) are priced again from their inventories"
            if recovered
            else ""
        )
        self.warnings.append(
            f"the ledger {self.path} was corrupt ({exc}); kept it as {backup.name} and started a new one{again}"
        )

    def _recover_clusters_up(self) -> list[str]:
        """In a new ledger, the clusters whose inventory says they are up, from the time each was created:
        their hours go on being priced (the runs of the old ledger are in its backup)."""
        recovered = []
        for stack in state.stacks_up():
            try:
                cluster = inventory.load(stack)
                created = datetime.fromisoformat(cluster.created_at).timestamp()
            except (UsageError, ValueError, TypeError):
                continue
            if self.open_cluster(stack) is None:
                self.cluster_up(
                    stack, cluster.provider, cluster.instance_type, len(cluster.nodes), cluster.hourly_usd, at=created
                )
                recovered.append(stack)
        return recovered

    def _transaction(self):
        return _Transaction(self.db)

    # ------------------------------------------------------------------------------------ events

    def event(self, stack: str, kind: str, node: str, detail: str, at: float, seconds: float) -> None:
        """Something that happened to a node of the cluster (a spot interruption, a node lost), and how
        long the cluster waited for it (until its replacement rejoined)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO events (stack, kind, node, detail, at, seconds) VALUES (?, ?, ?, ?, ?, ?)",
                (stack, kind, node, detail, at, seconds),
            )

    def run_idle(self, stack: str, node: str, stopped_at: float | None, restarted_at: float) -> bool:
        """A run that stood idle from `stopped_at` (its requeue; None: when the node was found gone) until it
        started again at `restarted_at`: the interruption of `node` before that restart (found gone at most
        IDLE_LOOKBACK_S earlier) is widened to that whole wait (the cluster paid
        for the run's idle time, not only for the replacement). False where no such interruption is recorded."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT id, at, seconds FROM events WHERE stack = ? AND node = ? AND at <= ? AND at >= ?"
                " ORDER BY at DESC LIMIT 1",
                (stack, node, restarted_at, restarted_at - IDLE_LOOKBACK_S),
            ).fetchone()
            if row is None:
                return False
            event_id, at, seconds = row
            start = min(at, stopped_at) if stopped_at is not None else at
            end = max(at + seconds, restarted_at)
            db.execute("UPDATE events SET at = ?, seconds = ? WHERE id = ?", (start, end - start, event_id))
        return True

    def events(self, stack: str | None = None) -> list[Event]:
        rows = self.db.execute(
            "SELECT stack, kind, node, detail, at, seconds FROM events WHERE ? IS NULL OR stack = ? ORDER BY at, id",
            (stack, stack),
        ).fetchall()
        return [Event(*row) for row in rows]

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------------------------- clusters

    def cluster_up(
        self,
        stack: str,
        provider: str,
        instance_type: str,
        nodes: int,
        hourly_usd: float,
        reference_hourly_usd: float | None = None,
        at: float | None = None,
        lines: tuple[LineRecord, ...] = (),
    ) -> int:
        """A cluster came up at `at`, billed for `lines` (which sum to `hourly_usd` on AWS). An interval of the
        stack still open (its state deleted with no `down`: a stack has one cluster at a time) ends here, so
        no hour is billed twice."""
        at = self.clock() if at is None else at
        with self._transaction():
            self.db.execute(
                "UPDATE intervals SET ended_at = MAX(?, started_at), end_reason = ? WHERE ended_at IS NULL AND "
                "cluster_id IN (SELECT id FROM clusters WHERE stack = ?)",
                (at, "a new up of the stack", stack),
            )
            cursor = self.db.execute(
                "INSERT INTO clusters"
                " (stack, provider, instance_type, nodes, hourly_usd, reference_hourly_usd, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stack, provider, instance_type, nodes, hourly_usd, reference_hourly_usd, at),
            )
            cluster_id = int(cursor.lastrowid or 0)  # set after every INSERT
            self.db.execute("INSERT INTO intervals (cluster_id, started_at) VALUES (?, ?)", (cluster_id, at))
            self.db.executemany(
                "INSERT INTO billed_lines (cluster_id, kind, usage_type, quantity, unit, unit_usd, hourly_usd, exact)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (cluster_id, x.kind, x.usage_type, x.quantity, x.unit, x.unit_usd, x.hourly_usd, int(x.exact))
                    for x in lines
                ],
            )
        return cluster_id

    def cluster_down(self, stack: str, reason: str = "down", at: float | None = None) -> bool:
        """Close the stack's open interval, and its runs still open (nothing runs on a cluster that is down:
        a run held by Slurm that no fab saw end is priced up to here); False if no interval was open."""
        at = self.clock() if at is None else at
        with self._transaction():
            cursor = self.db.execute(
                "UPDATE intervals SET ended_at = MAX(?, started_at), end_reason = ? WHERE ended_at IS NULL AND "
                "cluster_id IN (SELECT id FROM clusters WHERE stack = ?)",
                (at, reason, stack),
            )
            self.db.execute(
                "UPDATE runs SET ended_at = MAX(?, started_at), end_reason = ? WHERE ended_at IS NULL AND stack = ?",
                (at, f"ended with its cluster ({reason})", stack),
            )
        return cursor.rowcount > 0

    def clusters(self, stack: str | None = None) -> list[ClusterRecord]:
        rows = self.db.execute(
            "SELECT id, stack, provider, instance_type, nodes, hourly_usd, reference_hourly_usd, created_at"
            " FROM clusters" + (" WHERE stack = ?" if stack else "") + " ORDER BY created_at, id",
            (stack,) if stack else (),
        ).fetchall()
        records = [ClusterRecord(*row) for row in rows]
        for record in records:
            record.intervals = [
                Interval(*row)
                for row in self.db.execute(
                    "SELECT started_at, ended_at, end_reason FROM intervals WHERE cluster_id = ? ORDER BY started_at",
                    (record.id,),
                )
            ]
            record.lines = [
                LineRecord(kind, usage, quantity, unit, unit_usd, hourly, bool(exact))
                for kind, usage, quantity, unit, unit_usd, hourly, exact in self.db.execute(
                    "SELECT kind, usage_type, quantity, unit, unit_usd, hourly_usd, exact FROM billed_lines"
                    " WHERE cluster_id = ? ORDER BY id",
                    (record.id,),
                )
            ]
        return records

    def open_cluster(self, stack: str) -> ClusterRecord | None:
        up = [c for c in self.clusters(stack) if c.is_up]
        return up[-1] if up else None

    # -------------------------------------------------------------------------------------- runs

    def run_started(
        self,
        run_id: str,
        stack: str,
        task: str,
        nodes: int,
        hourly_usd: float,
        at: float | None = None,
        owner_pid: int | None = None,
        scheduled: bool = False,
    ) -> None:
        """Record a run; `owner_pid` (on this host) is the fab that supervises it and heartbeats. A
        `scheduled` run is held by Slurm on the cluster: no fab owns it, and its times come from Slurm
        (`run_times`) whenever a command sees it end."""
        at = self.clock() if at is None else at
        cluster = self.open_cluster(stack)
        with self._transaction():
            self.db.execute(
                "INSERT OR REPLACE INTO runs (run_id, cluster_id, stack, task, nodes, hourly_usd, started_at,"
                " owner_host, owner_pid, last_seen_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    cluster.id if cluster else None,
                    stack,
                    task,
                    nodes,
                    hourly_usd,
                    at,
                    SCHEDULED_OWNER if scheduled else socket.gethostname() if owner_pid else None,
                    owner_pid,
                    at,
                ),
            )

    def heartbeat(self, run_id: str, at: float | None = None) -> None:
        """The run's owner is alive now."""
        at = self.clock() if at is None else at
        with self._transaction():
            self.db.execute("UPDATE runs SET last_seen_at = ? WHERE run_id = ? AND ended_at IS NULL", (at, run_id))

    def run_hung(self, run_id: str, verdict: str, stalled_at: float, detected_at: float) -> None:
        """The hang watch found this run hung: what it said, when progress stopped, when it was found."""
        with self._transaction():
            self.db.execute(
                "UPDATE runs SET hang_verdict = ?, stalled_at = ?, hang_detected_at = ? WHERE run_id = ?",
                (verdict, stalled_at, detected_at, run_id),
            )

    def close_abandoned_runs(self, now: float | None = None) -> list[str]:
        """Close open runs whose fab is gone (its pid dead on this host, or not seen for
        ABANDONED_AFTER_S) at the time it was last seen; the run ids closed."""
        now = self.clock() if now is None else now
        host = socket.gethostname()
        rows = self.db.execute(
            "SELECT run_id, owner_host, owner_pid, seen FROM (SELECT *, COALESCE(last_seen_at, started_at) AS seen"
            " FROM runs WHERE ended_at IS NULL AND COALESCE(owner_host, '') != ?)"
            " WHERE typeof(seen) IN ('real', 'integer')",
            (SCHEDULED_OWNER,),
        ).fetchall()
        closed = []
        for run_id, owner_host, owner_pid, last_seen in rows:
            mine = owner_host == host and owner_pid is not None
            if mine and not procfs.alive(owner_pid):
                reason = f"its fab (pid {owner_pid}) was gone; closed at its last heartbeat"
            elif now - last_seen > ABANDONED_AFTER_S:
                reason = f"its fab was not seen for {now - last_seen:.0f} s; closed when it was last seen"
            else:
                continue
            with self._transaction():
                self.db.execute(
                    "UPDATE runs SET ended_at = ?, end_reason = ? WHERE run_id = ? AND ended_at IS NULL",
                    (last_seen, reason, run_id),
                )
            closed.append(run_id)
        return closed

    def run_ended(self, run_id: str, exit_codes: dict, at: float | None = None) -> float:
        """Record the end; returns the run's cost."""
        at = self.clock() if at is None else at
        with self._transaction():
            self.db.execute(
                "UPDATE runs SET ended_at = ?, exit_codes = ?, end_reason = NULL WHERE run_id = ?",
                (at, json.dumps(exit_codes), run_id),
            )
        run = self.run(run_id)
        return run.cost_usd(at) if run else 0.0

    def run_times(self, run_id: str, started_at: float | None, ended_at: float | None, exit_codes: dict | None) -> None:
        """A scheduled run's times as Slurm has them (it may have queued, or ended while nothing was
        connected); `ended_at` None while it runs; `started_at` None: it ended without ever starting
        (no start, no exit codes, no cost; its row keeps the submission time to sort by)."""
        with self._transaction():
            if started_at is None:
                self.db.execute(
                    "UPDATE runs SET never_started = 1, last_seen_at = ?, ended_at = ?, exit_codes = NULL "
                    "WHERE run_id = ?",
                    (ended_at, ended_at, run_id),
                )
                return
            self.db.execute(
                "UPDATE runs SET started_at = ?, last_seen_at = ?, ended_at = ?, exit_codes = ? WHERE run_id = ?",
                (started_at, started_at, ended_at, json.dumps(exit_codes) if exit_codes is not None else None, run_id),
            )

    def run(self, run_id: str) -> RunRecord | None:
        runs = self.runs(run_id=run_id)
        return runs[0] if runs else None

    def runs(self, stack: str | None = None, run_id: str | None = None) -> list[RunRecord]:
        where, args = [], []
        if stack:
            where.append("stack = ?")
            args.append(stack)
        if run_id:
            where.append("run_id = ?")
            args.append(run_id)
        rows = self.db.execute(
            "SELECT run_id, stack, task, nodes, hourly_usd, CASE WHEN never_started = 1 THEN NULL ELSE started_at END,"
            " ended_at, exit_codes, end_reason, hang_verdict, stalled_at FROM runs"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY started_at",
            args,
        ).fetchall()
        return [
            RunRecord(*row[:7], json.loads(row[7]) if row[7] else None, *row[8:])  # type: ignore[call-arg]
            for row in rows  # the SELECT lists RunRecord's fields in order; mypy cannot count a row's columns
        ]


def _expected_columns() -> dict[str, dict[str, str]]:
    """table -> column -> declared type, as SCHEMA makes them."""
    scratch = sqlite3.connect(":memory:")
    try:
        scratch.executescript(SCHEMA)
        return _columns(scratch)
    finally:
        scratch.close()


def _columns(db: sqlite3.Connection) -> dict[str, dict[str, str]]:
    tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: {row[1]: row[2].upper() for row in db.execute(f'PRAGMA table_info("{t}")')} for t in tables}


def _check_schema(db: sqlite3.Connection) -> None:
    """Our tables have our columns (CREATE TABLE IF NOT EXISTS keeps a same-named table of another schema)."""
    found = _columns(db)
    for table, columns in _expected_columns().items():
        for column, kind in columns.items():
            if found.get(table, {}).get(column) != kind:
                raise sqlite3.DatabaseError(f"another schema: table {table} has no {kind} column {column}")


# SQLite stores whatever a row is given; these are the storage classes each column may hold.
_STORAGE = {"INTEGER": "'integer'", "REAL": "'integer', 'real'", "TEXT": "'text'"}


def _check_rows(db: sqlite3.Connection) -> None:
    """Every row reads back as the ledger wrote it: numbers are numbers, exit codes a JSON object."""
    for table, columns in _expected_columns().items():
        for column, kind in columns.items():
            bad = db.execute(
                f'SELECT count(*) FROM "{table}" WHERE "{column}" IS NOT NULL AND '
                f'typeof("{column}") NOT IN ({_STORAGE[kind]})'
            ).fetchone()[0]
            if bad:
                raise sqlite3.DatabaseError(f"{bad} row(s) of {table} hold a non-{kind} {column}")
    for run_id, text in db.execute("SELECT run_id, exit_codes FROM runs WHERE exit_codes IS NOT NULL"):
        try:
            codes = json.loads(text)
        except ValueError:
            codes = None
        if not isinstance(codes, dict):
            raise sqlite3.DatabaseError(f"run {run_id}: exit_codes is not a JSON object")


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error: all of a write or none of it."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, value, traceback):
        self.db.execute("ROLLBACK" if kind else "COMMIT")
        return False
