"""The sweep after destroy, against moto (and Stubber for placement groups, which moto lacks)."""

import boto3
import pytest
from botocore.stub import Stubber

from infra import teardown
from infra.cluster import STACK_TAG
from tests.support.aws_fakes import moto_aws


@pytest.fixture
def aws(monkeypatch):
    with moto_aws(monkeypatch):
        yield boto3.client("ec2", region_name="us-east-1"), boto3.client("efs", region_name="us-east-1")


def tags(stack: str, resource: str) -> list[dict]:
    return [{"ResourceType": resource, "Tags": [{"Key": STACK_TAG, "Value": stack}, {"Key": "Name", "Value": stack}]}]


def build_leftovers(ec2, efs, stack: str) -> dict:
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16", TagSpecifications=tags(stack, "vpc"))["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    group = ec2.create_security_group(
        GroupName=f"{stack}-nodes", Description="nodes", VpcId=vpc, TagSpecifications=tags(stack, "security-group")
    )["GroupId"]
    ec2.create_key_pair(KeyName=f"{stack}-key", TagSpecifications=tags(stack, "key-pair"))
    instance = ec2.run_instances(
        ImageId="ami-12c6146b",
        MinCount=1,
        MaxCount=1,
        InstanceType="g4dn.2xlarge",
        SubnetId=subnet,
        SecurityGroupIds=[group],
        TagSpecifications=tags(stack, "instance") + tags(stack, "volume"),
    )["Instances"][0]["InstanceId"]
    fs = efs.create_file_system(
        CreationToken=f"{stack}-efs", Encrypted=True, Tags=[{"Key": STACK_TAG, "Value": stack}]
    )["FileSystemId"]
    target = efs.create_mount_target(FileSystemId=fs, SubnetId=subnet, SecurityGroups=[group])["MountTargetId"]
    return {"vpc": vpc, "group": group, "instance": instance, "fs": fs, "target": target, "subnet": subnet}


def placement_groups(stack: str, names: list[str]):
    client = boto3.client("ec2", region_name="us-east-1")
    stub = Stubber(client)
    stub.add_response(
        "describe_placement_groups",
        {
            "PlacementGroups": [
                {"GroupName": n, "GroupId": f"pg-{i:017x}", "Strategy": "cluster", "State": "available"}
                for i, n in enumerate(names)
            ]
        },
        {"Filters": teardown.tag_filter(stack)},
    )
    stub.activate()
    return client


def test_everything_the_stack_left_is_found_and_marked_billable_or_free(aws):
    ec2, efs = aws
    mine = build_leftovers(ec2, efs, "dev")
    theirs = build_leftovers(ec2, efs, "someone-else")
    found = teardown.sweep("dev", ec2, efs, placement_groups("dev", ["dev-placement"]))
    kinds = {(x.kind, x.billable) for x in found}
    assert ("instance", True) in kinds and ("volume", True) in kinds and ("network-interface", True) in kinds
    assert ("efs", True) in kinds and ("efs-mount-target", True) in kinds
    assert {("security-group", False), ("key-pair", False), ("placement-group", False), ("vpc", False)} <= kinds
    ids = {x.id for x in found}
    assert {mine["instance"], mine["fs"], mine["target"], mine["group"], mine["vpc"]} <= ids
    assert not ids & {theirs["instance"], theirs["fs"], theirs["target"], theirs["group"], theirs["vpc"]}
    assert len([x for x in found if x.kind == "instance"]) == 1
    lines = teardown.report_lines(found)
    assert lines[0].startswith(f"{sum(x.billable for x in found)} billable")


def test_after_a_clean_destroy_nothing_is_left(aws):
    ec2, efs = aws
    left = build_leftovers(ec2, efs, "dev")
    ec2.terminate_instances(InstanceIds=[left["instance"]])
    for volume in ec2.describe_volumes(Filters=teardown.tag_filter("dev"))["Volumes"]:
        if volume["State"] == "available":
            ec2.delete_volume(VolumeId=volume["VolumeId"])
    efs.delete_mount_target(MountTargetId=left["target"])
    efs.delete_file_system(FileSystemId=left["fs"])
    for interface in ec2.describe_network_interfaces(Filters=[{"Name": "vpc-id", "Values": [left["vpc"]]}])[
        "NetworkInterfaces"
    ]:
        ec2.delete_network_interface(NetworkInterfaceId=interface["NetworkInterfaceId"])
    ec2.delete_key_pair(KeyName="dev-key")
    ec2.delete_security_group(GroupId=left["group"])
    ec2.delete_subnet(SubnetId=left["subnet"])
    ec2.delete_vpc(VpcId=left["vpc"])
    found = teardown.sweep("dev", ec2, efs, placement_groups("dev", []))
    assert found == []
    assert teardown.report_lines(found) == ["0 billable resources left (nothing tagged with the stack remains)"]
