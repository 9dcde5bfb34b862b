"""The small request/reply exchanges with a node besides the job itself: the job lock, the job status
and what a launch asks first, stop, file hashes, and a Python program that prints JSON. Each is a
command builder and the parser of its reply; nothing here talks to a node."""

import json
import shlex

from infra.errors import OperationError
from node import contract, standalone
from remote.node_paths import ENV_FILE, JOB_FILE, LOCK_FILE, shell_path

TERMINATE_GRACE_S = 5


def lock_command(run_id: str, task: str, owner: str) -> str:
    """Take the one-job lock on this (head) node and hold it while the channel stays open
    (node/job_lock.py); CLUSTER_RUN_ID marks the holder as part of the job for `stop`."""
    holder = " ".join(shlex.quote(a) for a in (run_id, task, owner))
    return (
        f'. {ENV_FILE} && exec env {contract.RUN_ID_VARIABLE}={shlex.quote(run_id)} "$CLUSTER_PYTHON" '
        f'"$CLUSTER_CODE_DIR"/node/job_lock.py {LOCK_FILE} {holder}'
    )


def stopped_before_start(run_id: str, head: str, what: str) -> OperationError:
    """A launch whose job lock's holder was ended (`fab stop` or `down` at that moment) before its run was
    `what` (it started, it was submitted): nothing of it runs."""
    return OperationError(
        f"run {run_id} was stopped before {what}: its job lock on {head} was ended (a fab stop or down "
        "at that moment); nothing runs"
    )


def parse_lock_reply(line: str) -> tuple[str, dict | None]:
    """`locked`, `waiting` with the holder's {run_id, task, owner, since}, or `failed` (the line is the
    reason)."""
    parts = line.split()
    if parts == ["locked"]:
        return "locked", None
    if len(parts) == 5 and parts[0] == "waiting":
        return "waiting", dict(zip(("run_id", "task", "owner", "since"), parts[1:], strict=True))
    return "failed", None


# A process is alive if /proc says so and it is not a zombie (where /proc exists), else if kill -0 works.
_ALIVE = (
    "alive() { if [ -r /proc/$1/stat ]; then ! grep -q ') Z ' /proc/$1/stat; else kill -0 \"$1\" 2>/dev/null; fi; }"
)


def job_status_command() -> str:
    """Prints `running PID RUN_ID TASK`, `idle`, plus `bootstrapped` when the env file exists."""
    return (
        f"{_ALIVE}; "
        f'if [ -f {JOB_FILE} ] && read -r pid run task < {JOB_FILE} && alive "$pid"; '
        'then echo "running $pid $run $task"; else echo idle; fi; '
        f"[ -f {ENV_FILE} ] && echo bootstrapped || true"
    )


def launch_status_command(workdir_key: str | None = None, env_digest: str | None = None) -> str:
    """`job_status_command`, plus what the launch would otherwise ask in round trips of its own: the
    digest of the node's workdir cache (`workdir DIGEST`) and the interpreter a requirements
    environment was made over (`env PYTHON`), each an empty word where there is none."""
    parts = [job_status_command()]
    if workdir_key:
        digest = contract.shell(f"{contract.workdir_cache(workdir_key)}/{contract.WORKDIR_DIGEST}")
        parts.append(f"printf 'workdir %s\\n' \"$(cat {digest} 2>/dev/null)\"")
    if env_digest:
        marker = contract.shell(f"{contract.job_env(env_digest)}/{contract.ENV_READY}")
        parts.append(f"printf 'env %s\\n' \"$(cat {marker} 2>/dev/null)\"")
    return "; ".join(parts)


def parse_tagged(output: str, tag: str) -> str | None:
    """The value of a `TAG value` line of `launch_status_command`'s output ('' for an empty one)."""
    for line in output.splitlines():
        if line == tag or line.startswith(tag + " "):
            return line[len(tag) :].strip()
    return None


def parse_job_status(output: str) -> tuple[dict | None, bool]:
    """(the running job as {pid, run_id, task} or None, whether the node is bootstrapped)."""
    job = None
    lines = output.split("\n")
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "running":
            job = {"pid": int(parts[1]), "run_id": parts[2], "task": parts[3]}
    return job, "bootstrapped" in (line.strip() for line in lines)


def stop_command(grace_s: int = TERMINATE_GRACE_S, run_id: str = "", leave_slurm: bool = False) -> str:
    """End every job on the node (`run_id`: that run's only; `leave_slurm`: none of Slurm's jobs;
    node/stop_jobs.py): SIGTERM, SIGKILL after `grace_s`. Prints `stopped RUN_ID...` or `idle`."""
    source = standalone.source("stop_jobs")
    only = (f" {shlex.quote(run_id)}" if run_id else "") + (" --leave-slurm" if leave_slurm else "")
    return (
        f'. {ENV_FILE} 2>/dev/null; "${{CLUSTER_PYTHON:-python3}}" -c {shlex.quote(source)} {JOB_FILE} {grace_s}{only}'
    )


def hash_files_command(folder: str, tops: tuple[str, ...]) -> str:
    """sha256 of every file under `folder`/TOP (caches aside) as `HASH  TOP/PATH` lines; coreutils only,
    so it runs before the node has any Python we trust. An absent folder lists nothing."""
    names = " ".join(shlex.quote(top) for top in tops)
    return (
        f"cd {shell_path(folder)} 2>/dev/null || exit 0; "
        "if command -v sha256sum >/dev/null; then h=sha256sum; else h='shasum -a 256'; fi; "
        f"find {names} -type f ! -path '*/__pycache__/*' -exec $h {{}} + 2>/dev/null; true"
    )


def parse_hashes(output: str) -> dict[str, str]:
    """`HASH  PATH` lines into {PATH: HASH}."""
    found = {}
    for line in output.splitlines():
        parts = line.split(maxsplit=1)
        if len(parts) == 2 and len(parts[0]) == 64:
            found[parts[1].strip().removeprefix("./")] = parts[0]
    return found


def with_stale_code_hint(line: str) -> str:
    """A node's error line, with what to do where a file of node/ was missing there."""
    if "can't open file" in line and "/node/" in line:
        return f"{line} (the nodes' code predates this checkout: run fab bootstrap)"
    return line


def python_json_command(python: str, code: str, *args: str) -> str:
    """Run a short Python program on the node and have it print JSON."""
    return " ".join([shlex.quote(python), "-c", shlex.quote(code), *map(shlex.quote, args)])


def parse_last_json(output: str) -> dict:
    """The last line of `output` that is a JSON object (programs may print warnings first)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"no JSON in output: {output.strip()[-200:]!r}")
