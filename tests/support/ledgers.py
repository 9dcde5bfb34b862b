"""Ledgers as tests need them: damaged as a hand edit or another version's schema leaves one, or written
by a process of their own (a module this small, so that a spawned writer starts in a moment)."""

import sqlite3

from infra.ledger import Ledger


def damage_ledger(path, statement: str) -> None:
    Ledger(path).close()
    db = sqlite3.connect(path)
    db.executescript(statement)
    db.commit()
    db.close()


def write_runs(path, writer: int, count: int) -> None:
    """`count` runs, started and ended, as one `fab` after another would record them."""
    ledger = Ledger(path)
    for i in range(count):
        ledger.run_started(f"w{writer}-{i}", "dev", "hello", 2, 1.0)
        ledger.run_ended(f"w{writer}-{i}", {"node-0": 0})
    ledger.close()
