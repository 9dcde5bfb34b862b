"""Baked images: an AMI made from a bootstrapped AWS node, so that a new node boots with the node venv.

`deploy.py image create` asks EC2 for an image of one node's instance (CreateImage, NoReboot unless
asked), tagged with the stack (infra/tags.py), the node it was made from and the deps stage's digest
the node recorded. The image carries the node's whole root volume: its `~/.gpu-cluster/venv` and the
`~/.gpu-cluster/state.json` in which bootstrap recorded that digest, so on a node booted from it the
deps stage finds its digest unchanged and is `up to date`. `image list` shows this project's images,
`image delete` deregisters one and deletes its snapshots; `down` leaves them (they outlive clusters on
purpose) and names them, since their snapshots cost storage every month.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from infra.errors import OperationError, UsageError
from infra.tags import NODE_TAG, STACK_TAG

IMAGE_TAG = "gpu-cluster:image"
"""Marks an image as made by `deploy.py image create` (the value: the node it was made from)."""
DEPS_TAG = "gpu-cluster:deps-digest"
"""The digest of the deps stage the node had recorded (remote/bootstrap_node.py), so an image can be matched."""
SNAPSHOT_USD_PER_GB_MONTH = 0.05
"""EBS snapshot storage, standard tier, us-east-1 (https://aws.amazon.com/ebs/pricing/). A snapshot is
billed for the blocks it holds, so the volume's size is the most an image can cost."""
WAIT_TIMEOUT_S = 3600
POLL_S = 15.0


@dataclass(frozen=True)
class Image:
    """One of this project's AMIs, as DescribeImages tells it."""

    id: str
    """The AMI id."""
    name: str
    """Its name (unique per account and region)."""
    stack: str
    """The stack whose node it was made from."""
    node: str
    """That node."""
    created: str
    """EC2's CreationDate (ISO-8601 UTC)."""
    size_gb: int
    """The EBS volumes' sizes together: what its snapshots can cost at most."""
    state: str
    """pending, available, failed, ..."""
    snapshots: tuple[str, ...] = ()
    """Its EBS snapshots (deleted with it)."""
    deps_digest: str = ""
    """The deps stage's digest the node had recorded."""

    @property
    def monthly_usd(self) -> float:
        return self.size_gb * SNAPSHOT_USD_PER_GB_MONTH

    def as_dict(self) -> dict:
        return {**asdict(self), "snapshots": list(self.snapshots), "monthly_usd_at_most": round(self.monthly_usd, 2)}


def from_described(image: dict) -> Image:
    tags = {t["Key"]: t["Value"] for t in image.get("Tags", [])}
    volumes = [m["Ebs"] for m in image.get("BlockDeviceMappings", []) if "Ebs" in m]
    return Image(
        id=image["ImageId"],
        name=image.get("Name", ""),
        stack=tags.get(STACK_TAG, ""),
        node=tags.get(IMAGE_TAG, ""),
        created=image.get("CreationDate", ""),
        size_gb=sum(int(v.get("VolumeSize", 0)) for v in volumes),
        state=image.get("State", ""),
        snapshots=tuple(v["SnapshotId"] for v in volumes if v.get("SnapshotId")),
        deps_digest=tags.get(DEPS_TAG, ""),
    )


def is_ours(image: Image) -> bool:
    return bool(image.stack and image.node)


def image_tags(stack: str, node: str, deps_digest: str, name: str) -> list[dict]:
    return [
        {"Key": STACK_TAG, "Value": stack},
        {"Key": IMAGE_TAG, "Value": node},
        {"Key": NODE_TAG, "Value": node},
        {"Key": DEPS_TAG, "Value": deps_digest},
        {"Key": "Name", "Value": name},
    ]


def default_name(stack: str, node: str, now: float | None = None) -> str:
    return f"gpu-cluster-{stack}-{node}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"


def check_name(name: str) -> str:
    """EC2's rule for an AMI name: 3 to 128 characters of letters, digits and ( ) [ ] . / - ' @ _."""
    allowed = set("()[]./-'@_ ")
    if not 3 <= len(name) <= 128 or not all(c.isascii() and (c.isalnum() or c in allowed) for c in name):
        raise UsageError(f"--name {name!r}: an image name is 3 to 128 letters, digits, spaces or ( ) [ ] . / - ' @ _")
    return name


def create(ec2, instance_id: str, name: str, tags: list[dict], reboot: bool = False) -> str:
    """CreateImage of the instance, the image tagged; its snapshots are tagged once they exist (`tag_snapshots`)."""
    answer = ec2.create_image(
        InstanceId=instance_id,
        Name=name,
        Description=f"gpu-cluster image of {instance_id}",
        NoReboot=not reboot,
        TagSpecifications=[{"ResourceType": "image", "Tags": tags}],
    )
    return answer["ImageId"]


def describe(ec2, image_id: str) -> Image | None:
    """The image, or None where the region has no such image (or it is gone)."""
    import botocore.exceptions

    try:
        found = ec2.describe_images(ImageIds=[image_id])["Images"]
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
            return None
        raise
    return from_described(found[0]) if found else None


def wait_available(
    ec2,
    image_id: str,
    progress: Callable[[str, float], None],
    timeout_s: float = WAIT_TIMEOUT_S,
    poll_s: float = POLL_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Image:
    """Poll until the image is `available` (progress: its state and the seconds so far); OperationError
    where it fails or takes longer than `timeout_s`."""
    started = time.monotonic()
    while True:
        image = describe(ec2, image_id)
        waited = time.monotonic() - started
        state = image.state if image else "not listed yet"
        progress(state, waited)
        if image and image.state == "available":
            return image
        if image and image.state in ("failed", "invalid", "deregistered", "error"):
            raise OperationError(f"image {image_id} is {image.state}: python deploy.py image delete {image_id}")
        if waited > timeout_s:
            raise OperationError(
                f"image {image_id} is still {state} after {timeout_s / 60:.0f} min: "
                "see python deploy.py image list; it becomes usable once available"
            )
        sleep(poll_s)


def tag_snapshots(ec2, image: Image, tags: list[dict]) -> None:
    """The snapshots carry the image's tags, so a sweep by tag finds what costs the money."""
    if image.snapshots:
        ec2.create_tags(Resources=list(image.snapshots), Tags=tags)


def ours(ec2, stack: str | None = None) -> list[Image]:
    """This account's images made by `image create` (all stacks, or one), oldest first."""
    filters = [{"Name": "tag-key", "Values": [IMAGE_TAG]}]
    if stack is not None:
        filters.append({"Name": f"tag:{STACK_TAG}", "Values": [stack]})
    found = [from_described(i) for i in ec2.describe_images(Owners=["self"], Filters=filters)["Images"]]
    return sorted((i for i in found if is_ours(i)), key=lambda i: (i.created, i.id))


def delete(ec2, image_id: str) -> Image:
    """Deregister one of our images and delete its snapshots; UsageError for an image that is not ours."""
    image = describe(ec2, image_id)
    if image is None:
        raise UsageError(f"no image {image_id} in this region: python deploy.py image list shows ours")
    if not is_ours(image):
        raise UsageError(f"image {image_id} was not made by gpu-cluster (no {IMAGE_TAG} tag): not deleting it")
    ec2.deregister_image(ImageId=image_id)
    for snapshot in image.snapshots:
        ec2.delete_snapshot(SnapshotId=snapshot)
    return image


def usable_problem(ec2, image_id: str, region: str) -> str | None:
    """Why `up` cannot boot nodes from the image (preflight's line), or None where it can."""
    image = describe(ec2, image_id)
    if image is None:
        return f"image {image_id} does not exist in {region}: python deploy.py image list shows ours"
    if image.state != "available":
        return f"image {image_id} is {image.state}, not available: wait for it (python deploy.py image list)"
    return None


def cost_line(image: Image) -> str:
    return (
        f"{image.size_gb} GB of EBS snapshots: at most ${image.monthly_usd:.2f}/month "
        f"(${SNAPSHOT_USD_PER_GB_MONTH}/GB-month, billed for the blocks stored) until "
        f"python deploy.py image delete {image.id}"
    )


# ------------------------------------------------------------------------------- from a node


def node_deps_digest(cluster, node) -> str:
    """The deps stage's digest the node recorded in its ~/.gpu-cluster/state.json (over SSH); UsageError
    where the node was never bootstrapped, since an image of it would not carry the node venv."""
    import asyncio
    import json

    from infra import ssh
    from node import contract

    try:
        result = asyncio.run(ssh.run(cluster, node, f"cat {contract.shell(contract.STATE)}", timeout_s=30))
    except Exception as exc:  # unreachable, refused, timed out: one line either way
        raise OperationError(f"could not read {node.name}'s bootstrap state: {ssh.describe(exc)}") from None
    try:
        stages = json.loads(result.stdout) if result.exit_status == 0 else {}
    except ValueError:
        stages = {}
    found = stages.get("deps", {}).get("digest") if isinstance(stages, dict) else None
    if not found:
        raise UsageError(
            f"{node.name} has no node venv recorded (no deps stage in its state): run fab bootstrap first, "
            "so the image carries it"
        )
    return str(found)


@dataclass(frozen=True)
class BakeRequest:
    """What `deploy.py image create` asks for."""

    node: str
    """The node whose instance is imaged."""
    name: str
    """The image's name."""
    reboot: bool = False
    """Let EC2 reboot the instance for a consistent file system (the default takes it as it runs)."""


def bake(
    cluster, request: BakeRequest, ec2, say, timeline, deps_digest: Callable[..., str] = node_deps_digest
) -> Image:
    """An image of the node's instance, tagged, waited for, its snapshots tagged; phases on `timeline`."""
    from infra.providers.aws import current_instances

    node = cluster.node(request.node)
    instance = current_instances(ec2, cluster.stack).get(node.name, {})
    if instance.get("State", {}).get("Name") not in ("running", "stopped"):
        raise UsageError(f"{node.name} of stack {cluster.stack!r} has no running instance to image")
    digest = deps_digest(cluster, node)
    timeline.mark("checks")
    tags = image_tags(cluster.stack, node.name, digest, request.name)
    image_id = create(ec2, instance["InstanceId"], request.name, tags, request.reboot)
    how = "rebooting it" if request.reboot else "without a reboot"
    say(f"image {image_id} of {node.name} ({instance['InstanceId']}) requested, {how}")
    timeline.mark("create image")
    image = wait_available(ec2, image_id, lambda state, s: say(f"  {image_id}: {state} after {s:.0f} s"))
    timeline.mark("snapshot to available")
    tag_snapshots(ec2, image, tags)
    timeline.mark("tag snapshots")
    return image
