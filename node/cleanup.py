"""What `deploy.py down` runs on each of the `ssh` provider's hosts: stop the job and the watchdog,
then remove everything bootstrap put there. The machine itself is left running.

    python3 - HOME_DIR [SYNCED_CODE_DIR TOP...] < cleanup.py     # sent on stdin; prints one JSON object

HOME_DIR is the node's state folder (`~/.gpu-cluster`); SYNCED_CODE_DIR, where the cluster has a shared
folder, the code folder in it, of which only the synced TOP folders are removed (a user's own files
beside them stay). Standard library only; needs nothing that bootstrap installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
UNIT = "gpu-cluster-watchdog"
UNIT_FILE = f"/etc/systemd/system/{UNIT}.service"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[2] == str(pgid) and fields[0] != "Z":
                return True
    return False


def end_group(pgid: int) -> bool:
    """SIGTERM a process group, SIGKILL it after the grace period; True if there was one."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + GRACE_S
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    return True


def processes_with(entry: str) -> list:
    """This user's processes whose environment holds `entry` (others' are unreadable anyway)."""
    needle, found = entry.encode(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


def stop_job(home_dir: str) -> str:
    try:
        with open(os.path.join(home_dir, "job")) as f:
            pid, run_id = f.read().split()[:2]
    except (OSError, ValueError):
        return "idle"
    stopped = alive(int(pid)) and end_group(int(pid))
    for leftover in processes_with(f"CLUSTER_RUN_ID={run_id}"):  # workers in sessions of their own
        try:
            os.kill(leftover, signal.SIGKILL)
            stopped = True
        except OSError:
            pass
    return f"stopped {run_id}" if stopped else "idle"


def stop_daemons(home_dir: str) -> list:
    ended = []
    registry = os.path.join(home_dir, "pids")
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
    report = {"job": stop_job(home_dir), "daemons": stop_daemons(home_dir), "removed": []}
    if len(argv) > 2:
        report["removed"] += remove_code(argv[1], argv[2:])
    if os.path.isdir(home_dir):
        shutil.rmtree(home_dir, ignore_errors=True)
        report["removed"].append(home_dir)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
