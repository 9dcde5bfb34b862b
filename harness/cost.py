"""What a job costs while it runs, from `$CLUSTER_HOURLY_USD` (the whole cluster's hourly price)."""

import time

from node import billing


class CostMeter:
    """Dollars since the job started, and price-performance."""

    def __init__(self, hourly_usd: float, clock=time.monotonic):
        self.hourly_usd = hourly_usd
        self.clock = clock
        self.started = clock()

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def usd_so_far(self) -> float:
        return billing.cost_usd(self.hourly_usd, self.elapsed_s())

    def usd_per_million_samples(self, samples: int) -> float | None:
        """Cluster dollars per million training samples so far; None before the first sample."""
        if samples <= 0:
            return None
        return self.usd_so_far() / samples * 1e6
