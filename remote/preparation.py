"""A launch's preparation, the same for both holders (attached, `remote/launch.py`; held by Slurm,
`remote/scheduled.py`): open the sessions and check the nodes (`open_launch`), own the head node's job lock
in its turn (`owning`), prepare the workdir and the requirements (`prepare`), upload the script, send the
`--env` values, and build each node's command (`node_command`)."""

import contextlib
import os
import shlex
import socket
from pathlib import Path

import paramiko

from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from remote import free_space, job_command, node_paths, protocol, workdir
from remote.connect import CONNECTION_ERRORS, NodeSession, describe, on_all_nodes, open_sessions
from remote.hangwatch import job_environment, rankhook_path
from remote.job_spec import JobSpec, NodeSetup
from remote.packages import ensure as ensure_requirements
from remote.stream import say
from remote.workdir import Manifest

LOCK_WAIT_S = 30  # for the head node to answer whether the job lock is ours


class JobLock:
    """The cluster's one-job lock on the head node (node/job_lock.py), held over an SSH channel
    of its own: taking it is atomic, and closing the channel, or losing it, releases it. A launch that
    finds it held waits its turn (in arrival order) and says so once: launches queue, never refuse."""

    def __init__(self, head: NodeSession, run_id: str, task: str):
        self.head, self.run_id, self.task = head, run_id, task
        self.channel: paramiko.Channel | None = None
        self.waited = False
        """Whether another launch held the lock first (what it found before may have changed since)."""
        self.ended = False
        """Whether its holder was ended while this launch held the lock (`fab stop` ends it first), as seen
        at the release."""

    def __enter__(self) -> "JobLock":
        name, owner = self.head.node.name, f"{socket.gethostname()}:{os.getpid()}"
        try:
            channel = self.head.conn.client.get_transport().open_session(timeout=LOCK_WAIT_S)
        except CONNECTION_ERRORS as exc:
            raise OperationError(f"could not take the job lock on {name}: {describe(exc)}") from None
        try:
            channel.settimeout(LOCK_WAIT_S)
            channel.exec_command(protocol.lock_command(self.run_id, self.task, owner))
            replies = channel.makefile("r")
            reply = replies.readline().strip()
            state, holder = protocol.parse_lock_reply(reply)
            if state == "waiting" and holder is not None:
                self.waited = True
                say(
                    f"fab: {name} is busy with run {holder['run_id']} ({holder['task']}, fab {holder['owner']}): "
                    f"run {self.run_id} waits its turn (Ctrl-C gives up)"
                )
                channel.settimeout(None)  # as long as the launches before it take
                reply = replies.readline().strip()
                state, holder = protocol.parse_lock_reply(reply)
            if state == "locked":
                self.channel = channel
                return self
            why = reply or channel.makefile_stderr("r").read().decode(errors="replace").strip()[-200:]
            code = channel.recv_exit_status() if channel.exit_status_ready() or not why else -1
        except CONNECTION_ERRORS as exc:
            raise OperationError(f"could not take the job lock on {name}: {describe(exc)}") from None
        finally:
            if self.channel is None:
                channel.close()
        if not why or code >= 128 or code < 0:  # the holder was ended before it answered: a stop at that moment
            raise OperationError(
                f"the job lock on {name} was ended before it was taken (a fab stop or down at the same moment?): "
                "nothing was started; run the launch again"
            )
        raise UsageError(f"could not take the job lock on {name} ({why}): run fab bootstrap")

    def __exit__(self, *exc_info) -> None:
        """Release: end the holder's input and wait until it has exited, so the next launch finds it free."""
        if self.channel is None:
            return
        try:
            self.channel.shutdown_write()
            self.channel.status_event.wait(LOCK_WAIT_S)
            self.ended = self.lost
        except Exception:  # a dropped connection has released the lock already
            pass
        finally:
            self.channel.close()

    @property
    def lost(self) -> bool:
        """Whether the holder has exited other than at this launch's release (a `fab stop` ended it)."""
        if self.channel is None:
            return self.ended
        return self.channel.status_event.is_set() and self.channel.exit_status != 0


def open_launch(
    cluster: ClusterInfo, spec: JobSpec, timeline: Timeline | None = None
) -> tuple[Manifest | None, list[NodeSession], list[str], str]:
    """A launch's first steps, attached or held by Slurm: the workdir's manifest, one status round on
    every node (`launch_status`), the bootstrap check (UsageError before anything starts; the sessions
    closed), and the new run's id. The caller closes the sessions."""
    wanted = None
    if spec.workdir:
        wanted = workdir.manifest(spec.workdir, workdir.hash_cache_path(cluster, spec.workdir))
    sessions, statuses = open_sessions(cluster, launch_status(spec))
    try:
        check_ready(sessions, statuses, queued=True)  # a job running now: the job lock decides (`owning`)
    except BaseException:
        for session in sessions:
            session.close()
        raise
    if timeline:
        timeline.mark("connect")
    return wanted, sessions, statuses, job_command.new_run_id(spec.task)


def launch_status(spec: JobSpec) -> str:
    asked = protocol.launch_status_command(
        spec.workdir.key if spec.workdir else None, spec.requirements.digest if spec.requirements else None
    )
    return f"{asked}; {free_space.command()}"  # room for the run, checked with the rest (`check_ready`)


@contextlib.contextmanager
def owning(
    sessions: list[NodeSession],
    statuses: list[str],
    spec: JobSpec,
    run_id: str,
    queued: bool = False,
    timeline: Timeline | None = None,
):
    """The head node's job lock for this launch, taken in its turn. Where another launch held it first,
    `statuses` are asked again (that launch may have synced, installed or run meanwhile); then a job
    still running is one no launch holds (its fab was killed), and unless the run is `queued` by the
    scheduler behind it, the launch is refused before anything starts."""
    with JobLock(sessions[0], run_id, spec.task) as lock:
        if lock.waited:
            asked = on_all_nodes(sessions, lambda s: s.run(launch_status(spec)))
            if asked.failed:
                why = "; ".join(f"{r.name}: {describe(r.error)}" for r in asked.failed)
                raise OperationError(f"the nodes stopped answering while run {run_id} waited its turn: {why}")
            statuses[:] = [r.value.stdout for r in asked if r.value is not None]
        check_ready(sessions, statuses, queued=queued)
        if timeline:
            timeline.mark("lock")
        yield lock


def check_ready(sessions: list[NodeSession], statuses: list[str], queued: bool = False) -> None:
    """UsageError (exit 2) if a node is not bootstrapped or (unless the run is `queued` behind it by the
    scheduler) runs a job that no launch holds, before anything starts."""
    for session, output in zip(sessions, statuses, strict=True):
        job, bootstrapped = protocol.parse_job_status(output)
        if job and not queued:
            raise UsageError(
                f"{session.node.name} is running job {job['run_id']} ({job['task']}), which no launch holds "
                "(its fab was killed?): fab stop ends it"
            )
        if not bootstrapped:
            raise UsageError(f"{session.node.name} is not bootstrapped: run fab bootstrap")
    free_space.check([session.node.name for session in sessions], statuses)


def upload_script(cluster: ClusterInfo, sessions: list[NodeSession], run_id: str, script: Path) -> None:
    """Copy the user's script into the run folder: once on shared storage, else on every node at once; one
    round trip each (the folder made and the file written by one command, the script on its stdin)."""
    run_dir = node_paths.shell_path(node_paths.remote_run_dir(cluster, run_id))
    targets = sessions[:1] if cluster.shared_dir else sessions
    data = script.read_bytes()
    command = f"mkdir -p {run_dir} && cat > {run_dir}/{shlex.quote(script.name)}"
    sent = on_all_nodes(targets, lambda s: s.run_with_input(command, data))
    failed = [f"{r.name}: {describe(r.error)}" for r in sent.failed]
    failed += [f"{r.name}: {r.value[2].strip() or f'exit {r.value[0]}'}" for r in sent if r.value and r.value[0]]
    if failed:
        raise OperationError(f"could not copy {script.name} to the nodes: {'; '.join(failed)}")


def node_command(
    cluster: ClusterInfo,
    node,
    spec: JobSpec,
    setup: NodeSetup,
    run_id: str,
    script: str,
    workdir_key: str | None,
    stage: job_command.Stage | None = None,
    values: job_command.EnvValues | None = None,
    locked: bool = False,
) -> str:
    """The job's whole command on one node (`job_command.launch_command`) for this launch's spec, the
    hang watch's recorder and rank hook included; attached launches and Slurm's steps run the same
    (a queued run's with its `stage`; an attached one's `locked`: it holds the job lock as it runs)."""
    return job_command.launch_command(
        cluster,
        node,
        run_id,
        spec.task,
        script,
        spec.args,
        spec.max_restarts,
        setup.master_port,
        spec.nproc_per_node,
        job_environment(cluster, run_id, spec.hang),
        (rankhook_path(),) if spec.hang.enabled else (),
        workdir_key=workdir_key,
        python=spec.requirements.python if spec.requirements else None,
        env=spec.env,
        stage=stage,
        values=values,
        replicas=spec.replicas,
        locked=locked,
    )


def send_env_values(sessions: list[NodeSession], values: job_command.EnvValues, env: dict[str, str]) -> None:
    """Write the `--env` values where the job's command reads them, on SSH stdin (0600, umask 077):
    they are on no command line, here or on the node."""
    path = node_paths.shell_path(values.path)
    folder = node_paths.shell_path(values.path.rsplit("/", 1)[0])
    command = f"mkdir -p {folder} && cat > {path}"
    data = job_command.env_values_text(env).encode()
    sent = on_all_nodes(sessions, lambda s: s.run_with_input(command, data))
    failed = [f"{r.name}: {describe(r.error)}" for r in sent.failed]
    failed += [f"{r.name}: {r.value[2].strip() or f'exit {r.value[0]}'}" for r in sent if r.value and r.value[0]]
    if failed:
        raise OperationError(f"could not send the --env values: {'; '.join(failed)}")


def job_script(cluster: ClusterInfo, spec: JobSpec, run_id: str) -> str:
    """The script as the nodes see it: in the job's copy of the workdir, the run folder, or the code."""
    if spec.workdir:
        return f"{node_paths.job_workdir(run_id)}/{spec.script}"
    if spec.upload:
        return f"{node_paths.remote_run_dir(cluster, run_id)}/{spec.upload.name}"
    return f"$CLUSTER_CODE_DIR/{spec.script}"


def prepare(
    cluster: ClusterInfo,
    sessions: list[NodeSession],
    statuses: list[str],
    spec: JobSpec,
    setup: NodeSetup,
    wanted: Manifest | None,
    timeline: Timeline | None = None,
) -> None:
    """The workdir and the requirements on every node, from what the launch's first command found."""
    if spec.workdir and wanted is not None:
        workdir.sync(cluster, sessions, setup.python, spec.workdir, wanted, _tagged(sessions, statuses, "workdir"))
        if timeline:
            timeline.mark("sync")
    if spec.requirements:
        ensure_requirements(
            cluster,
            sessions,
            setup.python,
            spec.requirements,
            _tagged(sessions, statuses, "env"),
            spec.workdir.key if spec.workdir else None,
        )
        if timeline:
            timeline.mark("requirements")


def _tagged(sessions: list[NodeSession], statuses: list[str], tag: str) -> dict[str, str | None]:
    return {s.node.name: protocol.parse_tagged(output, tag) for s, output in zip(sessions, statuses, strict=True)}
