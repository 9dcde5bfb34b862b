"""Baked images (infra/images.py) against moto: CreateImage of a node's instance, tagged and listed,
deleted with its snapshots; what `down` says about them; the pieces of `up --image`."""

import boto3
import pytest
from botocore.stub import Stubber

from infra import config as stack_config
from infra import images, inventory, teardown
from infra.cloud_init import INSTANCE_ID_FILE, READY_MARKER, user_data
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo, NodeInfo
from infra.providers import AWS, LOCAL, UpRequest
from infra.providers import aws as aws_provider
from infra.tags import NODE_TAG, STACK_TAG
from infra.timeline import Timeline
from tests.support.aws_fakes import moto_aws

DLAMI = "ami-12c6146b"  # one of moto's own images


@pytest.fixture
def ec2(monkeypatch, state_dir):
    with moto_aws(monkeypatch):
        yield boto3.client("ec2", region_name="us-east-1")


def run_node(ec2, stack: str, node: str) -> str:
    tags = [{"Key": STACK_TAG, "Value": stack}, {"Key": NODE_TAG, "Value": node}]
    answer = ec2.run_instances(
        ImageId=DLAMI,
        MinCount=1,
        MaxCount=1,
        InstanceType="g4dn.xlarge",
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )
    return answer["Instances"][0]["InstanceId"]


def cluster(stack: str = "dev") -> ClusterInfo:
    nodes = tuple(NodeInfo(f"node-{i}", f"198.51.100.{i + 1}", f"10.42.1.{i + 10}", 22, 1) for i in range(2))
    return ClusterInfo(
        stack, "aws", "us-east-1", "g4dn.xlarge", 1.0, "ubuntu", "/k", "/kh", "/shared", "2026-11-21T00:00:00", nodes
    )


def bake(ec2, stack: str = "dev", node: str = "node-0", name: str = "baked-dev") -> tuple[images.Image, Timeline]:
    timeline = Timeline.since_process_start()
    request = images.BakeRequest(node, name)
    made = images.bake(cluster(stack), request, ec2, lambda line: None, timeline, deps_digest=lambda c, n: "d1g3st")
    return made, timeline.close("done")


def test_an_image_of_a_node_is_tagged_listed_and_timed(ec2):
    run_node(ec2, "dev", "node-0")
    made, timeline = bake(ec2)
    assert made.state == "available" and made.stack == "dev" and made.node == "node-0"
    assert made.deps_digest == "d1g3st" and made.size_gb > 0 and made.snapshots
    snapshot = ec2.describe_snapshots(SnapshotIds=list(made.snapshots))["Snapshots"][0]
    assert {"Key": STACK_TAG, "Value": "dev"} in snapshot["Tags"]  # what costs the money carries the stack
    assert [i.id for i in images.ours(ec2)] == [made.id]
    assert [i.id for i in images.ours(ec2, "dev")] == [made.id] and images.ours(ec2, "other") == []
    assert [p for p, _ in timeline.phases] == [
        "startup",
        "checks",
        "create image",
        "snapshot to available",
        "tag snapshots",
        "done",
    ]
    assert timeline.within()
    assert f"image delete {made.id}" in images.cost_line(made) and "$0.05/GB-month" in images.cost_line(made)
    assert made.monthly_usd == pytest.approx(made.size_gb * 0.05)


def test_a_node_with_no_instance_or_no_venv_is_refused(ec2):
    with pytest.raises(UsageError, match="node-1 of stack 'dev' has no running instance"):
        bake(ec2, node="node-1")
    run_node(ec2, "dev", "node-0")

    def never_bootstrapped(cluster, node):
        raise UsageError("node-0 has no node venv recorded")

    with pytest.raises(UsageError, match="no node venv"):
        images.bake(cluster(), images.BakeRequest("node-0", "x-y-z"), ec2, print, Timeline(0), never_bootstrapped)
    assert images.ours(ec2) == []


def test_delete_deregisters_and_deletes_the_snapshots_and_refuses_an_image_not_ours(ec2):
    run_node(ec2, "dev", "node-0")
    made, _ = bake(ec2)
    gone = images.delete(ec2, made.id)
    assert gone.id == made.id and images.ours(ec2) == [] and images.describe(ec2, made.id) is None
    left = [s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]]
    assert not set(made.snapshots) & set(left)
    instance = ec2.run_instances(ImageId=DLAMI, MinCount=1, MaxCount=1, InstanceType="t3.large")
    foreign = ec2.create_image(InstanceId=instance["Instances"][0]["InstanceId"], Name="someone-elses")["ImageId"]
    with pytest.raises(UsageError, match="not made by gpu-cluster"):
        images.delete(ec2, foreign)
    assert images.describe(ec2, foreign) is not None
    with pytest.raises(UsageError, match="no image ami-0123456789abcdef0 in this region"):
        images.delete(ec2, "ami-0123456789abcdef0")


def described(state: str) -> dict:
    return {"Images": [{"ImageId": "ami-0aaaaaaaaaaaaaaaa", "Name": "n", "State": state, "Tags": []}]}


def test_the_wait_shows_progress_until_available_and_stops_on_a_failed_image():
    client = boto3.client("ec2", region_name="us-east-1")
    stub = Stubber(client)
    for state in ("pending", "pending", "available"):
        stub.add_response("describe_images", described(state), {"ImageIds": ["ami-0aaaaaaaaaaaaaaaa"]})
    stub.add_response("describe_images", described("failed"), {"ImageIds": ["ami-0aaaaaaaaaaaaaaaa"]})
    stub.add_response("describe_images", described("pending"), {"ImageIds": ["ami-0aaaaaaaaaaaaaaaa"]})
    stub.activate()
    seen: list[str] = []
    image = images.wait_available(client, "ami-0aaaaaaaaaaaaaaaa", lambda s, t: seen.append(s), sleep=lambda s: None)
    assert image.state == "available" and seen == ["pending", "pending", "available"]
    with pytest.raises(OperationError, match="is failed"):
        images.wait_available(client, "ami-0aaaaaaaaaaaaaaaa", lambda s, t: None, sleep=lambda s: None)
    assert images.usable_problem(client, "ami-0aaaaaaaaaaaaaaaa", "us-east-1") == (
        "image ami-0aaaaaaaaaaaaaaaa is pending, not available: wait for it (python deploy.py image list)"
    )


def test_down_keeps_the_stacks_images_and_says_what_they_cost(ec2):
    run_node(ec2, "dev", "node-0")
    made, _ = bake(ec2)
    ec2.terminate_instances(
        InstanceIds=[i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    )
    kept = images.ours(ec2, "dev")
    lines = teardown.kept_image_lines("dev", kept)
    assert lines[0].startswith("kept 1 image(s) of stack 'dev': their EBS snapshots still cost storage")
    assert any(made.id in line for line in lines) and "image delete AMI_ID" in lines[-1]
    assert teardown.kept_image_lines("dev", []) == []
    assert not [x for x in teardown.sweep("dev", ec2, boto3.client("efs", region_name="us-east-1"), Stubbed())]


class Stubbed:
    """moto lacks placement groups."""

    def describe_placement_groups(self, **kwargs):
        return {"PlacementGroups": []}


def test_up_image_is_the_amiId_key_aws_only_and_recorded_in_the_inventory(state_dir):
    request = UpRequest("dev", {"amiId": "ami-0123456789abcdef0"})
    assert request.given() == {"amiId": "--image"}
    assert "amiId" in AWS.accepts and "amiId" not in LOCAL.accepts
    config = stack_config.load_stack("dev", request.overrides)
    assert config.ami_id == "ami-0123456789abcdef0"
    with pytest.raises(UsageError, match="not an AMI id"):
        stack_config.load_stack("dev", {"amiId": "ubuntu"})
    outputs = {"nodes": [{"name": "node-0", "public_ip": "198.51.100.1", "private_ip": "10.42.1.10"}]}
    made = aws_provider._cluster_from_outputs("dev", config, outputs, "/k", 1.0)
    assert made.image == "ami-0123456789abcdef0"
    assert inventory.ClusterInfo.from_dict({**made.__dict__, "nodes": [n.__dict__ for n in made.nodes]}).image
    plain = aws_provider._cluster_from_outputs("dev", stack_config.load_stack("dev"), outputs, "/k", 1.0)
    assert plain.image == ""


def test_a_node_from_an_image_is_ready_only_once_its_own_cloud_init_is_done():
    # The image carries the marker of the node it was made from: only this instance's own counts.
    assert aws_provider.ready_command("i-0abc") == f"grep -qsx i-0abc {READY_MARKER}"
    assert aws_provider.ready_command(None) == f"test -f {READY_MARKER}"
    script = user_data("fs-1.efs.us-east-1.amazonaws.com")
    assert f"cat {INSTANCE_ID_FILE}; date -Is; }} > {READY_MARKER}" in script
    # Another cluster's EFS line in the image's fstab is replaced, and its watchdog never starts here.
    assert "sed -i '\\| /shared nfs4 |d' /etc/fstab" in script
    assert script.index("systemctl disable --now gpu-cluster-watchdog") < script.index("mount -t nfs4")


def test_a_node_from_an_image_lets_in_only_this_clusters_key(tmp_path):
    """The image's authorized_keys (the old stack's key) is replaced by this instance's key from IMDS."""
    import getpass
    import subprocess

    from infra import cloud_init

    home, shims = tmp_path / "home", tmp_path / "bin"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAold old-stack\n")
    shims.mkdir()
    (shims / "curl").write_text(  # IMDSv2 as EC2 answers: a token, then the instance's key
        '#!/bin/sh\ncase "$*" in *api/token*) echo tok;; *openssh-key*) echo "ssh-ed25519 AAAAnew this-stack";; esac\n'
    )
    (shims / "curl").chmod(0o755)
    user = getpass.getuser()
    script = cloud_init.ONLY_THIS_KEY.format(home=home, user=user)
    subprocess.run(["bash", "-c", script], check=True, env={"PATH": f"{shims}:/usr/bin:/bin"})
    keys = home / ".ssh" / "authorized_keys"
    assert keys.read_text() == "ssh-ed25519 AAAAnew this-stack\n" and keys.stat().st_mode & 0o777 == 0o600


def test_a_spot_worker_powers_off_on_its_marker_written_since_it_booted_and_only_then(tmp_path):
    """The guard's check (`--on-straggler replace`): a marker from before this boot is its predecessor's."""
    import os
    import subprocess

    from infra import cloud_init
    from node import contract

    shims = tmp_path / "bin"
    shims.mkdir()
    for name in ("systemctl", "logger"):
        (shims / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/called\n')
        (shims / name).chmod(0o755)
    check = cloud_init.own_power_off("node-1").replace(cloud_init.SHARED_DIR, str(tmp_path))
    marker = tmp_path / contract.power_off_marker("node-1")
    marker.parent.mkdir(parents=True)
    env = {"PATH": f"{shims}:/usr/bin:/bin"}
    subprocess.run(["bash", "-c", check], check=True, env=env)  # no marker
    marker.write_text('{"reason": "straggler"}')
    os.utime(marker, (0, 0))  # written before this machine booted
    subprocess.run(["bash", "-c", check], check=True, env=env)
    assert not (tmp_path / "called").exists()
    marker.write_text('{"reason": "straggler"}')
    subprocess.run(["bash", "-c", check], check=True, env=env)
    assert (tmp_path / "called").read_text().splitlines()[-1] == "systemctl poweroff"
    assert contract.POWER_OFF_DIR not in user_data("fs-1.efs", node="node-0")  # the head: never
    assert check.replace(str(tmp_path), cloud_init.SHARED_DIR) in user_data("fs-1.efs", node="node-1")
