"""`/metrics`: what the dashboard shows, in Prometheus' text format (`prometheus_client`), for the users'
own Prometheus and Grafana.

Read as the page reads it (`sources.stack_view`: the inventory, the run records, the ledger read-only,
the last preflight) plus each run's progress from its `metrics.jsonl` (or rank 0's step lines in the log
a page follows), a running run's GPU readings from its nodes' samples files (`gpu-<node>.jsonl`: brought
from the head node by dashboard/gpus.py, or a copy already here) and the node states the dashboard last
asked. Names start with `gpucluster_`; labels
`stack`, `run`, `node`, `replica`, `gpu` where they apply. A scrape asks no cluster anything: it reads
files and this process's memory, so it stays quick however often Prometheus comes.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from dashboard import shape, sources
from infra import state
from infra.ledger import Ledger
from node import contract, gpu_samples
from node.run_state import RunState
from remote import runs

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFLIGHT_LEVELS = {"OK": 0, "WARN": 1, "CRITICAL": 2}
GPU_FIGURES = (
    # (record key, metric name, help, scale to the metric's unit)
    ("util_pct", "gpucluster_gpu_utilization_ratio", "GPU utilisation over the last sample period (0..1).", 0.01),
    ("mem_used_gib", "gpucluster_gpu_memory_used_bytes", "Device memory in use.", 2**30),
    ("temp_c", "gpucluster_gpu_temperature_celsius", "GPU temperature.", 1.0),
    ("power_w", "gpucluster_gpu_power_watts", "Board power draw.", 1.0),
    ("sm_clock_mhz", "gpucluster_gpu_sm_clock_hertz", "SM clock.", 1e6),
    ("mem_clock_mhz", "gpucluster_gpu_memory_clock_hertz", "Memory clock.", 1e6),
    ("ecc_uncorrected", "gpucluster_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors (volatile count).", 1.0),
    ("ecc_corrected", "gpucluster_gpu_ecc_corrected_errors", "Corrected ECC errors (volatile count).", 1.0),
    ("xid_events", "gpucluster_gpu_xid_events", "Xid events seen during the run.", 1.0),
)


@dataclass
class Progress:
    """What a run's metrics say of its progress."""

    step: int | None = None
    """The last step recorded (any replica group's, for a fault-tolerant run)."""
    step_at: float | None = None
    """When it was recorded (epoch s)."""
    participants: dict[str, int] = field(default_factory=dict)
    """A fault-tolerant run's participants per replica group, as its last `ft_step` line of that group said."""
    gpus: dict[tuple[str, str], dict] = field(default_factory=dict)
    """(node, gpu index) to its last `gpu` record (from the nodes' samples files, never metrics.jsonl)."""


def progress(records: Iterable[dict]) -> Progress:
    """A run's progress from its `step` and `ft_step` records (metrics.jsonl or the log's lines)."""
    found = Progress()
    for record in records:
        kind = record.get("kind")
        if kind in ("step", "ft_step") and isinstance(record.get("step"), int):
            found.step = record["step"] if found.step is None else max(found.step, record["step"])
            found.step_at = _float(record.get("time")) or found.step_at
            if kind == "ft_step" and record.get("participants") is not None:
                found.participants[str(record.get("replica", 0))] = int(record["participants"])
    return found


@dataclass
class Scrape:
    """One scrape's inputs: each stack's page view (`sources.stack_view`), each run's progress, the last
    preflight's verdicts ({stack: {node: level}}) and the nodes' states as last asked ({stack: {node: row}})."""

    views: list[dict]
    progress: dict[tuple[str, str], Progress]
    preflight: dict[str, dict[str, str]]
    statuses: dict[str, dict[str, dict]]


def families(scrape: Scrape) -> list[Metric]:
    """The metric families of one scrape (pure: the unit tests call it with made-up views)."""
    return [*_run_families(scrape), *_stack_families(scrape), *_node_families(scrape), *_gpu_families(scrape)]


def _run_families(scrape: Scrape) -> list[Metric]:
    run_labels = ["stack", "run"]
    states = GaugeMetricFamily(
        "gpucluster_run_state",
        f"1 for the run's state ({', '.join(state.value for state in RunState)}).",
        labels=[*run_labels, "task", "state"],
    )
    steps = GaugeMetricFamily("gpucluster_run_step", "The run's last recorded step.", labels=run_labels)
    step_at = GaugeMetricFamily(
        "gpucluster_run_last_step_timestamp_seconds", "When the run's last step was recorded.", labels=run_labels
    )
    participants = GaugeMetricFamily(
        "gpucluster_run_participants",
        "A fault-tolerant run's participants, as its replica group's last step said.",
        labels=[*run_labels, "replica"],
    )
    requeues = CounterMetricFamily("gpucluster_run_requeues", "Times the run was requeued.", labels=run_labels)
    cost = GaugeMetricFamily("gpucluster_run_cost_usd", "The run's cost so far (its nodes' $/h).", labels=run_labels)
    for view in scrape.views:
        for row in view["runs"]:
            labels = [view["stack"], row["run_id"]]
            states.add_metric([*labels, row.get("task") or "", row["state"]], 1)
            requeues.add_metric(labels, row.get("requeues") or 0)
            cost.add_metric(labels, row.get("cost_usd") or 0.0)
            found = scrape.progress.get((view["stack"], row["run_id"]))
            if found is None:
                continue
            if found.step is not None:
                steps.add_metric(labels, found.step)
            if found.step_at is not None:
                step_at.add_metric(labels, found.step_at)
            for replica, count in sorted(found.participants.items()):
                participants.add_metric([*labels, replica], count)
    return [states, steps, step_at, participants, requeues, cost]


def _stack_families(scrape: Scrape) -> list[Metric]:
    hourly = GaugeMetricFamily("gpucluster_stack_hourly_usd", "What the stack's nodes cost per hour.", labels=["stack"])
    spent = GaugeMetricFamily(
        "gpucluster_stack_cost_usd", "What the stack's clusters cost so far (the ledger).", labels=["stack"]
    )
    nodes = GaugeMetricFamily("gpucluster_stack_nodes", "Nodes in the stack's inventory.", labels=["stack"])
    for view in scrape.views:
        hourly.add_metric([view["stack"]], view.get("hourly_usd") or 0.0)
        spent.add_metric([view["stack"]], sum(c.get("cost_usd") or 0.0 for c in view.get("clusters") or []))
        nodes.add_metric([view["stack"]], len(view.get("nodes") or []))
    return [hourly, spent, nodes]


def _node_families(scrape: Scrape) -> list[Metric]:
    up = GaugeMetricFamily(
        "gpucluster_node_up", "1 where the node answered the dashboard's last status, else 0.", labels=["stack", "node"]
    )
    preflight = GaugeMetricFamily(
        "gpucluster_node_preflight",
        "The last preflight's verdict of the node: 0 OK, 1 WARN, 2 CRITICAL.",
        labels=["stack", "node", "verdict"],
    )
    daemons = GaugeMetricFamily(
        "gpucluster_node_daemon_up",
        "1 where the node's scheduler daemon (munged, slurmctld, slurmd, spot-watch) is up, else 0.",
        labels=["stack", "node", "daemon"],
    )
    for view in scrape.views:
        stack = view["stack"]
        statuses = scrape.statuses.get(stack, {})
        for node in view.get("nodes") or []:
            found = statuses.get(node["name"])
            if found is not None:
                up.add_metric([stack, node["name"]], 1 if found.get("reachable") else 0)
                for daemon, said in sorted((found.get("scheduler_daemons") or {}).items()):
                    daemons.add_metric([stack, node["name"], daemon], 1 if said == "up" else 0)
        for node, level in sorted(scrape.preflight.get(stack, {}).items()):
            if level in PREFLIGHT_LEVELS:
                preflight.add_metric([stack, node, level], PREFLIGHT_LEVELS[level])
    return [up, preflight, daemons]


def _gpu_families(scrape: Scrape) -> list[Metric]:
    """The GPU figures of the runs that run now (a finished run's last reading is no GPU's state now)."""
    labels = ["stack", "run", "node", "gpu"]
    found = {name: GaugeMetricFamily(name, why, labels=labels) for _, name, why, _ in GPU_FIGURES}
    running = {
        (v["stack"], row["run_id"]) for v in scrape.views for row in v["runs"] if row["state"] == RunState.RUNNING
    }
    for (stack, run_id), run in sorted(scrape.progress.items()):
        if (stack, run_id) not in running:
            continue
        for (node, index), record in sorted(run.gpus.items()):
            for key, name, _, scale in GPU_FIGURES:
                value = _float(record.get(key))
                if value is not None:
                    found[name].add_metric([stack, run_id, node, index], value * scale)
    return list(found.values())


def render(scrape: Scrape) -> bytes:
    """The text a scrape returns."""
    return generate_latest(_Fixed(families(scrape)))


class _Fixed:
    """A collector of families already made (generate_latest takes a registry: anything with collect)."""

    def __init__(self, found: list[Metric]):
        self.found = found

    def collect(self) -> list[Metric]:
        return self.found


class Reader:
    """Gathers a scrape from the files, lean: a run's record is read again only when its `run.json` changes
    and its progress only when its metrics file does (a finished run's never do: 200 runs cost 400 stat
    calls, not 400 reads), and none of the page's shaping (timelines, plots) is done."""

    def __init__(self) -> None:
        self.records: dict[Path, tuple[tuple[int, int], runs.Run | None]] = {}
        self.progresses: dict[Path, tuple[tuple[int, int], Progress]] = {}
        self.samples: dict[Path, tuple[tuple[int, int], dict]] = {}

    def scrape(
        self, stacks: list[str], statuses: dict, tails: dict, now: float, live_gpus: dict | None = None
    ) -> Scrape:
        """`live_gpus`: the running runs' newest GPU readings, brought from the cluster (dashboard/gpus.py)."""
        views, found, live_gpus = [], {}, live_gpus or {}
        for stack in stacks:
            view = self.stack_facts(stack, now)
            views.append(view)
            for row in view["runs"]:
                key = (stack, row["run_id"])
                found[key] = self.progress_of(row["folder"], tails.get(key))
                if row["state"] == "RUNNING":  # a GPU's reading says its state now only while the run goes
                    readings = {**self.gpus_here(row["folder"]), **live_gpus.get(key, {})}
                    found[key] = replace(found[key], gpus=readings)
        preflight = {stack: preflight_levels(stack) for stack in stacks}
        return Scrape(views, found, preflight, statuses)

    def stack_facts(self, stack: str, now: float) -> dict:
        """What the families need of a stack, in `sources.stack_view`'s keys."""
        cluster = sources.read_json(state.stack_file(stack, state.INVENTORY)) or {}
        hourly = float(cluster.get("hourly_usd") or 0.0)
        rows = []
        for folder, record in self.runs_of(state.runs_dir(stack)):
            cost = record.cost_usd(hourly) if record.started_at is not None else 0.0
            rows.append(
                {"run_id": record.run_id, "task": record.task, "state": record.state, "requeues": record.requeues,
                 "cost_usd": cost, "folder": folder}
            )  # fmt: skip
        return {
            "stack": stack,
            "hourly_usd": hourly,
            "nodes": cluster.get("nodes") or [],
            "runs": rows,
            "clusters": [{"cost_usd": c.cost_usd(now)} for c in ledger_clusters(stack)],
        }

    def runs_of(self, root: Path) -> list[tuple[Path, runs.Run]]:
        found = []
        try:
            folders = list(os.scandir(root))
        except OSError:
            return []
        for entry in folders:
            folder = Path(entry.path)
            try:
                seen = os.stat(folder / runs.RECORD)
            except OSError:
                continue
            stamp = (seen.st_mtime_ns, seen.st_size)
            kept = self.records.get(folder)
            if kept is None or kept[0] != stamp:
                kept = self.records[folder] = (stamp, runs.Run.load(folder))
            if kept[1] is not None:
                found.append((folder, kept[1]))
        return found

    def progress_of(self, folder: Path, tail: shape.LogTail | None) -> Progress:
        path = folder / contract.METRICS_FILE
        try:
            seen = path.stat()
        except OSError:
            seen = None
        if seen is None and tail is not None:  # a running run whose page is open: rank 0's step lines
            lines = tail.since(0)
            return progress(shape.steps_from_log([line for _, _, line in lines], [at for _, at, _ in lines]))
        if seen is None:
            return Progress()
        stamp = (seen.st_mtime_ns, seen.st_size)
        kept = self.progresses.get(path)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        found = progress(sources.metrics_records(folder))
        self.progresses[path] = (stamp, found)
        return found

    def gpus_here(self, folder: Path) -> dict:
        """The newest reading of each GPU in the run's samples files on this machine (each file read again
        only when it changed)."""
        found: dict = {}
        pattern = f"{contract.GPU_SAMPLES_PREFIX}*{contract.GPU_SAMPLES_SUFFIX}"
        for path in sorted(folder.glob(pattern)):
            try:
                seen = path.stat()
            except OSError:
                continue
            stamp = (seen.st_mtime_ns, seen.st_size)
            kept = self.samples.get(path)
            if kept is None or kept[0] != stamp:
                kept = self.samples[path] = (stamp, gpu_samples.newest_in(str(path)))
            found.update(kept[1])
        return found


def ledger_clusters(stack: str) -> list:
    """The stack's clusters in the ledger, read-only ([] where there is no ledger or it cannot be read)."""
    ledger = Ledger.read_only()
    if ledger is None:
        return []
    try:
        return ledger.clusters(stack)
    except Exception:  # a ledger another version is migrating: the scrape goes on without it
        return []
    finally:
        ledger.close()


def preflight_levels(stack: str) -> dict[str, str]:
    """{node: OK|WARN|CRITICAL} of the stack's last `fab preflight` ({} where none was kept)."""
    kept = sources.read_json(state.stack_file(stack, state.PREFLIGHT)) or {}
    try:
        return {str(n["node"]): str(n["verdict"]) for n in kept.get("nodes") or []}
    except (KeyError, TypeError):
        return {}


def _float(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None
