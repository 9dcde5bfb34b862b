"""What `deploy.py` prints: summaries and tables, built from plain data so they can be tested."""

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from infra import hints
from infra.inventory import ClusterInfo, NodeStatus
from infra.pricing import describe_quantity
from node.run_state import RunState

# The terminal's width, or a wide page when piped (logs, CI), so tables are not wrapped into columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def relative(path: str | Path) -> str:
    """`path` relative to the working directory when it is below it (shorter to read and paste)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def up_summary(cluster: ClusterInfo, created: bool, elapsed_s: float, inventory_path: Path) -> None:
    gpus = sum(n.gpus for n in cluster.nodes)
    kind = f"{cluster.instance_type}, {gpus} GPUs" if gpus else "CPU nodes, gloo"
    if not created:
        console.print(
            f"cluster '{cluster.stack}' is already up ({plural(len(cluster.nodes), 'node')}); nothing changed"
        )
    else:
        console.print(
            f"cluster '{cluster.stack}' is up: {plural(len(cluster.nodes), cluster.provider + ' node')} ({kind}), "
            f"${cluster.hourly_usd:.3f}/h, ready in {elapsed_s:.1f} s"
        )
    for index, node in enumerate(cluster.nodes):
        role = "  head: rank 0, MASTER_ADDR" if index == 0 else ""
        console.print(f"  {node.name}  {node.public_ip}:{node.ssh_port}  private {node.private_ip}{role}")
    console.print(f"  inventory: {relative(inventory_path)}")
    console.print(f"next: {hints.fab('bootstrap')}")


def status_table(cluster: ClusterInfo, rows: list[NodeStatus], stopped_reason: str, spent_usd: float | None) -> None:
    spent = f", ${spent_usd:.4f} so far" if spent_usd is not None else ""
    console.print(
        f"stack '{cluster.stack}' ({cluster.provider}, {cluster.region}, {cluster.instance_type}), "
        f"up since {cluster.created_at}, ${cluster.hourly_usd:.3f}/h{spent}"
    )
    if stopped_reason:
        console.print(f"the cluster stopped itself: {stopped_reason}")
    table = Table(show_edge=False, pad_edge=False)
    scheduled = any(row.scheduler is not None for row in rows)
    slurm_columns = ("slurm", "daemons") if scheduled else ()
    for column in ("node", "address", "state", "ssh", "uptime", *slurm_columns, "detail"):
        table.add_column(column)
    for row in rows:
        ssh_cell = f"{row.round_trip_ms:.0f} ms" if row.reachable and row.round_trip_ms is not None else "unreachable"
        daemons = " ".join(n if up == "up" else f"{n}:down" for n, up in (row.scheduler_daemons or {}).items())
        slurm = (row.scheduler or "-", daemons or "-") if scheduled else ()
        table.add_row(row.name, row.address, row.state, ssh_cell, format_duration(row.uptime_s), *slurm, row.error)
    console.print(table)


def plan_table(stack: str, config, resources: list[dict], estimate, price_note: str = "") -> None:
    console.print(
        f"plan for stack '{stack}': {config.nodes} x {config.instance_type} in {config.region}"
        f"{' (spot)' if config.spot else ''}; nothing is created"
    )
    table = Table(show_edge=False, pad_edge=False)
    for column in ("resource", "name", "settings"):
        table.add_column(column)
    for resource in resources:
        settings = ", ".join(f"{k} {v}" for k, v in resource["settings"].items())
        table.add_row(resource["type"].split(":")[-1], resource["name"], settings)
    console.print(table)
    if estimate is None:
        console.print(f"{len(resources)} resources; cost not estimated offline: {price_note}")
        return
    console.print(f"{len(resources)} resources; estimated cost, line by line as AWS bills it:")
    for line in estimate.text_lines():
        console.print(f"  {line}")


def cost_tables(data: dict) -> None:
    clusters = Table(title="clusters", show_edge=False, pad_edge=False)
    for column in ("stack", "provider", "type", "nodes", "from", "to", "hours", "$/h", "cost", "on AWS it would cost"):
        clusters.add_column(column)
    for c in data["clusters"]:
        last = c["intervals"][-1] if c["intervals"] else {}
        to = "up now" if c["up"] else f"{(last.get('ended_at') or '')[:19]} ({last.get('end_reason') or 'down'})"
        would = f"${c['would_have_cost_usd']:.4f}" if c["would_have_cost_usd"] is not None else ""
        clusters.add_row(
            c["stack"],
            c["provider"],
            c["instance_type"],
            str(c["nodes"]),
            (c["intervals"][0]["started_at"] or "")[:19] if c["intervals"] else "",
            to,
            f"{c['hours']:.3f}",
            f"{c['hourly_usd']:.3f}",
            f"${c['cost_usd']:.4f}",
            would,
        )
    console.print(clusters)
    runs = Table(title="runs", show_edge=False, pad_edge=False)
    for column in ("run", "task", "stack", "nodes", "seconds", "cost", "exit codes"):
        runs.add_column(column)
    for r in data["runs"]:
        codes = (
            ", ".join(f"{k}={v}" for k, v in sorted((r["exit_codes"] or {}).items()))
            or r.get("end_reason")
            or ("never started" if r["started_at"] is None and r["ended_at"] else "running")
        )
        if r.get("hung"):
            stalled = (r["stalled_at"] or "")[11:19]
            codes = f"{RunState.HUNG}: no progress from {stalled} UTC, ${r['usd_since_stall']:.4f} spent since; {codes}"
        runs.add_row(
            r["run_id"], r["task"], r["stack"], str(r["nodes"]), f"{r['seconds']:.1f}", f"${r['cost_usd']:.4f}", codes
        )
    console.print(runs)
    for r in data["runs"]:
        if r.get("hung"):
            console.print(r["hang_verdict"], markup=False)
    if data.get("events"):
        events = Table(title="interruptions", show_edge=False, pad_edge=False)
        for column in ("at", "stack", "node", "what", "seconds", "cost of waiting", "then"):
            events.add_column(column)
        for e in data["events"]:
            events.add_row(
                (e["at"] or "")[:19],
                e["stack"],
                e["node"],
                e["kind"],
                f"{e['seconds']:.1f}",
                f"${e['cost_usd']:.4f}",
                e["detail"],
            )
        console.print(events)
    _billed_lines_table(data["clusters"])
    would = data["local_would_have_cost_usd"]
    extra = f"; local clusters would have cost ${would:.4f} on their instance types" if would is not None else ""
    console.print(f"total: ${data['total_usd']:.4f}{extra}")
    for note in data.get("notes", []):
        console.print(f"note: {note}", markup=False)


def _billed_lines_table(clusters: list[dict]) -> None:
    """Each AWS cluster's billed lines: what was billed, for how many hours, at what price, and their sum."""
    billed = [c for c in clusters if c.get("lines")]
    if not billed:
        return
    table = Table(title="billed lines (AWS clusters)", show_edge=False, pad_edge=False)
    for column in ("stack", "from", "line", "usage type", "quantity", "hours", "cost", ""):
        table.add_column(column)
    for c in billed:
        start = (c["intervals"][0]["started_at"] or "")[:16] if c["intervals"] else ""
        for line in c["lines"]:
            table.add_row(
                c["stack"],
                start,
                line["kind"],
                line["usage_type"],
                describe_quantity(line["quantity"], line["unit"], line["unit_usd"]),
                f"{line['hours']:.3f}",
                f"${line['cost_usd']:.4f}",
                "exact" if line["exact"] else "estimate",
            )
        total = sum(line["cost_usd"] for line in c["lines"])
        table.add_row(c["stack"], start, "= sum", "", "", f"{c['hours']:.3f}", f"${total:.4f}", "")
    console.print(table)


def reconcile_tables(data: dict) -> None:
    """`cost --reconcile`: the ledger beside the bill, per cluster-day and per usage type; estimated rows,
    unmatched usage types, leak suspects, and what the comparison itself cost."""
    console.print(f"stack '{data['stack']}': the ledger beside {data['source']}", markup=False)
    days = Table(title="per cluster-day", show_edge=False, pad_edge=False)
    for column in ("day", "ledger", "bill", "difference", "%", "rows"):
        days.add_column(column)
    for d in data["days"]:
        pct = "-" if d["difference_pct"] is None else f"{d['difference_pct']:+.2f}%"
        days.add_row(
            d["day"], f"${d['ledger_usd']:.4f}", f"${d['bill_usd']:.4f}", f"${d['difference_usd']:+.4f}", pct,
            "final" if d["final"] else "estimated (may change)",
        )  # fmt: skip
    console.print(days)
    kinds = Table(title="per usage type", show_edge=False, pad_edge=False)
    for column in ("line", "AWS usage types", "ledger", "bill", "difference", ""):
        kinds.add_column(column)
    for k in data["usage_types"]:
        kinds.add_row(
            k["kind"], ", ".join(k["usage_types"]) or "-", f"${k['ledger_usd']:.4f}", f"${k['bill_usd']:.4f}",
            f"${k['difference_usd']:+.4f}", "exact" if k["exact"] else "estimate",
        )  # fmt: skip
    for u in data["unmatched"]:
        kinds.add_row("unmatched", u["usage_type"], "-", f"${u['bill_usd']:.4f}", "", "no ledger line")
    console.print(kinds)
    if data["estimated_rows"]:
        console.print(
            f"{plural(len(data['estimated_rows']), 'row')} of the bill still Estimated: those days may change"
        )
    for leak in data["leak_suspects"]:
        named = leak["resource_id"] or "(no resource id in this source)"
        console.print(
            f"leak suspect: {leak['day']} {leak['usage_type']} {named} ${leak['cost_usd']:.4f}, no stack tag",
            markup=False,
        )
    forecast = data.get("forecast")
    if forecast:
        said = "no forecast (too little history)" if forecast["ce_usd"] is None else f"${forecast['ce_usd']:.2f}"
        console.print(
            f"to {forecast['until']}, if it stays up: the ledger ${forecast['ledger_usd']:.2f}, Cost Explorer {said}"
        )
    for note in data["notes"]:
        console.print(f"note: {note}", markup=False)
    console.print(f"Cost Explorer requests: {data['ce_requests']} (${data['ce_cost_usd']:.2f})")


def image_table(region: str, images: list) -> None:
    """`deploy.py image list`: this project's AMIs in the region (infra/images.py's Image rows)."""
    if not images:
        console.print(f"no gpu-cluster images in {region}")
        return
    table = Table(show_edge=False, pad_edge=False, title=f"gpu-cluster images in {region}")
    for column in ("id", "name", "stack", "node", "created", "size", "state", "$/month at most"):
        table.add_column(column)
    for image in images:
        table.add_row(
            image.id,
            image.name,
            image.stack,
            image.node,
            image.created,
            f"{image.size_gb} GB",
            image.state,
            f"${image.monthly_usd:.2f}",
        )
    console.print(table)
    total = sum(i.monthly_usd for i in images)
    console.print(f"snapshot storage: at most ${total:.2f}/month together, until python deploy.py image delete AMI_ID")


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
