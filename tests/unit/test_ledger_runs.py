"""Runs whose `fab` is gone are closed by the next reader of the ledger, at the time they were last seen."""

import os
import sqlite3
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from infra import inventory, state
from infra.ledger import ABANDONED_AFTER_S, Ledger
from remote.runs import Run, RunBook
from tests.support import inventories


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def dead_pid() -> int:
    """A pid that ran on this host and has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_run_whose_fab_died_is_closed_at_its_last_heartbeat(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.run_started("r1", "local", "hello", 2, 3.6, owner_pid=dead_pid())
    clock.now += 10
    ledger.heartbeat("r1")
    clock.now += 400  # hundreds of seconds later someone runs `cost`
    reader = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    run = reader.run("r1")
    assert run.ended_at == 1_000_010.0 and "gone" in run.end_reason
    assert run.cost_usd(clock.now) == 3.6 * 10 / 3600  # not a cent more for the time after


def test_a_live_fab_keeps_its_run_open_until_it_ends_it(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.run_started("r1", "local", "hello", 2, 0.0, owner_pid=os.getpid())
    clock.now += ABANDONED_AFTER_S - 1
    assert Ledger(tmp_path / "ledger.sqlite", clock=clock).run("r1").ended_at is None
    assert ledger.run_ended("r1", {"node-0": 0}) == 0.0
    run = ledger.run("r1")
    assert run.ended_at == clock.now and run.exit_codes == {"node-0": 0} and run.end_reason is None


def test_a_run_not_seen_for_long_is_closed_even_if_its_pid_seems_alive(tmp_path):
    """A pid can be reused, or its fab frozen; the heartbeat decides then. Its own end still wins."""
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.run_started("r1", "local", "hello", 2, 0.0, owner_pid=os.getpid())
    clock.now += ABANDONED_AFTER_S + 1
    assert ledger.close_abandoned_runs() == ["r1"]
    assert ledger.run("r1").ended_at == 1_000_000.0
    ledger.run_ended("r1", {"node-0": 0})  # the fab was only frozen: it records the real end
    assert ledger.run("r1").end_reason is None and ledger.run("r1").ended_at == clock.now


def test_a_ledger_from_before_heartbeats_opens_and_its_open_runs_are_closed(tmp_path):
    path = tmp_path / "ledger.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, cluster_id INTEGER, stack TEXT NOT NULL, task TEXT NOT NULL,"
        " nodes INTEGER NOT NULL, hourly_usd REAL NOT NULL, started_at REAL NOT NULL, ended_at REAL, exit_codes TEXT);"
        "INSERT INTO runs VALUES ('old', NULL, 'local', 'hello', 2, 0.0, 1000.0, NULL, NULL);"
        "INSERT INTO runs VALUES ('done', NULL, 'local', 'hello', 2, 0.0, 1000.0, 1010.0, '{\"node-0\": 0}');"
    )
    db.commit()
    db.close()
    ledger = Ledger(path, clock=Clock(1000.0 + ABANDONED_AFTER_S + 1))
    assert ledger.run("old").ended_at == 1000.0 and ledger.run("old").end_reason
    assert ledger.run("done").ended_at == 1010.0 and ledger.run("done").end_reason is None


def test_a_ledger_damaged_during_a_run_keeps_the_run_and_the_clusters_still_up(state_dir):
    up = inventories.cluster(provider="aws")
    inventory.save(up)  # the stack is up: its inventory says so
    created = datetime.fromisoformat(up.created_at).timestamp()
    Ledger().cluster_up(up.stack, up.provider, up.instance_type, 2, up.hourly_usd, at=created)
    book = RunBook(up)
    book.started("r1", "hello")
    assert book.heartbeat is not None and book.heartbeat.beating.wait(30)  # the run is under way
    path = state.ledger_path()  # damaged mid-run: a full disk, a bad copy
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.write_bytes(b"not a database any more" * 200)

    now = time.time()
    record = Run("r1", "hello", "", "", ["node-0", "node-1"], now - 36, started_at=now - 36, ended_at=now, holder="fab")
    record.end("COMPLETED", {"node-0": 0, "node-1": 0}, {})
    book.ended(record)

    ledger = Ledger()
    run = ledger.run("r1")
    assert run is not None and run.exit_codes == {"node-0": 0, "node-1": 0} and run.task == "hello"
    assert run.cost_usd(now) == pytest.approx(up.hourly_usd * 36 / 3600, rel=0.05)
    cluster = ledger.open_cluster(up.stack)  # still priced, from when it was made, not from the damage
    assert cluster is not None and cluster.created_at == created
    # Set aside once at most: where the run's heartbeat still had the ledger open, sqlite's checkpoint at
    # its close may write the file whole again before anyone finds it damaged.
    assert len(list(path.parent.glob("ledger.sqlite.corrupt-*"))) <= 1


def test_a_scheduled_run_cancelled_while_it_waited_has_no_start_no_exit_codes_and_no_cost(state_dir):
    from infra import costs

    up = inventories.cluster(provider="aws")
    inventory.save(up)
    Ledger().cluster_up(up.stack, up.provider, up.instance_type, 2, up.hourly_usd)
    book = RunBook(up)
    book.started("queued", "hello", scheduled=True)
    now = time.time()
    record = Run("queued", "hello", "7", "/log", ["node-0", "node-1"], now - 60, state="CANCELLED", ended_at=now)
    book.ended(record)  # as `finish` leaves a run that never started: no start, no codes

    run = Ledger().run("queued")
    assert run is not None and run.started_at is None and run.exit_codes is None and run.cost_usd(now + 99) == 0.0
    row = next(r for r in costs.report()["runs"] if r["run_id"] == "queued")
    assert (row["started_at"], row["exit_codes"], row["seconds"], row["cost_usd"]) == (None, None, 0.0, 0.0), row
    assert row["ended_at"] is not None


def test_two_openers_of_a_damaged_ledger_start_it_over_once_and_keep_what_the_first_wrote(state_dir, monkeypatch):
    """A run's heartbeat and its end (or two fab commands) both find the ledger damaged: the second to get
    the repair finds it started over already and opens it, instead of setting the new one aside too."""
    path = state.ledger_path()
    Ledger().close()
    path.write_bytes(b"not a database any more" * 200)
    first = Ledger()  # starts it over
    first.cluster_up("kept", "aws", "g6.xlarge", 2, 1.0)
    first.close()
    opens = {"n": 0}
    real_open = Ledger._open

    def saw_the_damage_first(self):  # the second opener looked while the file was still the damaged one
        opens["n"] += 1
        if opens["n"] == 1:
            raise sqlite3.DatabaseError("file is not a database")
        real_open(self)

    monkeypatch.setattr(Ledger, "_open", saw_the_damage_first)
    second = Ledger()
    assert second.open_cluster("kept") is not None and not second.warnings
    assert len(list(path.parent.glob("ledger.sqlite.corrupt-*"))) == 1
