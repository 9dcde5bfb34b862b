"""On a node: the cluster's Slurm scheduler (munged, slurmctld on the head node, slurmd on every node).

    python node/scheduler.py start --node NAME [--conf-json FILE]   # the description on stdin without FILE
    python node/scheduler.py stop                                   # this node's daemons, nothing left
    python node/scheduler.py lost --node NAME [--why TEXT]          # that node is gone: DOWN, runs requeued
    python node/scheduler.py rejoined --node NAME                   # a replacement: back in service
    python node/scheduler.py replaced --node NAME                   # its old machine's jobs requeued
    python node/scheduler.py state [--json]                         # daemons alive, Slurm's node state
    python node/scheduler.py env                                    # `export SLURM_CONF=...` for clients
    python node/scheduler.py check [--head]                         # Slurm's programs are here (exit 2 if not)
    python node/scheduler.py identify [--partition P] [--conf F] [--name N] [--address A]...
                                                                    # this host's node in a Slurm it already runs
    python node/scheduler.py adopt --conf-json FILE                 # runs go to that Slurm (contract.SLURM_EXISTING)

`start` takes the cluster's description (the same JSON on every node; head node first):

    {"cluster": "gc", "munge_key": BASE64,
     "ports": {"slurmctld": 6817, "slurmd": 6818, "srun": [6900, 6999]},
     "nodes": [{"name": "node-0", "address": "10.0.0.5", "cpus": 8, "memory_mb": 30000, "gpus": 1}, ...]}

writes slurm.conf (and gres.conf where a node has GPUs) under `~/.gpu-cluster/slurm/` and starts what this
node runs, each daemon in a session of its own, registered in `~/.gpu-cluster/pids/` as the watchdog is,
so that power-off (local) and `down` end them. Daemons running with an unchanged configuration are left
alone; a changed one restarts them. Node i's slurmd listens on the `slurmd` port + i, so nodes that share
one machine do not meet.

Every socket listens on one address, never the wildcard: `CommunicationParameters=NoCtldInAddrAny,
NoInAddrAny` makes each daemon (and srun, and the steps) bind the address the host's name resolves to.
So that address must be the node's own (checked here), and on a cluster whose nodes are all on loopback
(one machine) it is that loopback address the nodes are reached at. A node's address may be its own name
instead (AWS spot workers come back at a new address): Slurm then looks every name up at each connection
(`NoAddrCache`), and each node's /etc/hosts maps the names (cloud-init keeps it from the shared folder).
Jobs run as the submitting user, on every node: this node's user runs the daemons (SlurmUser,
SlurmdUser), root or not.

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import argparse
import base64
import binascii
import hashlib
import ipaddress
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import calls, contract, procfs  # noqa: E402

READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
CLIENT_TIMEOUT_S = 15.0
CREDENTIAL_LIFETIME_S = 10
"""Slurm holds a requeued job `cred_expire + 1` s before it may start again (121 s by default)."""
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,19}$")
PROGRAMS = {
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sinfo": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "srun": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "squeue": "slurm-wlm",
    "scancel": "slurm-wlm",
    "sacct": "slurm-wlm",
}
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
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
    """One node of the description."""

    name: str
    """`node-<i>`: Slurm's NodeName, and `slurmd -N`."""
    address: str
    """The node's private address (what the other nodes reach it at)."""
    cpus: int
    """CPUs Slurm may give jobs on this node."""
    memory_mb: int
    """Memory Slurm may give jobs on this node (RealMemory)."""
    gpus: int
    """GPUs, as the GRES `gpu`."""


@dataclass(frozen=True)
class Cluster:
    """The description `start` takes, checked."""

    name: str
    """Slurm's ClusterName."""
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
    taken = [("slurmctld", ctld, ctld)] + [("slurmd", slurmd, slurmd + len(nodes) - 1)] + [("srun", first, last)]
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
    return Cluster(name, nodes, ctld, slurmd, (first, last), key, state_save)


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
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={paths.at(contract.JOB_COMPLETIONS)}",
        # Strict submission order: a job waiting at the head of the queue holds back every later one.
        "SchedulerType=sched/builtin",
        # A requeued job may start `cred_expire + 1` s later, but only the main loop (every 60 s by
        # default) looks again: ask every second.
        "SchedulerParameters=sched_interval=1",
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
        "MailProg=/bin/true",
    ]
    if gpus:
        lines.append("GresTypes=gpu")
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
    return "\n".join(lines) + "\n"


def gres_conf(cluster: Cluster) -> str | None:
    """gres.conf for the nodes with GPUs (counts only: no device files are bound), or None where none has any."""
    lines = [f"NodeName={node.name} Name=gpu Count={node.gpus}" for node in cluster.nodes if node.gpus]
    return "\n".join(["# Written by gpu-cluster (node/scheduler.py).", *lines]) + "\n" if lines else None


def daemons_of(cluster: Cluster, node: Node) -> list:
    """What this node runs, in start order."""
    return [name for name in contract.SCHEDULER_DAEMONS if name != "slurmctld" or node == cluster.head]


def program(name: str) -> str:
    """The absolute path of one of Slurm's or munge's programs; UsageError naming the package where missing."""
    found = shutil.which(name) or next(
        (os.path.join(d, name) for d in SBIN if os.access(os.path.join(d, name), os.X_OK)), None
    )
    if not found:
        raise UsageError(
            f"{name} is not installed on this node: install {PROGRAMS.get(name, name)} "
            "(Debian/Ubuntu: apt-get install slurm-wlm munge)"
        )
    return found


NEEDED = ("munged", "slurmd", "srun", "sbatch", "squeue", "scontrol", "sinfo")
"""What every node runs and what the runs' commands call; the head node runs slurmctld too."""


SITE_CONFS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
"""Where a host that runs a Slurm of its own keeps its configuration (Debian/Ubuntu, and their older path)."""


def check(head: bool) -> None:
    """UsageError naming the first of Slurm's or munge's programs this node lacks (and its package), or
    the configuration of a Slurm the host already runs (adopt that one rather than start another)."""
    for name in NEEDED + (("slurmctld",) if head else ()):
        program(name)
    site = next((path for path in SITE_CONFS if os.path.exists(path)), None)
    if site:
        raise UsageError(
            f"this host already runs Slurm ({site}): add slurm: existing to the hosts file to send runs to it, "
            "or fab bootstrap --scheduler slurm for one of gpu-cluster's own beside it"
        )


def daemon_argv(name: str, cluster: Cluster, node: Node, paths: Paths) -> list:
    if name == "munged":
        munge = paths.munge
        # -F: stay in the foreground (this session is its process group); -f: the folder is private (0700)
        # where munged would want it world-searchable.
        return [
            program("munged"),
            "-F",
            "-f",
            f"--socket={paths.munge_socket}",
            f"--key-file={paths.munge_key}",
            f"--log-file={paths.log('munged')}",
            f"--pid-file={os.path.join(munge, 'munged.pid')}",
            f"--seed-file={os.path.join(munge, 'munged.seed')}",
        ]
    if name == "slurmctld":
        return [program("slurmctld"), "-D", "-i", "-f", paths.conf]
    if name == "spot-watch":
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spot_watch.py")
        return [sys.executable, "-u", here, "--preempt", "--node", node.name]
    return [program("slurmd"), "-D", "-f", paths.conf, "-N", node.name]


def listen_address(name: str, cluster: Cluster, node: Node, bound: str):
    """(address, port) the daemon accepts on once it is ready; None for munged (a Unix socket)."""
    if name == "slurmctld":
        return bound, cluster.slurmctld_port
    if name == "slurmd":
        return bound, cluster.slurmd_port + cluster.nodes.index(node)
    return None  # munged answers on a Unix socket; spot-watch listens on nothing


def running_daemon(paths: Paths, name: str) -> int | None:
    """The registered daemon's pid while it runs (and really is that daemon: pids are reused)."""
    try:
        with open(paths.pid(name)) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    argv = procfs.command_line(pid)
    if not (pid > 1 and procfs.alive(pid) and argv):
        return None
    if name == "spot-watch":  # a Python program
        return pid if any(os.path.basename(word) == "spot_watch.py" for word in argv) else None
    return pid if os.path.basename(argv[0]).startswith(name) else None


def write_private(path: str, data: bytes, mode: int) -> None:
    """Replace `path` with `data` at `mode` (a 0400 key cannot be opened for writing again)."""
    temporary = f"{path}.new"
    if os.path.exists(temporary):
        os.unlink(temporary)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def configuration(cluster: Cluster, node: Node, paths: Paths, bound: str, user: str) -> dict:
    """{path: (bytes, mode)} of every file the daemons read."""
    files = {
        paths.conf: (slurm_conf(cluster, node, paths, bound, user).encode(), 0o644),
        paths.munge_key: (cluster.munge_key, 0o400),
    }
    gres = gres_conf(cluster)
    if gres:
        files[paths.gres] = (gres.encode(), 0o644)
    return files


def digest_of(files: dict) -> str:
    hashed = hashlib.sha256()
    for path in sorted(files):
        hashed.update(path.encode() + b"\0" + files[path][0] + b"\0")
    return hashed.hexdigest()


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def spawn(name: str, argv: list, paths: Paths) -> int:
    """Start a daemon in a session of its own (its pid is its process group) and register it."""
    environment = {**os.environ, contract.SCHEDULER_VARIABLE: paths.folder, "SLURM_CONF": paths.conf}
    with open(paths.log(name), "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=paths.folder,
            start_new_session=True,
        )
    write_private(paths.pid(name), f"{process.pid}\n".encode(), 0o600)
    return process.pid


def accepting(where) -> bool:
    try:
        with socket.create_connection(where, timeout=1.0):
            return True
    except OSError:
        return False


def munge_answers(paths: Paths) -> bool:
    if not os.path.exists(paths.munge_socket):
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(paths.munge_socket)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(name: str, pid: int, paths: Paths, where) -> None:
    """Until the daemon accepts connections; DaemonError if it exits or the deadline passes."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if not procfs.alive(pid):
            raise DaemonError(f"{name} exited at start; its log ({paths.log(name)}) ends: {log_tail(paths.log(name))}")
        if name == "spot-watch":  # it opens nothing; alive is ready
            return
        if munge_answers(paths) if where is None else accepting(where):
            return
        if time.monotonic() > deadline:
            raise DaemonError(
                f"{name} did not accept connections within {READY_TIMEOUT_S:.0f} s; see {paths.log(name)}"
            )
        time.sleep(0.05)


def make_folders(paths: Paths, cluster: Cluster | None = None) -> None:
    extra = (cluster.state_save,) if cluster is not None and cluster.state_save else ()
    for folder in (paths.folder, paths.munge, paths.sockets, paths.at(contract.PIDS), *extra):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.stat(folder).st_uid != os.getuid():
            raise UsageError(f"{folder} belongs to another user: remove it, or start from a shallower home")
        os.chmod(folder, 0o700)


def start(cluster: Cluster, node_name: str, home: str) -> dict:
    """This node's daemons running with this description; what was done."""
    node = cluster.node(node_name)
    paths = Paths(home)
    names = daemons_of(cluster, node)
    argvs = {name: daemon_argv(name, cluster, node, paths) for name in names}  # every program there
    program("sinfo")
    bound = daemon_address()
    check_binding(cluster, node, bound)
    user = pwd.getpwuid(os.getuid()).pw_name
    files = configuration(cluster, node, paths, bound, user)
    digest = digest_of(files)
    running = {name: running_daemon(paths, name) for name in names}
    if read_text(paths.digest) == digest and all(running.values()):
        resumed = resume_if_ours(paths, node.name, fresh=False)  # a node set DOWN as lost that answers again
        return {"node": node.name, "action": "unchanged", "daemons": running, "resumed": resumed}
    changed = read_text(paths.digest) != digest
    restarted = [name for name in stop(paths) if name in names] if changed else []
    make_folders(paths, cluster if node == cluster.head else None)  # after stop, which removes a short socket folder
    if changed:
        for path, (data, mode) in files.items():
            write_private(path, data, mode)
        if paths.gres not in files and os.path.exists(paths.gres):
            os.unlink(paths.gres)
        write_private(paths.digest, f"{digest}\n".encode(), 0o600)
    started = {}
    for name in names:
        pid = running_daemon(paths, name)
        if pid is None:
            pid = spawn(name, argvs[name], paths)
            wait_ready(name, pid, paths, listen_address(name, cluster, node, bound))
            started[name] = pid
        running[name] = pid
    action = "restarted" if restarted else ("started" if started else "unchanged")
    result: dict = {"node": node.name, "action": action, "daemons": running, "started": sorted(started)}
    result["resumed"] = resume_if_ours(paths, node.name, fresh="slurmd" in started)
    return result


def _is_step(pid: int) -> bool:
    return os.path.basename((procfs.command_line(pid) or [""])[0]).startswith("slurmstepd")


def _is_srun(pid: int) -> bool:
    return os.path.basename((procfs.command_line(pid) or [""])[0]) == "srun"


def scheduler_processes(paths: Paths) -> list:
    """Every live process of this node's scheduler: what carries its folder in its environment (the
    daemons), the job steps' slurmstepd (started by slurmd with an empty environment, in sessions of
    their own, but working in slurmd's folder) and everything below them (the jobs' tasks)."""
    marked = procfs.pids_with_environment(f"{contract.SCHEDULER_VARIABLE}={paths.folder}")
    steps = [
        pid
        for pid in procfs.pids()
        if procfs.working_directory(pid) == paths.folder and _is_step(pid) and procfs.alive(pid)
    ]
    roots = list(dict.fromkeys(marked + steps))
    return list(dict.fromkeys(roots + procfs.descendants(roots)))


def signal_groups(groups: list, pids: list, sig: int) -> None:
    for target, kill in [(g, os.killpg) for g in groups] + [(p, os.kill) for p in pids]:
        try:
            kill(target, sig)
        except OSError:
            pass


def stop(paths: Paths, grace_s: float = STOP_GRACE_S) -> list:
    """End this node's daemons (SIGTERM, SIGKILL after `grace_s`) and anything they left; the names that ran."""
    registered = {name: running_daemon(paths, name) for name in contract.SCHEDULER_DAEMONS}
    groups = [pid for pid in registered.values() if pid]
    others = [pid for pid in scheduler_processes(paths) if pid not in groups]
    signal_groups(groups, others, signal.SIGTERM)
    # slurmstepd ignores SIGTERM and srun waits for a controller that may be gone: wait for the rest
    # (the daemons, the jobs' own processes), then kill those two too.
    waited = [pid for pid in others if not _is_step(pid) and not _is_srun(pid)]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (
        any(procfs.group_alive(g) for g in groups) or any(procfs.alive(p) for p in waited)
    ):
        time.sleep(0.05)
    signal_groups(groups, others + scheduler_processes(paths), signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and scheduler_processes(paths):
        time.sleep(0.05)
    for name in contract.SCHEDULER_DAEMONS:
        try:
            os.unlink(paths.pid(name))
        except OSError:
            pass
    if paths.sockets != paths.folder:  # the short folder outside the home holds only sockets and spool
        shutil.rmtree(paths.sockets, ignore_errors=True)
    return [name for name, pid in registered.items() if pid]


def existing(paths: Paths) -> dict | None:
    """The Slurm the hosts already ran, where runs go to it (contract.SLURM_EXISTING); None where Slurm is ours."""
    try:
        with open(paths.at(contract.SLURM_EXISTING)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def client_environment(paths: Paths) -> dict:
    """What Slurm's clients need to reach the cluster's controller: our slurm.conf, or the existing one's."""
    adopted = existing(paths)
    if adopted is None:
        return {"SLURM_CONF": paths.conf}
    return {"SLURM_CONF": adopted["conf"]} if adopted.get("conf") else {}


def slurm_name(paths: Paths, node_name: str) -> str:
    """Slurm's NodeName of node-i: the same, or its name in the Slurm the hosts already ran."""
    adopted = existing(paths)
    return str((adopted or {}).get("names", {}).get(node_name) or node_name)


def answered(environment: dict, *argv: str) -> str:
    """One of Slurm's clients (`argv[0]`) with `environment`; its output. DaemonError with its own words
    where it fails or does not answer within CLIENT_TIMEOUT_S."""
    try:
        result = subprocess.run(
            [program(argv[0]), *argv[1:]],
            env={**os.environ, **environment},
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise DaemonError(f"{argv[0]} did not answer in {CLIENT_TIMEOUT_S:g} s (is slurmctld up?)") from None
    if result.returncode != 0:
        raise DaemonError(f"{argv[0]} failed: {(result.stderr.strip() or result.stdout.strip())[-200:]}")
    return result.stdout


def partition_nodes(environment: dict, partition: str) -> list:
    """[(NodeName, NodeHostname, NodeAddr, state)] of `partition` (every node where ''), as sinfo lists them;
    DaemonError with sinfo's own words where it cannot answer."""
    where = [f"--partition={partition}"] if partition else []
    listed = answered(environment, "sinfo", "--noheader", "--Node", "--format=%N|%n|%o|%T", *where)
    found: dict[str, tuple] = {}
    for line in listed.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) == 4:
            found.setdefault(parts[0], tuple(parts))
    return list(found.values())


def identify(partition: str, conf: str, name: str, addresses: list) -> dict:
    """This host's node in a Slurm it already runs: `name` where given, else the node whose NodeAddr is one
    of `addresses`, else whose NodeHostname or NodeName is this host's name. {"name", "state"}."""
    if conf and not os.path.isfile(conf):
        raise UsageError(f"slurm_conf {conf} is not a file on this host")
    listed = partition_nodes({"SLURM_CONF": conf} if conf else {}, partition)
    where = f"partition {partition}" if partition else "the existing Slurm"
    if not listed:
        raise UsageError(f"{where} has no nodes (check partition: in the hosts file)")
    if name:
        chosen = [row for row in listed if row[0] == name]
    else:
        chosen = [row for row in listed if row[2] in addresses]
        if not chosen:
            host = socket.gethostname()
            names = {host, host.split(".")[0], socket.getfqdn()}
            chosen = [row for row in listed if row[1] in names or row[0] in names]
    known = ", ".join(row[0] for row in listed[:8]) + (" ..." if len(listed) > 8 else "")
    if len(chosen) != 1:
        what = f"slurm_name {name!r} is not" if name else "no node at its address or host name is"
        if len(chosen) > 1:
            what = f"{', '.join(row[0] for row in chosen)} all match it: one must be"
        raise UsageError(f"{what} in {where} (its nodes: {known}); set slurm_name: for this host in the hosts file")
    return {"name": chosen[0][0], "state": chosen[0][3]}


def adopt(paths: Paths, data) -> dict:
    """Record the Slurm the hosts already ran (contract.SLURM_EXISTING): runs go there, none of our own
    daemons runs. `data`: {"partition", "conf", "tag", "names": {node-i: NodeName}}."""
    if not isinstance(data, dict) or not isinstance(data.get("names"), dict) or not data["names"]:
        raise UsageError("adopt needs {partition, conf, tag, names: {node-i: NodeName}}")
    record: dict[str, object] = {key: str(data.get(key) or "") for key in ("partition", "conf", "tag")}
    record["names"] = {str(k): str(v) for k, v in data["names"].items()}
    os.makedirs(paths.folder, mode=0o700, exist_ok=True)
    write_private(paths.at(contract.SLURM_EXISTING), json.dumps(record).encode(), 0o600)
    return record


def cancel_tagged(paths: Paths) -> list:
    """Cancel this stack's jobs (queued or running) in the Slurm the hosts already ran: the login user's
    whose comment is the stack's tag (random per `up`, so another stack of the same name is not ours);
    their ids. DaemonError where Slurm cannot be asked or does not cancel: nothing is known to be gone."""
    adopted = existing(paths)
    if not adopted or not adopted.get("tag"):
        return []
    environment = client_environment(paths)
    user = pwd.getpwuid(os.getuid()).pw_name
    listed = answered(environment, "squeue", "--noheader", f"--user={user}", "--format=%i|%k")
    rows = (line.partition("|") for line in listed.splitlines())
    ours = [job.strip() for job, _, comment in rows if comment.strip() == adopted["tag"]]
    if ours:
        answered(environment, "scancel", *ours)
    return ours


def node_states(paths: Paths) -> dict | None:
    """{node: Slurm's state} as sinfo reports it, or None where the controller does not answer."""
    return {name: node_state for name, (node_state, _) in node_reasons(paths).items()} or None


def scontrol(paths: Paths, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [program("scontrol"), *args],
        env={**os.environ, **client_environment(paths)},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )


def node_reasons(paths: Paths) -> dict:
    """{node: (Slurm's state, the reason it is drained or down, or "")}; {} where the controller is silent."""
    try:
        result = subprocess.run(
            [program("sinfo"), "--noheader", "--Node", "--format=%N|%T|%E"],
            env={**os.environ, **client_environment(paths)},
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except (subprocess.TimeoutExpired, OSError, UsageError):
        return {}
    found = {}
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        name, _, rest = line.partition("|")
        node_state, _, reason = rest.partition("|")
        found[name.strip()] = (node_state.strip(), "" if reason.strip() == "none" else reason.strip())
    return found


def lost_or_noticed(reason: str) -> bool:
    """A reason gpu-cluster gave a node it took out of service: a spot notice, or a node found dead."""
    return reason.startswith((contract.SPOT_DRAIN_REASON, contract.NODE_LOST_REASON))


def mark_lost(paths: Paths, node_name: str, why: str) -> str:
    """Tell Slurm a node is gone (DOWN: its run is requeued, JobRequeue=1); Slurm's answer."""
    result = scontrol(
        paths, "update", f"NodeName={node_name}", "State=DOWN", f"Reason={contract.NODE_LOST_REASON}: {why}"
    )
    return "down" if result.returncode == 0 else (result.stderr.strip() or f"scontrol exited {result.returncode}")


def drain_for_notice(paths: Paths, node_name: str, notice: str) -> str:
    """Drain this node (no new run starts on it; the running one goes on until it ends); Slurm's answer."""
    result = scontrol(
        paths, "update", f"NodeName={node_name}", "State=DRAIN", f"Reason={contract.SPOT_DRAIN_REASON}: {notice}"
    )
    return "drained" if result.returncode == 0 else (result.stderr.strip() or f"scontrol exited {result.returncode}")


def resume_if_ours(paths: Paths, node_name: str, fresh: bool, wait_s: float = READY_TIMEOUT_S) -> bool:
    """This node back in service where gpu-cluster took it out and it is whole again: set DOWN as lost
    (it answers now), or drained for a spot notice when it is `fresh` (its slurmd just started: a
    replacement; a node still waiting to be reclaimed keeps its drain). Waits for slurmd to register."""
    deadline = time.monotonic() + wait_s
    while True:
        node_state, reason = node_reasons(paths).get(node_name, ("", ""))
        ours = reason.startswith(contract.NODE_LOST_REASON) or (fresh and reason.startswith(contract.SPOT_DRAIN_REASON))
        if not ours:
            return False
        if "NOT_RESPONDING" not in node_state.upper() and not node_state.endswith("*"):
            if scontrol(paths, "update", f"NodeName={node_name}", "State=RESUME").returncode == 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def rejoined(paths: Paths, node_name: str, wait_s: float = READY_TIMEOUT_S) -> str:
    """A replacement (node/join.py) back in service: where gpu-cluster's reasons hold it out (a notice's
    drain, or lost), it is resumed; it is a new machine, never the one waiting to be reclaimed. Slurm's state
    of it; DaemonError when the controller does not answer (the head node may be being replaced too: the
    join is tried again) or still holds it out, `wait_s` on."""
    deadline = time.monotonic() + wait_s
    while True:
        resume_if_ours(paths, node_name, fresh=True, wait_s=max(0.0, deadline - time.monotonic()))
        node_state, reason = node_reasons(paths).get(node_name, ("", ""))
        if node_state and not lost_or_noticed(reason):
            return node_state
        if time.monotonic() > deadline:
            if not node_state:
                raise DaemonError(f"the controller did not answer about {node_name} (is the head node up?)")
            raise DaemonError(f"{node_name} is still out of service in Slurm ({node_state}: {reason})")
        time.sleep(1.0)


def forget_stale_jobs(paths: Paths, node_name: str) -> str:
    """A node replaced by a new machine while no controller was there to see it go (the head node was
    replaced too): a job Slurm still thinks runs on it, started before its new slurmd, went with the old
    machine. The node is set DOWN as lost (the job is requeued, JobRequeue=1) and back in service at once.
    What was done, in a few words. (A cloud instance's new boot time tells Slurm as much by itself; the
    local provider's nodes share this machine's.)"""
    shown = scontrol(paths, "show", "node", node_name, "--oneliner").stdout
    slurmd_started = re.search(r"SlurmdStartTime=(\S+)", shown)
    if not slurmd_started:
        return "unknown to the controller"
    listed = subprocess.run(
        [
            program("squeue"),
            "--noheader",
            f"--nodelist={node_name}",
            "--states=RUNNING,COMPLETING,CONFIGURING",
            "--format=%i|%S",
        ],
        env={**os.environ, **client_environment(paths)},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    ).stdout
    stale = [
        job for job, _, started in (line.partition("|") for line in listed.split()) if started < slurmd_started.group(1)
    ]
    if not stale:
        return "no job of the old machine"
    mark_lost(paths, node_name, "replaced: its jobs went with the old machine")
    rejoined(paths, node_name)
    return f"requeued {', '.join(stale)}"


def state(home: str, node_name: str | None) -> dict:
    """This node's scheduler: configured or not, each daemon's pid while it runs, Slurm's node states."""
    paths = Paths(home)
    adopted = existing(paths)
    configured = adopted is not None or os.path.exists(paths.conf)
    daemons = {} if adopted else {name: running_daemon(paths, name) for name in contract.SCHEDULER_DAEMONS}
    nodes = node_states(paths) if adopted or (configured and daemons["munged"]) else None
    return {
        "node": node_name,
        "configured": configured,
        "existing": adopted is not None,
        "daemons": {name: pid for name, pid in daemons.items() if pid or name != "slurmctld"},
        "node_state": (nodes or {}).get(slurm_name(paths, node_name)) if node_name else None,
        "nodes": nodes,
    }


def read_description(path: str | None) -> Cluster:
    try:
        if path is None:
            text = sys.stdin.read()
        else:
            with open(path) as f:
                text = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read --conf-json {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"the description is not JSON ({exc}); pass it with --conf-json FILE or on stdin") from None
    return parse_cluster(data)


def check_reply(head: bool) -> dict:
    """node/calls.py's CheckScheduler."""
    check(head)
    return {"said": "ok"}


def adopt_reply(existing: dict) -> dict:
    """node/calls.py's AdoptSlurm."""
    return adopt(Paths(os.path.expanduser("~")), existing)


def stop_reply() -> dict:
    """node/calls.py's StopScheduler: our daemons, or this stack's jobs in a Slurm the hosts already run."""
    paths = Paths(os.path.expanduser("~"))
    if existing(paths) is not None:  # none of the daemons is ours: this stack's jobs go
        cancelled = cancel_tagged(paths)  # a DaemonError keeps the record: ask again later
        os.unlink(paths.at(contract.SLURM_EXISTING))
        return {"said": "cancelled " + " ".join(cancelled) if cancelled else "nothing of ours in the existing Slurm"}
    stopped = stop(paths)
    return {"said": "stopped " + " ".join(stopped) if stopped else "not running"}


def state_reply(node: str) -> dict:
    """node/calls.py's AskScheduler."""
    return state(os.path.expanduser("~"), node)


def lost_reply(node: str, why: str) -> dict:
    """node/calls.py's MarkLost."""
    return {"said": mark_lost(Paths(os.path.expanduser("~")), node, why)}


def replaced_reply(node: str) -> dict:
    """node/calls.py's ForgetStaleJobs."""
    return {"said": forget_stale_jobs(Paths(os.path.expanduser("~")), node)}


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start_parser = commands.add_parser("start", help="write the configuration and start this node's daemons")
    start_parser.add_argument("--conf-json", help="the cluster's description (default: stdin)")
    start_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    commands.add_parser("stop", help="stop this node's daemons (an existing Slurm: cancel this stack's jobs there)")
    replaced_parser = commands.add_parser("replaced", help="a node replaced while the head was: requeue its old jobs")
    replaced_parser.add_argument("--node", required=True, help="the replaced node")
    rejoined_parser = commands.add_parser("rejoined", help="a replacement node: back in service (node/join.py)")
    rejoined_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    lost_parser = commands.add_parser("lost", help="tell Slurm a node is gone (its run is requeued)")
    lost_parser.add_argument("--node", required=True, help="the node that is gone")
    lost_parser.add_argument("--why", default="gone", help="the reason Slurm shows")
    state_parser = commands.add_parser("state", help="this node's scheduler state")
    state_parser.add_argument("--json", action="store_true", help="one JSON object")
    state_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    commands.add_parser("env", help="the environment Slurm's clients need (shell `export` lines)")
    check_parser = commands.add_parser("check", help="are Slurm's and munge's programs installed here")
    check_parser.add_argument("--head", action="store_true", help="this node runs the controller too")
    identify_parser = commands.add_parser("identify", help="this host's node in a Slurm it already runs")
    identify_parser.add_argument("--partition", default="", help="the partition runs go to (default: Slurm's)")
    identify_parser.add_argument("--conf", default="", help="its slurm.conf (default: Slurm's own)")
    identify_parser.add_argument("--name", default="", help="the node's NodeName, where the hosts file gives it")
    identify_parser.add_argument("--address", action="append", default=[], help="an address of this host")
    adopt_parser = commands.add_parser("adopt", help="runs go to a Slurm the hosts already run")
    adopt_parser.add_argument("--conf-json", help="{partition, conf, tag, names} (default: stdin)")
    args = parser.parse_args(argv)
    home = os.path.expanduser("~")
    try:
        if args.command == "start":
            if not args.node:
                raise UsageError(f"start needs --node NAME (or {contract.NODE_VARIABLE} in the environment)")
            result = start(read_description(args.conf_json), args.node, home)
            print(json.dumps(result))
        elif args.command == "replaced":
            print(f"{args.node}: {forget_stale_jobs(Paths(home), args.node)}")
        elif args.command == "rejoined":
            if not args.node:
                raise UsageError(f"rejoined needs --node NAME (or {contract.NODE_VARIABLE} in the environment)")
            print(f"{args.node}: {rejoined(Paths(home), args.node)}")
        elif args.command == "lost":
            print(f"{args.node}: {mark_lost(Paths(home), args.node, args.why)}")
        elif args.command == "stop":
            print(stop_reply()["said"])
        elif args.command == "identify":
            print(json.dumps(identify(args.partition, args.conf, args.name, args.address)))
        elif args.command == "adopt":
            text = open(args.conf_json).read() if args.conf_json else sys.stdin.read()
            try:
                data = json.loads(text)
            except ValueError:
                raise UsageError("adopt: the description is not JSON") from None
            print(json.dumps(adopt(Paths(home), data)))
        elif args.command == "check":
            check(args.head)
            print("ok")
        elif args.command == "state":
            result = state(home, args.node)
            if args.json:
                print(json.dumps(result))
            else:
                alive = " ".join(f"{name}={'up' if pid else 'down'}" for name, pid in result["daemons"].items())
                print(f"{result['node'] or '?'}: {alive} slurm={result['node_state'] or 'unknown'}")
        else:
            for key, value in client_environment(Paths(home)).items():
                print(f"export {key}={shlex.quote(value)}")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DaemonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
