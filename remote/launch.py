"""Launch one torchrun job on every node at once, stream it, and stop all of it when any part fails.

Each node runs `torchrun` in its own SSH session (one thread per node). When a node's torchrun exits
non-zero, or its connection is lost, or the user presses Ctrl-C, the job is stopped on every other node
(`protocol.stop_command`), so nothing waits forever in a collective and nothing is left behind.
One job at a time: a launch holds the head node's job lock (`JobLock`) from before it creates anything
until its job has ended everywhere; a launch that finds it held waits its turn.
"""

import contextlib
import os
import shlex
import signal
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import paramiko

from infra import state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline, job_phases
from node import calls, contract
from node import hang_rule as hang
from remote import job_command, node_paths, nodecall, protocol, workdir
from remote.connect import CONNECTION_ERRORS, NodeSession, describe, on_all_nodes, open_sessions
from remote.hangwatch import HangPolicy, HangReport, HangWatch, job_environment, rankhook_path
from remote.heal import Healer
from remote.packages import Requirements
from remote.packages import ensure as ensure_requirements
from remote.stream import NodeStream, RankOutcome, node_exited, say
from remote.workdir import Manifest, Project, count_files, human_bytes

STOP_WAIT_S = 15
LOCK_WAIT_S = 30  # for the head node to answer whether the job lock is ours
LOST = 255  # exit code recorded for a node whose connection dropped mid-job
DEFAULT_MAX_RESULT_MB = 50
FETCHED_SHOWN = 6  # file names listed in the "fetched" line


@dataclass(frozen=True)
class JobSpec:
    """What to run on every node."""

    task: str
    """The fab task (or `health` for bootstrap's all-reduce check)."""
    script: str
    """The script torchrun starts: a path in the synced code folder, e.g. examples/ddp_training.py."""
    args: list[str] = field(default_factory=list)
    """Arguments for the script."""
    max_restarts: int = 0
    """torchrun --max-restarts: how often a failed worker group is restarted."""
    upload: Path | None = None
    """A local script to copy into the run folder first (`fab run --script`)."""
    nproc_per_node: int | None = None
    """Processes per node (`--nproc-per-node`); None: one per GPU, one on CPU nodes."""
    hang: HangPolicy = HangPolicy()
    """When a job counts as hung, and what to do then (`--hang-timeout`, `--on-hang`)."""
    workdir: Project | None = None
    """A project folder to sync and run in (`fab run --workdir`); `script` is then relative to it."""
    requirements: Requirements | None = None
    """Packages the job needs beyond the node venv (`fab run --requirements`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables for every rank, taken literally (`fab run --env`)."""
    max_result_bytes: int = DEFAULT_MAX_RESULT_MB * 1_000_000
    """A fetched file bigger than this stays on the head node (`--max-result-mb`)."""
    replicas: int = 0
    """torchft replica groups (`--replicas`): each a torchrun job of its own, so one that fails leaves the
    others training; 0: one job over every node, stopped everywhere at the first failure."""


@dataclass
class JobResult:
    """How a job ended."""

    run_id: str
    """The run's id (also its rendezvous id and folder name)."""
    exit_codes: dict[str, int | None]
    """Per node; None where the job was stopped before it reported."""
    started_at: str
    """ISO-8601 UTC."""
    ended_at: str
    """ISO-8601 UTC."""
    duration_s: float
    """Wall time of the job."""
    interrupted: bool = False
    """True when Ctrl-C ended it."""
    tails: dict[str, list[str]] = field(default_factory=dict)
    """The last lines of each node's output."""
    hang: HangReport | None = None
    """What the hang watch found, if the job hung."""
    ranks: dict[str, RankOutcome] = field(default_factory=dict)
    """Per node, how its ranks ended, as its node/torchrun.py said."""
    watch: dict | None = None
    """What the hang watch did (polls, ranks seen); None where it was off."""
    exited_at: dict[str, float | None] = field(default_factory=dict)
    """Per node, when its job ended by its own clock (its exit marker)."""
    groups: list[list[str]] = field(default_factory=list)
    """A fault-tolerant run's replica groups (their nodes); empty for one job over every node."""
    healer: Healer | None = None
    """A fault-tolerant run's group restarts on replaced nodes (`remote/heal.py`), to price once fetched."""

    @property
    def ok(self) -> bool:
        """Every node exited 0; in a fault-tolerant run, every node of at least one replica group."""
        if self.interrupted:
            return False
        if self.groups:
            return job_command.surviving_group(self.groups, self.exit_codes)
        return all(code == 0 for code in self.exit_codes.values())

    @property
    def dropped(self) -> list[str]:
        """The nodes of the replica groups that failed while others went on (fault-tolerant runs)."""
        return [] if self.interrupted else job_command.dropped_nodes(self.groups, self.exit_codes)

    def exited(self, node: str) -> str:
        """`node-1 exited 1 (rank 1 exited 3)`: the node's code, and its failed ranks' own."""
        return node_exited(node, self.exit_codes.get(node), self.ranks.get(node, RankOutcome()))

    @property
    def rank_exit_codes(self) -> dict[str, dict[str, int]]:
        """{node: {global rank: exit code}} of the ranks that failed, for the run's summary."""
        return {node: outcome.exit_codes for node, outcome in self.ranks.items() if outcome.exit_codes}

    @property
    def without_process_group(self) -> list[str]:
        """The nodes none of whose ranks formed a process group (where the monitors could tell)."""
        return [node for node, outcome in self.ranks.items() if outcome.process_group is False]


@dataclass(frozen=True)
class NodeSetup:
    """What bootstrap found on the nodes and launches need (`.cluster/<stack>/bootstrap.json`)."""

    master_port: int
    """MASTER_PORT of the rendezvous on node-0."""
    python: dict[str, str]
    """The interpreter with torch on each node."""
    scheduler: str = ""
    """`slurm` where Slurm holds the runs (bootstrap's scheduler stage), else '' (runs held by fab)."""
    homes: dict[str, str] = field(default_factory=dict)
    """Each node user's home (the probe's), for absolute paths on the nodes."""
    scheduler_why: str = ""
    """Why bootstrap's `--scheduler auto` left the runs to fab (one line), '' where it did not."""
    slurm_holds: bool = False
    """Slurm holds the runs (`holders.SlurmHolder`), else fab's connections do."""

    @classmethod
    def load(cls, stack: str) -> "NodeSetup":
        try:
            data = state.bootstrap_record(stack)
            homes = {name: facts["probe"]["home"] for name, facts in data.get("nodes", {}).items()}
            return cls(
                int(data["master_port"]),
                dict(data["python"]),
                str(data.get("scheduler") or ""),
                homes,
                str(data.get("scheduler_why") or ""),
                bool(data["slurm_holds"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError("the cluster is not bootstrapped: run fab bootstrap") from None


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


class JobStream(NodeStream):
    """A node's job output; the launch command's exit marker and node/torchrun.py's ranks line are
    kept (`exit`, `ranks`) and not shown."""

    @property
    def exit(self) -> tuple[int, float | None] | None:
        rest = self.markers.get(contract.EXIT_MARKER)
        return None if rest is None else job_command.parse_exit_marker(f"{contract.EXIT_MARKER} {rest}")

    @property
    def ranks(self) -> RankOutcome:
        return RankOutcome.parse(self.markers.get(contract.RANKS_MARKER))


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
    return protocol.launch_status_command(
        spec.workdir.key if spec.workdir else None, spec.requirements.digest if spec.requirements else None
    )


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


def stop_everywhere(
    cluster: ClusterInfo,
    nodes: list[str] | None = None,
    background: bool = False,
    run_id: str = "",
    leave_slurm: bool = False,
) -> dict[str, str]:
    """Run the stop command on the named nodes (default all) over fresh connections (`background`: in
    daemon threads, which never keep fab from exiting; `run_id`: that run's processes only; `leave_slurm`:
    none of a Slurm job's)."""
    targets = [n for n in cluster.nodes if nodes is None or n.name in nodes]
    sessions = [NodeSession(cluster, node) for node in targets]
    command = protocol.stop_command(run_id=run_id, leave_slurm=leave_slurm)
    outcomes = on_all_nodes(
        sessions, lambda s: s.retrying(lambda x: x.run(command), delays_s=(0.5,)), daemon=background
    )
    for session in sessions:
        session.close()
    return {
        r.name: (f"unreachable: {describe(r.error)}" if r.value is None else r.value.stdout.strip() or "idle")
        for r in outcomes
    }


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


def run_job(
    cluster: ClusterInfo,
    sessions: list[NodeSession],
    spec: JobSpec,
    setup: NodeSetup,
    run_id: str,
    log_dir: Path,
    echo: bool = True,
    on_hang=None,
    wanted: Manifest | None = None,
    on_participants=None,
    locked: bool = False,
) -> JobResult:
    """Start the job on every node, supervise it, and return how it ended; a fault-tolerant run's group whose
    node was lost starts again on its replacement (`remote/heal.py`; `wanted`: the workdir's manifest;
    `locked`: the launch holds the job lock, and the job starts only while it does)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    script = job_script(cluster, spec, run_id)
    streams = {
        s.node.name: JobStream(s.node.name, i, log_dir / f"{s.node.name}.log", echo) for i, s in enumerate(sessions)
    }
    started_at, started = _now(), time.monotonic()
    exit_codes: dict[str, int | None] = {s.node.name: None for s in sessions}
    returned: list[str] = []
    interrupted = False

    values = fab_held_values(spec, run_id)

    def start(session: NodeSession) -> int:
        workdir_key = spec.workdir.key if spec.workdir else None
        command = node_command(
            cluster, session.node, spec, setup, run_id, script, workdir_key, values=values, locked=locked
        )
        stream = streams[session.node.name]
        try:
            return session.stream(command, stream)
        except Exception as exc:  # a dropped connection ends this node's part; the others are stopped
            stream.write(f"fab: connection lost during the job: {describe(exc)}\n")
            return LOST

    def start_again(session: NodeSession) -> Future:
        """A replica group's node started again (remote/heal.py): a new stream into the same log."""
        name = session.node.name
        streams[name].close()
        streams[name] = JobStream(name, names.index(name), log_dir / f"{name}.log", echo)
        return pool.submit(start, session)

    def prepare_again(session: NodeSession) -> None:
        """What the launch gave every node before its job, for a replaced one (its home is empty)."""
        status = session.run(launch_status(spec)).stdout
        if values:
            send_env_values([session], values, spec.env)
        prepare(cluster, [session], [status], spec, setup, wanted)
        if spec.upload and not cluster.shared_dir:
            upload_script(cluster, [session], run_id, spec.upload)

    names = [s.node.name for s in sessions]
    groups = [[n.name for n in g] for g in job_command.replica_groups(cluster.nodes, spec.replicas)]
    metrics = f"{node_paths.remote_run_dir(cluster, run_id)}/{contract.METRICS_FILE}"
    healer = (
        Healer(cluster, groups, launch_status(spec), prepare_again, start_again, metrics, on_participants)
        if spec.replicas
        else None
    )
    pool = ThreadPoolExecutor(max_workers=len(sessions))
    futures: dict[Future, NodeSession] = {pool.submit(start, s): s for s in sessions}
    watch = HangWatch(
        cluster, setup.python, run_id, spec.hang, log_dir, lambda: stop_everywhere(cluster), on_hang
    ).start()
    previous_handlers = _interrupt_on_signals()
    try:
        with healer or contextlib.nullcontext():
            _supervise(
                cluster,
                futures,
                exit_codes,
                returned,
                quiet=watch.stopping,
                exited=lambda name: node_exited(name, exit_codes[name], streams[name].ranks),
                groups=groups if spec.replicas else None,
                healer=healer,
            )
    except KeyboardInterrupt:
        interrupted = True
        say("fab: interrupted: stopping the job on every node")
        stop_everywhere(cluster)
        _collect(futures, exit_codes, timeout_s=STOP_WAIT_S)
    finally:
        _restore(previous_handlers)
        watch.close()
        pool.shutdown(wait=False, cancel_futures=True)
        for stream in streams.values():
            stream.close()
    exited_at = {name: stream.exit[1] if stream.exit else None for name, stream in streams.items()}
    return JobResult(
        run_id,
        exit_codes,
        started_at,
        _now(),
        time.monotonic() - started,
        interrupted,
        {name: stream.tail for name, stream in streams.items()},
        watch.report,
        {name: stream.ranks for name, stream in streams.items() if contract.RANKS_MARKER in stream.markers},
        watch.stats(),
        exited_at,
        groups if spec.replicas else [],
        healer,
    )


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


def fab_held_values(spec: JobSpec, run_id: str) -> job_command.EnvValues | None:
    """A fab-held run's `--env` values: each node's run folder, removed by the job once read."""
    if not spec.env:
        return None
    return job_command.EnvValues(f"{node_paths.node_run_dir(run_id)}/{contract.RUN_ENV_VALUES}", once=True)


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


def _interrupt_on_signals() -> dict:
    """Ctrl-C and SIGTERM both stop the job everywhere, even where SIGINT arrived ignored (a
    background job of a script starts that way)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _supervise(
    cluster: ClusterInfo,
    futures: dict[Future, NodeSession],
    exit_codes: dict,
    returned: list,
    quiet=lambda: False,
    exited=lambda name: name,
    groups: list[list[str]] | None = None,
    healer: Healer | None = None,
) -> None:
    """Wait for every node (`returned` says in which order they did); at the first failure stop the
    others, and wherever a connection dropped, reconnect and stop that node's part too. `quiet()` is
    true once the hang watch is stopping the job: the failures that follow are its doing; `exited(name)`
    says how a node's job ended (`JobResult.exited`). With replica `groups` (a fault-tolerant run), a
    failure stops only its own group: the others go on without it (`_drop_group`), and the `healer`'s
    groups started again on replaced nodes are followed as the others are."""
    pending, stopping, stoppers = set(futures), False, []
    dropped: set[str] = set()
    while pending:
        done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
        for future in done:
            name = futures[future].node.name
            exit_codes[name] = future.result()
            returned.append(name)
            if healer is not None:
                healer.ended_on(name, future, exit_codes[name], lost=exit_codes[name] == LOST)
            if exit_codes[name] == LOST:
                stoppers.append((_stop_in_background(cluster, [name], _report_lost_node), [name]))
            if exit_codes[name] != 0 and groups is not None and name not in dropped:
                stoppers += _drop_group(cluster, groups, name, {futures[f].node.name for f in pending}, exited)
                dropped.update(next(g for g in groups if name in g))
            elif exit_codes[name] != 0 and not stopping:
                stopping = True
                others = [futures[f].node.name for f in pending]
                if others and not quiet():
                    say(f"fab: {exited(name)}: stopping the job on {', '.join(others)}")
                    stoppers.append((_stop_in_background(cluster, others), others))
        if healer is not None:
            if not pending:
                healer.stop()  # no group is started again once the run's last one ended; one just started is followed
            for future, session in healer.started():
                futures[future] = session
                pending.add(future)
                dropped.discard(session.node.name)
    deadline = time.monotonic() + STOP_WAIT_S
    for thread, nodes in stoppers:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            say(
                f"fab: could not stop the job on {', '.join(nodes)} within {STOP_WAIT_S} s; "
                "it may still run there: fab stop"
            )


def _drop_group(cluster: ClusterInfo, groups: list[list[str]], name: str, running: set[str], exited) -> list:
    """A fault-tolerant run's failed node: its replica group is dropped (torchft's next quorum goes on
    without it), the rest of that group stopped; the other groups keep training."""
    group = next(g for g in groups if name in g)
    number = groups.index(group)
    others = [n for g in groups if g is not group for n in g if n in running]
    rest = [n for n in group if n in running]
    going_on = f"replica group(s) on {', '.join(others)} go on" if others else "no replica group is left"
    say(f"fab: {exited(name)}: replica group {number} ({', '.join(group)}) dropped; {going_on}")
    return [(_stop_in_background(cluster, rest), rest)] if rest else []


def _stop_in_background(cluster: ClusterInfo, nodes: list[str], report=None) -> threading.Thread:
    def stop():
        outcomes = stop_everywhere(cluster, nodes, background=True)
        if report:
            report(outcomes)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    return thread


def _report_lost_node(outcomes: dict[str, str]) -> None:
    """A dropped connection leaves the node's job running (OpenSSH sends no signal to a command
    without a terminal): say whether reconnecting stopped it."""
    for name, outcome in outcomes.items():
        if outcome.startswith("unreachable"):
            say(
                f"fab: {name}'s connection dropped and it cannot be reached again to stop its part "
                f"({outcome}); it may still run there: fab stop once it answers"
            )
        else:
            say(f"fab: {name}'s connection dropped; reconnected and stopped its part ({outcome})")


def _collect(futures: dict[Future, NodeSession], exit_codes: dict, timeout_s: float) -> None:
    done, _ = wait(set(futures), timeout=timeout_s)
    for future in done:
        exit_codes[futures[future].node.name] = future.result()


@dataclass(frozen=True)
class Fetched:
    """What came back from the head node after a run."""

    names: list[str]
    """Fetched files, relative to the local run folder."""
    total_bytes: int
    """Their size."""
    refused: list[tuple[str, int, str]]
    """(name, size, where it is on the node) of the files over the cap, left there."""
    failed: tuple[str, str] | None = None
    """(name, why) of the file whose copy failed (a full disk); the ones after it were not tried."""


def fetch_results(
    cluster: ClusterInfo, session: NodeSession, python: str, run_id: str, local_dir: Path, max_bytes: int
) -> Fetched:
    """Copy the head node's `$CLUSTER_RESULTS_DIR` (whole) and the run's `metrics.jsonl`, and nothing
    else: checkpoints and whatever else the job left in its folders stay on the nodes."""
    listing = calls.ListResults(
        contract.home_relative(node_paths.remote_run_dir(cluster, run_id)),
        contract.home_relative(node_paths.results_dir(run_id)),
    )
    entries = nodecall.call(session, python, listing).files
    names: list[str] = []
    total, refused = 0, []
    for entry in entries:
        name, size = _local_name(entry["name"]), int(entry["size"])
        if size > max_bytes:
            refused.append((name, size, entry["remote"]))
            continue
        target = local_dir / name
        try:
            state.make_private_dir(target.parent)
            _get_whole(session, entry["remote"], target)
        except OSError as exc:
            return Fetched(names, total, refused, (name, exc.strerror or describe(exc)))
        names.append(name)
        total += size
    return Fetched(names, total, refused)


def _get_whole(session: NodeSession, remote: str, target: Path) -> None:
    """Copy one file under a temporary name, made private (0600, as everything in .cluster), then
    renamed: a copy cut short (a full disk) never stands under the result's name."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        session.conn.get(remote, str(partial), preserve_mode=False)
        os.chmod(partial, state.PRIVATE_FILE_MODE)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _local_name(name: str) -> str:
    """A name the node gave, refused unless it stays inside the local run folder."""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"the node named a result {name!r} outside the run folder")
    return name


def report_fetched(fetched: Fetched, local_dir: Path, head: str, max_bytes: int) -> None:
    if fetched.names:
        shown = ", ".join(fetched.names[:FETCHED_SHOWN]) + (
            f" and {len(fetched.names) - FETCHED_SHOWN} more" if len(fetched.names) > FETCHED_SHOWN else ""
        )
        say(
            f"fab: fetched {count_files(len(fetched.names))} ({human_bytes(fetched.total_bytes)}) "
            f"into {local_dir}: {shown}"
        )
    elif not fetched.refused and not fetched.failed:
        say(f"fab: nothing to fetch: {head}'s $CLUSTER_RESULTS_DIR is empty and the run wrote no metrics.jsonl")
    if fetched.failed:
        name, why = fetched.failed
        say(
            f"fab: could not fetch {name} from {head}: {why}; it and the results after it stay there "
            "(free space here, then copy them with scp -F, see python deploy.py ssh-config)"
        )
    for name, size, remote in fetched.refused:
        where = remote if remote.startswith("/") else f"~/{remote}"
        say(
            f"fab: not fetched: {name} ({human_bytes(size)}, over --max-result-mb {max_bytes // 1_000_000}); "
            f"it stays on {head} in {where}"
        )


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


def launch(
    cluster: ClusterInfo,
    spec: JobSpec,
    setup: NodeSetup,
    runs_root: Path,
    on_start=None,
    on_hang=None,
    timeline: Timeline | None = None,
    on_participants=None,
) -> tuple[JobResult, Path]:
    """The whole launch: checks, sync, upload, run, results. UsageError before anything starts if not ready.
    `timeline` gets each phase (infra/timeline.py) up to the end of the fetch."""
    timeline = timeline or Timeline(time.time(), clock=time.monotonic())
    wanted, sessions, statuses, run_id = open_launch(cluster, spec, timeline)
    try:
        local_dir = runs_root / run_id
        with owning(sessions, statuses, spec, run_id, timeline=timeline) as lock:
            prepare(cluster, sessions, statuses, spec, setup, wanted, timeline)
            if spec.upload:
                upload_script(cluster, sessions, run_id, spec.upload)
                timeline.mark("upload")
            if lock.lost:  # its head node would start no rank (node/torchrun.py): say so before a record exists
                raise protocol.stopped_before_start(run_id, sessions[0].node.name, "it started")
            values = fab_held_values(spec, run_id)
            if values:
                send_env_values(sessions, values, spec.env)
            say(f"fab: run {run_id}: {spec.task} on {len(sessions)} nodes; logs in {local_dir}")
            if on_start:
                on_start(run_id)
            result = run_job(
                cluster,
                sessions,
                spec,
                setup,
                run_id,
                local_dir,
                on_hang=(lambda report: on_hang(run_id, report)) if on_hang else None,
                wanted=wanted,
                on_participants=(lambda shown: on_participants(run_id, shown)) if on_participants else None,
                locked=True,
            )
            times = [outcome.times for outcome in result.ranks.values()]
            job_phases(timeline, times, list(result.exited_at.values()))
            if not result.ok:
                explain_failure(local_dir)
            head = sessions[0].node.name
            try:
                fetched = fetch_results(
                    cluster, sessions[0], setup.python[head], run_id, local_dir, spec.max_result_bytes
                )
                report_fetched(fetched, local_dir, head, spec.max_result_bytes)
            except Exception as exc:  # results are a convenience; the logs are already local
                say(f"fab: could not fetch results from {head}: {describe(exc)}")
            if result.healer is not None:
                result.healer.price(local_dir / contract.METRICS_FILE)
            timeline.mark("fetch")
        return result, local_dir
    finally:
        for session in sessions:
            session.close()


def explain_failure(local_dir: Path) -> None:
    """Say what the node logs show about a failed job beyond its exit codes (a collective mismatch)."""
    for log in sorted(local_dir.glob("node-*.log")):
        try:
            line = hang.mismatch_line(log.stem, log.read_text(errors="replace"))
        except OSError:
            continue
        if line:
            say(line)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
