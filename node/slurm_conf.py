"""The cluster's Slurm as the nodes see it: the description, checked, and what it renders to on a node
(slurm.conf, gres.conf where a node has GPUs, the munge key), at this node's paths.

The description is the same JSON on every node, head node first:

    {"cluster": "gc", "munge_key": BASE64,
     "ports": {"slurmctld": 6817, "slurmd": 6818, "srun": [6900, 6999], "slurmdbd": 6835},
     "nodes": [{"name": "node-0", "address": "10.0.0.5", "cpus": 8, "memory_mb": 30000, "gpus": 1}, ...],
     "state_save": "/shared/.gpu-cluster/slurm-state"}

Bootstrap builds it (remote/bootstrap_slurm.py `_scheduler_description`) from the inventory, whose nodes it is
(order, names, addresses, GPUs), and what Slurm needs besides: each node's CPUs and memory (bootstrap's
probe), the stack's name and munge key, ports above MASTER_PORT, the queue's place on the shared folder.

Every socket listens on one address, never the wildcard: `CommunicationParameters=NoCtldInAddrAny,
NoInAddrAny` makes each daemon (and srun, and the steps) bind the address the host's name resolves to.
So that address must be the node's own (`check_binding`), and on a cluster whose nodes are all on
loopback (one machine) it is that loopback address the nodes are reached at. A node's address may be its
own name instead (AWS spot workers come back at a new address): Slurm then looks every name up at each
connection (`NoAddrCache`), and each node's /etc/hosts maps the names (cloud-init keeps it from the
shared folder). Jobs run as the submitting user, on every node: this node's user runs the daemons
(SlurmUser, SlurmdUser), root or not. Standard library only.
"""

import base64
import binascii
import hashlib
import ipaddress
import os
import re
import socket
from dataclasses import dataclass

from node import calls, contract

CREDENTIAL_LIFETIME_S = 10
"""Slurm holds a requeued job `cred_expire + 1` s before it may start again (121 s by default)."""
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,19}$")
SOCKET_PATH_MAX = 107
"""sun_path holds 108 bytes with the terminating NUL."""
SOCKET_NAME_ROOM = 50
"""What the deepest socket adds to the folder: `/spool/<node name, up to 20>_<job>.<step>` at most."""


class UsageError(calls.BadInput):
    """Bad input or a missing prerequisite: one line, exit 2, nothing started."""


class DaemonError(calls.Failed):
    """A daemon did not come up: exit 1, with the end of its log."""


@dataclass(frozen=True)
class Node:
    """One node of the description: the inventory's node, with what Slurm needs of it besides."""

    name: str
    """`node-<i>` (the inventory's `NodeInfo.name`): Slurm's NodeName, and `slurmd -N`."""
    address: str
    """Where the other nodes reach it: the inventory's `private_ip`, or the name (`ClusterInfo.nodes_move`)."""
    cpus: int
    """CPUs Slurm may give jobs on this node (bootstrap's probe of it)."""
    memory_mb: int
    """Memory Slurm may give jobs on this node (RealMemory; 90% of what bootstrap's probe found)."""
    gpus: int
    """GPUs (the inventory's `gpus`), as the GRES `gpu`."""


@dataclass(frozen=True)
class Cluster:
    """The description `start` takes, checked."""

    name: str
    """Slurm's ClusterName (the stack's name)."""
    nodes: tuple
    """Every Node, the head node (slurmctld's) first."""
    slurmctld_port: int
    """slurmctld's port."""
    slurmd_port: int
    """Node i's slurmd listens on this + i."""
    srun_ports: tuple
    """(first, last): the ports srun and the steps listen on."""
    munge_key: bytes
    """The cluster's munge key (the same on every node)."""
    slurmdbd_port: int = 0
    """Accounting (node/slurm_accounting.py): slurmdbd's port on the head node; 0: none (`sacct` has no history)."""
    state_save: str = ""
    """Where slurmctld keeps the queue: on shared storage, so a head node replaced with a fresh disk
    finds it again; empty: in the head node's own scheduler folder."""

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise UsageError(f"--node {name!r} is not in the description (its nodes: {', '.join(self.names)})")

    @property
    def names(self) -> list:
        return [node.name for node in self.nodes]

    @property
    def one_machine(self) -> bool:
        """Every node on loopback: they share this machine (nothing else reaches a loopback address)."""
        return all(on_loopback(node) for node in self.nodes)

    @property
    def by_name(self) -> bool:
        """The nodes are known by name: their addresses come and go (a replaced spot node), and every
        connection looks the name up again (the nodes' /etc/hosts)."""
        return any(node.address == node.name for node in self.nodes)


def on_loopback(node: Node) -> bool:
    return node.address != node.name and ipaddress.ip_address(node.address).is_loopback


def _integer(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{what} must be an integer from {low} to {high}, not {value!r}")
    return value


def parse_node(entry, index: int) -> Node:
    if not isinstance(entry, dict):
        raise UsageError(f"nodes[{index}] must be an object with name, address, cpus, memory_mb, gpus")
    missing = [key for key in ("name", "address", "cpus", "memory_mb") if key not in entry]
    if missing:
        raise UsageError(f"nodes[{index}] lacks {', '.join(missing)}")
    name, address = entry["name"], entry["address"]
    if not isinstance(name, str) or not NODE_NAME.match(name):
        raise UsageError(f"nodes[{index}].name {name!r} is not a node name (up to 20 letters, digits, '-', '_', '.')")
    try:
        if not isinstance(address, str) or (address != name and ipaddress.ip_address(address).version != 4):
            raise ValueError
    except ValueError:
        raise UsageError(f"nodes[{index}].address {address!r} is neither an IPv4 address nor the node's name") from None
    return Node(
        name=name,
        address=address,
        cpus=_integer(entry["cpus"], f"nodes[{index}].cpus", 1, 100000),
        memory_mb=_integer(entry["memory_mb"], f"nodes[{index}].memory_mb", 1, 1 << 40),
        gpus=_integer(entry.get("gpus", 0), f"nodes[{index}].gpus", 0, 1024),
    )


def parse_cluster(data) -> Cluster:
    """The description, checked whole; UsageError names the first thing wrong."""
    if not isinstance(data, dict):
        raise UsageError("the description must be a JSON object with cluster, nodes, ports and munge_key")
    missing = [key for key in ("cluster", "nodes", "ports", "munge_key") if key not in data]
    if missing:
        raise UsageError(f"the description lacks {', '.join(missing)}")
    name = data["cluster"]
    if not isinstance(name, str) or not NAME.match(name):
        raise UsageError(f"cluster {name!r} is not a Slurm cluster name: lowercase letters, digits, '-' and '_'")
    if not isinstance(data["nodes"], list) or not data["nodes"]:
        raise UsageError("nodes must be a non-empty list, head node first")
    nodes = tuple(parse_node(entry, i) for i, entry in enumerate(data["nodes"]))
    for attribute in ("name", "address"):
        values = [getattr(node, attribute) for node in nodes]
        if len(set(values)) != len(values):
            raise UsageError(f"two nodes share one {attribute}: {', '.join(values)}")
    loopback = [on_loopback(node) for node in nodes]
    if any(loopback) and not all(loopback):
        raise UsageError("some nodes are on loopback and some are not: a cluster is on one machine or on several")
    ports = data["ports"]
    if not isinstance(ports, dict) or not all(key in ports for key in ("slurmctld", "slurmd", "srun")):
        raise UsageError('ports must be {"slurmctld": PORT, "slurmd": PORT, "srun": [FIRST, LAST]}')
    ctld = _integer(ports["slurmctld"], "ports.slurmctld", 1024, 65535)
    slurmd = _integer(ports["slurmd"], "ports.slurmd", 1024, 65535 - len(nodes) + 1)
    srun = ports["srun"]
    if not isinstance(srun, list) or len(srun) != 2:
        raise UsageError(f"ports.srun must be [FIRST, LAST], not {srun!r}")
    first, last = (_integer(p, "ports.srun", 1024, 65535) for p in srun)
    if last - first < 1:
        raise UsageError(f"ports.srun [{first}, {last}] must hold at least two ports")
    dbd = _integer(ports["slurmdbd"], "ports.slurmdbd", 1024, 65535) if ports.get("slurmdbd") else 0
    taken = [("slurmctld", ctld, ctld)] + [("slurmd", slurmd, slurmd + len(nodes) - 1)] + [("srun", first, last)]
    taken += [("slurmdbd", dbd, dbd)] if dbd else []
    for i, (what, low, high) in enumerate(taken):
        for other, other_low, other_high in taken[i + 1 :]:
            if low <= other_high and other_low <= high:
                raise UsageError(f"ports.{what} and ports.{other} overlap: give each its own ports")
    try:
        key = base64.b64decode(data["munge_key"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise UsageError("munge_key must be base64") from None
    if len(key) < 32:
        raise UsageError(f"munge_key is {len(key)} bytes: munge needs at least 32 (1024 random bytes is usual)")
    state_save = data.get("state_save") or ""
    if not isinstance(state_save, str) or (state_save and not os.path.isabs(state_save)):
        raise UsageError(f"state_save must be an absolute path, not {state_save!r}")
    return Cluster(name, nodes, ctld, slurmd, (first, last), key, dbd, state_save)


def daemon_address() -> str:
    """The IPv4 address Slurm's daemons bind under NoInAddrAny: the one the host's name resolves to."""
    host = socket.gethostname()
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        raise UsageError(
            f"this host's name {host!r} resolves to no IPv4 address: Slurm's daemons bind the address of the "
            "host's name; add it to /etc/hosts"
        ) from None


def node_address(cluster: Cluster, node: Node, bound: str) -> str:
    """Where the others reach `node`'s daemons (NodeAddr): its own address, or, on one machine, the
    loopback address every daemon there binds (`bound`)."""
    return bound if cluster.one_machine else node.address


def check_binding(cluster: Cluster, node: Node, bound: str) -> None:
    """UsageError unless the daemons will listen where the other nodes reach this one, and only there."""
    host = socket.gethostname()
    if cluster.one_machine and not ipaddress.ip_address(bound).is_loopback:
        raise UsageError(
            f"this host's name {host!r} resolves to {bound}, not a loopback address: Slurm's daemons bind the "
            "address of the host's name, and this cluster's nodes are on loopback; make the name resolve to "
            "127.0.0.1 (/etc/hosts)"
        )
    if cluster.by_name and node.address == node.name:
        try:
            resolved = str(socket.getaddrinfo(node.name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            resolved = None
        if resolved != bound:
            raise UsageError(
                f"{node.name} resolves to {resolved or 'nothing'}, not to {bound}, the address of this host's name "
                f"{host!r}: the others reach it by name; map {node.name} to {bound} (/etc/hosts)"
            )
        return
    if not cluster.one_machine and bound != node.address:
        raise UsageError(
            f"this host's name {host!r} resolves to {bound}, not {node.name}'s address {node.address}: Slurm's "
            f"daemons bind the address of the host's name; make it resolve to {node.address} (/etc/hosts)"
        )


@dataclass(frozen=True)
class Paths:
    """This node's scheduler files, absolute."""

    home: str

    def at(self, relative: str) -> str:
        return os.path.join(self.home, relative)

    @property
    def folder(self) -> str:
        return self.at(contract.SCHEDULER)

    @property
    def conf(self) -> str:
        return self.at(contract.SLURM_CONF)

    @property
    def gres(self) -> str:
        return self.at(contract.GRES_CONF)

    @property
    def digest(self) -> str:
        return self.at(contract.SCHEDULER_DIGEST)

    @property
    def munge(self) -> str:
        return self.at(contract.MUNGE)

    @property
    def sockets(self) -> str:
        """The folder of this node's Unix sockets: the scheduler's own, or a short one where that is too
        deep for the longest socket (a step's, `spool/<node>_<job>.<step>`) to fit in 108 bytes."""
        if len(self.folder) + SOCKET_NAME_ROOM <= SOCKET_PATH_MAX:
            return self.folder
        key = hashlib.sha256(self.folder.encode()).hexdigest()[:12]
        return contract.SCHEDULER_SHORT_FOLDER.format(uid=os.getuid(), key=key)

    @property
    def munge_socket(self) -> str:
        return os.path.join(self.sockets, "munge.socket")

    @property
    def spool(self) -> str:
        return os.path.join(self.sockets, "spool")

    @property
    def munge_key(self) -> str:
        return os.path.join(self.munge, "munge.key")

    def log(self, daemon: str) -> str:
        return os.path.join(self.folder, f"{daemon}.log")

    def pid(self, daemon: str) -> str:
        return self.at(contract.daemon_pid(f"slurm-{daemon}"))


def controller_name(cluster: Cluster, node: Node) -> str:
    """SlurmctldHost's name: slurmctld starts only where it is the host's own name; elsewhere Slurm shows
    it and nothing more (every client and slurmd reaches the controller at its address)."""
    return socket.gethostname() if node == cluster.head else cluster.head.name


def slurm_conf(cluster: Cluster, node: Node, paths: Paths, bound: str, user: str) -> str:
    """slurm.conf: one job at a time across the cluster, in submission order, every socket on one address."""
    head = cluster.head
    gpus = any(node.gpus for node in cluster.nodes)
    lines = [
        "# Written by gpu-cluster (node/scheduler.py); `start` rewrites it and restarts the daemons on a change.",
        f"ClusterName={cluster.name}",
        f"SlurmctldHost={controller_name(cluster, node)}({node_address(cluster, head, bound)})",
        f"SlurmctldPort={cluster.slurmctld_port}",
        f"SlurmdPort={cluster.slurmd_port}",
        f"SrunPortRange={cluster.srun_ports[0]}-{cluster.srun_ports[1]}",
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny" + (",NoAddrCache" if cluster.by_name else ""),
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={paths.munge_socket},cred_expire={CREDENTIAL_LIFETIME_S}",
        f"StateSaveLocation={cluster.state_save or os.path.join(paths.folder, 'ctld')}",
        f"SlurmdSpoolDir={paths.spool}",
        f"SlurmctldPidFile={os.path.join(paths.folder, 'slurmctld.pid')}",
        f"SlurmdPidFile={os.path.join(paths.folder, 'slurmd.pid')}",
        f"SlurmctldLogFile={paths.log('slurmctld')}",
        f"SlurmdLogFile={paths.log('slurmd')}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # Node-local paths (the munge socket, spool, logs) differ where the nodes' homes do (one machine).
        "DebugFlags=NO_CONF_HASH",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        *accounting_lines(cluster, paths, bound),
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={paths.at(contract.JOB_COMPLETIONS)}",
        # The scheduler real clusters run, which heterogeneous jobs (torchx's) need. Runs keep their order:
        # each takes every node, so none fits before one waiting. A smaller job of a user's may start on
        # idle nodes ahead of a waiting run, as backfill does: with no time limit (INFINITE) it plans only
        # within its window (a day), where the waiting run has no reservation.
        "SchedulerType=sched/backfill",
        # A requeued job may start `cred_expire + 1` s later, but only the main loop (every 60 s by
        # default) looks again: ask every second, and backfill every second (30 s by default).
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # The description is what the caller measured; a node never drains over a count it sees otherwise.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        # A node that stops answering (an instance gone without notice) is DOWN within a minute, not five:
        # its run is requeued (JobRequeue) and resumes when a replacement registers.
        "SlurmdTimeout=60",
        "JobRequeue=1",
        "JobFileAppend=1",
        "KillOnBadExit=1",
        "KillWait=10",
        "InactiveLimit=0",
        # How long a client or daemon waits on a message (and retries a controller that refuses): 10 s by
        # default, so each client took 9 to 18 s to say that a dead controller does not answer. On one
        # machine a message over loopback arrives in milliseconds or not at all: 5 s.
        f"MessageTimeout={5 if cluster.one_machine else 10}",
        "MailProg=/bin/true",
    ]
    if gpus:
        lines.append("GresTypes=gpu")
    lines += node_lines(cluster, bound)
    return "\n".join(lines) + "\n"


def accounting_lines(cluster: Cluster, paths: Paths, bound: str) -> list[str]:
    """slurm.conf's accounting: through slurmdbd on the head node where the description has its port, else none."""
    if not cluster.slurmdbd_port:
        return ["AccountingStorageType=accounting_storage/none"]
    return [
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={node_address(cluster, cluster.head, bound)}",
        f"AccountingStoragePort={cluster.slurmdbd_port}",
        # where slurmctld and sacct get the credential slurmdbd checks: this node's munged
        f"AccountingStoragePass={paths.munge_socket}",
    ]


def node_lines(cluster: Cluster, bound: str) -> list[str]:
    """slurm.conf's nodes (each slurmd on a port of its own) and the one partition of them all."""
    lines = []
    for index, each in enumerate(cluster.nodes):
        lines.append(
            f"NodeName={each.name} NodeHostname={each.name} NodeAddr={node_address(cluster, each, bound)} "
            f"Port={cluster.slurmd_port + index} CPUs={each.cpus} RealMemory={each.memory_mb}"
            + (f" Gres=gpu:{each.gpus}" if each.gpus else "")
            + " State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=main Nodes={','.join(cluster.names)} Default=YES OverSubscribe=EXCLUSIVE "
        "MaxTime=INFINITE State=UP"
    )
    return lines


def gpu_files(cluster: Cluster, node: Node, paths: Paths) -> list:
    """This node's GPU device files, one per GPU: NVIDIA's, or on one machine (the local provider's nodes
    are CPU nodes) the node's own under its scheduler folder (`FAKE_GPU_DEVICE`). slurmd counts a GPU only
    where its file is a device (a count alone left the node INVALID: "gres/gpu count reported lower than
    configured (0 < 1)"; a regular file "is not a valid character or block device"), and gives a job
    CUDA_VISIBLE_DEVICES by their index."""
    folder = os.path.join(paths.folder, "gpus") if cluster.one_machine else "/dev"
    return [os.path.join(folder, f"nvidia{i}") for i in range(node.gpus)]


FAKE_GPU_DEVICE = "/dev/null"
"""What a fake GPU's file links to: a character device anyone may open, and no user may create one."""


def gres_conf(cluster: Cluster, node: Node, paths: Paths) -> str | None:
    """gres.conf: this node's GPUs, each with its device file (`gpu_files`); None where it has none."""
    files = gpu_files(cluster, node, paths)
    if not files:
        return None
    folder = os.path.dirname(files[0])
    found = f"{folder}/nvidia0" if len(files) == 1 else f"{folder}/nvidia[0-{len(files) - 1}]"
    return f"# Written by gpu-cluster (node/scheduler.py).\nNodeName={node.name} Name=gpu File={found}\n"


def configuration(cluster: Cluster, node: Node, paths: Paths, bound: str, user: str) -> dict:
    """{path: (bytes, mode)} of every file the daemons read (the fake GPUs' links aside: `gpu_files`)."""
    files = {
        paths.conf: (slurm_conf(cluster, node, paths, bound, user).encode(), 0o644),
        paths.munge_key: (cluster.munge_key, 0o400),
    }
    gres = gres_conf(cluster, node, paths)
    if gres:
        files[paths.gres] = (gres.encode(), 0o644)
    return files


def digest_of(files: dict) -> str:
    hashed = hashlib.sha256()
    for path in sorted(files):
        hashed.update(path.encode() + b"\0" + files[path][0] + b"\0")
    return hashed.hexdigest()
