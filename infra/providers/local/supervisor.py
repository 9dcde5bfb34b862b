"""The local provider's stand-in for a cloud that keeps a cluster whole: a node whose server is gone (reclaimed
after a spot drill's notice, or killed) is replaced by a fresh node on the same address and port.

    python -m infra.providers.local.supervisor STACK

`up --local --spot` starts it in a session of its own (its pid in the stack's `supervisor.pid`); `down`
ends it before the nodes. Every `POLL_S` it looks at each node server. When the watchdog's stop marker is there
(the cluster powered itself off) it exits: nothing is replaced. For every node found gone it:

1. tells Slurm the node is lost (DOWN, reason `contract.NODE_LOST_REASON`) unless a notice drained it
   already: a run still on it is requeued (node/slurm_run.py, JobRequeue), as slurmctld would do itself
   after SlurmdTimeout on a real cluster (where Slurm holds the runs; a fab-held run sees it by itself; a
   node that powered itself off as a straggler, `--on-straggler replace`, left its run requeued already:
   its ledger event is `straggler`);
2. ends what the dead node left running (its scheduler daemons, job processes), as a power cut would;
3. starts a fresh node: an empty home, a new host key (pinned in the stack's known_hosts in place of the
   old one), a new token and metadata service, no notice;
4. brings it in: a worker joins by itself from the shared folder (node/join.py, as a replacement's boot
   does on AWS: the venv, its env file, Slurm's daemons where Slurm holds the runs); where the head node
   is among the dead, or no bootstrap left a join kit, `fab bootstrap` of the cluster does it. Its slurmd
   registers, the node returns to service (node/scheduler.py), and the requeued run starts again; a
   fab-held fault-tolerant run starts the node's replica group again (remote/heal.py).

What it does is one line each in the stack's `supervisor.log`, and an event in the ledger (`deploy.py
cost` lists interruptions and replacements). A replacement that fails to bootstrap is marked so in Slurm
(the run waits, PENDING, with that reason) and tried again every `RETRY_S`, or at once with the next node
found gone: a head node whose bootstrap failed because a worker went during it is bootstrapped again with
the worker's replacement.
"""

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from infra import inventory, keys, nodecall, ssh, state
from infra.errors import NodeCallError
from infra.inventory import ClusterInfo, NodeInfo
from infra.ledger import Ledger
from infra.providers.local import metadata, provider
from node import calls, contract, spot_watch

POLL_S = 1.0
RETRY_S = 5.0
BOOTSTRAP_TIMEOUT_S = 600
PID_FILE = provider.SUPERVISOR_PID
LOG_FILE = provider.SUPERVISOR_LOG


def log(stack: str, line: str) -> None:
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with state.open_private(state.stack_file(stack, LOG_FILE), "a") as f:
        f.write(f"{stamp} {line}\n")


def dead_nodes(stack: str, cluster: ClusterInfo) -> list[tuple[int, NodeInfo]]:
    """Nodes whose server is not running."""
    alive = provider._server_start_times(stack)
    return [(i, node) for i, node in enumerate(cluster.nodes) if node.name not in alive]


def powered_off(stack: str) -> bool:
    return (provider.shared_dir(stack) / contract.STOP_MARKER).exists()


def forget_stale_jobs(cluster: ClusterInfo, replaced: list[NodeInfo]) -> None:
    """After the head node was replaced with others: the runs Slurm's recovered queue still has running on
    the old machines are requeued now (node/scheduler.py replaced), not after SlurmdTimeout."""
    for node in replaced:
        try:
            said = ask(cluster, cluster.head, calls.ForgetStaleJobs(node.name), 60).said
            log(cluster.stack, f"{node.name}: {said}")
        except Exception as exc:  # Slurm finds out by itself after SlurmdTimeout
            log(cluster.stack, f"{node.name}: could not ask Slurm about its old jobs: {ssh.describe(exc)}")


def slurm_holds(stack: str) -> bool:
    """Whether Slurm holds the stack's runs (its bootstrap.json): only then is there a controller to tell."""
    return state.bootstrap_record(stack).slurm_holds


def mark_lost(cluster: ClusterInfo, lost: list[NodeInfo], why: str = "its server is gone") -> None:
    """Slurm on the head node is told which nodes are gone (where the head node is one of them, there
    is no controller to tell: the queue is on shared storage and the runs are requeued when it is back).
    Where runs are held by fab's connections there is no Slurm to tell (asking would wait for its client's
    timeout, about 9 s, before the replacement starts): the launch sees the node gone by itself."""
    if cluster.head in lost or not slurm_holds(cluster.stack):
        return
    for node in lost:
        try:
            said = ask(cluster, cluster.head, calls.MarkLost(node.name, why), 30).said
            log(cluster.stack, f"{node.name}: Slurm told it is lost: {said}")
        except Exception as exc:  # the head node may be gone too; the replacement goes on regardless
            log(cluster.stack, f"{node.name}: could not tell Slurm: {ssh.describe(exc)}")


def drained_by_notice(stack: str, node_name: str) -> bool:
    """Whether the node's spot notice was up long enough for its watcher to have seen it: the watcher then
    drained the node in Slurm with the notice as its reason, and its run's requeue says so. Telling Slurm
    the node is lost on top would put `node lost` in place of the notice in the run's record and in `fab
    jobs`. A notice shorter than two of the watcher's polls may not have been seen: that node is told lost."""
    notice = metadata.read_notice(provider.notice_path(stack, node_name)) or {}
    try:
        posted = datetime.fromisoformat(str(notice["notice_time"]).replace("Z", "+00:00")).timestamp()
        up_s = float(notice["reclaim_at_s"]) - posted
    except (TypeError, KeyError, ValueError):
        return False
    return up_s >= 2 * spot_watch.DEFAULT_INTERVAL_S


def ask(cluster: ClusterInfo, node: NodeInfo, request: calls.Request, timeout_s: float):
    """A node call from the supervisor (node/calls.py, through the shared folder's code)."""
    code = f"{cluster.shared_dir}/code"  # a local cluster always has its shared folder
    return asyncio.run(nodecall.call(cluster, node, cluster.python, code, request, timeout_s))


def fresh_node(stack: str, cluster: ClusterInfo, index: int) -> None:
    """A new node in the dead one's place: same address and port, empty home, new host key pinned."""
    node = cluster.nodes[index]
    home = provider.node_dir(stack, index)
    shutil.rmtree(home, ignore_errors=True)
    provider.notice_path(stack, node.name).unlink(missing_ok=True)
    power_off_marker(stack, node.name).unlink(missing_ok=True)
    client_key = Path(cluster.ssh_key)
    config, host_public = provider._prepare_node(stack, index, node.public_ip, node.ssh_port, client_key, node.ssh_user)
    known_hosts = Path(cluster.known_hosts)
    entry = keys.known_hosts_entry(node.public_ip, node.ssh_port, host_public)
    host = entry.split()[0]
    kept = [line for line in known_hosts.read_text().splitlines() if line and line.split()[0] != host]
    keys.write_known_hosts(known_hosts, [*kept, entry])
    process = provider._spawn(config)
    provider._wait_for_pid_files([config], [process])
    ssh.wait_for_ssh(dataclasses.replace(cluster, nodes=(node,)), provider.READY_TIMEOUT_S)


def power_off_marker(stack: str, node: str) -> Path:
    """Where a run's batch job told `node` to power off as a straggler (`--on-straggler replace`)."""
    return provider.shared_dir(stack) / contract.power_off_marker(node)


def bootstrap(stack: str) -> tuple[bool, str]:
    """`fab bootstrap` of the stack (the scheduler it had); whether it passed, and its last line."""
    fab = Path(sys.executable).with_name("fab")
    argv = [
        str(fab) if fab.exists() else shutil.which("fab") or "fab",
        "-r",
        str(state.REPO_ROOT),
        "bootstrap",
        "--stack",
        stack,
    ]
    with state.open_private(state.stack_file(stack, LOG_FILE), "ab") as out:
        try:
            result = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=state.REPO_ROOT, timeout=BOOTSTRAP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return False, f"fab bootstrap did not finish within {BOOTSTRAP_TIMEOUT_S} s"
    return result.returncode == 0, f"fab bootstrap exited {result.returncode}"


def join(cluster: ClusterInfo, node: NodeInfo) -> tuple[bool, str]:
    """node/join.py on the fresh node, as a replacement's boot runs it on AWS: the venv, the env file and
    Slurm's daemons from the shared folder's join kit; whether it passed, and its last line."""
    try:
        joined = ask(cluster, node, calls.JoinCluster(node.name), BOOTSTRAP_TIMEOUT_S)
    except NodeCallError as exc:
        said = f"join failed: error: {exc.line}"[:400]
    except Exception as exc:
        return False, f"join could not run: {ssh.describe(exc)}"
    else:
        said = f"join passed: {json.dumps(dataclasses.asdict(joined))}"
    with state.open_private(state.stack_file(cluster.stack, LOG_FILE), "a") as out:
        out.write(said + "\n")
    return said.startswith("join passed"), said


def rejoin(stack: str, cluster: ClusterInfo, nodes: list[NodeInfo]) -> tuple[bool, str]:
    """Bring fresh nodes into the cluster: each joins from the shared folder by itself (node/join.py) where
    bootstrap left a join kit and the head node is not among them; else `fab bootstrap` of the cluster."""
    if cluster.head not in nodes and (provider.shared_dir(stack) / contract.JOIN_KIT).exists():
        if cluster.head.name in [node.name for _, node in dead_nodes(stack, cluster)]:
            return False, "the head node is gone too: its replacement comes first"  # no controller to join
        if provider.notice_path(stack, cluster.head.name).exists():
            return False, "the head node has a spot notice too: its replacement comes first"
        answers = [join(cluster, node) for node in nodes]
        failed = [last for passed, last in answers if not passed]
        return not failed, (failed or [answers[-1][1]])[0]
    return bootstrap(stack)


def replace(
    stack: str, cluster: ClusterInfo, dead: list[tuple[int, NodeInfo]], unjoined: list[NodeInfo] | None = None
) -> bool:
    """Replace every dead node, then bring them in with the nodes replaced before that have not rejoined yet
    (`unjoined`: a head node whose bootstrap failed because a worker went during it is bootstrapped again
    with that worker's replacement, not left out while the worker tries to join a controller that never
    started); whether all of it worked."""
    names = ", ".join(node.name for _, node in dead)
    started = time.time()
    reclaimed = [node.name for _, node in dead if provider.notice_path(stack, node.name).exists()]
    stragglers = [node.name for _, node in dead if power_off_marker(stack, node.name).exists()]
    why = "reclaimed after a spot notice" if reclaimed else "powered off as a straggler" if stragglers else "no notice"
    log(stack, f"{names}: gone ({why}); replacing")
    if cluster.head not in (unjoined or []):  # a head replaced but not bootstrapped runs no controller to tell
        mark_lost(cluster, [node for _, node in dead if not drained_by_notice(stack, node.name)])
    for index, _ in dead:
        provider.end_node_leftovers(provider.node_dir(stack, index))
    for index, node in dead:
        fresh_node(stack, cluster, index)
        log(stack, f"{node.name}: a fresh node is up on {node.public_ip}:{node.ssh_port}, its new host key pinned")
    if state.stack_file(stack, state.BOOTSTRAP).exists():
        replaced = [node for _, node in dead]
        brought_in = replaced + [node for node in unjoined or [] if node not in replaced]
        passed, last = rejoin(stack, cluster, brought_in)
        if passed and cluster.head in brought_in:
            forget_stale_jobs(cluster, brought_in)
    else:  # never bootstrapped: the fresh node is as the others are
        passed, last = True, "not bootstrapped before: fab bootstrap prepares it"
    took = time.time() - started
    ledger = Ledger()
    try:
        for _, node in dead:
            kind = (
                "spot interruption"
                if node.name in reclaimed
                else "straggler"
                if node.name in stragglers
                else "node lost"
            )
            detail = f"replaced; rejoined in {took:.0f} s" if passed else f"replaced; did not rejoin ({last})"
            ledger.event(stack, kind, node.name, detail, at=started, seconds=took)
    finally:
        ledger.close()
    log(stack, f"{names}: {'rejoined' if passed else 'did not rejoin'} in {took:.1f} s ({last})")
    if not passed:  # the runs wait, and say why (fab jobs); tried again after RETRY_S
        mark_lost(cluster, [node for _, node in dead], f"its replacement did not rejoin ({last}; see {LOG_FILE})")
    return passed


def run(stack: str) -> int:
    log(stack, f"supervising stack {stack!r} (pid {os.getpid()})")
    unjoined: list[NodeInfo] = []  # replaced, but their bootstrap failed: tried again every RETRY_S
    retry_at = 0.0
    while True:
        if powered_off(stack):
            log(stack, "the cluster powered itself off: nothing to replace; exiting")
            return 0
        try:
            cluster = inventory.load(stack)
        except Exception:  # down removed it
            return 0
        if dead_nodes(stack, cluster):
            time.sleep(POLL_S)  # a node the drill reclaims, or `down` stops, goes with its neighbours
            if powered_off(stack) or not state.stack_file(stack, PID_FILE).exists():
                continue
            dead = dead_nodes(stack, cluster)
            if dead and not replace(stack, cluster, dead, unjoined):
                gone = [node for _, node in dead]
                unjoined = [*gone, *(node for node in unjoined if node not in gone)]
                retry_at = time.monotonic() + RETRY_S
            elif dead:
                unjoined = []  # brought in with the dead
        elif unjoined and time.monotonic() >= retry_at:
            names = ", ".join(node.name for node in unjoined)
            passed, last = rejoin(stack, cluster, unjoined)
            log(stack, f"{names}: {'rejoined' if passed else 'did not rejoin'} on a new try ({last})")
            if passed:
                unjoined = []
            else:
                retry_at = time.monotonic() + RETRY_S
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m infra.providers.local.supervisor STACK", file=sys.stderr)
        return 2
    return run(args[0])


if __name__ == "__main__":
    sys.exit(main())
