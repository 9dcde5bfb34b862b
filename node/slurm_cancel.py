"""On the head node: `fab stop`'s cancel of every run that Slurm holds for this stack, queued or running.

A run's Slurm job is named by its run id (`contract.RUN_ID_PATTERN`) and submitted by the node user; in a
Slurm the hosts already ran it also carries the stack's tag as its comment (node/slurm_existing.py). What
the queue lists now is cancelled and named, with the state it had; a job submitted after the listing is
neither (a launch that raced the stop: it runs, and no one said it was stopped). Where the controller cannot
answer, the reply says why and cancels nothing: the operator stops the runs' processes on the nodes instead.
Standard library only.
"""

import os
import pwd
import re
import subprocess

from node import contract, slurm_existing, slurm_run
from node.slurm_conf import DaemonError, Paths
from node.slurm_daemons import gone

CANCELLABLE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED", "CONFIGURING", "RESIZING"})
"""Slurm's states of a job that `scancel` still stops (one COMPLETING or ended is past it)."""
NOT_CANCELLED = re.compile(r"job id (\d+)")
"""How `scancel` names a job it could not cancel (it ended in the meantime), one error line each."""


def listed(text: str, tag: str = "") -> list:
    """[(job id, run id, state)] of the stack's runs in `squeue --format=%i|%j|%T|%k` output (`tag`: the
    comment every job of the stack carries in a Slurm the hosts already ran) that scancel still stops."""
    found = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 4:
            continue
        job, name, state, comment = parts
        if re.fullmatch(contract.RUN_ID_PATTERN, name) and state in CANCELLABLE and (not tag or comment == tag):
            found.append((job, name, state))
    return found


def cancel(job_id: str) -> dict:
    """node/calls.py's CancelRun: one run's job (`slurm_run.cancel`), or where `job_id` is '' every run's
    (`cancel_runs`); `unanswered` says why Slurm's controller could not be asked."""
    paths = Paths(os.path.expanduser("~"))
    down = gone(paths)
    if down:
        return {
            "before": None,
            "unanswered": f"{' and '.join(down)} on the head node is not running (killed or crashed)",
        }
    if not job_id:
        return {"before": None, **cancel_runs(paths)}
    try:
        return slurm_run.cancel(job_id)
    except DaemonError as exc:
        return {"before": None, "unanswered": str(exc)}


def cancel_runs(paths: Paths) -> dict:
    """{"cancelled": [{run_id, job_id, state}], "unanswered": why Slurm's controller could not be asked ('' where
    it answered)}."""
    adopted = slurm_existing.existing(paths) or {}
    environment = slurm_existing.client_environment(paths)
    user = pwd.getpwuid(os.getuid()).pw_name
    try:
        jobs = listed(
            slurm_existing.answered(environment, "squeue", "--noheader", f"--user={user}", "--format=%i|%j|%T|%k"),
            adopted.get("tag") or "",
        )
        refused: set = set()
        if jobs:
            result = slurm_existing.client(environment, "scancel", *[job for job, _, _ in jobs])
            refused = set(NOT_CANCELLED.findall(result.stderr)) if result.returncode else set()
            if result.returncode and not refused:
                raise DaemonError(f"scancel failed: {(result.stderr.strip() or result.stdout.strip())[-200:]}")
    except (DaemonError, OSError) as exc:
        return {"cancelled": [], "unanswered": str(exc)}
    except subprocess.TimeoutExpired:
        return {"cancelled": [], "unanswered": f"scancel did not answer in {slurm_existing.CLIENT_TIMEOUT_S:g} s"}
    cancelled = [{"run_id": run, "job_id": job, "state": state} for job, run, state in jobs if job not in refused]
    return {"cancelled": cancelled, "unanswered": ""}
