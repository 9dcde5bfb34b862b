"""A job's own packages (`fab run --requirements FILE`): one venv per requirements file, made once.

    InstallRequirements (node/calls.py)                         # the launch asks, before any rank starts
    NODE_PYTHON job_env.py --job DEST REQUIREMENTS LOG [CWD]    # a job's own step: quiet where DEST is ready

Run by the node venv's interpreter, it makes DEST a venv layered over that interpreter as bootstrap
layers the node venv (python_env.py: `--system-site-packages` plus a `.pth` naming every folder the
node venv sees), so torch and the rest are found, not installed again. uv installs REQUIREMENTS into
it (pip where uv cannot run, saying why: node/uv_env.py), from CWD (the synced workdir: relative paths
in the file, such as `--find-links wheels`, are the project's), its output going to LOG, with the
node-local uv cache. DEST/.installed is written only after the install succeeded, naming the
interpreter it is layered over; where it is there and names this one, nothing is done. One maker at a
time per environment (`DEST.lock`): the launch that installs it and a queued run's job that finds it
missing on a replaced node (`--job`, from the run's staged requirements) may meet. `--job` prints for
the run's log: nothing where the environment is ready, else a line before and after the install (the error in
one line, exit 1, where it failed). Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, python_env, uv_env  # noqa: E402

READY = contract.ENV_READY


def ready(dest: str) -> bool:
    try:
        with open(os.path.join(dest, READY)) as f:
            return f.read().strip() == sys.executable
    except OSError:
        return False


def error_line(log: str) -> str:
    """pip's own summary of what went wrong: its last `ERROR:` line, else its last line."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no output"
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def install(dest: str, requirements: str, log: str, cwd: str) -> dict:
    python_env.create(dest)
    python_env.write_layer(dest)
    python = os.path.join(dest, "bin", "python")
    cache = os.path.join(os.path.expanduser("~"), contract.UV_CACHE)
    with open(log, "w") as out:
        try:
            how = uv_env.install(python, requirements, cwd, out, cache, python_env.ensure_pip)
        except subprocess.CalledProcessError:
            return {"ok": False, "error": error_line(log), "log": log}
    with open(os.path.join(dest, READY), "w") as f:
        f.write(sys.executable + "\n")
    return {"ok": True, "installed": True, "python": python, **how}


def ensure(dest: str, requirements: str, log: str, cwd: str) -> dict:
    """The environment, made where it is not ready, under its lock."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(f"{dest}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(dest):
            return {"ok": True, "installed": False, "python": os.path.join(dest, "bin", "python")}
        started = time.monotonic()
        try:
            outcome = install(dest, requirements, log, cwd)
        except SystemExit as exc:  # ensure_pip says why pip cannot be had
            outcome = {"ok": False, "error": str(exc.code), "log": log}
        except (OSError, subprocess.SubprocessError) as exc:
            outcome = {"ok": False, "error": str(exc), "log": log}
        outcome["seconds"] = round(time.monotonic() - started, 1)
        return outcome


def _paths(dest: str, requirements: str, log: str, cwd: str) -> tuple:
    """Absolute paths (a relative one is from home); CWD where it is a folder, else home."""
    dest, requirements, log = (os.path.abspath(os.path.expanduser(arg)) for arg in (dest, requirements, log))
    cwd = os.path.expanduser(cwd) if cwd and os.path.isdir(os.path.expanduser(cwd)) else os.path.expanduser("~")
    return dest, requirements, log, cwd


def ensure_reply(dest: str, requirements: str, log: str, cwd: str = "") -> dict:
    outcome = ensure(*_paths(dest, requirements, log, cwd))
    keys = ("ok", "installed", "python", "error", "seconds", "installer", "installer_why")
    return {key: outcome[key] for key in keys if key in outcome}


def installer_note(outcome: dict) -> str:
    """` with uv`, or ` with pip (no uv on this node)`: said beside an install."""
    if not outcome.get("installer"):
        return ""
    why = outcome.get("installer_why")
    return f" with {outcome['installer']}" + (f" ({why})" if why else "")


def main(argv: list) -> int:
    if argv[:1] != ["--job"] or len(argv) not in (4, 5):
        sys.exit("usage: NODE_PYTHON job_env.py --job DEST REQUIREMENTS LOG [CWD]")
    dest, requirements, log, cwd = _paths(argv[1], argv[2], argv[3], argv[4] if len(argv) == 5 else "")
    if not ready(dest):
        print(
            f"gpu-cluster: installing the run's requirements into {dest} (the installer's output in {log})", flush=True
        )
    outcome = ensure(dest, requirements, log, cwd)
    if not outcome["ok"]:
        print(f"error: the run's requirements could not be installed: {outcome['error']} (the installer's log: {log})")
    elif outcome["installed"]:
        print(f"gpu-cluster: requirements installed in {outcome['seconds']} s{installer_note(outcome)}", flush=True)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
