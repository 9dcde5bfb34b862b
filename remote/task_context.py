"""What every `fab` task starts from: the cluster (`cluster_for`: `--stack`, else $CLUSTER_STACK, else the last
`up`), what bootstrap found there (`setup_for`), the run holder bootstrap chose (`holder_of`), and how a launch
or a follow ended, said the one way for both holders (`report`)."""

import sys

from invoke.exceptions import Exit

from infra import hints, inventory
from infra.errors import UsageError
from infra.inventory import ClusterInfo
from remote import holders, runs
from remote.job_spec import NodeSetup
from remote.stream import say

STACK_HELP = "stack to use (default: $CLUSTER_STACK, else the last `python deploy.py up`)"


def report(cluster: ClusterInfo, ending: holders.Ending) -> None:
    """How a launch or a follow ended, said the one way for both holders: submitted (its id last),
    detached (it goes on), cancelled by Ctrl-C (130), or its outcome (`runs.outcome`: 0 or 1)."""
    run, folder = ending.run, ending.folder
    if run.timeline is not None and not ending.detached:  # the phases this command saw, in one line
        say(f"fab: {run.timeline.line()}")
    if ending.submitted:
        follow, cancel = hints.fab(f"logs -f --run {run.run_id}"), hints.fab(f"stop --run {run.run_id}")
        say(f"fab: follow it with {follow}; cancel it with {cancel}")
        print(run.run_id, flush=True)  # alone on the last line, for scripts
        return
    if ending.cancelled_by:
        raise Exit(f"fab: run {run.run_id} was cancelled by {ending.cancelled_by}; its log: {folder}", code=1)
    if ending.detached:
        say(
            f"fab: stopped following ({ending.detached}); run {run.run_id} goes on on the cluster: "
            + hints.fab(f"logs -f --run {run.run_id}")
        )
        if ending.interrupted:
            raise Exit(code=130)
        return
    if ending.interrupted:
        say(f"fab: run {run.run_id} cancelled (Ctrl-C): stopped on every node; logs: {folder}")
        raise Exit(code=130)
    code, line = runs.outcome(cluster, run, folder)
    if code:
        raise Exit(line, code=code)
    say(line)


def cluster_for(stack: str | None) -> ClusterInfo:
    try:
        cluster = inventory.load_current(stack)
    except UsageError as exc:
        raise Exit(f"error: {exc}", code=2) from None
    if not cluster.nodes_move:
        return cluster
    from infra import providers  # boto3 loads only where nodes move (AWS spot workers)

    return providers.current(cluster, lambda line: print(line, file=sys.stderr, flush=True))  # not into --json


def setup_for(cluster: ClusterInfo) -> NodeSetup:
    return NodeSetup.load(cluster.stack)


def holder_of(stack: str | None) -> tuple[ClusterInfo, holders.RunHolder]:
    cluster = cluster_for(stack)
    return cluster, holders.holder_for(cluster, setup_for(cluster))
