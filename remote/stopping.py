"""`fab stop` where Slurm holds the runs, and what a launch that a stop found preparing leaves behind.

A stop names only what it stopped, and what it names is stopped, however launches race it:

- first, on every node, the job lock's holders and waiters (launches being prepared, node/stop_jobs.py),
  then whatever job Slurm does not hold (a run held by fab's connections before Slurm was set up). A launch
  whose holder was ended submits nothing (remote/scheduled.py) and starts nothing (node/torchrun.py).
- then every run of the stack in Slurm's queue, queued or running, by its job's name
  (node/slurm_cancel.py), whether or not this machine has its record yet (a launch between its submit and
  its record): Slurm's list, not the records, says what is cancelled. A run submitted after it is neither
  cancelled nor named.

Where Slurm's controller does not answer (slurmctld killed), the runs' processes are stopped on the nodes
instead, so that `fab bootstrap`, which refuses while a job holds MASTER_PORT, can then restart the daemons:
one line says so, and what is queued stays queued until then.
"""

from infra.errors import OperationError
from infra.inventory import ClusterInfo
from node import calls
from remote import node_paths, nodecall
from remote.connect import CONNECTION_ERRORS, NodeSession, describe, on_all_nodes
from remote.launch import stop_everywhere
from remote.stream import say


class ControllerSilent(OperationError):
    """Slurm's controller cannot be asked (`why`: slurmctld or munged not running on the head node)."""

    def __init__(self, why: str):
        super().__init__(f"Slurm's controller does not answer ({why}): fab bootstrap restarts it")
        self.why = why


def stop_slurm_held(cluster: ClusterInfo) -> list[str]:
    """`fab stop` where Slurm holds the runs: each node's line and each run cancelled said; the run ids stopped.
    OperationError (one line) where some could not be (the controller is down and runs wait in its queue)."""
    stopped: list[str] = []
    for node, outcome in stop_everywhere(cluster, leave_slurm=True).items():
        say(f"{node}: {outcome}")
        stopped += outcome.split()[1:] if outcome.startswith("stopped ") else []
    reply = cancel_in_slurm(cluster, "")
    if not reply.unanswered:
        for cancelled in reply.cancelled:
            say(f"fab: run {cancelled['run_id']} cancelled (it was {cancelled['state']})")
        return stopped + [c["run_id"] for c in reply.cancelled]
    killed = stop_everywhere(cluster)
    for node, outcome in killed.items():
        if outcome != "idle":
            say(f"{node}: {outcome}")
    raise OperationError(
        f"Slurm's controller does not answer ({reply.unanswered}): what ran on the nodes was stopped there, but "
        "runs waiting in its queue are not cancelled: fab bootstrap restarts Slurm's daemons (the queue is "
        "kept), then fab stop cancels them"
    )


def cancel_in_slurm(cluster: ClusterInfo, job_id: str) -> calls.Cancelled:
    """Slurm's cancel of one job (`job_id`) or of every run of the stack (''), asked of the head node."""
    head = NodeSession(cluster, cluster.head)
    try:
        return nodecall.call(head, cluster.python, calls.CancelRun(job_id))
    except CONNECTION_ERRORS as exc:
        raise OperationError(f"{cluster.head.name} does not answer: {describe(exc)}") from None
    finally:
        head.close()


def stop_on_the_nodes(cluster: ClusterInfo, run_id: str, why: str) -> str:
    """`fab stop --run` of a run whose Slurm controller does not answer (`why`): its processes stopped on
    every node; the line that says so. OperationError where none ran (it waits in the queue, or ended)."""
    stopped = [node for node, outcome in stop_everywhere(cluster, run_id=run_id).items() if outcome != "idle"]
    if not stopped:
        raise OperationError(
            f"Slurm's controller does not answer ({why}) and run {run_id} runs on no node (it waits in the "
            f"queue): fab bootstrap restarts Slurm's daemons (the queue is kept), then fab stop --run {run_id}"
        )
    return (
        f"fab: run {run_id} stopped on {', '.join(stopped)}; Slurm's controller does not answer ({why}): "
        "fab bootstrap restarts it, and Slurm then records the run's end"
    )


def forget_launch(sessions: list[NodeSession], cluster: ClusterInfo, run_id: str) -> None:
    """Remove what a launch stopped before its submit made for its run on the nodes (the script, the workdir
    copy, the stage): no record, and no `fab jobs`, will ever name them."""
    folders = {node_paths.remote_run_dir(cluster, run_id), node_paths.node_run_dir(run_id)}
    command = "rm -rf " + " ".join(sorted(node_paths.shell_path(folder) for folder in folders))
    on_all_nodes(sessions, lambda s: s.run(command, warn=True))
