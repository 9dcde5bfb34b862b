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


def billed_cluster(ledger: Ledger, stack: str, start: float, end: float | None, instance_type: str = "g4dn.xlarge"):
    """An AWS cluster of 2 nodes of `instance_type` (150 GB roots) as `up` records it, with its billed
    lines at the bundled prices, up from `start` to `end` (None: still up)."""
    from infra.costs import line_records
    from infra.pricing import PriceSource

    estimate = PriceSource().estimate(instance_type, "us-east-1", nodes=2, root_volume_gb=150)
    ledger.cluster_up(stack, "aws", instance_type, 2, estimate.hourly_usd, at=start, lines=line_records(estimate.lines))
    if end is not None:
        ledger.cluster_down(stack, at=end)
    return estimate
