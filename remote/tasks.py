"""The `fab` tasks: prepare the nodes, launch jobs on all of them, watch and stop them.

The cluster is the current stack's inventory (`--stack`, else $CLUSTER_STACK, else the last `up`).
"""

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from invoke import Collection
from invoke.exceptions import Exit
from rich.table import Table

from infra import hints, inventory, runlog, state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from node import calls, contract
from remote import (
    fitness,
    holders,
    job_command,
    log_catchup,
    node_paths,
    nodecall,
    options,
    protocol,
    runs,
    workdir,
)
from remote.bootstrap import Bootstrap, remembered_setup
from remote.cli import task
from remote.connect import describe, on_all_nodes, open_sessions
from remote.launch import (
    DEFAULT_MAX_RESULT_MB,
    JobLock,
    JobSpec,
    NodeSetup,
    check_ready,
)
from remote.stream import console, say

STACK_HELP = "stack to use (default: $CLUSTER_STACK, else the last `python deploy.py up`)"
ARGS_HELP = 'arguments for the script, quoted as one string, e.g. --args "--steps 200"'
HANG_HELP = {
    "hang-timeout": "seconds a rank may wait inside a collective that another rank has not entered before the "
    "job counts as hung (default 300; 0 turns the flight recorder and hang detection off)",
    "on-hang": "stop (default): name the culprit, keep the evidence and stop the job; wait: name it and leave "
    "the job running for you",
    "on-straggler": "report (default): name a rank slower than the others and go on; replace: also drain its "
    "node, replace it through the spot path and resume the run from its checkpoint there (Slurm-held runs, "
    "stacks started with --spot)",
}
REPLICAS_HELP = (
    "run as N torchft replica groups (N >= 2, at most the node count; one group per node when N is the "
    "node count): a group that fails is dropped and the others go on; your script uses torchft (README)"
)
RESTARTS_HELP = "torchrun --max-restarts: restart a failed worker group this many times, >= 0 (default 0)"
DETACH_HELP = (
    "submit and return (the run id is the last line): the run is held by Slurm on the cluster, which "
    "bootstrap sets up wherever Slurm is installed on the nodes"
)
PREFLIGHT_HELP = {
    "preflight": "run fab preflight's checks first (about 10 s on 2 nodes) and refuse a CRITICAL node",
    "skip-preflight": "launch even where the last preflight found a node CRITICAL (without it, such a launch "
    "is refused, exit 1)",
}
NPROC_HELP = (
    f"processes per node, 1..{options.MAX_NPROC_PER_NODE} (default: one per GPU, one on CPU nodes); "
    "at most the GPU count on GPU nodes"
)


def report(cluster: ClusterInfo, ending: holders.Ending) -> None:
    """How a launch or a follow ended, said the one way for both holders: submitted (its id last),
    detached (it goes on), cancelled by Ctrl-C (130), or its outcome (`runs.outcome`: 0 or 1)."""
    run, folder = ending.run, ending.folder
    if run.timeline is not None and not ending.detached:  # the phases this command saw, in one line
        say(f"fab: {run.timeline.line()}")
    if ending.submitted:
        follow, cancel = hints.fab(f"logs -f --run {run.run_id}"), hints.fab(f"stop --run {run.run_id}")
        say(f"fab: follow it with {follow}; cancel it with {cancel}")
        print(run.run_id, flush=True)  # alone on the last line, for scripts
        return
    if ending.cancelled_by:
        raise Exit(f"fab: run {run.run_id} was cancelled by {ending.cancelled_by}; its log: {folder}", code=1)
    if ending.detached:
        say(
            f"fab: stopped following ({ending.detached}); run {run.run_id} goes on on the cluster: "
            + hints.fab(f"logs -f --run {run.run_id}")
        )
        if ending.interrupted:
            raise Exit(code=130)
        return
    if ending.interrupted:
        say(f"fab: run {run.run_id} cancelled (Ctrl-C): stopped on every node; logs: {folder}")
        raise Exit(code=130)
    code, line = runs.outcome(cluster, run, folder)
    if code:
        raise Exit(line, code=code)
    say(line)


def cluster_for(stack: str | None) -> ClusterInfo:
    try:
        cluster = inventory.load_current(stack)
    except UsageError as exc:
        raise Exit(f"error: {exc}", code=2) from None
    if not cluster.nodes_move:
        return cluster
    from infra import providers  # boto3 loads only where nodes move (AWS spot workers)

    return providers.current(cluster, lambda line: print(line, file=sys.stderr, flush=True))  # not into --json


def setup_for(cluster: ClusterInfo) -> NodeSetup:
    return NodeSetup.load(cluster.stack)


def holder_of(stack: str | None) -> tuple[ClusterInfo, holders.RunHolder]:
    cluster = cluster_for(stack)
    return cluster, holders.holder_for(cluster, setup_for(cluster))


def start_job(stack: str | None, spec: JobSpec, detach: bool = False, preflight: str = "gate") -> None:
    """Launch `spec` on every node, held as bootstrap chose; exit 1 naming the node that failed, 130 on
    Ctrl-C (`detach`: submitted only, its id printed last). The timeline starts with this process.
    `preflight`: gate (refuse a node the last preflight found CRITICAL and a fresh one finds so again), run
    (a fresh preflight first, then the gate), skip."""
    timeline = Timeline.since_process_start()
    options.job_text(spec.args, spec.env)
    cluster = cluster_for(stack)
    problem = job_command.nproc_problem(cluster.nodes, spec.nproc_per_node) or job_command.replicas_problem(
        len(cluster.nodes), spec.replicas
    )
    if problem:
        raise Exit(f"error: {problem}", code=2)
    setup = setup_for(cluster)
    holder = holders.holder_for(cluster, setup)
    if spec.hang.on_straggler == "replace":
        replace_problem = straggler_replace_problem(cluster, holder)
        if replace_problem:
            raise Exit(f"error: {replace_problem}", code=2)
    if preflight == "run":
        run_preflight(cluster, setup)
    elif preflight == "gate" and fitness.recorded_critical(cluster):
        # A node found CRITICAL is measured again before a launch is refused: a speed measured on a busy
        # machine (bootstrap's, or nodes sharing one machine) can read low once; a sick node reads low again.
        say("fab: the last preflight found a node CRITICAL: checking again before refusing")
        with contextlib.suppress(UsageError):  # a job holds MASTER_PORT: the verdict on record stands
            run_preflight(cluster, setup, shown=False)
    if preflight != "skip":
        fitness.gate(cluster)
    report(cluster, holder.launch(spec, detach, timeline))


def straggler_replace_problem(cluster: ClusterInfo, holder: holders.RunHolder) -> str:
    """Why `--on-straggler replace` cannot be done on this cluster ('' where it can): the run must be held
    by Slurm (its requeue resumes the run) and the stack must replace a node that goes (the spot path)."""
    if not holder.replaces_stragglers:
        return (
            "--on-straggler replace needs a run held by Slurm (its requeue resumes the run on the replacement); "
            f"this cluster's runs are held by fab ({holder.why_not or 'fab bootstrap --scheduler slurm'})"
        )
    from infra import providers  # boto3 loads only where asked

    why = providers.for_cluster(cluster).replacement_problem(cluster)
    return f"--on-straggler replace needs a stack whose nodes are replaced when they go: {why}" if why else ""


def preflight_mode(preflight: bool, skip_preflight: bool) -> str:
    """`--preflight` / `--skip-preflight` as start_job's `preflight`; both at once is bad input."""
    if preflight and skip_preflight:
        raise options.refuse("--preflight runs the checks and --skip-preflight ignores them: give one")
    return "run" if preflight else "skip" if skip_preflight else "gate"


def run_preflight(cluster: ClusterInfo, setup: NodeSetup, shown: bool = True) -> fitness.Fitness:
    """The preflight job on every node, judged, kept (`.cluster/<stack>/preflight.json`) and shown."""
    sessions, _ = open_sessions(cluster)
    try:
        fitness.refuse_busy(cluster, sessions[0], setup.master_port)
        found = fitness.check(cluster, sessions, setup, state.stack_dir(cluster.stack) / "preflight")
    finally:
        for session in sessions:
            session.close()
    fitness.save(cluster, found)
    if shown:
        fitness.show(found)
        for verdict in found.named:
            say(f"preflight: {verdict.node} {verdict.level}: {verdict.why()}")
        for node in found.failed:
            for line in found.tails.get(node, [])[-10:]:
                say(f"  [{node}] {line}")
    return found


@dataclass(frozen=True)
class ExampleTask:
    """A launch task that runs one of the examples on every node."""

    name: str
    """The fab task's name, dashed (`fab run-ddp`)."""
    script: str
    """The example it runs, relative to the synced code folder."""
    help: str
    """One line for `fab --list`."""
    fault_tolerant: bool = False
    """Whether the example follows the fault-tolerant contract (README): only then does it take --replicas."""
    plain_only: tuple[str, ...] = ()
    """`--args` flags its replica groups refuse (`--flag=KEPT`: unless KEPT), refused here with --replicas."""


# Adding an example task is one line here: the table registers the tasks and the collection.
EXAMPLE_TASKS = (
    ExampleTask(
        "hello",
        "examples/distributed_hello.py",
        "Distributed hello: every rank reports in; all-reduce, broadcast, all-gather checked.",
    ),
    ExampleTask(
        "run-ddp",
        "examples/ddp_training.py",
        "DDP training across all nodes (examples/ddp_training.py); --replicas N: torchft replica groups.",
        fault_tolerant=True,
        plain_only=("--precision=fp32", "--compile", "--profile-dir", "--simulate-failure-at-step"),
    ),
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

    def body(
        c,
        args="",
        max_restarts=None,
        nproc_per_node=None,
        hang_timeout=None,
        on_hang=None,
        on_straggler=None,
        replicas=None,
        detach=False,
        preflight=False,
        skip_preflight=False,
        stack=None,
    ):
        if replicas is not None and not example.fault_tolerant:
            raise options.refuse(
                f"--replicas needs a script that follows torchft's contract (README, Fault-tolerant runs); "
                f"{example.name} runs {example.script}, which does not (each group would train alone): "
                "fab run-ddp --replicas N, or fab run --script examples/ft_training.py --replicas N"
            )
        arguments = options.script_arguments(args, *((example.plain_only, example.name) if replicas else ()))
        mode = preflight_mode(bool(preflight), bool(skip_preflight))
        start_job(
            stack,
            JobSpec(
                example.name,
                example.script,
                arguments,
                restarts(max_restarts),
                nproc_per_node=processes(nproc_per_node),
                **fault_tolerance(replicas, hang_timeout, on_hang, on_straggler),
            ),
            detach=bool(detach),
            preflight=mode,
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
            "replicas": REPLICAS_HELP,
            "detach": DETACH_HELP,
            **PREFLIGHT_HELP,
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
    "env-file": "a file of KEY=VALUE lines for every rank (dotenv: # comments, quotes, export); no value is printed",
    "max-sync-mb": f"refuse a workdir bigger than this (default {workdir.DEFAULT_MAX_SYNC_MB}; 1 MB = 1,000,000 bytes)",
    "max-result-mb": f"leave a result file bigger than this on the head node (default {DEFAULT_MAX_RESULT_MB})",
    "max-restarts": RESTARTS_HELP,
    "nproc-per-node": NPROC_HELP,
    **HANG_HELP,
    "replicas": REPLICAS_HELP,
    "detach": DETACH_HELP,
    **PREFLIGHT_HELP,
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
    env_file=None,
    max_sync_mb=None,
    max_result_mb=None,
    max_restarts=None,
    nproc_per_node=None,
    hang_timeout=None,
    on_hang=None,
    on_straggler=None,
    replicas=None,
    detach=False,
    preflight=False,
    skip_preflight=False,
    stack=None,
):
    """Run a torchrun script of yours on every node: one file, or a whole project folder (--workdir)."""
    launch_options = dict(
        args=options.script_arguments(args),
        max_restarts=restarts(max_restarts),
        nproc_per_node=processes(nproc_per_node),
        **fault_tolerance(replicas, hang_timeout, on_hang, on_straggler),
    )
    launch_options["env"] = options.environment(env or [], env_file)
    mode = preflight_mode(bool(preflight), bool(skip_preflight))
    spec = run_spec(script, workdir, requirements, max_sync_mb, max_result_mb, launch_options)
    start_job(stack, spec, detach=bool(detach), preflight=mode)


def run_spec(script, folder, requirements, max_sync_mb, max_result_mb, launch_options: dict) -> JobSpec:
    """`fab run`'s options, every one checked before anything is created."""
    common = dict(
        launch_options,
        requirements=options.requirements_file(requirements),
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


def fault_tolerance(
    replicas: str | None, hang_timeout: str | None, on_hang: str | None, on_straggler: str | None = None
) -> dict:
    """`--replicas` and the hang watch, as JobSpec fields. A fault-tolerant run has no hang watch: a group
    that stops answering is torchft's to drop (its heartbeat timeout), and a watch would stop every group."""
    if replicas is None:
        return {"hang": options.hang_policy(hang_timeout, on_hang, on_straggler)}
    if hang_timeout is not None or on_hang is not None or on_straggler is not None:
        raise options.refuse(
            "--replicas runs without the hang watch (torchft drops a group that stops answering): "
            "leave out --hang-timeout, --on-hang and --on-straggler"
        )
    count = options.integer("--replicas", replicas, 0, minimum=2)  # at most the node count: checked at launch
    return {"replicas": count, "hang": options.hang_policy("0", None)}


def restarts(value: str | None) -> int:
    return options.integer("--max-restarts", value, 0, minimum=0, maximum=options.MAX_RESTARTS)


def processes(value: str | None) -> int | None:
    """`--nproc-per-node` as given (None: one per GPU); the GPU-count limit is checked at launch."""
    if value is None:
        return None
    return options.integer("--nproc-per-node", value, 1, minimum=1, maximum=options.MAX_NPROC_PER_NODE)


@task(
    help={
        "force": "redo every stage even where it is up to date",
        "master-port": f"MASTER_PORT for the rendezvous on node-0, {options.PORT_RANGE[0]}..{options.PORT_RANGE[1]}, "
        f"free there (default {job_command.DEFAULT_MASTER_PORT})",
        "scheduler": "slurm: Slurm on the nodes holds every run (detach, queue, follow, cancel); none: runs are "
        "held by fab's SSH sessions; auto: slurm where every node has it and one user, else none, saying why "
        "(default: what the last bootstrap chose, else auto)",
        "accounting": "auto: Slurm's accounting (sacct's history) where the head node has slurmdbd and MariaDB; "
        "none (default: what the last bootstrap chose, else auto)",
        "stack": STACK_HELP,
    }
)
def bootstrap(c, force=False, master_port=None, scheduler=None, stack=None, accounting=None):
    """Prepare every node: checks, Python deps, code sync, node environment, health check, scheduler."""
    timeline = Timeline.since_process_start()
    cluster = cluster_for(stack)
    # Another bootstrap (yours, or the replacement of a lost node) keeps the port the last one chose.
    default = remembered_setup(cluster).get("master_port") or job_command.DEFAULT_MASTER_PORT
    port = options.port("--master-port", master_port, default)
    chosen = options.choice("--scheduler", scheduler, ("auto", "slurm", "none")) if scheduler is not None else None
    kept = options.choice("--accounting", accounting, ("auto", "none")) if accounting is not None else None
    Bootstrap(cluster, bool(force), port, chosen, timeline, kept).run()


@task(help={"json": "machine-readable: every node's measurements, verdict and why; the pairs", "stack": STACK_HELP})
def preflight(c, json_=False, stack=None):
    """Check every node before a job: compute, memory, disk, GPUs (ECC, retired pages, throttling, PCIe,
    DCGM, Xids), each pair's all-reduce bandwidth, clocks; OK / WARN / CRITICAL per node (exit 1 on CRITICAL)."""
    cluster = cluster_for(stack)
    setup = setup_for(cluster)
    with contextlib.redirect_stdout(sys.stderr if json_ else sys.stdout):  # --json: stdout is the JSON alone
        found = run_preflight(cluster, setup, shown=not json_)
    if json_:
        print(json.dumps(found.as_dict(), indent=2))
    if found.critical:
        raise Exit(code=1)


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
    name="clean-runs",
    help={"keep": "how many of the newest runs keep their copies (default 3; 0 for none)", "stack": STACK_HELP},
)
def clean_runs(c, keep=None, stack=None):
    """Free disk on every node: remove old runs' workdir copies and results folders (never checkpoints)."""
    count = options.integer("--keep", keep, 3, minimum=0)
    cluster = cluster_for(stack)
    setup = setup_for(cluster)
    sessions, statuses = open_sessions(cluster, protocol.job_status_command())
    try:
        check_ready(sessions, statuses, queued=True)
        with JobLock(
            sessions[0], job_command.new_run_id("clean-runs"), "clean-runs"
        ):  # after the job; none starts meanwhile
            outcomes = on_all_nodes(
                sessions, lambda s: nodecall.call(s, setup.python[s.node.name], calls.CleanRuns(contract.RUNS, count))
            )
            stages = _clean_stages(cluster, sessions[0], setup.python[cluster.head.name], count)
    finally:
        for session in sessions:
            session.close()
    stages_line, stages_ok = stages
    failed = not stages_ok
    for result in outcomes:
        outcome = result.value
        if outcome is None:
            failed = True
            say(f"{result.name}: could not clean: {describe(result.error)}")
            continue
        say(
            f"{result.name}: removed the copies of {outcome.removed} of {outcome.runs} runs "
            f"({workdir.human_bytes(outcome.freed_bytes)}); the newest {count} kept"
        )
    if stages_line:
        say(stages_line)
    if failed:
        raise Exit(code=1)


def _clean_stages(cluster, head, python: str, keep: int) -> tuple[str, bool]:
    """The old runs' stages on the shared folder, removed once from the head node: the line that says so
    ('' where the cluster has no shared folder), and whether it worked."""
    if not cluster.shared_dir:
        return "", True
    runs = node_paths.shared_or_home(cluster, "runs")
    try:
        outcome = nodecall.call(head, python, calls.CleanRuns(runs, keep, [contract.RUN_STAGE]))
    except Exception as exc:
        return f"shared folder: could not remove old runs' stages: {describe(exc)}", False
    return (
        f"shared folder: removed the stages of {outcome.removed} of {outcome.runs} runs "
        f"({workdir.human_bytes(outcome.freed_bytes)}); the newest {keep} kept"
    ), True


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
    batch script's lines, for a run held by Slurm), each line with its writer's prefix once."""
    logs_found = sorted(run_dir.glob("node-*.log"))
    if node:
        logs_found = [p for p in logs_found if p.stem == node]
    elif (run_dir / runlog.CLUSTER_LOG).exists():
        logs_found.append(run_dir / runlog.CLUSTER_LOG)
    for path in logs_found:
        text = path.read_text(errors="replace").splitlines()
        shown = text[-count:] if count > 0 else text
        for line in shown:  # the nodes prefix their own lines; a line fab wrote before them gets one here
            own = line.startswith(f"[{path.stem}") or path.name == runlog.CLUSTER_LOG
            say(line if own else f"[{path.stem}] {line}")


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
            command = f"cd {node_paths.shell_path(node_paths.code_dir(cluster))} && " + protocol.python_json_command(
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


ns = Collection(
    bootstrap,
    *(example_task(example) for example in EXAMPLE_TASKS),
    run,
    preflight,
    gpus,
    logs,
    stop,
    clean_runs,
    jobs,
    results,
)
