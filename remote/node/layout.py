"""The node's files under `~/.gpu-cluster`: the one place that spells them.

Paths are relative to the login user's home, as SFTP takes them; `shell()` gives the `~/...` form
for commands. Standard library only: bootstrap, `fab` and `deploy.py down` import it on the operator's
machine, and it is shipped to the nodes with the rest of `remote/node/`.
"""

HOME_DIR = ".gpu-cluster"
ENV = f"{HOME_DIR}/env"
"""The node environment every job sources (written by bootstrap's env stage)."""
STATE = f"{HOME_DIR}/state.json"
"""Each bootstrap stage's digest and facts on this node."""
JOB = f"{HOME_DIR}/job"
"""`PID RUN_ID TASK` of the job running on this node (its session leader)."""
JOB_LOCK = f"{HOME_DIR}/job.lock"
"""flock'd on the head node by the launch that owns the cluster's one job (remote/node/job_lock.py)."""
PIDS = f"{HOME_DIR}/pids"
"""Daemons started on the node register `<name>.pid` (a process group id) here."""
VENV = f"{HOME_DIR}/venv"
"""The node venv, layered over the inventory's `python`."""
REQUIREMENTS = f"{HOME_DIR}/requirements-node.txt"
"""What the venv installs where torch is missing."""
CODE = f"{HOME_DIR}/code"
"""harness/, examples/ and remote/node/, where the cluster has no shared folder."""
RUNS = f"{HOME_DIR}/runs"
"""Run folders, where the cluster has no shared folder."""
PROGRESS = f"{HOME_DIR}/progress"
"""`<run-id>/rank-<R>.json`: each rank's collective progress, for hang detection (always node-local)."""
WATCHDOG_PID = f"{PIDS}/watchdog.pid"
"""The detached watchdog's process group."""
WATCHDOG_LOG = f"{HOME_DIR}/watchdog.log"
"""The detached watchdog's output."""
WATCHDOG_UNIT = "gpu-cluster-watchdog"
"""The systemd unit of the watchdog, where the node runs systemd."""
WATCHDOG_UNIT_FILE = f"{HOME_DIR}/{WATCHDOG_UNIT}.service"
"""The unit file as sent, before it is installed into /etc/systemd/system."""
SYNCED = ("harness", "examples", "remote/node")
"""The code folders bootstrap syncs (relative to the repository and to the code folder)."""


def shell(path: str) -> str:
    """`path` (relative to the home) for a shell command: `~/` expands, nothing else does."""
    return f"~/{path}"
