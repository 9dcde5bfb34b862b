"""`deploy.py plan`: the real Pulumi program run under Pulumi's own mocks, offline.

Needs no credentials and no Pulumi CLI: the engine is replaced by `pulumi.runtime.set_mocks`, which
records every resource the program registers. The two look-ups the program makes (the newest GPU AMI,
the zones that offer the type) are answered with placeholders; any other call is refused, so a new
look-up in the program cannot slip through `plan` unnoticed.
"""

import asyncio
from dataclasses import dataclass, field, replace

import pulumi

from infra.cluster import build
from infra.config import StackConfig
from infra.errors import UsageError
from infra.pricing import Estimate, PriceSource

PLACEHOLDER_CIDR = "192.0.2.1/32"  # TEST-NET-1: stands for "your public IP /32", looked up at `up`
PLACEHOLDER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGdwdS1jbHVzdGVyLXBsYWNlaG9sZGVyLWtleQAAAAAA plan"
PLACEHOLDER_AMI = "ami-0000000000000000a"
AMI_LOOKUP = "aws:ssm/getParameter:getParameter"
ZONE_LOOKUP = "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings"


@dataclass
class PlannedResource:
    """One resource the program would create."""

    type: str
    """The Pulumi type token, e.g. aws:ec2/instance:Instance."""
    name: str
    """The logical name."""
    inputs: dict
    """What the program set (Pulumi property names)."""


class RecordingMocks(pulumi.runtime.Mocks):
    """Records resources; answers the program's two look-ups; refuses every other call."""

    def __init__(self, region: str):
        self.region = region
        self.resources: list[PlannedResource] = []
        self.calls: list[str] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.resources.append(PlannedResource(args.typ, args.name, dict(args.inputs)))
        state = dict(args.inputs)
        if args.typ == "aws:ec2/instance:Instance":
            state.update(publicIp="203.0.113.10", availabilityZone=f"{self.region}a")
        elif args.typ == "aws:efs/fileSystem:FileSystem":
            state["dnsName"] = f"fs-planned.efs.{self.region}.amazonaws.com"
        elif args.typ in ("aws:ec2/keyPair:KeyPair", "aws:ec2/placementGroup:PlacementGroup"):
            state.setdefault("keyName" if "keyPair" in args.typ else "name", args.name)
        elif args.typ in (
            "aws:autoscaling/group:Group",
            "aws:iam/role:Role",
            "aws:iam/instanceProfile:InstanceProfile",
        ):
            state.setdefault("name", args.name)
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            state["latestVersion"] = 1
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append(args.token)
        if args.token == AMI_LOOKUP:
            return {"name": args.args.get("name"), "value": PLACEHOLDER_AMI, "type": "String", "id": "ami"}
        if args.token == ZONE_LOOKUP:
            zones = [f"{self.region}{suffix}" for suffix in "abc"]
            return {"locations": zones, "locationTypes": ["availability-zone"] * 3, "instanceTypes": [], "id": "zones"}
        raise NotImplementedError(f"the program made a call plan does not know: {args.token}")


@dataclass
class ProgramRun:
    """What running the program under mocks produced."""

    resources: list[PlannedResource]
    """Every resource, in registration order."""
    calls: list[str] = field(default_factory=list)
    """The look-ups the program made."""
    nodes: list[dict] = field(default_factory=list)
    """The `nodes` output."""


def run_program(config: StackConfig) -> ProgramRun:
    """Run the real program for `config` under mocks (preview=False, so outputs resolve)."""
    mocks = RecordingMocks(config.region)
    # Pulumi's runtime asks asyncio for the current loop; after an asyncio.run() in this process
    # (the SSH waits do that) there is none, so it gets one of its own.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pulumi.runtime.set_mocks(mocks, project="gpu-cluster", stack=config.stack, preview=False)
    result: dict = {}

    @pulumi.runtime.test
    def program():
        cluster = build(config)
        return cluster.nodes.apply(lambda nodes: result.setdefault("nodes", nodes))

    try:
        program()
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    return ProgramRun(mocks.resources, mocks.calls, result.get("nodes", []))


def estimate(config: StackConfig) -> tuple[Estimate | None, str]:
    """The cost, offline (the price cache or the bundled table); (None, why) for a type that only the
    Price List API prices, so that every type the catalog accepts can be planned."""
    try:
        return PriceSource().estimate(config.instance_type, config.region, config.nodes, config.root_volume_gb), ""
    except UsageError as exc:
        return None, str(exc)


def plan_config(config: StackConfig) -> StackConfig:
    """The config with placeholders where `up` would look things up or make a key; the cost-allocation tag
    as billing would list it (preflight asks at `up`; `describe` says so)."""
    return replace(
        config,
        ssh_cidr=config.ssh_cidr or PLACEHOLDER_CIDR,
        ssh_public_key=config.ssh_public_key or PLACEHOLDER_KEY,
        cost_allocation_tag_seen=True,
    )


ORDER = (
    "Vpc",
    "InternetGateway",
    "Subnet",
    "RouteTable",
    "RouteTableAssociation",
    "SecurityGroup",
    "SecurityGroupIngressRule",
    "SecurityGroupEgressRule",
    "FileSystem",
    "MountTarget",
    "PlacementGroup",
    "KeyPair",
    "CostAllocationTag",
    "Role",
    "RolePolicy",
    "InstanceProfile",
    "Instance",
    "LaunchTemplate",
    "Group",
)


def display_order(resource: PlannedResource) -> tuple:
    """Network first, instances last, nodes in index order (the engine registers them in no fixed order)."""
    short = resource.type.split(":")[-1]
    head, _, tail = resource.name.rpartition("-")
    index = int(tail) if tail.isdigit() else -1
    return (ORDER.index(short) if short in ORDER else len(ORDER), head if index >= 0 else resource.name, index)


def describe(resource: PlannedResource) -> dict[str, object]:
    """The settings of a resource that a reader of the plan cares about."""
    i = resource.inputs
    short = resource.type.split(":")[-1]
    if short == "Instance":
        metadata, root = i.get("metadataOptions", {}), i.get("rootBlockDevice", {})
        market = (i.get("instanceMarketOptions") or {}).get("marketType", "on-demand")
        return {
            "type": i.get("instanceType"),
            "private_ip": i.get("privateIp"),
            "market": market,
            "imds": "v2 required" if metadata.get("httpTokens") == "required" else "v1 allowed",
            "root": f"{int(root.get('volumeSize'))} GB {root.get('volumeType')}"
            f"{', encrypted' if root.get('encrypted') else ', NOT encrypted'}",
            "ami": "newest Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)"
            if i.get("ami") == PLACEHOLDER_AMI
            else i.get("ami"),
            "on_shutdown": i.get("instanceInitiatedShutdownBehavior"),
        }
    if short == "LaunchTemplate":
        metadata = i.get("metadataOptions", {})
        root = (i.get("blockDeviceMappings") or [{}])[0].get("ebs", {})
        return {
            "type": i.get("instanceType"),
            "market": (i.get("instanceMarketOptions") or {}).get("marketType", "on-demand"),
            "imds": "v2 required" if metadata.get("httpTokens") == "required" else "v1 allowed",
            "root": f"{int(root.get('volumeSize') or 0)} GB {root.get('volumeType')}"
            f"{', encrypted' if root.get('encrypted') == 'true' else ', NOT encrypted'}",
        }
    if short == "Group":
        return {"size": int(i.get("desiredCapacity") or 0), "replaces": "a reclaimed or dead worker"}
    if short == "SecurityGroupIngressRule":
        group = str(i.get("referencedSecurityGroupId", "")).removesuffix("-id")
        source = i.get("cidrIpv4") or i.get("cidrIpv6") or f"members of {group}"
        if source == PLACEHOLDER_CIDR:
            source = "your public IP /32 (looked up at up)"
        ports = "all" if i.get("ipProtocol") == "-1" else f"{i.get('ipProtocol')} {int(i.get('fromPort') or 0)}"
        return {"in": ports, "from": source}
    if short == "FileSystem":
        return {"encrypted": i.get("encrypted"), "throughput": i.get("throughputMode")}
    if short == "CostAllocationTag":
        return {
            "tag": i.get("tagKey"),
            "status": i.get("status"),
            "at up": "activated once billing lists the key (up to 24 h after the first tagged resource)",
            "at down": "kept (the account's, for every stack)",
        }
    if short == "PlacementGroup":
        return {"strategy": i.get("strategy")}
    if short in ("Vpc", "Subnet"):
        return {"cidr": i.get("cidrBlock"), **({"zone": i.get("availabilityZone")} if short == "Subnet" else {})}
    return {}
