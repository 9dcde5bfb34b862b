"""The straggler verdict of a running job, from what the rank monitors report (node/rankhook/).

In a data-parallel job every rank's step takes as long as the slowest rank's: the gradient all-reduce
waits for it. So the wall time of a step names nobody; what does is each rank's own compute, the part
of the step no collective waits in. A harness training loop times it every step (the forward pass:
`harness.metrics.step_compute`), and the rank monitor writes the last of them into its record as
`compute`: [[step, seconds], ...].

`find_stragglers` is the rule: a rank whose compute time stays above `RATIO` times the median of the
other ranks' at the same step, for `STEPS` steps in a row, is a straggler. Pure: tested on records
shaped as the monitor writes them. `Named` keeps one run's verdict across a hang watch's polls, each rank
named once; both hang watches keep one (fab's, remote/hangwatch.py, and the Slurm batch job's,
node/slurm_run.py), and write its `record()` as the run's `contract.STRAGGLER_RECORD`.
"""

import json
import statistics
import time
from dataclasses import dataclass

RATIO = 1.3
"""A step counts as slow for a rank above this many times the other ranks' median at that step."""
STEPS = 20
"""Slow steps in a row that make a straggler (a one-off pause, a checkpoint or a GC, makes none)."""
KEPT_STEPS = 40
"""How many of its last steps' compute times the monitor writes into a rank's record."""


@dataclass(frozen=True)
class Straggler:
    """One rank named slow, with its node and why."""

    rank: int
    node: str
    ratio: float
    """Its compute time over the other ranks' median, the median over the slow steps."""
    first_step: int
    last_step: int

    def why(self) -> str:
        return (
            f"compute {self.ratio:.1f}x the other ranks' median for {self.last_step - self.first_step + 1} "
            f"steps in a row (steps {self.first_step}-{self.last_step})"
        )

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "ratio": round(self.ratio, 2),
            "steps": [self.first_step, self.last_step],
            "why": self.why(),
        }

    def line(self, run_id: str) -> str:
        return f"STRAGGLER run={run_id}: rank {self.rank} on {self.node}: {self.why()}"


def find_stragglers(records: list, ratio: float = RATIO, steps: int = STEPS) -> list:
    """The stragglers among the ranks' progress records (each with `rank`, `node`, `compute`): for every
    step that every rank has reported, each rank's compute over the median of the others'."""
    by_rank = {}
    for record in records:
        compute = {int(step): float(seconds) for step, seconds in record.get("compute") or []}
        if compute:
            by_rank[int(record["rank"])] = (str(record.get("node", "")), compute)
    if len(by_rank) < 2:
        return []
    common = sorted(set.intersection(*(set(compute) for _, compute in by_rank.values())))
    found = []
    for rank, (node, compute) in sorted(by_rank.items()):
        run: list = []
        best: list = []
        for step in common:
            median = statistics.median(c[step] for r, (_, c) in by_rank.items() if r != rank)
            share = compute[step] / median if median > 0 else 0.0
            if share <= ratio:
                run = []
            elif run and run[-1][0] == step - 1:
                run.append((step, share))
            else:
                run = [(step, share)]
            if len(run) >= len(best):
                best = list(run)
        if len(best) >= steps:
            found.append(Straggler(rank, node, statistics.median(s for _, s in best), best[0][0], best[-1][0]))
    return found


class Named:
    """The ranks named slow in one run so far, each once, in the order they were named."""

    def __init__(self) -> None:
        self.by_rank: dict[int, dict] = {}

    def update(self, records: list) -> list:
        """The stragglers among the ranks' progress records not named before (now named)."""
        fresh = [found for found in find_stragglers(records) if found.rank not in self.by_rank]
        for found in fresh:
            self.by_rank[found.rank] = {**found.as_dict(), "named_at": round(time.time(), 3)}
        return fresh

    def record(self) -> str:
        """The run's straggler record (`contract.STRAGGLER_RECORD`): a JSON list, one object a rank."""
        return json.dumps(list(self.by_rank.values()), indent=2) + "\n"
