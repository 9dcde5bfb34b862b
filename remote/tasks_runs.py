"""The run tasks, through the run holder: `fab jobs`, `fab logs`, `fab results`, `fab stop`."""

import contextlib
import json
import sys
from pathlib import Path

from invoke.exceptions import Exit

from infra import runlog, state
from infra.errors import OperationError
from remote import holders, log_catchup, options, runs
from remote.cli import task
from remote.stream import console, say
from remote.task_context import STACK_HELP, holder_of, report


@task(help={"run": "cancel this run only (queued or running)", "stack": STACK_HELP})
def stop(c, run=None, stack=None):
    """Stop whatever job runs on the cluster, on every node (where Slurm holds the runs, queued runs too);
    --run ID: that run only."""
    cluster, holder = holder_of(stack)
    if run is None:
        holders.stop_all(cluster, holder)
        return
    say(holders.cancel_run(cluster, holder, options.run_id(run)))


@task(help={"json": "machine-readable: a list of runs", "stack": STACK_HELP})
def jobs(c, json_=False, stack=None):
    """Queued, running and recent runs: state, times, exit code, requeues, cost."""
    cluster, holder = holder_of(stack)
    found = runs.runs_of(state.runs_dir(cluster.stack))
    with contextlib.redirect_stdout(sys.stderr if json_ else sys.stdout):  # finishing says what it fetched
        holder.refresh(found)
    rows = [record.as_row(cluster.hourly_usd) for _, record in found]
    if json_:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        say("no runs yet: fab run ... (or any launch task)")
        return
    from rich.table import Table  # rich loads only for a table: fab's start stays short (issue 41)

    table = Table(title=f"runs of '{cluster.stack}'")
    for column in ("run", "task", "state", "submitted", "started", "ended", "exit", "requeues", "cost"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["run_id"],
            row["task"],
            f"{row['state']} {row['participants']}" if row.get("participants") else row["state"],
            *(str(row[k] or "-").replace("+00:00", "Z") for k in ("submitted_at", "started_at", "ended_at")),
            "-" if row["exit_code"] is None else str(row["exit_code"]),
            str(row["requeues"]),
            f"${row['cost_usd']:.4f}",
        )
    console().print(table)
    for _, record in found:
        if record.waiting_for and not record.ended:
            say(f"{record.run_id} waits for {record.waiting_for}")
        for slow in record.stragglers:
            say(f"{record.run_id}: straggler rank {slow['rank']} on {slow['node']}: {slow['why']}")


@task(help={"run": "the run (default: the newest)", "stack": STACK_HELP})
def results(c, run=None, stack=None):
    """Fetch a finished run's results and metrics into its run folder (as an attached run does)."""
    run_id = None if run is None else options.run_id(run)  # `--run ''` is a bad id, not the newest run
    cluster, holder = holder_of(stack)
    folder, record = runs.find(state.runs_dir(cluster.stack), run_id)
    holder.refresh([(folder, record)])
    record.save(folder)
    if not record.ended:
        raise Exit(
            f"error: run {record.run_id} is {record.state}: its results come when it ends "
            f"(fab logs -f --run {record.run_id})",
            code=2,
        )
    try:
        holder.results(folder, record)
    except OperationError as exc:
        raise Exit(f"error: {exc}", code=1) from None


@task(
    help={
        "run": "the run id (default: the latest run)",
        "node": "only this node's log",
        "lines": "how many lines from the end of each log (default 50; 0 for all)",
        "follow": "follow the run until it ends (exit 0 if it completed, else 1); Ctrl-C stops following only",
        "stack": STACK_HELP,
    }
)
def logs(c, run=None, node=None, lines=None, follow=False, stack=None):
    """Show a run's per-node logs (kept on this machine in .cluster/<stack>/runs/<run-id>/); -f follows the
    run until it ends (exit 0 if it completed, else 1)."""
    count = options.integer("--lines", lines, 50, minimum=0)
    run = options.run_id(run) if run is not None else None
    node = options.node_name("--node", node)
    if follow:
        cluster, holder = holder_of(stack)
        folder, record = runs.find(state.runs_dir(cluster.stack), run)
        if not record.finished:
            report(cluster, holder.follow(folder, record))  # Ctrl-C stops the following only
            return
        caught = log_catchup.catch_up(cluster.stack, folder, record, count)
        if not log_catchup.show(caught, None):
            show_logs(folder, None, count)
        report(cluster, holders.Ending(folder, record))
        return
    stack_name = state.resolve_stack(stack)
    if stack_name is None:
        raise Exit("error: no cluster: run python deploy.py up", code=2)
    runs_root = state.runs_dir(stack_name)
    run_dir = runs_root / run if run else runs.latest_run(runs_root)
    if run_dir is None or not run_dir.is_dir():
        raise Exit(f"error: no run {run!r} in {runs_root}" if run else f"error: no runs yet in {runs_root}", code=2)
    held = runs.Run.load(run_dir)  # a run held by Slurm: its log comes here as it goes
    caught = log_catchup.catch_up(stack_name, run_dir, held, count) if held else log_catchup.Caught()
    if node and not (run_dir / f"{node}.log").exists() and node not in (caught.lines or {}):
        raise Exit(f"error: run {run_dir.name} has no log for {node}", code=2)
    say(f"run {run_dir.name} ({run_dir})")
    if not log_catchup.show(caught, node):
        show_logs(run_dir, node, count)
    summary = run_dir / runs.SUMMARY
    if summary.exists():
        say(runs.summary_line(summary))


def show_logs(run_dir: Path, node: str | None, count: int) -> None:
    """The last `count` lines (0: all) of each node's log, then of the cluster's (Slurm's, srun's and the
    batch script's lines, for a run held by Slurm), each line with its writer's prefix once. A run fab held
    shows its nodes' lines as one stream in the order they reached fab (`runlog.in_time_order`, as the
    dashboard does); an older one, without the times kept, node after node."""
    merged = None if node else runlog.in_time_order(run_dir, count)
    if merged is not None:
        for _, line in merged:
            say(line)
        return
    logs_found = sorted(run_dir.glob("node-*.log"))
    if node:
        logs_found = [p for p in logs_found if p.stem == node]
    elif (run_dir / runlog.CLUSTER_LOG).exists():
        logs_found.append(run_dir / runlog.CLUSTER_LOG)
    for path in logs_found:
        text = path.read_text(errors="replace").splitlines()
        shown = text[-count:] if count > 0 else text
        for line in shown:  # the nodes prefix their own lines; a line fab wrote before them gets one here
            say(runlog.with_prefix(path, line))
