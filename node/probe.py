"""What a node is: OS, Python, GPUs, driver and CUDA, how daemons run, and how it reaches the head node.

Standard library only, and readable by old interpreters too (so a Python that is too old can still
say which version it is). Self-contained (it is sent on stdin, and needs nothing of its siblings).
Two uses:

    python3 - --host OWN_ADDRESS HEAD_ADDRESS [SLURM_JSON]   # deploy.py up --hosts, sent on stdin before
                                                  # any code is on the host (creates nothing): prints one JSON
                                                  # object; SLURM_JSON ({"partition", "conf", "name"}, with
                                                  # `slurm: existing`): the host's Slurm is asked for them
    ProbeNode (node/calls.py)                     # fab bootstrap's probe stage, from the synced code
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys

MIN_PYTHON = (3, 10)
# A non-root login's PATH often lacks the sbin folders, where Debian keeps `ip`.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def tool(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def run(*argv: str) -> str:
    try:
        return subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def succeeds(*argv: str) -> bool:
    try:
        return (
            subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def gpus() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"gpus": [], "driver": None, "cuda": None}
    rows = run("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits")
    found = [
        dict(zip(("name", "memory_mib", "driver"), (c.strip() for c in row.split(","))))
        for row in rows.splitlines()
        if row.strip()
    ]
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", run("nvidia-smi"))
    return {"gpus": found, "driver": found[0]["driver"] if found else None, "cuda": cuda.group(1) if cuda else None}


def gpu_count() -> int:
    """GPUs as `nvidia-smi -L` lists them; 0 without a driver."""
    if not shutil.which("nvidia-smi"):
        return 0
    return sum(1 for line in run("nvidia-smi", "-L").splitlines() if line.startswith("GPU "))


def route(address: str) -> str:
    ip = tool("ip")
    return run(ip, "route", "get", address) if ip else ""


def parse_route_interface(ip_route_output: str) -> str | None:
    """The `dev` of `ip route get ADDR` output: the interface that carries traffic to ADDR."""
    match = re.search(r"\bdev\s+(\S+)", ip_route_output)
    return match.group(1) if match else None


def route_interface(address: str) -> str | None:
    """The interface the kernel would use to reach `address` (never guessed from names)."""
    interface = parse_route_interface(route(address))
    if interface:
        return interface
    route_tool = tool("route")
    if route_tool:  # macOS / BSD
        match = re.search(r"interface:\s*(\S+)", run(route_tool, "-n", "get", address))
        if match:
            return match.group(1)
    return None


def private_ip(own_address: str, head_address: str) -> str | None:
    """The address this host uses towards the head node: the one we connect to where it is the host's
    own (a `local` route), else the source address of the route to the head node."""
    if route(own_address).startswith("local "):
        return own_address
    match = re.search(r"\bsrc\s+(\S+)", route(head_address))
    return match.group(1) if match else None


def daemon() -> str:
    """`systemd` where systemd is PID 1 and sudo needs no password (to install a unit), else `detached`."""
    try:
        with open("/proc/1/comm") as f:
            init = f.read().strip()
    except OSError:
        init = ""
    return "systemd" if init == "systemd" and succeeds("sudo", "-n", "true") else "detached"


def distro() -> str:
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except (OSError, AttributeError):  # not Linux, or Python before 3.10
        return ""


def memory_mb() -> int:
    """MemTotal in MiB (/proc/meminfo), 1024 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1024


def node_facts(master_addr: str) -> dict:
    return {
        "os": f"{platform.system()} {platform.release()}",
        "cpus": os.cpu_count() or 1,
        "memory_mb": memory_mb(),
        "distro": distro(),
        "python": platform.python_version(),
        "interface": route_interface(master_addr),
        "home": os.path.expanduser("~"),
        **gpus(),
    }


def host_facts(own_address: str, head_address: str) -> dict:
    return {
        "python": platform.python_version(),
        "python_ok": sys.version_info[:2] >= MIN_PYTHON,
        "executable": sys.executable,
        "gpus": gpu_count(),
        "daemon": daemon(),
        "private_ip": private_ip(own_address, head_address),
        "home": os.path.expanduser("~"),
    }


def slurm_problem(partition: str, conf: str, name: str) -> str:
    """Why the Slurm this host runs cannot take runs as the hosts file says (`slurm: existing`): its
    slurm_conf missing or unreadable, its clients missing or not answering, no such partition, no such
    node there; '' where it can."""
    if conf and not os.path.isfile(conf):
        return "slurm_conf %s is not a file on this host" % conf
    if conf and not os.access(conf, os.R_OK):
        return "slurm_conf %s is not readable by this login" % conf
    sinfo = tool("sinfo")
    if not sinfo:
        return "Slurm's clients (sinfo) are not on this login's PATH"
    env = dict(os.environ, SLURM_CONF=conf) if conf else None
    try:
        result = subprocess.run(
            [sinfo, "--noheader", "--Node", "--format=%N|%P"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "sinfo did not answer in 15 s (is slurmctld up? is slurm_conf right?)"
    if result.returncode != 0:
        return "sinfo failed: %s" % " ".join((result.stderr or result.stdout).split())[-200:]
    rows = [line.strip().split("|") for line in result.stdout.splitlines() if line.count("|") == 1]
    partitions = sorted({part.rstrip("*") for _, part in rows})
    if partition and partition not in partitions:
        return "partition %s is not in its Slurm (its partitions: %s)" % (partition, ", ".join(partitions) or "none")
    nodes = sorted({node for node, part in rows if not partition or part.rstrip("*") == partition})
    if name and name not in nodes:
        where = "partition %s" % partition if partition else "its Slurm"
        return "slurm_name %s is not a node of %s (its nodes: %s)" % (name, where, ", ".join(nodes[:8]) or "none")
    return ""


def probe_reply(master_addr: str) -> dict:
    return {"facts": node_facts(master_addr)}


def main(argv: list) -> None:
    if argv[:1] != ["--host"] or len(argv) not in (3, 4):
        sys.exit(
            "usage: python3 - --host OWN_ADDRESS HEAD_ADDRESS [SLURM_JSON] (the probe stage asks with node/calls.py)"
        )
    facts = host_facts(argv[1], argv[2])
    if len(argv) == 4:
        slurm = json.loads(argv[3])
        facts["slurm_problem"] = slurm_problem(slurm["partition"], slurm["conf"], slurm["name"])
    print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1:])
