"""The node tasks: `fab bootstrap`, `fab preflight`, `fab gpus`, and `fab clean-runs` (disk on every node)."""

import contextlib
import json
import sys

from invoke.exceptions import Exit

from infra.timeline import Timeline
from node import calls, contract
from remote import job_command, node_paths, nodecall, options, protocol, workdir
from remote.cli import task
from remote.connect import describe, on_all_nodes, open_sessions
from remote.preparation import JobLock, check_ready
from remote.stream import console, say
from remote.task_context import STACK_HELP, cluster_for, setup_for
from remote.tasks_launch import run_preflight


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
    from remote.bootstrap import Bootstrap  # its stages load for a bootstrap only (issue 41: fab's start)
    from remote.bootstrap_stage import remembered_setup

    cluster = cluster_for(stack)
    # Another bootstrap (yours, or the replacement of a lost node) keeps the port the last one chose.
    default = remembered_setup(cluster).master_port or job_command.DEFAULT_MASTER_PORT
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
    from rich.table import Table  # rich loads only for a table: fab's start stays short (issue 41)

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
