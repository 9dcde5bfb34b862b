"""The `fab` tasks: prepare the nodes, launch jobs on all of them, watch and stop them.

The cluster is the current stack's inventory (`--stack`, else $CLUSTER_STACK, else the last `up`).
"""

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from invoke import Collection, task
from invoke.exceptions import Exit
from rich.table import Table

from infra import inventory, state
from infra.errors import UsageError
from infra.inventory import ClusterInfo
from infra.ledger import HEARTBEAT_S, Ledger
from node import billing, contract
from remote import commands, options, workdir
from remote.bootstrap import Bootstrap
from remote.connect import describe, on_all_nodes, open_sessions
from remote.launch import (
    DEFAULT_MAX_RESULT_MB,
    JobLock,
    JobResult,
    JobSpec,
    NodeSetup,
    check_ready,
    launch,
    stop_everywhere,
)
from remote.stream import console, say

STACK_HELP = "stack to use (default: $CLUSTER_STACK, else the last `python deploy.py up`)"
ARGS_HELP = 'arguments for the script, quoted as one string, e.g. --args "--steps 200"'
HANG_HELP = {
    "hang-timeout": "seconds a rank may wait inside a collective that another rank has not entered before the "
    "job counts as hung (default 300; 0 turns the flight recorder and hang detection off)",
    "on-hang": "stop (default): name the culprit, keep the evidence and stop the job; wait: name it and leave "
    "the job running for you",
}
RESTARTS_HELP = "torchrun --max-restarts: restart a failed worker group this many times, >= 0 (default 0)"
NPROC_HELP = "processes per node, >= 1 (default: one per GPU, one on CPU nodes); at most the GPU count on GPU nodes"


def cluster_for(stack: str | None) -> ClusterInfo:
    try:
        return inventory.load_current(stack)
    except UsageError as exc:
        raise Exit(f"error: {exc}", code=2) from None


def setup_for(cluster: ClusterInfo) -> NodeSetup:
    return NodeSetup.load(state.stack_file(cluster.stack, state.BOOTSTRAP))


class RunBook:
    """Runs into the ledger; a ledger that cannot be written costs a warning, never the launch."""

    def __init__(self, cluster: ClusterInfo):
        self.cluster = cluster
        self.heartbeat: Heartbeat | None = None
        self.ledger: Ledger | None
        try:
            self.ledger = Ledger()
            for warning in self.ledger.warnings:
                say(f"fab: warning: {warning}")
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: the ledger cannot be opened ({exc}); this run is not recorded in it")
            self.ledger = None

    def started(self, run_id: str, task: str) -> None:
        self._safely(
            lambda ledger: ledger.run_started(
                run_id,
                self.cluster.stack,
                task,
                len(self.cluster.nodes),
                self.cluster.hourly_usd,
                owner_pid=os.getpid(),
            )
        )
        if self.ledger is not None:
            self.heartbeat = Heartbeat(self.ledger.path, run_id)
            self.heartbeat.start()

    def hung(self, run_id: str, report) -> None:
        """Record the hang watch's finding, from its own thread (a connection of its own)."""
        if self.ledger is None:
            return
        try:
            ledger = Ledger(self.ledger.path)
            try:
                ledger.run_hung(run_id, report.verdict, report.stalled_since, report.detected_at)
            finally:
                ledger.close()
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: could not record the hang in the ledger ({exc})")

    def ended(self, run_id: str, exit_codes: dict, duration_s: float) -> float:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        cost = self._safely(lambda ledger: ledger.run_ended(run_id, exit_codes))
        return cost if cost is not None else billing.cost_usd(self.cluster.hourly_usd, duration_s)

    def _safely(self, write: Callable[[Ledger], Any]) -> Any:
        if self.ledger is None:
            return None
        try:
            return write(self.ledger)
        except (sqlite3.Error, OSError) as exc:
            say(f"fab: warning: could not write the ledger ({exc})")
            return None


class Heartbeat(threading.Thread):
    """Records every HEARTBEAT_S that this fab still supervises its run, so that if it is killed, the
    next command reading the ledger closes the run at the last beat (infra/ledger.py)."""

    def __init__(self, ledger_path: Path, run_id: str):
        super().__init__(name=f"heartbeat-{run_id}", daemon=True)
        self.ledger_path, self.run_id = ledger_path, run_id
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            ledger = Ledger(self.ledger_path)  # a connection of this thread's own
        except (sqlite3.Error, OSError):
            return  # RunBook has warned already; the run's end is still recorded
        try:
            while not self.stopped.wait(HEARTBEAT_S):
                try:
                    ledger.heartbeat(self.run_id)
                except (sqlite3.Error, OSError):
                    pass  # a busy or damaged ledger; the next beat may get through
        finally:
            ledger.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def start_job(stack: str | None, spec: JobSpec) -> None:
    """Launch `spec` on every node; exit 1 naming the node that failed, 130 on Ctrl-C."""
    cluster = cluster_for(stack)
    problem = commands.nproc_problem(cluster.nodes, spec.nproc_per_node)
    if problem:
        raise Exit(f"error: {problem}", code=2)
    setup = setup_for(cluster)
    book = RunBook(cluster)
    result, local_dir = launch(
        cluster,
        spec,
        setup,
        state.runs_dir(cluster.stack),
        on_start=lambda run_id: book.started(run_id, spec.task),
        on_hang=book.hung,
    )
    cost_usd = book.ended(result.run_id, result.exit_codes, result.duration_s)
    summary = {
        "task": spec.task,
        "run_id": result.run_id,
        "nodes": [n.name for n in cluster.nodes],
        "started_at": result.started_at,
        "ended_at": result.ended_at,
        "duration_s": round(result.duration_s, 3),
        "exit_codes": result.exit_codes,
        "rank_exit_codes": result.rank_exit_codes,  # the failed ranks' own codes, by node and global rank
        "cost_usd": round(cost_usd, 6),
        "hourly_usd": cluster.hourly_usd,
        "script": spec.script if not spec.upload else str(spec.upload),
        "args": spec.args,
        "workdir": str(spec.workdir.root) if spec.workdir else None,
        "requirements": str(spec.requirements.path) if spec.requirements else None,
        "env": sorted(spec.env),  # names only: values may be secrets, and this file outlives the run
    }
    if result.hang:
        summary["hang"] = {
            "verdict": result.hang.verdict,
            "stalled_at": result.hang.stalled_since,
            "detected_at": result.hang.detected_at,
            "evidence": str(result.hang.evidence_dir),
            "usd_since_stall": round(billing.cost_usd(cluster.hourly_usd, time.time() - result.hang.stalled_since), 6),
        }
    state.write_atomic(local_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    where = f"logs: {local_dir}"
    if result.interrupted:
        say(f"fab: run {result.run_id} interrupted after {result.duration_s:.1f} s; job stopped on every node; {where}")
        raise Exit(code=130)
    if result.hang and spec.hang.on_hang == "stop":
        raise Exit(
            f"error: run {result.run_id} hung and was stopped on every node ({result.hang.verdict.split(': ', 1)[1]}); "
            f"evidence: {result.hang.evidence_dir}; {where}",
            code=1,
        )
    if not result.ok:
        first = result.failed_node or next(n for n, c in result.exit_codes.items() if c != 0)
        codes = ", ".join(result.exited(n) for n, c in result.exit_codes.items() if c not in (0, None))
        raise Exit(
            f"error: run {result.run_id} failed: {codes} (first: {first}, log: {local_dir / (first + '.log')}); "
            "the job was stopped on every node",
            code=1,
        )
    say(
        f"fab: run {result.run_id} ok in {result.duration_s:.1f} s, cost ${cost_usd:.4f} "
        f"(${cluster.hourly_usd:.3f}/h){alone(result)}; {where}"
    )


def alone(result: JobResult) -> str:
    """Beside "ok": the nodes whose ranks never formed a process group (a script that found no GPU and
    returned 0 did nothing distributed)."""
    nodes = result.without_process_group
    if not nodes:
        return ""
    if len(nodes) == len(result.exit_codes):
        return ", but no rank joined a process group"
    return f", but no rank on {', '.join(nodes)} joined a process group"


@dataclass(frozen=True)
class ExampleTask:
    """A launch task that runs one of the examples on every node."""

    name: str
    """The fab task's name, dashed (`fab run-ddp`)."""
    script: str
    """The example it runs, relative to the synced code folder."""
    help: str
    """One line for `fab --list`."""


# Adding an example task is one line here: the table registers the tasks and the collection.
EXAMPLE_TASKS = (
    ExampleTask(
        "hello",
        "examples/distributed_hello.py",
        "Distributed hello: every rank reports in; all-reduce, broadcast, all-gather checked.",
    ),
    ExampleTask("run-ddp", "examples/ddp_training.py", "DDP training across all nodes (examples/ddp_training.py)."),
    ExampleTask(
        "profile",
        "examples/profile_communication.py",
        "All-reduce and friends over message sizes, as nccl-tests tables.",
    ),
    ExampleTask(
        "accumulate",
        "examples/gradient_accumulation.py",
        "Gradient accumulation: one all-reduce per optimizer step with no_sync.",
    ),
    ExampleTask(
        "model-parallel", "examples/model_parallelism.py", "Pipeline parallel: one stage per rank, GPipe or 1F1B."
    ),
    ExampleTask(
        "compress",
        "examples/gradient_compression.py",
        "DDP gradient compression (fp16, PowerSGD): bytes per step, loss and time against none.",
    ),
    ExampleTask(
        "fsdp",
        "examples/fsdp_training.py",
        "FSDP2 (ZeRO-2/3): per-rank memory from the shards next to DDP's; sharded checkpoints.",
    ),
    ExampleTask(
        "tensor-parallel",
        "examples/tensor_parallel.py",
        "Tensor parallel attention and MLP over all ranks; collectives counted per step.",
    ),
    ExampleTask(
        "hybrid",
        "examples/hybrid_parallel.py",
        "Hybrid dp x tp: tensor parallel within a node, FSDP across nodes (--nproc-per-node 2 on CPU).",
    ),
    ExampleTask(
        "compare",
        "examples/compare_strategies.py",
        "The strategy table: DDP, PowerSGD, ZeRO-2/3, TP, hybrid: memory, bytes, time (+ PNG).",
    ),
)


def example_task(example: ExampleTask):
    """The fab task that launches `example.script`."""

    def body(c, args="", max_restarts=None, nproc_per_node=None, hang_timeout=None, on_hang=None, stack=None):
        start_job(
            stack,
            JobSpec(
                example.name,
                example.script,
                options.script_arguments(args),
                restarts(max_restarts),
                nproc_per_node=processes(nproc_per_node),
                hang=options.hang_policy(hang_timeout, on_hang),
            ),
        )

    body.__name__ = example.name.replace("-", "_")
    body.__doc__ = example.help
    return task(
        body,
        name=example.name,
        help={
            "args": ARGS_HELP,
            "max-restarts": RESTARTS_HELP,
            "nproc-per-node": NPROC_HELP,
            **HANG_HELP,
            "stack": STACK_HELP,
        },
    )


RUN_HELP = {
    "script": "the Python script torchrun starts: a file on this machine, or with --workdir a path inside it",
    "workdir": "a project folder to sync to every node (only what changed is sent; .gitignore and "
    ".gpuclusterignore are honoured); the job runs in its own copy of it on each node",
    "args": ARGS_HELP,
    "requirements": "a pip requirements file: installed once per node into an environment of its own, "
    "layered over the node venv (torch is not installed again)",
    "env": "KEY=VALUE for every rank, taken literally; repeat for more",
    "max-sync-mb": f"refuse a workdir bigger than this (default {workdir.DEFAULT_MAX_SYNC_MB}; 1 MB = 1,000,000 bytes)",
    "max-result-mb": f"leave a result file bigger than this on the head node (default {DEFAULT_MAX_RESULT_MB})",
    "max-restarts": RESTARTS_HELP,
    "nproc-per-node": NPROC_HELP,
    **HANG_HELP,
    "stack": STACK_HELP,
}


@task(help=RUN_HELP, iterable=["env"], auto_shortflags=False)  # long flags only: a dozen options share few letters
def run(
    c,
    script=None,
    workdir=None,
    args="",
    requirements=None,
    env=None,
    max_sync_mb=None,
    max_result_mb=None,
    max_restarts=None,
    nproc_per_node=None,
    hang_timeout=None,
    on_hang=None,
    stack=None,
):
    """Run a torchrun script of yours on every node: one file, or a whole project folder (--workdir)."""
    launch_options = dict(
        args=options.script_arguments(args),
        max_restarts=restarts(max_restarts),
        nproc_per_node=processes(nproc_per_node),
        hang=options.hang_policy(hang_timeout, on_hang),
    )
    start_job(stack, run_spec(script, workdir, requirements, env or [], max_sync_mb, max_result_mb, launch_options))


def run_spec(script, folder, requirements, env, max_sync_mb, max_result_mb, launch_options: dict) -> JobSpec:
    """`fab run`'s options, every one checked before anything is created."""
    common = dict(
        launch_options,
        requirements=options.requirements_file(requirements),
        env=options.environment(env),
        max_result_bytes=options.megabytes("--max-result-mb", max_result_mb, DEFAULT_MAX_RESULT_MB),
    )
    if folder is None:
        if max_sync_mb is not None:
            raise options.refuse("--max-sync-mb limits --workdir; give --workdir DIR too")
        path = options.compiled_script(script)
        return JobSpec("run", path.name, upload=path.resolve(), **common)
    root = options.workdir(folder)
    path = options.compiled_script(script, root)
    max_bytes = options.megabytes("--max-sync-mb", max_sync_mb, workdir.DEFAULT_MAX_SYNC_MB)
    project, relative = workdir.checked_project(root, path, max_bytes)
    return JobSpec("run", relative, workdir=project, **common)


def restarts(value: str | None) -> int:
    return options.integer("--max-restarts", value, 0, minimum=0)


def processes(value: str | None) -> int | None:
    """`--nproc-per-node` as given (None: one per GPU); the GPU-count limit is checked at launch."""
    return None if value is None else options.integer("--nproc-per-node", value, 1, minimum=1)


@task(
    help={
        "force": "redo every stage even where it is up to date",
        "master-port": f"MASTER_PORT for the rendezvous on node-0, {options.PORT_RANGE[0]}..{options.PORT_RANGE[1]}, "
        f"free there (default {commands.DEFAULT_MASTER_PORT})",
        "stack": STACK_HELP,
    }
)
def bootstrap(c, force=False, master_port=None, stack=None):
    """Prepare every node: checks, Python deps, code sync, node environment, health check."""
    port = options.port("--master-port", master_port, commands.DEFAULT_MASTER_PORT)
    Bootstrap(cluster_for(stack), bool(force), port).run()


@task(help={"stack": STACK_HELP})
def stop(c, stack=None):
    """Stop whatever job runs on the cluster, on every node."""
    cluster = cluster_for(stack)
    for node, outcome in stop_everywhere(cluster).items():
        say(f"{node}: {outcome}")


@task(
    name="clean-runs",
    help={"keep": "how many of the newest runs keep their copies (default 3; 0 for none)", "stack": STACK_HELP},
)
def clean_runs(c, keep=None, stack=None):
    """Free disk on every node: remove old runs' workdir copies and results folders (never checkpoints)."""
    count = options.integer("--keep", keep, 3, minimum=0)
    cluster = cluster_for(stack)
    setup = setup_for(cluster)
    sessions, statuses = open_sessions(cluster, commands.job_status_command())
    try:
        check_ready(sessions, statuses)
        with JobLock(sessions[0], commands.new_run_id("clean-runs"), "clean-runs"):  # no job starts meanwhile
            outcomes = on_all_nodes(
                sessions,
                lambda s: commands.parse_last_json(
                    s.run(
                        "cd && "
                        + commands.node_module(
                            cluster, setup.python[s.node.name], "sync", "clean", contract.RUNS, str(count)
                        ),
                        warn=False,
                    ).stdout
                ),
            )
    finally:
        for session in sessions:
            session.close()
    failed = False
    for result in outcomes:
        outcome = result.value
        if outcome is None:
            failed = True
            say(f"{result.name}: could not clean: {describe(result.error)}")
            continue
        say(
            f"{result.name}: removed the copies of {outcome['removed']} of {outcome['runs']} runs "
            f"({workdir.human_bytes(outcome['freed_bytes'])}); the newest {count} kept"
        )
    if failed:
        raise Exit(code=1)


@task(
    help={
        "run": "the run id (default: the latest run)",
        "node": "only this node's log",
        "lines": "how many lines from the end of each log (default 50; 0 for all)",
        "stack": STACK_HELP,
    }
)
def logs(c, run=None, node=None, lines=None, stack=None):
    """Show a run's per-node logs (kept on this machine in .cluster/<stack>/runs/<run-id>/)."""
    count = options.integer("--lines", lines, 50, minimum=0)
    run = options.run_id(run) if run is not None else None
    stack_name = state.resolve_stack(stack)
    if stack_name is None:
        raise Exit("error: no cluster: run python deploy.py up", code=2)
    runs = state.runs_dir(stack_name)
    run_dir = runs / run if run else _latest_run(runs)
    if run_dir is None or not run_dir.is_dir():
        raise Exit(f"error: no run {run!r} in {runs}" if run else f"error: no runs yet in {runs}", code=2)
    logs_found = sorted(run_dir.glob("node-*.log"))
    if node:
        logs_found = [p for p in logs_found if p.stem == node]
        if not logs_found:
            raise Exit(f"error: run {run_dir.name} has no log for {node}", code=2)
    say(f"run {run_dir.name} ({run_dir})")
    for path in logs_found:
        text = path.read_text().splitlines()
        shown = text[-count:] if count > 0 else text
        for line in shown:  # the nodes prefix their own lines; a line fab wrote before them gets one here
            say(line if line.startswith(f"[{path.stem}") else f"[{path.stem}] {line}")
    summary = run_dir / "summary.json"
    if summary.exists():
        say(summary_line(summary))


def summary_line(path: Path) -> str:
    """A run's outcome from its summary.json; a damaged one is said so, after its logs were shown."""
    try:
        data = json.loads(path.read_text())
        return f"exit codes {data['exit_codes']}, {float(data['duration_s']):.1f} s, ${float(data['cost_usd']):.4f}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return (
            f"{path} is damaged ({type(exc).__name__}: {exc}); the logs above are complete, "
            "and python deploy.py cost has the run's exit codes and cost"
        )


def _latest_run(runs: Path) -> Path | None:
    candidates = [p for p in runs.glob("*") if p.is_dir()] if runs.exists() else []
    return max(candidates, key=lambda p: p.name, default=None)


GPU_QUERY = (
    "import json\n"
    "from harness.gpu_monitor import read_gpus\n"
    "from dataclasses import asdict\n"
    "print(json.dumps([asdict(s) for s in read_gpus()]))\n"
)


@task(help={"stack": STACK_HELP})
def gpus(c, stack=None):
    """A table per node: GPU, utilisation, memory, temperature, power (nvidia-ml-py)."""
    cluster = cluster_for(stack)
    setup = setup_for(cluster)
    sessions, _ = open_sessions(cluster)
    try:

        def query(session):
            python = setup.python[session.node.name]
            command = f"cd {commands.shell_path(commands.code_dir(cluster))} && " + commands.python_json_command(
                python, GPU_QUERY
            )
            return session.run(command)

        results = on_all_nodes(sessions, query)
    finally:
        for session in sessions:
            session.close()
    out = console()
    for answer in results:
        name, result = answer.name, answer.value
        if result is None or result.exited != 0:
            out.print(
                f"{name}: could not read GPUs: {answer.error if result is None else result.stderr.strip()[-200:]}"
            )
            continue
        samples = json.loads(result.stdout.strip().splitlines()[-1])
        if not samples:
            out.print(f"{name}: no GPU (CPU node, gloo)")
            continue
        table = Table(title=name)
        for column in ("gpu", "name", "util %", "memory GiB", "temp C", "power W"):
            table.add_column(column)
        for s in samples:
            power = "-" if s["power_w"] is None else f"{s['power_w']:.0f}"
            temp = "-" if s["temp_c"] is None else str(s["temp_c"])
            table.add_row(
                str(s["index"]),
                s["name"],
                str(s["util_pct"]),
                f"{s['mem_used_gib']:.1f} / {s['mem_total_gib']:.1f}",
                temp,
                power,
            )
        out.print(table)


ns = Collection(bootstrap, *(example_task(example) for example in EXAMPLE_TASKS), run, gpus, logs, stop, clean_runs)
