"""SSH from the operator's machine to the nodes: the one connection policy, and provisioning's probes.

The policy, for every client the project uses: only the cluster's key is offered, only the pinned
`known_hosts` is trusted (an unknown or changed host key is refused), the user's agent and
~/.ssh/config are not read, and a connection attempt gives up after `CONNECT_TIMEOUT_S`.
`asyncssh_options` (provisioning, status, the hosts file's checks), `paramiko_options` (Fabric's
`connect_kwargs`, for `fab`: remote/connect.py) and `openssh_settings` (`deploy.py ssh` and `ssh-config`) spell it for
each, and `describe` is the one sentence for a connection's failure, whichever client raised it.
asyncssh loads only where it is used: `fab` (Fabric) imports this module for the policy alone.
"""

import asyncio
import socket
import sys
import time
from dataclasses import dataclass

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


CONNECT_TIMEOUT_S = 10.0


def asyncssh_options(key: str, known_hosts: str | None, user: str, timeout_s: float = CONNECT_TIMEOUT_S) -> dict:
    """asyncssh.connect's keywords. `known_hosts=None` is for `up --hosts` before any key is pinned: the
    key offered is recorded and shown, and pinned from then on."""
    return {
        "username": user,
        "client_keys": [key],
        "known_hosts": known_hosts,
        "agent_path": None,
        "config": None,
        "connect_timeout": timeout_s,
    }


def paramiko_options(key: str) -> dict:
    """paramiko's (Fabric's `connect_kwargs`); the caller loads the pinned known_hosts and sets
    paramiko's RejectPolicy, which paramiko takes as calls rather than keywords."""
    return {"key_filename": key, "look_for_keys": False, "allow_agent": False}


def openssh_settings(key: str, known_hosts: str) -> list[tuple[str, str]]:
    """Stock OpenSSH's (`ssh`, `scp`, `rsync -e ssh`), as ssh_config keywords: the key alone, the pinned
    hosts alone, no prompt for a new key, no agent forwarded."""
    return [
        ("IdentityFile", key),
        ("IdentitiesOnly", "yes"),
        ("UserKnownHostsFile", known_hosts),
        ("GlobalKnownHostsFile", "/dev/null"),
        ("StrictHostKeyChecking", "yes"),
        ("ForwardAgent", "no"),
        ("ConnectTimeout", f"{CONNECT_TIMEOUT_S:g}"),
        ("LogLevel", "ERROR"),
    ]


def openssh_options(key: str, known_hosts: str) -> list[str]:
    """The policy as `ssh` command-line options (`deploy.py ssh`)."""
    settings = openssh_settings(key, known_hosts)
    return [word for name, value in settings for word in ("-o", f"{name}={_config_word(value)}")]


def openssh_config(cluster: ClusterInfo) -> str:
    """An ssh_config block per node (`deploy.py ssh-config`): `ssh -F FILE node-1`, `scp -F FILE`,
    `rsync -e "ssh -F FILE"` and editors' remote modes reach the nodes under the same policy. Each node
    answers to `node-i` and `<stack>-node-i` (the second stays unique where several stacks' blocks are
    included in one config)."""
    lines = [f"# gpu-cluster stack '{cluster.stack}' ({cluster.provider}), from: python deploy.py ssh-config"]
    for node in cluster.nodes:
        lines += [
            "",
            f"Host {node.name} {cluster.stack}-{node.name}",
            f"  HostName {node.public_ip}",
            f"  Port {node.ssh_port}",
            f"  User {_config_word(node.ssh_user)}",
        ]
        lines += [
            f"  {name} {_config_word(value)}" for name, value in openssh_settings(cluster.ssh_key, cluster.known_hosts)
        ]
    return "\n".join(lines) + "\n"


def _config_word(value: str) -> str:
    """A value as ssh_config reads it: in double quotes where it holds a space (a path under "My Files")."""
    if '"' in value or "\n" in value:
        raise ValueError(f"{value!r} cannot be written in an ssh_config file")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def connect(cluster: ClusterInfo, node: NodeInfo, timeout_s: float = CONNECT_TIMEOUT_S):
    import asyncssh

    return asyncssh.connect(
        node.public_ip,
        node.ssh_port,
        **asyncssh_options(cluster.ssh_key, cluster.known_hosts, node.ssh_user, timeout_s),
    )


async def run(
    cluster: ClusterInfo, node: NodeInfo, command: str, timeout_s: float = 10.0, encoding: str | None = "utf-8"
):
    """Run `command` on `node`; returns asyncssh's completed process (exit_status, stdout, stderr: text, or
    bytes with `encoding` None)."""
    async with connect(cluster, node, timeout_s) as conn:
        return await asyncio.wait_for(conn.run(command, check=False, encoding=encoding), timeout_s)


async def _probe(cluster: ClusterInfo, node: NodeInfo, timeout_s: float) -> NodeProbe:
    start = time.perf_counter()
    try:
        result = await run(cluster, node, "true", timeout_s)
        error = "" if result.exit_status == 0 else f"'true' exited {result.exit_status}"
    except (OSError, sys.modules["asyncssh"].Error, asyncio.TimeoutError) as exc:  # connect() loaded it
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
    import asyncssh

    key = await asyncio.wait_for(asyncssh.get_server_host_key(address, port), timeout_s)
    if key is None:
        raise OSError(f"{address}:{port} offered no host key")
    return key.export_public_key().decode().strip()


def connection_errors() -> tuple[type[BaseException], ...]:
    """What a failed asyncssh connection or command raises (asyncssh loaded here, where one is at hand)."""
    import asyncssh

    return (OSError, asyncssh.Error, asyncio.TimeoutError)


def describe(exc: BaseException | None) -> str:
    """Why a connection failed, in the words a user reads, from asyncssh's or paramiko's exception."""
    # An exception of a client that was never loaded cannot be at hand: look only at the loaded ones.
    asyncssh, paramiko = sys.modules.get("asyncssh"), sys.modules.get("paramiko")
    if paramiko and isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError) and exc.errors:
        exc = next(iter(exc.errors.values()))  # the per-address reason, e.g. ConnectionRefusedError
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if (
        (asyncssh and isinstance(exc, asyncssh.HostKeyNotVerifiable))
        or (paramiko and isinstance(exc, paramiko.BadHostKeyException))
        or "not found in known_hosts" in str(exc)
    ):
        return "host key does not match the pinned known_hosts"
    if (asyncssh and isinstance(exc, asyncssh.PermissionDenied)) or (
        paramiko and isinstance(exc, paramiko.AuthenticationException)
    ):
        return "the cluster key was refused"
    return str(exc) or type(exc).__name__
