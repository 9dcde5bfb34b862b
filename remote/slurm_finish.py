"""A run Slurm held, seen ended (`finish`, once per run, by the first command that sees it end): its state and
times from Slurm, each node's and each failed rank's exit code, the hang watch's verdict, the restarts
priced, results fetched, `summary.json` written, the ledger's row given Slurm's own start and end times, so a
run that ended while nothing was connected is priced."""

import io
import json
import time
from pathlib import Path

from infra.inventory import ClusterInfo
from infra.timeline import job_phases
from node import contract
from node.outcome import STOPPED_CODES, ended_at
from node.run_state import RunState
from remote import job_command
from remote.connect import NodeSession, describe
from remote.hangwatch import keep_evidence
from remote.job_spec import NodeSetup
from remote.results import explain_failure, fetch_results, report_fetched
from remote.runs import Run, RunBook, summary, write_summary
from remote.slurm_follow import Followed, brought_log
from remote.slurm_jobs import forget_env_values, refresh
from remote.stream import RankOutcome, say


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
        brought = brought_log(cluster, run, folder)
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
    if ranks and outcome == known.get("state") == RunState.FAILED and all(c in STOPPED_CODES for c in stopped):
        # Every node stopped from outside (`fab stop` without Slurm's controller), by what their torchrun said:
        # where the log could not be read at all, the codes are guesses and Slurm's FAILED stands.
        outcome = RunState.CANCELLED if stopped else outcome
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
