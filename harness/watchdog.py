"""The budget and idle guard, running on the head node so it holds while the operator's laptop is off.

    python -m harness.watchdog --shared-dir /shared --hourly-usd 1.537 --started-at 1763700000 \\
        --max-total-usd 25 --idle-minutes 30

Every check it works out what the cluster has cost since it came up. When the next check would find
it past `--max-total-usd`, or when no job has run and the GPUs have been idle for `--idle-minutes`, or
when the running job has made no progress that long (no collective completed and no training step,
as its ranks' monitors report: a stalled job is as idle as no job), it stops the job on this node
and writes the stop marker `$CLUSTER_SHARED_DIR/.gpu-cluster/stop.json`
with the reason. Every node powers itself off when the marker appears (on AWS a systemd timer from
cloud-init; on the local provider the node's SSH server), which terminates or stops the instances as
the stack says. `deploy.py status` then says the cluster stopped itself, and why, and the ledger records it.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.gpu_monitor import busy as gpus_busy
from node import billing, contract, procfs

JOB_FILE = contract.shell(contract.JOB)
PROGRESS_DIR = contract.shell(contract.PROGRESS)


@dataclass(frozen=True)
class Guards:
    """What the watchdog enforces."""

    hourly_usd: float
    """What the whole cluster costs per hour."""
    started_at: float
    """When the cluster came up (epoch seconds): cost accrues from here."""
    max_total_usd: float | None = None
    """Power off before the accrued cost crosses this."""
    idle_minutes: float | None = None
    """Power off after this long with no job and idle GPUs."""
    interval_s: float = 30.0
    """Seconds between checks."""


@dataclass(frozen=True)
class Decision:
    """The outcome of one check."""

    stop: bool
    """Whether to power the cluster off."""
    reason: str
    """Why (or what was seen)."""
    accrued_usd: float
    """The cost so far."""
    idle_s: float
    """Seconds without a job or GPU work."""


def running_run_id(job_file: Path) -> str | None:
    """The run id recorded by `fab`'s launch (`PID RUN_ID TASK`), if its job is alive."""
    if not job_running(job_file):
        return None
    try:
        return job_file.read_text().split()[1]
    except (OSError, IndexError):
        return None


def job_progress(progress_dir: Path, run_id: str) -> tuple | None:
    """What the run's live ranks on this node have done so far: per rank, the collectives each
    process group completed and the harness's step (from their monitors, node/rankhook/). Two
    equal values mean no progress in between; None when no live rank reports (then nothing is known:
    torchrun starting its workers, or tearing down after they ended, is not a stall)."""
    done = []
    for path in sorted((progress_dir / run_id).glob(contract.RANK_PROGRESS_GLOB)):
        if path.name.endswith(contract.DUMP_SUFFIX):
            continue
        try:
            record = json.loads(path.read_text())
            if not procfs.alive(int(record["pid"])):
                continue
            groups = tuple(sorted((name, int(g["completed"])) for name, g in record.get("groups", {}).items()))
            done.append((int(record["rank"]), groups, record.get("step")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being replaced, or damaged: judged at the next check
    return tuple(done) or None


def job_running(job_file: Path) -> bool:
    """The job recorded by `fab`'s launch is alive (zombies count as gone)."""
    try:
        pid = int(job_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    return procfs.alive(pid)


def runs_queued(conf: Path | None = None) -> bool:
    """Whether a run waits in the cluster's Slurm queue (`fab bootstrap --scheduler slurm`): a queued run
    is activity, as a running one is. False where this node has no scheduler or Slurm does not answer."""
    conf = conf or Path(os.path.expanduser(f"~/{contract.SLURM_CONF}"))
    if not conf.exists():
        return False
    try:
        found = subprocess.run(
            ["squeue", "--noheader", "--states=PENDING,CONFIGURING,REQUEUED,REQUEUE_HOLD", "--format=%i"],
            env={**os.environ, "SLURM_CONF": str(conf)},
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.returncode == 0 and bool(found.stdout.strip())


def lock_held(lock_file: Path, locks_table: Path = Path("/proc/locks")) -> bool:
    """Someone holds the flock on `lock_file`: a launch owns the cluster (syncing a project, installing
    its requirements, starting its ranks) before its job is recorded. Read from the kernel's lock
    table, so the check never takes the lock itself and can never turn a launch away."""
    try:
        info = lock_file.stat()
        table = locks_table.read_text()
    except OSError:
        return False
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    return any(
        len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where
        for fields in (line.split() for line in table.splitlines())
    )


class Watchdog:
    """Checks the guards; the clock and the activity probes are injectable, for tests."""

    def __init__(
        self,
        guards: Guards,
        shared_dir: Path,
        job_file: Path,
        clock=time.time,
        gpus_are_busy=gpus_busy,
        progress_dir: Path | None = None,
        job_lock: Path | None = None,
        runs_are_queued=None,
    ):
        self.guards, self.shared_dir, self.job_file = guards, shared_dir, job_file
        self.job_lock = job_lock or job_file.with_name(Path(contract.JOB_LOCK).name)
        self.clock, self.gpus_are_busy = clock, gpus_are_busy
        self.runs_are_queued = runs_are_queued or runs_queued
        self.progress_dir = progress_dir or Path(os.path.expanduser(PROGRESS_DIR))
        self.last_active = clock()
        self.last_progress: tuple | None = None
        self.stalled_run: str | None = None

    def check(self) -> Decision:
        now, g = self.clock(), self.guards
        accrued = billing.cost_usd(g.hourly_usd, max(0.0, now - g.started_at))
        self.note_activity(now)
        idle_s = now - self.last_active
        if g.max_total_usd is not None:
            at_next_check = accrued + billing.cost_usd(g.hourly_usd, g.interval_s)
            if at_next_check >= g.max_total_usd:
                return Decision(
                    True,
                    f"budget: ${accrued:.2f} spent of maxTotalUsd ${g.max_total_usd:g} at ${g.hourly_usd:.3f}/h",
                    accrued,
                    idle_s,
                )
        if g.idle_minutes is not None and idle_s >= g.idle_minutes * 60:
            if self.stalled_run:
                return Decision(
                    True,
                    f"stalled: job {self.stalled_run} made no progress (no collective completed, "
                    f"no training step) for {idle_s / 60:.1f} min (idleMinutes {g.idle_minutes:g})",
                    accrued,
                    idle_s,
                )
            return Decision(
                True,
                f"idle: no job and idle GPUs for {idle_s / 60:.1f} min (idleMinutes {g.idle_minutes:g})",
                accrued,
                idle_s,
            )
        return Decision(False, "within budget" if g.max_total_usd is not None else "active", accrued, idle_s)

    def note_activity(self, now: float) -> None:
        """A job that makes progress, or (with no job, or one whose ranks report nothing) a running job,
        a launch under way (the job lock held) or busy GPUs, counts as activity. A job whose ranks report
        the same progress as before does not: it is stalled, however busy its GPUs spin (a hung NCCL
        collective keeps them at 100%)."""
        run_id = running_run_id(self.job_file)
        progress = job_progress(self.progress_dir, run_id) if run_id else None
        if progress is not None:
            if (run_id, progress) != self.last_progress:
                self.last_progress, self.last_active = (run_id, progress), now
            self.stalled_run = run_id
            return
        self.stalled_run = None
        if (
            run_id
            or job_running(self.job_file)
            or lock_held(self.job_lock)
            or self.gpus_are_busy()
            or self.runs_are_queued()
        ):
            self.last_active = now

    def heartbeat(self, decision: Decision) -> None:
        _write_json(
            self.shared_dir / contract.WATCHDOG_HEARTBEAT,
            {
                "pid": os.getpid(),
                "checked_at": self.clock(),
                "accrued_usd": decision.accrued_usd,
                "idle_s": decision.idle_s,
                "guards": asdict(self.guards),
            },
        )

    def power_off(self, decision: Decision) -> None:
        """Stop this node's job, then write the marker every node's guard powers off on."""
        _stop_job(self.job_file)
        _write_json(
            self.shared_dir / contract.STOP_MARKER,
            {
                "reason": decision.reason,
                "at": self.clock(),
                "accrued_usd": round(decision.accrued_usd, 4),
                "by": "watchdog",
                "node": os.environ.get(contract.NODE_VARIABLE, "node-0"),
            },
        )

    def run(self) -> Decision:
        while True:
            decision = self.check()
            self.heartbeat(decision)
            if decision.stop:
                print(f"watchdog: powering the cluster off: {decision.reason}", flush=True)
                self.power_off(decision)
                return decision
            time.sleep(self.guards.interval_s)


def _stop_job(job_file: Path) -> None:
    if not job_running(job_file):
        return
    pid = int(job_file.read_text().split()[0])
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        pass


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def check_interval_s(idle_minutes: float | None) -> float:
    """Often enough for the idle guard to be prompt, at most every 30 s."""
    if idle_minutes is None:
        return 30.0
    return max(1.0, min(30.0, idle_minutes * 60 / 6))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared-dir", type=Path, required=True, help="the folder every node shares")
    parser.add_argument("--hourly-usd", type=float, required=True, help="the whole cluster's price per hour")
    parser.add_argument("--started-at", type=float, required=True, help="when the cluster came up (epoch seconds)")
    parser.add_argument("--max-total-usd", type=float, default=None, help="power off before spending this")
    parser.add_argument("--idle-minutes", type=float, default=None, help="power off after this long idle")
    parser.add_argument("--interval-s", type=float, default=None, help="seconds between checks (default: derived)")
    parser.add_argument("--job-file", default=JOB_FILE, help=f"the job record of fab launches (default {JOB_FILE})")
    parser.add_argument(
        "--progress-dir",
        default=PROGRESS_DIR,
        help=f"where the ranks of fab launches record their progress (default {PROGRESS_DIR})",
    )
    args = parser.parse_args(argv)
    if args.max_total_usd is None and args.idle_minutes is None:
        parser.error("nothing to guard: give --max-total-usd and/or --idle-minutes")
    guards = Guards(
        args.hourly_usd,
        args.started_at,
        args.max_total_usd,
        args.idle_minutes,
        args.interval_s or check_interval_s(args.idle_minutes),
    )
    print(f"watchdog: guarding {asdict(guards)}", flush=True)
    Watchdog(
        guards,
        args.shared_dir,
        Path(os.path.expanduser(args.job_file)),
        progress_dir=Path(os.path.expanduser(args.progress_dir)),
    ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
