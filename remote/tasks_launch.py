"""The launch tasks: one per example (`EXAMPLE_TASKS`: adding one is one line) and `fab run` for the user's own
script or project, each option checked before anything is created; `start_job` launches through the holder."""

import contextlib
from dataclasses import dataclass

from invoke.exceptions import Exit

from infra import state
from infra.errors import UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from remote import fitness, holders, job_command, options, workdir
from remote.cli import task
from remote.connect import open_sessions
from remote.job_spec import DEFAULT_MAX_RESULT_MB, JobSpec, NodeSetup
from remote.stream import say
from remote.task_context import STACK_HELP, cluster_for, report, setup_for

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
