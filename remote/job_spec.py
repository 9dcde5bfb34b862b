"""What a launch is given, whichever holder runs it: the job (`JobSpec`, from a fab task's options) and what
bootstrap found on the nodes (`NodeSetup`, from `.cluster/<stack>/bootstrap.json`)."""

from dataclasses import dataclass, field
from pathlib import Path

from infra import state
from infra.errors import UsageError
from remote.hangwatch import HangPolicy
from remote.packages import Requirements
from remote.workdir import Project

DEFAULT_MAX_RESULT_MB = 50


@dataclass(frozen=True)
class JobSpec:
    """What to run on every node."""

    task: str
    """The fab task (or `health` for bootstrap's all-reduce check)."""
    script: str
    """The script torchrun starts: a path in the synced code folder, e.g. examples/ddp_training.py."""
    args: list[str] = field(default_factory=list)
    """Arguments for the script."""
    max_restarts: int = 0
    """torchrun --max-restarts: how often a failed worker group is restarted."""
    upload: Path | None = None
    """A local script to copy into the run folder first (`fab run --script`)."""
    nproc_per_node: int | None = None
    """Processes per node (`--nproc-per-node`); None: one per GPU, one on CPU nodes."""
    hang: HangPolicy = HangPolicy()
    """When a job counts as hung, and what to do then (`--hang-timeout`, `--on-hang`)."""
    workdir: Project | None = None
    """A project folder to sync and run in (`fab run --workdir`); `script` is then relative to it."""
    requirements: Requirements | None = None
    """Packages the job needs beyond the node venv (`fab run --requirements`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables for every rank, taken literally (`fab run --env`)."""
    max_result_bytes: int = DEFAULT_MAX_RESULT_MB * 1_000_000
    """A fetched file bigger than this stays on the head node (`--max-result-mb`)."""
    replicas: int = 0
    """torchft replica groups (`--replicas`): each a torchrun job of its own, so one that fails leaves the
    others training; 0: one job over every node, stopped everywhere at the first failure."""


@dataclass(frozen=True)
class NodeSetup:
    """What bootstrap found on the nodes and launches need (`.cluster/<stack>/bootstrap.json`)."""

    master_port: int
    """MASTER_PORT of the rendezvous on node-0."""
    python: dict[str, str]
    """The interpreter with torch on each node."""
    homes: dict[str, str] = field(default_factory=dict)
    """Each node user's home (the probe's), for absolute paths on the nodes."""
    scheduler_why: str = ""
    """Why bootstrap's `--scheduler auto` left the runs to fab (one line), '' where it did not."""
    slurm_holds: bool = False
    """Slurm holds the runs (`holders.SlurmHolder`), else fab's connections do."""

    @classmethod
    def load(cls, stack: str) -> "NodeSetup":
        record = state.bootstrap_record(stack)
        if record.master_port is None or not record.python:
            raise UsageError("the cluster is not bootstrapped: run fab bootstrap")
        return cls(record.master_port, record.python, record.homes, record.scheduler_why, record.slurm_holds)
