"""The `ssh` provider: the user's own machines, listed in a hosts file, reached over SSH only.

    python deploy.py up --hosts hosts.yaml [--stack NAME]      # default stack: hosts

`up` checks every host at once (reachable, key accepted, Python 3.10+, GPUs, systemd and sudo, the
address it uses towards the head node), prints and pins each host key, and writes the inventory; it
creates nothing on the hosts and records nothing when any host fails. `down` stops the job and the
watchdog and removes what bootstrap put on the hosts, then forgets the stack; it never powers a
machine off.
"""

import asyncio
import ipaddress
import json
import re
import secrets
import shlex
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from infra import inventory, keys, ssh, state
from infra.errors import UsageError
from infra.inventory import ClusterInfo, NodeInfo, NodeStatus
from infra.providers.base import DownReport, Provider, UpRequest, UpResult
from node import contract, standalone

DEFAULT_STACK = "hosts"
NODE_SCRIPTS = Path(contract.__file__).resolve().parent  # node/: the scripts that run on a node
CHECK_TIMEOUT_S = 30.0
DOWN_TIMEOUT_S = 60.0
MAX_HOSTS = 16
MAX_HOSTS_FILE_BYTES = 1_000_000
"""A hosts file names at most MAX_HOSTS hosts: a bigger file is the wrong path (a log, a dataset)."""
FILE_KEYS = {
    "key",
    "user",
    "python",
    "shared_dir",
    "hourly_usd",
    "known_hosts",
    "hosts",
    "slurm",
    "partition",
    "slurm_conf",
}
HOST_KEYS = {"address", "port", "user", "private_ip", "slurm_name"}
SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PARTITION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Host:
    """One entry of the hosts file."""

    address: str
    """What the operator's machine connects to."""
    port: int
    """Its SSH port."""
    user: str
    """The login user there."""
    private_ip: str | None
    """What the other hosts use to reach it; None: probed at `up`."""
    slurm_name: str = ""
    """Its NodeName in the Slurm the hosts already run (`slurm: existing`); empty: found at bootstrap."""


@dataclass(frozen=True)
class HostsFile:
    """The hosts file, checked."""

    key: Path
    """The private key that logs into every host (`~` expanded)."""
    python: str
    """The interpreter bootstrap layers the node venv over."""
    shared_dir: str
    """A folder every host sees, or empty."""
    hourly_usd: float
    """What these machines cost per hour, for the ledger."""
    known_hosts: Path | None
    """Host keys to require; None: pin what each host offers on first contact."""
    hosts: tuple[Host, ...]
    """In the file's order."""
    slurm_existing: dict = field(default_factory=dict)
    """`slurm: existing`: the Slurm the hosts already run holds the runs, {"partition", "conf"} (each
    may be empty: Slurm's default partition, its default configuration); {} otherwise."""


@dataclass(frozen=True)
class HostCheck:
    """What `up` found on one host."""

    host: Host
    """The host."""
    problem: str
    """Why it cannot be used; empty when it can."""
    host_key: str = ""
    """Its public host key, `ssh-ed25519 AAAA...`."""
    fingerprint: str = ""
    """`SHA256:...` of that key."""
    facts: dict = field(default_factory=dict)
    """What the probe printed (node/probe.py); empty where the host could not be probed."""


# ---------------------------------------------------------------------------------- hosts file


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (at any level), which PyYAML would
    take silently, the last one winning; a merge (`<<:`) may still override what it brings in."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the safe loader's own error names it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (first at line {first + 1})", key_node.start_mark
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_hosts_file(path: str) -> HostsFile:
    """The checked hosts file; one UsageError naming every problem in it."""
    where = f"hosts file {path}"
    file = Path(path).expanduser()
    if file.exists() and not file.is_file() and not file.is_dir():  # /dev/zero is read for ever, a pipe waits
        raise UsageError(f"{where} is not a regular file (a device, a pipe?): give a YAML hosts file")
    try:
        with file.open("rb") as handle:
            raw = handle.read(MAX_HOSTS_FILE_BYTES + 1)
        if len(raw) > MAX_HOSTS_FILE_BYTES:
            raise UsageError(f"{where} is over {MAX_HOSTS_FILE_BYTES:,} bytes: give a YAML hosts file")
        data = yaml.load(raw.decode("utf-8"), Loader=UniqueKeyLoader)
    except FileNotFoundError:
        raise UsageError(f"no {where}: write one (see README, 'Your own machines')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]  # a NUL's error is two lines
        raise UsageError(f"{where} is not valid YAML{at}: {problem}") from None
    problems: list[str] = []
    parsed = _parse(data, problems)
    if problems or parsed is None:
        raise UsageError(f"{where}: " + "; ".join(problems))
    return parsed


def _parse(data, problems: list[str]) -> HostsFile | None:
    if not isinstance(data, dict):
        problems.append("must be a mapping with key:, user: and hosts:")
        return None
    unknown = sorted(set(map(str, data)) - FILE_KEYS)
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(FILE_KEYS))})")
    key = _key_path(data.get("key"), problems)
    default_user = _given_text(data, "user", "user", problems)
    python = _text(data.get("python", "python3"), "python", problems) or "python3"
    shared_dir = _given_text(data, "shared_dir", "shared_dir", problems)
    if shared_dir and not shared_dir.startswith("/"):
        problems.append(f"shared_dir {shared_dir!r} must be an absolute path")
    hourly_usd = _hourly_usd(data.get("hourly_usd", 0), problems)
    known_hosts = _known_hosts(data.get("known_hosts"), problems)
    hosts = _hosts(data.get("hosts"), default_user, problems)
    existing = _slurm_existing(data, hosts, problems)
    if problems:
        return None
    return HostsFile(key, python, shared_dir.rstrip("/") or shared_dir, hourly_usd, known_hosts, hosts, existing)


def _slurm_existing(data: dict, hosts: tuple[Host, ...], problems: list[str]) -> dict:
    """`slurm: existing` with its optional `partition:` and `slurm_conf:` (and hosts' `slurm_name:`)."""
    slurm = data.get("slurm")
    if slurm is None:
        for key in ("partition", "slurm_conf"):
            if key in data:
                problems.append(f"{key}: is for a Slurm the hosts already run: add slurm: existing")
        if any(h.slurm_name for h in hosts):
            problems.append("slurm_name: is for a Slurm the hosts already run: add slurm: existing")
        return {}
    if slurm != "existing":
        problems.append(
            f"slurm: {slurm!r} is not understood: slurm: existing adopts the Slurm the hosts already run "
            "(leave it out and fab bootstrap sets up Slurm of its own)"
        )
        return {}
    partition = _given_text(data, "partition", "partition", problems)
    if partition and not PARTITION.match(partition):
        problems.append(f"partition {partition!r} is not a Slurm partition name")
    conf = _given_text(data, "slurm_conf", "slurm_conf", problems)
    if conf and not conf.startswith("/"):
        problems.append(f"slurm_conf {conf!r} must be an absolute path on the hosts")
    names = [h.slurm_name for h in hosts if h.slurm_name]
    if len(set(names)) < len(names):
        problems.append("slurm_name: two hosts name the same Slurm node")
    return {"partition": partition, "conf": conf}


def _text(value, name: str, problems: list[str], required: bool = True) -> str:
    if value is None or value == "":
        if required:
            problems.append(f"{name}: is empty")
        return ""
    if not isinstance(value, str) or "\n" in value or not value.strip():
        problems.append(f"{name}: must be one line of text, not {value!r}")
        return ""
    return value.strip()


def _given_text(mapping: dict, key: str, name: str, problems: list[str]) -> str:
    """An optional key's text: left out is "", but written and empty (`user: ""`, `user:`) is a problem,
    not a silent fall-back to the default."""
    if key not in mapping:
        return ""
    if mapping[key] in (None, ""):
        problems.append(f"{name}: is empty: give it a value or leave the key out")
        return ""
    return _text(mapping[key], name, problems)


def _key_path(value, problems: list[str]) -> Path:
    if not value:
        problems.append("key: is missing (the private key that logs into every host)")
        return Path()
    if not isinstance(value, str):
        problems.append(f"key: must be a path, not {value!r}")
        return Path()
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        problems.append(f"key {path} does not exist")
    elif stat.S_IMODE(path.stat().st_mode) & 0o077:
        problems.append(f"key {path} is readable by others, which ssh refuses: chmod 600 {path}")
    return path


def _hourly_usd(value, problems: list[str]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        problems.append(f"hourly_usd: must be a number >= 0, not {value!r}")
        return 0.0
    return float(value)


def _known_hosts(value, problems: list[str]) -> Path | None:
    if value in (None, ""):
        return None
    path = Path(str(value)).expanduser().resolve()
    if not path.is_file():
        problems.append(f"known_hosts {path} does not exist")
    return path


def _hosts(value, default_user: str, problems: list[str]) -> tuple[Host, ...]:
    if not isinstance(value, list) or not value:
        problems.append("hosts: must be a non-empty list of {address: ...}")
        return ()
    if len(value) > MAX_HOSTS:
        problems.append(f"hosts: at most {MAX_HOSTS}, not {len(value)}")
    hosts, seen = [], set()
    for index, entry in enumerate(value):
        host = _host(index, entry, default_user, problems)
        if host is None:
            continue
        if (host.address, host.port) in seen:
            problems.append(f"hosts[{index}]: {host.address}:{host.port} is listed twice")
        seen.add((host.address, host.port))
        hosts.append(host)
    return tuple(hosts)


def _host(index: int, entry, default_user: str, problems: list[str]) -> Host | None:
    where = f"hosts[{index}]"
    if isinstance(entry, str):
        entry = {"address": entry}
    if not isinstance(entry, dict):
        problems.append(f"{where}: must be a mapping with address:")
        return None
    before = len(problems)
    unknown = sorted(set(map(str, entry)) - HOST_KEYS)
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(HOST_KEYS))})")
    address = _text(entry.get("address"), f"{where} address", problems)
    port = entry.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        problems.append(f"{where}: port must be 1..65535, not {port!r}")
    user = _given_text(entry, "user", f"{where} user", problems) or default_user
    if not user and address and "user" not in entry:  # an empty one is named above
        problems.append(f"{where}: no user (set user: for the file or the host)")
    private_ip = entry.get("private_ip")
    if private_ip is not None:
        try:
            private_ip = str(ipaddress.ip_address(str(private_ip)))
        except ValueError:
            problems.append(f"{where}: private_ip {private_ip!r} is not an IP address")
    slurm_name = _given_text(entry, "slurm_name", f"{where} slurm_name", problems)
    if slurm_name and not SLURM_NAME.match(slurm_name):
        problems.append(f"{where}: slurm_name {slurm_name!r} is not a Slurm node name")
    return Host(address, port, user, private_ip, slurm_name) if len(problems) == before else None


# --------------------------------------------------------------------------------------- checks


async def check_host(hosts_file: HostsFile, host: Host, head_address: str) -> HostCheck:
    """Connect, note the host key, and run the probe from stdin (nothing is written on the host)."""
    import asyncssh  # loaded where it connects: other `deploy.py` commands start without it

    known_hosts = str(hosts_file.known_hosts) if hosts_file.known_hosts else None
    try:
        async with asyncssh.connect(
            host.address,
            host.port,
            **ssh.asyncssh_options(str(hosts_file.key), known_hosts, host.user, CHECK_TIMEOUT_S / 2),
        ) as conn:
            server_key = conn.get_server_host_key()
            probe = (NODE_SCRIPTS / "probe.py").read_text()
            command = (
                f"{shlex.quote(hosts_file.python)} - --host {shlex.quote(host.address)} {shlex.quote(head_address)}"
            )
            if hosts_file.slurm_existing:  # its Slurm asked now, not at bootstrap's sixth stage
                slurm = {**hosts_file.slurm_existing, "name": host.slurm_name}
                command += " " + shlex.quote(json.dumps(slurm))
            result = await asyncio.wait_for(conn.run(command, input=probe, check=False), CHECK_TIMEOUT_S)
    except ssh.connection_errors() as exc:
        return HostCheck(host, _connect_problem(exc, hosts_file))
    if server_key is None:  # asyncssh has one once the handshake is done; a server that offered none is refused
        return HostCheck(host, "it offered no host key")
    host_key = server_key.export_public_key().decode().strip()
    fingerprint = server_key.get_fingerprint("sha256")
    problem, facts = _probe_problem(result, hosts_file.python)
    if not problem and facts.get("slurm_problem"):
        problem = facts["slurm_problem"]
    if not problem and not (host.private_ip or facts.get("private_ip")):
        problem = "cannot tell which address it uses towards the head node: set its private_ip"
    return HostCheck(host, problem, host_key, fingerprint, facts)


def _connect_problem(exc: BaseException, hosts_file: HostsFile) -> str:
    import asyncssh

    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return f"its host key is not in known_hosts {hosts_file.known_hosts}"
    if isinstance(exc, asyncssh.PermissionDenied):
        return f"the key {hosts_file.key} was refused"
    if isinstance(exc, asyncssh.KeyImportError):
        return f"cannot use the key {hosts_file.key}: {exc}"
    return f"unreachable ({ssh.describe(exc)})"


def _probe_problem(result, python: str) -> tuple[str, dict]:
    if result.exit_status == 127:
        return f"{python} not found (set python: to an interpreter 3.10 or newer)", {}
    try:
        facts = json.loads((result.stdout or "").strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = " ".join((result.stderr or result.stdout or "").split())[-160:]
        return f"{python} could not run the probe (exit {result.exit_status}: {why})", {}
    if not facts.get("python_ok"):
        return f"{python} is Python {facts.get('python')}; 3.10 or newer is needed", facts
    return "", facts


def check_hosts(hosts_file: HostsFile) -> list[HostCheck]:
    """Every host at once."""
    head = hosts_file.hosts[0]
    head_address = head.private_ip or head.address

    async def all_hosts():
        return await asyncio.gather(*(check_host(hosts_file, h, head_address) for h in hosts_file.hosts))

    return asyncio.run(all_hosts())


# ------------------------------------------------------------------------------------------- up


def up(hosts_path: str, stack: str, say=print) -> tuple[ClusterInfo, bool]:
    """Check the hosts and write the inventory; returns (cluster, created). Records nothing on refusal.
    On a stack that is up, the file is read and must list the same hosts (nothing is changed in place)."""
    hosts_file = read_hosts_file(hosts_path)
    if inventory.inventory_path(stack).exists():
        cluster = inventory.load(stack)
        _refuse_other_hosts(cluster, hosts_file, hosts_path)
        return cluster, False
    _refuse_hosts_of_other_stacks(stack, hosts_file)
    checks = check_hosts(hosts_file)
    problems = [f"{c.host.address}:{c.host.port}: {' '.join(c.problem.split())}" for c in checks if c.problem]
    if problems:
        raise UsageError(f"{len(problems)} of {len(checks)} host(s) cannot be used: " + "; ".join(problems))
    checks = _rank_order(checks)
    for index, check in enumerate(checks):
        say(
            f"node-{index}: {check.host.user}@{check.host.address}:{check.host.port} "
            f"host key {check.fingerprint} (pinned)"
        )
    stack_path = state.stack_dir(stack)
    known_hosts = stack_path / state.KNOWN_HOSTS
    keys.write_known_hosts(
        known_hosts, [keys.known_hosts_entry(c.host.address, c.host.port, c.host_key) for c in checks]
    )
    cluster = _cluster(stack, hosts_file, checks, known_hosts)
    inventory.save(cluster)
    state.set_current_stack(stack)
    return cluster, True


def _login(user: str, address: str, port: int) -> str:
    return f"{user}@{address}:{port}"


def _refuse_other_hosts(cluster: ClusterInfo, hosts_file: HostsFile, hosts_path: str) -> None:
    """A stack that is up takes the same hosts again or none: hosts are not added or swapped in place."""
    have = sorted(_login(n.ssh_user, n.public_ip, n.ssh_port) for n in cluster.nodes)
    want = sorted(_login(h.user, h.address, h.port) for h in hosts_file.hosts)
    if have != want:
        raise UsageError(
            f"stack {cluster.stack!r} is up on {', '.join(have)}, and {hosts_path} lists {', '.join(want)}: "
            f"hosts are not changed in place: python deploy.py down --stack {cluster.stack}, "
            f"then python deploy.py up --hosts {hosts_path}"
        )
    named = {_login(h.user, h.address, h.port): h.slurm_name for h in hosts_file.hosts}
    settings = {key: value for key, value in cluster.slurm_existing.items() if key != "tag"}
    if settings != hosts_file.slurm_existing or any(
        named[_login(n.ssh_user, n.public_ip, n.ssh_port)] != n.slurm_name for n in cluster.nodes
    ):
        raise UsageError(
            f"stack {cluster.stack!r} is up with other Slurm settings than {hosts_path} has (slurm:, partition:, "
            f"slurm_conf:, slurm_name:): python deploy.py down --stack {cluster.stack}, "
            f"then python deploy.py up --hosts {hosts_path}"
        )


def _refuse_hosts_of_other_stacks(stack: str, hosts_file: HostsFile) -> None:
    """A login another stack uses is refused: the two stacks would share its ~/.gpu-cluster, and the
    `down` of either would remove the other's files."""
    wanted = {_login(h.user, h.address, h.port) for h in hosts_file.hosts}
    for other in state.stacks_up():
        if other == stack:
            continue
        try:
            nodes = inventory.load(other).nodes
        except UsageError:
            continue  # a damaged inventory says so where it is used
        shared = sorted(wanted & {_login(n.ssh_user, n.public_ip, n.ssh_port) for n in nodes})
        if shared:
            raise UsageError(
                f"{', '.join(shared)} is in use by stack {other!r} (the two would share ~/.gpu-cluster there, "
                f"and down of either would remove the other's): use another user on that host, "
                f"or python deploy.py down --stack {other} first"
            )


def _private_ip(check: HostCheck) -> str:
    return check.host.private_ip or check.facts["private_ip"]


def _rank_order(checks: list[HostCheck]) -> list[HostCheck]:
    """torchrun ranks nodes by their address (as text): number them that way, so node-0, which holds
    the rendezvous and MASTER_ADDR, is also where global rank 0 runs. Ties keep the file's order."""
    return sorted(checks, key=_private_ip)


def _cluster(stack: str, hosts_file: HostsFile, checks: list[HostCheck], known_hosts: Path) -> ClusterInfo:
    nodes = tuple(
        NodeInfo(
            f"node-{i}",
            c.host.address,
            _private_ip(c),
            c.host.port,
            int(c.facts.get("gpus") or 0),
            c.host.user,
            c.host.slurm_name,
        )
        for i, c in enumerate(checks)
    )
    daemons = {c.facts.get("daemon") for c in checks}
    return ClusterInfo(
        stack=stack,
        provider=SshProvider.name,
        region=SshProvider.name,
        instance_type="own machines",
        hourly_usd=hosts_file.hourly_usd,
        ssh_user=checks[0].host.user,
        ssh_key=str(hosts_file.key),
        known_hosts=str(known_hosts),
        shared_dir=hosts_file.shared_dir,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        nodes=nodes,
        python=hosts_file.python,
        daemon="systemd" if daemons == {"systemd"} else "detached",
        # The comment this stack's jobs carry there, random so that another stack of the same name (another
        # state folder, another laptop) is never taken for this one when `down` cancels.
        slurm_existing={**hosts_file.slurm_existing, "tag": f"gpu-cluster:{stack}:{secrets.token_hex(6)}"}
        if hosts_file.slurm_existing
        else {},
    )


# ----------------------------------------------------------------------------------------- down


async def _clean_node(cluster: ClusterInfo, node: NodeInfo) -> dict:
    script = standalone.source("cleanup")
    args = [contract.shell(contract.HOME_DIR)]
    if cluster.shared_dir:
        args += [f"{cluster.shared_dir}/code", *contract.SYNCED]
    command = " ".join([shlex.quote(cluster.python), "-", *map(shlex.quote, args)])
    try:
        async with ssh.connect(cluster, node, timeout_s=DOWN_TIMEOUT_S / 4) as conn:
            result = await asyncio.wait_for(conn.run(command, input=script, check=False), DOWN_TIMEOUT_S)
        return json.loads(result.stdout.strip().splitlines()[-1])
    except ssh.connection_errors() as exc:
        return {"error": ssh.describe(exc)}
    except (ValueError, IndexError):
        return {"error": f"cleanup failed: {' '.join((result.stderr or '').split())[-160:]}"}


def down(stack: str, say=print) -> bool:
    """Clean every host (job, watchdog, ~/.gpu-cluster, synced code) and forget the stack; the machines
    keep running. False, and the stack kept, when a host could not be cleaned."""
    cluster = inventory.load(stack)

    async def all_nodes():
        return await asyncio.gather(*(_clean_node(cluster, n) for n in cluster.nodes))

    reports = asyncio.run(all_nodes())
    failed, said = [], set()
    for node, report in zip(cluster.nodes, reports, strict=True):
        if "error" in report:
            failed.append(node.name)
            say(f"{node.name} ({node.ssh_user}@{node.public_ip}): not cleaned: {report['error']}")
            continue
        daemons = f", ended {', '.join(report['daemons'])}" if report["daemons"] else ""
        # A site's one controller answers every node's scancel with the same jobs: each is said once.
        cancelled = [job for job in report.get("cancelled") or [] if job not in said]
        said.update(cancelled)
        slurm = f", cancelled Slurm job(s) {', '.join(cancelled)}" if cancelled else ""
        removed = ", ".join(report["removed"]) or "nothing to remove"
        say(f"{node.name} ({node.ssh_user}@{node.public_ip}): job {report['job']}{daemons}{slurm}; removed {removed}")
    if failed:
        return False
    state.forget(stack)
    return True


# --------------------------------------------------------------------------------------- status


def status(cluster: ClusterInfo) -> list[NodeStatus]:
    """Per host: a real SSH round trip, and the machine's uptime."""

    async def all_nodes():
        return await asyncio.gather(*(_status_row(cluster, n) for n in cluster.nodes))

    return asyncio.run(all_nodes())


async def _status_row(cluster: ClusterInfo, node: NodeInfo) -> NodeStatus:
    started = time.perf_counter()
    uptime_s, error = None, ""
    try:
        result = await ssh.run(cluster, node, "cat /proc/uptime", timeout_s=5.0)
        if result.exit_status == 0:
            uptime_s = float(result.stdout.split()[0])
        else:
            error = f"exited {result.exit_status}"
    except ssh.connection_errors() as exc:
        error = ssh.describe(exc)
    except (ValueError, IndexError):
        uptime_s = None
    return NodeStatus(
        name=node.name,
        address=f"{node.public_ip}:{node.ssh_port}",
        state="down" if error else "up",
        reachable=not error,
        round_trip_ms=round((time.perf_counter() - started) * 1000, 1),
        uptime_s=None if uptime_s is None else round(uptime_s),
        error=error,
    )


# ------------------------------------------------------------------------------------- provider


class SshProvider(Provider):
    """The user's own machines from a hosts file; creates nothing on them and powers nothing off."""

    name = "ssh"
    accepts = frozenset({"hosts_file"})
    what = "a hosts-file cluster (your own machines)"
    why_not = "the hosts file says what the machines are, and nothing powers them off"
    flag = "--hosts"
    default_stack = DEFAULT_STACK

    def check(self, request: UpRequest) -> None:
        if request.hosts_file:
            read_hosts_file(request.hosts_file)

    def up(self, request: UpRequest, say) -> UpResult:
        if not request.hosts_file:
            raise UsageError(f"stack {request.stack!r} is not up: pass --hosts FILE to bring your machines up")
        cluster, created = up(request.hosts_file, request.stack, say=say)
        return UpResult(cluster, created)

    def down(self, stack: str, say) -> DownReport:
        if not inventory.inventory_path(stack).exists():
            say(f"nothing to do: stack '{stack}' is not up")
            return DownReport(0)
        say(f"cleaning stack '{stack}' on its hosts (job, watchdog, ~/.gpu-cluster); the machines keep running ...")
        if not down(stack, say=say):
            say(f"the stack is kept: run python deploy.py down --stack {stack} again once every host answers")
            return DownReport(1, ended=False)
        say(f"stack '{stack}' is down: nothing of it is left on its hosts; they were not powered off")
        return DownReport(0)

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        return status(cluster), {}
