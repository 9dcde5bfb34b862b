"""Every call from the operator to a node, typed: each verb's request and reply, defined once here, one
dispatcher that runs on the node, and one error rule.

    python node/calls.py REQUEST        # REQUEST: base64 of {"verb", "version", "args"}; prints the reply
    python node/calls.py -              # the same, the request on stdin (one that carries a secret)

The operator side (remote/nodecall.py, the local supervisor) builds the command with `command_words` and
reads the answer with `reply_from`: one line of JSON on stdout, exit 0. The one error rule: `error: <one
line>` on stderr, exit 2 where the request is bad (an unknown verb, arguments that do not fit, bad input
the work refused, or other node code than the caller speaks: run fab bootstrap), exit 1 where the work
failed. A request carrying a secret (a Slurm run's spec holds --env values) goes on stdin, not argv.

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import base64
import dataclasses
import hashlib
import importlib
import json
import os
import sys
import typing

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

HERE = os.path.dirname(os.path.abspath(__file__))
BAD_INPUT_EXIT, FAILED_EXIT = 2, 1


class BadInput(Exception):
    """The request cannot be done as asked (exit 2)."""


class Failed(Exception):
    """The work was tried and failed (exit 1)."""


class CallError(Exception):
    """What the operator side raises for an answer that is not a reply: the node's one line and exit code."""

    def __init__(self, verb: str, exit_code: int, line: str):
        super().__init__(line)
        self.verb, self.exit_code, self.line = verb, exit_code, line

    @property
    def bad_input(self) -> bool:
        return self.exit_code == BAD_INPUT_EXIT


# ------------------------------------------------------------------------------------------ the verbs


@dataclasses.dataclass(frozen=True)
class Request:
    """A verb's request; `HANDLER` ("module:function") does it on the node with the fields as keyword
    arguments and returns the fields of `REPLY`."""

    HANDLER: typing.ClassVar[str] = ""
    REPLY: typing.ClassVar[type] = dict
    SECRET: typing.ClassVar[bool] = False
    """It carries a secret: sent on stdin, never on the command line."""


@dataclasses.dataclass(frozen=True)
class Files:
    """{path: sha256} of a workdir cache's files."""

    files: dict


@dataclasses.dataclass(frozen=True)
class WorkdirManifest(Request):
    """The manifest of a workdir cache (`~/.gpu-cluster/workdirs/<key>`)."""

    cache: str
    HANDLER: typing.ClassVar[str] = "sync:manifest_reply"
    REPLY: typing.ClassVar[type] = Files


@dataclasses.dataclass(frozen=True)
class Applied:
    sent: int
    removed: int


@dataclasses.dataclass(frozen=True)
class ApplyBundle(Request):
    """Apply a bundle of changed files that fab sent to a workdir cache."""

    cache: str
    bundle_path: str
    HANDLER: typing.ClassVar[str] = "sync:apply"
    REPLY: typing.ClassVar[type] = Applied


@dataclasses.dataclass(frozen=True)
class ResultFiles:
    files: list
    """[{"remote", "name", "size"}] of what a launch fetches back."""


@dataclasses.dataclass(frozen=True)
class ListResults(Request):
    """What a run leaves to fetch: its results folder and its metrics."""

    run_dir: str
    results_dir: str
    HANDLER: typing.ClassVar[str] = "sync:results_reply"
    REPLY: typing.ClassVar[type] = ResultFiles


@dataclasses.dataclass(frozen=True)
class Cleaned:
    removed: int
    runs: int
    freed_bytes: int


@dataclasses.dataclass(frozen=True)
class CleanRuns(Request):
    """Remove the node-local copies (or `names`) of all but the newest `keep` runs."""

    runs: str
    keep: int
    names: list = dataclasses.field(default_factory=list)
    """Which folders of an old run go (none: its node-local copies, contract.RUN_COPIES)."""
    HANDLER: typing.ClassVar[str] = "sync:clean_reply"
    REPLY: typing.ClassVar[type] = Cleaned


@dataclasses.dataclass(frozen=True)
class Submitted:
    job_id: str


@dataclasses.dataclass(frozen=True)
class SubmitRun(Request):
    """sbatch a run from its spec (sent on stdin: its commands carry --env values)."""

    spec: dict
    SECRET: typing.ClassVar[bool] = True
    HANDLER: typing.ClassVar[str] = "slurm_run:submit_reply"
    REPLY: typing.ClassVar[type] = Submitted


@dataclasses.dataclass(frozen=True)
class JobStates:
    states: dict
    """{job id: what Slurm knows of it (slurm_run.shown_state), or None}."""


@dataclasses.dataclass(frozen=True)
class RunStates(Request):
    """The state of Slurm jobs, each with its run's log on the head node (its end record lies beside it)."""

    logs: dict
    """{job id: log}"""
    HANDLER: typing.ClassVar[str] = "slurm_run:states"
    REPLY: typing.ClassVar[type] = JobStates


@dataclasses.dataclass(frozen=True)
class Cancelled:
    before: dict | None
    """What Slurm knew of the job before (None: nothing)."""
    cancelled: list = dataclasses.field(default_factory=list)
    """Every run's job cancelled: [{run_id, job_id, state it had}]."""
    unanswered: str = ""
    """Why Slurm's controller could not be asked (nothing was cancelled); '' where it answered."""


@dataclasses.dataclass(frozen=True)
class CancelRun(Request):
    """scancel a run's job; where `job_id` is '', every run's of the stack, queued or running (`fab stop`)."""

    job_id: str
    HANDLER: typing.ClassVar[str] = "slurm_cancel:cancel"
    REPLY: typing.ClassVar[type] = Cancelled


@dataclasses.dataclass(frozen=True)
class KitApplied:
    facts: dict
    """{part: what applying it found or did}"""


@dataclasses.dataclass(frozen=True)
class ApplyKit(Request):
    """Apply parts of a node's kit (node/kit.py: deps, env, scheduler) from a file fab sent (0600: the
    scheduler's description holds the munge key; removed once read)."""

    kit_file: str
    parts: list
    HANDLER: typing.ClassVar[str] = "kit:apply_file"
    REPLY: typing.ClassVar[type] = KitApplied


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    facts: dict
    """node/probe.py's facts: OS, CPUs, memory, Python, GPUs, home, the interface that reaches MASTER_ADDR."""


@dataclasses.dataclass(frozen=True)
class ProbeNode(Request):
    """What a node is, for bootstrap's probe stage (run by the inventory's interpreter: no venv yet)."""

    master_addr: str
    HANDLER: typing.ClassVar[str] = "probe:probe_reply"
    REPLY: typing.ClassVar[type] = NodeFacts


@dataclasses.dataclass(frozen=True)
class RequirementsEnv:
    ok: bool
    installed: bool = False
    """The installer ran (False: the environment was ready)."""
    python: str = ""
    error: str = ""
    """The installer's own summary of what went wrong, where it failed."""
    seconds: float = 0.0
    installer: str = ""
    """`uv`, or `pip` where uv could not run (node/uv_env.py)."""
    installer_why: str = ""
    """Why not uv, where pip installed it."""


@dataclasses.dataclass(frozen=True)
class InstallRequirements(Request):
    """A run's `--requirements` environment (node/job_env.py), made where it is not ready; paths from home,
    `cwd` the synced workdir (the file's relative paths are the project's) or empty."""

    dest: str
    requirements: str
    log: str
    cwd: str = ""
    HANDLER: typing.ClassVar[str] = "job_env:ensure_reply"
    REPLY: typing.ClassVar[type] = RequirementsEnv


@dataclasses.dataclass(frozen=True)
class Said:
    said: str
    """What was done, in a few words (for a log line)."""


@dataclasses.dataclass(frozen=True)
class CheckScheduler(Request):
    """BadInput naming the first of Slurm's or munge's programs this node lacks (`head`: slurmctld too), or
    a Slurm of the host's own to adopt instead."""

    head: bool = False
    HANDLER: typing.ClassVar[str] = "scheduler:check_reply"
    REPLY: typing.ClassVar[type] = Said


@dataclasses.dataclass(frozen=True)
class Identified:
    name: str
    state: str


@dataclasses.dataclass(frozen=True)
class IdentifyNode(Request):
    """This host's node in a Slurm it already runs (`slurm: existing`)."""

    partition: str
    conf: str
    name: str
    addresses: list
    HANDLER: typing.ClassVar[str] = "slurm_existing:identify"
    REPLY: typing.ClassVar[type] = Identified


@dataclasses.dataclass(frozen=True)
class Adopted:
    partition: str
    conf: str
    tag: str
    names: dict


@dataclasses.dataclass(frozen=True)
class AdoptSlurm(Request):
    """Runs go to a Slurm the hosts already run: {partition, conf, tag, names: {node-i: NodeName}}."""

    existing: dict
    HANDLER: typing.ClassVar[str] = "scheduler:adopt_reply"
    REPLY: typing.ClassVar[type] = Adopted


@dataclasses.dataclass(frozen=True)
class StopScheduler(Request):
    """This node's daemons stopped (an existing Slurm: this stack's jobs there cancelled, its record gone)."""

    HANDLER: typing.ClassVar[str] = "scheduler:stop_reply"
    REPLY: typing.ClassVar[type] = Said


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    node: str | None
    configured: bool
    existing: bool
    daemons: dict
    node_state: str | None
    nodes: dict | None


@dataclasses.dataclass(frozen=True)
class AskScheduler(Request):
    """This node's scheduler: configured or not, its daemons, Slurm's node states."""

    node: str
    HANDLER: typing.ClassVar[str] = "scheduler:state_reply"
    REPLY: typing.ClassVar[type] = SchedulerState


@dataclasses.dataclass(frozen=True)
class MarkLost(Request):
    """Tell Slurm (on the head node) that a node is gone: its run is requeued."""

    node: str
    why: str
    HANDLER: typing.ClassVar[str] = "scheduler:lost_reply"
    REPLY: typing.ClassVar[type] = Said


@dataclasses.dataclass(frozen=True)
class ForgetStaleJobs(Request):
    """A node replaced while the head node was: the jobs Slurm still has on its old machine are requeued."""

    node: str
    HANDLER: typing.ClassVar[str] = "scheduler:replaced_reply"
    REPLY: typing.ClassVar[type] = Said


@dataclasses.dataclass(frozen=True)
class Joined:
    node: str
    took_s: float
    venv: dict
    scheduler: str
    slurm: str


@dataclasses.dataclass(frozen=True)
class JoinCluster(Request):
    """A fresh node joins from the shared folder's kit alone (node/join.py)."""

    node: str
    HANDLER: typing.ClassVar[str] = "join:join_reply"
    REPLY: typing.ClassVar[type] = Joined


@dataclasses.dataclass(frozen=True)
class Progress:
    now: float
    ranks: list
    """Each of the run's ranks on this node: its collective progress and process state (node/hang.py)."""


@dataclasses.dataclass(frozen=True)
class HangStatus(Request):
    """The hang watch's look at a run's ranks on this node (their progress folder, relative to the home)."""

    folder: str
    run_id: str
    HANDLER: typing.ClassVar[str] = "hang:status_reply"
    REPLY: typing.ClassVar[type] = Progress


@dataclasses.dataclass(frozen=True)
class Evidence:
    now: float
    ranks: list
    dumps: dict
    """Each rank's flight-recorder buffer, by rank."""
    py_spy: dict
    """Each rank's stacks as py-spy saw them, by rank."""


@dataclasses.dataclass(frozen=True)
class HangCollect(Request):
    """A hung run's evidence on this node: the ranks' recorder dumps (asked for, waited for) and stacks."""

    folder: str
    run_id: str
    wait_s: float
    HANDLER: typing.ClassVar[str] = "hang:collect_reply"
    REPLY: typing.ClassVar[type] = Evidence


VERBS = {verb.__name__: verb for verb in Request.__subclasses__()}
"""Every verb, by its name: each Request subclass above."""


# --------------------------------------------------------------------------------------- the version


def code_version(folder: str = HERE) -> str:
    """The digest of the node code in `folder` (every .py under it): what the caller and the node must share."""
    hasher = hashlib.sha256()
    for top, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(top, name)
            hasher.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as f:
                hasher.update(f.read() + b"\0")
    return hasher.hexdigest()[:16]


# ------------------------------------------------------------------------------------ the caller's side


def encoded(request: Request, version: str) -> str:
    """`request` as the node reads it."""
    message = {"verb": type(request).__name__, "version": version, "args": dataclasses.asdict(request)}
    return base64.b64encode(json.dumps(message).encode()).decode()


def command_words(request: Request, version: str) -> list:
    """The words after `python node/calls.py` for `request`, on the command line (`-` instead, with the
    request on stdin, for one that carries a secret)."""
    return [encoded(request, version)]


def reply_from(request: Request, exit_code: int, stdout: str, stderr: str):
    """The reply to `request` from what the node printed; CallError with the node's one line otherwise."""
    verb = type(request).__name__
    if exit_code == 0:
        for line in reversed(stdout.strip().splitlines()):
            try:
                return type(request).REPLY(**json.loads(line))
            except (ValueError, TypeError):
                continue
        exit_code = FAILED_EXIT
    lines = [line.strip() for line in (stderr.strip() or stdout.strip()).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    line = (errors or lines or [f"exit {exit_code}, no answer"])[-1]
    return_code = exit_code if exit_code in (BAD_INPUT_EXIT, FAILED_EXIT) else FAILED_EXIT
    raise CallError(verb, return_code, line.removeprefix("error: "))


# -------------------------------------------------------------------------------------- the node's side


def dispatch(encoded: str, version: str) -> dict:
    """Do the request; its reply's fields. BadInput where the request does not fit."""
    try:
        message = json.loads(base64.b64decode(encoded))
        verb, asked, args = message["verb"], message["version"], dict(message["args"])
    except (ValueError, KeyError, TypeError):
        raise BadInput("the request is not one fab sends: run fab bootstrap") from None
    if asked != version:
        raise BadInput(f"this node runs other node code ({version}) than fab speaks ({asked}): run fab bootstrap")
    kind = VERBS.get(verb)
    if kind is None:
        raise BadInput(f"no verb {verb!r} on this node: run fab bootstrap")
    try:
        request = kind(**args)
    except TypeError as exc:
        raise BadInput(f"{verb}: {exc}") from None
    module, function = kind.HANDLER.split(":")
    handler = getattr(importlib.import_module(f"node.{module}"), function)
    result = handler(**dataclasses.asdict(request))
    reply = kind.REPLY(**result) if isinstance(result, dict) else result
    return dataclasses.asdict(reply)


def main(argv: list) -> int:
    if len(argv) != 1:
        print("error: usage: calls.py REQUEST|- (fab sends it)", file=sys.stderr)
        return BAD_INPUT_EXIT
    try:
        request = sys.stdin.read().strip() if argv[0] == "-" else argv[0]  # `-`: a request with a secret
        print(json.dumps(dispatch(request, code_version())), flush=True)
    except BadInput as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return BAD_INPUT_EXIT
    except Exception as exc:  # the one rule: whatever failed is one line, exit 1
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return FAILED_EXIT
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]


if __name__ == "__main__":
    # The handlers raise `node.calls.BadInput` (slurm_conf.UsageError, ...): run as this module, not as
    # __main__, a class of its own that would take their refusals (exit 2) for failures (exit 1).
    from node import calls

    sys.exit(calls.main(sys.argv[1:]))
