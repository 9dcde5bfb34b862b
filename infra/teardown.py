"""After `pulumi destroy`: look for anything still tagged with the stack, and say what it costs.

Auto Scaling groups, instances, volumes, network interfaces, security groups, EFS file systems and mount targets,
placement groups, key pairs and VPCs carrying `gpu-cluster:stack = <stack>` (network interfaces also
by the stack's VPC, since AWS does not tag the ones it makes for instances and mount targets).

The stack's baked images (infra/images.py) are not leftovers: they outlive the cluster on purpose, so
`down` keeps them and names them with what their snapshots cost (`kept_image_lines`).
"""

from dataclasses import dataclass

from infra.tags import STACK_TAG

LIVE_INSTANCE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]


@dataclass(frozen=True)
class Leftover:
    """A resource of the stack that still exists."""

    kind: str
    """instance, volume, network-interface, security-group, efs, efs-mount-target, placement-group, key-pair, vpc."""
    id: str
    """Its AWS id."""
    billable: bool
    """Whether it costs money while it exists."""
    detail: str = ""
    """State, size, or whatever helps to find it."""


def tag_filter(stack: str) -> list[dict]:
    return [{"Name": f"tag:{STACK_TAG}", "Values": [stack]}]


def sweep(stack: str, ec2, efs, placement_ec2=None, autoscaling=None) -> list[Leftover]:
    """Everything of `stack` that still exists. `placement_ec2` answers describe_placement_groups
    (default: `ec2`); `autoscaling`, where given, is asked for the stack's Auto Scaling groups (spot workers)."""
    found: list[Leftover] = []
    tagged = tag_filter(stack)
    if autoscaling is not None:
        # A group left behind starts a new instance for every one that ends: as billable as the instances.
        for page in autoscaling.get_paginator("describe_auto_scaling_groups").paginate(Filters=tagged):
            for group in page["AutoScalingGroups"]:
                wanted = f"{group['DesiredCapacity']} wanted"
                found.append(Leftover("auto-scaling-group", group["AutoScalingGroupName"], True, wanted))
    for reservation in ec2.describe_instances(
        Filters=tagged + [{"Name": "instance-state-name", "Values": LIVE_INSTANCE_STATES}]
    )["Reservations"]:
        for instance in reservation["Instances"]:
            state = instance["State"]["Name"]
            # A stopped instance costs nothing by the hour but its volume and any Elastic IP do.
            found.append(Leftover("instance", instance["InstanceId"], state != "stopped", state))
    for volume in ec2.describe_volumes(Filters=tagged)["Volumes"]:
        found.append(Leftover("volume", volume["VolumeId"], True, f"{volume['Size']} GB {volume['State']}"))
    vpcs = [v["VpcId"] for v in ec2.describe_vpcs(Filters=tagged)["Vpcs"]]
    found += _network_interfaces(ec2, tagged, vpcs)
    for group in ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]:
        found.append(Leftover("security-group", group["GroupId"], False, group.get("GroupName", "")))
    found += _file_systems(efs, stack)
    for group in (placement_ec2 or ec2).describe_placement_groups(Filters=tagged)["PlacementGroups"]:
        found.append(Leftover("placement-group", group.get("GroupId", group["GroupName"]), False, group["GroupName"]))
    for key in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"]:
        found.append(Leftover("key-pair", key.get("KeyPairId", key["KeyName"]), False, key["KeyName"]))
    found += [Leftover("vpc", vpc, False) for vpc in vpcs]
    return found


def _network_interfaces(ec2, tagged: list[dict], vpcs: list[str]) -> list[Leftover]:
    interfaces = {
        i["NetworkInterfaceId"]: i for i in ec2.describe_network_interfaces(Filters=tagged)["NetworkInterfaces"]
    }
    if vpcs:
        for interface in ec2.describe_network_interfaces(Filters=[{"Name": "vpc-id", "Values": vpcs}])[
            "NetworkInterfaces"
        ]:
            interfaces[interface["NetworkInterfaceId"]] = interface
    # An interface with a public IPv4 address is billed by the hour.
    return [Leftover("network-interface", i, True, interface.get("Status", "")) for i, interface in interfaces.items()]


def _file_systems(efs, stack: str) -> list[Leftover]:
    found = []
    for page in efs.get_paginator("describe_file_systems").paginate():
        for fs in page["FileSystems"]:
            tags = {t["Key"]: t["Value"] for t in fs.get("Tags", [])}
            if tags.get(STACK_TAG) != stack:
                continue
            found.append(Leftover("efs", fs["FileSystemId"], True, fs.get("LifeCycleState", "")))
            for target in efs.describe_mount_targets(FileSystemId=fs["FileSystemId"])["MountTargets"]:
                found.append(
                    Leftover("efs-mount-target", target["MountTargetId"], True, target.get("LifeCycleState", ""))
                )
    return found


def report_lines(leftovers: list[Leftover]) -> list[str]:
    billable = [x for x in leftovers if x.billable]
    if not leftovers:
        return ["0 billable resources left (nothing tagged with the stack remains)"]
    lines = [f"{len(billable)} billable, {len(leftovers) - len(billable)} free resources still exist:"]
    for item in leftovers:
        mark = "$" if item.billable else " "
        lines.append(f"  {mark} {item.kind:18s} {item.id}  {item.detail}".rstrip())
    return lines


def kept_image_lines(stack: str, images: list) -> list[str]:
    """What `down` says about the stack's images (infra/images.py's Image rows): kept, and what they cost."""
    if not images:
        return []
    monthly = sum(i.monthly_usd for i in images)
    lines = [
        f"kept {len(images)} image(s) of stack '{stack}': their EBS snapshots still cost storage, at most "
        f"${monthly:.2f}/month together:"
    ]
    lines += [f"  $ image {i.id}  {i.name}  {i.size_gb} GB" for i in images]
    lines.append("  python deploy.py image delete AMI_ID removes one")
    return lines
