"""The ClusterInfo inventory: the one contract between provisioning and everything downstream.

A provider writes `.cluster/<stack>/inventory.json`; `fab`, `deploy.py status/ssh` and the tests read it.
Nodes are listed head node first: node-0 hosts rank 0 and `MASTER_ADDR`.
"""

import json
import stat
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from infra import state
from infra.errors import UsageError

DAEMONS = ("systemd", "detached")
DEFAULT_PYTHON = "python3"
DEFAULT_DAEMON = "detached"
# What an inventory written before `python`, `daemon` and `env` existed meant, by provider.
EARLIER_FACTS: dict[str, dict] = {
    "local": {"python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
    "aws": {"daemon": "systemd"},
}


@dataclass(frozen=True)
class NodeStatus:
    """What `status` found on one node, whichever provider asked (`deploy.py status --json`'s rows)."""

    name: str
    """node-<i>."""
    address: str
    """`public_ip:ssh_port`, as the operator connects."""
    state: str
    """up or down (local, own machines); the EC2 state on AWS (running, stopped, ...)."""
    reachable: bool
    """A real SSH round trip ran a command there."""
    round_trip_ms: float | None
    """That round trip, where one was tried."""
    uptime_s: float | None
    """How long the machine (or local node) has been up, where known."""
    error: str = ""
    """Why it is not reachable; empty when it is."""
    instance_id: str | None = None
    """AWS only: the EC2 instance."""
    scheduler: str | None = None
    """Where Slurm holds the runs (`fab bootstrap --scheduler slurm`): Slurm's state of the node (idle,
    allocated, down, ...), or what is wrong with its daemons; None where there is no scheduler."""
    scheduler_daemons: dict | None = None
    """With `scheduler`: this node's daemons of it (munged, slurmctld on the head, slurmd, spot-watch), each
    `up` or `down`."""
    scheduler_serves: bool = True
    """With `scheduler`: its daemons run, the controller answers, and the node can take a run."""

    def as_dict(self) -> dict:
        row = asdict(self)
        for optional in ("instance_id", "scheduler", "scheduler_daemons"):
            if row[optional] is None:
                del row[optional]
        if self.scheduler is None:
            del row["scheduler_serves"]
        return row


@dataclass(frozen=True)
class NodeInfo:
    """One machine of the cluster as SSH and torchrun see it."""

    name: str
    """`node-<i>`; the index is the node rank."""
    public_ip: str
    """Where the operator's machine reaches the node's SSH server."""
    private_ip: str
    """Where the other nodes reach it (`MASTER_ADDR` for node-0)."""
    ssh_port: int
    """The node's SSH port (22 on AWS, 2222 by default on the local provider)."""
    gpus: int
    """GPUs on the node; 0 for CPU nodes, which train with gloo."""
    ssh_user: str = ""
    """The login user on this node (hosts of the `ssh` provider may differ); filled from the cluster's."""
    slurm_name: str = ""
    """Its NodeName in a Slurm the hosts already ran (`slurm_existing`) where the hosts file names it; else
    bootstrap finds it (the node's address, then its host name)."""


@dataclass(frozen=True)
class ClusterInfo:
    """A running cluster: where its nodes are, how to log in, what it costs per hour."""

    stack: str
    """The stack name, also the folder under `.cluster/`."""
    provider: str
    """`local`, `aws` or `ssh` (infra/providers picks the implementation from it)."""
    region: str
    """AWS region, or `local`."""
    instance_type: str
    """The EC2 type the nodes are (for the local provider: the type its hours are compared with)."""
    hourly_usd: float
    """What the whole cluster costs per hour while it is up (0 for the local provider)."""
    ssh_user: str
    """The default login user (each node's `ssh_user` says where it differs)."""
    ssh_key: str
    """Absolute path of the cluster's private key (mode 0600)."""
    known_hosts: str
    """Absolute path of the pinned host keys; connections to unknown keys are refused."""
    shared_dir: str
    """The folder every node shares (EFS on AWS); empty when there is none."""
    created_at: str
    """ISO-8601 UTC time the cluster came up."""
    nodes: tuple[NodeInfo, ...]
    """Head node first."""
    python: str = DEFAULT_PYTHON
    """The interpreter bootstrap builds the node venv from (its torch is kept where it has one)."""
    daemon: str = DEFAULT_DAEMON
    """How the watchdog is kept alive on the head node: `systemd` (a unit) or `detached` (a process)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every node's jobs (local nodes share this machine's cores: one thread each)."""
    nodes_move: bool = False
    """A replaced node comes back at a new address (AWS spot: each worker is an Auto Scaling group of one):
    Slurm knows the nodes by name, and each node's /etc/hosts maps the names from the shared folder."""
    slurm_existing: dict = field(default_factory=dict)
    """Own machines that already run Slurm (`slurm: existing` in the hosts file): its runs go there,
    {"partition": "" for Slurm's default, "conf": "" for Slurm's default slurm.conf, "tag": the comment this
    stack's jobs carry there, random per `up`}; {} otherwise."""
    timeline: dict = field(default_factory=dict)
    """How the `up` that created it spent its time (infra/timeline.py's record); {} where not recorded."""
    image: str = ""
    """AWS: the AMI the nodes booted from where the stack pinned one (`amiId`, `up --image`, e.g. an image
    of `deploy.py image create`); empty for the newest Deep Learning AMI, and off AWS."""

    def __post_init__(self):
        # Every node names its login user, so no connection has to fall back to the cluster's.
        filled = tuple(n if n.ssh_user else replace(n, ssh_user=self.ssh_user) for n in self.nodes)
        object.__setattr__(self, "nodes", filled)

    @property
    def head(self) -> NodeInfo:
        return self.nodes[0]

    def node(self, name: str) -> NodeInfo:
        for node in self.nodes:
            if node.name == name:
                return node
        names = ", ".join(n.name for n in self.nodes)
        raise UsageError(f"no node {name!r} in stack {self.stack!r}: its nodes are {names}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterInfo":
        """The inventory from its JSON; ValueError naming the first field that is missing or of the wrong type."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        nodes = data.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise ValueError("nodes must be a non-empty list")
        typed_nodes = tuple(NodeInfo(**_typed(NodeInfo, node)) for node in nodes)
        # Facts added since an inventory was written mean what that provider did before them.
        earlier = EARLIER_FACTS.get(str(data.get("provider")), {})
        values = {**earlier, **_typed(cls, data, skip=("nodes",))}
        if values.get("daemon", DEFAULT_DAEMON) not in DAEMONS:
            raise ValueError(f"daemon must be one of {', '.join(DAEMONS)}")
        if not isinstance(values.get("env", {}), dict):
            raise ValueError("env must be a mapping")
        existing = values.get("slurm_existing", {})
        if not isinstance(existing, dict) or not all(
            isinstance(existing.get(k, ""), str) for k in ("partition", "conf", "tag")
        ):
            raise ValueError("slurm_existing must be a mapping of partition, conf and tag")
        return cls(nodes=typed_nodes, **values)


def _typed(cls, data, skip: tuple[str, ...] = ()) -> dict:
    """`data`'s fields of dataclass `cls`, each checked against its annotation (str, int, float)."""
    if not isinstance(data, dict):
        raise ValueError(f"a {cls.__name__} must be a JSON object")
    values = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"missing {f.name}")
            continue  # a field added later, with a default: older inventories lack it
        values[f.name] = _checked(f.name, f.type, data[f.name])
    return values


def _checked(name: str, kind, value):
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    if kind is int and not (is_number and isinstance(value, int)):
        raise ValueError(f"{name} must be a whole number")
    if kind is float:
        if not is_number:
            raise ValueError(f"{name} must be a number")
        return float(value)
    return value


def inventory_path(stack: str) -> Path:
    return state.stack_file(stack, state.INVENTORY)


def save(cluster: ClusterInfo) -> Path:
    path = inventory_path(cluster.stack)
    state.write_atomic(path, cluster.to_json())
    return path


def load(stack: str) -> ClusterInfo:
    """The stack's inventory as written, or a one-line UsageError saying what to do (down uses this)."""
    path = inventory_path(stack)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ClusterInfo.from_dict(data)
    except FileNotFoundError:
        raise UsageError(f"no cluster: stack {stack!r} is not up; run python deploy.py up") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a folder, not UTF-8, not JSON, wrong shape
        raise UsageError(
            f"inventory {path} is corrupt ({state.unreadable_reason(exc)}); "
            f"run python deploy.py down --stack {stack} to clean up"
        ) from None


def load_current(stack_flag: str | None = None) -> ClusterInfo:
    """The cluster a command means to use (`--stack`, `$CLUSTER_STACK`, or the last `up`), with its key
    checked: every command that logs in (status, ssh, every fab task) refuses the same way."""
    stack = state.resolve_stack(stack_flag)
    if stack is None:
        raise UsageError("no cluster: run python deploy.py up (or python deploy.py up --local)")
    cluster = load(stack)
    check_login_files(cluster)
    return cluster


def check_login_files(cluster: ClusterInfo) -> None:
    """The cluster key exists, is a file and is the user's alone (ssh refuses a looser key); the pinned
    host keys exist. One line each, saying what to do."""
    key = Path(cluster.ssh_key)
    again = f"python deploy.py down --stack {cluster.stack}, then up again"
    try:
        key_stat = key.stat()
    except FileNotFoundError:
        raise UsageError(f"the cluster key {key} is missing: restore it, or start over with {again}") from None
    except OSError as exc:
        raise UsageError(f"the cluster key {key} cannot be read ({state.unreadable_reason(exc)})") from None
    if not stat.S_ISREG(key_stat.st_mode):
        raise UsageError(f"the cluster key {key} is not a file: restore it, or start over with {again}")
    if key_stat.st_mode & 0o077:
        raise UsageError(
            f"the cluster key {key} is readable by others (mode {stat.S_IMODE(key_stat.st_mode):04o}), "
            f"which ssh refuses: run chmod 600 {key}"
        )
    if not Path(cluster.known_hosts).is_file():
        raise UsageError(
            f"the pinned host keys {cluster.known_hosts} are missing: without them no node can be "
            f"trusted; start over with {again}"
        )
