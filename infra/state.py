"""Where the cluster's state lives on the operator's machine, and which stack a command means.

Everything is under `.cluster/` in the repository (or `$CLUSTER_STATE_DIR`, which tests use): each
stack's files (named below, the one place that spells them), `current`, `ledger.sqlite`, `pulumi/`.
The folder is the user's alone: 0700, and every file in it 0600 (keys, logs with script arguments,
costs). `keep_private` makes that the default for everything a command creates.
"""

import dataclasses
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, overload

from infra.errors import UsageError, shown

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
LOCAL_STACK = "local"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# write_atomic's temporary files: `.<name>.<pid>.tmp`, beside the file they replace.
TMP_FILE = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.tmp")

# A stack's files, in `.cluster/<stack>/`:
INVENTORY = "inventory.json"
"""The ClusterInfo a provider's `up` writes (infra/inventory.py)."""
KNOWN_HOSTS = "known_hosts"
"""The nodes' pinned host keys."""
SSH_KEY = "id_ed25519"
"""The cluster's own SSH key (`.pub` beside it), created once per stack (infra/keys.py)."""
BOOTSTRAP = "bootstrap.json"
"""What `fab bootstrap` found on the nodes (remote/bootstrap.py): a `BootstrapRecord`, read by `bootstrap_record`."""
GUARDS = "guards.json"
"""The budget and idle guards `up` asked for, which bootstrap starts the watchdog with (infra/costs.py)."""
WORKDIRS = "workdirs"
"""`fab run --workdir`: per project, the manifest last synced to the nodes (remote/workdir.py)."""
RUNS = "runs"
"""Each run's logs and results, kept when the stack is taken down."""
MUNGE_KEY = "munge.key"
"""The cluster's munge key (base64), which bootstrap's scheduler stage gives every node."""
PREFLIGHT = "preflight.json"
"""The last preflight's measurements and verdicts (remote/fitness.py): launches refuse its CRITICAL nodes."""
RECONCILIATION = "reconciliation.json"
"""What the last `deploy.py cost --reconcile` of the stack found, in a few figures (the dashboard shows them)."""
FACTS = (INVENTORY, KNOWN_HOSTS, BOOTSTRAP, GUARDS, MUNGE_KEY, PREFLIGHT)
"""What `forget` removes: what was true of the nodes while they were up."""


def keep_private() -> None:
    """Files and folders this process creates are its user's alone (as ssh insists for keys)."""
    os.umask(0o077)


def state_root() -> Path:
    return Path(os.environ.get("CLUSTER_STATE_DIR") or REPO_ROOT / ".cluster").resolve()


def stack_dir(stack: str) -> Path:
    return state_root() / stack


def stack_file(stack: str, name: str) -> Path:
    """One of a stack's files (`INVENTORY`, `BOOTSTRAP`, ...)."""
    return stack_dir(stack) / name


@dataclasses.dataclass(frozen=True)
class BootstrapRecord:
    """What the last `fab bootstrap` of a stack chose and found (its bootstrap.json), written and read here
    only; every field empty where no bootstrap ran (`bootstrapped` False)."""

    master_port: int | None = None
    """MASTER_PORT of the rendezvous on node-0 (and the base of Slurm's ports)."""
    python: dict[str, str] = dataclasses.field(default_factory=dict)
    """The interpreter with torch on each node."""
    code_dir: str = ""
    """Where the code is synced on the nodes."""
    slurm_holds: bool = False
    """Slurm holds the runs (bootstrap's scheduler stage settled on it); else fab's connections do."""
    scheduler_choice: str = ""
    """`--scheduler` as asked (auto, slurm, none): the next bootstrap keeps it."""
    scheduler_why: str = ""
    """Why `--scheduler auto` left the runs to fab (one line), '' where it did not."""
    accounting: str = ""
    """`--accounting` as asked (auto, none)."""
    nodes: dict = dataclasses.field(default_factory=dict)
    """{node: {"probe": its facts, "deps": what the deps stage found}}"""
    completed_at: str = ""
    timeline: dict | None = None
    """The bootstrap's phases (infra/timeline.py)."""

    SLURM: ClassVar[str] = "slurm"
    """The file's `scheduler` where Slurm holds the runs ('' where fab's connections do)."""

    @property
    def bootstrapped(self) -> bool:
        return self.master_port is not None

    @property
    def homes(self) -> dict[str, str]:
        """Each node user's home (the probe's), for absolute paths on the nodes."""
        found = {}
        for name, facts in self.nodes.items():
            home = ((facts or {}).get("probe") or {}).get("home")
            if isinstance(home, str):
                found[name] = home
        return found

    @classmethod
    def from_dict(cls, data: dict) -> "BootstrapRecord":
        """The record a bootstrap wrote (keys it does not know are left: a record at rest outlives versions);
        ValueError where a value is not of its kind."""
        if not isinstance(data, dict):
            raise ValueError("bootstrap.json is not a JSON object")
        try:
            port = data.get("master_port")
            return cls(
                master_port=None if port is None else int(port),
                python={str(k): str(v) for k, v in (data.get("python") or {}).items()},
                code_dir=str(data.get("code_dir") or ""),
                slurm_holds=data.get("scheduler") == cls.SLURM,
                scheduler_choice=str(data.get("scheduler_choice") or ""),
                scheduler_why=str(data.get("scheduler_why") or ""),
                accounting=str(data.get("accounting") or ""),
                nodes=dict(data.get("nodes") or {}),
                completed_at=str(data.get("completed_at") or ""),
                timeline=data.get("timeline") if isinstance(data.get("timeline"), dict) else None,
            )
        except (TypeError, AttributeError):
            raise ValueError("bootstrap.json has a value of the wrong kind") from None

    def as_dict(self) -> dict:
        return {
            "master_port": self.master_port,
            "python": self.python,
            "code_dir": self.code_dir,
            "scheduler": self.SLURM if self.slurm_holds else "",
            "scheduler_choice": self.scheduler_choice,
            "scheduler_why": self.scheduler_why,
            "accounting": self.accounting,
            "nodes": self.nodes,
            "completed_at": self.completed_at,
            "timeline": self.timeline,
        }

    @classmethod
    def read(cls, path: Path) -> "BootstrapRecord":
        """The record in `path`; an empty one where there is none, or one not readable."""
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return cls()

    def write(self, stack: str) -> None:
        write_atomic(stack_file(stack, BOOTSTRAP), json.dumps(self.as_dict(), indent=2) + "\n")


def bootstrap_record(stack: str) -> BootstrapRecord:
    """The one reading of the stack's bootstrap.json (an empty record where there is none)."""
    return BootstrapRecord.read(stack_file(stack, BOOTSTRAP))


def runs_dir(stack: str) -> Path:
    return stack_dir(stack) / RUNS


def forget(stack: str) -> None:
    """Forget a stack that is down: its facts go (`FACTS`), and it is no longer the current stack;
    runs/ (the logs) and the key stay."""
    for name in FACTS:
        stack_file(stack, name).unlink(missing_ok=True)
    clear_current_stack(stack)


def stacks_up() -> list[str]:
    """The stacks that have an inventory (are up, as far as this machine knows), by name."""
    root = state_root()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{INVENTORY}") if STACK_NAME.fullmatch(p.parent.name))


def ledger_path() -> Path:
    return state_root() / "ledger.sqlite"


def make_private_dir(path: Path) -> Path:
    """`path` and its missing parents as 0700 folders; the state folder itself is made 0700 too."""
    root = state_root()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        os.chmod(folder, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask
    if (path == root or root in path.parents) and root.is_dir() and root.stat().st_mode & 0o077:
        os.chmod(root, PRIVATE_DIR_MODE)
    return path


def open_private(path: Path, mode: str = "a", **kwargs):
    """`open(path, mode)`, creating the file 0600 where it does not exist (logs, which may hold arguments)."""
    make_private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return open(path, mode, opener=lambda name, _: os.open(name, flags, PRIVATE_FILE_MODE), **kwargs)


def check_stack_name(stack: str, origin: str = "stack name") -> str:
    """`stack` when it is a whole valid name (no empty string, no trailing newline); else one line."""
    if not isinstance(stack, str) or not STACK_NAME.fullmatch(stack):
        raise UsageError(
            f"bad {origin} {shown(stack)}: use 1 to 40 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return stack


def current_path() -> Path:
    return state_root() / "current"


def current_stack() -> str | None:
    """The stack of the last `up`, or None; a damaged `current` file is one line saying how to mend it."""
    path = current_path()
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} cannot be read ({unreadable_reason(exc)}): remove it and pass --stack NAME") from None
    if not name:
        return None
    try:
        return check_stack_name(name, origin=f"stack name in {path}")
    except UsageError as exc:
        raise UsageError(f"{exc}; remove {path} and pass --stack NAME") from None


def set_current_stack(stack: str) -> None:
    write_atomic(current_path(), stack + "\n")


def clear_current_stack(stack: str) -> None:
    """Forget `stack` as the current one, leaving another stack's claim alone."""
    try:
        if current_stack() == stack:
            current_path().unlink(missing_ok=True)
    except UsageError:
        pass  # a damaged `current` names no stack; leave it for the user, who was told about it
    remove_stale_tmp_files(state_root())


@overload
def resolve_stack(flag: str | None, default: str) -> str: ...
@overload
def resolve_stack(flag: str | None, default: None = None) -> str | None: ...
def resolve_stack(flag: str | None, default: str | None = None) -> str | None:
    """`--stack`, else `$CLUSTER_STACK`, else `.cluster/current`, else `default`.

    A flag that was given is checked even when empty (`--stack ''` is a bad name, not "no stack");
    an empty `$CLUSTER_STACK` counts as unset, as shells treat `export CLUSTER_STACK=`.
    """
    if flag is not None:
        return check_stack_name(flag)
    from_env = os.environ.get("CLUSTER_STACK")
    if from_env:
        return check_stack_name(from_env, origin="$CLUSTER_STACK")
    name = current_stack() or default
    return check_stack_name(name) if name else None


LOCKS = ".locks"
"""`.cluster/.locks/<name>.lock`: held (flock) by the command that changes a stack, with who holds it."""


@contextmanager
def stack_lock(name: str, what: str, say=None, wait: bool = True) -> Iterator[None]:
    """Hold the lock `name` (e.g. a stack's name) while `what` runs. Another command holding it is waited
    for, saying so once through `say` (so two `up`s of one stack run one after the other), or with
    `wait=False` refused in one line naming it. The kernel releases the lock when its holder dies."""
    path = make_private_dir(state_root() / LOCKS) / f"{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another command"
            if not wait:
                raise UsageError(f"{holder} is under way: wait for it to end, then run this again") from None
            if say:
                say(f"waiting for {holder} to end ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_holder(name: str) -> str | None:
    """Who holds the lock `name` now (what `stack_lock` was told, e.g. "down of stack 'dev' (pid ...)"); None
    where nobody does."""
    path = state_root() / LOCKS / f"{name}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another command"
    finally:
        os.close(fd)


def down_holder(stack: str) -> str:
    """What `deploy.py down` tells the stack's lock it is (`taken_down` looks for it)."""
    return f"down of stack '{stack}'"


def taken_down(stack: str, waiting: str) -> bool:
    """Whether `deploy.py down` takes or took the stack down: its down holds the stack's lock (waited for, as
    `waiting`, so that what it records is written), or the stack has no inventory left."""
    if (lock_holder(stack) or "").startswith(down_holder(stack)):
        with stack_lock(stack, waiting):
            pass
    return not stack_file(stack, INVENTORY).exists()


def write_atomic(path: Path, text: str, mode: int = PRIVATE_FILE_MODE) -> None:
    """Write `text` so that a reader sees the old file or the new one, never half of one (0600 unless asked)."""
    make_private_dir(path.parent)
    remove_stale_tmp_files(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:  # a full disk: the old file (or none) stays, and no temporary file is left
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_tmp_files(folder: Path) -> list[Path]:
    """Remove write_atomic's temporary files whose writer is gone (a command killed mid-write)."""
    removed: list[Path] = []
    try:
        candidates = list(folder.glob(".*.tmp"))
    except OSError:
        return removed
    for path in candidates:
        match = TMP_FILE.fullmatch(path.name)
        if match and not _pid_alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def unreadable_reason(exc: BaseException) -> str:
    """Why a file could not be read, in a few words."""
    if isinstance(exc, IsADirectoryError):
        return "it is a folder"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc) or type(exc).__name__


def read_text(path: Path, what: str) -> str:
    """A user-editable file's text, or one line saying what is wrong with it (not a file, not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {path} cannot be read: {unreadable_reason(exc)}") from None
