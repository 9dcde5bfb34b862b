"""Local clusters made by the real `deploy.py up --local`, and what tests look at on them: their
processes, a run's id and metrics."""

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env, run_cli, run_fab
from tests.support.network import free_endpoint, free_port


@dataclass
class LocalCluster:
    """A running local cluster made by the real `deploy.py up --local`."""

    stack: str
    state_dir: Path
    inventory: dict

    @property
    def stack_dir(self) -> Path:
        return self.state_dir / self.stack


def start_local_cluster(stack: str, state_dir: Path, nodes: int = 2, *extra: str) -> LocalCluster:
    address, port = free_endpoint(nodes)
    run_cli(
        "up",
        "--local",
        "--stack",
        stack,
        "--nodes",
        str(nodes),
        "--bind",
        address,
        "--ssh-port",
        str(port),
        *extra,
        check=True,
    )
    inventory = json.loads((state_dir / stack / "inventory.json").read_text())
    return LocalCluster(stack, state_dir, inventory)


class Cluster:
    """A local cluster that tests share, with its own state folder."""

    def __init__(self, state_dir: Path, stack: str = "local", master_port: int | None = None, up_args=()):
        self.state_dir, self.stack = state_dir, stack
        self.env = {"CLUSTER_STATE_DIR": str(state_dir)}
        self.info = start_local_cluster_in(state_dir, stack, *up_args)
        self.master_port = master_port or free_port()

    def fab(self, *args: str, **kwargs):
        return run_fab(*args, **self.env, **kwargs)

    def cli(self, *args: str):
        return run_cli(*args, **self.env)

    def popen_fab(self, *args: str, stderr=subprocess.STDOUT, text: bool = True) -> subprocess.Popen:
        """fab running; `text=False` gives its output as bytes, as they come (unfinished lines too)."""
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("fab")), *args],
            cwd=REPO,
            env=child_env(**self.env),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=text,
        )

    def runs(self) -> list[Path]:
        return sorted((self.state_dir / self.stack / "runs").glob("*"))

    def run_dir(self, output: str) -> Path:
        """The local run folder of the launch that printed `output`."""
        return self.state_dir / self.stack / "runs" / run_id_in(output)

    def down(self):
        self.cli("down", "--stack", self.stack)


def start_local_cluster_in(state_dir: Path, stack: str, *up_args: str) -> dict:
    old = os.environ.get("CLUSTER_STATE_DIR")
    os.environ["CLUSTER_STATE_DIR"] = str(state_dir)
    try:
        return start_local_cluster(stack, state_dir, 2, *up_args).inventory
    finally:
        if old is None:
            os.environ.pop("CLUSTER_STATE_DIR")
        else:
            os.environ["CLUSTER_STATE_DIR"] = old


@contextmanager
def bootstrapped_cluster(
    tmp_path_factory, name: str, *bootstrap_args: str, master_port: int | None = None, up_args=(), scheduler="none"
):
    """A 2-node local cluster, bootstrapped, that a module's tests share; `down` afterwards, pass or fail.
    `scheduler`: bootstrap's --scheduler (none: runs held by fab; None: the default, auto)."""
    handle = Cluster(tmp_path_factory.mktemp(name) / "state", master_port=master_port, up_args=up_args)
    # Slurm's accounting only where a test asks (`bootstrap_args`): MariaDB's first start is 4 to 17 s here.
    chosen = (("--scheduler", scheduler) if scheduler else ()) + (
        () if "--accounting" in bootstrap_args else ("--accounting", "none")
    )
    try:
        handle.first_bootstrap = handle.fab(
            "bootstrap", "--master-port", str(handle.master_port), *chosen, *bootstrap_args
        )
        assert handle.first_bootstrap.returncode == 0, handle.first_bootstrap.stdout + handle.first_bootstrap.stderr
        yield handle
    finally:
        handle.down()


def results_fetched_again(cluster: Cluster, run_dir: Path, name: str) -> str:
    """`fab results` of an ended run, whichever holder held it, with one expected outcome: its results folder,
    removed here, comes back (the text of `name` in it, returned); an unknown run is one line and exit 2."""
    shutil.rmtree(run_dir / "results")
    fetched = cluster.fab("results", "--run", run_dir.name)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert "fab: fetched " in fetched.stdout and str(run_dir) in fetched.stdout, fetched.stdout
    assert_one_line_error(cluster.fab("results", "--run", "no-such-run"), "no-such-run")
    return (run_dir / "results" / name).read_text()


def metrics_of(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def run_id_in(output: str) -> str:
    """The run id a launch announces (`fab: run <id>: ...`)."""
    return next(line.split()[2].rstrip(":") for line in output.splitlines() if line.startswith("fab: run "))


def run_processes(run_id: str) -> list[int]:
    """Processes of a run still alive anywhere on this machine (found by CLUSTER_RUN_ID)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"CLUSTER_RUN_ID={run_id}".encode() in environ.read_bytes().split(b"\0"):
                stat = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def processes_of(module: str, state_dir: Path) -> list[int]:
    """Live (non-zombie) processes running `python -m module` for this state dir."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if module.encode() in cmdline and str(state_dir).encode() in cmdline and stat[0] != "Z":
            pids.append(int(proc.name))
    return pids


def node_server_processes(state_dir: Path) -> list[int]:
    return processes_of("infra.providers.local.node_server", state_dir)


def fabric_connection(inventory: dict, node: dict):
    """A Fabric connection built only from the inventory (its key, its pinned host keys), as `fab` makes it."""
    from infra.inventory import ClusterInfo
    from remote.connect import connect

    cluster = ClusterInfo.from_dict(inventory)
    return connect(cluster, cluster.node(node["name"]))


# Run inside a rank (while its run's processes all live): how many processes on this machine carry
# `marker` in their arguments, as written or inside a base64 word (Slurm's spec travelled so).
CMDLINE_LEAKS = """
def cmdline_leaks(marker):
    import base64, binascii, os
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        decoded = []
        for word in words:
            try:
                decoded.append(base64.b64decode(word, validate=True))
            except (binascii.Error, ValueError):
                pass
        found += any(marker.encode() in w for w in words + decoded)
    return found
"""


def files_holding(marker: str, *folders: Path) -> list[Path]:
    """Every file under `folders` whose bytes hold `marker`."""
    return [p for f in folders for p in f.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]
