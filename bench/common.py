"""What every benchmark returns, and helpers to run the real CLIs in a scratch state folder."""

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Check:
    """One measured requirement."""

    measure: str
    """What was measured."""
    figure: str
    """The measured figure, as printed."""
    requirement: str
    """What it must be."""
    ok: bool
    """Whether the figure meets the requirement."""


def scratch_env() -> dict[str, str]:
    """The environment for CLI runs: a private `.cluster/`, loopback gloo, one thread per rank."""
    env = dict(os.environ)
    env.update(
        CLUSTER_STATE_DIR=tempfile.mkdtemp(prefix="gpu-cluster-bench-"),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("CLUSTER_STACK", None)
    return env


def cli(argv: list[str], env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def deploy(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return cli([sys.executable, "deploy.py", *args], env, check)


def fab(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return cli([str(Path(sys.executable).with_name("fab")), *args], env, check)


def started(argv: list[str], env: dict[str, str], stderr=subprocess.STDOUT) -> subprocess.Popen:
    """`argv` started from the repository, its output (stderr merged in, unless told) read as text as it comes."""
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


def fab_started(*args: str, env: dict[str, str], stderr=subprocess.STDOUT) -> subprocess.Popen:
    return started([str(Path(sys.executable).with_name("fab")), *args], env, stderr)


def median(values: list[float]) -> float:
    return statistics.median(values)


def torchrun(script: str, *args: str, env: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess:
    """A 2-rank torchrun job on this machine (c10d rendezvous on localhost)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return cli(argv, env)


def summary(run_dir: Path, kind: str = "summary") -> dict:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind][-1]


def bootstrapped_local_cluster(scheduler: str) -> dict[str, str]:
    """A bootstrapped 2-node local cluster in a scratch state folder, its runs held as `scheduler` says
    (`slurm` or `none`); its environment for the CLIs."""
    from tests.support import slurm
    from tests.support.network import free_endpoint

    env = scratch_env()
    address, port = free_endpoint(2)
    deploy("up", "--local", "--nodes", "2", "--bind", address, "--ssh-port", str(port), env=env)
    fab("bootstrap", "--master-port", str(slurm.free_ports()), "--scheduler", scheduler, env=env)
    return env


def without_slurm() -> bool:
    """Whether Slurm cannot run here (it says why): a bench that needs it then measures nothing."""
    from tests.support import slurm

    why = slurm.unavailable()
    if why:
        print(f"skipped: {why}")
    return bool(why)
