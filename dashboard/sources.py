"""Where the dashboard's data comes from, and the one action it takes.

Everything is read the way the commands read it: the inventory, bootstrap.json and the run records
(`remote.runs`: `runs_of`, `Run.as_row`, as `fab jobs` does), the ledger opened read-only
(`Ledger.read_only`: no lock, no write, so it never holds up a running command). Two things talk to the
cluster, in threads of their own so the page never waits for them: `Live.refresh_once` brings the records
of runs not yet ended up to date through their holder (`holder.refresh`, `fab jobs`'s call), and node
states come from the status function the CLI hands in (`deploy.py status`'s). A run page's log is the
run's holder following it (`holder.follow`, `fab logs -f`'s call) with the terminal swapped for a
`LogTail`. Cancel is `holders.cancel_run`, `fab stop --run`'s body.
"""

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dashboard import gpus, shape
from infra import inventory, runlog, state
from infra.errors import ClusterError, UsageError
from infra.ledger import Ledger
from node import contract
from node.run_state import RunState
from remote import holders, runs
from remote.job_spec import NodeSetup

REFRESH_S = 2.0
"""How often the records of runs not yet ended are brought up to date from the cluster."""
STATUS_EVERY_S = 10.0
"""How often each node is asked for its state (an SSH round trip per node, as `deploy.py status`)."""
LOG_LINES = 400
"""The lines of a finished run's log the page shows (the newest)."""

StatusFn = Callable[[inventory.ClusterInfo], list[dict]]
"""A stack's node rows as `deploy.py status --json` gives them (NodeStatus.as_dict)."""


def reconciliation(stack: str) -> dict | None:
    """The last `deploy.py cost --reconcile` of `stack` in a few figures (label to value: the ledger, the
    bill, their difference, the rows still estimated, the leak suspects), shown beside the cluster's cost
    plot; None where none was made."""
    return read_json(state.stack_file(stack, state.RECONCILIATION))


def read_json(path: Path) -> dict | None:
    """A JSON file as it is now (written atomically by its owners); None where absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def shown_stacks(only: str | None) -> list[str]:
    """`--stack S`, else every stack this machine has an inventory for."""
    return [only] if only else state.stacks_up()


def _ledger_facts(stack: str, now: float) -> tuple[list[dict], dict[str, str], list]:
    """The stack's clusters with their cost over time, the runs' hang verdicts, and its node events."""
    ledger = Ledger.read_only()
    if ledger is None:
        return [], {}, []
    try:
        clusters = [
            {
                "id": c.id,
                "instance_type": c.instance_type,
                "nodes": c.nodes,
                "hourly_usd": c.hourly_usd,
                "up": c.is_up,
                "cost_usd": round(c.cost_usd(now), 6),
                "reference_hourly_usd": c.reference_hourly_usd,
                "series": shape.cost_series(c.intervals, c.hourly_usd, now, c.reference_hourly_usd).as_dict(),
            }
            for c in ledger.clusters(stack)
        ]
        verdicts = {r.run_id: r.hang_verdict for r in ledger.runs(stack) if r.hang_verdict}
        events = ledger.events(stack)
    except Exception:  # a ledger another version is migrating, or one set aside as damaged: shown without it
        return [], {}, []
    finally:
        ledger.close()
    return clusters, verdicts, events


def stack_view(stack: str, statuses: dict[str, dict], problem: str, now: float) -> dict:
    """One stack as the overview shows it, from its files alone (fast: no cluster is asked here)."""
    cluster = read_json(state.stack_file(stack, state.INVENTORY)) or {}
    nodes = cluster.get("nodes") or []
    hourly = float(cluster.get("hourly_usd") or 0.0)
    clusters, verdicts, _ = _ledger_facts(stack, now)
    found = runs.runs_of(state.runs_dir(stack))
    rows = [
        shape.run_row(record.as_row(hourly), read_json(folder / runs.SUMMARY), verdicts.get(record.run_id))
        for folder, record in found
    ]
    bootstrap = state.bootstrap_record(stack)
    return {
        "stack": stack,
        "provider": cluster.get("provider"),
        "instance_type": cluster.get("instance_type"),
        "hourly_usd": hourly,
        "nodes": shape.node_rows(nodes, statuses, hourly / max(1, len(nodes))),
        "runs": rows[::-1],  # newest first
        "counts": shape.queue_counts(rows),
        "clusters": clusters,
        "reconciliation": reconciliation(stack),
        "timelines": shape.timelines(
            cluster.get("timeline"),
            bootstrap.timeline,
            [(f"launch {r.run_id}", r.timeline.as_dict() if r.timeline else None) for _, r in found[-5:]],
        ),
        "problem": problem,
    }


def run_view(stack: str, run_id: str, tail: shape.LogTail | None, now: float) -> dict:
    """A run's page: its row, plots (metrics.jsonl once fetched; rank 0's step lines in the log until
    then), interruptions and participants on the same time axis, and its timeline."""
    folder, record = runs.find(state.runs_dir(stack), run_id)
    cluster = read_json(state.stack_file(stack, state.INVENTORY)) or {}
    _, verdicts, events = _ledger_facts(stack, now)
    summary = read_json(folder / runs.SUMMARY)
    row = shape.run_row(record.as_row(float(cluster.get("hourly_usd") or 0.0)), summary, verdicts.get(run_id))
    metrics = metrics_records(folder)
    if not any(m.get("kind") in ("step", "ft_step") for m in metrics) and tail is not None:
        lines = tail.since(0)  # the run's steps are in its log until its metrics.jsonl is here
        metrics += shape.steps_from_log([line for _, _, line in lines], [at for _, at, _ in lines])
    plots = {name: series.as_dict() for name, series in shape.step_series(metrics).items()}
    plots["participants"] = shape.participants_series(metrics).as_dict()
    return {
        "stack": stack,
        "run": row,
        "plots": plots,
        "interruptions": shape.interruptions(events, record.started_at, record.ended_at, now),
        "timeline": record.timeline.as_dict() if record.timeline else None,
        "summary": summary,
    }


def metrics_records(folder: Path) -> list[dict]:
    """The run's metrics.jsonl records (none where it is not here yet)."""
    try:
        lines = (folder / contract.METRICS_FILE).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return found


def finished_log(folder: Path, tail: shape.LogTail) -> None:
    """A run whose log is all here (or that nobody can follow now): its last lines from the local copy, one
    stream in time order, read-only. A run Slurm held has its log as the cluster wrote it (`output.log`):
    every node's lines and the cluster's in the order they came, which is their time order. A run fab held
    has a log per node and the time each of its lines reached fab: merged by that time, lines of one time in
    node order (`runlog.in_time_order`, as `fab logs` shows it). An older fab-held run without the times:
    its nodes' logs one after the other."""
    at = time.time()
    if (folder / runlog.RAW).is_file():
        copy = runlog.LogCopy(folder, echo=lambda writer, piece: tail.add(writer or "cluster", piece, at), write=False)
        copy.resume()
        copy.close(ended=True)
        del tail.pieces[:-LOG_LINES]
        tail.end(at)
        return
    merged = runlog.in_time_order(folder, LOG_LINES)
    if merged is not None:
        for when, line in merged[-LOG_LINES:]:
            tail.add("log", line + "\n", when)
        tail.end(at)
        return
    paths = runlog.node_logs(folder)
    if (folder / runlog.CLUSTER_LOG).exists():
        paths.append(folder / runlog.CLUSTER_LOG)
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()[-LOG_LINES:]
        except OSError:
            continue
        for line in lines:
            tail.add(path.stem, runlog.with_prefix(path, line) + "\n", at)
    tail.end(at)


def holder_of(stack: str) -> tuple[inventory.ClusterInfo, holders.RunHolder]:
    cluster = inventory.load(stack)
    return cluster, holders.holder_for(cluster, NodeSetup.load(stack))


def cancel(stack: str, run_id: str) -> str:
    """`fab stop --run ID`'s body: the line that says what became of the run (UsageError: nothing to do)."""
    cluster, holder = holder_of(stack)
    return holders.cancel_run(cluster, holder, run_id)


def _problem(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ClusterError) else f"{type(exc).__name__}: {exc}"


class Live:
    """The threads that talk to the cluster: the runs' refresh, node states, and one follow per run page
    open on a run not finished. Daemon threads: Ctrl-C of the dashboard ends them with the process."""

    def __init__(self, only: str | None, status: StatusFn | None):
        self.only, self.status = only, status
        self.statuses: dict[str, dict[str, dict]] = {}
        self.run_problems: dict[str, str] = {}
        self.status_problems: dict[str, str] = {}
        self.tails: dict[tuple[str, str], shape.LogTail] = {}
        self.gpus: dict[tuple[str, str], gpus.Readings] = {}
        """(stack, run id) to each GPU's newest reading, for the runs running now (`/metrics`)."""
        self.followers: dict[tuple[str, str], threading.Thread] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="dashboard-refresh", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        asked_at = gpus_at = 0.0
        while not self.stopping.is_set():
            ask = self.status is not None and time.monotonic() - asked_at >= STATUS_EVERY_S
            ask_gpus = time.monotonic() - gpus_at >= gpus.EVERY_S
            for stack in shown_stacks(self.only):
                self.refresh_once(stack, ask)
                if ask_gpus:
                    self.refresh_gpus(stack)
            asked_at = time.monotonic() if ask else asked_at
            gpus_at = time.monotonic() if ask_gpus else gpus_at
            self.stopping.wait(REFRESH_S)

    def refresh_gpus(self, stack: str) -> None:
        """The newest GPU readings of the stack's running runs (kept as they were where the head node does
        not answer now: they are asked again next time)."""
        running = [r.run_id for _, r in runs.runs_of(state.runs_dir(stack)) if r.state == RunState.RUNNING]
        try:
            found = gpus.bring(inventory.load(stack), running) if running else {}
        except Exception:
            return
        for key in [k for k in self.gpus if k[0] == stack]:
            del self.gpus[key]
        self.gpus.update({(stack, run_id): readings for run_id, readings in found.items() if readings})

    def refresh_once(self, stack: str, ask_status: bool) -> None:
        """`fab jobs`'s refresh of the runs not yet ended; with `ask_status`, each node's state too (asked
        of a cluster not bootstrapped as well: `status` needs only the inventory)."""
        try:
            cluster, holder = holder_of(stack)
            pending = [(f, r) for f, r in runs.runs_of(state.runs_dir(stack)) if not r.ended]
            holder.refresh(pending)  # a log a follower here holds is skipped (runlog's lock): it is coming
            self.run_problems[stack] = ""
        except Exception as exc:  # the page says so; the next pass tries again
            self.run_problems[stack] = _problem(exc)
        if ask_status and self.status is not None:
            try:
                cluster = inventory.load(stack)
            except Exception as exc:
                self.status_problems[stack] = _problem(exc)
                return
            try:
                self.statuses[stack] = {row["name"]: row for row in self.status(cluster)}
                self.status_problems[stack] = ""
            except Exception as exc:
                problem = self.status_problems[stack] = f"status: {_problem(exc)}"
                self.statuses[stack] = {n.name: {"state": "unknown", "error": problem} for n in cluster.nodes}

    def problem(self, stack: str) -> str:
        """What went wrong the last time the cluster was asked, for the stack's box ('' where nothing)."""
        return "; ".join(p for p in (self.run_problems.get(stack), self.status_problems.get(stack)) if p)

    def tail(self, stack: str, run_id: str) -> shape.LogTail:
        """The run's log tail: followed by its holder while it is not finished (started on first ask),
        else read from the local copy."""
        key = (stack, run_id)
        with self.lock:
            tail = self.tails.get(key)
            follower = self.followers.get(key)
            if tail is not None and (tail.ended or (follower is not None and follower.is_alive())):
                return tail
            folder, record = runs.find(state.runs_dir(stack), run_id)
            tail = self.tails[key] = shape.LogTail()
            if record.finished:
                finished_log(folder, tail)
                return tail
            follower = threading.Thread(
                target=self._follow, args=(stack, folder, record, tail), name=f"dashboard-follow-{run_id}", daemon=True
            )
            self.followers[key] = follower
            follower.start()
            return tail

    @staticmethod
    def _follow(stack: str, folder: Path, record: runs.Run, tail: shape.LogTail) -> None:
        try:
            _, holder = holder_of(stack)
            holder.follow(folder, record, show=lambda prefix, piece: tail.add(prefix, piece, time.time()))
        except (ClusterError, UsageError) as exc:
            tail.add("dashboard", f"[dashboard] cannot follow the run: {exc}\n", time.time())
        except Exception as exc:
            tail.add("dashboard", f"[dashboard] following stopped: {type(exc).__name__}: {exc}\n", time.time())
        finally:
            tail.end(time.time())
