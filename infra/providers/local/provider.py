"""The local provider: N SSH-server "nodes" on 127.0.0.x and a shared folder, on this machine.

Node i listens on 127.0.0.(10+i):2222. Where the platform cannot bind loopback addresses beyond
127.0.0.1 (macOS by default) every node uses 127.0.0.1 with its own port instead. Nodes are CPU nodes;
everything else (SSH, Fabric, torchrun) is the same code path as on AWS.

Layout under `.cluster/<stack>/` (all 0700/0600): `nodes/node-<i>/` is node i's home (`$HOME` of every
command, with its `node.json`, `sshd.pid` and `sshd.log`), `host_keys/node-<i>` its SSH host key (out
of reach of the jobs that run in the home), `shared/` the folder all nodes share.
"""

import errno
import getpass
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from infra import config as stack_config
from infra import costs, inventory, keys, report, ssh, state
from infra.config import StackConfig
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo, NodeInfo, NodeStatus
from infra.providers.base import DownReport, Provider, UpRequest, UpResult
from infra.providers.local import metadata, orphans, procs
from infra.providers.local.node_config import (
    PID_REGISTRY,
    SERVER_MODULE,
    SUPERVISOR_MODULE,
    NodeConfig,
    read_pid,
    token_entry,
)
from infra.timeline import Timeline
from node import contract, procfs

DEFAULT_FIRST_ADDRESS = "127.0.0.10"
DEFAULT_SSH_PORT = 2222
SSH_PORT_RANGE = (1024, 65535)  # `--ssh-port`: below 1024 needs root
MAX_FAKE_GPUS = 8
"""`--gpus`: fake GPUs per local node (device files and GRES; what an instance with the most has)."""
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 6.0  # longer than a node server's own grace for what it ends
# What a node server, and so every command on a local node, keeps of the caller's environment: enough
# to run programs (PATH, locale, time zone, temporary folder) and nothing that grants access elsewhere
# (AWS_*, PULUMI_*, tokens, passwords, SSH_AUTH_SOCK), as a fresh login on another machine would have.
NODE_ENVIRONMENT = ("PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR")


@dataclass(frozen=True)
class LocalOptions:
    """What `deploy.py up --local` asks for."""

    stack: str
    """Stack name (`local` unless `--stack` says otherwise)."""
    nodes: int
    """How many nodes, 1..16."""
    instance_type: str
    """The EC2 type whose price `deploy.py cost` compares these hours with."""
    first_address: str | None = None
    """Node-0's loopback address; None picks 127.0.0.10, or 127.0.0.1 where only that binds."""
    ssh_port: int = DEFAULT_SSH_PORT
    """SSH port of node-0 (and of every node when each has its own address)."""
    gpus: int = 0
    """Fake GPUs per node: Slurm's GRES, a device file each under the node's folder (bootstrap's scheduler
    stage); jobs get CUDA_VISIBLE_DEVICES from Slurm as on GPU nodes, and torch still runs on the CPU."""
    spot: bool = False
    """Nodes behave as spot instances in a group that keeps its size: a node reclaimed (`drill spot`) or
    dead is replaced by a fresh one, which bootstraps and rejoins (supervisor.py)."""
    asked: frozenset[str] = frozenset()
    """The fields above the user gave explicitly; a cluster that is already up must match them."""


def node_dir(stack: str, index: int) -> Path:
    return state.stack_dir(stack) / "nodes" / f"node-{index}"


def shared_dir(stack: str) -> Path:
    return state.stack_dir(stack) / "shared"


def host_key_path(stack: str, index: int) -> Path:
    return state.stack_dir(stack) / "host_keys" / f"node-{index}"


def notice_path(stack: str, node_name: str) -> Path:
    """Where `drill spot` posts a node's spot notice (out of the node's home, as the host keys are)."""
    return state.stack_dir(stack) / "notices" / f"{node_name}.json"


# ---------------------------------------------------------------------------------------------- up


def up(options: LocalOptions, timeline: Timeline | None = None) -> tuple[ClusterInfo, bool]:
    """Start the nodes and write the inventory; returns (cluster, created). Rolls back on failure.
    `timeline` gets the phases: keys, node servers, ssh ready."""
    timeline = timeline or Timeline(time.time())
    existing = running_cluster(options.stack)
    if existing is not None:
        check_unchanged(existing, options)
        return existing, False
    addresses = plan_addresses(options)
    try:
        cluster = _start(options, addresses, timeline)
    except BaseException:
        stop_nodes(options.stack)
        remove_state(options.stack)
        raise
    inventory.save(cluster)
    state.set_current_stack(options.stack)
    if options.spot:
        start_supervisor(options.stack)
    return cluster, True


def running_cluster(stack: str) -> ClusterInfo | None:
    """The stack's cluster if its nodes run; UsageError if it exists but is not whole."""
    if not state.stack_dir(stack).exists():
        return None
    alive = [pid for pid in _server_pids(stack) if _is_node_server(pid)]
    has_inventory = inventory.inventory_path(stack).exists()
    if not alive and not has_inventory:
        return None
    if has_inventory and alive:
        cluster = inventory.load(stack)
        if len(alive) == len(cluster.nodes):
            return cluster
    if alive and not has_inventory:
        raise UsageError(
            f"stack {stack!r} has node servers but no inventory (an interrupted up); "
            f"run python deploy.py down --stack {stack} first"
        )
    why = stop_reason(stack)
    because = f" (it stopped itself: {why})" if why else ""
    raise UsageError(
        f"stack {stack!r} exists but is not running{because}; run python deploy.py down --stack {stack} first"
    )


def check_unchanged(cluster: ClusterInfo, options: LocalOptions) -> None:
    """UsageError when `up` asks a running cluster for something else (nodes are not resized in place)."""
    head = cluster.head
    found = {
        "nodes": len(cluster.nodes),
        "instance_type": cluster.instance_type,
        "first_address": head.public_ip,
        "ssh_port": head.ssh_port,
        "spot": supervised(cluster.stack),
        "gpus": head.gpus,
    }
    flags = {
        "spot": "--spot",
        "nodes": "--nodes",
        "instance_type": "--instance-type",
        "first_address": "--bind",
        "ssh_port": "--ssh-port",
        "gpus": "--gpus",
    }
    differ = [k for k in sorted(options.asked) if getattr(options, k) != found[k]]
    if differ:
        asked = "; ".join(f"{flags[k]} {getattr(options, k)} (it has {found[k]})" for k in differ)
        stack_flag = "" if cluster.stack == state.LOCAL_STACK else f" --stack {cluster.stack}"
        again = " ".join(f"{flags[k]} {getattr(options, k)}" for k in differ)
        raise UsageError(
            f"stack {cluster.stack!r} is already up and differs from what you asked: {asked}. To change it: "
            f"python deploy.py down --stack {cluster.stack}, then python deploy.py up --local{stack_flag} {again}"
        )


def check_gpus(gpus: int | None) -> int:
    """The fake GPUs per node `--gpus` asks for; UsageError outside 0..MAX_FAKE_GPUS."""
    if gpus is None:
        return 0
    if not 0 <= gpus <= MAX_FAKE_GPUS:
        raise UsageError(f"--gpus {gpus}: give each local node 0 to {MAX_FAKE_GPUS} fake GPUs")
    return gpus


def check_addresses(first_address: str | None, ssh_port: int, nodes: int) -> ipaddress.IPv4Address:
    """Node-0's address, once `--bind` and `--ssh-port` are known to fit `nodes` nodes; UsageError otherwise.

    Ports below 1024 need root (and 22, 80, 443 belong to real services); node i gets node-0's address
    + i, all within node-0's /24 and never its .0 or .255, so a cluster is one block a user can read.
    """
    low, high = SSH_PORT_RANGE
    if not low <= ssh_port <= high:
        raise UsageError(
            f"--ssh-port {ssh_port} is outside {low}..{high} (ports below {low} need root): pick one in it"
        )
    if ssh_port + nodes - 1 > high:  # where only 127.0.0.1 binds, node i listens on ssh_port + i
        raise UsageError(
            f"--ssh-port {ssh_port} leaves no port for node-{nodes - 1}: pick one in {low}..{high - nodes + 1}"
        )
    first = DEFAULT_FIRST_ADDRESS if first_address is None else first_address
    try:
        base = ipaddress.IPv4Address(first)
    except ValueError:
        raise UsageError(f"--bind {first!r} is not an IPv4 address: use one in 127.0.0.0/8") from None
    if not base.is_loopback:
        raise UsageError(f"--bind {first}: local nodes bind to loopback only; use an address in 127.0.0.0/8")
    last_octet = int(base) & 0xFF
    if not 1 <= last_octet <= 255 - nodes:
        block = ipaddress.IPv4Network(f"{base}/24", strict=False)
        raise UsageError(
            f"--bind {first} with {nodes} node(s): node i gets {first} + i, and all must lie in "
            f"{block[1]}..{block[254]}; pick a last number from 1 to {255 - nodes}"
        )
    return base


def plan_addresses(options: LocalOptions) -> list[tuple[str, int]]:
    """(address, port) per node, checked free and bindable; UsageError before anything is created."""
    base = check_addresses(options.first_address, options.ssh_port, options.nodes)
    if _can_bind_address(str(base)):
        planned = [(str(base + i), options.ssh_port) for i in range(options.nodes)]
    elif options.first_address is None:
        planned = [("127.0.0.1", options.ssh_port + i) for i in range(options.nodes)]
    else:
        raise UsageError(f"cannot bind {base} on this machine: omit --bind to use 127.0.0.1 with one port per node")
    for address, port in planned:
        _check_port_free(address, port)
    return planned


def _can_bind_address(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
            return True
        except OSError:
            return False


def _free_port(address: str) -> int:
    """A port free on `address` now, for the node's metadata service (its node server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _check_port_free(address: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"port {port} on {address} is in use (another local cluster? python deploy.py status); "
                    "choose another with --ssh-port"
                ) from None
            raise UsageError(f"cannot bind {address}:{port}: {exc.strerror}") from None


def _start(options: LocalOptions, addresses: list[tuple[str, int]], timeline: Timeline) -> ClusterInfo:
    stack_path = state.make_private_dir(state.stack_dir(options.stack))
    shared = state.make_private_dir(shared_dir(options.stack))
    client_key = keys.ensure_client_key(stack_path)
    user = getpass.getuser()
    known_hosts = stack_path / state.KNOWN_HOSTS
    entries, configs = [], []
    for index, (address, port) in enumerate(addresses):
        config, host_public = _prepare_node(options.stack, index, address, port, client_key, user)
        configs.append(config)
        entries.append(keys.known_hosts_entry(address, port, host_public))
    keys.write_known_hosts(known_hosts, entries)
    timeline.mark("keys")
    procs = [_spawn(config) for config in configs]
    _wait_for_pid_files(configs, procs)
    timeline.mark("node servers")
    cluster = ClusterInfo(
        stack=options.stack,
        provider="local",
        region="local",
        instance_type=options.instance_type,
        hourly_usd=0.0,
        ssh_user=user,
        ssh_key=str(client_key),
        known_hosts=str(known_hosts),
        shared_dir=str(shared),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        nodes=tuple(
            NodeInfo(f"node-{i}", address, address, port, options.gpus, user)
            for i, (address, port) in enumerate(addresses)
        ),
        python=sys.executable,  # this project's own interpreter already has torch
        daemon="detached",  # the node server ends registered daemons when it powers off
        env={"OMP_NUM_THREADS": "1"},  # the nodes share this machine's cores: one thread per rank
    )
    try:
        ssh.wait_for_ssh(cluster, READY_TIMEOUT_S)
    except TimeoutError as exc:
        raise OperationError(f"local nodes did not answer SSH within {READY_TIMEOUT_S:.0f} s: {exc}") from None
    timeline.mark("ssh ready")
    return cluster


def _prepare_node(stack: str, index: int, address: str, port: int, client_key: Path, user: str):
    home = node_dir(stack, index)
    state.make_private_dir(home / PID_REGISTRY)
    host_key = host_key_path(stack, index)
    host_public = keys.generate_host_key(host_key)
    config = NodeConfig(
        name=f"node-{index}",
        address=address,
        port=port,
        host_key=str(host_key),
        authorized_key=keys.public_key_text(client_key),
        user=user,
        home=str(home),
        shared_dir=str(shared_dir(stack)),
        pid_file=str(home / "sshd.pid"),
        token=secrets.token_hex(8),
        metadata_port=_free_port(address),
        notice_file=str(notice_path(stack, f"node-{index}")),
    )
    state.write_atomic(home / "node.json", json.dumps(config.__dict__, indent=2))
    return config, host_public


def node_server_environment(home: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment a node server starts with (see NODE_ENVIRONMENT)."""
    source: Mapping[str, str] = os.environ if environ is None else environ
    kept = {k: v for k, v in source.items() if k in NODE_ENVIRONMENT or k.startswith("LC_")}
    return {**kept, "HOME": home}


def _spawn(config: NodeConfig) -> subprocess.Popen:
    home = Path(config.home)
    with state.open_private(home / "sshd.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE, str(home / "node.json")],
            cwd=state.REPO_ROOT,
            env=node_server_environment(config.home),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # the node outlives this command and its terminal
        )


def _wait_for_pid_files(configs: list[NodeConfig], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(zip(configs, procs, strict=True))
    while pending:
        for config, proc in list(pending):
            if Path(config.pid_file).exists():
                pending.remove((config, proc))
            elif proc.poll() is not None:
                raise UsageError(_last_log_line(config) or f"{config.name} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise OperationError(f"{pending[0][0].name} did not start within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def _last_log_line(config: NodeConfig) -> str:
    try:
        lines = (Path(config.home) / "sshd.log").read_text().strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------------- supervisor

SUPERVISOR_PID = "supervisor.pid"
SUPERVISOR_LOG = "supervisor.log"


def start_supervisor(stack: str) -> int:
    """Start the stack's supervisor (supervisor.py) in a session of its own; its pid."""
    with state.open_private(state.stack_file(stack, SUPERVISOR_LOG), "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, stack],
            cwd=state.REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    # Written here, before `up` lets go of the stack lock, not by the supervisor once it runs: an `up` that
    # waited on the lock finds the stack supervised (`--spot`), and a `down` right after finds what to end.
    state.write_atomic(state.stack_file(stack, SUPERVISOR_PID), f"{process.pid}\n")
    return process.pid


def supervisor_pid(stack: str) -> int | None:
    """The running supervisor's pid (really it: pids are reused)."""
    try:
        pid = int(state.stack_file(stack, SUPERVISOR_PID).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid > 1 and procs.alive(pid) and SUPERVISOR_MODULE in (procfs.command_line(pid) or []) else None


def supervised(stack: str) -> bool:
    return state.stack_file(stack, SUPERVISOR_PID).exists()


def stop_supervisor(stack: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """End the supervisor, and a bootstrap it runs (its process group), before the nodes are stopped."""
    pid = supervisor_pid(stack)
    state.stack_file(stack, SUPERVISOR_PID).unlink(missing_ok=True)
    pids = {pid} if pid is not None else set()
    pids |= set(orphans.supervisors(stack))  # its pid file gone with the stack's folder
    for each in pids:
        _kill_group(each, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(procs.alive(each) for each in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for each in pids:
        _kill_group(each, signal.SIGKILL)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


# -------------------------------------------------------------------------------------------- down


@dataclass(frozen=True)
class Teardown:
    """What stopping the nodes did."""

    stopped: int
    """Node servers that were running and were stopped."""
    listening: list[str]
    """`address:port` still accepting connections afterwards; empty when all is gone."""
    was_up: bool = True
    """False when there was no cluster state to remove."""
    orphaned: orphans.Orphans | None = None
    """What ran of a stack whose state folder was gone (found and stopped without it)."""


def down(stack: str) -> Teardown:
    """Stop every node, prove no port listens, remove the state; keeps runs/ and the ledger."""
    if not (state.stack_dir(stack) / "nodes").exists() and not inventory.inventory_path(stack).exists():
        left = orphans.find(stack)
        if left.count:
            return _down_without_state(stack, left)
        state.clear_current_stack(stack)
        return Teardown(0, [], was_up=False)
    endpoints = _node_endpoints(stack)
    stopped = stop_nodes(stack)
    listening = [f"{a}:{p}" for a, p in endpoints if _accepts_connections(a, p)]
    if not listening:
        remove_state(stack)
    return Teardown(stopped, listening)


def _down_without_state(stack: str, left: orphans.Orphans) -> Teardown:
    """A stack whose state folder was deleted while it ran: its processes, found without it
    (infra/providers/local/orphans.py), stopped as `stop_nodes` stops them; what still runs after that
    is named in `listening` as pids."""
    stopped = stop_nodes(stack)  # the supervisor, then the node servers: they end their nodes' sessions
    for pid in left.others:
        if procs.alive(pid):
            _kill(pid, signal.SIGKILL)
    again = orphans.find(stack)  # anything started meanwhile
    for pid in again.others:
        _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while orphans.find(stack).count and time.monotonic() < deadline:
        time.sleep(0.05)
    still = orphans.find(stack)
    remove_state(stack)
    listening = [f"pid {pid}" for pid in sorted(set(still.servers + still.supervisors + still.others))]
    return Teardown(stopped, listening, orphaned=left)


def stop_nodes(stack: str) -> int:
    """SIGTERM every node server (they end their sessions and daemons), SIGKILL stragglers.

    Servers are found by their pid files and also by their command line, so that one whose pid file
    is not written yet (an `up` killed right after spawning it) or was deleted is stopped too."""
    stop_supervisor(stack)  # first: it would replace the nodes as they go
    pids = sorted({pid for pid in _server_pids(stack) if _is_node_server(pid)} | set(orphans.node_servers(stack)))
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(procs.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in pids:
        if procs.alive(pid):
            _kill(pid, signal.SIGKILL)
    _end_registered_daemons(stack)
    return len(pids)


def _end_registered_daemons(stack: str) -> None:
    """A node server that was killed outright could not end what it started; do it for it."""
    for home in sorted((state.stack_dir(stack) / "nodes").glob("node-*")):
        end_node_leftovers(home)


def end_node_leftovers(home: Path) -> None:
    """What a node's server ends when it powers off, for a server that could not (killed outright, or
    stopped before it finished): its registered daemons' groups, processes carrying its token, and what
    works in its ~/.gpu-cluster (Slurm's steps, in sessions of their own, with an emptied environment),
    with everything below them."""
    for path in (home / PID_REGISTRY).glob("*.pid"):
        try:
            pgid = int(path.read_text().split()[0])
            if pgid > 1:  # a job may write anything here; never signal init's group or every process
                os.killpg(pgid, signal.SIGKILL)
        except (ValueError, IndexError, OSError):
            pass
    try:
        token = json.loads((home / "node.json").read_text())["token"]
    except (OSError, ValueError, KeyError, TypeError):
        token = None
    rooted = procfs.pids_working_in(str(home / contract.HOME_DIR))
    marked = procfs.pids_with_environment(token_entry(token)) if token else []
    for pid in set(marked + rooted + procfs.descendants(rooted)):
        if pid != os.getpid():
            _kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class SharedContents:
    """What is in a local stack's shared folder (`down` says so before removing it)."""

    path: Path
    """The shared folder."""
    files: int
    """Files in it, at any depth."""
    size_bytes: int
    """Their total size."""

    def describe_size(self) -> str:
        size = float(self.size_bytes)
        for unit in ("bytes", "KiB", "MiB", "GiB"):
            if size < 1024 or unit == "GiB":
                return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
            size /= 1024
        raise AssertionError("unreachable")


def shared_contents(stack: str) -> SharedContents:
    path = shared_dir(stack)
    files, size_bytes = 0, 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                size_bytes += os.lstat(os.path.join(folder, name)).st_size
                files += 1
            except OSError:
                continue
    return SharedContents(path, files, size_bytes)


def remove_state(stack: str) -> None:
    """Everything of the stack except runs/ (logs are kept, less the temporary files of writers that
    were killed), and `.cluster/current` if it is this."""
    stack_path = state.stack_dir(stack)
    if stack_path.exists():
        for child in stack_path.iterdir():
            if child.name == state.RUNS:
                for run in [child, *(p for p in child.iterdir() if p.is_dir())]:
                    state.remove_stale_tmp_files(run)
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        if not any(stack_path.iterdir()):
            stack_path.rmdir()
    state.forget(stack)


def _node_endpoints(stack: str) -> list[tuple[str, int]]:
    endpoints = []
    for path in sorted((state.stack_dir(stack) / "nodes").glob("node-*/node.json")):
        try:
            config = json.loads(path.read_text())
            endpoints.append((config["address"], int(config["port"])))
            if config.get("metadata_port"):
                endpoints.append((config["address"], int(config["metadata_port"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return endpoints


def _server_pids(stack: str) -> list[int]:
    found = (read_pid(path) for path in sorted((state.stack_dir(stack) / "nodes").glob("node-*/sshd.pid")))
    return [pid for pid, _ in filter(None, found)]


def stacks_without_inventory() -> list[str]:
    """Local stacks with node folders but no inventory: what an `up` killed before it finished leaves."""
    root = state.state_root()
    folders = sorted(p.parent.name for p in root.glob("*/nodes") if p.is_dir()) if root.is_dir() else []
    return [
        stack for stack in folders if state.STACK_NAME.fullmatch(stack) and not inventory.inventory_path(stack).exists()
    ]


def _is_node_server(pid: int) -> bool:
    """Alive and really our node server (pid files outlive reboots and pids get reused)."""
    if not procs.alive(pid):
        return False
    if not procfs.has_proc():
        return True  # no procfs (macOS): trust the pid
    return any(SERVER_MODULE in arg for arg in procfs.command_line(pid))


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _accepts_connections(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address, port)) == 0


# ------------------------------------------------------------------------------------------ status


def status(cluster: ClusterInfo) -> list[NodeStatus]:
    probes = ssh.probe_nodes(cluster)
    started = _server_start_times(cluster.stack)
    now = time.time()
    rows = []
    for probe in probes:
        started_at = started.get(probe.node.name)
        uptime = now - started_at if started_at and probe.reachable else None
        rows.append(
            NodeStatus(
                name=probe.node.name,
                address=f"{probe.node.public_ip}:{probe.node.ssh_port}",
                state="up" if probe.reachable else "down",
                reachable=probe.reachable,
                round_trip_ms=round(probe.round_trip_ms, 1),
                uptime_s=None if uptime is None else round(uptime),
                error=probe.error,
            )
        )
    return rows


def _server_start_times(stack: str) -> dict[str, float]:
    times = {}
    for path in (state.stack_dir(stack) / "nodes").glob("node-*/sshd.pid"):
        found = read_pid(path)
        if found is not None and _is_node_server(found[0]):
            times[path.parent.name] = found[1]
    return times


def stop_record(stack: str) -> dict:
    """The watchdog's stop marker (`reason`, `at`, ...), or {} if it did not power the cluster off."""
    try:
        record = json.loads((shared_dir(stack) / contract.STOP_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def stacks_that_stopped_themselves() -> list[str]:
    """Local stacks whose watchdog powered them off (their state is still there until `down`)."""
    return sorted(p.parents[2].name for p in state.state_root().glob(f"*/shared/{contract.STOP_MARKER}"))


def stop_reason(stack: str) -> str:
    """Why the watchdog powered this cluster off, or '' if it did not."""
    record = stop_record(stack)
    return str(record.get("reason") or "stopped") if record else ""


# ----------------------------------------------------------------------------------------- provider


class LocalProvider(Provider):
    """N SSH-server nodes on this machine's loopback."""

    name = "local"
    accepts = frozenset({"nodes", "instanceType", "spot", "maxTotalUsd", "idleMinutes", "bind", "ssh_port", "gpus"})
    what = "the local provider"
    why_not = "the nodes run on this machine, cost nothing and need no confirmation"
    flag = "--local"
    default_stack = state.LOCAL_STACK

    def check(self, request: UpRequest) -> None:
        wanted = self._stack_config(request)
        check_addresses(request.bind, DEFAULT_SSH_PORT if request.ssh_port is None else request.ssh_port, wanted.nodes)
        check_gpus(request.gpus)

    def _stack_config(self, request: UpRequest) -> StackConfig:
        return stack_config.load_stack(request.stack, request.overrides)

    def up(self, request: UpRequest, say) -> UpResult:
        wanted = self._stack_config(request)
        asked = {
            name
            for name, value in (
                ("nodes", request.overrides.get("nodes")),
                ("instance_type", request.overrides.get("instanceType")),
                ("first_address", request.bind),
                ("ssh_port", request.ssh_port),
                ("spot", request.overrides.get("spot")),
                ("gpus", request.gpus),
            )
            if value is not None
        }
        options = LocalOptions(
            request.stack,
            wanted.nodes,
            wanted.instance_type,
            request.bind,
            DEFAULT_SSH_PORT if request.ssh_port is None else request.ssh_port,
            spot=wanted.spot,
            gpus=check_gpus(request.gpus),
            asked=frozenset(asked),
        )
        cluster, created = up(options, request.timeline)
        return UpResult(cluster, created)

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        wanted = self._stack_config(request)
        return wanted, costs.reference_hourly_usd(wanted.instance_type, wanted.region, wanted.nodes)

    def down(self, stack: str, say) -> DownReport:
        stopped_itself = stop_record(stack)
        shared = shared_contents(stack)
        if shared.files:
            say(
                f"removing {report.relative(shared.path)}: {report.plural(shared.files, 'file')}, "
                f"{shared.describe_size()} (datasets, checkpoints, anything jobs wrote there)"
            )
        started = time.perf_counter()
        result = down(stack)
        elapsed = time.perf_counter() - started
        if result.listening:
            still = "still running after down" if result.orphaned else "still listening after down"
            say(f"{still}: {', '.join(result.listening)}")
            return DownReport(1, stopped_itself=stopped_itself)
        if result.orphaned is not None:
            left = result.orphaned
            others = f"{len(left.others)} process{'' if len(left.others) == 1 else 'es'}"
            say(
                f"stack '{stack}': its state folder {report.relative(state.stack_dir(stack))} was gone; stopped "
                f"what still ran of it: {report.plural(len(left.servers), 'node server')}, "
                f"{report.plural(len(left.supervisors), 'supervisor')}, "
                f"{others} its nodes started (sessions, Slurm's daemons and jobs)"
            )
        elif not result.was_up:
            say(f"nothing to do: stack '{stack}' is not up")
        elif stopped_itself:
            say(f"stack '{stack}' had stopped itself ({stopped_itself.get('reason', 'stopped')}); state removed")
        elif result.stopped == 0:
            say(f"stack '{stack}': no node was running; state removed, run logs kept")
        else:
            say(
                f"stack '{stack}' is down: {report.plural(result.stopped, 'node')} stopped in {elapsed:.1f} s, "
                "no port left listening"
            )
        return DownReport(0, stopped_itself=stopped_itself)

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        return status(cluster), stop_record(cluster.stack)

    def self_stops(self) -> dict[str, dict]:
        return {stack: stop_record(stack) for stack in stacks_that_stopped_themselves()}

    def interrupted_stacks(self) -> list[str]:
        return stacks_without_inventory()

    def replacement_problem(self, cluster: ClusterInfo) -> str:
        if supervised(cluster.stack):
            return ""  # the supervisor replaces a node whose server is gone
        return f"stack {cluster.stack!r} was started without --spot, so nothing replaces a node (up --local --spot)"

    def spot_drill(
        self, cluster: ClusterInfo, node: str, notice_s: float, say, fis_role: str | None = None, yes: bool = False
    ) -> None:
        if fis_role:
            raise UsageError(
                f"--fis-role is for AWS (FIS interrupts an EC2 instance); stack {cluster.stack!r} is local: "
                "leave it out and the drill posts the notice on the node's own metadata service"
            )
        name = cluster.node(node).name
        if name not in _server_start_times(cluster.stack):
            raise UsageError(f"{name} is not running (reclaimed already?): python deploy.py status shows the nodes")
        if not yes and not supervised(cluster.stack):
            raise UsageError(
                f"stack {cluster.stack!r} was started without --spot: nothing will replace {name} once it is "
                "reclaimed, and a run that needs it waits for good; pass --yes to reclaim it anyway, or drill "
                "a stack started with up --local --spot"
            )
        notice = metadata.post_notice(notice_path(cluster.stack, name), notice_s)
        say(
            f"{name}: spot interruption notice posted on its metadata service; "
            f"reclaimed at {notice['time']} (in {notice_s:g} s)"
        )
