"""`up` and `down` on AWS, whole: preflight (moto + Stubber), the Automation API (a fake Pulumi CLI that
has no capacity in the first zone), then host-key pinning and readiness against real SSH servers on
loopback that stand in for the instances."""

import json
import shutil

import boto3
import pytest
from botocore.stub import Stubber

from infra import inventory, state, teardown
from infra.errors import UsageError
from infra.providers import UpRequest
from infra.providers import aws as aws_provider
from tests.support import pulumi_fakes
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
    for node in local.inventory["nodes"]:  # cloud-init's ready marker, in each stand-in's home
        (local.stack_dir / "nodes" / node["name"] / "ready").write_text("ok\n")
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
    assert any("no g4dn.2xlarge capacity in us-east-1a" in line for line in said)
    assert sum("host key pinned on first contact" in line for line in said) == 2
    saved = inventory.load("dev")
    assert saved.provider == "aws" and saved.hourly_usd == pytest.approx(1.537, abs=1e-3)
    assert [n.private_ip for n in saved.nodes] == [n["private_ip"] for n in instances.inventory["nodes"]]
    assert saved.nodes[0].gpus == 1 and saved.shared_dir == "/shared"
    pinned = sorted(line.split()[2] for line in open(saved.known_hosts))
    real = sorted(line.split()[2] for line in open(instances.inventory["known_hosts"]))
    assert pinned == real  # the keys the servers really have
    assert state.current_stack() == "dev"


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
        left = aws_provider.down("dev", clients=clients(), command=fake, placement_ec2=placement, say=lambda s: None)
    assert left == []
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
    from infra.inventory import ClusterInfo, NodeInfo

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
        cluster = ClusterInfo(
            "dev",
            "aws",
            "us-east-1",
            "g4dn.2xlarge",
            1.504,
            "ubuntu",
            "/k",
            "/kh",
            "/shared",
            "2026-11-21T00:00:00+00:00",
            tuple(NodeInfo(f"node-{i}", f"54.0.0.{i}", f"10.42.1.{10 + i}", 22, 1) for i in range(2)),
        )
        line = 'gpu-cluster-watchdog: {"reason": "budget: $24.99 spent of maxTotalUsd $25", "at": 1795250000.0}\n'
        rows, stopped = aws_provider.status(cluster, ConsoleWithWatchdogLine(ec2, "boot...\n" + line))
    assert [r.state for r in rows] == ["stopped", "stopped"]
    assert [r.instance_id for r in rows] == ids and not any(r.reachable for r in rows)
    assert stopped == {"reason": "budget: $24.99 spent of maxTotalUsd $25", "at": 1795250000.0}
