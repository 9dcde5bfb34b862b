"""Runs held by Slurm on the cluster (`fab bootstrap --scheduler slurm`): submit, follow, list, cancel, fetch.

A launch prepares the nodes as an attached one does (workdir, requirements, script, each node's copy of
the workdir made now, so a later sync cannot change a queued run), stages the project and the requirements
file once on the shared folder (a replaced node's job makes its own copy and environment from there), then
submits one batch job (node/slurm_run.py) whose step runs the same `launch_command` on every node. From then on the run
belongs to the cluster: fab follows its log on the head node (`slurm_run.py follow`), and a closed
connection, a SIGHUP or a killed fab only stops the following. Ctrl-C cancels (an explicit choice).

Each run has a record in its local run folder (`run.json`): the Slurm job, the log on the head node,
the state as last seen. Every command that talks to the cluster refreshes the records of runs not yet
ended, and the first to see a run end finishes it: results and metrics fetched, `summary.json`
written, the ledger row given Slurm's own start and end times, so a run that ended while nothing was
connected is priced.
"""

import contextlib
import io
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra import runlog, state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline, job_phases
from node import calls, contract
from node.outcome import STOPPED_CODES, ended_at
from node.run_state import RunState
from node.run_watch import OVERDUE_GRACE_S
from remote import job_command, node_paths, nodecall, protocol
from remote.connect import CONNECTION_ERRORS, NodeSession, describe, on_all_nodes, open_sessions
from remote.hangwatch import ask_command, keep_evidence, tell_ranks_command
from remote.launch import (
    JobSpec,
    NodeSetup,
    explain_failure,
    fetch_results,
    job_script,
    node_command,
    open_launch,
    owning,
    prepare,
    report_fetched,
    send_env_values,
    upload_script,
)
from remote.runs import FINAL, Run, RunBook, spec_facts, summary, write_summary
from remote.stopping import ControllerSilent, forget_launch
from remote.stream import LogWriter, RankOutcome, say, terminal

RECORD = runlog.RECORD
CANCEL_WAIT_S = 30
STATE_WAIT_S = 2.0
"""How often a launch whose log's copy failed asks Slurm whether its run has ended."""
HOLD_WAIT_S = 2.0
"""How long a follower waits for a command that is adding to the run's local copy (`fab jobs`)."""


# ------------------------------------------------------------------------------------------- submit


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
    watch: dict | None = None,
    replicas: int = 0,
) -> str:
    """sbatch the run (one task per node, each running its command; `watch`: the hang watch that runs
    beside it on the head node; `replicas`: torchft replica groups, so one node's end ends no other's);
    the Slurm job id."""
    run_dir = head_path(setup, cluster, node_paths.remote_run_dir(cluster, run_id))
    spec: dict = {
        "run_id": run_id,
        "log": f"{run_dir}/{contract.RUN_LOG}",
        "python": cluster.python,
        "nodes": [
            {"name": node.name, "home": setup.homes.get(node.name, ""), "command": commands[node.name]}
            for node in cluster.nodes
        ],
    }
    if watch:
        spec["watch"] = watch
    if replicas:
        spec["replicas"] = replicas
    try:  # the spec on stdin (its commands carry --env values): `submit` makes the run's folder and script
        return nodecall.call(head, cluster.python, calls.SubmitRun(spec)).job_id
    except OperationError as exc:
        raise OperationError(f"the run could not be submitted to Slurm: {exc}") from None


# ------------------------------------------------------------------------------------------- follow


class LogSplitter(runlog.LogCopy):
    """The run's log as it arrives: into its local copy (infra/runlog.py: `output.log`, each node's
    `node-<i>.log`, `cluster.log` for Slurm's, srun's and the batch script's lines) and onto the terminal,
    each writer (a node, a rank, the cluster) a terminal writer of its own, as an attached run's nodes
    are: a progress bar one rank redraws with `\\r` is ended before another's line starts. The launch's
    markers are kept apart (`exit_codes`), and the follower's end marker noted (`end`)."""

    def __init__(self, local_dir: Path, echo: bool = True, write: bool = True, show: runlog.Echo | None = None):
        super().__init__(local_dir, show or (self._show if echo else None), write)
        self.writers: dict[str, LogWriter] = {}

    def _show(self, prefix: str, piece: str) -> None:
        terminal.write(self.writers.setdefault(prefix, LogWriter()), piece.encode())

    @property
    def ranks(self) -> dict[str, str]:
        """Each node's ranks line (`contract.RANKS_MARKER`'s JSON: the failed ranks' own codes)."""
        marker = contract.RANKS_MARKER
        return {node: found[marker][len(marker) :].strip() for node, found in self.markers.items() if marker in found}

    @property
    def exited_at(self) -> dict[str, float | None]:
        """When each node's job ended by its own clock, from its exit marker."""
        found = {}
        for node, markers in self.markers.items():
            marker = job_command.parse_exit_marker(markers.get(contract.EXIT_MARKER, ""))
            if marker is not None:
                found[node] = marker[1]
        return found

    @property
    def exit_codes(self) -> dict[str, int]:
        """Each node's exit code, from its exit marker."""
        found = {}
        for node, markers in self.markers.items():
            marker = job_command.parse_exit_marker(markers.get(contract.EXIT_MARKER, ""))
            if marker is not None:
                found[node] = marker[0]
        return found

    def feed(self, data: bytes) -> None:
        """Bytes of the follower's output as they come (`NodeSession.stream`)."""
        self.add(data)


class FollowerNotes:
    """The follower's stderr: its `[cluster]` lines (what a waiting run waits for, a requeue) shown on the
    terminal and kept out of the log's copy; why it could not follow (`failed`), where it says."""

    def __init__(self, echo: bool = True):
        self.echo, self.partial, self.failed = echo, b"", ""

    def feed(self, data: bytes) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            if line.startswith(contract.FOLLOW_FAILED_MARKER):
                self.failed = line[len(contract.FOLLOW_FAILED_MARKER) :].strip()
            elif line.startswith("error: "):
                self.failed = line[len("error: ") :].strip()
            elif line.strip() and self.echo:
                say(line)


@dataclass
class Followed:
    """How following a run ended."""

    end: tuple[str, int | None] | None
    """(Slurm's state, the job's exit code) when the run ended while followed; None otherwise."""
    exit_codes: dict[str, int]
    ranks: dict[str, str] = field(default_factory=dict)
    """Each node's ranks line (the failed ranks' own codes), as `LogSplitter.ranks`."""
    detached: str = ""
    """Why following stopped before the end (a dropped connection, SIGHUP); '' when it did not."""
    interrupted: bool = False
    """Ctrl-C: the run was cancelled (or, `detached` too, only the following stopped)."""
    exited_at: dict = field(default_factory=dict)
    """When each node's job ended by its own clock (its exit marker), for the timeline."""
    head: NodeSession | None = None
    """The head node's connection the follow used, still open: `finish` asks over it, then closes it."""
    cancelled_by: str = ""
    """What cancelled the run from outside while it was followed (the cluster's down); '' where nothing did."""


def follow(
    cluster: ClusterInfo,
    run: Run,
    local_dir: Path,
    stop_hang=None,
    echo: bool = True,
    cancel_on_interrupt=True,
    show: runlog.Echo | None = None,
    head: NodeSession | None = None,
) -> Followed:
    """Show the run's log from its start until it ends. Ctrl-C (or SIGTERM) cancels the run and follows
    it to its end, or with `cancel_on_interrupt` False (`fab logs -f`) only stops the following, as
    SIGHUP or a lost connection do. `show`: where each piece goes instead of the terminal (the dashboard).
    `head`: the head node's connection to follow over (the launch's), else a new one; a run seen to its end
    hands it on, open, in `Followed.head`, for `finish`."""
    local_dir.mkdir(parents=True, exist_ok=True)
    splitter = LogSplitter(local_dir, echo, show=show)
    if not splitter.hold(wait_s=HOLD_WAIT_S):  # another fab follows it and keeps its copy: only shown here
        splitter = LogSplitter(local_dir, echo, write=False, show=show)
    head = head or NodeSession(cluster, cluster.head)
    outcome: dict = {}
    notes = FollowerNotes(echo and show is None)

    def reader() -> None:
        command = node_paths.node_module(
            cluster, cluster.python, "slurm_run", "follow", run.log, run.job_id, str(splitter.offset)
        )
        try:
            head.stream(f"cd && {command}", splitter, notes)
        except CONNECTION_ERRORS as exc:
            outcome["lost"] = describe(exc)
        except Exception as exc:  # not the connection (the local copy could not be written): the run goes on
            outcome["lost"], outcome["here"] = describe(exc), True

    hangup = threading.Event()
    handlers = _signals(hangup)
    thread = threading.Thread(target=reader, name=f"follow-{run.run_id}", daemon=True)
    interrupted = False
    try:
        splitter.resume()  # what is here already, shown again; the rest comes from where it ends
        thread.start()
        while thread.is_alive() and not hangup.is_set():
            thread.join(timeout=0.2)
    except KeyboardInterrupt:
        interrupted = True
        if cancel_on_interrupt:
            say(f"fab: interrupted: cancelling run {run.run_id}")
            try:
                cancel(cluster, run)
            except (UsageError, OperationError) as exc:
                say(f"fab: {exc}")
            if thread.ident is None:  # interrupted while what was here was shown: follow it to its end
                thread.start()
            thread.join(timeout=CANCEL_WAIT_S)
    finally:
        _restore(handlers)
        if splitter.end is None or interrupted or "lost" in outcome:
            head.close()
        if thread.ident is not None:  # what it read before the connection closed goes into the copy first
            thread.join(timeout=2.0)
        splitter.close(ended=splitter.end is not None)
    codes, ranks = splitter.exit_codes, splitter.ranks
    if interrupted and not cancel_on_interrupt:
        return Followed(None, codes, ranks, detached="Ctrl-C", interrupted=True)
    if hangup.is_set() and not splitter.end:
        return Followed(None, codes, ranks, detached="the terminal hung up (SIGHUP)")
    if splitter.end is None and not interrupted:
        if notes.failed:
            raise OperationError(f"cannot follow run {run.run_id}: {notes.failed}")
        if state.taken_down(cluster.stack, f"fab following run {run.run_id}"):  # the run went with it
            return Followed(None, codes, ranks, cancelled_by="the cluster's down (python deploy.py down)")
        end = ended_in_slurm(cluster, run, wait=bool(outcome.get("here")))
        if end is not None:  # the run's end is Slurm's, whatever became of its log or of this copy
            return Followed(end, codes, ranks)
        return Followed(None, codes, ranks, detached=outcome.get("lost", "the connection ended"))
    kept = head if splitter.end is not None and not interrupted and "lost" not in outcome else None
    return Followed(splitter.end, codes, ranks, interrupted=interrupted, exited_at=splitter.exited_at, head=kept)


def ended_in_slurm(cluster: ClusterInfo, run: Run, wait: bool = False) -> tuple[str, int | None] | None:
    """The run's end as Slurm knows it (its state, its exit code), where following stopped without one;
    `wait`: the connection is fine (only the local copy failed), so wait for the end. None where the run
    goes on, or the head node does not answer."""
    try:
        while True:
            refresh(cluster, [run])
            if run.ended:
                return run.state, run.exit_code
            if not wait:
                return None
            time.sleep(STATE_WAIT_S)
    except (OperationError, KeyboardInterrupt):
        return None


def _signals(hangup: threading.Event) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    handlers[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: hangup.set())
    return handlers


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


# ------------------------------------------------------------------------------------ states, cancel


def refresh(cluster: ClusterInfo, runs: list[Run], head: NodeSession | None = None, ended_too: bool = False) -> dict:
    """Ask Slurm (on the head node; `head`: over that open session) for the runs not yet ended (`ended_too`:
    and those seen ended); their records are updated in place. What the head node said of each ({job id:
    its state})."""
    pending = [r for r in runs if ended_too or not r.ended]
    if not pending:
        return {}
    session = head or NodeSession(cluster, cluster.head)
    try:  # with each run's log: its end record lies beside it
        found = nodecall.call(session, cluster.python, calls.RunStates({r.job_id: r.log for r in pending})).states
    except CONNECTION_ERRORS as exc:
        raise OperationError(f"{cluster.head.name} does not answer: {describe(exc)}") from None
    finally:
        if head is None:
            session.close()
    for run in pending:
        known = found.get(run.job_id)
        if known is None:
            continue
        run.state = RunState.from_slurm(known["state"]) if known.get("state") else run.state
        run.started_at = run.started_at or known.get("started_at")  # the first start: a requeue costs the wait too
        run.ended_at = known.get("ended_at") if run.state in FINAL else None
        run.exit_code = known.get("exit_code") if run.state in FINAL else None
        run.requeues = int(known.get("requeues") or 0)
        run.waiting_for = known.get("waiting_for")
        replicas = int(run.spec.get("replicas") or 0)
        shown = known.get("participants")
        run.participants = f"{shown}/{replicas}" if replicas and shown is not None else None
        run.stragglers = known.get("stragglers") or run.stragglers  # the cluster's hang watch's verdict
    return found


def cancel(cluster: ClusterInfo, run: Run) -> dict | None:
    """scancel the run's job, and remove its `--env` values from the cluster (no start of it reads them
    now); what Slurm knew of it before (None: nothing)."""
    head = NodeSession(cluster, cluster.head)
    try:
        reply = nodecall.call(head, cluster.python, calls.CancelRun(run.job_id))
    except CONNECTION_ERRORS as exc:
        raise OperationError(f"{cluster.head.name} does not answer: {describe(exc)}") from None
    except OperationError as exc:
        raise OperationError(f"could not cancel run {run.run_id}: {exc}") from None
    else:
        if reply.unanswered:
            raise ControllerSilent(reply.unanswered)
        before = reply.before
        try:
            forget_env_values(cluster, run.run_id, run.spec.get("env_values"), head)
        except (OperationError, *CONNECTION_ERRORS) as exc:
            raise OperationError(
                f"run {run.run_id} was cancelled, but its --env values are still on the cluster ({describe(exc)}): "
                "fab jobs removes them once it sees the run ended"
            ) from None
        return before
    finally:
        head.close()


# ------------------------------------------------------------------------------------- a launch


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
                folder = node_paths.shell_path(node_paths.node_run_dir(run_id))
                copy = f"mkdir -p {folder} && {job_command.workdir_step(run_id, spec.workdir.key)}"
                copied = on_all_nodes(sessions, lambda s: s.run(copy, warn=False))
                if copied.failed:
                    why = "; ".join(f"{r.name}: {describe(r.error)}" for r in copied.failed)
                    raise OperationError(f"could not copy the workdir for run {run_id}: {why}")
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
        watch = None
        if spec.hang.enabled:  # on the cluster: it holds while no fab follows the run
            watch = {
                "timeout_s": spec.hang.timeout_s,
                "poll_s": spec.hang.poll_s,
                "on_hang": spec.hang.on_hang,
                "on_straggler": spec.hang.on_straggler,
                "shared_dir": cluster.shared_dir,  # where a straggler's power-off marker goes (replace)
                "tell_ranks": {
                    n.name: tell_ranks_command(cluster, setup.python[n.name], n.name) for n in cluster.nodes
                },
                "overdue_grace_s": OVERDUE_GRACE_S,
                **{
                    action: {n.name: ask_command(cluster, setup.python[n.name], run_id, action) for n in cluster.nodes}
                    for action in ("status", "collect")
                },
            }
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


def slurm_held_values(cluster: ClusterInfo, spec: JobSpec, run_id: str) -> job_command.EnvValues | None:
    """A Slurm-held run's `--env` values: read at every start (a requeue starts the command again), from
    the run's stage where the cluster has a shared folder, else each node's run folder; `finish` removes
    them."""
    if not spec.env:
        return None
    folder = node_paths.run_stage(cluster, run_id) or node_paths.node_run_dir(run_id)
    return job_command.EnvValues(f"{folder}/{contract.RUN_ENV_VALUES}", once=False)


def forget_env_values(cluster: ClusterInfo, run_id: str, path: str | None, head: NodeSession) -> None:
    """Remove an ended run's `--env` values (at `path`) from the cluster: the shared folder, or every node."""
    if not path:
        return
    command = f"rm -f {node_paths.shell_path(path)}"
    try:
        if cluster.shared_dir:
            head.run(command)
            return
        sessions, _ = open_sessions(cluster)
        try:
            removed = on_all_nodes(sessions, lambda s: s.run(command))
        finally:
            for session in sessions:
                session.close()
        if removed.failed:
            raise OperationError("; ".join(f"{r.name}: {describe(r.error)}" for r in removed.failed))
    except Exception as exc:
        say(f"fab: could not remove run {run_id}'s --env values ({path}): {describe(exc)}; remove them by hand")


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


def finish(cluster: ClusterInfo, setup: NodeSetup, folder: Path, run: Run, followed: Followed | None = None) -> None:
    """A run seen ended: its state and times from Slurm, each node's and each failed rank's exit code,
    results fetched, summary.json written, the ledger's row given Slurm's times. Done once per run."""

    if run.finished:
        if followed is not None and followed.head is not None:
            followed.head.close()
        return
    # one connection for its state, hang record and results: the follow's, where it kept one open
    head = followed.head if followed is not None and followed.head is not None else NodeSession(cluster, cluster.head)
    try:
        started = _finish_over(cluster, setup, folder, run, followed, head)
    finally:
        head.close()
    run.started_at = (run.started_at or run.submitted_at) if started else None
    run.ended_at = run.ended_at or time.time()
    RunBook(cluster).ended(run)
    if run.timeline is not None and run.timeline.wall_s is None:
        run.timeline.close("record")
    write_summary(folder, summary(cluster, run))
    run.finished = True
    run.save(folder)


def _finish_over(
    cluster: ClusterInfo, setup: NodeSetup, folder: Path, run: Run, followed: Followed | None, head
) -> bool:
    """`finish`'s questions to the head node, over one session; whether the run ever started."""
    known = refresh(cluster, [run], head, ended_too=True).get(run.job_id) or {}
    forget_env_values(cluster, run.run_id, run.spec.get("env_values"), head)
    if run.state != RunState.COMPLETED and not known.get("ever_started", True):  # where the head cannot tell, it did
        # Cancelled while it waited: Slurm gives such a job a start (the cancel's time) and exit 0, but
        # nothing ran, so it has no start, no exit code, no node's code and no results.
        run.started_at, run.exit_code, run.exit_codes, run.rank_exit_codes = None, None, {}, {}
        if run.timeline is not None:
            run.timeline.mark("queue wait")  # to its end: it did nothing else
        return False
    exit_codes, ranks = dict(run.exit_codes), {}
    if followed is not None and followed.exit_codes:
        exit_codes, ranks = dict(followed.exit_codes), dict(followed.ranks)
    if followed is None and run.log:  # ended unfollowed: its log (and each node's code) from the head
        brought = _bring_log(cluster, run, folder)
        exit_codes = dict(brought.exit_codes) or exit_codes
        ranks = dict(brought.ranks)  # a node stopped whole left no exit marker, but its torchrun said when it ended
    exited_at = dict(followed.exited_at) if followed is not None else {}
    if followed is None and run.log:
        exited_at = dict(brought.exited_at)
    for node in run.nodes:  # a node that left no marker was ended from outside
        exit_codes.setdefault(node, 0 if run.state == RunState.COMPLETED else 128 + 15)
    if run.hang is None:
        run.hang = _cluster_hang(run, folder, head)
    if run.requeues or run.spec.get("replicas"):
        _price_idle(cluster, run, head)
    outcome = run.state
    if run.hang and run.state in (RunState.CANCELLED, RunState.FAILED):
        outcome = RunState.HUNG
    stopped = [code for code in exit_codes.values() if code != 0]
    if outcome == known.get("state") == RunState.FAILED and stopped and all(c in STOPPED_CODES for c in stopped):
        outcome = RunState.CANCELLED  # every node stopped from outside (`fab stop` without Slurm's controller)
    groups = job_command.group_names(run.nodes, int(run.spec.get("replicas") or 0))
    if (
        run.spec.get("replicas")
        and outcome in (RunState.FAILED, RunState.COMPLETED)
        and job_command.surviving_group(groups, exit_codes)
    ):
        # a replica group was dropped, another trained to the end; or a group started again on a replaced node
        # did (its node's code is the new start's): Slurm's code is the run's first step's, which lost a node
        outcome, run.exit_code = RunState.COMPLETED, None
        dropped = job_command.dropped_nodes(groups, exit_codes)
        run.extra = {**run.extra, "dropped": dropped} if dropped else run.extra
    said = {n: RankOutcome.parse(text) for n, text in ranks.items()}
    run.end(outcome, exit_codes, said, exited_at)
    own = ended_at(run.nodes, {n: ranked.times.get("ended") for n, ranked in said.items()}, exited_at)
    if own is not None and run.ended_at is not None and (run.started_at or 0) <= own < run.ended_at:
        run.ended_at = own  # priced to the nodes' own end, not to when a restarted controller learned of it
    if run.timeline is not None:
        times = [ranked.times for ranked in said.values()]
        job_phases(run.timeline, times, list(exited_at.values()), queued_until=run.started_at)
    if run.state != RunState.COMPLETED:
        explain_failure(folder)
    max_bytes = int(run.spec.get("max_result_bytes") or 50_000_000)
    try:
        fetched = fetch_results(cluster, head, setup.python[cluster.head.name], run.run_id, folder, max_bytes)
        report_fetched(fetched, folder, cluster.head.name, max_bytes)
    except Exception as exc:  # results are a convenience; the logs are local already
        say(f"fab: could not fetch results from {cluster.head.name}: {describe(exc)}")
    if run.timeline is not None:
        run.timeline.mark("fetch")
    return True


def _price_idle(cluster: ClusterInfo, run: Run, head: NodeSession) -> None:
    """Each restart of a requeued run (`contract.RESTARTS_RECORD` beside its log), and each replica group of a
    fault-tolerant run started again on a replaced node (`contract.HEALS_RECORD`), into the ledger: the
    interruption that held it lasts until the run (the group) started again, not only until the node was
    replaced."""
    from infra.ledger import Ledger

    ledger = Ledger()
    try:
        for record in (contract.RESTARTS_RECORD, contract.HEALS_RECORD):
            found = io.BytesIO()
            try:
                head.conn.get(f"{run.log.rsplit('/', 1)[0]}/{record}", local=found)
            except Exception:  # none (never started again), or the head does not answer
                continue
            for line in found.getvalue().decode(errors="replace").splitlines():
                try:
                    restart = json.loads(line)
                    at, stopped_at = float(restart["at"]), restart.get("stopped_at")
                except (ValueError, KeyError, TypeError):
                    continue
                for node in restart.get("nodes") or run.nodes:
                    ledger.run_idle(cluster.stack, node, float(stopped_at) if stopped_at else None, at)
    finally:
        ledger.close()


def _cluster_hang(run: Run, folder: Path, head: NodeSession) -> dict | None:
    """The cluster-side hang watch's verdict (`hang.json` beside the run's log), where it found one; the
    evidence it collected goes into the run's local `hang/` folder."""
    found = io.BytesIO()
    try:
        head.conn.get(f"{run.log.rsplit('/', 1)[0]}/{contract.HANG_RECORD}", local=found)
        record = json.loads(found.getvalue())
    except Exception:  # none: the run did not hang (or the head does not answer; the logs say the rest)
        return None
    if not isinstance(record, dict) or "verdict" not in record:
        return None
    collected = record.pop("collected", None) or []
    if collected:  # the recorder dumps and stacks the cluster's watch collected, kept as fab's own watch keeps them
        record["evidence"] = str(keep_evidence(folder / "hang", collected, record["verdict"]))
    return record


def bring_logs(cluster: ClusterInfo, runs: list[tuple[Path, Run]]) -> None:
    """The rest of each unfinished run's log from the head node into its local copy (infra/runlog.py), so
    that a run nobody follows has its log here as it goes; a copy another fab holds is skipped (it
    follows the run: the log is here)."""
    pending = [(folder, run) for folder, run in runs if not run.finished]
    if not pending:
        return
    head = NodeSession(cluster, cluster.head)
    try:
        for folder, run in pending:
            copy = LogSplitter(folder, echo=False)
            if not copy.hold():
                continue
            try:
                copy.resume()
                received = _Bytes()
                head.stream(f"cd && {runlog.tail_command(run.log, copy.offset)}", received)
                copy.add(bytes(received.data).partition(b"\n")[2])  # the first line: the end record
            except CONNECTION_ERRORS as exc:
                say(f"fab: could not bring run {run.run_id}'s log from {cluster.head.name}: {describe(exc)}")
            finally:
                copy.close(ended=run.ended)
    finally:
        head.close()


def _bring_log(cluster: ClusterInfo, run: Run, folder: Path) -> "LogSplitter":
    """The rest of the run's log from the head node into its local copy; each node's exit code and ranks
    line are on the copy returned."""
    bring_logs(cluster, [(folder, run)])
    copy = LogSplitter(folder, echo=False, write=False)
    copy.resume()
    copy.close(ended=True)
    return copy


class _Bytes:
    """A command's output, kept whole."""

    def __init__(self):
        self.data = bytearray()

    def feed(self, data: bytes) -> None:
        self.data += data
