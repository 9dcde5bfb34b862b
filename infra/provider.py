"""One interface over the three ways to have a cluster: `local`, `aws` and `ssh`.

Each provider's `up` writes the inventory (with the node facts that differ by provider: interpreter,
shared folder, how a daemon is kept alive, GPUs) and records the cluster in the ledger; `down` removes
what the provider made and says what it did; `status` gives one row per node. `deploy.py` picks the
provider with `for_up` and `for_stack` and never asks which one it has.
"""

import json
import time
from dataclasses import dataclass

from infra import config, costs, inventory, report, state
from infra.config import StackConfig
from infra.errors import UsageError
from infra.inventory import ClusterInfo, NodeStatus
from infra.local import provider as local

DEFAULT_AWS_STACK = "dev"


@dataclass(frozen=True)
class UpRequest:
    """What `deploy.py up` asks for; each provider takes what concerns it and refuses the rest."""

    stack: str
    """The stack to bring up."""
    overrides: dict
    """Stack-config values from the command line (None where not given)."""
    yes: bool = False
    """AWS: do not ask to confirm the hourly cost."""
    bind: str | None = None
    """local: node-0's loopback address."""
    ssh_port: int | None = None
    """local: node-0's SSH port."""
    hosts_file: str | None = None
    """ssh: the hosts file."""


class Provider:
    """up / down / status for one kind of cluster."""

    name = ""
    cloud_plan = False
    """Whether `deploy.py plan` applies: the stack is a cloud program whose resources can be listed offline."""
    what = ""
    """What the provider's clusters are, for messages: "the local provider", "your own machines"."""

    def up(self, request: UpRequest, say) -> tuple[ClusterInfo, bool]:
        """Bring the cluster up (or find it up) and write the inventory; returns (cluster, created)."""
        raise NotImplementedError

    def down(self, stack: str, say) -> int:
        """Remove what the stack made and say what; returns the exit code."""
        raise NotImplementedError

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        """One NodeStatus per node, and the watchdog's stop record when the cluster stopped itself ({} otherwise)."""
        raise NotImplementedError

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        """For a cluster `up` created: the stack config whose guards the watchdog enforces (None: no
        guards apply), and what the same hours would cost on AWS (None: the cluster is priced itself)."""
        return None, None

    def note_self_stops(self, say) -> None:
        """Close the ledger intervals of this provider's clusters that powered themselves off."""

    def interrupted_stacks(self) -> list[str]:
        """Stacks an `up` killed midway left running without an inventory (found from what is on disk)."""
        return []


class LocalProvider(Provider):
    """N SSH-server nodes on this machine's loopback (infra/local/provider.py)."""

    name = "local"
    what = "the local provider"

    def up(self, request: UpRequest, say) -> tuple[ClusterInfo, bool]:
        stack_config = config.load_stack(request.stack, {**request.overrides, "sshCidr": None, "spot": None})
        asked = {
            name
            for name, value in (
                ("nodes", request.overrides.get("nodes")),
                ("instance_type", request.overrides.get("instanceType")),
                ("first_address", request.bind),
                ("ssh_port", request.ssh_port),
            )
            if value is not None
        }
        ssh_port = local.DEFAULT_SSH_PORT if request.ssh_port is None else request.ssh_port
        options = local.LocalOptions(
            request.stack,
            stack_config.nodes,
            stack_config.instance_type,
            request.bind,
            ssh_port,
            asked=frozenset(asked),
        )
        return local.up(options)

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        stack_config = config.load_stack(request.stack, {**request.overrides, "sshCidr": None, "spot": None})
        reference = costs.reference_hourly_usd(stack_config.instance_type, stack_config.region, stack_config.nodes)
        return stack_config, reference

    def down(self, stack: str, say) -> int:
        stopped_itself = local.stop_record(stack)
        shared = local.shared_contents(stack)
        if shared.files:
            say(
                f"removing {report.relative(shared.path)}: {report.plural(shared.files, 'file')}, "
                f"{shared.describe_size()} (datasets, checkpoints, anything jobs wrote there)"
            )
        started = time.perf_counter()
        result = local.down(stack)
        elapsed = time.perf_counter() - started
        if stopped_itself:
            costs.record_self_stop(stack, stopped_itself.get("reason", "stopped"), stopped_itself.get("at"), say)
        costs.record_down(stack, say=say)
        if result.listening:
            say(f"still listening after down: {', '.join(result.listening)}")
            return 1
        if not result.was_up:
            say(f"nothing to do: stack '{stack}' is not up")
        elif stopped_itself:
            say(f"stack '{stack}' had stopped itself ({stopped_itself.get('reason', 'stopped')}); state removed")
        elif result.stopped == 0:
            say(f"stack '{stack}': no node was running; state removed, run logs kept")
        else:
            say(
                f"stack '{stack}' is down: {report.plural(result.stopped, 'node')} stopped in {elapsed:.1f} s, "
                "no port left listening"
            )
        _say_runs_kept(stack, say)
        return 0

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        rows = [
            NodeStatus(
                name=s.node.name,
                address=f"{s.node.public_ip}:{s.node.ssh_port}",
                state="up" if s.reachable else "down",
                reachable=s.reachable,
                round_trip_ms=round(s.round_trip_ms, 1),
                uptime_s=None if s.uptime_s is None else round(s.uptime_s),
                error=s.error,
            )
            for s in local.status(cluster)
        ]
        return rows, local.stop_record(cluster.stack)

    def note_self_stops(self, say) -> None:
        for name in local.stacks_that_stopped_themselves():
            record = local.stop_record(name)
            costs.record_self_stop(name, record.get("reason", "stopped"), record.get("at"), say)

    def interrupted_stacks(self) -> list[str]:
        return local.stacks_without_inventory()


class AwsProvider(Provider):
    """EC2 instances, EFS and a VPC of their own, through Pulumi (infra/aws_provider.py)."""

    name = "aws"
    cloud_plan = True
    what = "AWS"

    def up(self, request: UpRequest, say) -> tuple[ClusterInfo, bool]:
        config.load_stack(request.stack, request.overrides)  # bad input: one line now, before boto3 and Pulumi load
        from infra import aws_provider

        if not config.stack_file(request.stack).exists():
            say(
                f"note: no Pulumi.{request.stack}.yaml: using the defaults (2 x {config.DEFAULT_INSTANCE_TYPE} "
                f"in {config.DEFAULT_REGION}) and your flags"
            )
        return aws_provider.up(aws_provider.UpRequest(request.stack, request.overrides, request.yes), say=say)

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        return config.load_stack(request.stack, request.overrides), None

    def down(self, stack: str, say) -> int:
        from infra import aws_provider, teardown

        say(f"destroying stack '{stack}' (instances, EFS and the data on it, network) ...")
        leftovers = aws_provider.down(stack, say=say)
        costs.record_down(stack, say=say)
        for line in teardown.report_lines(leftovers):
            say(line)
        if leftovers:
            say(f"run python deploy.py down --stack {stack} again, or delete these by hand")
            return 1
        _say_runs_kept(stack, say)
        return 0

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        from infra import aws_provider, preflight

        return aws_provider.status(cluster, preflight.AwsClients.for_region(cluster.region).ec2)


class SshProvider(Provider):
    """The user's own machines from a hosts file (infra/ssh_provider.py); creates nothing on them."""

    name = "ssh"
    what = "a hosts-file cluster (your own machines)"

    def up(self, request: UpRequest, say) -> tuple[ClusterInfo, bool]:
        from infra import ssh_provider

        given = sorted(k for k, v in request.overrides.items() if v is not None)
        flags = [
            flag
            for flag, value in (
                ("--bind", request.bind),
                ("--ssh-port", request.ssh_port),
                ("--yes", request.yes or None),
            )
            if value is not None
        ]
        if given or flags:
            names = ", ".join([config_flag(k) for k in given] + flags)
            raise UsageError(
                f"{names} do(es) not apply to --hosts: the hosts file says what the machines are, and "
                "nothing powers them off"
            )
        if not request.hosts_file:
            raise UsageError(f"stack {request.stack!r} is not up: pass --hosts FILE to bring your machines up")
        return ssh_provider.up(request.hosts_file, request.stack, say=say)

    def down(self, stack: str, say) -> int:
        from infra import ssh_provider

        if not inventory.inventory_path(stack).exists():
            say(f"nothing to do: stack '{stack}' is not up")
            return 0
        say(f"cleaning stack '{stack}' on its hosts (job, watchdog, ~/.gpu-cluster); the machines keep running ...")
        if not ssh_provider.down(stack, say=say):
            say(f"the stack is kept: run python deploy.py down --stack {stack} again once every host answers")
            return 1
        costs.record_down(stack, say=say)
        say(f"stack '{stack}' is down: nothing of it is left on its hosts; they were not powered off")
        _say_runs_kept(stack, say)
        return 0

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        from infra import ssh_provider

        return ssh_provider.status(cluster), {}


PROVIDERS: dict[str, Provider] = {p.name: p for p in (LocalProvider(), AwsProvider(), SshProvider())}
CONFIG_FLAGS = {
    "nodes": "--nodes",
    "instanceType": "--instance-type",
    "spot": "--spot",
    "sshCidr": "--ssh-cidr",
    "maxTotalUsd": "--max-total-usd",
    "idleMinutes": "--idle-minutes",
}


def config_flag(key: str) -> str:
    return CONFIG_FLAGS.get(key, key)


def bring_up(chosen: Provider, request: UpRequest, say) -> tuple[ClusterInfo, bool]:
    """`up` through the chosen provider, then the bookkeeping every provider shares, once: a cluster
    it created goes into the ledger, and its guards (where they apply) where bootstrap finds them."""
    cluster, created = chosen.up(request, say)
    if created:
        guarded, reference_usd = chosen.bookkeeping(request)
        if guarded is not None:
            costs.save_guards(request.stack, guarded)
        costs.record_up(cluster, reference_usd, say=say)
    return cluster, created


def for_up(local_flag: bool, hosts_file: str | None, stack_flag: str | None) -> tuple[Provider, str]:
    """The provider and stack `up` means: `--local`, `--hosts FILE`, else the stack's own (AWS for a new one)."""
    if local_flag and hosts_file:
        raise UsageError("--local and --hosts exclude each other: the nodes are either here or your machines")
    if hosts_file is not None and not hosts_file.strip():
        raise UsageError("--hosts needs a file: the YAML list of your machines (see README, 'Your own machines')")
    if local_flag:
        return PROVIDERS["local"], state.check_stack_name(state.LOCAL_STACK if stack_flag is None else stack_flag)
    if hosts_file is not None:
        from infra.ssh_provider import DEFAULT_STACK

        return PROVIDERS["ssh"], state.check_stack_name(DEFAULT_STACK if stack_flag is None else stack_flag)
    stack = state.resolve_stack(stack_flag, default=DEFAULT_AWS_STACK)
    return for_stack(stack), stack


def for_stack(stack: str) -> Provider:
    """The stack's provider: its inventory says (even a damaged one, where its `provider` can be read);
    else a local stack's node folders, or the default stack names of `--local` and `--hosts`; else AWS,
    whose state is Pulumi's."""
    from infra.ssh_provider import DEFAULT_STACK as HOSTS_STACK

    name = _inventory_provider(stack)
    if name is None and (stack == state.LOCAL_STACK or (state.stack_dir(stack) / "nodes").exists()):
        name = "local"
    if name is None and stack == HOSTS_STACK:
        name = "ssh"
    return PROVIDERS.get(name or "aws", PROVIDERS["aws"])


def _inventory_provider(stack: str) -> str | None:
    try:
        data = json.loads(inventory.inventory_path(stack).read_text())
    except (OSError, ValueError):
        return None
    name = data.get("provider") if isinstance(data, dict) else None
    return name if name in PROVIDERS else None


def for_cluster(cluster: ClusterInfo) -> Provider:
    if cluster.provider not in PROVIDERS:
        raise UsageError(f"stack {cluster.stack!r} names an unknown provider {cluster.provider!r} in its inventory")
    return PROVIDERS[cluster.provider]


def note_self_stops(say) -> None:
    for provider in PROVIDERS.values():
        provider.note_self_stops(say)


def interrupted_stacks() -> list[str]:
    """Every stack an interrupted `up` left behind, whatever its provider."""
    return sorted(stack for provider in PROVIDERS.values() for stack in provider.interrupted_stacks())


def _say_runs_kept(stack: str, say) -> None:
    runs = state.runs_dir(stack)
    if runs.exists():
        say(f"run logs kept in {report.relative(runs)}")
