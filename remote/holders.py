"""Who holds a run: fab's own SSH connections (`FabHolder`), or Slurm on the cluster (`SlurmHolder`).

One protocol, two implementations, chosen once from what bootstrap recorded (`holder_for`). Both write
the one run record (`runs.Run`, `run.json` in the run's folder), the one summary (`runs.summary`), the
ledger through one writer (`runs.RunBook`), and end with the one rule from outcome to exit code
(`runs.outcome`). What a holder can do (detach, queue on the cluster) is a fact on it, never a test of
its name.
"""

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from infra import runlog, state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from node.outcome import STOPPED_CODES
from node.run_state import RunState
from remote import protocol, runs, scheduled, slurm_finish, slurm_follow, slurm_jobs, stopping
from remote.connect import NodeSession, describe, open_sessions
from remote.job_spec import DEFAULT_MAX_RESULT_MB, JobSpec, NodeSetup
from remote.launch import JobResult, launch, stop_everywhere
from remote.results import fetch_results, report_fetched
from remote.stream import say


@dataclass
class Ending:
    """How a launch returned."""

    folder: Path
    run: runs.Run
    submitted: bool = False
    """`--detach`: submitted, not followed."""
    detached: str = ""
    """Why fab stopped following a run that goes on (a dropped connection, SIGHUP, Ctrl-C of logs -f)."""
    interrupted: bool = False
    """Ctrl-C (or SIGTERM) of an attached launch: the run was cancelled."""
    cancelled_by: str = ""
    """What else cancelled the run while it was followed (the cluster's down); '' where nothing did."""


class RunHolder(Protocol):
    detaches: bool
    """A run outlives the fab that launched it (`--detach`, `fab logs -f`, a closed lid)."""
    queues: bool
    """Runs wait in a queue on the cluster (else a launch waits its turn in its own fab)."""
    why_not: str
    """Why the runs are not held on the cluster ('' where they are): said once per launch."""
    replaces_stragglers: bool
    """`--on-straggler replace` can be done: a straggler's node drained and replaced, the run requeued."""

    def launch(self, spec: JobSpec, detach: bool, timeline: Timeline | None = None) -> Ending:
        """Run `spec` (`detach`: submit only); `timeline` gets the launch's phases (one is started here
        where none is given), kept in the run's record and its summary."""

    def refresh(self, found: list[tuple[Path, runs.Run]]) -> None:
        """Bring the records of runs not yet ended up to date (in place)."""

    def cancel(self, run: runs.Run) -> str | None:
        """Stop one run, queued or running; the state it had, or None where it was not running."""

    def follow(self, folder: Path, run: runs.Run, show: runlog.Echo | None = None) -> Ending:
        """Show a run's output from its start until it ends (Ctrl-C stops the following only); `show`
        gets each piece (its writer's prefix, the piece) instead of the terminal (the dashboard)."""

    def results(self, folder: Path, run: runs.Run) -> None:
        """Fetch an ended run's results and metrics into its folder again (`fab results`)."""

    def bring_logs(self, found: list[tuple[Path, runs.Run]]) -> None:
        """The rest of each unfinished run's log into its local copy, where it is not written here as it goes."""


class FabHolder:
    """The run lives in the launching fab's SSH connections: one at a time (a second launch waits its
    turn on the head node's job lock), it ends if that fab is killed, and it cannot detach."""

    detaches = False
    queues = False
    replaces_stragglers = False  # nothing requeues a fab-held run onto a replaced node

    def __init__(self, cluster: ClusterInfo, setup: NodeSetup):
        self.cluster, self.setup = cluster, setup
        self.why_not = setup.scheduler_why or "bootstrapped with --scheduler none"

    def launch(self, spec: JobSpec, detach: bool, timeline: Timeline | None = None) -> Ending:
        if detach:
            raise UsageError(
                f"--detach needs runs held by Slurm on the cluster, which it does not run ({self.why_not}); "
                "fab bootstrap sets Slurm up once that is mended"
            )
        if self.setup.scheduler_why:
            say(f"fab: this run lives in fab's connections, not in Slurm on the cluster: {self.setup.scheduler_why}")
        runs_root = state.runs_dir(self.cluster.stack)
        timeline = timeline or Timeline(time.time(), clock=time.monotonic())
        book = runs.RunBook(self.cluster)
        records: dict[str, runs.Run] = {}

        def started(run_id: str) -> None:
            book.started(run_id, spec.task)
            now = time.time()
            run = runs.Run(
                run_id,
                spec.task,
                "",
                "",
                [n.name for n in self.cluster.nodes],
                now,
                state=RunState.RUNNING,
                started_at=now,
                holder="fab",
                owner=f"{socket.gethostname()}:{os.getpid()}",
                spec=runs.spec_facts(spec),
                timeline=timeline,
            )
            run.save(state.make_private_dir(runs_root / run_id))
            records[run_id] = run

        def participants(run_id: str, shown: str) -> None:  # a fault-tolerant run's groups in the quorum
            run = records.get(run_id)
            if run is not None and not run.ended:
                run.participants = shown
                run.save(runs_root / run_id)

        try:
            result, folder = launch(
                self.cluster,
                spec,
                self.setup,
                runs_root,
                on_start=started,
                on_hang=book.hung,
                timeline=timeline,
                on_participants=participants,
            )
        except BaseException:
            book.close()  # a record written stays RUNNING until this fab is gone, then reads FAILED
            raise
        run = records[result.run_id]
        ended(run, spec, result)
        book.ended(run)
        timeline.close("record")
        runs.write_summary(folder, runs.summary(self.cluster, run))
        run.finished = True
        run.save(folder)
        return Ending(folder, run, interrupted=result.interrupted)

    def refresh(self, found: list[tuple[Path, runs.Run]]) -> None:
        """A run whose fab is gone from this machine is held no more: it ended when its fab did."""
        here = socket.gethostname()
        for folder, run in found:
            host, _, pid = run.owner.partition(":")  # a run recorded while Slurm held the runs has none
            if run.ended or host != here or not pid.isdigit() or _alive(int(pid)):
                continue
            run.state, run.ended_at = RunState.FAILED, run.ended_at or time.time()
            run.extra = {**run.extra, "ended": f"its fab (pid {pid}) ended before the run did"}
            run.save(folder)

    def cancel(self, run: runs.Run) -> str | None:
        sessions, statuses = open_sessions(self.cluster, protocol.job_status_command())
        for session in sessions:
            session.close()
        running = {(protocol.parse_job_status(s)[0] or {}).get("run_id") for s in statuses}
        if run.run_id not in running:
            return None
        for node, outcome in stop_everywhere(self.cluster, run_id=run.run_id).items():
            say(f"{node}: {outcome}")
        return RunState.RUNNING

    def follow(self, folder: Path, run: runs.Run, show: runlog.Echo | None = None) -> Ending:
        """The launching fab writes each node's log here as it streams: show them as they grow until its
        record says the run ended."""
        shown: dict[Path, int] = {}
        try:
            while True:
                record = runs.Run.load(folder) or run
                self.refresh([(folder, record)])
                for path in sorted(folder.glob("node-*.log")):
                    with path.open("rb") as f:
                        f.seek(shown.get(path, 0))
                        text = f.read()
                    shown[path] = shown.get(path, 0) + len(text)
                    if text and show:
                        show(path.stem, text.decode(errors="replace"))
                    elif text:
                        os.write(1, text)
                if record.ended:
                    return Ending(folder, record)
                time.sleep(0.2)
        except KeyboardInterrupt:
            return Ending(folder, run, detached="Ctrl-C", interrupted=True)

    def results(self, folder: Path, run: runs.Run) -> None:
        fetch_results_again(self.cluster, self.setup, folder, run)

    def bring_logs(self, found: list[tuple[Path, runs.Run]]) -> None:
        """Nothing to bring: the launching fab writes each node's log here as it streams."""


def fetch_results_again(cluster: ClusterInfo, setup: NodeSetup, folder: Path, run: runs.Run) -> None:
    """An ended run's results and metrics from the head node into its folder, as its launch fetched them (the
    same for both holders: the run's folders on the nodes are the same)."""
    head = NodeSession(cluster, cluster.head)
    max_bytes = int(run.spec.get("max_result_bytes") or DEFAULT_MAX_RESULT_MB * 1_000_000)
    try:
        fetched = fetch_results(cluster, head, setup.python[cluster.head.name], run.run_id, folder, max_bytes)
    except Exception as exc:
        why = describe(exc)
        raise OperationError(f"could not fetch run {run.run_id}'s results from {cluster.head.name}: {why}") from None
    finally:
        head.close()
    report_fetched(fetched, folder, cluster.head.name, max_bytes)


def ended(run: runs.Run, spec: JobSpec, result: JobResult) -> None:
    """An attached launch's result into its run record."""
    run.ended_at = time.time()
    run.started_at = run.ended_at - result.duration_s
    run.without_process_group = result.without_process_group
    failed = [c for c in result.exit_codes.values() if c not in (0, None)]
    if result.hang and spec.hang.on_hang == "stop" and not result.interrupted:
        outcome = RunState.HUNG  # the watch stopped it: every node ended on its signal
    elif result.interrupted or (failed and all(c in STOPPED_CODES for c in failed)):
        outcome = RunState.CANCELLED
    else:
        outcome = RunState.COMPLETED if result.ok else RunState.FAILED
    run.end(outcome, result.exit_codes, result.ranks, result.exited_at)
    if result.hang:
        run.hang = {
            "verdict": result.hang.verdict,
            "stalled_at": result.hang.stalled_since,
            "detected_at": result.hang.detected_at,
            "evidence": str(result.hang.evidence_dir),
        }
    if result.watch:
        run.extra = {**run.extra, "hang_watch": result.watch}
    if result.dropped:
        run.extra = {**run.extra, "dropped": result.dropped}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlurmHolder:
    """Slurm on the cluster holds the run: submitted as one batch job, queued in submission order,
    followed from its log; a closed connection or a killed fab only stops the following."""

    detaches = True
    queues = True
    why_not = ""
    replaces_stragglers = True

    def __init__(self, cluster: ClusterInfo, setup: NodeSetup):
        self.cluster, self.setup = cluster, setup

    def launch(self, spec: JobSpec, detach: bool, timeline: Timeline | None = None) -> Ending:
        runs_root = state.runs_dir(self.cluster.stack)
        folder, run, followed = scheduled.launch(self.cluster, spec, self.setup, runs_root, detach, timeline)
        if followed is None:
            return Ending(folder, run, submitted=True)
        return self._after(folder, run, followed)

    def refresh(self, found: list[tuple[Path, runs.Run]]) -> None:
        jobs = [(f, r) for f, r in found if r.job_id]  # a run held by fab before Slurm was set up has none
        slurm_jobs.refresh(self.cluster, [r for _, r in jobs])
        self.bring_logs(jobs)  # a run nobody follows has its log here as it goes
        for folder, run in jobs:
            run.save(folder)
            if run.ended and not run.finished:
                slurm_finish.finish(self.cluster, self.setup, folder, run)

    def cancel(self, run: runs.Run) -> str | None:
        before = slurm_jobs.cancel(self.cluster, run)
        return (before or {}).get("state") or run.state

    def follow(self, folder: Path, run: runs.Run, show: runlog.Echo | None = None) -> Ending:
        followed = slurm_follow.follow(self.cluster, run, folder, cancel_on_interrupt=False, show=show)
        return self._after(folder, run, followed)

    def results(self, folder: Path, run: runs.Run) -> None:
        fetch_results_again(self.cluster, self.setup, folder, run)

    def bring_logs(self, found: list[tuple[Path, runs.Run]]) -> None:
        slurm_follow.bring_logs(self.cluster, [(f, r) for f, r in found if r.job_id])

    def _after(self, folder: Path, run: runs.Run, followed: slurm_follow.Followed) -> Ending:
        if followed.cancelled_by:  # the cluster is gone: nothing to finish there (down recorded the run)
            return Ending(folder, run, cancelled_by=followed.cancelled_by)
        if followed.detached:
            return Ending(folder, run, detached=followed.detached, interrupted=followed.interrupted)
        slurm_finish.finish(self.cluster, self.setup, folder, run, followed)
        return Ending(folder, run, interrupted=followed.interrupted)


def cancel_run(cluster: ClusterInfo, holder: RunHolder, run_id: str) -> str:
    """`fab stop --run ID` (and the dashboard's cancel): cancel one run, queued or running; the line that
    says what became of it. UsageError where there is no such run, or it is not on the cluster."""
    folder, record = runs.find(state.runs_dir(cluster.stack), run_id)
    try:
        holder.refresh([(folder, record)])
    except OperationError:  # Slurm's controller may be down: the cancel below says what it can do
        pass
    if record.ended:
        record.save(folder)
        return f"fab: run {record.run_id} had already ended ({record.state}); nothing to cancel"
    try:
        before = holder.cancel(record)
    except stopping.ControllerSilent as silent:  # stopped where it runs, so that bootstrap can mend Slurm
        return stopping.stop_on_the_nodes(cluster, record.run_id, silent.why)
    if before is None:
        raise UsageError(f"run {record.run_id} is not running on the cluster; fab jobs lists the runs")
    return f"fab: run {record.run_id} cancelled (it was {before})"


def stop_all(cluster: ClusterInfo, holder: RunHolder) -> None:
    """`fab stop`: whatever job runs on each node, launches being prepared, and (where the cluster queues)
    every run in its queue; what it names is what it stopped, however launches race it (remote/stopping.py)."""
    if holder.queues:
        _forget_values(cluster, stopping.stop_slurm_held(cluster))
        return
    for node, outcome in stop_everywhere(cluster).items():
        say(f"{node}: {outcome}")


def _forget_values(cluster: ClusterInfo, stopped: list[str]) -> None:
    """The `--env` values of the Slurm-held runs a stop cancelled leave the cluster now: no start reads them."""
    found = [
        r for _, r in runs.runs_of(state.runs_dir(cluster.stack)) if r.run_id in stopped and r.spec.get("env_values")
    ]
    if not found:
        return
    head = NodeSession(cluster, cluster.head)
    try:
        for run in found:
            slurm_jobs.forget_env_values(cluster, run.run_id, run.spec["env_values"], head)
    finally:
        head.close()


def holder_for(cluster: ClusterInfo, setup: NodeSetup) -> RunHolder:
    """The holder bootstrap chose for this cluster."""
    return SlurmHolder(cluster, setup) if setup.slurm_holds else FabHolder(cluster, setup)
