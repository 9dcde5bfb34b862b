"""Stock OpenSSH servers on loopback that act as the `ssh` provider's machines, for the tests.

Each node is its own `/usr/sbin/sshd` on its own loopback address, with its own host key and config,
logging in one Unix user of its own (`gcnode0`, `gcnode1`, ...) with a home of its own, as separate
machines would. The users run a Python with torch that lives at a world-readable place
(`/opt/gpu-cluster-test/`), built once from Debian's python3 and cached by requirements-node.txt's
digest, since the project's own venv may sit under a private home.

    python -m tests.support.openssh build-python     # what `make test` runs first (as root)
"""

import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

SSHD = Path("/usr/sbin/sshd")
SYSTEM_PYTHON = Path("/usr/bin/python3")
NODE_PYTHON_ROOT = Path("/opt/gpu-cluster-test")
WHEELS = Path("/opt/wheels")  # where a CPU wheel of torch may already lie (CI's machine has one)
# Two suites at once on one machine (two checkouts) would share the node users: a run may name its own.
USER_PREFIX = os.environ.get("GPU_CLUSTER_TEST_USER_PREFIX", "gcnode")
READY_TIMEOUT_S = 20.0


def requirements_digest() -> str:
    return hashlib.sha256((REPO / "requirements-node.txt").read_bytes()).hexdigest()[:12]


def node_python_dir() -> Path:
    return NODE_PYTHON_ROOT / f"python-{requirements_digest()}"


def node_python() -> Path | None:
    """The cached node Python (with torch), or None when it has not been built."""
    root = node_python_dir()
    return root / "bin" / "python" if (root / ".ready").exists() else None


def build_node_python() -> Path:
    """A venv from Debian's python3 with requirements-node.txt, readable by every user; cached."""
    root = node_python_dir()
    for stale in root.parent.glob("python-*"):  # built for an earlier requirements-node.txt
        if stale != root:
            shutil.rmtree(stale, ignore_errors=True)
    ready = node_python()
    if ready:
        return ready
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(root.parent, 0o755)
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", str(root)], check=True)
    # Spelt out rather than left to root's pip config, which another user (or a clean CI) lacks.
    pip = [str(root / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
    if WHEELS.is_dir():
        pip += ["--find-links", str(WHEELS)]
    requirements = (REPO / "requirements-node.txt").read_text().split()
    torch = [r for r in requirements if r.startswith("torch==")]
    subprocess.run(pip + torch, check=True)  # first and alone, so no looser spec pulls a CUDA build
    subprocess.run(pip + ["-r", str(REPO / "requirements-node.txt")], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    (root / ".ready").write_text(requirements_digest() + "\n")
    return root / "bin" / "python"


def unavailable() -> str:
    """Why these fixtures cannot run here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (to add one Unix user per node and run sshd)"
    if not SSHD.exists():
        return f"no {SSHD}: install openssh-server (.ci/run does)"
    if (
        not SYSTEM_PYTHON.exists()
        or subprocess.run([str(SYSTEM_PYTHON), "-c", "import venv, ensurepip"], capture_output=True).returncode != 0
    ):
        return f"no {SYSTEM_PYTHON} with venv: install python3-venv (.ci/run does)"
    if shutil.which("useradd") is None:
        return "no useradd to make the node users"
    return ""


# ------------------------------------------------------------------------------------------ users


def ensure_user(name: str) -> pwd.struct_passwd:
    """A login user with a fresh home from /etc/skel; '*' (not '!') as password, or sshd with
    `UsePAM no` takes the account for locked."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", "--password", "*", name], check=True)
    end_processes_of(name)
    user = pwd.getpwnam(name)
    home = Path(user.pw_dir)
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree("/etc/skel", home, symlinks=True)
    os.chmod(home, 0o700)
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(home)], check=True)
    return user


def authorize(user: pwd.struct_passwd, public_key: str) -> None:
    ssh_dir = Path(user.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(public_key.strip() + "\n")
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(ssh_dir)], check=True)


def processes_of(name: str) -> list[int]:
    """Live (non-zombie) processes running as user `name`."""
    uid, found = pwd.getpwnam(name).pw_uid, []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            status = (proc / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(proc.name))
    return found


def end_processes_of(name: str) -> None:
    """Kill, by id, whatever a node user still runs (a test user only ever runs what tests started)."""
    for pid in processes_of(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------- sshd


@dataclass
class Sshd:
    """One stock sshd: one node."""

    user: str
    address: str
    port: int
    folder: Path
    process: subprocess.Popen | None = None

    def config_text(self) -> str:
        return (
            "\n".join(
                [
                    f"ListenAddress {self.address}:{self.port}",
                    f"HostKey {self.folder / 'ssh_host_ed25519_key'}",
                    f"PidFile {self.folder / 'sshd.pid'}",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "AuthorizedKeysFile .ssh/authorized_keys",
                    "StrictModes yes",
                    f"AllowUsers {self.user}",
                    "PermitRootLogin no",
                    "UseDNS no",
                    "PrintMotd no",
                    "Subsystem sftp internal-sftp",
                    "LogLevel VERBOSE",
                ]
            )
            + "\n"
        )

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "ssh_host_ed25519_key")], check=True
        )
        (self.folder / "sshd_config").write_text(self.config_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
        log = open(self.folder / "sshd.log", "ab")
        self.process = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(self.folder / "sshd_config")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _accepts(self.address, self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd for {self.user} did not start: {self.log()[-500:]}")
            time.sleep(0.05)

    def host_public_key(self) -> str:
        return (self.folder / "ssh_host_ed25519_key.pub").read_text().strip()

    def log(self) -> str:
        try:
            return (self.folder / "sshd.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _accepts(address: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address, port)) == 0


@dataclass
class Hosts:
    """N stock sshd "machines", one user each, and a hosts file for `deploy.py up --hosts`."""

    servers: list[Sshd]
    key: Path
    python: Path

    @property
    def users(self) -> list[str]:
        return [s.user for s in self.servers]

    def hosts_file(self, path: Path, **extra) -> Path:
        import yaml

        data = {
            "key": str(self.key),
            "python": str(self.python),
            "hosts": [{"address": s.address, "port": s.port, "user": s.user} for s in self.servers],
            **extra,
        }
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def stop(self) -> None:
        """Stop the servers, end what the users still run, and remove the users and their homes."""
        for server in self.servers:
            server.stop()
            end_processes_of(server.user)
            subprocess.run(["userdel", "--remove", server.user], capture_output=True)


def start_hosts(folder: Path, first_address: str, port: int, count: int = 2) -> Hosts:
    """`count` sshd servers on first_address, +1, ... (same port), users gcnode0.., one client key."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpu-cluster-test", "-f", str(key)], check=True
    )
    prefix, last = first_address.rsplit(".", 1)
    servers = []
    try:
        for index in range(count):
            user = ensure_user(f"{USER_PREFIX}{index}")
            authorize(user, (folder / "id_ed25519.pub").read_text())
            server = Sshd(user.pw_name, f"{prefix}.{int(last) + index}", port, folder / f"sshd-{index}")
            servers.append(server)
            server.start()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return Hosts(servers, key, build_node_python())


if __name__ == "__main__":
    if sys.argv[1:] != ["build-python"]:
        sys.exit("usage: python -m tests.support.openssh build-python")
    if unavailable():
        print(f"skipping the node Python: the OpenSSH tests will skip: {unavailable()}")
        sys.exit(0)
    print(f"node Python for the OpenSSH tests: {build_node_python()}")
