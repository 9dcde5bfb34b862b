"""A run held by Slurm on the cluster (`fab bootstrap --scheduler slurm`): prepared, staged and submitted.

A launch prepares the nodes as an attached one does (`remote/preparation.py`: workdir, requirements, script,
each node's copy of the workdir made now, so a later sync cannot change a queued run), stages the project and
the requirements file once on the shared folder (a replaced node's job makes its own copy and environment from
there), then submits one batch job (node/slurm_run.py) whose step runs the same `launch_command` on every node.
From then on the run belongs to the cluster: fab follows its log on the head node (`remote/slurm_follow.py`),
and a closed connection, a SIGHUP or a killed fab only stops the following. Ctrl-C cancels (an explicit choice).

Each run has a record in its local run folder (`run.json`): the Slurm job, the log on the head node,
the state as last seen. Every command that talks to the cluster refreshes the records of runs not yet
ended (`remote/slurm_jobs.py`), and the first to see a run end finishes it (`remote/slurm_finish.py`).
"""

import contextlib
import io
import time
from pathlib import Path

from infra import state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from node import calls, contract
from node.run_spec import RunSpec, SpecNode, WatchSpec
from node.run_watch import OVERDUE_GRACE_S
from remote import job_command, node_paths, nodecall, protocol
from remote.connect import NodeSession, describe, on_all_nodes
from remote.hangwatch import ask_command, tell_ranks_command
from remote.job_spec import JobSpec, NodeSetup
from remote.preparation import (
    job_script,
    node_command,
    open_launch,
    owning,
    prepare,
    send_env_values,
    upload_script,
)
from remote.runs import Run, RunBook, spec_facts
from remote.slurm_follow import Followed, follow
from remote.slurm_jobs import forget_env_values
from remote.stopping import forget_launch
from remote.stream import say


def head_path(setup: NodeSetup, cluster: ClusterInfo, path: str) -> str:
    """A node path (`$HOME/...` or absolute) as an absolute path on the head node."""
    home = setup.homes.get(cluster.head.name)
    if path.startswith("$HOME/"):
        if not home:
            raise UsageError("bootstrap.json lacks the head node's home: run fab bootstrap")
        return f"{home}/{path[len('$HOME/') :]}"
    return path


def submit(
    cluster: ClusterInfo,
    head: NodeSession,
    setup: NodeSetup,
    run_id: str,
    task: str,
    commands: dict[str, str],
    watch: WatchSpec | None = None,
    replicas: int = 0,
) -> str:
    """sbatch the run (one task per node, each running its command; `watch`: the hang watch that runs
    beside it on the head node; `replicas`: torchft replica groups, so one node's end ends no other's);
    the Slurm job id."""
    run_dir = head_path(setup, cluster, node_paths.remote_run_dir(cluster, run_id))
    spec = RunSpec(
        run_id=run_id,
        log=f"{run_dir}/{contract.RUN_LOG}",
        python=cluster.python,
        nodes=tuple(SpecNode(n.name, setup.homes.get(n.name, ""), commands[n.name]) for n in cluster.nodes),
        watch=watch,
        replicas=replicas,
    )
    try:  # the spec on stdin (its commands carry --env values): `submit` makes the run's folder and script
        return nodecall.call(head, cluster.python, calls.SubmitRun(spec.as_dict())).job_id
    except OperationError as exc:
        raise OperationError(f"the run could not be submitted to Slurm: {exc}") from None


def launch(
    cluster: ClusterInfo,
    spec: JobSpec,
    setup: NodeSetup,
    runs_root: Path,
    detach: bool,
    timeline: Timeline | None = None,
) -> tuple[Path, Run, Followed | None]:
    """Prepare, submit and (unless `detach`) follow one run; the run's local folder, its record (its
    timeline up to the submit), and how following ended (None when detached at once)."""
    timeline = timeline or Timeline(time.time(), clock=time.monotonic())
    wanted, sessions, statuses, run_id = open_launch(cluster, spec, timeline)
    kept = None  # the head node's connection, kept open for the follow and the finish: no new handshakes
    try:
        local_dir = runs_root / run_id
        # The lock keeps the workdir caches and environments to one launch at a time; a launch with neither
        # writes only into its own run's folders, and skips the lock's round trip.
        shared = spec.workdir is not None or spec.requirements is not None
        owned = owning(sessions, statuses, spec, run_id, queued=True, timeline=timeline)
        with owned if shared else contextlib.nullcontext() as lock:
            prepare(cluster, sessions, statuses, spec, setup, wanted, timeline)
            if spec.upload:
                upload_script(cluster, sessions, run_id, spec.upload)
                timeline.mark("upload")
            if spec.workdir:  # each node's copy now: a later sync must not change a run that waits in the queue
                copy_workdir(sessions, run_id, spec.workdir.key)
                timeline.mark("copy")
            staged = stage(cluster, sessions[0], spec, run_id)
            if staged is not None:
                timeline.mark("stage")
        if lock is not None and lock.ended:  # `fab stop` found it preparing: it submits nothing
            forget_launch(sessions, cluster, run_id)
            raise protocol.stopped_before_start(run_id, cluster.head.name, "it was submitted")
        values = slurm_held_values(cluster, spec, run_id)
        if values:  # once on the shared folder (every node, a replaced one too, reads it there), else per node
            send_env_values(sessions[:1] if cluster.shared_dir else sessions, values, spec.env)
        script = job_script(cluster, spec, run_id)
        # The copy is made: each node's command only makes the job's folder (no workdir key), or its copy and
        # environment from the stage where its node has none (a replaced node).
        commands = {
            node.name: node_command(cluster, node, spec, setup, run_id, script, None, staged, values)
            for node in cluster.nodes
        }
        watch = watch_spec(cluster, setup, spec, run_id)
        try:
            job_id = submit(cluster, sessions[0], setup, run_id, spec.task, commands, watch, spec.replicas)
        except OperationError:
            if values:  # nothing will read them
                forget_env_values(cluster, run_id, values.path, sessions[0])
            raise
        timeline.mark("submit")
        kept = None if detach else sessions[0]
    finally:
        for session in sessions:
            if session is not kept:
                session.close()
    run = Run(
        run_id,
        spec.task,
        job_id,
        f"{head_path(setup, cluster, node_paths.remote_run_dir(cluster, run_id))}/{contract.RUN_LOG}",
        [node.name for node in cluster.nodes],
        time.time(),
        spec={**spec_facts(spec), "env_values": values.path if values else None},
        timeline=timeline,
    )
    run.save(state.make_private_dir(local_dir))
    book = RunBook(cluster)
    book.started(run_id, spec.task, scheduled=True)
    book.close()
    say(
        f"fab: run {run_id}: {spec.task} on {len(cluster.nodes)} nodes, held by Slurm (job {job_id}); "
        f"logs in {local_dir}"
    )
    if detach:
        return local_dir, run, None
    return local_dir, run, follow(cluster, run, local_dir, head=kept)  # the hang watch runs on the cluster


def copy_workdir(sessions: list[NodeSession], run_id: str, workdir_key: str) -> None:
    """Each node's copy of the workdir for this run, made at submit from the node's cache."""
    folder = node_paths.shell_path(node_paths.node_run_dir(run_id))
    copy = f"mkdir -p {folder} && {job_command.workdir_step(run_id, workdir_key)}"
    copied = on_all_nodes(sessions, lambda s: s.run(copy, warn=False))
    if copied.failed:
        why = "; ".join(f"{r.name}: {describe(r.error)}" for r in copied.failed)
        raise OperationError(f"could not copy the workdir for run {run_id}: {why}")


def watch_spec(cluster: ClusterInfo, setup: NodeSetup, spec: JobSpec, run_id: str) -> WatchSpec | None:
    """The run spec's `watch`: the hang watch that runs beside the batch job on the cluster (it holds while no
    fab follows the run; node/slurm_watch.py); None where the hang watch is off."""
    if not spec.hang.enabled:
        return None
    asked = {
        action: {n.name: ask_command(cluster, setup.python[n.name], run_id, action) for n in cluster.nodes}
        for action in ("status", "collect")
    }
    return WatchSpec(
        timeout_s=spec.hang.timeout_s,
        poll_s=spec.hang.poll_s,
        on_hang=spec.hang.on_hang,
        on_straggler=spec.hang.on_straggler,
        shared_dir=cluster.shared_dir or "",  # where a straggler's power-off marker goes (replace)
        tell_ranks={n.name: tell_ranks_command(cluster, setup.python[n.name], n.name) for n in cluster.nodes},
        overdue_grace_s=OVERDUE_GRACE_S,
        status=asked["status"],
        collect=asked["collect"],
    )


def slurm_held_values(cluster: ClusterInfo, spec: JobSpec, run_id: str) -> job_command.EnvValues | None:
    """A Slurm-held run's `--env` values: read at every start (a requeue starts the command again), from
    the run's stage where the cluster has a shared folder, else each node's run folder; `finish` removes
    them."""
    if not spec.env:
        return None
    folder = node_paths.run_stage(cluster, run_id) or node_paths.node_run_dir(run_id)
    return job_command.EnvValues(f"{folder}/{contract.RUN_ENV_VALUES}", once=False)


def stage(cluster: ClusterInfo, head: NodeSession, spec: JobSpec, run_id: str) -> job_command.Stage | None:
    """The run's stage on the shared folder (`contract.RUN_STAGE`), from which a node that lacks the job's
    workdir copy or requirements environment (a replaced one) makes them: the project as the head node's
    cache holds it now, the requirements file. None where the cluster has no shared folder (each node keeps
    its own copy, and no node joins by itself), or the run needs neither; made whole or not at all."""
    folder = node_paths.run_stage(cluster, run_id)
    if folder is None or not (spec.workdir or spec.requirements):
        return None
    files = f"{folder}/{contract.STAGE_FILES}"
    steps = [f"mkdir -p {node_paths.shell_path(folder)}"]
    if spec.workdir:
        cache = contract.in_home(f"{contract.workdir_cache(spec.workdir.key)}/{contract.WORKDIR_FILES}")
        steps.append(f"cp -pR {node_paths.shell_path(cache)} {node_paths.shell_path(files)}")
    try:
        result = head.run(" && ".join(steps))
        why = (result.stderr.strip() or f"exit {result.exited}").splitlines()[-1] if result.exited else ""
        if not why and spec.requirements:
            head.conn.put(io.BytesIO(spec.requirements.text), remote=f"{folder}/{contract.STAGE_REQUIREMENTS}")
    except Exception as exc:
        why = describe(exc)
    if why:
        try:
            head.run(f"rm -rf {node_paths.shell_path(folder)}")
        except Exception:  # the head does not answer: the error below says so already
            pass
        raise OperationError(
            f"could not stage run {run_id} on the shared folder ({folder}): {why}; nothing was submitted"
        )
    return job_command.Stage(
        folder, files=bool(spec.workdir), env_dir=spec.requirements.env_dir if spec.requirements else None
    )
