"""A run's records on the operator's side: its rows in the ledger (RunBook, with the heartbeat that
lets the next command close a run whose fab was killed), and its `summary.json` (the schema, written
atomically, read back by `fab logs`)."""

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra import state
from infra.inventory import ClusterInfo
from infra.ledger import HEARTBEAT_S, Ledger
from node import billing
from remote.launch import JobResult, JobSpec
from remote.stream import say

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

    def started(self, run_id: str, task: str) -> None:
        self._safely(
            lambda ledger: ledger.run_started(
                run_id,
                self.cluster.stack,
                task,
                len(self.cluster.nodes),
                self.cluster.hourly_usd,
                owner_pid=os.getpid(),
            )
        )
        if self.ledger is not None:
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

    def ended(self, run_id: str, exit_codes: dict, duration_s: float, task: str) -> float:
        """Record the end over a connection opened now: a ledger damaged during the run is started over
        here (with the clusters the inventories know), and a run whose row went with it is written again."""
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

        def record(ledger: Ledger) -> float:
            if ledger.run(run_id) is None:
                stack, nodes, hourly = self.cluster.stack, len(self.cluster.nodes), self.cluster.hourly_usd
                ledger.run_started(run_id, stack, task, nodes, hourly, at=time.time() - duration_s)
            return ledger.run_ended(run_id, exit_codes)

        cost = self._safely(record)
        return cost if cost is not None else billing.cost_usd(self.cluster.hourly_usd, duration_s)

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

    def run(self) -> None:
        try:
            ledger = Ledger(self.ledger_path)  # a connection of this thread's own
        except (sqlite3.Error, OSError):
            return  # RunBook has warned already; the run's end is still recorded
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


def summary(cluster: ClusterInfo, spec: JobSpec, result: JobResult, cost_usd: float) -> dict:
    """What `summary.json` says of a finished run (names of --env variables only: values may be secrets)."""
    summary: dict = {
        "task": spec.task,
        "run_id": result.run_id,
        "nodes": [n.name for n in cluster.nodes],
        "started_at": result.started_at,
        "ended_at": result.ended_at,
        "duration_s": round(result.duration_s, 3),
        "exit_codes": result.exit_codes,
        "rank_exit_codes": result.rank_exit_codes,  # the failed ranks' own codes, by node and global rank
        "cost_usd": round(cost_usd, 6),
        "hourly_usd": cluster.hourly_usd,
        "script": spec.script if not spec.upload else str(spec.upload),
        "args": spec.args,
        "workdir": str(spec.workdir.root) if spec.workdir else None,
        "requirements": str(spec.requirements.path) if spec.requirements else None,
        "env": sorted(spec.env),  # names only: values may be secrets, and this file outlives the run
    }
    if result.watch:
        summary["hang_watch"] = result.watch
    if result.hang:
        summary["hang"] = {
            "verdict": result.hang.verdict,
            "stalled_at": result.hang.stalled_since,
            "detected_at": result.hang.detected_at,
            "evidence": str(result.hang.evidence_dir),
            "usd_since_stall": round(billing.cost_usd(cluster.hourly_usd, time.time() - result.hang.stalled_since), 6),
        }
    return summary


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
        return f"exit codes {data['exit_codes']}, {float(data['duration_s']):.1f} s, ${float(data['cost_usd']):.4f}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return (
            f"{path} is damaged ({type(exc).__name__}: {exc}); the logs above are complete, "
            "and python deploy.py cost has the run's exit codes and cost"
        )


def latest_run(runs: Path) -> Path | None:
    candidates = [p for p in runs.glob("*") if p.is_dir()] if runs.exists() else []
    return max(candidates, key=lambda p: p.name, default=None)
