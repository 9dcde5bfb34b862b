"""SSH from the operator's machine to the nodes, for provisioning: readiness waits and status probes.

Only the inventory's key and pinned `known_hosts` are used; the user's agent and ~/.ssh/config are not.
(`fab` tasks use Fabric instead; this module serves `deploy.py`.)
"""

import asyncio
import time
from dataclasses import dataclass

import asyncssh

from infra.inventory import ClusterInfo, NodeInfo


@dataclass(frozen=True)
class NodeProbe:
    """What one SSH round trip to a node found."""

    node: NodeInfo
    """The node asked."""
    reachable: bool
    """True when a command ran there and exited 0."""
    round_trip_ms: float
    """Connect, authenticate, run `true`, and close."""
    error: str
    """Why it was not reachable; empty when it was."""


def connect(cluster: ClusterInfo, node: NodeInfo, timeout_s: float = 10.0):
    return asyncssh.connect(
        node.public_ip,
        node.ssh_port,
        username=node.ssh_user,
        client_keys=[cluster.ssh_key],
        known_hosts=cluster.known_hosts,
        agent_path=None,
        config=None,
        connect_timeout=timeout_s,
    )


async def run(cluster: ClusterInfo, node: NodeInfo, command: str, timeout_s: float = 10.0):
    """Run `command` on `node`; returns asyncssh's completed process (exit_status, stdout, stderr)."""
    async with connect(cluster, node, timeout_s) as conn:
        return await asyncio.wait_for(conn.run(command, check=False), timeout_s)


async def _probe(cluster: ClusterInfo, node: NodeInfo, timeout_s: float) -> NodeProbe:
    start = time.perf_counter()
    try:
        result = await run(cluster, node, "true", timeout_s)
        error = "" if result.exit_status == 0 else f"'true' exited {result.exit_status}"
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        error = describe(exc)
    elapsed_ms = (time.perf_counter() - start) * 1000
    return NodeProbe(node, not error, elapsed_ms, error)


def probe_nodes(cluster: ClusterInfo, timeout_s: float = 5.0) -> list[NodeProbe]:
    """One real SSH round trip to every node, all at once."""

    async def probe_all():
        return await asyncio.gather(*(_probe(cluster, n, timeout_s) for n in cluster.nodes))

    return asyncio.run(probe_all())


async def _wait_one(cluster: ClusterInfo, node: NodeInfo, deadline: float, poll_s: float) -> None:
    while True:
        probe = await _probe(cluster, node, timeout_s=max(0.5, min(10.0, deadline - time.monotonic())))
        if probe.reachable:
            return
        if time.monotonic() + poll_s > deadline:
            raise TimeoutError(f"{node.name} ({node.public_ip}:{node.ssh_port}): {probe.error}")
        await asyncio.sleep(poll_s)


def wait_for_ssh(cluster: ClusterInfo, timeout_s: float, poll_s: float = 0.05) -> None:
    """Return once every node answers a real SSH round trip; TimeoutError names the first that did not."""
    deadline = time.monotonic() + timeout_s

    async def wait_all():
        await asyncio.gather(*(_wait_one(cluster, n, deadline, poll_s) for n in cluster.nodes))

    asyncio.run(wait_all())


async def fetch_host_key(address: str, port: int, timeout_s: float = 10.0) -> str:
    """The host key a server offers, as `ssh-ed25519 AAAA...` (trust on first use; AWS only)."""
    key = await asyncio.wait_for(asyncssh.get_server_host_key(address, port), timeout_s)
    if key is None:
        raise OSError(f"{address}:{port} offered no host key")
    return key.export_public_key().decode().strip()


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return "host key does not match the pinned known_hosts"
    if isinstance(exc, asyncssh.PermissionDenied):
        return "the cluster key was refused"
    return str(exc) or type(exc).__name__
