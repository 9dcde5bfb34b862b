"""Fabric connections to the inventory's nodes: its key, its pinned host keys, one thread per node.

A connection that drops (the SSH transport, not the command) is reopened and the step retried with
backoff; steps given to `retrying` must therefore be safe to repeat.
"""

import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import paramiko
from fabric import Config, Connection
from invoke.exceptions import UnexpectedExit

from infra import ssh
from infra.errors import UsageError
from infra.inventory import ClusterInfo, NodeInfo
from infra.ssh import describe
from remote.stream import Feed, copy_channel, say

T = TypeVar("T")
NO_EXIT_STATUS = -1  # what paramiko reports for a channel that closed without an exit status
CONNECT_TIMEOUT_S = ssh.CONNECT_TIMEOUT_S
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
# What a dropped or refused connection raises (socket errors are OSErrors); a command's own failure is
# not among these, nor is a file that is missing or unreadable, which no retry will mend.
CONNECTION_ERRORS = (paramiko.SSHException, EOFError, ConnectionError, socket.timeout, OSError)
NOT_CONNECTION_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _handle_exit_signal(channel: paramiko.Channel, message: paramiko.Message) -> bool:
    """OpenSSH reports a command killed by a signal as `exit-signal` (RFC 4254 6.10), which paramiko
    ignores: the exit status stays -1, as for a dropped connection. Record it as a shell would,
    128 + the signal's number, so a stopped job is not taken for a lost node."""
    start = message.packet.tell()
    if message.get_text() != "exit-signal":
        message.packet.seek(start)
        return False
    message.get_boolean()  # want-reply: never set for exit-signal
    name = message.get_text()
    number = getattr(signal, f"SIG{name}", None)
    channel.exit_status = 128 + int(number) if number is not None else 255
    channel.status_event.set()
    return True


def _install_exit_signal_handling() -> None:
    """Put `_handle_exit_signal` in front of paramiko's channel-request handler (the transport
    dispatches through its own table)."""
    table = paramiko.Transport._channel_handler_table
    original = table[paramiko.common.MSG_CHANNEL_REQUEST]
    if getattr(original, "handles_exit_signal", False):
        return

    def handle_request(channel, message):
        if not _handle_exit_signal(channel, message):
            original(channel, message)

    handle_request.handles_exit_signal = True  # type: ignore[attr-defined]  # a marker on our own function
    table[paramiko.common.MSG_CHANNEL_REQUEST] = handle_request


_install_exit_signal_handling()


def connect(cluster: ClusterInfo, node: NodeInfo) -> Connection:
    """An unopened connection under the one SSH policy (infra/ssh.py): the cluster key, the pinned host keys."""
    conn = Connection(
        node.public_ip,
        port=node.ssh_port,
        user=node.ssh_user,
        connect_timeout=CONNECT_TIMEOUT_S,
        connect_kwargs=ssh.paramiko_options(cluster.ssh_key),
        config=Config(overrides={"run": {"in_stream": False}, "load_ssh_configs": False}),
    )
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    conn.client.load_host_keys(cluster.known_hosts)
    return conn


class NodeSession:
    """One node's connection, reopened on demand, with a retry loop for idempotent steps."""

    def __init__(self, cluster: ClusterInfo, node: NodeInfo):
        self.cluster, self.node = cluster, node
        self.conn = connect(cluster, node)

    def run(self, command: str, **kwargs):
        """Run a command (under umask 077); a connection that closes before the command reports its exit status
        raises ConnectionResetError (so `retrying` retries it) instead of passing for a failure."""
        kwargs.setdefault("hide", True)
        kwargs.setdefault("in_stream", False)
        warn = kwargs.pop("warn", True)
        # umask 077: what fab's commands and jobs create on a node is the node user's alone (hosts with
        # other users on them included), as everything under .cluster is here.
        result = self.conn.run(
            f"umask 077; {command}", warn=True, **kwargs
        )  # a lost connection must not pass for a failure
        if result.exited == NO_EXIT_STATUS:
            raise ConnectionResetError("the connection closed before the command finished")
        if not warn and result.exited != 0:
            raise UnexpectedExit(result)
        return result

    def stream(self, command: str, stream: Feed, errors: Feed | None = None) -> int:
        """Run a command, its output (stderr merged in, or into `errors` where given) copied into `stream`
        as it comes, in large reads straight from the channel (`copy_channel`); its exit code.
        ConnectionResetError as for `run`."""
        self.conn.open()
        channel = self.conn.client.get_transport().open_session()
        try:
            channel.set_combine_stderr(errors is None)
            channel.exec_command(command)
            code = copy_channel(channel, stream, errors)
        finally:
            channel.close()
        if code == NO_EXIT_STATUS:
            raise ConnectionResetError("the connection closed before the command finished")
        return code

    def run_with_input(self, command: str, data: bytes) -> tuple[int, str, str]:
        """Run `command` (under umask 077, as `run` does) with `data` on its stdin, sent whole (invoke's
        `in_stream` sends a byte per 10 ms); its exit code, stdout and stderr (small: read at the end)."""
        self.conn.open()
        channel = self.conn.client.get_transport().open_session()
        try:
            channel.exec_command(f"umask 077; {command}")
            channel.sendall(data)
            channel.shutdown_write()
            out = channel.makefile("rb").read().decode(errors="replace")
            err = channel.makefile_stderr("rb").read().decode(errors="replace")
            code = channel.recv_exit_status()
        finally:
            channel.close()
        if code == NO_EXIT_STATUS:
            raise ConnectionResetError("the connection closed before the command finished")
        return code, out, err

    def retrying(
        self,
        step: Callable[["NodeSession"], T],
        on_retry: Callable[[str], None] | None = None,
        delays_s: tuple[float, ...] = RETRY_DELAYS_S,
    ) -> T:
        """Run `step(self)`, reconnecting and retrying with backoff when the connection drops."""
        for attempt, delay in enumerate((*delays_s, None)):
            try:
                return step(self)
            except CONNECTION_ERRORS as exc:
                if isinstance(exc, NOT_CONNECTION_ERRORS) or delay is None:
                    raise
                if on_retry:
                    on_retry(f"{self.node.name}: connection lost ({describe(exc)}); retry {attempt + 1} in {delay:g} s")
                time.sleep(delay)
                self.reopen()
        raise AssertionError("unreachable")

    def reopen(self) -> None:
        self.close()
        self.conn = connect(self.cluster, self.node)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # closing a half-dead transport can raise anything; it is gone either way
            pass


@dataclass(frozen=True)
class NodeResult(Generic[T]):
    """One node's outcome of a step run on every node: its value, or the exception the step raised."""

    session: "NodeSession"
    """The node's session."""
    value: T | None = None
    """What the step returned (None where it raised)."""
    error: Exception | None = None
    """What the step raised, if it did."""

    @property
    def name(self) -> str:
        return self.session.node.name

    @property
    def ok(self) -> bool:
        return self.error is None


class NodeResults(list[NodeResult[T]]):
    """Every node's NodeResult, in the sessions' order (as Fabric's GroupResult is for a Group)."""

    @property
    def succeeded(self) -> list[NodeResult[T]]:
        return [r for r in self if r.ok]

    @property
    def failed(self) -> list[NodeResult[T]]:
        return [r for r in self if not r.ok]


def on_all_nodes(sessions: list[NodeSession], step: Callable[[NodeSession], T], daemon: bool = False) -> NodeResults[T]:
    """`step` on every node at once, one thread each; what each returned or raised. `daemon`: in daemon
    threads, for best-effort work in the background (a stop after a failure), so that a node that never
    answers does not keep fab from exiting (a pool's workers are joined at the interpreter's exit)."""

    def guarded(session: NodeSession) -> NodeResult[T]:
        try:
            return NodeResult(session, value=step(session))
        except Exception as exc:  # reported per node by the caller
            return NodeResult(session, error=exc)

    if daemon:
        results: list = [None] * len(sessions)

        def work(index: int) -> None:
            results[index] = guarded(sessions[index])

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(sessions))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return NodeResults(results)
    with ThreadPoolExecutor(max_workers=max(1, len(sessions))) as pool:
        return NodeResults(pool.map(guarded, sessions))


def open_sessions(cluster: ClusterInfo, probe_command: str = "true") -> tuple[list[NodeSession], list[str]]:
    """Sessions to every node, each proven by running `probe_command` (its output is returned);
    exit 2 naming the nodes that do not answer."""
    if not Path(cluster.known_hosts).exists():  # removed by a `down` of this stack at the same moment
        raise UsageError(
            f"stack {cluster.stack!r} is being taken down or is down (its pinned host keys are gone): "
            "nothing was started; python deploy.py status says what is up"
        )
    sessions = [NodeSession(cluster, node) for node in cluster.nodes]

    def probe(session: NodeSession):
        return session.retrying(lambda s: s.run(probe_command), on_retry=say, delays_s=(0.5,))

    results = on_all_nodes(sessions, probe)
    failures = [
        f"{r.name} ({r.session.node.public_ip}:{r.session.node.ssh_port}): {describe(r.error)}"
        for r in results.failed
        if r.error is not None
    ]
    if failures:
        for session in sessions:
            session.close()
        raise UsageError(f"unreachable: {'; '.join(failures)}. Check python deploy.py status")
    return sessions, [r.value.stdout for r in results if r.value is not None]
