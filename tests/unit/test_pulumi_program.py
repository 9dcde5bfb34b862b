"""Policy tests of the Pulumi program under Pulumi's own mocks (preview=False; unknown calls refused)."""

import base64
import importlib
import inspect
import json

import pytest

from infra import config as stack_config
from infra.cluster import STACK_TAG, node_private_ip
from infra.errors import UsageError
from infra.plan import AMI_LOOKUP, PLACEHOLDER_AMI, ZONE_LOOKUP, RecordingMocks, run_program

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl test"


def program(**raw):
    values = {"sshCidr": "203.0.113.7/32", "sshPublicKey": KEY, "nodes": 2, "instanceType": "g4dn.2xlarge"}
    values.update(raw)
    run = run_program(stack_config.validate("dev", values))
    return run


def of_type(run, short: str) -> list:
    """Resources of a type, by name (the mock engine registers them in no fixed order)."""
    return sorted((r for r in run.resources if r.type.split(":")[-1] == short), key=lambda r: _natural(r.name))


def _natural(name: str) -> tuple:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def named(run, name: str):
    return next(r for r in run.resources if r.name == name)


def test_ssh_is_open_only_to_the_operators_cidr_and_nothing_else_comes_in_from_outside():
    run = program()
    rules = of_type(run, "SecurityGroupIngressRule")
    from_outside = [r for r in rules if r.inputs.get("cidrIpv4") or r.inputs.get("cidrIpv6")]
    assert len(from_outside) == 1
    ssh = from_outside[0].inputs
    assert (ssh["cidrIpv4"], ssh["ipProtocol"], ssh["fromPort"], ssh["toPort"]) == ("203.0.113.7/32", "tcp", 22, 22)
    assert ssh["securityGroupId"] == "dev-nodes-id"


def test_the_nodes_talk_to_each_other_freely_and_efs_hears_only_nodes():
    run = program()
    intra = named(run, "dev-intra-cluster").inputs
    assert intra["ipProtocol"] == "-1"
    assert intra["securityGroupId"] == intra["referencedSecurityGroupId"] == "dev-nodes-id"
    nfs = named(run, "dev-shared-nfs-from-nodes").inputs
    assert (nfs["securityGroupId"], nfs["referencedSecurityGroupId"]) == ("dev-shared-nfs-id", "dev-nodes-id")
    assert (nfs["ipProtocol"], nfs["fromPort"], nfs["toPort"]) == ("tcp", 2049, 2049)
    assert named(run, "dev-shared-efs-mount").inputs["securityGroups"] == ["dev-shared-nfs-id"]
    ingress_to_efs = [
        r for r in of_type(run, "SecurityGroupIngressRule") if r.inputs["securityGroupId"] == "dev-shared-nfs-id"
    ]
    assert len(ingress_to_efs) == 1


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "::/0"])
def test_world_open_ssh_is_refused_unless_asked_for(cidr):
    with pytest.raises(UsageError, match="whole internet"):
        program(sshCidr=cidr)
    run = program(sshCidr=cidr, allowWorldSsh=True)
    key = "cidrIpv6" if ":" in cidr else "cidrIpv4"
    assert named(run, "dev-ssh").inputs[key] == cidr


def test_instances_require_imdsv2_encrypt_their_disks_and_sit_in_the_placement_group():
    run = program()
    instances = of_type(run, "Instance")
    assert len(instances) == 2
    for index, instance in enumerate(instances):
        i = instance.inputs
        assert i["metadataOptions"]["httpTokens"] == "required"
        assert i["rootBlockDevice"]["encrypted"] is True and i["rootBlockDevice"]["volumeType"] == "gp3"
        assert i["placementGroup"] == "dev-placement"
        assert i["instanceType"] == "g4dn.2xlarge" and i["privateIp"] == node_private_ip(index)
        assert i["vpcSecurityGroupIds"] == ["dev-nodes-id"] and i["keyName"] == "dev-key"
        assert "mount -t nfs4" in i["userData"] and "fs-planned.efs.us-east-1.amazonaws.com" in i["userData"]
        assert "instanceMarketOptions" not in i
    assert named(run, "dev-placement").inputs["strategy"] == "cluster"
    efs = named(run, "dev-shared-efs").inputs
    assert efs["encrypted"] is True and efs["throughputMode"] == "elastic"


def test_node_addresses_ascend_so_rank_0_is_on_node_0():
    run = program(nodes=12)
    addresses = [r.inputs["privateIp"] for r in of_type(run, "Instance")]
    assert addresses == sorted(addresses) and addresses[0] == "10.42.1.10"
    assert [n["name"] for n in run.nodes] == [f"node-{i}" for i in range(12)]


def test_count_and_type_come_from_the_config():
    run = program(nodes=3, instanceType="g6.2xlarge")
    instances = of_type(run, "Instance")
    assert len(instances) == 3 and {i.inputs["instanceType"] for i in instances} == {"g6.2xlarge"}
    assert of_type(run, "Group") == [] and of_type(run, "Role") == []


def test_spot_workers_are_groups_of_one_that_replace_them_and_join_from_efs_at_boot():
    run = program(nodes=3, instanceType="g6.2xlarge", spot=True)
    (head,) = of_type(run, "Instance")  # the head keeps its address: MASTER_ADDR, slurmctld
    market = head.inputs["instanceMarketOptions"]
    assert market["marketType"] == "spot" and market["spotOptions"]["instanceInterruptionBehavior"] == "terminate"
    assert head.inputs["privateIp"] == node_private_ip(0) and head.inputs["iamInstanceProfile"] == "dev-head"
    assert "hostnamectl set-hostname node-0" in head.inputs["userData"]
    groups, templates = of_type(run, "Group"), of_type(run, "LaunchTemplate")
    assert [g.name for g in groups] == [t.name for t in templates] == ["dev-node-1", "dev-node-2"]
    head_data = head.inputs["userData"]
    for index, (group, template) in enumerate(zip(groups, templates, strict=True), start=1):
        g, t = group.inputs, template.inputs
        assert (g["minSize"], g["maxSize"], g["desiredCapacity"]) == (1, 1, 1) and g["capacityRebalance"] is False
        assert g["vpcZoneIdentifiers"] == ["dev-net-subnet-id"] and g["forceDelete"] is True
        assert {tag["key"]: tag["value"] for tag in g["tags"]}[STACK_TAG] == "dev"
        assert t["instanceType"] == "g6.2xlarge" and t["metadataOptions"]["httpTokens"] == "required"
        assert t["instanceMarketOptions"]["spotOptions"]["instanceInterruptionBehavior"] == "terminate"
        assert t["instanceInitiatedShutdownBehavior"] == "terminate"
        assert t["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
        assert t["placement"]["groupName"] == "dev-placement"
        (interface,) = t["networkInterfaces"]
        assert interface["securityGroups"] == ["dev-nodes-id"] and interface["subnetId"] == "dev-net-subnet-id"
        tagged = {spec["resourceType"]: spec["tags"] for spec in t["tagSpecifications"]}
        assert tagged["instance"]["gpu-cluster:node"] == f"node-{index}" and tagged["volume"][STACK_TAG] == "dev"
        boot = base64.b64decode(t["userData"]).decode()
        assert f"join.py --node node-{index}" in boot and f"hostnamectl set-hostname node-{index}" in boot
        # A worker started while the cluster stops powers off before it installs anything.
        assert boot.index("the cluster is stopping") < boot.index("apt-get install -y -qq slurm-wlm")
        assert group.name in head_data  # the head's guard scales it to zero before powering off
    policy = json.loads(named(run, "dev-scale-workers").inputs["policy"])["Statement"]
    assert [(p["Action"], p["Condition"]) for p in policy] == [
        (
            "autoscaling:UpdateAutoScalingGroup",
            {
                "StringEquals": {f"autoscaling:ResourceTag/{STACK_TAG}": "dev"},
                "NumericEquals": {"autoscaling:MinSize": 0, "autoscaling:MaxSize": 0, "autoscaling:DesiredCapacity": 0},
            },
        )
    ]
    assert [n.get("group") for n in run.nodes] == [None, "dev-node-1", "dev-node-2"]


def test_every_resource_that_takes_tags_is_tagged_with_the_stack():
    run = program()
    checked = 0
    for resource in run.resources:
        if not resource.type.startswith("aws:"):
            continue
        module, name = resource.type.split(":")[1].split("/")[0], resource.type.split(":")[-1]
        cls = getattr(importlib.import_module(f"pulumi_aws.{module}"), name)
        if "tags" in inspect.signature(cls._internal_init).parameters:
            assert resource.inputs.get("tags", {}).get(STACK_TAG) == "dev", resource.name
            assert resource.inputs["tags"].get("Name"), resource.name
            checked += 1
    assert checked >= 14


def test_the_ami_and_zone_are_looked_up_unless_pinned():
    looked_up = program()
    assert sorted(looked_up.calls) == sorted([AMI_LOOKUP, ZONE_LOOKUP])
    assert {i.inputs["ami"] for i in of_type(looked_up, "Instance")} == {PLACEHOLDER_AMI}
    assert named(looked_up, "dev-net-subnet").inputs["availabilityZone"] == "us-east-1a"
    pinned = program(amiId="ami-0123456789abcdef0", availabilityZone="us-east-1c")
    assert pinned.calls == []
    assert {i.inputs["ami"] for i in of_type(pinned, "Instance")} == {"ami-0123456789abcdef0"}
    assert named(pinned, "dev-net-subnet").inputs["availabilityZone"] == "us-east-1c"
    # A baked image (deploy.py image create; up --image) boots spot workers too, from their launch templates.
    spot = program(amiId="ami-0123456789abcdef0", availabilityZone="us-east-1c", spot=True, nodes=3)
    assert spot.calls == []
    assert {t.inputs["imageId"] for t in of_type(spot, "LaunchTemplate")} == {"ami-0123456789abcdef0"}
    assert {i.inputs["ami"] for i in of_type(spot, "Instance")} == {"ami-0123456789abcdef0"}


def test_the_mocks_refuse_calls_the_program_is_not_known_to_make():
    mocks = RecordingMocks("us-east-1")

    class Call:
        token, args, provider = "aws:index/getCallerIdentity:getCallerIdentity", {}, ""

    with pytest.raises(NotImplementedError, match="getCallerIdentity"):
        mocks.call(Call())


def test_shutdown_behaviour_follows_the_config_and_spot_must_terminate():
    run = program(shutdownBehavior="stop")
    assert {i.inputs["instanceInitiatedShutdownBehavior"] for i in of_type(run, "Instance")} == {"stop"}
    with pytest.raises(UsageError, match="spot instances can only terminate"):
        program(spot=True, shutdownBehavior="stop")


def test_the_job_ports_are_open_to_the_node_group_only():
    """The rendezvous store, the workers' store and gloo/NCCL take no password; on AWS what covers them
    is that only the nodes' own security group reaches any port but SSH (README, 'What a job exposes')."""
    run = program()
    groups = of_type(run, "SecurityGroup")
    assert all(not g.inputs.get("ingress") for g in groups)  # no inline rules beside the separate ones
    rules = [
        r.inputs for r in of_type(run, "SecurityGroupIngressRule") if r.inputs["securityGroupId"] == "dev-nodes-id"
    ]

    def admits(rule: dict, port: int) -> bool:
        return rule["ipProtocol"] == "-1" or rule["fromPort"] <= port <= rule["toPort"]

    for port in (29500, 29400, 32768, 45000, 60999):  # MASTER_PORT's default, torchrun's, ephemeral ports
        admitting = [rule for rule in rules if admits(rule, port)]
        assert admitting and all(rule.get("referencedSecurityGroupId") == "dev-nodes-id" for rule in admitting), port
        assert not any(rule.get("cidrIpv4") or rule.get("cidrIpv6") for rule in admitting), port


def test_the_stack_tag_is_activated_for_cost_allocation_only_once_billing_lists_it_and_the_stack_wants_it():
    [tag] = of_type(program(costAllocationTagSeen="true"), "CostAllocationTag")
    assert (tag.inputs["tagKey"], tag.inputs["status"]) == (STACK_TAG, "Active")
    assert of_type(program(costAllocationTagSeen="false"), "CostAllocationTag") == []
    assert of_type(program(), "CostAllocationTag") == []  # plain `pulumi up`, no preflight: never a failing up
    assert of_type(program(costAllocationTag="false", costAllocationTagSeen="true"), "CostAllocationTag") == []
