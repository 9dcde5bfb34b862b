"""`deploy.py cost --reconcile`: the ledger side by side with what AWS billed, by usage type and day.

The bill comes from Cost Explorer (`GetCostAndUsage`, daily, grouped by usage type: once filtered by the
stack's tag, once for spend with no stack tag at all) or from a Data Exports (CUR 2.0) CSV the user
downloaded (`--bill FILE`). Both become `BillRow`s; the comparison does not know which it has.

The ledger's side is each cluster's billed lines (`infra/pricing.py`) spread over the UTC days of its up
intervals. A usage type of the bill is matched to a line by its kind (`kind_of`, the region's prefix
taken off); one that matches no line is itemized as unmatched. Spend that carries no stack tag on a day
a cluster of the stack was up is a leak suspect (a volume left behind, an address kept): named by its
resource id where the bill has one (the CSV does; Cost Explorer's daily view does not).
"""

import csv
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

from infra.errors import UsageError
from infra.ledger import ClusterRecord
from infra.pricing import LINE_KINDS
from infra.tags import STACK_TAG

CE_USD_PER_REQUEST = 0.01
"""What AWS charges for each Cost Explorer API request (https://aws.amazon.com/aws-cost-management/pricing/)."""
WITHIN = 0.02
"""The goal: a final cluster-day of the ledger within 2% of the bill's UnblendedCost."""
CE_REGION = "us-east-1"
MAX_DAYS = 365
DEFAULT_DAYS = 14
REGION_PREFIX = re.compile(r"^(?:(?:[A-Z]{2,4}[0-9]{1,2}|EU)-)+")
KIND_PATTERNS = (
    ("instances", re.compile(r"^(BoxUsage|SpotUsage|DedicatedUsage|HostBoxUsage)")),
    ("ebs", re.compile(r"^EBS:Volume")),
    ("efs storage", re.compile(r"TimedStorage")),
    ("efs throughput", re.compile(r"Throughput|DataAccess")),
    ("public ipv4", re.compile(r"^PublicIPv4:")),
    ("data transfer", re.compile(r"DataTransfer|-(Out|In)-Bytes$")),
)
CUR_COLUMNS = (
    "line_item_usage_start_date",
    "line_item_usage_type",
    "line_item_unblended_cost",
    "line_item_resource_id",
    "resource_tags",
)
CUR_USAGE_ITEMS = {"Usage", "DiscountedUsage", "SavingsPlanCoveredUsage"}


def kind_of(usage_type: str) -> str | None:
    """The ledger line a usage type of the bill belongs to; None: none of the cluster's."""
    bare = REGION_PREFIX.sub("", usage_type)
    return next((kind for kind, pattern in KIND_PATTERNS if pattern.search(bare)), None)


@dataclass(frozen=True)
class BillRow:
    """One day's spend on one usage type, as AWS billed it."""

    day: str
    """YYYY-MM-DD (UTC)."""
    usage_type: str
    cost_usd: float
    """UnblendedCost."""
    tagged: bool
    """Carries the stack's tag (False: no stack tag at all)."""
    estimated: bool = False
    """Cost Explorer's `Estimated`: the day's figures may still change."""
    resource_id: str = ""
    """The resource, where the bill names it (CUR)."""


@dataclass
class Bill:
    """What was read, from where, and what reading it cost."""

    source: str
    rows: list[BillRow]
    requests: int = 0
    """Cost Explorer requests made (each one billed)."""
    notes: list[str] = field(default_factory=list)
    forecast: dict | None = None
    """Cost Explorer's forecast to the month's end beside the ledger's, where a cluster is up."""


# ---------------------------------------------------------------------------------- Cost Explorer


class CostExplorer:
    """The Cost Explorer requests `--reconcile` makes, counted (each costs CE_USD_PER_REQUEST)."""

    def __init__(self, client):
        self.client, self.requests = client, 0

    def cost_and_usage(self, start: date, end: date, where: dict, tagged: bool) -> list[BillRow]:
        """Daily UnblendedCost by usage type in [start, end), every page; `where` is the tag filter."""
        rows, token = [], None
        while True:
            page = self.client.get_cost_and_usage(
                TimePeriod={"Start": start.isoformat(), "End": end.isoformat()},
                Granularity="DAILY",
                Metrics=["UnblendedCost"],
                GroupBy=[{"Type": "DIMENSION", "Key": "USAGE_TYPE"}],
                Filter=where,
                **({"NextPageToken": token} if token else {}),
            )
            self.requests += 1
            for period in page.get("ResultsByTime", []):
                day, estimated = period["TimePeriod"]["Start"][:10], bool(period.get("Estimated"))
                for group in period.get("Groups", []):
                    usd = float(group["Metrics"]["UnblendedCost"]["Amount"])
                    rows.append(BillRow(day, group["Keys"][0], usd, tagged, estimated))
            token = page.get("NextPageToken")
            if not token:
                return rows

    def forecast_usd(self, start: date, end: date, where: dict) -> float | None:
        """Cost Explorer's forecast of UnblendedCost in [start, end); None where it has too little history."""
        try:
            answer = self.client.get_cost_forecast(
                TimePeriod={"Start": start.isoformat(), "End": end.isoformat()},
                Metric="UNBLENDED_COST",
                Granularity="MONTHLY",
                Filter=where,
            )
        except Exception as exc:
            if getattr(exc, "response", {}).get("Error", {}).get("Code") != "DataUnavailableException":
                raise
            return None  # too little history under the tag for a forecast
        finally:
            self.requests += 1
        return float(answer["Total"]["Amount"])

    def stack_tag(self) -> dict | None:
        """The stack tag as billing lists it among cost-allocation tags (`TagKey`, `Status` Active or
        Inactive, `LastUpdatedDate`); None where billing has not seen the key on a resource yet."""
        answer = self.client.list_cost_allocation_tags(TagKeys=[STACK_TAG], Type="UserDefined")
        self.requests += 1
        return next((tag for tag in answer.get("CostAllocationTags", []) if tag.get("TagKey") == STACK_TAG), None)

    def tag_activated_at(self) -> datetime | None:
        """When the stack tag was last made Active as a cost-allocation tag; None where it is not active."""
        tag = self.stack_tag()
        if tag is None or tag.get("Status") != "Active":
            return None
        when = tag.get("LastUpdatedDate") or "0001-01-01T00:00:00Z"  # active, since when unknown
        return datetime.fromisoformat(when.replace("Z", "+00:00"))


def ce_client():
    """Cost Explorer's one endpoint (us-east-1), with the caller's credentials."""
    import boto3

    return boto3.client("ce", region_name=CE_REGION)


def from_cost_explorer(client, stack: str, start: date, end: date, now: datetime, up_hourly_usd: float = 0.0) -> Bill:
    """The stack's tagged spend and the account's untagged spend, daily by usage type; with a cluster up
    (`up_hourly_usd`), Cost Explorer's forecast for the rest of the month beside the ledger's."""
    ce = CostExplorer(client)
    notes = []
    activated = ce.tag_activated_at()
    if activated is None:
        notes.append(
            f"the cost-allocation tag {STACK_TAG} is not active: nothing is billed under it; the first `up` once "
            "billing lists the key (up to 24 h after the first tagged resource) activates it, or Billing > Cost "
            "allocation tags (the payer account's, in an organization); spend shows under it from then on"
        )
    elif now - activated < timedelta(hours=24):
        notes.append(
            f"the cost-allocation tag {STACK_TAG} was activated at {activated.isoformat(timespec='minutes')}: "
            "the bill may show spend under it only from 24 h after that, and count the stack's as untagged until then"
        )
    tag = {"Tags": {"Key": STACK_TAG, "Values": [stack], "MatchOptions": ["EQUALS"]}}
    untagged = {"Tags": {"Key": STACK_TAG, "MatchOptions": ["ABSENT"]}}
    rows = ce.cost_and_usage(start, end, tag, True) + ce.cost_and_usage(start, end, untagged, False)
    forecast = _forecast(ce, tag, now, up_hourly_usd) if up_hourly_usd else None
    return Bill(f"Cost Explorer, {start} to {end - timedelta(days=1)}", rows, ce.requests, notes, forecast)


def _forecast(ce: CostExplorer, tag: dict, now: datetime, hourly_usd: float) -> dict:
    """From now to the month's end: what Cost Explorer forecasts under the tag, and what the ledger would
    charge if the cluster stays up that long."""
    month_end = (now.replace(day=1) + timedelta(days=32)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    forecast = ce.forecast_usd(now.date(), month_end.date(), tag)
    hours = (month_end - now).total_seconds() / 3600
    return {
        "until": month_end.date().isoformat(),
        "ce_usd": None if forecast is None else round(forecast, 2),
        "ledger_usd": round(hourly_usd * hours, 2),
    }


# --------------------------------------------------------------------------------------- CUR 2.0


def from_cur(path: Path, stack: str) -> Bill:
    """A Data Exports (CUR 2.0) CSV: usage line items, with the stack's tag or with none. A row that is not
    what CUR writes (a truncated row, a cost that is no amount of dollars, a day no calendar has, a NUL byte)
    is refused with its line: a reconciliation built on it would print figures nobody can trust."""
    if not path.is_file():
        raise UsageError(f"--bill {path}: no such file; download the CUR 2.0 export's CSV (gunzip it first)")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(_no_nul(handle, path))
            _check_header(reader.fieldnames or [], path)
            rows = []
            for item in reader:
                where = f"--bill {path.name} line {reader.line_num}"
                if None in item or None in item.values():
                    raise UsageError(
                        f"{where}: a row of other than the header's {len(reader.fieldnames or [])} fields "
                        "(a truncated or torn row): download the export again"
                    )
                if (row := _cur_row(item, stack, where)) is not None:
                    rows.append(row)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UsageError(f"--bill {path.name} is not a readable CSV ({exc}): give the CUR 2.0 export's CSV") from None
    final = "invoiced" if all(not r.estimated for r in rows) else "rows of a month not yet invoiced are estimated"
    notes = []
    if not any(r.tagged for r in rows):
        notes.append(
            f"no row of {path.name} carries {STACK_TAG} = {stack}: CUR 2.0 has only activated cost-allocation tags "
            "(see costAllocationTag), from the day they were activated"
        )
    return Bill(f"{path.name} (CUR 2.0; {final})", rows, notes=notes)


def _no_nul(lines, path: Path):
    """The file's lines, refusing a NUL byte (the csv module reads one as text since Python 3.11)."""
    for number, line in enumerate(lines, 1):
        if "\0" in line:
            raise UsageError(f"--bill {path.name} line {number}: a NUL byte; this is not a CSV export as written")
        yield line


def _check_header(names: Sequence[str], path: Path) -> None:
    missing = [c for c in CUR_COLUMNS if c not in names]
    if missing:
        raise UsageError(
            f"--bill {path.name} is not a CUR 2.0 export: it lacks the column(s) {', '.join(missing)} "
            "(export with Data Exports, CUR 2.0, with resource IDs, as CSV)"
        )
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"--bill {path.name}: the column(s) {', '.join(twice)} appear more than once: which counts?")


def _cur_row(item: dict, stack: str, where: str) -> BillRow | None:
    if item.get("line_item_line_item_type", "Usage") not in CUR_USAGE_ITEMS:
        return None  # taxes, credits, refunds: not usage any ledger line could match
    tags = _cur_tags(item.get("resource_tags") or "", where)
    value = next((v for k, v in tags.items() if _tag_name(k) == _tag_name(STACK_TAG)), None)
    if value is not None and value != stack:
        return None  # another stack's
    cost = usd_amount(item["line_item_unblended_cost"] or "0", f"{where}: line_item_unblended_cost")
    day = _day(item["line_item_usage_start_date"] or "", f"{where}: line_item_usage_start_date")
    estimated = "bill_invoice_id" in item and not item["bill_invoice_id"]
    return BillRow(day, item["line_item_usage_type"], cost, value is not None, estimated, item["line_item_resource_id"])


MAX_LINE_USD = 1e9
"""No usage line item of one stack's day comes near a billion dollars: a bigger one is a broken file."""
AMOUNT = re.compile(r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?")


def usd_amount(text: str, what: str) -> float:
    """A usage line item's dollars: a plain decimal, finite, not negative (credits and refunds are
    line item types of their own), below MAX_LINE_USD."""
    if not AMOUNT.fullmatch(text.strip()):
        raise UsageError(f"{what} {text[:40]!r} is not a number")
    usd = float(text)
    if not 0 <= usd < MAX_LINE_USD:
        raise UsageError(f"{what} {text[:40]!r} is not a usage cost (0 to {MAX_LINE_USD:.0e} dollars)")
    return usd


def _day(text: str, what: str) -> str:
    """The UTC day of an ISO-8601 timestamp, a day of the calendar."""
    day = text[:10]
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", day) and date.fromisoformat(day):
            return day
    except ValueError:
        pass
    raise UsageError(f"{what} {text[:40]!r} is not a date")


def _cur_tags(text: str, where: str) -> dict:
    """CUR 2.0's `resource_tags` map, as the CSV export writes it (a JSON object)."""
    if not text.strip():
        return {}
    try:
        tags = json.loads(text)
    except ValueError:
        tags = None
    if not isinstance(tags, dict):
        raise UsageError(f"{where}: resource_tags {text[:40]!r} is not the JSON map CUR 2.0 writes")
    return tags


def _tag_name(key: str) -> str:
    """CUR 2.0 writes a user tag `gpu-cluster:stack` as `user_gpu_cluster_stack` (or keeps it): compare both."""
    return re.sub(r"[^a-z0-9]", "_", key.lower().removeprefix("user_").removeprefix("user:"))


# ------------------------------------------------------------------------------------- comparison


def ledger_by_day(clusters: list[ClusterRecord], now: float) -> dict[tuple[str, str], float]:
    """(day, kind) -> the ledger's dollars: each line's hourly price over the part of each interval in that UTC day."""
    spent: dict[tuple[str, str], float] = defaultdict(float)
    for cluster in clusters:
        for interval in cluster.intervals:
            for day, seconds in _split_by_day(interval.started_at, interval.ended_at or now):
                for line in cluster.lines:
                    spent[(day, line.kind)] += line.cost_usd(seconds)
    return spent


def _split_by_day(start: float, end: float) -> list[tuple[str, float]]:
    parts, at = [], start
    while at < end:
        moment = datetime.fromtimestamp(at, timezone.utc)
        midnight = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc) + timedelta(days=1)
        upto = min(end, midnight.timestamp())
        parts.append((moment.date().isoformat(), upto - at))
        at = upto
    return parts


def compare(stack: str, clusters: list[ClusterRecord], bill: Bill, now: float, since: str = "") -> dict:
    """The comparison `cost --reconcile` prints: per cluster-day, per usage type, estimated rows, leaks;
    the days the stack's clusters were up, from `since` (YYYY-MM-DD) on."""
    today = datetime.fromtimestamp(now, timezone.utc).date().isoformat()
    ledger = {key: usd for key, usd in ledger_by_day(clusters, now).items() if key[0] >= since}
    days = sorted({day for day, _ in ledger})
    in_window = set(days)
    tagged = [r for r in bill.rows if r.tagged and r.day in in_window]
    return {
        "stack": stack,
        "source": bill.source,
        "days": [_day_row(day, ledger, tagged, today) for day in days],
        "usage_types": _kind_rows(ledger, tagged, clusters),
        "unmatched": _unmatched(tagged),
        "estimated_rows": [_bill_row(r) for r in tagged if r.estimated],
        "leak_suspects": [
            _bill_row(r)
            for r in bill.rows
            if not r.tagged and r.day in in_window and r.cost_usd > 0 and kind_of(r.usage_type) is not None
        ],
        "forecast": bill.forecast,
        "ce_requests": bill.requests,
        "ce_cost_usd": round(bill.requests * CE_USD_PER_REQUEST, 2),
        "notes": bill.notes,
    }


def _day_row(day: str, ledger: dict, tagged: list[BillRow], today: str) -> dict:
    ours = sum(usd for (d, _), usd in ledger.items() if d == day)
    billed = sum(r.cost_usd for r in tagged if r.day == day)
    final = day < today and not any(r.estimated for r in tagged if r.day == day)
    share = (ours - billed) / billed if billed else None
    return {
        "day": day,
        "ledger_usd": round(ours, 4),
        "bill_usd": round(billed, 4),
        "difference_usd": round(ours - billed, 4),
        "difference_pct": None if share is None else round(100 * share, 2),
        "final": final,
        "within_2pct": share is not None and abs(share) <= WITHIN,
    }


def _kind_rows(ledger: dict, tagged: list[BillRow], clusters: list[ClusterRecord]) -> list[dict]:
    exact = {line.kind: line.exact for c in clusters for line in c.lines}
    rows = []
    for kind in LINE_KINDS:
        ours = sum(usd for (_, k), usd in ledger.items() if k == kind)
        mine = [r for r in tagged if kind_of(r.usage_type) == kind]
        if kind not in exact and not mine:
            continue
        billed = sum(r.cost_usd for r in mine)
        rows.append(
            {
                "kind": kind,
                "usage_types": sorted({r.usage_type for r in mine}),
                "ledger_usd": round(ours, 4),
                "bill_usd": round(billed, 4),
                "difference_usd": round(ours - billed, 4),
                "exact": exact.get(kind, False),
            }
        )
    return rows


def _unmatched(tagged: list[BillRow]) -> list[dict]:
    """The stack's spend on usage types no ledger line covers, by usage type."""
    totals: dict[str, float] = defaultdict(float)
    for row in tagged:
        if kind_of(row.usage_type) is None:
            totals[row.usage_type] += row.cost_usd
    return [{"usage_type": usage, "bill_usd": round(usd, 4)} for usage, usd in sorted(totals.items())]


def _bill_row(row: BillRow) -> dict:
    return {**asdict(row), "cost_usd": round(row.cost_usd, 4)}


# ------------------------------------------------------------------------------------------ entry


def reconcile(ledger, stack: str, days: int | None, bill_path: Path | None, ce_client, now: float) -> dict:
    """`cost --reconcile` for one AWS stack: `ledger` read, the bill read (the CSV, else Cost Explorer
    through `ce_client()`, made only when needed), compared over the last `days` days (all, for a CSV without)."""
    clusters = [c for c in ledger.clusters(stack) if c.lines] if ledger is not None else []
    if not clusters:
        raise UsageError(
            f"the ledger has no AWS cluster of stack '{stack}' to compare with a bill: "
            "python deploy.py cost lists the stacks it has"
        )
    today = datetime.fromtimestamp(now, timezone.utc).date()
    since = "" if days is None else (today - timedelta(days=days)).isoformat()
    if bill_path is not None:
        bill = from_cur(bill_path, stack)
    else:
        start = today - timedelta(days=days or DEFAULT_DAYS)
        up_hourly = sum(c.hourly_usd for c in clusters if c.is_up)
        moment = datetime.fromtimestamp(now, timezone.utc)
        bill = from_cost_explorer(ce_client(), stack, start, today + timedelta(days=1), moment, up_hourly)
        since = start.isoformat()
    return compare(stack, clusters, bill, now, since)


def figures(data: dict, now: float) -> dict:
    """A comparison (`compare`) in a few figures, label to value, for the dashboard: the days compared,
    the ledger and the bill over them, their difference, the rows still estimated and the suspects."""
    ledger = sum(day["ledger_usd"] for day in data["days"])
    billed = sum(day["bill_usd"] for day in data["days"])
    return {
        "reconciled at": datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "source": data["source"],
        "days": len(data["days"]),
        "ledger": f"${ledger:.2f}",
        "bill": f"${billed:.2f}",
        "difference": f"{100 * (ledger - billed) / billed:+.2f}%" if billed else "n/a (nothing billed yet)",
        "estimated rows": len(data["estimated_rows"]),
        "leak suspects": len({row.get("resource_id") or row.get("usage_type") for row in data["leak_suspects"]}),
    }


def check_days(days: int) -> int:
    if not 1 <= days <= MAX_DAYS:
        raise UsageError(f"--days {days}: give the days to compare, 1..{MAX_DAYS} (Cost Explorer keeps 14 months)")
    return days
