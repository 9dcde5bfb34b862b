"""Real Slurm schedulers on this machine: node/scheduler.py started for each node of a description, each
node with a home of its own (as the local provider's nodes have), and Slurm's clients pointed at node-0's
configuration."""

import base64
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from node import contract, procfs
from tests.support import REPO
from tests.support.network import free_endpoint

SCHEDULER = REPO / "node" / "scheduler.py"
PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "squeue", "sinfo", "scontrol")
DEADLINE_S = 90.0
"""How long a poll waits for what should take seconds: generous, for a loaded machine."""
PORT_BLOCK = 64


def unavailable() -> str | None:
    """Why real Slurm daemons cannot run here, or None where they can."""
    missing = [name for name in PROGRAMS if not _program(name)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; .ci/run does it as root)"
    return None


def _program(name: str) -> str | None:
    return shutil.which(name) or next(
        (f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.access(f"{d}/{name}", os.X_OK)), None
    )


def free_ports() -> int:
    """The first of PORT_BLOCK consecutive ports free on every loopback address the daemons may bind."""
    try:  # below the kernel's ephemeral ports: every outgoing connection of the suite takes one of those
        below = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        below = 60000
    high = below - PORT_BLOCK if below - PORT_BLOCK > 21000 else 60000 - PORT_BLOCK
    for _ in range(200):
        first = random.randint(20000, high)
        if all(_bindable(first + i) for i in range(PORT_BLOCK)):
            return first
    raise RuntimeError("no free block of loopback ports")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def description(
    nodes: int, first_port: int, cpus: int = 2, memory_mb: int = 1000, gpus: int = 0, accounting: bool = False
) -> dict:
    """A cluster of `nodes` on loopback (one machine), as the local provider's nodes are; `accounting`:
    slurmdbd and its MariaDB on the head node."""
    base, _ = free_endpoint(nodes)
    prefix = base.rsplit(".", 1)[0]
    return {
        "cluster": f"gc{random.randint(0, 10**6)}",
        "munge_key": base64.b64encode(os.urandom(1024)).decode(),
        "ports": {
            "slurmctld": first_port,
            "slurmd": first_port + 1,
            "srun": [first_port + 20, first_port + 60],
            **({"slurmdbd": first_port + 18} if accounting else {}),
        },
        "nodes": [
            {"name": f"node-{i}", "address": f"{prefix}.{10 + i}", "cpus": cpus, "memory_mb": memory_mb, "gpus": gpus}
            for i in range(nodes)
        ],
    }


@dataclass
class SlurmCluster:
    """node/scheduler.py's daemons for one description, each node in its own home under `folder`."""

    folder: Path
    description: dict
    homes: list = field(default_factory=list)

    def __post_init__(self):
        self.homes = [self.folder / node["name"] for node in self.description["nodes"]]
        for home in self.homes:
            home.mkdir(parents=True, exist_ok=True)

    def scheduler(self, index: int, *args: str, stdin: str | None = None, timeout: float = 120, program=SCHEDULER):
        """`python node/scheduler.py ARGS` (or another `program`) on node `index` (its HOME and CLUSTER_NODE)."""
        env = {**os.environ, "HOME": str(self.homes[index]), contract.NODE_VARIABLE: f"node-{index}"}
        return subprocess.run(
            [sys.executable, str(program), *args],
            input=stdin,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, description: dict | None = None) -> list:
        """`start` on every node (head first); each node's JSON answer."""
        if description is not None:
            self.description = description
        answers = []
        for index in range(len(self.homes)):
            result = self.scheduler(index, "start", stdin=json.dumps(self.description))
            assert result.returncode == 0, (result.returncode, result.stdout, result.stderr, self.logs(index))
            answers.append(json.loads(result.stdout))
        return answers

    def stop(self) -> None:
        for index in range(len(self.homes)):
            self.scheduler(index, "stop")

    def state(self, index: int) -> dict:
        result = self.scheduler(index, "state", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def logs(self, index: int) -> str:
        folder = self.homes[index] / contract.SCHEDULER
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(folder.glob("*.log")))

    @property
    def conf(self) -> Path:
        return self.homes[0] / contract.SLURM_CONF

    def client(self, *argv: str, timeout: float = 60, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        """One of Slurm's clients on node-0, as `env` tells a user to run them."""
        env = {**os.environ, "HOME": str(self.homes[0]), "SLURM_CONF": str(self.conf)}
        result = subprocess.run(
            list(argv), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or self.folder
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def node_states(self) -> dict:
        out = self.client("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self) -> None:
        names = [node["name"] for node in self.description["nodes"]]
        wait_for(lambda: all(self.node_states().get(n) == "idle" for n in names), "every node idle", self.all_logs)

    def all_logs(self) -> str:
        return "\n".join(self.logs(i) for i in range(len(self.homes)))

    def job(self, job_id: str) -> dict:
        """scontrol's fields of the job (`JobState`, `Restarts`, ...); empty once Slurm forgot it."""
        out = self.client("scontrol", "show", "job", "--oneliner", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def sbatch(self, *argv: str) -> str:
        return self.client("sbatch", "--parsable", *argv).stdout.strip().split(";")[0]

    def processes(self) -> list:
        """Live processes of these schedulers: the daemons (by their folder in the environment), the
        steps and the jobs' tasks (working in, or started with, a node's folders)."""
        folders = [str(home / contract.SCHEDULER) for home in self.homes]
        found = []
        for pid in procfs.pids():
            if pid == os.getpid() or not procfs.alive(pid):
                continue
            variables = procfs.environment(pid) or {}
            cwd = procfs.working_directory(pid) or ""
            argv = " ".join(procfs.command_line(pid))
            if variables.get(contract.SCHEDULER_VARIABLE) in folders or str(self.folder) in cwd + argv:
                found.append(pid)
        return found


def node_processes(cluster: "SlurmCluster", index: int) -> list:
    """Live processes of node `index` alone: its daemons, its steps and their tasks."""
    folder = str(cluster.homes[index] / contract.SCHEDULER)
    steps = [pid for pid in procfs.pids_working_in(folder) if procfs.alive(pid)]
    marked = procfs.pids_with_environment(f"{contract.SCHEDULER_VARIABLE}={folder}")
    return sorted(set(marked + steps + procfs.descendants(steps)))


def wait_for(condition, what: str, details=None, deadline_s: float = DEADLINE_S) -> None:
    """Ask `condition` until it holds, at most every 0.2 s, and never busier than half the time: a
    condition that starts a `fab` (half a second of CPU) waits as long as it took before asking again."""
    deadline = time.monotonic() + deadline_s
    while True:
        asked = time.monotonic()
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {deadline_s:.0f} s: {what}\n{details() if details else ''}")
        time.sleep(max(0.2, time.monotonic() - asked))


def listening_sockets() -> list:
    """(address, port, pid) of every listening TCP socket, as `ss -ltnp` shows them."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        address, _, port = parts[3].rpartition(":")
        for pid in re.findall(r"pid=(\d+)", line):
            found.append((address.strip("[]"), int(port), int(pid)))
    return found
