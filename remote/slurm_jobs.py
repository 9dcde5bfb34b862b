"""The Slurm jobs of the runs Slurm holds, as the head node knows them: their states (`refresh`, onto each
run's record), `cancel`, and the `--env` values an ended or cancelled run lets go (`forget_env_values`)."""

from infra.errors import OperationError
from infra.inventory import ClusterInfo
from node import calls
from node.run_state import RunState
from remote import node_paths, nodecall
from remote.connect import CONNECTION_ERRORS, NodeSession, describe, on_all_nodes, open_sessions
from remote.runs import FINAL, Run
from remote.stopping import ControllerSilent
from remote.stream import say


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
