"""The AWS provider: preflight, `pulumi up` through the Automation API, pinned host keys, the inventory;
`pulumi destroy` and a sweep that proves nothing billable is left; status from EC2 itself."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shlex
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from infra import config as stack_config
from infra import inventory, keys, ssh, state
from infra.cloud_init import READY_MARKER, SHARED_DIR, SSH_USER
from infra.config import StackConfig
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo, NodeInfo, NodeStatus
from infra.providers.base import DownReport, Provider, UpRequest, UpResult
from infra.tags import NODE_TAG
from infra.timeline import Timeline

if TYPE_CHECKING:  # boto3 and Pulumi load only when AWS is used (about 2 s)
    from infra import automation, preflight, teardown

READY_TIMEOUT_S = 900
HOST_KEY_BLOCK = re.compile(r"-----BEGIN SSH HOST KEY KEYS-----(.*?)-----END SSH HOST KEY KEYS-----", re.S)
WATCHDOG_LINE = re.compile(r"gpu-cluster-watchdog: (.*)")


def up(
    request: UpRequest,
    clients: preflight.AwsClients | None = None,
    command=None,
    lookup_ip: Callable[[], str] | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = print,
) -> UpResult:
    """Create the cluster (or say it is up)."""
    from infra import automation, preflight

    if inventory.inventory_path(request.stack).exists():
        return UpResult(inventory.load(request.stack), False)
    config = stack_config.load_stack(request.stack, request.overrides)
    clients = clients or preflight.AwsClients.for_region(config.region)
    found = preflight.run(
        config,
        clients,
        cli_present=command is not None or automation.find_cli() is not None,
        lookup_ip=lookup_ip or preflight.lookup_public_ip,
    )
    for note in found.notes:
        say(f"note: {note}")
    if found.problems:
        raise UsageError(f"preflight found {len(found.problems)} problem(s): " + "; ".join(found.problems))
    # Without a problem, preflight has found the caller's address and priced the cluster.
    assert found.ssh_cidr is not None and found.estimate is not None
    _confirm_cost(config, found, request.yes, confirm, say)
    timeline = request.timeline
    timeline.mark("preflight")
    key_path = keys.ensure_client_key(state.stack_dir(request.stack))
    config = program_config(config, found, keys.public_key_text(key_path))
    deployment = automation.Deployment(request.stack, command, on_output=lambda line: say(line.rstrip()))
    outputs = _up_with_zone_fallback(deployment, config, found.zones, say)
    found_nodes = _group_nodes_found(request.stack, outputs["nodes"], clients.ec2, say, autoscaling=clients.autoscaling)
    outputs = {**outputs, "nodes": found_nodes}
    # EC2's launch time ends the API part (networks, EFS, the RunInstances); Pulumi returns once they run.
    timeline.event("api", _launched_at(clients.ec2, [n.get("instance_id") for n in found_nodes]))
    timeline.mark("pending to running")
    cluster = _cluster_from_outputs(request.stack, config, outputs, key_path, found.estimate.hourly_usd)
    _pin_and_wait(cluster, outputs, clients.ec2, say, timeline)
    inventory.save(cluster)
    state.set_current_stack(request.stack)
    return UpResult(cluster, True, tuple(found.estimate.lines))


def program_config(config: StackConfig, found: preflight.PreflightResult, public_key: str) -> StackConfig:
    """The config the program runs with: what preflight found (the caller's address, whether billing lists
    the stack tag, so that it is activated now) and the cluster's key."""
    assert found.ssh_cidr is not None  # preflight found no problem
    config = stack_config.with_ssh(config, found.ssh_cidr, public_key)
    return dataclasses.replace(config, cost_allocation_tag_seen=found.cost_tag_seen)


def _confirm_cost(config, found: preflight.PreflightResult, yes: bool, confirm, say) -> None:
    say(
        f"preflight ok: account {found.account}, {config.region}, zones offering {config.instance_type}: "
        f"{', '.join(found.zones)}; SSH from {found.ssh_cidr}"
    )
    assert found.estimate is not None  # checked by up() before asking
    for line in found.estimate.text_lines():
        say(f"  {line}")
    if yes:
        return
    question = f"create {config.nodes} x {config.instance_type} at about ${found.estimate.hourly_usd:.2f}/h? [y/N] "
    if confirm is None:
        if not sys.stdin.isatty():
            raise UsageError("up needs confirmation of the hourly cost: pass --yes (no terminal to ask on)")
        confirm = lambda q: input(q).strip().lower() in ("y", "yes")  # noqa: E731
    if not confirm(question):
        raise UsageError("not confirmed: nothing was created")


def _up_with_zone_fallback(deployment: automation.Deployment, config, zones: list[str], say) -> dict:
    from infra import automation

    """`pulumi up`, moving to the next zone that offers the type when AWS has no capacity."""
    candidates = [config.availability_zone] if config.availability_zone else zones
    tried = []
    for zone in candidates:
        tried.append(zone)
        deployment.configure(stack_config.StackConfig(**{**config.__dict__, "availability_zone": zone}))
        say(f"pulumi up in {zone} ...")
        try:
            return deployment.up()
        except Exception as exc:
            if not automation.is_capacity_error(exc) or zone == candidates[-1]:
                hint = f"python deploy.py down --stack {config.stack} removes what was created"
                why = "no capacity in any zone" if automation.is_capacity_error(exc) else automation.first_line(exc)
                raise OperationError(f"up failed (zones tried: {', '.join(tried)}): {why}; {hint}") from None
            say(f"no {config.instance_type} capacity in {zone}; trying the next zone")
    raise OperationError("no zone to try")


def _cluster_from_outputs(stack: str, config, outputs: dict, key_path, hourly_usd: float) -> ClusterInfo:
    stack_path = state.stack_dir(stack)
    user = outputs.get("ssh_user", SSH_USER)
    nodes = tuple(
        NodeInfo(n["name"], n["public_ip"], n["private_ip"], int(n.get("ssh_port", 22)), config.gpus_per_node, user)
        for n in outputs["nodes"]
    )
    return ClusterInfo(
        stack=stack,
        provider="aws",
        region=config.region,
        instance_type=config.instance_type,
        hourly_usd=hourly_usd,
        ssh_user=user,
        ssh_key=str(key_path),
        known_hosts=str(stack_path / state.KNOWN_HOSTS),
        shared_dir=outputs.get("shared_dir", SHARED_DIR),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        nodes=nodes,
        python="python3",
        daemon="systemd",  # the DLAMI runs systemd and the user has sudo
        nodes_move=any("group" in n for n in outputs["nodes"]),
        image=config.ami_id or "",
    )


# ------------------------------------------------------------------------ nodes in Auto Scaling groups

LIVE_FIRST = {"running": 0, "pending": 1, "stopping": 2, "stopped": 3, "shutting-down": 4, "terminated": 5}


def current_instances(ec2, stack: str) -> dict[str, dict]:
    """Each node's instance now, by its node tag: a live one before one that is gone (a replaced worker's
    old instance stays listed for a while, terminated), the newest of equals."""
    from infra import teardown

    found: dict[str, dict] = {}
    for reservation in ec2.describe_instances(Filters=teardown.tag_filter(stack))["Reservations"]:
        for instance in reservation["Instances"]:
            name = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}.get(NODE_TAG)
            if name is None:
                continue
            if name not in found or _preference(instance) < _preference(found[name]):
                found[name] = instance
    return found


def _preference(instance: dict) -> tuple:
    launched = instance.get("LaunchTime")
    return (LIVE_FIRST.get(instance["State"]["Name"], 9), -launched.timestamp() if launched else 0)


def _group_nodes_found(
    stack: str, nodes: list[dict], ec2, say, timeout_s: float = READY_TIMEOUT_S, autoscaling=None
) -> list[dict]:
    """The program's nodes with every worker of an Auto Scaling group filled in (its instance, addresses),
    once EC2 has started it; OperationError at once where a group's last try to start one failed (no spot
    capacity in the zone, a quota)."""
    waiting = [n["name"] for n in nodes if "group" in n]
    if not waiting:
        return nodes
    say(f"waiting for the Auto Scaling groups to start {', '.join(waiting)} ...")
    deadline = time.monotonic() + timeout_s
    while True:
        instances = current_instances(ec2, stack)
        started = {
            name: instances[name]
            for name in waiting
            if instances.get(name, {}).get("State", {}).get("Name") == "running"
            and instances[name].get("PublicIpAddress")
        }
        if len(started) == len(waiting):
            break
        for node in nodes:
            if "group" in node and node["name"] not in started and autoscaling is not None:
                _refuse_failed_launch(autoscaling, stack, node)
        if time.monotonic() > deadline:
            missing = ", ".join(name for name in waiting if name not in started)
            raise OperationError(
                f"no instance started for {missing} in {timeout_s:.0f} s (see the Auto Scaling group's activity); "
                f"python deploy.py down --stack {stack} removes the cluster"
            )
        time.sleep(5)
    return [
        {
            **n,
            "instance_id": started[n["name"]]["InstanceId"],
            "public_ip": started[n["name"]]["PublicIpAddress"],
            "private_ip": started[n["name"]]["PrivateIpAddress"],
        }
        if n["name"] in started
        else n
        for n in nodes
    ]


def _refuse_failed_launch(autoscaling, stack: str, node: dict) -> None:
    activities = autoscaling.describe_scaling_activities(AutoScalingGroupName=node["group"], MaxRecords=1)
    last = (activities.get("Activities") or [{}])[0]
    if last.get("StatusCode") in ("Failed", "Cancelled"):
        why = (last.get("StatusMessage") or last.get("Description") or "no reason given").splitlines()[0]
        raise OperationError(
            f"{node['name']}'s Auto Scaling group could not start it: {why}; python deploy.py down --stack {stack} "
            "removes the cluster (another zone: availabilityZone in the stack config)"
        )


def adopt_replacements(cluster: ClusterInfo, ec2, say) -> ClusterInfo:
    """Workers EC2 replaced by itself (their group started a new instance in place of a reclaimed or dead
    one) become the inventory's: the new addresses, the new host key pinned from the instance's console
    output (never on first contact: a replacement nobody watched come up is trusted only through AWS),
    and an event in the ledger. A replacement whose key is not on its console yet keeps the old entry and
    is said so; the next command tries again."""
    instances = current_instances(ec2, cluster.stack)
    nodes, pinned = [], {}
    for node in cluster.nodes:
        instance = instances.get(node.name, {})
        address = instance.get("PublicIpAddress")
        if instance.get("State", {}).get("Name") != "running" or not address or address == node.public_ip:
            nodes.append(node)
            continue
        key = _console_host_key(ec2, instance["InstanceId"])
        if key is None:
            say(
                f"{node.name} was replaced (instance {instance['InstanceId']} at {address}); its host key is not on "
                "its console output yet, so it is not trusted yet: try again in a minute"
            )
            nodes.append(node)
            continue
        moved = NodeInfo(**{**node.__dict__, "public_ip": address, "private_ip": instance["PrivateIpAddress"]})
        pinned[node] = (moved, keys.known_hosts_entry(address, moved.ssh_port, key), instance)
        nodes.append(moved)
    if not pinned:
        return cluster
    known_hosts = Path(cluster.known_hosts)
    gone = {f"[{old.public_ip}]:{old.ssh_port}" for old in pinned} | {old.public_ip for old in pinned}
    kept = [line for line in known_hosts.read_text().splitlines() if line and line.split()[0] not in gone]
    keys.write_known_hosts(known_hosts, [*kept, *(entry for _, entry, _ in pinned.values())])
    updated = ClusterInfo(**{**cluster.__dict__, "nodes": tuple(nodes)})
    inventory.save(updated)
    from infra.ledger import Ledger

    ledger = Ledger()
    try:
        for old, (moved, _, instance) in pinned.items():
            launched = instance.get("LaunchTime")
            ledger.event(
                cluster.stack,
                "node replaced",
                old.name,
                f"by its Auto Scaling group: {instance['InstanceId']} at {moved.public_ip} (was {old.public_ip})",
                at=launched.timestamp() if launched else time.time(),
                seconds=0.0,
            )
            say(
                f"{old.name} was replaced by its Auto Scaling group: now {moved.public_ip}, "
                "host key pinned from its console"
            )
    finally:
        ledger.close()
    return updated


# ------------------------------------------------------------------------------------ host keys


def host_keys_from_console(console_output: str) -> list[str]:
    """The host keys cloud-init prints to the console, ed25519 first."""
    match = HOST_KEY_BLOCK.search(console_output or "")
    if not match:
        return []
    found = [" ".join(line.split()[:2]) for line in match.group(1).strip().splitlines() if line.strip()]
    return sorted(found, key=lambda k: not k.startswith("ssh-ed25519"))


def _console_host_key(ec2, instance_id: str) -> str | None:
    try:
        output = ec2.get_console_output(InstanceId=instance_id, Latest=True).get("Output", "")
    except Exception:  # console output is best effort; the key is then taken on first contact
        return None
    found = host_keys_from_console(output)
    return found[0] if found else None


def _launched_at(ec2, instance_ids: list) -> float | None:
    """The latest EC2 LaunchTime of the instances (epoch seconds), None where EC2 does not say."""
    ids = [i for i in instance_ids if i]
    if not ids:
        return None
    try:
        reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
        times = [i["LaunchTime"].timestamp() for r in reservations for i in r["Instances"] if i.get("LaunchTime")]
    except Exception:  # the timeline's split is a nicety: never fail an up over it
        return None
    return max(times) if times else None


def _pin_and_wait(cluster: ClusterInfo, outputs: dict, ec2, say, timeline: Timeline | None = None) -> None:
    """Pin each node's host key (from the console where it shows, else on first contact), then wait
    for SSH and cloud-init on every node at once."""
    timeline = timeline or Timeline(time.time())
    instance_ids = {n["name"]: n.get("instance_id") for n in outputs["nodes"]}
    deadline = time.monotonic() + READY_TIMEOUT_S
    say(f"waiting for SSH and cloud-init on {len(cluster.nodes)} nodes (up to {READY_TIMEOUT_S // 60} min) ...")
    entries = asyncio.run(_host_keys(cluster, instance_ids, ec2, deadline, say))
    keys.write_known_hosts(Path(cluster.known_hosts), entries)
    timeline.mark("ssh ready")
    asyncio.run(_wait_ready(cluster, deadline, instance_ids))
    timeline.mark("cloud-init")


async def _host_keys(cluster: ClusterInfo, instance_ids: dict, ec2, deadline: float, say) -> list[str]:
    async def one(node: NodeInfo) -> str:
        instance_id = instance_ids.get(node.name)
        key = _console_host_key(ec2, instance_id) if instance_id else None
        how = "from the console output"
        while key is None:
            try:
                key = await ssh.fetch_host_key(node.public_ip, node.ssh_port)
                how = "on first contact (trust on first use)"
            except ssh.connection_errors():
                if time.monotonic() > deadline:
                    raise OperationError(
                        f"{node.name} ({node.public_ip}) never answered SSH; "
                        f"python deploy.py down --stack {cluster.stack} removes the cluster"
                    ) from None
                await asyncio.sleep(5)
        say(f"{node.name}: host key pinned {how}")
        return keys.known_hosts_entry(node.public_ip, node.ssh_port, key)

    return list(await asyncio.gather(*(one(n) for n in cluster.nodes)))


def ready_command(instance_id: str | None) -> str:
    """Is cloud-init done on this instance? Its marker names the instance that wrote it: a node booted from
    an image of another node (`deploy.py image`) carries that node's marker until its own cloud-init ends."""
    if not instance_id:
        return f"test -f {READY_MARKER}"
    return f"grep -qsx {shlex.quote(instance_id)} {READY_MARKER}"


async def _wait_ready(cluster: ClusterInfo, deadline: float, instance_ids: dict | None = None) -> None:
    async def one(node: NodeInfo) -> None:
        command = ready_command((instance_ids or {}).get(node.name))
        while True:
            try:
                result = await ssh.run(cluster, node, command)
                if result.exit_status == 0:
                    return
            except ssh.connection_errors():
                pass
            if time.monotonic() > deadline:
                raise OperationError(
                    f"{node.name} did not finish cloud-init (EFS mount) in time: see "
                    "/var/log/gpu-cluster-init.log on it (python deploy.py ssh " + node.name + ")"
                )
            await asyncio.sleep(5)

    await asyncio.gather(*(one(n) for n in cluster.nodes))


# ----------------------------------------------------------------------------------------- down


def down(
    stack: str,
    clients: preflight.AwsClients | None = None,
    command=None,
    placement_ec2=None,
    say: Callable[[str], None] = print,
) -> list[teardown.Leftover]:
    """Destroy the stack, then sweep by tag; returns what is left (empty: nothing). The stack's images
    are kept, and said so with their cost."""
    from infra import automation, images, preflight, teardown

    region = _region_of(stack)
    clients = clients or preflight.AwsClients.for_region(region)
    deployment = automation.Deployment(stack, command, on_output=lambda line: say(line.rstrip()))
    try:
        deployment.destroy()
    except Exception as exc:
        raise OperationError(
            f"pulumi destroy failed: {automation.first_line(exc)}; run down again "
            "(it clears pending operations and refreshes first)"
        ) from None
    with preflight.aws_answers("after destroy, looking for leftovers"):
        leftovers = teardown.sweep(stack, clients.ec2, clients.efs, placement_ec2, clients.autoscaling)
        kept = images.ours(clients.ec2, stack)
    for line in teardown.kept_image_lines(stack, kept):
        say(line)
    if not leftovers:
        state.forget(stack)
    return leftovers


def _region_of(stack: str) -> str:
    try:
        return inventory.load(stack).region
    except UsageError:
        return stack_config.load_stack(stack).region


# --------------------------------------------------------------------------------------- status


def status(cluster: ClusterInfo, ec2) -> tuple[list[NodeStatus], dict]:
    from infra import preflight

    """Per node: EC2 state, uptime, addresses, SSH round trip; and why the cluster stopped itself, if it did."""
    with preflight.aws_answers(f"status of stack '{cluster.stack}'"):
        return _status(cluster, ec2)


def _status(cluster: ClusterInfo, ec2) -> tuple[list[NodeStatus], dict]:

    instances = current_instances(ec2, cluster.stack)
    running = [n for n in cluster.nodes if instances.get(n.name, {}).get("State", {}).get("Name") == "running"]
    probes = {p.node.name: p for p in ssh.probe_nodes(_only(cluster, running))} if running else {}
    now = datetime.now(timezone.utc)
    rows: list[NodeStatus] = []
    stopped: dict = {}
    for node in cluster.nodes:
        instance = instances.get(node.name, {})
        ec2_state = instance.get("State", {}).get("Name", "missing")
        probe = probes.get(node.name)
        launched = instance.get("LaunchTime")
        rows.append(
            NodeStatus(
                name=node.name,
                address=f"{node.public_ip}:{node.ssh_port}",
                state=ec2_state,
                reachable=bool(probe and probe.reachable),
                round_trip_ms=round(probe.round_trip_ms, 1) if probe else None,
                uptime_s=(now - launched).total_seconds() if launched and ec2_state == "running" else None,
                error=(probe.error if probe else instance.get("StateReason", {}).get("Message", "")),
                instance_id=instance.get("InstanceId", ""),
            )
        )
        if ec2_state in ("stopped", "terminated", "shutting-down") and not stopped:
            stopped = _stop_record(ec2, instance)
    return rows, stopped


def _only(cluster: ClusterInfo, nodes: list[NodeInfo]) -> ClusterInfo:
    return ClusterInfo(**{**cluster.__dict__, "nodes": tuple(nodes)})


def _stop_record(ec2, instance: dict) -> dict:
    """The watchdog's marker as the guard echoed it to the console, else EC2's own reason; {} if
    the instance did not shut itself down."""
    try:
        output = ec2.get_console_output(InstanceId=instance["InstanceId"]).get("Output", "")
        match = WATCHDOG_LINE.search(output or "")
        if match:
            return json.loads(match.group(1))
    except Exception:  # console output may be gone for a terminated instance, or garbled
        pass
    message = instance.get("StateReason", {}).get("Message", "")
    return {"reason": message} if "InstanceInitiatedShutdown" in message else {}


# ------------------------------------------------------------------------------------- provider


class AwsProvider(Provider):
    """EC2 instances, EFS and a VPC of their own, through Pulumi (the program: infra/cluster.py)."""

    name = "aws"
    accepts = frozenset({"nodes", "instanceType", "spot", "sshCidr", "maxTotalUsd", "idleMinutes", "amiId", "yes"})
    cloud_plan = True
    what = "AWS"
    why_not = "they are for --local (the nodes' loopback addresses and ports)"
    default_stack = "dev"

    def check(self, request: UpRequest) -> None:
        stack_config.load_stack(request.stack, request.overrides)  # bad input: one line now, before boto3 and Pulumi

    def up(self, request: UpRequest, say) -> UpResult:
        if not stack_config.stack_file(request.stack).exists():
            say(
                f"note: no Pulumi.{request.stack}.yaml: using the defaults (2 x {stack_config.DEFAULT_INSTANCE_TYPE} "
                f"in {stack_config.DEFAULT_REGION}) and your flags"
            )
        return up(request, say=say)

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        return stack_config.load_stack(request.stack, request.overrides), None

    def replacement_problem(self, cluster: ClusterInfo) -> str:
        if cluster.nodes_move:
            return ""  # spot workers: each one's Auto Scaling group replaces it (cloud-init's guard powers it off)
        return f"stack {cluster.stack!r} runs on-demand nodes, which nothing replaces (spot: true in its config)"

    def spot_drill(
        self, cluster: ClusterInfo, node: str, notice_s: float, say, fis_role: str | None = None, yes: bool = False
    ) -> None:
        import boto3

        from infra import preflight, spot_fis

        cluster.node(node)
        if not fis_role:
            raise UsageError(
                f"drill spot on AWS runs an AWS FIS experiment ({spot_fis.ACTION_ID}) on {node}'s instance: "
                "pass --fis-role ARN, an IAM role FIS may assume with ec2:SendSpotInstanceInterruptions "
                "and ec2:DescribeInstances"
            )
        spot_fis.check_notice(notice_s)
        session = boto3.Session(region_name=cluster.region)
        with preflight.aws_answers(f"drill spot {node}"):
            experiment = spot_fis.interrupt(
                session.client("ec2"), session.client("fis"), cluster.stack, node, cluster.region, notice_s, fis_role
            )
        say(f"{node}: AWS FIS experiment {experiment} posts the spot notice; interrupted in {notice_s:g} s")

    def down(self, stack: str, say) -> DownReport:
        from infra import teardown

        say(f"destroying stack '{stack}' (instances, EFS and the data on it, network) ...")
        leftovers = down(stack, say=say)
        for line in teardown.report_lines(leftovers):
            say(line)
        if leftovers:
            say(f"run python deploy.py down --stack {stack} again, or delete these by hand")
            return DownReport(1)
        return DownReport(0)

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        from infra import preflight

        return status(cluster, preflight.AwsClients.for_region(cluster.region).ec2)

    def adopt_replacements(self, cluster: ClusterInfo, say) -> ClusterInfo:
        from infra import preflight

        with preflight.aws_answers(f"looking for replaced nodes of stack '{cluster.stack}'"):
            return adopt_replacements(cluster, preflight.AwsClients.for_region(cluster.region).ec2, say)
