"""Where the cluster's state lives on the operator's machine, and which stack a command means.

Everything is under `.cluster/` in the repository (or `$CLUSTER_STATE_DIR`, which tests use):
`<stack>/inventory.json`, `<stack>/id_ed25519`, `<stack>/runs/`, `current`, `ledger.sqlite`, `pulumi/`.
"""

import os
import re
from pathlib import Path

from infra.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
LOCAL_STACK = "local"


def state_root() -> Path:
    return Path(os.environ.get("CLUSTER_STATE_DIR") or REPO_ROOT / ".cluster").resolve()


def stack_dir(stack: str) -> Path:
    return state_root() / stack


def runs_dir(stack: str) -> Path:
    return stack_dir(stack) / "runs"


def ledger_path() -> Path:
    return state_root() / "ledger.sqlite"


def check_stack_name(stack: str) -> str:
    if not STACK_NAME.match(stack):
        raise UsageError(
            f"bad stack name {stack!r}: use lower-case letters, digits, '-' or '_' (at most 40)"
        )
    return stack


def current_stack() -> str | None:
    path = state_root() / "current"
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


def set_current_stack(stack: str) -> None:
    write_atomic(state_root() / "current", stack + "\n")


def clear_current_stack(stack: str) -> None:
    """Forget `stack` as the current one, leaving another stack's claim alone."""
    if current_stack() == stack:
        (state_root() / "current").unlink(missing_ok=True)


def resolve_stack(flag: str | None, default: str | None = None) -> str | None:
    """`--stack`, else `$CLUSTER_STACK`, else `.cluster/current`, else `default`."""
    name = flag or os.environ.get("CLUSTER_STACK") or current_stack() or default
    return check_stack_name(name) if name else None


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` so that a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
