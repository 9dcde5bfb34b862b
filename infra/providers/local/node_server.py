"""One local node: an SSH server on a loopback address that runs commands with bash in the node's home.

    python -m infra.providers.local.node_server .cluster/local/nodes/node-0/node.json

Started in the background by `deploy.py up --local`, one process per node, with an allow-listed
environment (no credentials of the caller's). It accepts only the cluster's key, serves exec, shell
(with a PTY when asked), SFTP and scp (both protocols, with an exit status as OpenSSH gives), and
behaves like a machine that can be powered off: on SIGTERM, when the watchdog's stop marker appears
in the shared folder, or when a spot notice's time passes (a spot instance reclaimed), it ends every
process started on the node and exits. It also serves the node's instance metadata service
(metadata.py). A client that disconnects takes its command's process group with it, so a killed
session leaves no orphans. Everything it and
its commands create is private to the user (umask 077), as the state folder it lives in is.
"""

import asyncio
import fcntl
import logging
import os
import pty
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import asyncssh

from infra import state
from infra.providers.local import metadata
from infra.providers.local.node_config import PID_REGISTRY, NodeConfig, pid_text, token_entry
from node import contract, procfs

# Every shell sources the node environment, so NODE_RANK, MASTER_ADDR, CLUSTER_PYTHON are there in
# plain `ssh` sessions too: non-interactive ones through BASH_ENV (unset at once, so a job's own
# shells do not source it again over what the job set), interactive ones through the rcfile. Where
# Slurm holds the runs, the login file too, so `squeue` and `sbatch` work as typed (node/slurm_login.py).
SOURCE_ENV = "".join(f'[ -f "$HOME/{path}" ] && . "$HOME/{path}"\n' for path in (contract.ENV, contract.SLURM_LOGIN))

TERMINATE_GRACE_S = 3.0
GUARD_POLL_S = 1.0

log = logging.getLogger("node")


class ProcessTable:
    """Process groups started by sessions on this node, so power-off can end them all."""

    def __init__(self, home: Path, token: str):
        self.session_groups: set[int] = set()
        self.home = home
        self.registry = home / PID_REGISTRY
        self.token = token

    def registered_daemons(self) -> list[int]:
        pids = []
        for path in self.registry.glob("*.pid"):
            try:
                pids.append(int(path.read_text().split()[0]))
            except (ValueError, IndexError, OSError):
                continue
        # A job can write anything here: 0, 1 or a negative number would signal this server's own
        # group, init's, or every process, so only real process group ids of others are kept.
        return [pid for pid in pids if pid > 1 and pid != os.getpid()]

    async def end_all(self) -> None:
        """Everything started on the node: session groups and daemons get SIGTERM and a grace
        period; whatever still carries the node's token after that (processes that started their
        own sessions, such as torchrun's workers) is killed, as a power-off would, and so is what
        works in the node's `~/.gpu-cluster`, with everything below it: processes a daemon started in
        sessions of their own with an emptied environment (Slurm's slurmstepd, and the job steps under
        it)."""
        groups = set(self.session_groups) | set(self.registered_daemons())
        await asyncio.gather(*(terminate_group(pgid) for pgid in groups))
        rooted = procfs.pids_working_in(str(self.home / contract.HOME_DIR))
        for pid in procfs.pids_with_environment(token_entry(self.token)) + rooted + procfs.descendants(rooted):
            _signal_pid(pid, signal.SIGKILL)


async def terminate_group(pgid: int, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left after `grace_s`."""
    if not _signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not procfs.group_alive(pgid):
            return
        await asyncio.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class NodeSFTPServer(asyncssh.SFTPServer):
    """asyncssh's SFTP server, ending as OpenSSH's does and keeping the node's files private.

    OpenSSH's sftp-server exits 0 when the client ends the session and sshd sends that exit status;
    asyncssh only closes the channel, and stock `scp` (SFTP protocol by default since OpenSSH 9.0)
    copies the file and then exits 1 for want of a status. A chmod from the client (Fabric's `put`
    copies the local mode) keeps only the owner's bits, as the umask does for files created here.
    """

    def exit(self) -> None:
        try:
            self.channel.exit(0)
        except OSError:  # the client went away first: there is no one to tell
            pass

    def setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        super().setstat(path, _owner_only(attrs))

    def lsetstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        super().lsetstat(path, _owner_only(attrs))

    def fsetstat(self, file_obj: object, attrs: asyncssh.SFTPAttrs) -> None:
        super().fsetstat(file_obj, _owner_only(attrs))


def _owner_only(attrs: asyncssh.SFTPAttrs) -> asyncssh.SFTPAttrs:
    if attrs.permissions is not None:
        attrs.permissions &= ~0o077
    return attrs


class NodeSSHServer(asyncssh.SSHServer):
    """Authentication for one connection: the cluster's key and user, nothing else."""

    def __init__(self, config: NodeConfig, authorized: asyncssh.SSHKey, connections: set | None = None):
        self.config = config
        self.authorized = authorized
        self.connections = connections if connections is not None else set()
        """Every open connection of the node, which its power-off drops."""

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        peer = conn.get_extra_info("peername")
        log.info("connection from %s", peer[0] if peer else "?")
        self.conn = conn
        self.connections.add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(getattr(self, "conn", None))

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        accepted = username == self.config.user and key.public_data == self.authorized.public_data
        if not accepted:
            log.warning("refused key for user %r", username)
        return accepted


class Node:
    """The running node: its sessions, its guard, and its power switch."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.home = Path(config.home)
        self.processes = ProcessTable(self.home, config.token)
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self.metadata_endpoint = f"http://{config.address}:{config.metadata_port}" if config.metadata_port else ""

    def session_env(self, process: asyncssh.SSHServerProcess) -> dict[str, str]:
        cfg = self.config
        env = {
            "HOME": cfg.home,
            "USER": cfg.user,
            "LOGNAME": cfg.user,
            "SHELL": "/bin/bash",
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "CLUSTER_SHARED_DIR": cfg.shared_dir,
            "CLUSTER_NODE": cfg.name,
            "CLUSTER_NODE_TOKEN": cfg.token,
            # Local nodes are CPU nodes: two "nodes" on one GPU would break NCCL.
            "CUDA_VISIBLE_DEVICES": "",
            "BASH_ENV": str(self.home / contract.HOME_DIR / "bash_env"),
        }
        if self.metadata_endpoint:
            env[contract.METADATA_ENDPOINT_VARIABLE] = self.metadata_endpoint
        env.update(process.env)
        if process.term_type:
            env["TERM"] = process.term_type
        return env

    def write_shell_files(self) -> None:
        """BASH_ENV for non-interactive shells; the interactive shell's rc: the usual files, the node
        environment, then a prompt that names the node."""
        folder = self.home / contract.HOME_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bash_env").write_text("unset BASH_ENV\n" + SOURCE_ENV)
        (folder / "bashrc").write_text(
            "unset BASH_ENV\n"
            "[ -f /etc/bash.bashrc ] && . /etc/bash.bashrc\n"
            '[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n' + SOURCE_ENV + f"PS1='\\u@{self.config.name}:\\w\\$ '\n"
        )

    async def handle(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command
        if command is not None:
            argv = ["bash", "-c", command]
        elif process.term_type:
            argv = ["bash", "--rcfile", str(self.home / contract.HOME_DIR / "bashrc"), "-i"]
        else:
            argv = ["bash", "-s"]  # no terminal: a script on stdin
        log.info("%s: %s", "pty" if process.term_type else "exec", command or "<shell>")
        try:
            if process.term_type:
                await self.run_with_pty(process, argv)
            else:
                await self.run_with_pipes(process, argv)
        except Exception:
            log.exception("session failed")
            process.exit(255)

    async def run_with_pipes(self, process: asyncssh.SSHServerProcess, argv: list[str]) -> None:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.config.home,
            env=self.session_env(process),
            start_new_session=True,
        )
        output = asyncio.gather(_copy_stream(proc.stdout, process.stdout), _copy_stream(proc.stderr, process.stderr))
        await self.supervise(process, proc, output, stdin=_feed_pipe(process, proc))

    async def run_with_pty(self, process: asyncssh.SSHServerProcess, argv: list[str]) -> None:
        master, slave = pty.openpty()
        _set_window(master, process.term_size)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=self.config.home,
            env=self.session_env(process),
            preexec_fn=_take_terminal,
        )
        os.close(slave)
        try:
            output = asyncio.ensure_future(_copy_pty(master, process.stdout))
            await self.supervise(process, proc, output, stdin=_feed_pty(process, master, proc.pid))
        finally:
            os.close(master)

    async def supervise(self, process, proc, output, stdin) -> None:
        """Run until the command's output ends (then report its exit) or the client goes away."""
        self.processes.session_groups.add(proc.pid)
        stdin_task = asyncio.ensure_future(stdin)
        closed = asyncio.ensure_future(process.channel.wait_closed())
        try:
            await asyncio.wait({output, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not output.done():
                log.info("client left; ending process group %d", proc.pid)
                await terminate_group(proc.pid)
                return
            returncode = await proc.wait()
            process.exit(returncode if returncode >= 0 else 128 - returncode)
        finally:
            self.processes.session_groups.discard(proc.pid)
            for task in (stdin_task, closed, output):
                task.cancel()

    async def guard(self) -> None:
        """Power off when the watchdog's stop marker appears, as an AWS node's guard timer does, or this
        node's power-off marker, written since it started (`--on-straggler replace`), or when the spot
        notice's time has passed, as EC2 reclaims a spot instance."""
        marker = Path(self.config.shared_dir) / contract.STOP_MARKER
        mine = Path(self.config.shared_dir) / contract.power_off_marker(self.config.name)
        while not self.stopping.is_set():
            if marker.exists():
                log.warning("stop marker %s found: powering off", marker)
                self.stopping.set()
                return
            if _written_since(mine, self.started_at):
                log.warning("power-off marker %s found: powering off", mine)
                self.stopping.set()
                return
            if self.config.notice_file and metadata.reclaim_due(Path(self.config.notice_file)):
                log.warning("the spot notice's time has passed: the node is reclaimed")
                self.stopping.set()
                return
            try:
                await asyncio.wait_for(self.stopping.wait(), GUARD_POLL_S)
            except asyncio.TimeoutError:
                pass


def _written_since(path: Path, started_at: float) -> bool:
    try:
        return path.stat().st_mtime >= started_at
    except OSError:
        return False


async def _copy_stream(reader: asyncio.StreamReader | None, writer) -> None:
    while reader is not None and (data := await reader.read(65536)):
        writer.write(data)
        await writer.drain()


async def _feed_pipe(process, proc) -> None:
    """Client stdin to the command; client signals to its process group."""
    try:
        while True:
            try:
                data = await process.stdin.read(65536)
            except asyncssh.SignalReceived as exc:
                _forward_signal(proc.pid, exc.signal)
                continue
            except (asyncssh.TerminalSizeChanged, asyncssh.BreakReceived):
                continue
            if not data:
                break
            proc.stdin.write(data)
            await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError, asyncssh.Error):
        pass
    finally:
        if not proc.stdin.is_closing():
            proc.stdin.close()


async def _feed_pty(process, master: int, pgid: int) -> None:
    while True:
        try:
            data = await process.stdin.read(65536)
        except asyncssh.TerminalSizeChanged as exc:
            _set_window(master, (exc.width, exc.height, exc.pixwidth, exc.pixheight))
            continue
        except asyncssh.SignalReceived as exc:
            _forward_signal(pgid, exc.signal)
            continue
        except (asyncssh.BreakReceived, asyncssh.Error):
            continue
        if not data:
            return
        os.write(master, data)


async def _copy_pty(master: int, writer) -> None:
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO once the shell has exited and the terminal closed
            data = b""
        if not data:
            loop.remove_reader(master)
        chunks.put_nowait(data)

    loop.add_reader(master, readable)
    try:
        while data := await chunks.get():
            writer.write(data)
    finally:
        loop.remove_reader(master)


def _forward_signal(pgid: int, name: str) -> None:
    sig = getattr(signal, f"SIG{name}", None)
    if sig is not None:
        _signal_group(pgid, sig)


def _take_terminal() -> None:
    """In the child: a new session whose controlling terminal is the PTY on stdin."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_window(fd: int, size) -> None:
    width, height, pixwidth, pixheight = size
    if width and height:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, pixwidth, pixheight))


async def serve(config: NodeConfig) -> None:
    node = Node(config)
    node.write_shell_files()
    authorized = asyncssh.import_public_key(config.authorized_key)
    connections: set = set()
    server = await asyncssh.create_server(
        lambda: NodeSSHServer(config, authorized, connections),
        config.address,
        config.port,
        server_host_keys=[config.host_key],
        process_factory=node.handle,
        sftp_factory=NodeSFTPServer,
        allow_scp=True,
        encoding=None,
        reuse_address=True,
    )
    service = None
    if config.metadata_port:
        try:
            service = metadata.MetadataServer(config.address, config.metadata_port, Path(config.notice_file)).start()
        except OSError as exc:  # main() names the SSH port; say which port this was
            raise OSError(exc.errno, f"{exc.strerror} (the metadata service's port {config.metadata_port})") from None
    _write_pid_file(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, node.stopping.set)
    log.info("%s listening on %s:%d", config.name, config.address, config.port)
    guard = asyncio.ensure_future(node.guard())
    await node.stopping.wait()
    guard.cancel()
    server.close()
    if service is not None:
        service.stop()
    await node.processes.end_all()
    for conn in list(connections):  # a machine that powers off drops its connections: no client waits on
        conn.abort()  # one (a `fab stop` that connected as it went would wait for an answer forever)
    Path(config.pid_file).unlink(missing_ok=True)
    log.info("%s powered off", config.name)


def _write_pid_file(config: NodeConfig) -> None:
    state.write_atomic(Path(config.pid_file), pid_text(os.getpid()))


def main(argv: list[str]) -> int:
    state.keep_private()
    config = NodeConfig.load(argv[1])
    os.chdir(config.home)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"{config.name}: cannot listen on {config.address}:{config.port}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
