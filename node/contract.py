"""The node's files under `~/.gpu-cluster`: the one place that spells them.

Paths are relative to the login user's home, as SFTP takes them; `shell()` gives the `~/...` form
for commands. Standard library only: bootstrap, `fab` and `deploy.py down` import it on the operator's
machine, and it is shipped to the nodes with the rest of `node/`.
"""

HOME_DIR = ".gpu-cluster"
ENV = f"{HOME_DIR}/env"
"""The node environment every job sources (written by bootstrap's env stage)."""
STATE = f"{HOME_DIR}/state.json"
"""Each bootstrap stage's digest and facts on this node."""
JOB = f"{HOME_DIR}/job"
"""`PID RUN_ID TASK` of the job running on this node (its session leader)."""
JOB_LOCK = f"{HOME_DIR}/job.lock"
"""flock'd on the head node by the launch that owns the cluster's one job (node/job_lock.py)."""
PIDS = f"{HOME_DIR}/pids"
"""Daemons started on the node register `<name>.pid` (a process group id) here."""
VENV = f"{HOME_DIR}/venv"
"""The node venv, layered over the inventory's `python`."""
REQUIREMENTS = f"{HOME_DIR}/requirements-node.txt"
"""What the venv installs where torch is missing."""
CODE = f"{HOME_DIR}/code"
"""harness/, examples/ and node/, where the cluster has no shared folder."""
RUNS = f"{HOME_DIR}/runs"
"""Each run's node-local folder, on every node: `<run-id>/workdir` (the job's working directory) and
`<run-id>/results` (`$CLUSTER_RESULTS_DIR`); also the run folder itself where there is no shared folder."""
WORKDIRS = f"{HOME_DIR}/workdirs"
"""`fab run --workdir` caches, one per project folder: `<key>/files/`, `manifest.json` and `digest`."""
ENVS = f"{HOME_DIR}/envs"
"""`fab run --requirements` environments, one per requirements file: `<digest>/` (a venv), with
`<digest>.txt` (the file) and `<digest>.log` (pip's output) beside it."""
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
SYNCED = ("harness", "examples", "node")
"""The code folders bootstrap syncs (relative to the repository and to the code folder)."""


def node_run(run_id: str) -> str:
    """A run's node-local folder."""
    return f"{RUNS}/{run_id}"


def workdir_cache(key: str) -> str:
    """The cache of one project folder (`remote/workdir.py` names the key)."""
    return f"{WORKDIRS}/{key}"


def job_env(digest: str) -> str:
    """The environment of one requirements file."""
    return f"{ENVS}/{digest}"


ENV_READY = ".installed"
"""In a requirements environment: written only after pip succeeded; holds the interpreter it is layered over."""
WORKDIR_FILES = "files"
"""In a workdir cache: the synced files."""
WORKDIR_MANIFEST = "manifest.json"
"""In a workdir cache: {path: sha256} of the files, written after a sync completes."""
WORKDIR_DIGEST = "digest"
"""In a workdir cache: the manifest's digest, which a launch's first command reads."""


def shell(path: str) -> str:
    """`path` (relative to the home) for a shell command: `~/` expands, nothing else does."""
    return f"~/{path}"
