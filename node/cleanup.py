"""What `deploy.py down` runs on each of the `ssh` provider's hosts: stop the job and the watchdog,
then remove everything bootstrap put there. The machine itself is left running.

    python3 - HOME_DIR [SYNCED_CODE_DIR TOP...] < cleanup.py     # sent on stdin; prints one JSON object

HOME_DIR is the node's state folder (`~/.gpu-cluster`); SYNCED_CODE_DIR, where the cluster has a shared
folder, the code folder in it, of which only the synced TOP folders are removed (a user's own files
beside them stay). Standard library only; needs nothing that bootstrap installed.

Sent on stdin (nothing is written on the host, whose Python may be older than the project needs), it
cannot import its siblings from a folder: the sender inlines the `from node import ...` line's modules
(node/standalone.py), which, like this file, parse on Python 3.7.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from node import contract, procfs

GRACE_S = 5.0
UNIT = contract.WATCHDOG_UNIT
UNIT_FILE = f"/etc/systemd/system/{UNIT}.service"


def end_group(pgid: int) -> bool:
    """SIGTERM a process group, SIGKILL it after the grace period; True if there was one."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + GRACE_S
    while procfs.group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    return True


def stop_job(home_dir: str) -> str:
    try:
        with open(os.path.join(home_dir, os.path.relpath(contract.JOB, contract.HOME_DIR))) as f:
            pid, run_id = f.read().split()[:2]
    except (OSError, ValueError):
        return "idle"
    stopped = procfs.alive(int(pid)) and end_group(int(pid))
    workers = procfs.pids_with_environment(f"{contract.RUN_ID_VARIABLE}={run_id}")  # in sessions of their own
    for leftover in workers:
        try:
            os.kill(leftover, signal.SIGKILL)
            stopped = True
        except OSError:
            pass
    return f"stopped {run_id}" if stopped else "idle"


def cancel_existing_runs(home_dir: str, code_dir: str) -> list:
    """Where runs went to a Slurm the hosts already ran, this stack's jobs there (queued ones would
    start after down, with nothing left to run): scheduler.py's `stop`, with the node venv bootstrap made.
    RuntimeError, saying why, where they could not be cancelled."""
    if not os.path.exists(os.path.join(home_dir, os.path.relpath(contract.SLURM_EXISTING, contract.HOME_DIR))):
        return []
    python = os.path.join(home_dir, os.path.relpath(contract.VENV, contract.HOME_DIR), "bin", "python")
    script = os.path.join(code_dir, "node", "scheduler.py")
    try:
        result = subprocess.run([python, script, "stop"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(str(exc)) from None
    if result.returncode != 0:
        raise RuntimeError(result.stderr.decode(errors="replace").strip()[-200:] or "exit %d" % result.returncode)
    words = result.stdout.decode(errors="replace").split()
    return words[words.index("cancelled") + 1 :] if "cancelled" in words else []


def stop_daemons(home_dir: str) -> list:
    ended = []
    registry = os.path.join(home_dir, os.path.relpath(contract.PIDS, contract.HOME_DIR))
    for name in sorted(os.listdir(registry)) if os.path.isdir(registry) else []:
        try:
            with open(os.path.join(registry, name)) as f:
                pgid = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if end_group(pgid):
            ended.append(name[: -len(".pid")] if name.endswith(".pid") else name)
    if os.path.exists(UNIT_FILE):
        sudo = ["sudo", "-n"] if os.geteuid() != 0 else []
        for argv in (["systemctl", "disable", "--now", UNIT], ["rm", "-f", UNIT_FILE], ["systemctl", "daemon-reload"]):
            subprocess.run(sudo + argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ended.append(f"{UNIT}.service")
    return ended


def remove_code(code_dir: str, tops: list) -> list:
    removed = []
    for top in tops:
        path = os.path.join(code_dir, top)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for top in sorted({t.split("/")[0] for t in tops}) + [""]:  # folders left empty, then the code folder
        try:
            os.rmdir(os.path.join(code_dir, top) if top else code_dir)
        except OSError:
            pass
    return removed


def main(argv: list) -> None:
    if not argv:
        sys.exit("usage: cleanup.py HOME_DIR [SYNCED_CODE_DIR TOP...]")
    home_dir = os.path.expanduser(argv[0])
    removed = []  # type: list[str]
    code_dir = argv[1] if len(argv) > 2 else os.path.join(home_dir, os.path.relpath(contract.CODE, contract.HOME_DIR))
    try:
        cancelled = cancel_existing_runs(home_dir, code_dir)
    except RuntimeError as exc:  # nothing removed: down keeps the stack and can be run again
        print(json.dumps({"error": "could not cancel this stack's jobs in the existing Slurm: %s" % exc}))
        return
    report = {"job": stop_job(home_dir), "daemons": stop_daemons(home_dir), "removed": removed}
    if cancelled:
        report["cancelled"] = cancelled
    if len(argv) > 2:
        removed += remove_code(argv[1], argv[2:])
    if os.path.isdir(home_dir):
        shutil.rmtree(home_dir, ignore_errors=True)
        removed.append(home_dir)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
