"""This node's daemons of the cluster's Slurm: munged, slurmctld on the head node, slurmd (and the spot
watch) on every node, each in a session of its own, registered in `~/.gpu-cluster/pids/` as the watchdog
is, so that power-off (local) and `down` end them. Daemons running with an unchanged configuration
(node/slurm_conf.py's files) are left alone; a changed one restarts them. Node i's slurmd listens on the
`slurmd` port + i, so nodes that share one machine do not meet. Standard library only.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time

from node import contract, procfs, slurm_accounting, slurm_conf
from node.slurm_conf import Cluster, DaemonError, Node, Paths, UsageError

READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
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
    **slurm_accounting.PROGRAMS,
}
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


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


def check(head: bool) -> None:
    """UsageError naming the first of Slurm's or munge's programs this node lacks (and its package)."""
    for name in NEEDED + (("slurmctld",) if head else ()):
        program(name)


def daemons_of(cluster: Cluster, node: Node) -> list:
    """What this node runs, in start order."""
    return [
        name
        for name in contract.SCHEDULER_DAEMONS
        if (node == cluster.head or name not in HEAD_ONLY) and (cluster.slurmdbd_port or name not in ACCOUNTING)
    ]


HEAD_ONLY = ("slurmctld", "mariadbd", "slurmdbd")
ACCOUNTING = ("mariadbd", "slurmdbd")
"""Accounting's daemons (node/slurm_accounting.py), where the description asks for it."""


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
    if name == "mariadbd":
        return slurm_accounting.mariadbd_argv(program("mariadbd"), paths)
    if name == "slurmdbd":
        return [program("slurmdbd"), "-D"]  # slurmdbd.conf beside SLURM_CONF
    if name == "spot-watch":
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spot_watch.py")
        return [sys.executable, "-u", here, "--preempt", "--node", node.name]
    return [program("slurmd"), "-D", "-f", paths.conf, "-N", node.name]


def listen_address(name: str, cluster: Cluster, node: Node, bound: str, paths: Paths):
    """(address, port) the daemon accepts on once it is ready, a Unix socket's path (mariadbd's); None for
    munged (its own Unix socket, `munge_answers`)."""
    if name == "slurmctld":
        return bound, cluster.slurmctld_port
    if name == "slurmd":
        return bound, cluster.slurmd_port + cluster.nodes.index(node)
    if name == "slurmdbd":
        return bound, cluster.slurmdbd_port
    if name == "mariadbd":
        return slurm_accounting.database_socket(paths)
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


def gone(paths: Paths) -> list:
    """The daemons a client on this node needs (munged; slurmctld where this node runs it) that were started
    here and are not running now, stopped by no one (killed, crashed): `stop` removes a pid file, so a pid
    file whose daemon is gone says so at once, where Slurm's clients would wait MessageTimeout to fail."""
    return [
        name for name in ("munged", "slurmctld") if os.path.exists(paths.pid(name)) and not running_daemon(paths, name)
    ]


def write_private(path: str, data: bytes, mode: int) -> None:
    """Replace `path` with `data` at `mode` (a 0400 key cannot be opened for writing again)."""
    temporary = f"{path}.new"
    if os.path.exists(temporary):
        os.unlink(temporary)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def spawn(name: str, argv: list, paths: Paths) -> int:
    """Start a daemon in a session of its own (its pid is its process group) and register it."""
    environment = {
        **os.environ,
        contract.SCHEDULER_VARIABLE: paths.folder,
        "SLURM_CONF": paths.conf,
        **slurm_accounting.environment(paths),
    }
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
    if isinstance(where, str):
        return unix_answers(where)
    try:
        with socket.create_connection(where, timeout=1.0):
            return True
    except OSError:
        return False


def munge_round_trip(paths: Paths) -> bool:
    """A credential encoded and decoded through this node's munged: it serves (a live munged may not, and
    without it every Slurm daemon and client fails, and nodes go DOWN+NOT_RESPONDING)."""
    try:
        encode, decode = program("munge"), program("unmunge")
    except UsageError:  # munge's clients are not installed: its socket answering is all we can ask
        return munge_answers(paths)
    socket_option = f"--socket={paths.munge_socket}"
    try:
        encoded = subprocess.run([encode, "-n", socket_option], capture_output=True, timeout=10)
        if encoded.returncode != 0:
            return False
        decoded = subprocess.run([decode, socket_option], input=encoded.stdout, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return decoded.returncode == 0


def controller_answers(paths: Paths) -> bool:
    """`scontrol ping` says this cluster's slurmctld is UP."""
    try:
        result = subprocess.run(
            [program("scontrol"), "ping"],
            env={**os.environ, "SLURM_CONF": paths.conf},
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and "is UP" in result.stdout


def serves(name: str, paths: Paths, where) -> bool:
    """A running daemon does its work: munged a credential round trip, slurmctld a ping, slurmd accepts."""
    if name == "munged":
        return munge_round_trip(paths)
    if where is not None and not accepting(where):
        return False
    return controller_answers(paths) if name == "slurmctld" else True


def munge_answers(paths: Paths) -> bool:
    return unix_answers(paths.munge_socket)


def unix_answers(path: str) -> bool:
    if not os.path.exists(path):
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
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


def link_fake_gpus(files: list) -> None:
    """Each fake GPU's file a link to a device (slurm_conf.FAKE_GPU_DEVICE), in a folder of the node's own."""
    for path in files:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(slurm_conf.FAKE_GPU_DEVICE, path)


def make_folders(paths: Paths, cluster: Cluster | None = None) -> None:
    extra = (cluster.state_save,) if cluster is not None and cluster.state_save else ()
    for folder in (paths.folder, paths.munge, paths.sockets, paths.at(contract.PIDS), *extra):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.stat(folder).st_uid != os.getuid():
            raise UsageError(f"{folder} belongs to another user: remove it, or start from a shallower home")
        os.chmod(folder, 0o700)


def start(cluster: Cluster, node_name: str, home: str, renew: tuple = ()) -> dict:
    """This node's daemons running with this description, and serving (`serves`: one that runs but does
    not is restarted, as is each name in `renew`); what was done (`started`: the daemons started now,
    `restarted`: those that ran before; both absent where every one ran and served already)."""
    node = cluster.node(node_name)
    paths = Paths(home)
    names = daemons_of(cluster, node)
    argvs = {name: daemon_argv(name, cluster, node, paths) for name in names}  # every program there
    program("sinfo")
    if "mariadbd" in names:
        program("mariadb-install-db")
    bound = slurm_conf.daemon_address()
    slurm_conf.check_binding(cluster, node, bound)
    user = pwd.getpwuid(os.getuid()).pw_name
    files = slurm_conf.configuration(cluster, node, paths, bound, user)
    if "slurmdbd" in names:
        dbd = slurm_accounting.dbd_conf(cluster, paths, slurm_conf.controller_name(cluster, node), bound, user)
        files[slurm_accounting.dbd_conf_path(paths)] = (dbd.encode(), 0o600)
    digest = slurm_conf.digest_of(files)
    changed = read_text(paths.digest) != digest
    restarted = [name for name in stop(paths) if name in names] if changed else []
    make_folders(paths, cluster if node == cluster.head else None)  # after stop, which removes a short socket folder
    if changed:
        for path, (data, mode) in files.items():
            write_private(path, data, mode)
        if cluster.one_machine:
            link_fake_gpus(slurm_conf.gpu_files(cluster, node, paths))
        if paths.gres not in files and os.path.exists(paths.gres):
            os.unlink(paths.gres)
        write_private(paths.digest, f"{digest}\n".encode(), 0o600)
    running, started = {}, {}
    for name in names:  # in start order: a controller is asked only once munge serves
        where = listen_address(name, cluster, node, bound, paths)
        pid = running_daemon(paths, name)
        if pid is not None and (name in renew or not serves(name, paths, where)):
            stop_daemon(paths, name)
            restarted.append(name)
            pid = None
        if pid is None:
            if name == "mariadbd":
                slurm_accounting.install(program("mariadb-install-db"), paths, user)
            pid = spawn(name, argvs[name], paths)
            wait_ready(name, pid, paths, where)
            started[name] = pid
        running[name] = pid
    if not started:
        return {"node": node.name, "action": "unchanged", "daemons": running}
    action = "restarted" if restarted else "started"
    return {"node": node.name, "action": action, "daemons": running, "started": sorted(started), "restarted": restarted}


def stop_daemon(paths: Paths, name: str, grace_s: float = STOP_GRACE_S) -> None:
    """End one registered daemon (SIGTERM to its session, SIGKILL after `grace_s`): it runs but does not serve."""
    pid = running_daemon(paths, name)
    if pid is None:
        return
    signal_groups([pid], [], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and procfs.group_alive(pid):
        time.sleep(0.05)
    signal_groups([pid], [], signal.SIGKILL)
    try:
        os.unlink(paths.pid(name))
    except OSError:
        pass


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
