"""Asking the node's warm launcher (node/warm.py) for a rank, from torchrun's agent (node/torchrun.py).

The wire: one JSON line from the asker, the rank's output descriptor passed with it (SCM_RIGHTS); one
JSON line back, `{"pid": N}` or `{"cold": WHY}`; then, when the rank has ended, `{"exit": CODE}` (a
signal is its negative number, as `subprocess.Popen.returncode` says it). Standard library only.
"""

import json
import os
import shlex
import signal
import socket
import sys
import time
import typing

from node import contract

IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "CUDA_", "LD_", "PYTHON")
"""Variables a library may read when it is imported: a rank forked from a process imported under other
values would not see its own. Those of `RUN_TIME_PREFIXES` are read later, by the rank itself."""
RUN_TIME_PREFIXES = (
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "TORCH_FR_",
    "TORCHFT_",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    "PYTHONDONTWRITEBYTECODE",
)
"""Read when a process group or a store is made (torchrun and the launch set them per run), not at import;
and the interpreter's start-up variables the forked rank applies itself (node/warm.py `interpreter_settings`)."""
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "PYTHONPATH",
)
"""Not the launcher's: a rank's own (torchrun's), and PYTHONPATH, where the user's code and the rank monitor are."""
ROOM_VARIABLE = "GPU_CLUSTER_WARM_ROOM"
"""Set in the launcher's start-up environment only, 64 KiB long: room for a rank's environment in the block
/proc/<pid>/environ shows (node/warm.py `show_environment`)."""
ROOM_BYTES = 65536
DEFAULT = "0"
"""Whether ranks are forked warm where neither the node environment nor the launch says (`contract.WARM_VARIABLE`)."""
ASK_TIMEOUT_S = 10.0


class Cold(Exception):
    """This launch cannot be served warm; the message says why in a few words."""


def socket_path(home: str | None = None) -> str:
    """`contract.WARM_SOCKET` under the home, or in a short folder of /tmp where that path is too long."""
    home = home or os.path.expanduser("~")
    path = os.path.join(home, contract.WARM_SOCKET)
    if len(path.encode()) <= 100:
        return path
    import hashlib

    key = hashlib.sha256(home.encode()).hexdigest()[:12]
    folder = contract.WARM_SHORT_FOLDER.format(uid=os.getuid(), key=key)
    return os.path.join(folder, os.path.basename(contract.WARM_SOCKET))


def private_folder(folder: str) -> None:
    """Make `folder` (0700), or refuse one another user owns or others may enter."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    found = os.lstat(folder)
    if found.st_uid != os.getuid() or not os.path.isdir(folder) or os.path.islink(folder):
        raise Cold(f"{folder} is not this user's own folder")
    if found.st_mode & 0o077:
        os.chmod(folder, 0o700)


def import_time_environment(env: dict) -> dict:
    return {
        name: value
        for name, value in env.items()
        if name.startswith(IMPORT_TIME_PREFIXES) and not name.startswith(RUN_TIME_PREFIXES)
    }


def script_of(args: list) -> tuple[str, str, list] | None:
    """(interpreter, script or `-m` module, its argv) from torchrun's worker command, or None where
    it is not `python [-u] SCRIPT ...` or `python [-u] -m MODULE ...`."""
    if len(args) < 2:
        return None
    interpreter, rest = args[0], list(args[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return interpreter, "-m " + rest[1], [rest[1]] + rest[2:]
    if not rest or rest[0].startswith("-"):
        return None
    return interpreter, rest[0], rest


# ---- the wire --------------------------------------------------------------------------------------


def read_ask(conn: socket.socket) -> tuple[dict, list]:
    """One JSON line, the rank's output descriptor passed with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ValueError("the ask ended early")
        data += more
    if not fds:
        raise ValueError("no output descriptor")
    return json.loads(data), list(fds)


def answer(conn: socket.socket, said: dict) -> None:
    conn.sendall(json.dumps(said).encode() + b"\n")


# ---- the asker (torchrun's agent) -----------------------------------------------------------------


class WarmRank:
    """What torchrun's agent holds of a forked rank: the part of `subprocess.Popen` it uses."""

    def __init__(self, conn: socket.socket, pid: int, args: list):
        self.conn, self.pid, self.args = conn, pid, args
        self.returncode: int | None = None
        self.exited_at: float | None = None
        """When the rank exited, by the launcher's clock (this node's), where it said so."""
        self._said = b""

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self.conn.settimeout(timeout)
        try:
            while not self._said.endswith(b"\n"):
                more = self.conn.recv(4096)
                if not more:  # the launcher died: its ranks died with it (PR_SET_PDEATHSIG)
                    self.returncode, self.exited_at = -signal.SIGKILL, time.time()
                    self.conn.close()
                    return
                self._said += more
        except (TimeoutError, BlockingIOError):
            return
        said = json.loads(self._said)
        self.returncode, at = int(said["exit"]), said.get("at")
        self.exited_at = float(at) if isinstance(at, (int, float)) else time.time()
        self.conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_up_hook(env: "typing.Mapping[str, str]") -> str | None:
    """A sitecustomize or usercustomize on the rank's PYTHONPATH other than the rank monitor's own
    (node/rankhook, which the launcher starts itself), or None."""
    for folder in [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]:
        if os.path.exists(os.path.join(folder, "gpu_cluster_rank_monitor.py")):
            continue
        for name in ("sitecustomize.py", "usercustomize.py"):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def ask(args: list, env: dict, out_fd: int, home: str | None = None) -> WarmRank:
    """Have the node's warm launcher fork this rank; Cold, saying why, where it cannot."""
    found = script_of(list(args))
    if found is None:
        raise Cold("the worker is not a Python script or module")
    python, target, argv = found
    hook = start_up_hook(env)
    if hook:
        raise Cold(f"{hook} on PYTHONPATH runs at an interpreter's start, which a fork skips")
    path = socket_path(home)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ASK_TIMEOUT_S)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        raise Cold("no warm launcher runs on this node yet") from None
    said = {
        "python": python,
        "target": target,
        "argv": argv,
        "env": dict(env),
        "cwd": os.getcwd(),
        "environment": import_time_environment(dict(env)),
    }
    try:
        socket.send_fds(conn, [json.dumps(said).encode() + b"\n"], [out_fd])
        reply = b""
        while not reply.endswith(b"\n"):
            more = conn.recv(4096)
            if not more:
                raise Cold("the warm launcher ended")
            reply += more
    except OSError as exc:
        conn.close()
        raise Cold(f"the warm launcher did not answer ({exc})") from None
    answered = json.loads(reply)
    if "cold" in answered:
        conn.close()
        raise Cold(answered["cold"])
    return WarmRank(conn, int(answered["pid"]), list(args))


def starting_or_running(home: str) -> bool:
    """A warm launcher's process group is registered and alive (it may still be importing torch)."""
    try:
        with open(os.path.join(home, contract.WARM_PID)) as f:
            pgid = int(f.read().split()[0])
        os.killpg(pgid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def start(env: "typing.Mapping[str, str]", home: str | None = None, python: str | None = None) -> None:
    """Start a warm launcher for the next launches, detached (its own session), with a rank's environment."""
    import subprocess

    home = home or os.path.expanduser("~")
    if starting_or_running(home):
        return
    private_folder(os.path.join(home, contract.WARM))
    log = os.open(os.path.join(home, contract.WARM_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    # Not the run's own variables: stop_jobs.py would take it for a process of that run.
    env = {
        k: v
        for k, v in env.items()
        if k not in RANK_VARIABLES and not k.startswith((*RUN_TIME_PREFIXES, "CLUSTER_RUN"))
    }
    env[ROOM_VARIABLE] = "." * ROOM_BYTES
    try:
        subprocess.Popen(
            [python or sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm.py"), "serve"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd=home,
            start_new_session=True,
        )
    finally:
        os.close(log)


class RankStarter:
    """torchrun's agent's way to start a rank: forked by the warm launcher where the launch asks for it
    and it can, else as torchrun starts it; the first cold start says why, in one line."""

    def __init__(self, wanted: bool, home: str | None = None):
        self.wanted, self.home, self.said = wanted, home, False

    def start(self, args, env: dict, out_fd: int):
        if self.wanted:
            try:
                return ask(list(args), env, out_fd, self.home)
            except Cold as cold:
                self.cold(str(cold), env, fresh=not str(cold).startswith("another interpreter"))
        import subprocess

        # As torch starts them: a session of their own, so that stopping one ends its children too.
        return subprocess.Popen(args=args, env=env, stdout=out_fd, stderr=out_fd, start_new_session=True)

    def cold(self, why: str, env: dict, fresh: bool) -> None:
        if not self.said:
            self.said = True
            print(f"gpu-cluster: ranks start cold: {why}", file=sys.stderr, flush=True)
            if not fresh:
                return
            try:
                start(env, self.home)  # for the next launch, with the variables torchrun gives its ranks
            except (OSError, Cold) as exc:
                print(f"gpu-cluster: the warm launcher cannot start: {exc}", file=sys.stderr, flush=True)


def wanted(env: "typing.Mapping[str, str]") -> bool:
    """Whether the launch asks for warm ranks (`contract.WARM_VARIABLE`, else `DEFAULT`)."""
    return env.get(contract.WARM_VARIABLE, DEFAULT) == "1"


def stop(home: str) -> bool:
    """End the running warm launcher (its ranks end with it); whether there was one."""
    try:
        with open(os.path.join(home, contract.WARM_PID)) as f:
            pgid = int(f.read().split()[0])
        with open(f"/proc/{pgid}/cmdline", "rb") as f:  # a stale pid file's number may be another's now
            if b"warm.py" not in f.read():
                raise ProcessLookupError(pgid)
        os.killpg(pgid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.unlink(os.path.join(home, contract.WARM_PID))
    except OSError:
        pass
    return True


def restart_for_the_node(home: str, code: str, env_file: str) -> str:
    """Bootstrap's and a replacement's: the node environment was (re)written, so a running launcher may
    hold stale imports. It ends; where the node environment asks for warm ranks, a fresh one starts with
    that environment, ready for the next launch. What was done, in a word."""
    stopped = stop(home)
    env = dict(os.environ)
    for line in open(env_file).read().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export ") :].split("=", 1)
            words = shlex.split(value) if value else [""]
            env[key] = os.path.expandvars(words[0] if words else "")
    if not wanted(env):
        return "stopped" if stopped else "off"
    python = env.get("CLUSTER_PYTHON") or sys.executable
    env["CLUSTER_CODE_DIR"] = env.get("CLUSTER_CODE_DIR") or code
    start(env, home, python)
    return "started"
