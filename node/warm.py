"""The warm launcher: one process per node that imported torch once and forks torchrun's ranks from it.

    python node/warm.py serve       (started by node/torchrun.py where the launch asks for it; detached)

A rank started by torchrun pays a fresh interpreter and `import torch` (about 1.5 CPU-seconds here).
This process pays it once: it imports `torch` and `torch.distributed` and nothing of the user's, listens
on `contract.WARM_SOCKET` (mode 0600 in a 0700 folder: only the node user can ask it), and for each ask
forks one child that runs the rank's script as `__main__` (runpy) with the environment, `argv` and
working folder torchrun gave it, its output on the file descriptor the ask passed (SCM_RIGHTS), reseeded.
The asker (node/torchrun.py's `piped`, in torchrun's agent) holds the connection for as long as the
rank runs and gets its exit status on it; a connection that closes first (the agent killed, the
Slurm step cancelled) ends the rank's process group with SIGKILL, and every rank dies with this
process (PR_SET_PDEATHSIG), so that no rank outlives the job that asked for it.

Fork safety is checked before every fork, not assumed: a process that created a CUDA context or runs
a second thread cannot fork safely, and then this process answers "cold" (the agent starts that rank as
before) and exits, to be started afresh. It exits likewise when what it imported may be stale: the node
environment file, the interpreter's site-packages or this code changed, or an ask comes from another
interpreter or with other values of the variables read at import time (`import_time_environment`).

Each rank's environment is also written to `contract.WARM_RANKS/<pid>` while it runs: /proc shows a
forked process's environment as this process's, and node/procfs.py reads the record instead, so that
`fab stop`, the hang watch and the spot watch find forked ranks by their CLUSTER_RUN_ID as before.
"""

import contextlib
import io
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

INTERPRETER_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
"""The interpreter's own sys.path entries (stdlib, site-packages), before this file's folder and PYTHONPATH."""
if not __package__:  # run as a file: import its siblings from the code folder, ahead of any other `node`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from node import contract, procfs  # noqa: E402
from node.warm_ask import ASK_TIMEOUT_S, answer, import_time_environment, private_folder, read_ask, socket_path  # noqa: E402, I001

PR_SET_PDEATHSIG = 1


def fork_hazard() -> str | None:
    """Why this process must not fork now, or None: a CUDA context, or more than one thread."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a CUDA context exists in the warm launcher"
    if threading.active_count() != 1:
        return f"the warm launcher runs {threading.active_count()} Python threads"
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = 1
    if tasks != 1:
        return f"the warm launcher runs {tasks} threads"
    return None


def stamps(home: str) -> dict:
    """What the imported modules were made from: a change means this process may run stale code."""
    import site
    import sysconfig

    folders = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    files = [os.path.join(home, contract.ENV), os.path.abspath(__file__), *sorted(folders)]
    found: dict[str, int | None] = {}
    for path in files:
        try:
            found[path] = os.stat(path).st_mtime_ns
        except OSError:
            found[path] = None
    return found


# ---- the launcher ----------------------------------------------------------------------------------


class Launcher:
    def __init__(self, home: str):
        self.home = home
        self.path = socket_path(home)
        self.ranks_dir = os.path.join(home, contract.WARM_RANKS)
        self.python = os.path.abspath(sys.executable)
        self.environment = import_time_environment(dict(os.environ))
        self.stamps = stamps(home)
        self.children: dict[int, socket.socket] = {}
        self.selector = selectors.DefaultSelector()
        self.running = True
        self.inode = -1

    def listen(self) -> socket.socket:
        private_folder(os.path.join(self.home, contract.WARM))
        private_folder(os.path.dirname(self.path))
        private_folder(self.ranks_dir)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            server.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.inode = os.stat(self.path).st_ino
        server.listen(64)
        return server

    def serve(self) -> None:
        server = self.listen()
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stop, self.stop)
        self.selector.register(server, selectors.EVENT_READ, "server")
        self.selector.register(wake_read, selectors.EVENT_READ, "wake")
        print(f"gpu-cluster: warm launcher {os.getpid()} serves {self.path}", flush=True)
        try:
            while self.running:
                for key, _ in self.selector.select(timeout=5):
                    if key.data == "server":
                        self.accept(server)
                    elif key.data == "wake":
                        os.read(wake_read, 4096)
                    else:
                        self.asker_gone(key.fileobj, key.data)
                self.reap()
        finally:
            self.retire()
            for pid in list(self.children):
                self.kill(pid)

    def retire(self) -> None:
        """Leave the socket and the pid file to a successor."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        pid_file = os.path.join(self.home, contract.WARM_PID)
        with contextlib.suppress(OSError), open(pid_file) as f:
            if f.read().split() == [str(os.getpgrp())]:
                os.unlink(pid_file)

    def stop(self, *_) -> None:
        self.running = False

    def stale(self, ask: dict) -> str | None:
        if ask.get("environment") != self.environment:
            changed = sorted(set(ask.get("environment", {}).items()) ^ set(self.environment.items()))
            return "other import-time variables (" + ", ".join(sorted({name for name, _ in changed})) + ")"
        if stamps(self.home) != self.stamps:
            return "the node environment or its packages changed"
        return None

    def accept(self, server: socket.socket) -> None:
        conn, _ = server.accept()
        try:
            conn.settimeout(ASK_TIMEOUT_S)
            ask, fds = read_ask(conn)
        except (OSError, ValueError) as exc:
            conn.close()
            print(f"gpu-cluster: warm launcher: a bad ask ({exc})", file=sys.stderr, flush=True)
            return
        if os.path.abspath(ask.get("python", "")) != self.python:
            # A --requirements environment's interpreter: its ranks start cold; this launcher stays for the node's.
            self.refuse(conn, fds, f"another interpreter ({ask.get('python')}) than the warm launcher's")
            return
        why = self.stale(ask) or fork_hazard()
        if why is not None:
            self.retire()  # before the answer: the asker starts a fresh launcher at once
            self.refuse(conn, fds, why)
            print(f"gpu-cluster: warm launcher ends: {why}", file=sys.stderr, flush=True)
            self.running = False  # what it imported no longer serves: a fresh one is started
            return
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            # The launcher's own stop handlers go before the agent hears the pid: a stop that comes at once
            # (fail-fast, a fab stop) must end the rank, not run the launcher's handler in it.
            for stop in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(stop, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.close(ready_read)
            os.setsid()  # before the agent hears its pid: it ends a rank by killpg(pid)
            os.close(ready_write)
            self.run_rank(ask, fds, conn)  # never returns
        os.close(ready_write)
        os.read(ready_read, 1)  # end of file once the child has its own session
        os.close(ready_read)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.record(pid, ask["env"])
        answer(conn, {"pid": pid})
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def refuse(self, conn: socket.socket, fds: list, why: str) -> None:
        answer(conn, {"cold": why})
        conn.close()
        for fd in fds:
            os.close(fd)

    def record(self, pid: int, env: dict) -> None:
        fields = procfs.stat_fields(pid) or []
        started = fields[19] if len(fields) > 19 else None
        path = os.path.join(self.ranks_dir, str(pid))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"start_time": started, "env": env}, f)

    def forget(self, pid: int) -> None:
        try:
            os.unlink(os.path.join(self.ranks_dir, str(pid)))
        except FileNotFoundError:
            pass

    def asker_gone(self, conn, pid: int) -> None:
        """The agent closed its end (or wrote, which it never does): the rank must not outlive it."""
        try:
            if conn.recv(1):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self.kill(pid)

    def kill(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.forget(pid)
            if conn is None:
                continue
            self.selector.unregister(conn)
            conn.setblocking(True)
            try:
                answer(conn, {"exit": os.waitstatus_to_exitcode(status), "at": time.time()})
            except OSError:
                pass
            conn.close()

    def run_rank(self, ask: dict, fds: list, conn: socket.socket) -> None:
        """In the forked child: become the rank, run its script, exit with its status."""
        code = 1
        try:
            prepare_rank(self, ask, fds, conn)
            code = run_script(ask["target"], ask["argv"])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)


def prepare_rank(launcher: Launcher, ask: dict, fds: list, conn: socket.socket) -> None:
    set_parent_death_signal(signal.SIGKILL)
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(stop, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    launcher.selector.close()
    conn.close()
    out = fds[0]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in (null, out):
        os.close(fd)
    for fd in fds[1:]:
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # python -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()  # unsets every variable: the C environment no longer points into the start-up block
    os.environ.update(ask["env"])
    show_environment(ask["env"])
    interpreter_settings(ask["env"])
    os.chdir(ask["cwd"])
    sys.path[:] = rank_path(ask)
    for name in [n for n in sys.modules if n == "node" or n.startswith("node.")]:
        del sys.modules[name]  # ours, not the user's: a project may have a `node` package of its own
    reseed()
    start_rank_monitor(ask["env"])


def show_environment(env: dict) -> bool:
    """Write the rank's environment over the block the kernel shows as /proc/<pid>/environ (this
    process's start-up environment, given room by `warm_ask.ROOM_VARIABLE`), so that whatever finds a
    rank by its environment (fab stop, the watches, `grep -z /proc/*/environ`) finds this one as it
    finds a rank torchrun started. False where it does not fit (node/procfs.py then reads the record)."""
    import ctypes

    fields = procfs.stat_fields("self") or []
    if len(fields) < 49:
        return False
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5), fields 50 and 51)
    block = b"".join(os.fsencode(f"{name}={value}") + b"\0" for name, value in env.items())
    if len(block) > end - start:
        return False
    ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)
    return True


def interpreter_settings(env: dict) -> None:
    """What an interpreter takes from its environment at start, which the launcher's was not started with."""
    import faulthandler

    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
    else:
        faulthandler.disable()
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))


def rank_path(ask: dict) -> list:
    """sys.path as `python SCRIPT` would have it with the rank's PYTHONPATH: the script's folder (or the
    working folder for `-m`), PYTHONPATH, then the interpreter's own entries."""
    first = ask["cwd"] if ask["target"].startswith("-m ") else os.path.dirname(os.path.abspath(ask["target"]))
    extra = [os.path.abspath(p) for p in ask["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *INTERPRETER_PATH]


def reseed() -> None:
    """No two ranks or runs share random state: the fork copied this process's."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def start_rank_monitor(env: dict) -> None:
    """What node/rankhook/sitecustomize.py does at an interpreter's start, which a fork skips."""
    folders = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not any(os.path.exists(os.path.join(p, "gpu_cluster_rank_monitor.py")) for p in folders):
        return
    try:
        import gpu_cluster_rank_monitor

        gpu_cluster_rank_monitor.start()
    except Exception as exc:
        print(f"gpu-cluster: the rank monitor did not start ({type(exc).__name__}: {exc})", file=sys.stderr)


def run_script(target: str, argv: list) -> int:
    """Run the script as `__main__`, then end as the interpreter would: threads, atexit, flush."""
    import atexit

    sys.argv = list(argv)
    code = 0
    try:
        if target.startswith("-m "):
            runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exit_status(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does: non-daemon threads end first
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def exit_status(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def set_parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list) -> None:
    if argv[:1] != ["serve"]:
        sys.exit("usage: python node/warm.py serve")
    home = os.path.expanduser("~")
    pid_file = os.path.join(home, contract.WARM_PID)
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    with open(pid_file, "w") as f:  # first: an asker that finds it waits for this one instead of starting another
        f.write(f"{os.getpgrp()}\n")
    launcher = None
    try:
        import torch  # noqa: F401  (the point: once, here)
        import torch.distributed  # noqa: F401  (torch imports numpy where it is installed)

        launcher = Launcher(home)
        launcher.serve()
    finally:
        with contextlib.suppress(OSError), open(pid_file) as f:
            if launcher is None and f.read().split() == [str(os.getpgrp())]:
                os.unlink(pid_file)


if __name__ == "__main__":
    main(sys.argv[1:])
