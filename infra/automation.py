"""The Pulumi Automation API on the repository's own Pulumi.yaml: the same program `pulumi up` runs.

State goes to a local file backend under `.cluster/pulumi/` unless PULUMI_BACKEND_URL says otherwise.
Secrets use a passphrase: the user's (PULUMI_CONFIG_PASSPHRASE or _FILE) or one generated once and
kept 0600 in `.cluster/pulumi/passphrase`, so no command ever stops to ask for one.
"""

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from pulumi import automation as auto

from infra import state
from infra.config import StackConfig
from infra.errors import OperationError, UsageError

INSTALL_HINT = (
    "install it with `curl -fsSL https://get.pulumi.com | sh` (or `brew install pulumi`; "
    "https://www.pulumi.com/docs/install/), then run this again"
)
CAPACITY_ERRORS = ("InsufficientInstanceCapacity", "Insufficient capacity", "InsufficientCapacity")


def find_cli() -> str | None:
    """The pulumi executable on PATH or where its installer puts it; None if there is none."""
    found = shutil.which("pulumi")
    if found:
        return found
    default = Path.home() / ".pulumi" / "bin" / "pulumi"
    return str(default) if default.exists() else None


def cli_command() -> auto.PulumiCommand:
    executable = find_cli()
    if executable is None:
        raise UsageError(f"the Pulumi CLI is not installed: {INSTALL_HINT}")
    return auto.PulumiCommand(root=str(Path(executable).resolve().parent.parent))


def backend_dir() -> Path:
    return state.state_root() / "pulumi"


def workspace_env() -> dict[str, str]:
    """What every Pulumi command run here sees: the backend, the passphrase, no update nagging."""
    env = {"PULUMI_SKIP_UPDATE_CHECK": "true"}
    if not os.environ.get("PULUMI_BACKEND_URL"):
        backend_dir().mkdir(parents=True, exist_ok=True)
        env["PULUMI_BACKEND_URL"] = backend_dir().as_uri()
    if not (os.environ.get("PULUMI_CONFIG_PASSPHRASE") or os.environ.get("PULUMI_CONFIG_PASSPHRASE_FILE")):
        env["PULUMI_CONFIG_PASSPHRASE_FILE"] = str(ensure_passphrase())
    return env


def ensure_passphrase() -> Path:
    path = backend_dir() / "passphrase"
    if not path.exists():
        state.write_atomic(path, secrets.token_urlsafe(32) + "\n", mode=0o600)
    os.chmod(path, 0o600)
    return path


def config_values(config: StackConfig) -> dict[str, auto.ConfigValue]:
    """The stack config as Pulumi stores it (strings; unset keys left out)."""
    values = {
        "aws:region": config.region,
        "gpu-cluster:nodes": config.nodes,
        "gpu-cluster:instanceType": config.instance_type,
        "gpu-cluster:sshCidr": config.ssh_cidr,
        "gpu-cluster:sshPublicKey": config.ssh_public_key,
        "gpu-cluster:allowWorldSsh": config.allow_world_ssh,
        "gpu-cluster:spot": config.spot,
        "gpu-cluster:rootVolumeGb": config.root_volume_gb,
        "gpu-cluster:maxHourlyUsd": config.max_hourly_usd,
        "gpu-cluster:maxTotalUsd": config.max_total_usd,
        "gpu-cluster:idleMinutes": config.idle_minutes,
        "gpu-cluster:amiId": config.ami_id,
        "gpu-cluster:availabilityZone": config.availability_zone,
        "gpu-cluster:shutdownBehavior": config.shutdown_behavior,
        "gpu-cluster:costAllocationTag": config.cost_allocation_tag,
        "gpu-cluster:costAllocationTagSeen": config.cost_allocation_tag_seen,
    }
    return {key: auto.ConfigValue(_text(value)) for key, value in values.items() if value is not None}


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def is_capacity_error(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in CAPACITY_ERRORS)


class Deployment:
    """One stack of the gpu-cluster project, driven through the Pulumi CLI."""

    def __init__(
        self, stack_name: str, command: auto.PulumiCommand | None = None, on_output: Callable[[str], None] = print
    ):
        self.on_output = on_output
        try:
            self.stack = auto.create_or_select_stack(
                stack_name,
                work_dir=str(state.REPO_ROOT),
                opts=auto.LocalWorkspaceOptions(pulumi_command=command or cli_command(), env_vars=workspace_env()),
            )
        except auto.CommandError as exc:
            raise OperationError(f"pulumi could not open stack {stack_name!r}: {first_line(exc)}") from None

    def configure(self, config: StackConfig) -> None:
        self.stack.set_all_config(config_values(config))

    def set_zone(self, zone: str) -> None:
        self.stack.set_config("gpu-cluster:availabilityZone", auto.ConfigValue(zone))

    def up(self) -> dict:
        """Create or update everything; the stack outputs as plain values."""
        result = self.stack.up(on_output=self.on_output, color="never")
        return {key: output.value for key, output in result.outputs.items()}

    def outputs(self) -> dict:
        return {key: output.value for key, output in self.stack.outputs().items()}

    def clear_pending_operations(self) -> int:
        """An interrupted `up` leaves pending operations that block destroy; drop them (the
        refresh that follows finds what really exists). Returns how many there were."""
        deployment = self.stack.export_stack()
        state: dict = dict(deployment.deployment or {})
        pending = state.get("pending_operations") or []
        if pending:
            state["pending_operations"] = []
            deployment.deployment = state
            self.stack.import_stack(deployment)
        return len(pending)

    def destroy(self) -> None:
        """Clear what an interrupted up left pending, refresh, destroy, and forget the stack."""
        self.clear_pending_operations()
        self.stack.refresh(on_output=self.on_output, color="never")
        self.stack.destroy(on_output=self.on_output, color="never")
        self.stack.workspace.remove_stack(self.stack.name)


def first_line(exc: BaseException) -> str:
    text = getattr(exc, "stderr", "") or str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
