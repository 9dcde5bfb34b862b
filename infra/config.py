"""Stack configuration (Pulumi namespace `gpu-cluster`): one dataclass, one validating function.

The same `validate` serves `deploy.py` (reading `Pulumi.<stack>.yaml` plus command-line overrides), the
Pulumi program (reading `pulumi.Config`) and `plan`, so every entry point refuses the same things with
the same words, all problems at once.
"""

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infra import catalog, state
from infra.errors import UsageError, shown

NAMESPACE = "gpu-cluster"
MAX_NODES = 16
DEFAULT_INSTANCE_TYPE = "g4dn.2xlarge"
DEFAULT_REGION = "us-east-1"
# No count, port or number of days has more than 18 digits, and int() refuses text over 4,300 digits with a
# ValueError of its own (CPython's int_max_str_digits): longer text is not a whole number here.
WHOLE_NUMBER = re.compile(r"[0-9]{1,18}")
NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?")
REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]")
ZONE = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9][a-z]")
AMI_ID = re.compile(r"ami-[0-9a-f]{8,17}")
PUBLIC_KEY = re.compile(r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/]+={0,3}( [^\r\n]*)?")
WORLD = ("0.0.0.0/0", "::/0")
# The stack config keys, in the `gpu-cluster` namespace (`aws:region` aside).
CONFIG_KEYS = (
    "nodes",
    "instanceType",
    "sshCidr",
    "sshPublicKey",
    "allowWorldSsh",
    "spot",
    "rootVolumeGb",
    "maxHourlyUsd",
    "maxTotalUsd",
    "idleMinutes",
    "amiId",
    "availabilityZone",
    "shutdownBehavior",
    "costAllocationTag",
    "costAllocationTagSeen",
)


@dataclass(frozen=True)
class StackConfig:
    """The cluster a stack describes."""

    stack: str
    """Stack name; also tags every AWS resource (`gpu-cluster:stack`)."""
    region: str = DEFAULT_REGION
    """`aws:region`."""
    nodes: int = 2
    """Number of instances, 1..16."""
    instance_type: str = DEFAULT_INSTANCE_TYPE
    """An EC2 type of the instance catalog (harness/catalog.json)."""
    ssh_cidr: str | None = None
    """Who may SSH in; None means the operator's public IP /32, looked up at `up`."""
    ssh_public_key: str | None = None
    """The cluster key's public half; `deploy.py` sets it from `.cluster/<stack>/id_ed25519.pub`."""
    allow_world_ssh: bool = False
    """Must be true for `sshCidr` 0.0.0.0/0 or ::/0 to be accepted."""
    spot: bool = False
    """Spot instances instead of on-demand."""
    root_volume_gb: int = 150
    """Encrypted gp3 root volume per node (the Deep Learning Base AMI needs at least 75)."""
    max_hourly_usd: float | None = None
    """`up` refuses a cluster whose estimated hourly cost is above this."""
    max_total_usd: float | None = None
    """The watchdog powers the cluster off before its accrued cost crosses this."""
    idle_minutes: float | None = None
    """The watchdog powers the cluster off after this long with no job and idle GPUs."""
    ami_id: str | None = None
    """Override the newest Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)."""
    availability_zone: str | None = None
    """Pin the zone; otherwise the first zone (sorted) that offers the type, with fallback on capacity."""
    shutdown_behavior: str = "terminate"
    """What a watchdog power-off does to the instances: `terminate` or `stop`."""
    cost_allocation_tag: bool = True
    """The program activates `gpu-cluster:stack` as a cost-allocation tag (the bill's side of `cost --reconcile`);
    false where the account cannot (a member account of an organization: its payer account activates it)."""
    cost_allocation_tag_seen: bool = False
    """AWS billing lists `gpu-cluster:stack` (Cost Explorer's ListCostAllocationTags), so it can be activated:
    `up`'s preflight asks and sets this; only then does the program activate the tag (AWS refuses a key
    billing has not seen yet, up to 24 h after the first tagged resource)."""

    @property
    def gpus_per_node(self) -> int:
        return gpus_per_node(self.instance_type)


def gpus_per_node(instance_type: str) -> int:
    return catalog.lookup(instance_type).gpus


def _whole_number(value) -> int:
    """An int from an int or its digits alone: no bool, no float, no sign, space or trailing newline."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and WHOLE_NUMBER.fullmatch(value):
        return int(value)
    raise ValueError(value)


def _number(value) -> float:
    """A float from a number or its decimal text alone (no space or trailing newline)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and NUMBER.fullmatch(value):
        return float(value)
    raise ValueError(value)


def check_nodes(value) -> int:
    try:
        nodes = _whole_number(value)
    except ValueError:
        raise UsageError(f"nodes must be a whole number from 1 to {MAX_NODES}, not {shown(value)}") from None
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"nodes must be from 1 to {MAX_NODES} (got {nodes}); pass --nodes N")
    return nodes


def check_instance_type(value) -> str:
    """A type the catalog knows; anything else (an unlisted multi-GPU type included) is refused."""
    return catalog.lookup(value).name


def validate(stack: str, raw: Mapping[str, object]) -> StackConfig:
    """A StackConfig from raw key/values (config keys, unprefixed); every problem in one UsageError."""
    problems: list[str] = []
    values: dict[str, Any] = {"stack": state.check_stack_name(stack)}  # each value checked by its take()

    def take(key: str, field: str, parse):
        if raw.get(key) is None:  # not given; an empty string is given, and bad
            return
        try:
            values[field] = parse(raw[key])
        except UsageError as exc:
            problems.append(str(exc))
        except (TypeError, ValueError):
            problems.append(f"{key} has a bad value {raw[key]!r}")

    take("region", "region", _region)
    take("nodes", "nodes", check_nodes)
    take("instanceType", "instance_type", check_instance_type)
    take("sshCidr", "ssh_cidr", _cidr)
    take("sshPublicKey", "ssh_public_key", _public_key)
    take("allowWorldSsh", "allow_world_ssh", _boolean)
    take("spot", "spot", _boolean)
    take("rootVolumeGb", "root_volume_gb", _volume_gb)
    take("maxHourlyUsd", "max_hourly_usd", _budget("maxHourlyUsd"))
    take("maxTotalUsd", "max_total_usd", _budget("maxTotalUsd"))
    take("idleMinutes", "idle_minutes", _budget("idleMinutes"))
    take("amiId", "ami_id", _ami)
    take("availabilityZone", "availability_zone", _zone)
    take("shutdownBehavior", "shutdown_behavior", _shutdown_behavior)
    take("costAllocationTag", "cost_allocation_tag", _boolean)
    take("costAllocationTagSeen", "cost_allocation_tag_seen", _boolean)
    config = StackConfig(**values) if not problems else None
    if config and config.ssh_cidr in WORLD and not config.allow_world_ssh:
        problems.append(
            f"sshCidr {config.ssh_cidr} opens SSH to the whole internet: use your /32, "
            "or set gpu-cluster:allowWorldSsh true if you really mean it"
        )
    if config and config.availability_zone and not config.availability_zone.startswith(config.region):
        problems.append(f"availabilityZone {config.availability_zone} is not in aws:region {config.region}")
    if config and config.spot and config.shutdown_behavior == "stop":
        problems.append("spot instances can only terminate when shut down: set shutdownBehavior terminate or drop spot")
    if problems or config is None:
        raise UsageError("; ".join(problems))
    return config


def check_region(value) -> str:
    """An AWS region name, or UsageError in one line."""
    return _region(value)


def _region(value) -> str:
    if not isinstance(value, str) or not REGION.fullmatch(value):
        raise UsageError(f"aws:region {value!r} is not a region name like us-east-1")
    return value


def _zone(value) -> str:
    if not isinstance(value, str) or not ZONE.fullmatch(value):
        raise UsageError(f"availabilityZone {value!r} is not a zone name like us-east-1a")
    return value


def _cidr(value) -> str:
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise UsageError(f"sshCidr {value!r} is not a CIDR block like 203.0.113.7/32") from None


def _public_key(value) -> str:
    text = value.strip() if isinstance(value, str) else ""
    if not PUBLIC_KEY.fullmatch(text):
        raise UsageError("sshPublicKey is not one OpenSSH public key line (ssh-ed25519 AAAA... [comment])")
    return text


def _boolean(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise ValueError(value)


def _volume_gb(value) -> int:
    size = _whole_number(value)
    if not 75 <= size <= 16384:
        raise UsageError(f"rootVolumeGb must be from 75 to 16384 (got {size}): the GPU AMI needs 75 GB")
    return size


def _budget(key: str):
    def parse(value) -> float:
        try:
            number = _number(value)
        except ValueError:
            raise UsageError(f"{key} must be a positive number, not {value!r}") from None
        if not number > 0 or number != number or number == float("inf"):
            raise UsageError(f"{key} must be a positive number (got {value})")
        return number

    return parse


def _ami(value) -> str:
    if not isinstance(value, str) or not AMI_ID.fullmatch(value):
        raise UsageError(f"amiId {value!r} is not an AMI id like ami-0123456789abcdef0")
    return value


def _shutdown_behavior(value) -> str:
    if value not in ("terminate", "stop"):
        raise UsageError(f"shutdownBehavior must be terminate or stop, not {value!r}")
    return str(value)


# --------------------------------------------------------------------------------- stack files


def stack_file(stack: str) -> Path:
    return state.REPO_ROOT / f"Pulumi.{stack}.yaml"


def read_stack_file(stack: str) -> dict[str, object]:
    """`Pulumi.<stack>.yaml`'s config with namespaces taken off (`aws:region` becomes `region`).

    The file is the user's to edit, so whatever it holds is one line saying what is wrong with it:
    not a file, not UTF-8, not YAML, not a mapping, or a `config:` that is not a mapping.
    """
    path = stack_file(stack)
    try:
        text = state.read_text(path, "the stack file")
    except FileNotFoundError:
        return {}
    import yaml  # loads only where a stack file is read: fab's start stays short (issue 41)

    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path.name} is not valid YAML: {exc}".splitlines()[0]) from None
    document = {} if document is None else document
    if not isinstance(document, dict):
        raise UsageError(f"{path.name} must be a YAML mapping with a `config:` mapping, not a {_yaml_kind(document)}")
    settings = document.get("config")
    settings = {} if settings is None else settings
    if not isinstance(settings, dict):
        raise UsageError(
            f"{path.name}: `config:` must be a mapping of keys like gpu-cluster:nodes, not a {_yaml_kind(settings)}"
        )
    raw = {}
    for key, value in settings.items():
        namespace, _, name = str(key).partition(":")
        if namespace in (NAMESPACE, "aws") and name:
            raw[name] = value
    return raw


def _yaml_kind(value) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def load_stack(stack: str, overrides: Mapping[str, object] | None = None) -> StackConfig:
    raw = read_stack_file(stack)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validate(stack, raw)


def with_ssh(config: StackConfig, cidr: str, public_key: str) -> StackConfig:
    return replace(config, ssh_cidr=cidr, ssh_public_key=public_key)
