"""Which Slurm holds the runs, ours or the one the hosts already run (`slurm: existing` in the hosts
file), and how Slurm's clients reach it; for the hosts' own: the node a host is there (`identify`), the
record that sends runs to it (`adopt`, contract.SLURM_EXISTING), and this stack's jobs cancelled in it.
Standard library only.
"""

import json
import os
import pwd
import socket
import subprocess

from node import contract
from node.slurm_conf import DaemonError, Paths, UsageError
from node.slurm_daemons import program, write_private

CLIENT_TIMEOUT_S = 15.0
SITE_CONFS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
"""Where Slurm's packages put slurm.conf (Debian's 22.05 and older ones)."""
PROC = "/proc"
OURS = "# Written by gpu-cluster"
"""The first words of every slurm.conf of ours (node/slurm_conf.py), a stack's on this host or another's."""
DAEMONS = ("slurmctld", "slurmd")


def existing(paths: Paths) -> dict | None:
    """The Slurm the hosts already ran, where runs go to it (contract.SLURM_EXISTING); None where Slurm is ours."""
    try:
        with open(paths.at(contract.SLURM_EXISTING)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def client_environment(paths: Paths) -> dict:
    """What Slurm's clients need to reach the cluster's controller: our slurm.conf, or the existing one's."""
    adopted = existing(paths)
    if adopted is None:
        return {"SLURM_CONF": paths.conf}
    return {"SLURM_CONF": adopted["conf"]} if adopted.get("conf") else {}


def site_conf() -> str | None:
    """The configuration of a Slurm this host already runs, looked for where Slurm itself looks:
    `SLURM_CONF`, the `-f` of a running slurmctld or slurmd, the packages' default paths, then what
    `scontrol show config` reads (a configless node's copy); None where there is none. A slurm.conf of
    ours (any stack's) is never one."""
    for found in (os.environ.get("SLURM_CONF"), *_daemon_confs(), *SITE_CONFS):
        if found and os.path.exists(found) and not _ours(found):
            return found
    try:
        shown = client({}, "scontrol", "show", "config")
    except (OSError, subprocess.TimeoutExpired, UsageError):
        return None
    conf = next(
        (line.split("=", 1)[1].strip() for line in shown.stdout.splitlines() if line.startswith("SLURM_CONF ")), ""
    )
    return conf if shown.returncode == 0 and conf and not _ours(conf) else None


def _ours(conf: str) -> bool:
    try:
        with open(conf) as f:
            return f.read(len(OURS)) == OURS
    except OSError:
        return False


def _daemon_confs() -> list:
    """The slurm.conf each running slurmctld and slurmd was started with (`-f`)."""
    found = []
    for entry in os.listdir(PROC):
        try:
            with open(os.path.join(PROC, entry, "cmdline"), "rb") as f:
                argv = [word.decode(errors="replace") for word in f.read().split(b"\0") if word]
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) not in DAEMONS:
            continue
        given = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "-f"]
        given += [word[2:] for word in argv if word.startswith("-f") and len(word) > 2]
        found.extend(given)  # none: Slurm's default path, or a configless copy (scontrol finds both)
    return found


def slurm_name(paths: Paths, node_name: str) -> str:
    """Slurm's NodeName of node-i: the same, or its name in the Slurm the hosts already ran."""
    adopted = existing(paths)
    return str((adopted or {}).get("names", {}).get(node_name) or node_name)


def client(environment: dict, *argv: str) -> subprocess.CompletedProcess:
    """One of Slurm's clients (`argv[0]`) with `environment` (`client_environment`'s, or another Slurm's)
    over this process's, its output captured; TimeoutExpired past CLIENT_TIMEOUT_S."""
    return subprocess.run(
        [program(argv[0]), *argv[1:]],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )


def answered(environment: dict, *argv: str) -> str:
    """`client`'s output. DaemonError with its own words where it fails or does not answer within
    CLIENT_TIMEOUT_S."""
    try:
        result = client(environment, *argv)
    except subprocess.TimeoutExpired:
        raise DaemonError(f"{argv[0]} did not answer in {CLIENT_TIMEOUT_S:g} s (is slurmctld up?)") from None
    if result.returncode != 0:
        raise DaemonError(f"{argv[0]} failed: {(result.stderr.strip() or result.stdout.strip())[-200:]}")
    return result.stdout


def partition_nodes(environment: dict, partition: str) -> list:
    """[(NodeName, NodeHostname, NodeAddr, state)] of `partition` (every node where ''), as sinfo lists them;
    DaemonError with sinfo's own words where it cannot answer."""
    where = [f"--partition={partition}"] if partition else []
    listed = answered(environment, "sinfo", "--noheader", "--Node", "--format=%N|%n|%o|%T", *where)
    found: dict[str, tuple] = {}
    for line in listed.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) == 4:
            found.setdefault(parts[0], tuple(parts))
    return list(found.values())


def identify(partition: str, conf: str, name: str, addresses: list) -> dict:
    """This host's node in a Slurm it already runs: `name` where given, else the node whose NodeAddr is one
    of `addresses`, else whose NodeHostname or NodeName is this host's name. {"name", "state"}."""
    if conf and not os.path.isfile(conf):
        raise UsageError(f"slurm_conf {conf} is not a file on this host")
    listed = partition_nodes({"SLURM_CONF": conf} if conf else {}, partition)
    where = f"partition {partition}" if partition else "the existing Slurm"
    if not listed:
        raise UsageError(f"{where} has no nodes (check partition: in the hosts file)")
    if name:
        chosen = [row for row in listed if row[0] == name]
    else:
        chosen = [row for row in listed if row[2] in addresses]
        if not chosen:
            host = socket.gethostname()
            names = {host, host.split(".")[0], socket.getfqdn()}
            chosen = [row for row in listed if row[1] in names or row[0] in names]
    known = ", ".join(row[0] for row in listed[:8]) + (" ..." if len(listed) > 8 else "")
    if len(chosen) != 1:
        what = f"slurm_name {name!r} is not" if name else "no node at its address or host name is"
        if len(chosen) > 1:
            what = f"{', '.join(row[0] for row in chosen)} all match it: one must be"
        raise UsageError(f"{what} in {where} (its nodes: {known}); set slurm_name: for this host in the hosts file")
    return {"name": chosen[0][0], "state": chosen[0][3]}


def adopt(paths: Paths, data) -> dict:
    """Record the Slurm the hosts already ran (contract.SLURM_EXISTING): runs go there, none of our own
    daemons runs. `data`: {"partition", "conf", "tag", "names": {node-i: NodeName}}."""
    if not isinstance(data, dict) or not isinstance(data.get("names"), dict) or not data["names"]:
        raise UsageError("adopt needs {partition, conf, tag, names: {node-i: NodeName}}")
    record: dict[str, object] = {key: str(data.get(key) or "") for key in ("partition", "conf", "tag")}
    record["names"] = {str(k): str(v) for k, v in data["names"].items()}
    os.makedirs(paths.folder, mode=0o700, exist_ok=True)
    write_private(paths.at(contract.SLURM_EXISTING), json.dumps(record).encode(), 0o600)
    return record


def cancel_tagged(paths: Paths) -> list:
    """Cancel this stack's jobs (queued or running) in the Slurm the hosts already ran: the login user's
    whose comment is the stack's tag (random per `up`, so another stack of the same name is not ours);
    their ids. DaemonError where Slurm cannot be asked or does not cancel: nothing is known to be gone."""
    adopted = existing(paths)
    if not adopted or not adopted.get("tag"):
        return []
    environment = client_environment(paths)
    user = pwd.getpwuid(os.getuid()).pw_name
    listed = answered(environment, "squeue", "--noheader", f"--user={user}", "--format=%i|%k")
    rows = (line.partition("|") for line in listed.splitlines())
    ours = [job.strip() for job, _, comment in rows if comment.strip() == adopted["tag"]]
    if ours:
        answered(environment, "scancel", *ours)
    return ours
