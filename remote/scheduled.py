"""Runs held by Slurm on the cluster (`fab bootstrap --scheduler slurm`): submit, follow, list, cancel, fetch.

A launch prepares the nodes as an attached one does (workdir, requirements, script, each node's copy of
the workdir made now, so a later sync cannot change a queued run), stages the project and the requirements
file once on the shared folder (a replaced node's job makes its own copy and environment from there), then
submits one batch job (node/slurm_run.py) whose step runs the same `launch_command` on every node. From then on the run
belongs to the cluster: fab follows its log on the head node (`slurm_run.py follow`), and a closed
connection, a SIGHUP or a killed fab only stops the following. Ctrl-C cancels (an explicit choice).

Each run has a record in its local run folder (`run.json`): the Slurm job, the log on the head node,
the state as last seen. Every command that talks to the cluster refreshes the records of runs not yet
ended, and the first to see a run end finishes it: results and metrics fetched, `summary.json`
written, the ledger row given Slurm's own start and end times, so a run that ended while nothing was
connected is priced.
"""

import io
import json
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from infra import state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from node import billing, contract
from remote import job_command, node_paths, protocol
from remote.connect import CONNECTION_ERRORS, NodeSession, describe
from remote.stream import say

RECORD = "run.json"
"""A scheduled run's record in its local run folder."""
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "HUNG", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
"""States after which the run runs no more (Slurm's, plus HUNG: the hang watch stopped it). PREEMPTED is
not one: a run a spot notice ended waits in the queue, and starts again once every node is in service."""
NODE_LINE = re.compile(r"^\[(node-\d+)(?: rank \d+)?\] ?")
CANCEL_WAIT_S = 30


@dataclass
class Run:
    """What this machine knows of one scheduled run (`run.json`)."""

    run_id: str
    task: str
    job_id: str
    log: str
    """The run's log on the head node (absolute)."""
    nodes: list[str]
    submitted_at: float
    state: str = "PENDING"
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    requeues: int = 0
    exit_codes: dict = field(default_factory=dict)
    """Each node's own exit code, from its exit marker in the log."""
    finished: bool = False
    """Results fetched, summary written, ledger closed."""
    hang: dict | None = None
    """The hang watch's verdict, where it stopped the run."""
    spec: dict = field(default_factory=dict)
    """What the summary needs of the launch (script, args, workdir, requirements, env names, result cap)."""
    waiting_for: str | None = None
    """While it waits: the nodes out of service it needs (a notice, a lost node, a replacement that failed)."""

    @property
    def ended(self) -> bool:
        return self.state in FINAL

    def save(self, folder: Path) -> None:
        state.write_atomic(folder / RECORD, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "Run | None":
        try:
            data = json.loads((folder / RECORD).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def as_row(self, hourly_usd: float) -> dict:
        """`fab jobs --json`'s object: the issue's keys, then `waiting_for` (null unless it waits for nodes
        out of service: a notice, a lost node, a replacement that failed to join)."""
        return {
            "run_id": self.run_id,
            "task": self.task,
            "state": self.state,
            "nodes": self.nodes,
            "submitted_at": _iso(self.submitted_at),
            "started_at": _iso(self.started_at),
            "ended_at": _iso(self.ended_at),
            "exit_code": self.exit_code,
            "requeues": self.requeues,
            "cost_usd": round(self.cost_usd(hourly_usd), 6),
            "waiting_for": None if self.ended else self.waiting_for,
        }

    def cost_usd(self, hourly_usd: float) -> float:
        if self.started_at is None:
            return 0.0
        return billing.cost_usd(hourly_usd, max(0.0, (self.ended_at or time.time()) - self.started_at))


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------- submit


def head_path(setup, cluster: ClusterInfo, path: str) -> str:
    """A node path (`$HOME/...` or absolute) as an absolute path on the head node."""
    home = setup.homes.get(cluster.head.name)
    if path.startswith("$HOME/"):
        if not home:
            raise UsageError("bootstrap.json lacks the head node's home: run fab bootstrap")
        return f"{home}/{path[len('$HOME/') :]}"
    return path


def submit(
    cluster: ClusterInfo,
    head: NodeSession,
    setup,
    run_id: str,
    task: str,
    commands: dict[str, str],
    watch: dict | None = None,
) -> str:
    """sbatch the run (one task per node, each running its command; `watch`: the hang watch that runs
    beside it on the head node); the Slurm job id."""
    run_dir = head_path(setup, cluster, node_paths.remote_run_dir(cluster, run_id))
    spec: dict = {
        "run_id": run_id,
        "log": f"{run_dir}/{contract.RUN_LOG}",
        "python": cluster.python,
        "nodes": [
            {"name": node.name, "home": setup.homes.get(node.name, ""), "command": commands[node.name]}
            for node in cluster.nodes
        ],
    }
    if watch:
        spec["watch"] = watch
    spec_path = f"{run_dir}/slurm-spec.json"
    head.run(f"mkdir -p {node_paths.shell_path(run_dir)}", warn=False)
    head.conn.put(_text_file(json.dumps(spec)), remote=spec_path)
    command = node_paths.node_module(cluster, cluster.python, "slurm_run", "submit", spec_path)
    result = head.run(f"cd && chmod 600 {node_paths.shell_path(spec_path)} && {command}")
    if result.exited != 0:
        lines = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise OperationError(f"the run could not be submitted to Slurm: {lines[-1] if lines else result.exited}")
    return result.stdout.strip().splitlines()[-1]


def _text_file(text: str):
    return io.StringIO(text)


# ------------------------------------------------------------------------------------------- follow


class LogSplitter:
    """The run's log as it arrives: each `[node-i] ` piece into that node's local log and onto the
    terminal (a piece ends at a newline or a carriage return, so progress bars stay live), the exit
    markers kept apart, and the end marker's state and exit code noted."""

    def __init__(self, local_dir: Path, echo: bool = True):
        self.local_dir, self.echo = local_dir, echo
        self.partial = ""
        self.logs: dict[str, object] = {}
        self.exit_codes: dict[str, int] = {}
        self.ranks: dict[str, str] = {}
        """Each node's ranks line (`contract.RANKS_MARKER`'s JSON: the failed ranks' own codes)."""
        self.end: tuple[str, int | None] | None = None
        self.tail: dict[str, list[str]] = {}

    def write(self, text: str) -> int:
        self.partial += text
        pieces = re.split(r"(?<=[\r\n])", self.partial)
        self.partial = pieces.pop() if pieces and not pieces[-1].endswith(("\r", "\n")) else ""
        for piece in pieces:
            if piece:
                self._piece(piece)
        return len(text)

    def _piece(self, piece: str) -> None:
        line = piece.rstrip("\r\n")
        if line.startswith(contract.RUN_END_MARKER):
            words = line.split()
            code = words[2] if len(words) > 2 else "-"
            self.end = (words[1] if len(words) > 1 else "UNKNOWN", int(code) if code.lstrip("-").isdigit() else None)
            return
        match = NODE_LINE.match(line)
        node = match.group(1) if match else None
        payload = piece[match.end() :] if match else piece
        if node and payload.startswith(contract.MARKER_START):  # the launch's markers: kept, never shown
            marker = job_command.parse_exit_marker(payload.strip())
            if marker is not None:
                self.exit_codes[node] = marker[0]
            elif payload.startswith(contract.RANKS_MARKER):
                self.ranks[node] = payload[len(contract.RANKS_MARKER) :].strip()
            return
        if node:
            log = self.logs.get(node)
            if log is None:
                log = self.logs[node] = state.open_private(self.local_dir / f"{node}.log", "w", buffering=1)
            log.write(piece if piece.endswith("\n") else piece.rstrip("\r") + "\n")  # type: ignore[attr-defined]
            self.tail[node] = (self.tail.get(node, []) + [payload.rstrip()])[-40:]
        if self.echo:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.partial:
            self._piece(self.partial + "\n")
            self.partial = ""
        for log in self.logs.values():
            log.close()  # type: ignore[attr-defined]
        self.logs = {}


@dataclass
class Followed:
    """How following a run ended."""

    end: tuple[str, int | None] | None
    """(Slurm's state, the job's exit code) when the run ended while followed; None otherwise."""
    exit_codes: dict[str, int]
    detached: str = ""
    """Why following stopped before the end (a dropped connection, SIGHUP); '' when it did not."""
    interrupted: bool = False
    """Ctrl-C: the run was cancelled (or, `detached` too, only the following stopped)."""


def follow(
    cluster: ClusterInfo, run: Run, local_dir: Path, stop_hang=None, echo: bool = True, cancel_on_interrupt=True
) -> Followed:
    """Show the run's log from its start until it ends. Ctrl-C (or SIGTERM) cancels the run and follows
    it to its end, or with `cancel_on_interrupt` False (`fab logs -f`) only stops the following, as
    SIGHUP or a lost connection do."""
    local_dir.mkdir(parents=True, exist_ok=True)
    splitter = LogSplitter(local_dir, echo)
    head = NodeSession(cluster, cluster.head)
    command = node_paths.node_module(cluster, cluster.python, "slurm_run", "follow", run.log, run.job_id)
    outcome: dict = {}

    def reader() -> None:
        try:
            head.run(f"cd && {command}", out_stream=splitter, err_stream=splitter, hide=False, pty=False)
        except CONNECTION_ERRORS as exc:
            outcome["lost"] = describe(exc)
        except Exception as exc:  # whatever ended the connection: the run goes on
            outcome["lost"] = describe(exc)

    hangup = threading.Event()
    handlers = _signals(hangup)
    thread = threading.Thread(target=reader, name=f"follow-{run.run_id}", daemon=True)
    thread.start()
    interrupted = False
    try:
        while thread.is_alive() and not hangup.is_set():
            thread.join(timeout=0.2)
    except KeyboardInterrupt:
        interrupted = True
        if cancel_on_interrupt:
            say(f"fab: interrupted: cancelling run {run.run_id}")
            try:
                cancel(cluster, run)
            except (UsageError, OperationError) as exc:
                say(f"fab: {exc}")
            thread.join(timeout=CANCEL_WAIT_S)
    finally:
        _restore(handlers)
        head.close()
        splitter.close()
    if interrupted and not cancel_on_interrupt:
        return Followed(None, splitter.exit_codes, detached="Ctrl-C", interrupted=True)
    if hangup.is_set() and not splitter.end:
        return Followed(None, splitter.exit_codes, detached="the terminal hung up (SIGHUP)")
    if splitter.end is None and not interrupted:
        return Followed(None, splitter.exit_codes, detached=outcome.get("lost", "the connection ended"))
    return Followed(splitter.end, splitter.exit_codes, interrupted=interrupted)


def _signals(hangup: threading.Event) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    handlers[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: hangup.set())
    return handlers


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


# ------------------------------------------------------------------------------------ states, cancel


def refresh(cluster: ClusterInfo, runs: list[Run]) -> None:
    """Ask Slurm (on the head node) for the runs not yet ended; their records are updated in place."""
    pending = [r for r in runs if not r.ended]
    if not pending:
        return
    head = NodeSession(cluster, cluster.head)
    try:
        asked = [f"{r.job_id}={r.log}" for r in pending]  # the log: the run's end record lies beside it
        command = node_paths.node_module(cluster, cluster.python, "slurm_run", "states", *asked)
        result = head.run(f"cd && {command}")
    except CONNECTION_ERRORS as exc:
        raise OperationError(f"{cluster.head.name} does not answer: {describe(exc)}") from None
    finally:
        head.close()
    try:
        found = protocol.parse_last_json(result.stdout)
    except ValueError:
        raise OperationError(
            f"could not read the runs' states on {cluster.head.name}: {result.stderr.strip()[-200:]}"
        ) from None
    for run in pending:
        known = found.get(run.job_id)
        if known is None:
            continue
        run.state = known.get("state") or run.state
        run.started_at = run.started_at or known.get("started_at")  # the first start: a requeue costs the wait too
        run.ended_at = known.get("ended_at") if run.state in FINAL else None
        run.exit_code = known.get("exit_code") if run.state in FINAL else None
        run.requeues = int(known.get("requeues") or 0)
        run.waiting_for = known.get("waiting_for")


def cancel(cluster: ClusterInfo, run: Run) -> dict | None:
    """scancel the run's job; what Slurm knew of it before (None: nothing)."""
    head = NodeSession(cluster, cluster.head)
    try:
        command = node_paths.node_module(cluster, cluster.python, "slurm_run", "cancel", run.job_id)
        result = head.run(f"cd && {command}")
    except CONNECTION_ERRORS as exc:
        raise OperationError(f"{cluster.head.name} does not answer: {describe(exc)}") from None
    finally:
        head.close()
    if result.exited != 0:
        raise OperationError(f"could not cancel run {run.run_id}: {result.stderr.strip()[-200:]}")
    return protocol.parse_last_json(result.stdout).get("before")


# -------------------------------------------------------------------------------------------- runs


def runs_of(runs_root: Path) -> list[tuple[Path, Run]]:
    """Every scheduled run of the stack with a record here, oldest first."""
    found = []
    if runs_root.is_dir():
        for folder in sorted(runs_root.iterdir()):
            run = Run.load(folder) if folder.is_dir() else None
            if run is not None:
                found.append((folder, run))
    return sorted(found, key=lambda pair: pair[1].submitted_at)


def find(runs_root: Path, run_id: str | None) -> tuple[Path, Run]:
    """The run `--run ID` names (the newest without it); one line, exit 2, when there is none."""
    runs = runs_of(runs_root)
    if run_id is None:
        if not runs:
            raise UsageError("no run held by the scheduler yet: fab run ... (or any launch task)")
        return runs[-1]
    for folder, run in runs:
        if run.run_id == run_id:
            return folder, run
    known = ", ".join(run.run_id for _, run in runs[-3:]) or "none"
    raise UsageError(f"no run {run_id!r} on this stack (latest: {known}); fab jobs lists them")


# ------------------------------------------------------------------------------------- a launch


def launch(cluster: ClusterInfo, spec, setup, runs_root: Path, detach: bool) -> tuple[Path, Run, Followed | None]:
    """Prepare, submit and (unless `detach`) follow one run; the run's local folder, its record, and how
    following ended (None when detached at once)."""
    from infra.ledger import Ledger
    from remote.connect import on_all_nodes
    from remote.hangwatch import OVERDUE_GRACE_S, ask_command
    from remote.launch import JobLock, job_script, node_command, open_launch, prepare, upload_script

    wanted, sessions, statuses, run_id = open_launch(cluster, spec, queued=True)
    try:
        local_dir = runs_root / run_id
        with JobLock(sessions[0], run_id, spec.task):  # the workdir caches and environments, one launch at a time
            prepare(cluster, sessions, statuses, spec, setup, wanted)
            if spec.upload:
                upload_script(cluster, sessions, run_id, spec.upload)
            if spec.workdir:  # each node's copy now: a later sync must not change a run that waits in the queue
                folder = node_paths.shell_path(node_paths.node_run_dir(run_id))
                copy = f"mkdir -p {folder} && {job_command.workdir_step(run_id, spec.workdir.key)}"
                copied = on_all_nodes(sessions, lambda s: s.run(copy, warn=False))
                if copied.failed:
                    why = "; ".join(f"{r.name}: {describe(r.error)}" for r in copied.failed)
                    raise OperationError(f"could not copy the workdir for run {run_id}: {why}")
            staged = stage(cluster, sessions[0], spec, run_id)
        script = job_script(cluster, spec, run_id)
        # The copy is made: each node's command only makes the job's folder (no workdir key), or its copy and
        # environment from the stage where its node has none (a replaced node).
        commands = {
            node.name: node_command(cluster, node, spec, setup, run_id, script, None, staged) for node in cluster.nodes
        }
        watch = None
        if spec.hang.enabled:  # on the cluster: it holds while no fab follows the run
            watch = {
                "timeout_s": spec.hang.timeout_s,
                "poll_s": spec.hang.poll_s,
                "on_hang": spec.hang.on_hang,
                "overdue_grace_s": OVERDUE_GRACE_S,
                **{
                    action: {n.name: ask_command(cluster, setup.python[n.name], run_id, action) for n in cluster.nodes}
                    for action in ("status", "collect")
                },
            }
        job_id = submit(cluster, sessions[0], setup, run_id, spec.task, commands, watch)
    finally:
        for session in sessions:
            session.close()
    run = Run(
        run_id,
        spec.task,
        job_id,
        f"{head_path(setup, cluster, node_paths.remote_run_dir(cluster, run_id))}/{contract.RUN_LOG}",
        [node.name for node in cluster.nodes],
        time.time(),
        spec={
            "script": spec.script if not spec.upload else str(spec.upload),
            "args": spec.args,
            "workdir": str(spec.workdir.root) if spec.workdir else None,
            "requirements": str(spec.requirements.path) if spec.requirements else None,
            "env": sorted(spec.env),
            "max_result_bytes": spec.max_result_bytes,
            "hang": {"timeout_s": spec.hang.timeout_s, "on_hang": spec.hang.on_hang},
        },
    )
    run.save(state.make_private_dir(local_dir))
    try:
        ledger = Ledger()
        try:
            ledger.run_started(run_id, cluster.stack, spec.task, len(cluster.nodes), cluster.hourly_usd, scheduled=True)
        finally:
            ledger.close()
    except Exception as exc:  # the ledger is a record; it never costs the run
        say(f"fab: warning: could not record the run in the ledger ({exc})")
    say(
        f"fab: run {run_id}: {spec.task} on {len(cluster.nodes)} nodes, held by Slurm (job {job_id}); "
        f"logs in {local_dir}"
    )
    if detach:
        return local_dir, run, None
    return local_dir, run, follow_with_watch(cluster, setup, run, local_dir, spec.hang)


def stage(cluster: ClusterInfo, head: NodeSession, spec, run_id: str) -> job_command.Stage | None:
    """The run's stage on the shared folder (`contract.RUN_STAGE`), from which a node that lacks the job's
    workdir copy or requirements environment (a replaced one) makes them: the project as the head node's
    cache holds it now, the requirements file. None where the cluster has no shared folder (each node keeps
    its own copy, and no node joins by itself), or the run needs neither; made whole or not at all."""
    folder = node_paths.run_stage(cluster, run_id)
    if folder is None or not (spec.workdir or spec.requirements):
        return None
    files = f"{folder}/{contract.STAGE_FILES}"
    steps = [f"mkdir -p {node_paths.shell_path(folder)}"]
    if spec.workdir:
        cache = contract.in_home(f"{contract.workdir_cache(spec.workdir.key)}/{contract.WORKDIR_FILES}")
        steps.append(f"cp -pR {node_paths.shell_path(cache)} {node_paths.shell_path(files)}")
    try:
        result = head.run(" && ".join(steps))
        why = (result.stderr.strip() or f"exit {result.exited}").splitlines()[-1] if result.exited else ""
        if not why and spec.requirements:
            head.conn.put(io.BytesIO(spec.requirements.text), remote=f"{folder}/{contract.STAGE_REQUIREMENTS}")
    except Exception as exc:
        why = describe(exc)
    if why:
        try:
            head.run(f"rm -rf {node_paths.shell_path(folder)}")
        except Exception:  # the head does not answer: the error below says so already
            pass
        raise OperationError(
            f"could not stage run {run_id} on the shared folder ({folder}): {why}; nothing was submitted"
        )
    return job_command.Stage(
        folder, files=bool(spec.workdir), env_dir=spec.requirements.env_dir if spec.requirements else None
    )


def follow_with_watch(
    cluster: ClusterInfo, setup, run: Run, local_dir: Path, hang_policy=None, cancel_on_interrupt=True
) -> Followed:
    """`follow`, with the hang watch beside it (while fab follows) where the run has one."""
    from remote.hangwatch import HangPolicy, HangWatch

    saved = run.spec.get("hang") or {}
    policy = hang_policy or HangPolicy(float(saved.get("timeout_s", 0)), str(saved.get("on_hang", "stop")))
    watch = None
    if policy.enabled:

        def stop_run():
            cancel(cluster, run)
            return {}

        def hung(report) -> None:
            run.hang = {
                "verdict": report.verdict,
                "stalled_at": report.stalled_since,
                "detected_at": report.detected_at,
                "evidence": str(report.evidence_dir),
            }
            run.save(local_dir)

        watch = HangWatch(cluster, setup.python, run.run_id, policy, local_dir, stop_run, hung).start()
    try:
        return follow(cluster, run, local_dir, cancel_on_interrupt=cancel_on_interrupt)
    finally:
        if watch is not None:
            watch.close()


def finish(cluster: ClusterInfo, setup, folder: Path, run: Run, followed: Followed | None = None) -> None:
    """A run seen ended: its state and times from Slurm, each node's exit code, results fetched,
    summary.json written, the ledger's row given Slurm's times. Done once per run."""
    from infra.ledger import Ledger
    from remote.launch import explain_failure, fetch_results, report_fetched
    from remote.runs import write_summary

    if run.finished:
        return
    refresh(cluster, [run])
    if followed is not None and followed.exit_codes:
        run.exit_codes = dict(followed.exit_codes)
    if followed is None:  # ended while nothing followed it: its log (and each node's code) from the head
        run.exit_codes = _bring_log(cluster, run, folder) or run.exit_codes
    for node in run.nodes:  # a node that left no marker was ended from outside
        run.exit_codes.setdefault(node, 0 if run.state == "COMPLETED" else 128 + 15)
    if run.hang is None:
        run.hang = _cluster_hang(cluster, run)
    if run.hang and run.state in ("CANCELLED", "FAILED"):
        run.state = "HUNG"
    if run.state not in ("COMPLETED",):
        explain_failure(folder)
    head = NodeSession(cluster, cluster.head)
    try:
        fetched = fetch_results(
            cluster,
            head,
            setup.python[cluster.head.name],
            run.run_id,
            folder,
            int(run.spec.get("max_result_bytes") or 50_000_000),
        )
        report_fetched(fetched, folder, cluster.head.name, int(run.spec.get("max_result_bytes") or 50_000_000))
    except Exception as exc:  # results are a convenience; the logs are local already
        say(f"fab: could not fetch results from {cluster.head.name}: {describe(exc)}")
    finally:
        head.close()
    started = run.started_at or run.submitted_at
    ended = run.ended_at or time.time()
    cost = billing.cost_usd(cluster.hourly_usd, max(0.0, ended - started))
    try:
        ledger = Ledger()
        try:
            if ledger.run(run.run_id) is None:
                ledger.run_started(
                    run.run_id, cluster.stack, run.task, len(run.nodes), cluster.hourly_usd, scheduled=True
                )
            ledger.run_times(run.run_id, started, ended, run.exit_codes)
        finally:
            ledger.close()
    except Exception as exc:
        say(f"fab: warning: could not record the run's end in the ledger ({exc})")
    summary = {
        "task": run.task,
        "run_id": run.run_id,
        "nodes": run.nodes,
        "state": run.state,
        "slurm_job": run.job_id,
        "submitted_at": _iso(run.submitted_at),
        "started_at": _iso(started),
        "ended_at": _iso(ended),
        "duration_s": round(ended - started, 3),
        "exit_codes": run.exit_codes,
        "requeues": run.requeues,
        "cost_usd": round(cost, 6),
        "hourly_usd": cluster.hourly_usd,
        **{key: run.spec.get(key) for key in ("script", "args", "workdir", "requirements", "env")},
    }
    if run.hang:
        summary["hang"] = run.hang
    write_summary(folder, summary)
    run.finished = True
    run.save(folder)


def _cluster_hang(cluster: ClusterInfo, run: Run) -> dict | None:
    """The cluster-side hang watch's verdict (`hang.json` beside the run's log), where it found one."""

    head = NodeSession(cluster, cluster.head)
    found = io.BytesIO()
    try:
        head.conn.get(f"{run.log.rsplit('/', 1)[0]}/{contract.HANG_RECORD}", local=found)
        record = json.loads(found.getvalue())
        return record if isinstance(record, dict) and "verdict" in record else None
    except Exception:  # none: the run did not hang (or the head does not answer; the logs say the rest)
        return None
    finally:
        head.close()


def _bring_log(cluster: ClusterInfo, run: Run, folder: Path) -> dict[str, int]:
    """The run's whole log from the head node into the local per-node logs; each node's exit code."""
    splitter = LogSplitter(folder, echo=False)
    head = NodeSession(cluster, cluster.head)
    try:
        head.conn.get(run.log, local=_Sink(splitter))
    except Exception as exc:  # the logs are a convenience here; the outcome comes from Slurm
        say(f"fab: could not bring run {run.run_id}'s log from {cluster.head.name}: {describe(exc)}")
    finally:
        head.close()
        splitter.close()
    return splitter.exit_codes


class _Sink:
    """A binary file-like that feeds the splitter (SFTP writes bytes)."""

    def __init__(self, splitter: LogSplitter):
        self.splitter = splitter

    def write(self, data: bytes) -> int:
        self.splitter.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        pass


def outcome_line(cluster: ClusterInfo, run: Run, folder: Path) -> tuple[int, str]:
    """The exit code and the last line for a run that ended: 0 for COMPLETED, else 1."""
    cost = run.cost_usd(cluster.hourly_usd)
    took = (run.ended_at or time.time()) - (run.started_at or run.submitted_at)
    if run.state == "COMPLETED":
        return (
            0,
            f"fab: run {run.run_id} ok in {took:.1f} s, cost ${cost:.4f} (${cluster.hourly_usd:.3f}/h); logs: {folder}",
        )
    codes = ", ".join(f"{n} exited {c}" for n, c in sorted(run.exit_codes.items()) if c)
    if run.state == "HUNG" and run.hang:
        return (
            1,
            f"error: run {run.run_id} hung and was stopped ({run.hang['verdict']}); "
            f"evidence: {run.hang.get('evidence') or folder}; logs: {folder}",
        )
    if run.state == "CANCELLED":
        return 1, f"error: run {run.run_id} was cancelled ({codes or 'before it started'}); logs: {folder}"
    return 1, f"error: run {run.run_id} {run.state.lower()}: {codes or f'exit code {run.exit_code}'}; logs: {folder}"
