"""Cost bookkeeping for `deploy.py`: clusters into the ledger, guards for the watchdog, the report.

A cluster that powered itself off (the watchdog's stop marker) is noticed by the next `status`,
`cost` or `down`, which closes its ledger interval at the moment it stopped, with the reason.
"""

import json
import math
import time
from datetime import datetime, timezone

from infra import state
from infra.config import StackConfig
from infra.inventory import ClusterInfo
from infra.ledger import Ledger, LineRecord, billed_seconds
from infra.pricing import PriceSource
from infra.tags import STACK_TAG
from node import billing


def open_ledger(say=print, create: bool = True) -> Ledger | None:
    """The ledger, with its warnings said; None where it does not exist and `create` is False."""
    ledger = Ledger() if create else Ledger.if_exists()
    for warning in ledger.warnings if ledger else ():
        say(f"warning: {warning}")
    return ledger


def save_guards(stack: str, config: StackConfig) -> dict:
    """What the watchdog enforces for this stack (`fab bootstrap` installs it from this file)."""
    guards = {"max_total_usd": config.max_total_usd, "idle_minutes": config.idle_minutes}
    state.write_atomic(state.stack_file(stack, state.GUARDS), json.dumps(guards, indent=2) + "\n")
    return guards


def reference_hourly_usd(instance_type: str, region: str, nodes: int) -> float | None:
    """What `nodes` of `instance_type` would cost per hour (for local clusters, which cost nothing)."""
    try:
        return PriceSource().on_demand(instance_type, region).usd * nodes
    except Exception:  # an unknown type or region only means no comparison is shown
        return None


def record_up(cluster: ClusterInfo, reference_usd: float | None, say=print, lines=()) -> None:
    """The cluster into the ledger, with the lines it is billed for (`pricing.BilledLine`s)."""
    ledger = open_ledger(say)
    assert ledger is not None  # create=True always opens one
    try:
        created = datetime.fromisoformat(cluster.created_at).timestamp()
        ledger.cluster_up(
            cluster.stack,
            cluster.provider,
            cluster.instance_type,
            len(cluster.nodes),
            cluster.hourly_usd,
            reference_usd,
            at=created,
            lines=line_records(lines),
        )
    finally:
        ledger.close()


def line_records(lines) -> tuple[LineRecord, ...]:
    """`pricing.BilledLine`s as the ledger keeps them."""
    return tuple(LineRecord(x.kind, x.usage_type, x.quantity, x.unit, x.unit_usd, x.hourly_usd, x.exact) for x in lines)


def record_down(stack: str, reason: str = "down", at: float | None = None, say=print) -> None:
    """Close the stack's open interval; with no ledger there is none to close."""
    ledger = open_ledger(say, create=False)
    if ledger is None:
        return
    try:
        ledger.cluster_down(stack, reason, at)
    finally:
        ledger.close()


def record_runs_down(ends: dict, at: float, say=print) -> None:
    """The runs `down` found unfinished, into the ledger before it closes the cluster's runs at the down:
    {run id: its batch job's end state (`slurm_run.end_record_state`), or None where it never started (it
    cost nothing: it waited in the queue until `at`)}."""
    ledger = open_ledger(say, create=False) if ends else None
    if ledger is None:
        return
    try:
        for run_id, end in ends.items():
            row = ledger.run(run_id)
            if row is None or row.ended_at is not None:
                continue
            if end is None:
                ledger.run_times(run_id, None, at, None)
            else:
                ledger.run_ended(run_id, {}, at=end["ended_at"])
    finally:
        ledger.close()


def record_self_stop(stack: str, reason, at, say=print) -> None:
    """Close the interval of a cluster that stopped itself, once, at the time it stopped.

    The reason and time come from a stop marker on the nodes, which a job could have written: only a
    number is taken as the time (else now), and the reason is kept as text."""
    if reason:
        is_time = isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
        when = float(at) if is_time else None
        record_down(stack, f"stopped itself: {str(reason)[:200]}", when, say)


def cost_so_far(stack: str, say=print) -> float | None:
    ledger = open_ledger(say, create=False)
    if ledger is None:
        return None
    try:
        cluster = ledger.open_cluster(stack) or next(reversed(ledger.clusters(stack)), None)
        return cluster.cost_usd(time.time()) if cluster else None
    finally:
        ledger.close()


def report(stack: str | None = None, say=print) -> dict:
    """`deploy.py cost --json`: every cluster and run, with totals."""
    ledger = open_ledger(say, create=False)
    now = time.time()
    clusters, runs, events, notes = [], [], [], []
    if ledger is not None:
        try:
            notes = tag_notes(ledger.clusters(), now)
            records = ledger.clusters(stack)
            clusters = [_cluster_row(c, now) for c in records]
            runs = [_run_row(r, now) for r in ledger.runs(stack)]
            events = [_event_row(e, records) for e in ledger.events(stack)]
        finally:
            ledger.close()
    would = [c["would_have_cost_usd"] for c in clusters if c["would_have_cost_usd"] is not None]
    return {
        "clusters": clusters,
        "runs": runs,
        "events": events,
        "total_usd": round(sum(c["cost_usd"] for c in clusters), 6),
        "local_would_have_cost_usd": round(sum(would), 6) if would else None,
        "notes": notes,
    }


def _iso(epoch: float | None) -> str | None:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds") if epoch else None


def _cluster_row(c, now: float) -> dict:
    reference = c.reference_cost_usd(now)  # None but for clusters that recorded what AWS would charge (local)
    return {
        "stack": c.stack,
        "provider": c.provider,
        "instance_type": c.instance_type,
        "nodes": c.nodes,
        "hourly_usd": c.hourly_usd,
        "reference_hourly_usd": c.reference_hourly_usd,
        "up": c.is_up,
        "intervals": [
            {
                "started_at": _iso(i.started_at),
                "ended_at": _iso(i.ended_at),
                "end_reason": i.end_reason,
                "seconds": round(i.seconds(now), 1),
            }
            for i in c.intervals
        ],
        "hours": round(billing.hours(c.seconds(now)), 4),
        "cost_usd": round(c.cost_usd(now), 6),
        "would_have_cost_usd": round(reference, 6) if reference is not None else None,
        "lines": [_line_row(line, c, now) for line in c.lines],
    }


def _line_row(line, c, now: float) -> dict:
    """A billed line of a cluster: how long it was billed (the cluster's intervals) and what that cost."""
    seconds = sum(billed_seconds(i.seconds(now)) for i in c.intervals)
    return {
        "kind": line.kind,
        "usage_type": line.usage_type,
        "quantity": line.quantity,
        "unit": line.unit,
        "unit_usd": line.unit_usd,
        "hours": round(billing.hours(seconds), 4),
        "cost_usd": round(line.cost_usd(seconds), 6),
        "exact": line.exact,
    }


TAG_DELAY_S = 24 * 3600
"""How long AWS billing may take to list a tag key after its first tagged resource, and to show spend under
a newly activated cost-allocation tag."""


def tag_notes(clusters: list, now: float) -> list[str]:
    """Where the first AWS cluster is younger than a day: billing may not list the stack tag yet, so no `up`
    has activated it as a cost-allocation tag, and the bill does not carry it."""
    billed = [c for c in clusters if c.lines]
    first = min((c.created_at for c in billed), default=None)
    if first is None or now - first >= TAG_DELAY_S:
        return []
    return [
        f"the first AWS cluster came up {(now - first) / 3600:.1f} h ago: AWS billing lists the tag {STACK_TAG} "
        "up to 24 h after its first tagged resource, the first `up` after that activates it as a cost-allocation "
        f"tag, and Cost Explorer and the bill show spend under it from then on, not before {_iso(first + TAG_DELAY_S)}"
    ]


def _event_row(e, clusters) -> dict:
    """An interruption or a lost node, priced as the whole cluster's time waiting for the replacement
    (at the hourly price of the stack's cluster that was up then)."""
    hourly = next((c.hourly_usd for c in reversed(clusters) if c.stack == e.stack and c.created_at <= e.at), 0.0)
    return {
        "stack": e.stack,
        "kind": e.kind,
        "node": e.node,
        "at": _iso(e.at),
        "seconds": round(e.seconds, 1),
        "detail": e.detail,
        "cost_usd": round(billing.cost_usd(hourly, e.seconds), 6),
    }


def _run_row(r, now: float) -> dict:
    return {
        "run_id": r.run_id,
        "stack": r.stack,
        "task": r.task,
        "nodes": r.nodes,
        "started_at": _iso(r.started_at),
        "ended_at": _iso(r.ended_at),
        "seconds": round(r.seconds(now), 1),
        "exit_codes": r.exit_codes,
        "cost_usd": round(r.cost_usd(now), 6),
        "end_reason": r.end_reason,
        "hung": r.hang_verdict is not None,
        "hang_verdict": r.hang_verdict,
        "stalled_at": _iso(r.stalled_at),
        "usd_since_stall": None if r.stalled_at is None else round(r.usd_since_stall(now), 6),
    }
