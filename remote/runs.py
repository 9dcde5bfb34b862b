"""A run's records on the operator's side: its rows in the ledger (RunBook, with the heartbeat that
lets the next command close a run whose fab was killed), and its `summary.json` (the schema, written
atomically, read back by `fab logs`)."""

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infra import state
from infra.errors import UsageError
from infra.inventory import ClusterInfo
from infra.ledger import HEARTBEAT_S, Ledger
from infra.timeline import Timeline
from node import billing, contract
from node.outcome import first_failure
from node.run_state import FINAL, RunState
from remote.job_spec import JobSpec
from remote.stream import RankOutcome, node_exited, say

SUMMARY = "summary.json"


class RunBook:
    """Runs into the ledger; a ledger that cannot be written costs a warning, never the launch."""

    def __init__(self, cluster: ClusterInfo):
        self.cluster = cluster
        self.heartbeat: Heartbeat | None = None
        self.ledger: Ledger | None
        try:
            self.ledger = Ledger()
            for warning in self.ledger.warnings:
                say(f"fab: warning: {warning}")
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: the ledger cannot be opened ({exc}); this run is not recorded in it")
            self.ledger = None

    def started(self, run_id: str, task: str, scheduled: bool = False) -> None:
        """A run begins: held by this fab (it heartbeats while it supervises the run), or `scheduled` (held
        by Slurm: no fab owns it, its times come from Slurm when a command sees it end)."""
        self._safely(
            lambda ledger: ledger.run_started(
                run_id,
                self.cluster.stack,
                task,
                len(self.cluster.nodes),
                self.cluster.hourly_usd,
                owner_pid=None if scheduled else os.getpid(),
                scheduled=scheduled,
            )
        )
        if self.ledger is not None and not scheduled:
            self.heartbeat = Heartbeat(self.ledger.path, run_id)
            self.heartbeat.start()

    def hung(self, run_id: str, report) -> None:
        """Record the hang watch's finding, from its own thread (a connection of its own)."""
        if self.ledger is None:
            return
        try:
            ledger = Ledger(self.ledger.path)
            try:
                ledger.run_hung(run_id, report.verdict, report.stalled_since, report.detected_at)
            finally:
                ledger.close()
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: could not record the hang in the ledger ({exc})")

    def ended(self, run: "Run") -> None:
        """Record the end over a connection opened now: a ledger damaged during the run is started over
        here (with the clusters the inventories know), and a run whose row went with it is written again.
        A run held by Slurm gets Slurm's times (it may have queued, or ended while nothing was connected)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.ledger is not None:
            try:
                self.ledger.close()
                self.ledger = Ledger(self.ledger.path)
                for warning in self.ledger.warnings:
                    say(f"fab: warning: {warning}")
            except (sqlite3.Error, OSError) as exc:
                say(f"fab: warning: the ledger cannot be opened ({exc}); this run's end is not recorded in it")
                self.ledger = None
        started, ended = run.started_at, run.ended_at or time.time()  # no start: it ended while it waited
        scheduled = bool(run.job_id)  # held by Slurm: its times are Slurm's

        def record(ledger: Ledger) -> None:
            if ledger.run(run.run_id) is None:
                stack, nodes, hourly = self.cluster.stack, len(run.nodes), self.cluster.hourly_usd
                at = run.submitted_at if started is None else started
                ledger.run_started(run.run_id, stack, run.task, nodes, hourly, at=at, scheduled=scheduled)
            ledger.run_times(run.run_id, started, ended, run.exit_codes)  # the record's times, either holder's
            if not scheduled:
                ledger.run_ended(run.run_id, run.exit_codes, at=ended)  # and no longer abandoned

        self._safely(record)
        self.close()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def _safely(self, write: Callable[[Ledger], Any]) -> Any:
        if self.ledger is None:
            return None
        try:
            return write(self.ledger)
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: could not write the ledger ({exc})")
            return None


class Heartbeat(threading.Thread):
    """Records every HEARTBEAT_S that this fab still supervises its run, so that if it is killed, the
    next command reading the ledger closes the run at the last beat (infra/ledger.py)."""

    def __init__(self, ledger_path: Path, run_id: str):
        super().__init__(name=f"heartbeat-{run_id}", daemon=True)
        self.ledger_path, self.run_id = ledger_path, run_id
        self.stopped = threading.Event()
        self.beating = threading.Event()
        """Set once the thread has its connection (or could not open one)."""

    def run(self) -> None:
        try:
            ledger = Ledger(self.ledger_path)  # a connection of this thread's own
        except (sqlite3.Error, OSError):
            return  # RunBook has warned already; the run's end is still recorded
        finally:
            self.beating.set()
        try:
            while not self.stopped.wait(HEARTBEAT_S):
                try:
                    ledger.heartbeat(self.run_id)
                except (sqlite3.Error, OSError):
                    pass  # a busy or damaged ledger; the next beat may get through
        finally:
            ledger.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


RECORD = "run.json"
"""A run's record in its local run folder."""


def _read_list(path: Path) -> list:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


@dataclass
class Run:
    """What this machine knows of one run, whichever holder holds it (`run.json` in its run folder)."""

    run_id: str
    task: str
    job_id: str
    """The Slurm job ('' for a run held by fab's connections)."""
    log: str
    """The run's log on the head node (absolute; '' where fab's connections bring every line)."""
    nodes: list[str]
    submitted_at: float
    state: str = RunState.PENDING
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    """The run's own exit code: the first failed rank's (its script's), else its node's."""
    requeues: int = 0
    exit_codes: dict = field(default_factory=dict)
    """Each node's own exit code, from its exit marker."""
    finished: bool = False
    """Results fetched, summary written, ledger closed."""
    hang: dict | None = None
    """The hang watch's verdict, where it found one."""
    spec: dict = field(default_factory=dict)
    """What the summary needs of the launch (script, args, workdir, requirements, env names, result cap)."""
    waiting_for: str | None = None
    """While it waits: the nodes out of service it needs (a notice, a lost node, a replacement that failed)."""
    holder: str = "slurm"
    """Who holds it: `slurm`, or `fab` (an attached launch's connections; `owner` is that fab)."""
    rank_exit_codes: dict = field(default_factory=dict)
    """{node: {global rank: exit code}} of the ranks that failed (node/torchrun.py's ranks line)."""
    first_failed: str | None = None
    """The node that failed first (`remote/outcome.py`)."""
    first_failed_by: str = ""
    """The evidence that named it (`rank 1 exited first by its clock`)."""
    without_process_group: list = field(default_factory=list)
    """The nodes none of whose ranks formed a process group."""
    owner: str = ""
    """`host:pid` of the fab that holds a run in its connections."""
    extra: dict = field(default_factory=dict)
    """What only one holder knows, for the summary (fab's hang watch's counts)."""
    participants: str | None = None
    """A running fault-tolerant run's replica groups in its quorum now, of all (`1/2`), from its newest
    contract line in metrics.jsonl."""
    timeline: Timeline | None = None
    """The launch's phases (infra/timeline.py): up to the submit while Slurm holds it, whole once finished."""
    stragglers: list = field(default_factory=list)
    """The ranks the straggler verdict named, with their nodes and why (the hang watch's
    `contract.STRAGGLER_RECORD` in the run folder, read with the record)."""

    @property
    def ended(self) -> bool:
        return self.state in FINAL

    def save(self, folder: Path) -> None:
        data = {**asdict(self), "timeline": self.timeline.as_dict() if self.timeline else None}
        state.write_atomic(folder / RECORD, json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "Run | None":
        try:
            data = json.loads((folder / RECORD).read_text())
            data["timeline"] = Timeline.from_dict(data.get("timeline"))
            data["stragglers"] = _read_list(folder / contract.STRAGGLER_RECORD) or data.get("stragglers") or []
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def end(
        self,
        state_: str,
        exit_codes: dict,
        ranks: dict[str, RankOutcome],
        exited_at: dict[str, float | None] | None = None,
    ) -> None:
        """The run ended `state_`, each node's job with `exit_codes`, its ranks as its ranks line said, its
        job's end by its own clock `exited_at`: the node that failed first and the run's exit code by the one
        rule both holders share (`node/outcome.py`)."""
        self.state, self.exit_codes = state_, dict(exit_codes)
        self.rank_exit_codes = {node: said.exit_codes for node, said in ranks.items() if said.exit_codes}
        first = (
            None
            if state_ == RunState.COMPLETED
            else first_failure(
                self.exit_codes,
                {node: said.exit_codes for node, said in ranks.items()},
                {node: said.exited_at for node, said in ranks.items()},
                exited_at,
                self.nodes,
            )
        )
        if first is not None:
            self.first_failed, self.first_failed_by, self.exit_code = first.node, first.evidence, first.exit_code
        elif state_ == RunState.COMPLETED:
            self.exit_code = 0  # a fault-tolerant run's dropped group is in `dropped`, not its exit code

    def exited(self, node: str) -> str:
        """`node-1 exited 1 (rank 1 exited 3)`: the node's code, and its failed ranks' own."""
        return node_exited(node, self.exit_codes.get(node), RankOutcome(self.rank_exit_codes.get(node) or {}))

    def as_row(self, hourly_usd: float) -> dict:
        """`fab jobs --json`'s object: the contract's keys, then `waiting_for` (null unless it waits for
        nodes out of service: a notice, a lost node, a replacement that failed to join), `holder`, and
        `participants` (a running fault-tolerant run's, e.g. `1/2`; null otherwise)."""
        return {
            "run_id": self.run_id,
            "task": self.task,
            "state": self.state,
            "nodes": self.nodes,
            "submitted_at": iso(self.submitted_at),
            "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at),
            "exit_code": self.exit_code,
            "requeues": self.requeues,
            "cost_usd": round(self.cost_usd(hourly_usd), 6),
            "waiting_for": None if self.ended else self.waiting_for,
            "participants": self.participants if self.state == RunState.RUNNING else None,
            "exit_codes": self.exit_codes,
            "rank_exit_codes": self.rank_exit_codes,
            "holder": self.holder,
            "timeline": self.timeline.as_dict() if self.timeline else None,
            "stragglers": self.stragglers,
        }

    def cost_usd(self, hourly_usd: float) -> float:
        if self.started_at is None:
            return 0.0
        return billing.cost_usd(hourly_usd, max(0.0, (self.ended_at or time.time()) - self.started_at))


def iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")


def spec_facts(spec: JobSpec) -> dict:
    """What a run's record keeps of its launch (names of --env variables only: values may be secrets)."""
    return {
        "script": spec.script if not spec.upload else str(spec.upload),
        "args": spec.args,
        "workdir": str(spec.workdir.root) if spec.workdir else None,
        "requirements": str(spec.requirements.path) if spec.requirements else None,
        "env": sorted(spec.env),
        "max_result_bytes": spec.max_result_bytes,
        "hang": {"timeout_s": spec.hang.timeout_s, "on_hang": spec.hang.on_hang},
        "replicas": spec.replicas,
    }


def summary(cluster: ClusterInfo, run: Run) -> dict:
    """What `summary.json` says of a finished run, whichever holder held it."""
    ended = run.ended_at or time.time()
    started = ended if run.started_at is None else run.started_at  # none: it never started
    summary: dict = {
        "task": run.task,
        "run_id": run.run_id,
        "nodes": run.nodes,
        "state": run.state,
        "holder": run.holder,
        "submitted_at": iso(run.submitted_at),
        "started_at": iso(run.started_at),
        "ended_at": iso(ended),
        "duration_s": round(ended - started, 3),
        "exit_code": run.exit_code,
        "exit_codes": run.exit_codes,
        "rank_exit_codes": run.rank_exit_codes,  # the failed ranks' own codes, by node and global rank
        "requeues": run.requeues,
        "cost_usd": round(run.cost_usd(cluster.hourly_usd), 6),
        "hourly_usd": cluster.hourly_usd,
        **{key: run.spec.get(key) for key in ("script", "args", "workdir", "requirements", "env")},
        **run.extra,
    }
    if run.job_id:
        summary["slurm_job"] = run.job_id
    if run.timeline:
        summary["timeline"] = run.timeline.as_dict()
    if run.hang:
        summary["hang"] = {
            **run.hang,
            "usd_since_stall": round(billing.cost_usd(cluster.hourly_usd, ended - float(run.hang["stalled_at"])), 6)
            if run.hang.get("stalled_at")
            else None,
        }
    return summary


def outcome(cluster: ClusterInfo, run: Run, folder: Path) -> tuple[int, str]:
    """The one rule from a run's end to fab's exit code and last line: 0 for COMPLETED, else 1."""
    where = f"logs: {folder}"
    if run.state == RunState.COMPLETED:
        took = (run.ended_at or time.time()) - (run.started_at or run.submitted_at)
        cost = run.cost_usd(cluster.hourly_usd)
        rate = f"${cluster.hourly_usd:.3f}/h"
        return (
            0,
            f"fab: run {run.run_id} ok in {took:.1f} s, cost ${cost:.4f} ({rate}){alone(run)}{dropped(run)}; {where}",
        )
    failed = [n for n in run.nodes if run.exit_codes.get(n) not in (0, None)]
    codes = ", ".join(run.exited(n) for n in failed)
    if run.state == RunState.HUNG and run.hang:
        verdict = str(run.hang.get("verdict", ""))
        return 1, (
            f"error: run {run.run_id} hung and was stopped on every node ({verdict.split(': ', 1)[-1]}); "
            f"evidence: {run.hang.get('evidence') or folder}; {where}"
        )
    if run.state == RunState.CANCELLED:
        return 1, (
            f"error: run {run.run_id} was stopped from outside ({codes or 'before it started'}: a fab stop, "
            f"the watchdog or a down at the same time); {where}"
        )
    first = run.first_failed or (failed[0] if failed else None)
    if first is None:
        return 1, f"error: run {run.run_id} {run.state.lower()}: exit code {run.exit_code}; {where}"
    why = f", {run.first_failed_by}" if run.first_failed == first and run.first_failed_by else ""
    return 1, (
        f"error: run {run.run_id} failed: {codes} (first: {first}{why}, log: {folder / (first + '.log')}); "
        "the job was stopped on every node"
    )


def alone(run: Run) -> str:
    """Beside "ok": the nodes whose ranks never formed a process group (a script that found no GPU and
    returned 0 did nothing distributed)."""
    nodes = run.without_process_group
    if not nodes:
        return ""
    if len(nodes) == len(run.nodes):
        return ", but no rank joined a process group"
    return f", but no rank on {', '.join(nodes)} joined a process group"


def dropped(run: Run) -> str:
    """Beside "ok": the nodes of the replica groups a fault-tolerant run went on without."""
    nodes = run.extra.get("dropped") or []
    return f", without the replica group(s) on {', '.join(nodes)} (dropped)" if nodes else ""


def runs_of(runs_root: Path) -> list[tuple[Path, Run]]:
    """Every run of the stack with a record here, oldest first."""
    found = []
    if runs_root.is_dir():
        for folder in sorted(runs_root.iterdir()):
            run = Run.load(folder) if folder.is_dir() else None
            if run is not None:
                found.append((folder, run))
    return sorted(found, key=lambda pair: pair[1].submitted_at)


def find(runs_root: Path, run_id: str | None) -> tuple[Path, Run]:
    """The run `--run ID` names (the newest without it); one line, exit 2, when there is none."""
    found = runs_of(runs_root)
    if run_id is None:
        if not found:
            raise UsageError("no run yet: fab run ... (or any launch task)")
        return found[-1]
    for folder, run in found:
        if run.run_id == run_id:
            return folder, run
    known = ", ".join(run.run_id for _, run in found[-3:]) or "none"
    raise UsageError(f"no run {run_id!r} on this stack (latest: {known}); fab jobs lists them")


def write_summary(run_dir: Path, data: dict) -> None:
    """Write the summary; one that cannot be written (a full disk) costs a warning, never the run's outcome."""
    try:
        state.write_atomic(run_dir / SUMMARY, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        say(
            f"fab: warning: could not write {run_dir / SUMMARY} ({exc.strerror or exc}); "
            "the run's exit codes and cost are in the ledger (python deploy.py cost)"
        )


def summary_line(path: Path) -> str:
    """A run's outcome from its summary.json; a damaged one is said so, after its logs were shown."""
    try:
        data = json.loads(path.read_text())
        line = f"exit codes {data['exit_codes']}, {float(data['duration_s']):.1f} s, ${float(data['cost_usd']):.4f}"
        verdict = (data.get("hang") or {}).get("verdict")
        return f"{line}\n{verdict}" if verdict else line  # the hang watch's verdict, where it found one
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return (
            f"{path} is damaged ({type(exc).__name__}: {exc}); the logs above are complete, "
            "and python deploy.py cost has the run's exit codes and cost"
        )


def latest_run(runs: Path) -> Path | None:
    candidates = [p for p in runs.glob("*") if p.is_dir()] if runs.exists() else []
    return max(candidates, key=lambda p: p.name, default=None)
