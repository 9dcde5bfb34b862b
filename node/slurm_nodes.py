"""The nodes as Slurm's controller sees them: their states, and gpu-cluster's three reasons for taking one
out of service (a spot notice's drain, contract.SPOT_DRAIN_REASON; a straggler's drain before it is
replaced, contract.STRAGGLER_DRAIN_REASON; a node found gone, set DOWN, contract.NODE_LOST_REASON), set
and lifted here; and Slurm's own drain of a node whose disk was full, lifted once it has room again.
Standard library only.
"""

import json
import os
import re
import subprocess
import time

from node import contract
from node.slurm_conf import DaemonError, Paths, UsageError
from node.slurm_daemons import READY_TIMEOUT_S, write_private
from node.slurm_existing import client, client_environment


def scontrol(paths: Paths, *args: str) -> subprocess.CompletedProcess:
    return client(client_environment(paths), "scontrol", *args)


def node_reasons(paths: Paths) -> dict:
    """{node: (Slurm's state, the reason it is drained or down, or "")}; {} where the controller is silent."""
    try:
        result = client(client_environment(paths), "sinfo", "--noheader", "--Node", "--format=%N|%T|%E")
    except (subprocess.TimeoutExpired, OSError, UsageError):
        return {}
    found = {}
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        name, _, rest = line.partition("|")
        node_state, _, reason = rest.partition("|")
        found[name.strip()] = (node_state.strip(), "" if reason.strip() == "none" else reason.strip())
    return found


SLURM_NOT_RESPONDING = "Not responding"
"""The reason slurmctld gives a node it set DOWN for not answering (SlurmdTimeout)."""


def out_of_service(node_state: str, reason: str = "") -> bool:
    """Slurm's state of a node no run can start on: down, drained, failing, or not responding (`*`)."""
    lowered = node_state.lower()
    return lowered.endswith("*") or any(word in lowered for word in ("down", "drain", "fail", "not_responding"))


def responding(paths: Paths, node_name: str) -> bool:
    """The controller hears from this node's slurmd (True where the controller does not answer: that is
    for the head node's start to mend, not this node's slurmd)."""
    node_state, reason = node_reasons(paths).get(node_name, ("", ""))
    lowered = node_state.lower()
    silent = lowered.endswith("*") or "not_responding" in lowered
    return not (silent or (lowered.startswith("down") and reason.startswith(SLURM_NOT_RESPONDING)))


DRAINED_TO_BE_REPLACED = (contract.SPOT_DRAIN_REASON, contract.STRAGGLER_DRAIN_REASON)
"""The reasons of a drain whose machine goes away and comes back as a replacement (lifted on the new one)."""


def lost_or_noticed(reason: str) -> bool:
    """A reason gpu-cluster gave a node it took out of service: a spot notice, a straggler to be replaced,
    or a node found dead."""
    return reason.startswith((*DRAINED_TO_BE_REPLACED, contract.NODE_LOST_REASON))


def mark_lost(paths: Paths, node_name: str, why: str) -> str:
    """Tell Slurm a node is gone (DOWN: its run is requeued, JobRequeue=1); Slurm's answer. Each run on it
    gets its PREEMPTED_RECORD first, as a notice's requeue writes one: Slurm ends its batch script at once,
    and the node's reason is gone once its replacement has joined, while the run still waits. Where its
    watcher had drained the node for a spot notice, the runs' requeue stays the notice's (a drill's short
    notice, which the supervisor cannot tell was seen, read as a lost node); the node's own reason says it
    is lost and why (what a run waiting for it waits for)."""
    _, current = node_reasons(paths).get(node_name, ("", ""))
    reason = f"{contract.NODE_LOST_REASON}: {why}"
    requeued_for = current if current.startswith(contract.SPOT_DRAIN_REASON) else reason
    for folder, restart in _runs_on(paths, node_name):
        record = {"nodes": [node_name], "reason": requeued_for, "at": time.time(), "restart": restart + 1}
        try:
            write_private(os.path.join(folder, contract.PREEMPTED_RECORD), json.dumps(record).encode(), 0o600)
        except OSError:  # the run's folder is gone: nothing waits to read it
            pass
    return _take_out(paths, node_name, "DOWN", reason, "down")


def _runs_on(paths: Paths, node_name: str) -> list:
    """[(the run's folder, its restarts so far)] of gpu-cluster's runs on `node_name` (their batch job's
    output is the run's log, beside its FIRST_START_RECORD)."""
    try:
        listed = client(
            client_environment(paths), "squeue", "--noheader", f"--nodelist={node_name}", "--format=%i"
        ).stdout.split()
        found = []
        for job in listed:
            shown = scontrol(paths, "show", "job", "--oneliner", job).stdout
            log, restarts = re.search(r"StdOut=(\S+)", shown), re.search(r"Restarts=(\d+)", shown)
            folder = os.path.dirname(log.group(1)) if log else ""
            if folder and restarts and os.path.exists(os.path.join(folder, contract.FIRST_START_RECORD)):
                found.append((folder, int(restarts.group(1))))
        return found
    except (subprocess.TimeoutExpired, OSError, UsageError):
        return []


def drain_for_notice(paths: Paths, node_name: str, notice: str) -> str:
    """Drain this node (no new run starts on it; the running one goes on until it ends); Slurm's answer."""
    return _take_out(paths, node_name, "DRAIN", f"{contract.SPOT_DRAIN_REASON}: {notice}", "drained")


def drain_straggler(paths: Paths, node_name: str, why: str) -> str:
    """Drain a node named a straggler, to be replaced (`--on-straggler replace`); Slurm's answer."""
    return _take_out(paths, node_name, "DRAIN", f"{contract.STRAGGLER_DRAIN_REASON}: {why}", "drained")


def _take_out(paths: Paths, node_name: str, state: str, reason: str, done: str) -> str:
    result = scontrol(paths, "update", f"NodeName={node_name}", f"State={state}", f"Reason={reason}")
    return done if result.returncode == 0 else (result.stderr.strip() or f"scontrol exited {result.returncode}")


def resume_if_ours(paths: Paths, node_name: str, fresh: bool, wait_s: float = READY_TIMEOUT_S) -> bool:
    """This node back in service where gpu-cluster took it out and it is whole again: set DOWN as lost
    (it answers now), or drained for a spot notice or as a straggler when it is `fresh` (its slurmd just
    started: a replacement; a node still waiting to be reclaimed or powered off keeps its drain). Waits
    for slurmd to register."""
    deadline = time.monotonic() + wait_s
    while True:
        node_state, reason = node_reasons(paths).get(node_name, ("", ""))
        ours = reason.startswith(contract.NODE_LOST_REASON) or (fresh and reason.startswith(DRAINED_TO_BE_REPLACED))
        if not ours:
            return False
        if "NOT_RESPONDING" not in node_state.upper() and not node_state.endswith("*"):
            if scontrol(paths, "update", f"NodeName={node_name}", "State=RESUME").returncode == 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def rejoined(paths: Paths, node_name: str, wait_s: float = READY_TIMEOUT_S) -> str:
    """A replacement (node/join.py) back in service: where gpu-cluster's reasons hold it out (a notice's
    drain, or lost), it is resumed; it is a new machine, never the one waiting to be reclaimed. Slurm's state
    of it; DaemonError when the controller does not answer (the head node may be being replaced too: the
    join is tried again) or still holds it out, `wait_s` on."""
    deadline = time.monotonic() + wait_s
    while True:
        resume_if_ours(paths, node_name, fresh=True, wait_s=max(0.0, deadline - time.monotonic()))
        node_state, reason = node_reasons(paths).get(node_name, ("", ""))
        if node_state and not lost_or_noticed(reason):
            return node_state
        if time.monotonic() > deadline:
            if not node_state:
                raise DaemonError(f"the controller did not answer about {node_name} (is the head node up?)")
            raise DaemonError(f"{node_name} is still out of service in Slurm ({node_state}: {reason})")
        time.sleep(1.0)


def forget_stale_jobs(paths: Paths, node_name: str) -> str:
    """A node replaced by a new machine while no controller was there to see it go (the head node was
    replaced too): a job Slurm still thinks runs on it, started before its new slurmd, went with the old
    machine. The node is set DOWN as lost (the job is requeued, JobRequeue=1) and back in service at once.
    What was done, in a few words. (A cloud instance's new boot time tells Slurm as much by itself; the
    local provider's nodes share this machine's.)"""
    shown = scontrol(paths, "show", "node", node_name, "--oneliner").stdout
    slurmd_started = re.search(r"SlurmdStartTime=(\S+)", shown)
    if not slurmd_started:
        return "unknown to the controller"
    listed = client(
        client_environment(paths),
        "squeue",
        "--noheader",
        f"--nodelist={node_name}",
        "--states=RUNNING,COMPLETING,CONFIGURING",
        "--format=%i|%S",
    ).stdout
    stale = [
        job for job, _, started in (line.partition("|") for line in listed.split()) if started < slurmd_started.group(1)
    ]
    if not stale:
        return "no job of the old machine"
    mark_lost(paths, node_name, "replaced: its jobs went with the old machine")
    rejoined(paths, node_name)
    return f"requeued {', '.join(stale)}"


DISK_FULL_REASONS = ("SlurmdSpoolDir is full", "batch job complete failure", "Low TmpDisk")
"""The reasons Slurm drains a node with when its disk is full (slurmd or a job's step could not write its files).
Slurm never lifts them itself: every run waits for that node until someone does."""


def free_mb(path: str) -> float:
    """MiB free to this user where `path` is (or the nearest folder above it that exists)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    found = os.statvfs(path)
    return found.f_bavail * found.f_frsize / 2**20


def resume_if_room_back(paths: Paths, node_name: str) -> str:
    """This node back in service where Slurm drained it for a full disk (DISK_FULL_REASONS) and its disk (its
    run folder, Slurm's own folder) has contract.RUN_ROOM_MB free again; what was done, '' where nothing."""
    node_state, reason = node_reasons(paths).get(node_name, ("", ""))
    if "drain" not in node_state.lower() or not reason.startswith(DISK_FULL_REASONS):
        return ""
    room = {folder: free_mb(paths.at(folder)) for folder in (contract.RUNS, contract.SCHEDULER)}
    short = [f"~/{folder} has {mb:.1f} MiB free" for folder, mb in room.items() if mb < contract.RUN_ROOM_MB]
    if short:
        return f"still drained by Slurm ({reason}): {', '.join(short)}, a run needs {contract.RUN_ROOM_MB} MiB"
    result = scontrol(paths, "update", f"NodeName={node_name}", "State=RESUME")
    if result.returncode != 0:
        return f"drained by Slurm ({reason}), not resumed: {result.stderr.strip() or result.returncode}"
    return (
        f"back in service: Slurm drained it ({reason}) while its disk was full; {min(room.values()):.0f} MiB free now"
    )
