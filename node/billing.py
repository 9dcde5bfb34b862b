"""What time on a cluster costs: hourly price x seconds / 3600, the one formula every meter uses.

The ledger (`deploy.py cost`), the head node's watchdog, the training loop's cost column and `fab`'s
run summaries all price time here. Standard library only, so the harness and infra both import it.
"""

SECONDS_PER_HOUR = 3600.0


def hours(seconds: float) -> float:
    return seconds / SECONDS_PER_HOUR


def cost_usd(hourly_usd: float, seconds: float) -> float:
    """Dollars for `seconds` at `hourly_usd` (no minimum: the ledger applies AWS's per-second billing)."""
    return hourly_usd * seconds / SECONDS_PER_HOUR
