"""`up` and `down` on AWS, whole: preflight (moto + Stubber), the Automation API (a fake Pulumi CLI that
has no capacity in the first zone), then host-key pinning and readiness against real SSH servers on
loopback that stand in for the instances."""

import dataclasses
import json
import shutil

import boto3
import pytest
from botocore.stub import Stubber

from infra import inventory, state, teardown
from infra.errors import OperationError, UsageError
from infra.providers import UpRequest
from infra.providers import aws as aws_provider
from tests.support import inventories, pulumi_fakes
from tests.support.aws_fakes import clients, moto_aws
from tests.support.pulumi_fakes import FakePulumi


@pytest.fixture
def instances(make_cluster, state_dir, monkeypatch):
    """Two loopback SSH nodes posing as EC2 instances: the fake Pulumi outputs point at them."""
    local = make_cluster("stand-in")
    stack_dir = state_dir / "dev"
    stack_dir.mkdir(parents=True)
    for name in ("id_ed25519", "id_ed25519.pub"):  # the key deploy.py would make, already authorized there
        shutil.copy(local.stack_dir / name, stack_dir / name)
    for i, node in enumerate(local.inventory["nodes"]):  # cloud-init's ready marker, in each stand-in's home
        (local.stack_dir / "nodes" / node["name"] / "ready").write_text(f"i-{i:017x}\n2026-11-21T00:00:00+00:00\n")
    monkeypatch.setattr(aws_provider, "READY_MARKER", "ready")
    return local


def fake_outputs(local) -> dict:
    return {
        "nodes": [
            {
                "name": n["name"],
                "instance_id": f"i-{i:017x}",
                "public_ip": n["public_ip"],
                "ssh_port": n["ssh_port"],
                "private_ip": n["private_ip"],
            }
            for i, n in enumerate(local.inventory["nodes"])
        ],
        "ssh_user": local.inventory["ssh_user"],
        "shared_dir": "/shared",
        "region": "us-east-1",
    }


def test_up_falls_back_a_zone_pins_host_keys_and_writes_the_inventory(instances, monkeypatch, state_dir):
    monkeypatch.setattr(pulumi_fakes, "OUTPUTS", fake_outputs(instances))
    fake = FakePulumi(no_capacity={"us-east-1a"})
    said: list[str] = []
    with moto_aws(monkeypatch):
        request = UpRequest("dev", {"nodes": 2, "sshCidr": "203.0.113.7/32"}, yes=True)
        result = aws_provider.up(request, clients=clients(), command=fake, say=said.append)
    assert result.created
    assert fake.config["gpu-cluster:availabilityZone"] == "us-east-1b"
    assert fake.config["gpu-cluster:sshCidr"] == "203.0.113.7/32"
    assert fake.config["gpu-cluster:sshPublicKey"] == (state_dir / "dev" / "id_ed25519.pub").read_text().strip()
    assert fake.config["gpu-cluster:costAllocationTagSeen"] == "true"  # billing lists the tag: the program activates it
    assert any("no g4dn.2xlarge capacity in us-east-1a" in line for line in said)
    assert sum("host key pinned on first contact" in line for line in said) == 2
    saved = inventory.load("dev")
    assert saved.provider == "aws" and saved.hourly_usd == pytest.approx(1.568, abs=1e-3)
    assert sum(line.hourly_usd for line in result.billed_lines) == pytest.approx(saved.hourly_usd)  # for the ledger
    assert [n.private_ip for n in saved.nodes] == [n["private_ip"] for n in instances.inventory["nodes"]]
    assert saved.nodes[0].gpus == 1 and saved.shared_dir == "/shared"
    pinned = sorted(line.split()[2] for line in open(saved.known_hosts))
    real = sorted(line.split()[2] for line in open(instances.inventory["known_hosts"]))
    assert pinned == real  # the keys the servers really have
    assert state.current_stack() == "dev"
    names = [name for name, _ in request.timeline.phases]  # the phases of an AWS up, in order
    assert [n for n in names if n in ("preflight", "pending to running", "ssh ready", "cloud-init")] == [
        "preflight",
        "pending to running",
        "ssh ready",
        "cloud-init",
    ], names


def test_up_refuses_without_confirmation_and_creates_nothing(instances, monkeypatch, state_dir):
    fake = FakePulumi()
    with moto_aws(monkeypatch):
        request = UpRequest("dev", {"sshCidr": "203.0.113.7/32"}, yes=False)
        with pytest.raises(UsageError, match="not confirmed"):
            aws_provider.up(
                request, clients=clients(), command=fake, confirm=lambda question: False, say=lambda s: None
            )
    assert not any(c[0] == "up" for c in fake.calls) and fake.calls == []
    assert not (state_dir / "dev" / "inventory.json").exists()


def test_down_destroys_sweeps_and_removes_the_local_state(monkeypatch, state_dir):
    stack_dir = state_dir / "dev"
    stack_dir.mkdir(parents=True)
    (stack_dir / "runs").mkdir()
    (stack_dir / "inventory.json").write_text(json.dumps({"region": "us-east-1"}))  # corrupt: region comes from config
    fake = FakePulumi(pending=[{"type": "creating"}])
    with moto_aws(monkeypatch):
        placement = boto3.client("ec2", region_name="us-east-1")
        stub = Stubber(placement)
        stub.add_response("describe_placement_groups", {"PlacementGroups": []}, {"Filters": teardown.tag_filter("dev")})
        stub.activate()
        ec2 = boto3.client("ec2", region_name="us-east-1")
        tags = [{"Key": "gpu-cluster:stack", "Value": "dev"}, {"Key": "gpu-cluster:image", "Value": "node-0"}]
        instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="t3.large")
        instance_id = instance["Instances"][0]["InstanceId"]
        image = ec2.create_image(
            InstanceId=instance_id, Name="baked", TagSpecifications=[{"ResourceType": "image", "Tags": tags}]
        )["ImageId"]
        ec2.terminate_instances(InstanceIds=[instance_id])
        said: list[str] = []
        left = aws_provider.down("dev", clients=clients(), command=fake, placement_ec2=placement, say=said.append)
        assert [i["ImageId"] for i in ec2.describe_images(Owners=["self"])["Images"]] == [image]  # kept
    assert left == []  # an image outlives the cluster on purpose: no leftover, but said, with its cost
    assert any(line.startswith("kept 1 image(s) of stack 'dev'") for line in said), said
    assert any(image in line for line in said)
    assert [c[0] for c in fake.calls if c[0] in ("refresh", "destroy")] == ["refresh", "destroy"]
    assert fake.imported["deployment"]["pending_operations"] == []
    assert not (stack_dir / "inventory.json").exists() and (stack_dir / "runs").exists()


class ConsoleWithWatchdogLine:
    """moto's EC2 for everything, but a console output that carries the guard's line (moto's is fixed)."""

    def __init__(self, ec2, line: str):
        self.ec2, self.line = ec2, line

    def get_console_output(self, **kwargs):
        stubbed = boto3.client("ec2", region_name="us-east-1")
        stub = Stubber(stubbed)
        stub.add_response(
            "get_console_output",
            {"InstanceId": kwargs["InstanceId"], "Output": self.line},
            {"InstanceId": kwargs["InstanceId"]},
        )
        stub.activate()
        return stubbed.get_console_output(**kwargs)

    def __getattr__(self, name):
        return getattr(self.ec2, name)


def test_status_shows_instance_states_and_why_the_cluster_stopped_itself(monkeypatch, state_dir):
    with moto_aws(monkeypatch):
        ec2 = boto3.client("ec2", region_name="us-east-1")
        ids = []
        for index in range(2):
            ids.append(
                ec2.run_instances(
                    ImageId="ami-12c6146b",
                    MinCount=1,
                    MaxCount=1,
                    InstanceType="g4dn.2xlarge",
                    TagSpecifications=[
                        {
                            "ResourceType": "instance",
                            "Tags": [
                                {"Key": "gpu-cluster:stack", "Value": "dev"},
                                {"Key": "gpu-cluster:node", "Value": f"node-{index}"},
                            ],
                        }
                    ],
                )["Instances"][0]["InstanceId"]
            )
        ec2.stop_instances(InstanceIds=ids)
        cluster = inventories.cluster()
        line = 'gpu-cluster-watchdog: {"reason": "budget: $24.99 spent of maxTotalUsd $25", "at": 1795250000.0}\n'
        rows, stopped = aws_provider.status(cluster, ConsoleWithWatchdogLine(ec2, "boot...\n" + line))
    assert [r.state for r in rows] == ["stopped", "stopped"]
    assert [r.instance_id for r in rows] == ids and not any(r.reachable for r in rows)
    assert stopped == {"reason": "budget: $24.99 spent of maxTotalUsd $25", "at": 1795250000.0}


class ConsoleWithHostKeys:
    """moto's EC2 for everything, but each instance's console output carries the host keys cloud-init
    prints (moto's is fixed): `keys` maps an instance id to its key; an instance not in it shows none yet."""

    def __init__(self, ec2, keys: dict[str, str]):
        self.ec2, self.keys = ec2, keys

    def get_console_output(self, **kwargs):
        key = self.keys.get(kwargs["InstanceId"])
        block = f"-----BEGIN SSH HOST KEY KEYS-----\n{key} root@node\n-----END SSH HOST KEY KEYS-----\n" if key else ""
        return {"InstanceId": kwargs["InstanceId"], "Output": "boot...\n" + block}

    def __getattr__(self, name):
        return getattr(self.ec2, name)


def spot_stack_on_moto(ec2, autoscaling) -> str:
    """What the program makes for `spot: true, nodes: 2`: the head an instance, node-1 a group of one."""
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    ec2.modify_subnet_attribute(SubnetId=subnet["SubnetId"], MapPublicIpOnLaunch={"Value": True})

    def tags(node: str) -> list[dict]:
        return [{"Key": "gpu-cluster:stack", "Value": "dev"}, {"Key": "gpu-cluster:node", "Value": node}]

    ec2.run_instances(
        ImageId="ami-12c6146b",
        MinCount=1,
        MaxCount=1,
        InstanceType="g4dn.2xlarge",
        SubnetId=subnet["SubnetId"],
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags("node-0")}],
    )
    template = ec2.create_launch_template(
        LaunchTemplateName="dev-node-1",
        LaunchTemplateData={
            "ImageId": "ami-12c6146b",
            "InstanceType": "g4dn.2xlarge",
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags("node-1")}],
        },
    )["LaunchTemplate"]
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName="dev-node-1-3f2a",
        MinSize=1,
        MaxSize=1,
        DesiredCapacity=1,
        LaunchTemplate={"LaunchTemplateId": template["LaunchTemplateId"], "Version": "1"},
        VPCZoneIdentifier=subnet["SubnetId"],
        Tags=[
            {**tag, "PropagateAtLaunch": False, "ResourceId": "dev-node-1-3f2a", "ResourceType": "auto-scaling-group"}
            for tag in tags("node-1")
        ],
    )
    return "dev-node-1-3f2a"


def test_a_reclaimed_spot_worker_is_replaced_by_its_group_and_adopted_with_its_key_from_the_console(
    monkeypatch, state_dir
):
    from infra import keys
    from infra.inventory import NodeInfo
    from infra.ledger import Ledger

    said: list[str] = []
    with moto_aws(monkeypatch):
        ec2, autoscaling = (
            boto3.client("ec2", region_name="us-east-1"),
            boto3.client("autoscaling", region_name="us-east-1"),
        )
        group = spot_stack_on_moto(ec2, autoscaling)
        head = aws_provider.current_instances(ec2, "dev")["node-0"]
        program_nodes = [
            {
                "name": "node-0",
                "instance_id": head["InstanceId"],
                "public_ip": head["PublicIpAddress"],
                "private_ip": head["PrivateIpAddress"],
            },
            {"name": "node-1", "group": group},
        ]
        found = aws_provider._group_nodes_found("dev", program_nodes, ec2, said.append, 30, autoscaling)
        first = found[1]
        assert first["instance_id"].startswith("i-") and first["public_ip"]  # up fills the group's worker in
        stack_dir = state_dir / "dev"
        stack_dir.mkdir(parents=True)
        (stack_dir / "known_hosts").write_text(
            "".join(keys.known_hosts_entry(n["public_ip"], 22, f"ssh-ed25519 OLD{n['name'][-1]}") + "\n" for n in found)
        )
        cluster = dataclasses.replace(
            inventories.cluster(),
            ssh_key=str(stack_dir / "id_ed25519"),
            known_hosts=str(stack_dir / "known_hosts"),
            nodes=tuple(NodeInfo(n["name"], n["public_ip"], n["private_ip"], 22, 1) for n in found),
            nodes_move=True,
        )
        inventory.save(cluster)

        ec2.terminate_instances(InstanceIds=[first["instance_id"]])  # reclaimed: its group starts another
        replacement = aws_provider.current_instances(ec2, "dev")["node-1"]
        assert replacement["InstanceId"] != first["instance_id"] and replacement["State"]["Name"] == "running"

        # Its console shows no host key yet: it is not trusted, and the inventory keeps the old address.
        unchanged = aws_provider.adopt_replacements(cluster, ConsoleWithHostKeys(ec2, {}), said.append)
        assert unchanged == cluster and "its host key is not on its console output yet" in said[-1]

        console = ConsoleWithHostKeys(ec2, {replacement["InstanceId"]: "ssh-ed25519 NEW1"})
        adopted = aws_provider.adopt_replacements(cluster, console, said.append)
        rows, _ = aws_provider.status(adopted, console)
        placement = boto3.client("ec2", region_name="us-east-1")  # moto lacks placement groups
        stub = Stubber(placement)
        stub.add_response("describe_placement_groups", {"PlacementGroups": []}, {"Filters": teardown.tag_filter("dev")})
        stub.activate()
        leftovers = teardown.sweep("dev", ec2, boto3.client("efs", region_name="us-east-1"), placement, autoscaling)

    node1 = adopted.node("node-1")
    assert (node1.public_ip, node1.private_ip) == (replacement["PublicIpAddress"], replacement["PrivateIpAddress"])
    assert adopted.node("node-0") == cluster.node("node-0")
    assert inventory.load("dev") == adopted
    pinned = (stack_dir / "known_hosts").read_text()
    assert keys.known_hosts_entry(node1.public_ip, 22, "ssh-ed25519 NEW1") in pinned.splitlines()
    assert "OLD1" not in pinned and "OLD0" in pinned
    assert [r.instance_id for r in rows] == [head["InstanceId"], replacement["InstanceId"]]  # the live one, not the old
    ledger = Ledger()
    try:
        events = [(e.kind, e.node) for e in ledger.events("dev")]
    finally:
        ledger.close()
    assert events == [("node replaced", "node-1")]
    assert ("auto-scaling-group", group) in [(x.kind, x.id) for x in leftovers]  # down's sweep would name it


def test_up_stops_at_once_when_a_workers_group_cannot_start_it(monkeypatch, state_dir):
    """No spot capacity in the zone: the group's launch fails, and up says so instead of waiting 15 minutes."""
    with moto_aws(monkeypatch):
        ec2 = boto3.client("ec2", region_name="us-east-1")
        autoscaling = boto3.client("autoscaling", region_name="us-east-1")
        stub = Stubber(autoscaling)
        failed = {
            "StatusCode": "Failed",
            "StatusMessage": "We currently do not have sufficient g4dn.2xlarge capacity in the zone you requested.",
            "ActivityId": "a",
            "AutoScalingGroupName": "dev-node-1-3f2a",
            "Cause": "an instance was started in response to a difference between desired and actual capacity",
            "StartTime": "2026-11-25T00:00:00Z",
        }
        stub.add_response(
            "describe_scaling_activities",
            {"Activities": [failed]},
            {"AutoScalingGroupName": "dev-node-1-3f2a", "MaxRecords": 1},
        )
        stub.activate()
        nodes = [{"name": "node-1", "group": "dev-node-1-3f2a"}]
        with pytest.raises(OperationError, match="node-1's Auto Scaling group could not start it: We currently do not"):
            aws_provider._group_nodes_found("dev", nodes, ec2, lambda line: None, 30, autoscaling)
