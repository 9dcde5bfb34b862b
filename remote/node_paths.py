"""Where things are on a node, as the shell spells them: the stack's folders (on the shared storage
or under each node's ~/.gpu-cluster), a run's folders, the synced code, and paths quoted so that a
leading $HOME or $CLUSTER_CODE_DIR still expands. Pure functions; nothing here talks to a node."""

import shlex
from pathlib import Path

from infra.inventory import ClusterInfo
from node import contract

STATE_DIR = contract.shell(contract.HOME_DIR)
ENV_FILE = contract.shell(contract.ENV)
STATE_FILE = contract.shell(contract.STATE)
JOB_FILE = contract.shell(contract.JOB)
LOCK_FILE = contract.shell(contract.JOB_LOCK)
NODE_CODE = Path(__file__).resolve().parent.parent / "node"


def shared_or_home(cluster: ClusterInfo, folder: str) -> str:
    """A folder on the shared storage, or under each node's `~/.gpu-cluster` where the cluster has none."""
    if cluster.shared_dir:
        return f"{cluster.shared_dir.rstrip('/')}/{folder}"
    return contract.in_home(f"{contract.HOME_DIR}/{folder}")


def code_dir(cluster: ClusterInfo) -> str:
    return shared_or_home(cluster, "code")


def remote_run_dir(cluster: ClusterInfo, run_id: str) -> str:
    return shared_or_home(cluster, f"runs/{run_id}")


def run_stage(cluster: ClusterInfo, run_id: str) -> str | None:
    """A queued run's stage on the shared folder (`contract.RUN_STAGE`); None where the cluster has none."""
    return f"{remote_run_dir(cluster, run_id)}/{contract.RUN_STAGE}" if cluster.shared_dir else None


def node_module(cluster: ClusterInfo, python: str, module: str, *args: str) -> str:
    """Run one of node/'s files with `python`, from the synced code folder."""
    path = shell_path(f"{code_dir(cluster)}/node/{module}.py")
    return " ".join([shlex.quote(python), path, *map(shlex.quote, args)])


def node_run_dir(run_id: str) -> str:
    """The run's folder on each node's own disk (contract.RUNS)."""
    return contract.in_home(contract.node_run(run_id))


def job_workdir(run_id: str) -> str:
    """The job's working directory on each node: its own copy of the workdir, or an empty folder."""
    return f"{node_run_dir(run_id)}/{contract.RUN_WORKDIR}"


def results_dir(run_id: str) -> str:
    """`$CLUSTER_RESULTS_DIR`: node-local; what the head node's holds is fetched after the run."""
    return f"{node_run_dir(run_id)}/{contract.RUN_RESULTS}"


def python_path(run_id: str, first: tuple[str, ...] = ()) -> list[str]:
    """PYTHONPATH of the job, first to last, before the node's own: `first` (the hang watch's rank
    hook, whose sitecustomize must be found before any other), the workdir, then the synced code."""
    return [*first, job_workdir(run_id), "$CLUSTER_CODE_DIR"]


def shell_path(path: str) -> str:
    """Quote a path for the shell but leave a leading $HOME or $CLUSTER_CODE_DIR to be expanded."""
    for variable in ("$HOME", "$CLUSTER_CODE_DIR"):
        if path == variable:
            return f'"{variable}"'
        if path.startswith(variable + "/"):
            return f'"{variable}"/' + shlex.quote(path[len(variable) + 1 :])
    return shlex.quote(path)
