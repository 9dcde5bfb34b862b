"""The straggler verdict of a running job, from what the rank monitors report (node/rankhook/).

In a data-parallel job every rank's step takes as long as the slowest rank's: the gradient all-reduce
waits for it. So the wall time of a step names nobody; what does is each rank's own compute, the part
of the step no collective waits in. A harness training loop times it every step (the forward pass:
`harness.metrics.step_compute`), and the rank monitor writes the last of them into its record as
`compute`: [[step, seconds], ...].

`find_stragglers` is the rule: a rank whose compute time stays above `RATIO` times the median of the
other ranks' at the same step, for `STEPS` steps in a row, is a straggler, named at the step the rule is
met. Pure: tested on records shaped as the monitor writes them. `Named` keeps one run's verdict and its
ranks' step times across a hang watch's polls, each rank named once; the run watch (node/run_watch.py, for
both holders) keeps one, looks again when it says a slow rank is due (`next_look_s`), and writes its
`record()` as the run's `contract.STRAGGLER_RECORD`.

Where the cluster has a shared folder, the rank monitors also write their step times there
(`contract.STEP_TIMES`), and each watch runs `SharedLooks` beside its polls: it reads them on the head node
(the Slurm batch job's watch from its own disk, fab's through the head node's connection) and feeds the same
`Named`. A slow node's answer to a poll takes as long as the node is slow (2 to 3 s at a tenth of a core,
20 steps of such a run); the shared folder's does not. Without a shared folder the polls' records alone feed
the verdict. Both feed it the same step times, so whichever source sees a step first counts it, once.
"""

import bisect
import glob
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from node import contract

RATIO = 1.3
"""A step counts as slow for a rank above this many times the other ranks' median at that step."""
STEPS = 20
"""Slow steps in a row that make a straggler (a one-off pause, a checkpoint or a GC, makes none)."""
TOLERATED_STEPS = 2
"""Single steps not slow that a run of slow steps may hold without starting its count again (not counted:
it still needs `STEPS` slow ones): where the other ranks have a hiccup of their own (a GC, a busy
neighbour: on a shared 2-core machine a healthy rank's forward swings 10 to 120 ms), a throttled rank is
not slower than 1.3x them for that one step. Two such steps in a row end the run."""
KEPT_STEPS = 200
"""How many of its last steps' compute times the monitor writes into a rank's record: more than pass
between two of the watch's looks (every 1 to 10 s) at steps of 50 ms, so the watch misses none."""
HISTORY_STEPS = 400
"""How many of each rank's last steps' compute times a watch's `Named` keeps across its looks."""
MIN_LOOK_S = 0.5
"""The soonest a watch looks again where a rank is slow (each look is a command on every node)."""
SHARED_LOOK_S = 1.0
"""How often `SharedLooks` reads the shared step times of a run where no rank is slow."""
SHARED_MIN_LOOK_S = 0.2
"""The soonest `SharedLooks` reads them again where a rank is slow (a read of small files on the head node)."""
SUSPECT_STEPS = 5
"""Slow steps in a row after which a watch looks again when the rank will have made `STEPS` (fewer: noise,
which would make a healthy run's watch look every `MIN_LOOK_S`)."""


@dataclass(frozen=True)
class Straggler:
    """One rank named slow, with its node and why."""

    rank: int
    node: str
    ratio: float
    """Its compute time over the other ranks' median, the median over the window's steps."""
    first_step: int
    last_step: int
    slow_steps: int = STEPS
    """The window's slow steps (fewer than its steps where it held a tolerated one)."""

    def why(self) -> str:
        span = self.last_step - self.first_step + 1
        steps = f"for {span} steps in a row" if span == self.slow_steps else f"in {self.slow_steps} of {span} steps"
        return f"compute {self.ratio:.1f}x the other ranks' median {steps} (steps {self.first_step}-{self.last_step})"

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


def compute_by_rank(records: list) -> dict:
    """{rank: (node, {step: seconds})} of the ranks' progress records (each with `rank`, `node`, `compute`)."""
    by_rank = {}
    for record in records:
        compute = {int(step): float(seconds) for step, seconds in record.get("compute") or []}
        if compute:
            by_rank[int(record["rank"])] = (str(record.get("node", "")), compute)
    return by_rank


def find_stragglers(records: list, ratio: float = RATIO, steps: int = STEPS) -> list:
    """The stragglers among the ranks' progress records (each with `rank`, `node`, `compute`)."""
    return judge(compute_by_rank(records), ratio, steps)


def judge(by_rank: dict, ratio: float = RATIO, steps: int = STEPS) -> list:
    """The stragglers of {rank: (node, {step: seconds})}: for every step that every rank has reported, each
    rank's compute over the median of the others'. A straggler's window is its first `steps` slow steps in a
    row (with at most TOLERATED_STEPS single steps not slow between them): its last step is the step at
    which the rule was met, whenever the watch looked."""
    found = []
    for rank, node, shares in _shares(by_rank, ratio):
        run: list = []
        for step, share in shares:
            run = _extended(run, step, share, ratio)
            slow = _slow(run, ratio)
            if slow == steps:
                median = statistics.median(s for _, s in run)
                found.append(Straggler(rank, node, median, run[0][0], run[-1][0], slow))
                break
    return found


def _shares(by_rank: dict, ratio: float) -> list:
    """[(rank, node, [(step, its compute over the other ranks' median)])] over the steps every rank reported."""
    if len(by_rank) < 2:
        return []
    common = sorted(set.intersection(*(set(compute) for _, compute in by_rank.values())))
    ordered = {step: sorted(c[step] for _, c in by_rank.values()) for step in common}
    found = []
    for rank, (node, compute) in sorted(by_rank.items()):
        shares = []
        for step in common:
            median = _median_without(ordered[step], compute[step])
            shares.append((step, compute[step] / median if median > 0 else 0.0))
        found.append((rank, node, shares))
    return found


def _median_without(ordered: list, value: float) -> float:
    """The median of the sorted `ordered` less one occurrence of `value` (the other ranks'), without
    building that list: a watch of 128 ranks judges 400 steps of each at every look."""
    skip = bisect.bisect_left(ordered, value)
    size = len(ordered) - 1

    def kept(index: int) -> float:
        return ordered[index] if index < skip else ordered[index + 1]

    middle = size // 2
    return kept(middle) if size % 2 else (kept(middle - 1) + kept(middle)) / 2


def _extended(run: list, step: int, share: float, ratio: float) -> list:
    """The run of slow steps in a row after `step`: a step missing between ends it, and so does a step not
    slow, unless it follows a slow one and the run holds fewer than TOLERATED_STEPS such steps."""
    follows = bool(run) and run[-1][0] == step - 1
    if share > ratio:
        return [*run, (step, share)] if follows else [(step, share)]
    if follows and run[-1][1] > ratio and len(run) - _slow(run, ratio) < TOLERATED_STEPS:
        return [*run, (step, share)]
    return []


def _slow(run: list, ratio: float) -> int:
    return sum(1 for _, share in run if share > ratio)


def slow_so_far(by_rank: dict, ratio: float = RATIO) -> dict:
    """{rank: the slow steps of its run up to the last step every rank reported} of the ranks in a run."""
    found = {}
    for rank, _, shares in _shares(by_rank, ratio):
        run: list = []
        for step, share in shares:
            run = _extended(run, step, share, ratio)
        if run:
            found[rank] = _slow(run, ratio)
    return found


class Named:
    """The ranks named slow in one run so far, each once, in the order they were named. It keeps each
    rank's step times across a watch's polls (`HISTORY_STEPS` of them), so that the verdict counts steps:
    a rank is named with the step at which the rule was met, however many steps pass between two polls
    (the monitor reports its last `KEPT_STEPS`), and `next_look_s` says when a slow rank will have made
    its `STEPS`, for the watch to look then rather than at its next regular poll."""

    def __init__(self) -> None:
        self.by_rank: dict[int, dict] = {}
        self.history: dict[int, tuple[str, dict]] = {}
        self.pace: list = []
        """(monotonic time, the last step every rank reported) at the last two looks that saw a new step."""
        self.lock = threading.RLock()
        """A watch's polls and its `SharedLooks` update it from two threads."""

    def update(self, records: list, said: Callable[[list], None] | None = None) -> list:
        """The stragglers among the ranks' progress records, with every step seen before, not named
        before (now named); `said(fresh)` is called with them before another update can name any."""
        with self.lock:
            self._remember(compute_by_rank(records))
            fresh = [found for found in judge(self.history) if found.rank not in self.by_rank]
            seen = self._last_common_step()
            for found in fresh:
                self.by_rank[found.rank] = {**found.as_dict(), "seen_step": seen, "named_at": round(time.time(), 3)}
            if fresh and said is not None:
                said(fresh)
            return fresh

    def next_look_s(self, regular_s: float, soonest_s: float = MIN_LOOK_S) -> float:
        """Seconds to the next look: `regular_s`, or sooner where an unnamed rank is slow now, at about
        the moment it will have been slow for `STEPS` steps (at most one look every `soonest_s`)."""
        with self.lock:
            slow = slow_so_far(self.history)
            pending = [STEPS - run for rank, run in slow.items() if rank not in self.by_rank and run >= SUSPECT_STEPS]
            if not pending or len(self.pace) < 2:
                return regular_s
            (then, first), (now, last) = self.pace
        step_s = (now - then) / max(last - first, 1)
        return min(regular_s, max(soonest_s, min(pending) * step_s))

    def _remember(self, seen: dict) -> None:
        for rank, (node, compute) in seen.items():
            _, kept = self.history.get(rank, (node, {}))
            kept.update(compute)
            for step in sorted(kept)[:-HISTORY_STEPS]:
                del kept[step]
            self.history[rank] = (node, kept)
        last = self._last_common_step()
        if last is not None and (not self.pace or last > self.pace[-1][1]):
            self.pace = [*self.pace, (time.monotonic(), last)][-2:]

    def _last_common_step(self):
        if len(self.history) < 2:
            return None
        common = set.intersection(*(set(compute) for _, compute in self.history.values()))
        return max(common) if common else None

    def record(self) -> str:
        """The run's straggler record (`contract.STRAGGLER_RECORD`): a JSON list, one object a rank."""
        with self.lock:
            return json.dumps(list(self.by_rank.values()), indent=2) + "\n"


def read_step_times(folder: str) -> list:
    """The ranks' shared step-times records in `folder` (`contract.STEP_TIMES`), on this machine."""
    text = []
    for path in sorted(glob.glob(os.path.join(folder, contract.RANK_PROGRESS_GLOB))):
        try:
            with open(path) as f:
                text.append(f.read())
        except OSError:  # a rank's file replaced while listed: its next write has the steps
            continue
    return contract.json_objects("\n".join(text).splitlines())


class SharedLooks:
    """The straggler verdict's looks at the ranks' step times on the shared folder, on a thread of their own
    beside a hang watch's polls: every `SHARED_LOOK_S`, sooner where a rank is slow (`Named.next_look_s`,
    at most every `SHARED_MIN_LOOK_S`, and never more often than three times a look's own cost: judging
    every rank's history takes about 0.3 s at 128 ranks). `read()` gives the records; `said(fresh)` says the
    ranks named, as the watch's polls do; `then(fresh)`, where given, acts on them afterwards (`--on-straggler
    replace`), outside the verdict's lock, and not once the looks are stopped. A look that fails (the head
    node's connection, a record it cannot judge) is said once, on stderr, and the next one is made."""

    SERVING_S = 5.0
    """`serving` for this long after a look that found step times."""

    def __init__(
        self,
        named: Named,
        read: Callable[[], list],
        said: Callable[[list], None],
        then: Callable[[list], None] | None = None,
    ):
        self.named, self.read, self.said, self.then = named, read, said, then
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="straggler-shared-looks", daemon=True)
        self.found_at: float | None = None
        """When a look last found step times (monotonic)."""
        self.failure = ""

    def start(self) -> "SharedLooks":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop looking, once the look under way is done (a read has its own timeout)."""
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def serving(self) -> bool:
        """A look found step times lately: the watch's polls can keep their pace (else they come sooner where a
        rank is due, as without a shared folder: ranks whose writes fail, a thread that cannot read)."""
        found = self.found_at
        return found is not None and time.monotonic() - found < self.SERVING_S and self.thread.is_alive()

    def _run(self) -> None:
        cost = 0.0
        while not self.stopped.wait(max(self.named.next_look_s(SHARED_LOOK_S, SHARED_MIN_LOOK_S), 3 * cost)):
            began = time.monotonic()
            try:
                records = self.read()
                if records:
                    self.found_at = time.monotonic()
                fresh = self.named.update(records, self.said)
                if fresh and self.then is not None and not self.stopped.is_set():
                    self.then(fresh)
            except Exception as exc:  # noqa: BLE001 - the next look tries again
                failure = f"{type(exc).__name__}: {exc}"
                if failure != self.failure:
                    print(f"straggler verdict: a look at the shared step times failed ({failure})", file=sys.stderr)
                self.failure = failure
            cost = time.monotonic() - began


def named_in(folder: str) -> list:
    """The run's straggler record in its folder ([] where it has none, or one that cannot be read)."""
    try:
        with open(os.path.join(folder, contract.STRAGGLER_RECORD)) as record:
            found = json.load(record)
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []
