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

import yaml

from infra import state
from infra.errors import UsageError

NAMESPACE = "gpu-cluster"
MAX_NODES = 16
DEFAULT_INSTANCE_TYPE = "g4dn.2xlarge"
DEFAULT_REGION = "us-east-1"
INSTANCE_TYPE = re.compile(r"^(g4dn|g5|g6|g6e|p3|p3dn|p4d|p4de|p5|p5e|p5en)\.(metal|\d*xlarge)$")
WORLD = ("0.0.0.0/0", "::/0")
# The stack config keys, in the `gpu-cluster` namespace (`aws:region` aside).
CONFIG_KEYS = ("nodes", "instanceType", "sshCidr", "sshPublicKey", "allowWorldSsh", "spot", "rootVolumeGb",
               "maxHourlyUsd", "maxTotalUsd", "idleMinutes", "amiId", "availabilityZone", "shutdownBehavior")


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
    """EC2 type: g4dn.* (T4), g5.* (A10G), g6.* (L4), g6e.* (L40S) or p*."""
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

    @property
    def gpus_per_node(self) -> int:
        return gpus_per_node(self.instance_type)


# GPUs per node for the supported types (the rest of each family has one GPU).
_MULTI_GPU = {
    "g4dn.12xlarge": 4, "g4dn.metal": 8,
    "g5.12xlarge": 4, "g5.24xlarge": 4, "g5.48xlarge": 8,
    "g6.12xlarge": 4, "g6.24xlarge": 4, "g6.48xlarge": 8,
    "g6e.12xlarge": 4, "g6e.24xlarge": 4, "g6e.48xlarge": 8,
    "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8,
    "p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8,
}  # fmt: skip


def gpus_per_node(instance_type: str) -> int:
    return _MULTI_GPU.get(instance_type, 1)


def check_nodes(value) -> int:
    try:
        nodes = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"nodes must be a whole number from 1 to {MAX_NODES}, not {value!r}") from None
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"nodes must be from 1 to {MAX_NODES} (got {nodes}); pass --nodes N")
    return nodes


def check_instance_type(value: str) -> str:
    if not INSTANCE_TYPE.match(value or ""):
        raise UsageError(
            f"instance type {value!r} is not supported: use g4dn.*, g5.*, g6.*, g6e.* or p* (e.g. g4dn.2xlarge)"
        )
    return value


def validate(stack: str, raw: Mapping[str, object]) -> StackConfig:
    """A StackConfig from raw key/values (config keys, unprefixed); every problem in one UsageError."""
    problems: list[str] = []
    values: dict[str, object] = {"stack": state.check_stack_name(stack)}

    def take(key: str, field: str, parse):
        if raw.get(key) in (None, ""):
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
    take("availabilityZone", "availability_zone", str)
    take("shutdownBehavior", "shutdown_behavior", _shutdown_behavior)
    config = StackConfig(**values) if not problems else None
    if config and config.ssh_cidr in WORLD and not config.allow_world_ssh:
        problems.append(
            f"sshCidr {config.ssh_cidr} opens SSH to the whole internet: use your /32, "
            "or set gpu-cluster:allowWorldSsh true if you really mean it"
        )
    if config and config.spot and config.shutdown_behavior == "stop":
        problems.append("spot instances can only terminate when shut down: set shutdownBehavior terminate or drop spot")
    if problems:
        raise UsageError("; ".join(problems))
    return config


def _region(value) -> str:
    if not re.match(r"^[a-z]{2}(-[a-z]+)+-\d$", str(value)):
        raise UsageError(f"aws:region {value!r} is not a region name like us-east-1")
    return str(value)


def _cidr(value) -> str:
    try:
        return str(ipaddress.ip_network(str(value), strict=False))
    except ValueError:
        raise UsageError(f"sshCidr {value!r} is not a CIDR block like 203.0.113.7/32") from None


def _public_key(value) -> str:
    text = str(value).strip()
    if not re.match(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-\S+) [A-Za-z0-9+/=]+", text):
        raise UsageError("sshPublicKey is not an OpenSSH public key")
    return text


def _boolean(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise ValueError(value)


def _volume_gb(value) -> int:
    size = int(value)
    if not 75 <= size <= 16384:
        raise UsageError(f"rootVolumeGb must be from 75 to 16384 (got {size}): the GPU AMI needs 75 GB")
    return size


def _budget(key: str):
    def parse(value) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{key} must be a positive number, not {value!r}") from None
        if not number > 0 or number != number or number == float("inf"):
            raise UsageError(f"{key} must be a positive number (got {value})")
        return number

    return parse


def _ami(value) -> str:
    if not re.match(r"^ami-[0-9a-f]{8,17}$", str(value)):
        raise UsageError(f"amiId {value!r} is not an AMI id like ami-0123456789abcdef0")
    return str(value)


def _shutdown_behavior(value) -> str:
    if value not in ("terminate", "stop"):
        raise UsageError(f"shutdownBehavior must be terminate or stop, not {value!r}")
    return str(value)


# --------------------------------------------------------------------------------- stack files


def stack_file(stack: str) -> Path:
    return state.REPO_ROOT / f"Pulumi.{stack}.yaml"


def read_stack_file(stack: str) -> dict[str, object]:
    """`Pulumi.<stack>.yaml`'s config with namespaces taken off (`aws:region` becomes `region`)."""
    path = stack_file(stack)
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return {}
    except yaml.YAMLError as exc:
        raise UsageError(f"{path.name} is not valid YAML: {exc}".splitlines()[0]) from None
    raw = {}
    for key, value in (document.get("config") or {}).items():
        namespace, _, name = str(key).partition(":")
        if namespace in (NAMESPACE, "aws") and name:
            raw[name] = value
    return raw


def load_stack(stack: str, overrides: Mapping[str, object] | None = None) -> StackConfig:
    raw = read_stack_file(stack)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validate(stack, raw)


def with_ssh(config: StackConfig, cidr: str, public_key: str) -> StackConfig:
    return replace(config, ssh_cidr=cidr, ssh_public_key=public_key)
