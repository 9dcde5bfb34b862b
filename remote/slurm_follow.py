"""Following a run Slurm holds: its log on the head node (`node/slurm_run.py follow`) into its local copy
(infra/runlog.py) and onto the terminal, until it ends. A closed connection, a SIGHUP or a killed fab only
stops the following; Ctrl-C cancels (an explicit choice). `bring_logs`: the rest of the log of a run that
nobody follows."""

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra import runlog, state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from node import contract
from remote import job_command, node_paths
from remote.connect import CONNECTION_ERRORS, NodeSession, describe
from remote.runs import Run
from remote.slurm_jobs import cancel, refresh
from remote.stream import LogWriter, say, terminal

CANCEL_WAIT_S = 30


STATE_WAIT_S = 2.0
"""How often a launch whose log's copy failed asks Slurm whether its run has ended."""


HOLD_WAIT_S = 2.0
"""How long a follower waits for a command that is adding to the run's local copy (`fab jobs`)."""


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


def brought_log(cluster: ClusterInfo, run: Run, folder: Path) -> "LogSplitter":
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
