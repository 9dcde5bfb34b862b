"""Launch one torchrun job on every node at once, stream it, and stop all of it when any part fails.

Each node runs `torchrun` in its own SSH session (one thread per node). When a node's torchrun exits
non-zero, or its connection is lost, or the user presses Ctrl-C, the job is stopped on every other node
(`protocol.stop_command`), so nothing waits forever in a collective and nothing is left behind.
One job at a time: a launch holds the head node's job lock (`preparation.JobLock`) from before it creates anything
until its job has ended everywhere; a launch that finds it held waits its turn.
"""

import contextlib
import functools
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from infra.inventory import ClusterInfo
from infra.timeline import Timeline, job_phases
from node import contract
from remote import job_command, node_paths, protocol
from remote.connect import NodeSession, describe, on_all_nodes
from remote.hangwatch import HangReport, HangWatch
from remote.heal import Healer
from remote.job_spec import JobSpec, NodeSetup
from remote.preparation import (
    job_script,
    launch_status,
    node_command,
    open_launch,
    owning,
    prepare,
    send_env_values,
    upload_script,
)
from remote.results import explain_failure, fetch_results, report_fetched
from remote.stream import NodeStream, RankOutcome, node_exited, say
from remote.workdir import Manifest

STOP_WAIT_S = 15
LOST = 255  # exit code recorded for a node whose connection dropped mid-job


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

    names = [s.node.name for s in sessions]
    groups = [[n.name for n in g] for g in job_command.replica_groups(cluster.nodes, spec.replicas)]
    prepare_again = functools.partial(prepare_replaced, cluster, spec, setup, run_id, wanted)
    healer = _healer(cluster, spec, run_id, groups, prepare_again, start_again, on_participants)
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
    return _job_result(run_id, exit_codes, (started_at, started), interrupted, streams, watch, groups, healer)


def prepare_replaced(
    cluster: ClusterInfo,
    spec: JobSpec,
    setup: NodeSetup,
    run_id: str,
    wanted: Manifest | None,
    session: NodeSession,
) -> None:
    """What the launch gave every node before its job, for a replaced one (its home is empty)."""
    values = fab_held_values(spec, run_id)
    status = session.run(launch_status(spec)).stdout
    if values:
        send_env_values([session], values, spec.env)
    prepare(cluster, [session], [status], spec, setup, wanted)
    if spec.upload and not cluster.shared_dir:
        upload_script(cluster, [session], run_id, spec.upload)


def _healer(
    cluster: ClusterInfo,
    spec: JobSpec,
    run_id: str,
    groups: list[list[str]],
    prepare_again,
    start_again,
    on_participants,
) -> Healer | None:
    """A fault-tolerant run's group restarts on replaced nodes (`remote/heal.py`); None without --replicas."""
    if not spec.replicas:
        return None
    metrics = f"{node_paths.remote_run_dir(cluster, run_id)}/{contract.METRICS_FILE}"
    return Healer(cluster, groups, launch_status(spec), prepare_again, start_again, metrics, on_participants)


def _job_result(
    run_id: str,
    exit_codes: dict[str, int | None],
    started: tuple[str, float],
    interrupted: bool,
    streams: dict[str, JobStream],
    watch: HangWatch,
    groups: list[list[str]],
    healer: Healer | None,
) -> JobResult:
    """How the job ended, from its streams and its watch; `started`: (ISO time, monotonic clock)."""
    exited_at = {name: stream.exit[1] if stream.exit else None for name, stream in streams.items()}
    return JobResult(
        run_id,
        exit_codes,
        started[0],
        _now(),
        time.monotonic() - started[1],
        interrupted,
        {name: stream.tail for name, stream in streams.items()},
        watch.report,
        {name: stream.ranks for name, stream in streams.items() if contract.RANKS_MARKER in stream.markers},
        watch.stats(),
        exited_at,
        groups if healer is not None else [],
        healer,
    )


def fab_held_values(spec: JobSpec, run_id: str) -> job_command.EnvValues | None:
    """A fab-held run's `--env` values: each node's run folder, removed by the job once read."""
    if not spec.env:
        return None
    return job_command.EnvValues(f"{node_paths.node_run_dir(run_id)}/{contract.RUN_ENV_VALUES}", once=True)


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
            if pending:  # a group started again that no peer can heal any more is stopped
                stoppers += healer.stop_orphans(lambda nodes: _stop_in_background(cluster, nodes), dropped)
            else:
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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
