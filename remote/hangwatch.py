"""While a job runs: watch every rank's collectives, and when the job hangs, name the culprit and act.

Every launch turns on torch's flight recorder and a monitor thread in each rank (node/rankhook/;
nothing in the user's script changes). `HangWatch` asks each node every `poll_s` (sooner where a rank is
slow and due to be named a straggler: `straggler.Named.next_look_s`) what its ranks are
doing (the HangStatus node call, node/calls.py, over SSH connections of its own) and applies the rule in
node/hang_rule.py (which a Slurm-held run also applies on the cluster). On a hang it collects from
every node the recorder dumps and the `py-spy dump` stacks of every rank, keeps them in the run folder
(`hang/`), prints one verdict line, and then stops the job everywhere (`--on-hang stop`, the default) or
leaves it running for a person (`--on-hang wait`).
"""

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from infra import state
from infra.inventory import ClusterInfo
from node import calls, contract, straggler
from node import hang_rule as hang
from remote import node_paths, nodecall
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

DEFAULT_HANG_TIMEOUT_S = 300
ON_HANG = ("stop", "wait")
ON_STRAGGLER = ("report", "replace")
# Ring-buffer entries of torch's flight recorder per rank: enough for the collectives in flight plus
# their recent history. Recording costs the same whatever the size; dumping the buffer is ~0.5 ms per
# 1000 entries, and happens only when a rank sits in one collective for a whole monitor interval.
RECORDER_ENTRIES = 1000
COLLECT_WAIT_S = 5
# Past the hang timeout plus this, a rank still waiting in one collective is a hang even where the rule
# has no rank to blame (a node that stopped answering, a transport that stopped moving): the verdict
# comes within the timeout + 60 s, polls and evidence included, and a run never waits forever for one.
OVERDUE_GRACE_S = 30
STOP_ATTEMPTS = 3
STOP_CHECK_S = 20  # how long a stopped job may take to end before the watch stops it again


@dataclass(frozen=True)
class HangPolicy:
    """What a launch does about hangs and stragglers (`--hang-timeout`, `--on-hang`, `--on-straggler`)."""

    timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """A rank inside a collective this long while another rank has not entered it is a hang; 0 turns
    the recorder and the watch off."""
    on_hang: str = "stop"
    """stop: end the job everywhere (exit 1); wait: leave it running for a person."""
    on_straggler: str = "report"
    """report: name a straggler and go on; replace: also drain its node and replace it through the spot
    path, the run resuming from its checkpoint there (a Slurm-held run on a stack that replaces nodes)."""

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    @property
    def poll_s(self) -> float:
        """Often enough to report within a fifth of the timeout, never more than every second."""
        return min(10.0, max(1.0, self.timeout_s / 5))


def job_environment(cluster: ClusterInfo, run_id: str, policy: HangPolicy) -> dict[str, str]:
    """What the launch command adds to every rank's environment (values for a shell, unquoted `$`)."""
    if not policy.enabled:
        return {}
    variables = {
        # A recorder size the user chose (in the node env or --env) wins.
        "TORCH_FR_BUFFER_SIZE": f"${{TORCH_FR_BUFFER_SIZE:-{RECORDER_ENTRIES}}}",
        contract.PROGRESS_VARIABLE: f'"$HOME"/{contract.progress_dir(run_id)}',  # node-local: each node has its own
        "CLUSTER_PROGRESS_INTERVAL_S": "1",
        "PYTHONFAULTHANDLER": "1",  # a rank that aborts (gloo's size checks) prints its Python stack
    }
    shared = step_times_dir(cluster, run_id)
    if shared:
        variables[contract.STEP_TIMES_VARIABLE] = node_paths.shell_path(shared)
    return variables


def step_times_dir(cluster: ClusterInfo, run_id: str) -> str | None:
    """Where the ranks write their step times for the straggler verdict's shared looks (the run's folder on
    the shared folder, `contract.STEP_TIMES`); None where the cluster has no shared folder."""
    if not cluster.shared_dir:
        return None
    return f"{node_paths.remote_run_dir(cluster, run_id)}/{contract.STEP_TIMES}"


def rankhook_path() -> str:
    """Put first on PYTHONPATH: its sitecustomize starts the monitor in every rank."""
    return "$CLUSTER_CODE_DIR/node/rankhook"


@dataclass
class HangReport:
    """What the watch found, for the summary and the ledger."""

    verdict: str
    """The one line, `HANG run=...: ...`."""
    stalled_since: float
    """When progress stopped: the first waiting rank entered the collective (epoch seconds)."""
    detected_at: float
    """When the watch declared the hang."""
    evidence_dir: Path
    """Where the dumps and stacks were kept."""


class HangWatch:
    """Polls the ranks of one run on every node until told to stop, or until it has found a hang."""

    def __init__(
        self,
        cluster: ClusterInfo,
        python: dict[str, str],
        run_id: str,
        policy: HangPolicy,
        local_dir: Path,
        stop_job,
        on_hang=None,
    ):
        self.cluster, self.python, self.run_id, self.policy = cluster, python, run_id, policy
        self.local_dir, self.stop_job, self.on_hang = local_dir, stop_job, on_hang
        self.report: HangReport | None = None
        self.polls = 0
        """Polls answered: every rank's progress read, no hang found."""
        self.ranks_seen = 0
        """The most ranks one poll found reporting (the job's ranks, once all have started)."""
        self.stragglers = straggler.Named()
        """The ranks named slow (node/straggler.py), each once."""
        self.finished = threading.Event()
        self.stopping = threading.Event()
        """Set once the watch is stopping the job (fail-fast then has nothing to add)."""
        self.thread = threading.Thread(target=self._run, name=f"hang-watch-{run_id}", daemon=True)

    def start(self) -> "HangWatch":
        if self.policy.enabled:
            self.thread.start()
        return self

    def stats(self) -> dict | None:
        """What the watch did (summary.json's `hang_watch`); None where it was off."""
        if not self.policy.enabled:
            return None
        return {"timeout_s": self.policy.timeout_s, "polls": self.polls, "ranks_seen": self.ranks_seen}

    def close(self) -> None:
        self.finished.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.policy.poll_s + 60)

    def _run(self) -> None:
        sessions = [NodeSession(self.cluster, node) for node in self.cluster.nodes]
        looks = None
        try:
            looks = self._shared_looks()
            found = self._watch(sessions, looks)
            if looks is not None:
                looks.stop()
            if found is None:
                return
            self.report = self._diagnose(sessions, found)
            if self.on_hang:
                self.on_hang(self.report)
            if self.policy.on_hang == "stop":
                self.stopping.set()
                say("fab: stopping the hung job on every node (--on-hang wait leaves it running)")
                self._stop_until_ended()
            else:
                say("fab: --on-hang wait: the job keeps running; fab stop (or Ctrl-C here) ends it")
        finally:
            if looks is not None:
                looks.stop()
                looks.session.close()
            for session in sessions:
                session.close()

    def _shared_looks(self) -> "SharedLooks | None":
        """The straggler verdict's own looks at the ranks' step times on the shared folder, through the head
        node's connection (a connection of their own), where the cluster has a shared folder."""
        folder = step_times_dir(self.cluster, self.run_id)
        if folder is None:
            return None
        looks = SharedLooks(self.stragglers, NodeSession(self.cluster, self.cluster.head), folder, self._say)
        looks.start()
        return looks

    def _watch(self, sessions: list[NodeSession], looks: "SharedLooks | None") -> hang.Hang | None:
        """Poll until a hang is found (returned) or the job has ended (None). A poll that fails (a node
        that does not answer, a damaged record) is simply made again: the watch itself never ends early.
        While the straggler verdict's own `looks` find step times, the polls keep their pace (else a poll
        comes sooner where a slow rank is due)."""
        overdue_s = self.policy.timeout_s + OVERDUE_GRACE_S
        regular_s = self.policy.poll_s

        def pause_s() -> float:
            serving = looks is not None and looks.serving()
            return regular_s if serving else self.stragglers.next_look_s(regular_s)

        while not self.finished.wait(pause_s()):
            try:
                payloads = self._payloads(sessions, "status")
                views = [view for payload in payloads for view in hang.parse_ranks(payload)]
                found = hang.find_hang(views, self.policy.timeout_s, overdue_s)
                self.stragglers.update([r for payload in payloads for r in payload.get("ranks", [])], self._say)
            except Exception as exc:  # noqa: BLE001 - the next poll tries again
                say(f"fab: hang watch: a poll failed ({describe(exc)}); trying again")
                continue
            self.polls += 1
            self.ranks_seen = max(self.ranks_seen, len(views))
            if found is not None and not self.finished.is_set():
                return found
        return None

    def _say(self, fresh: list) -> None:
        """Say each rank the straggler rule names now, and keep the verdict in the run folder (`fab jobs`)."""
        for found in fresh:
            say(found.line(self.run_id))
        state.make_private_dir(self.local_dir)
        state.write_atomic(self.local_dir / contract.STRAGGLER_RECORD, self.stragglers.record())

    def _stop_until_ended(self) -> None:
        """Stop the job everywhere, and again while it has not ended (a node that missed the first stop)."""
        for attempt in range(STOP_ATTEMPTS):
            self.stop_job()
            if self.finished.wait(STOP_CHECK_S):
                return
            say(f"fab: the hung job has not ended {STOP_CHECK_S} s after stop {attempt + 1}; stopping it again")
        say("fab: could not end the hung job on every node; run fab stop once the nodes answer")

    def _command(self, session: NodeSession, action: str) -> str:
        return ask_command(self.cluster, self.python.get(session.node.name, "python3"), self.run_id, action)

    def _payloads(self, sessions: list[NodeSession], action: str) -> list[dict]:
        def ask(session: NodeSession) -> dict:
            try:
                result = session.run(self._command(session, action), timeout=60)
            except Exception:  # the node did not answer: a fresh connection for the next poll
                session.reopen()
                raise
            try:
                request = hang_request(self.run_id, action)
                return dataclasses.asdict(calls.reply_from(request, result.exited, result.stdout, result.stderr))
            except calls.CallError:
                return {}

        return [r.value for r in on_all_nodes(sessions, ask) if isinstance(r.value, dict)]

    def _ask(self, sessions: list[NodeSession], action: str) -> list[hang.RankView]:
        return [view for payload in self._payloads(sessions, action) for view in hang.parse_ranks(payload)]

    def _diagnose(self, sessions: list[NodeSession], found: hang.Hang) -> HangReport:
        detected_at = time.time()
        payloads = self._payloads(sessions, "collect")
        evidence = hang.Evidence.from_collected(payloads)
        line = hang.verdict(self.run_id, found, evidence)
        folder = keep_evidence(self.local_dir / "hang", payloads, line)
        say(line)
        say(f"fab: flight-recorder dumps and stacks of every rank in {folder}")
        return HangReport(line, hang.stalled_since(found), detected_at, folder)


class SharedLooks(straggler.SharedLooks):
    """fab's: the shared step times read on the head node, through a connection of their own."""

    def __init__(self, named: straggler.Named, session: NodeSession, folder: str, said):
        self.session = session
        self.command = f"cat {node_paths.shell_path(folder)}/{contract.RANK_PROGRESS_GLOB} 2>/dev/null; true"
        super().__init__(named, self._read, said)

    def _read(self) -> list:
        try:
            return contract.json_objects(self.session.run(self.command, timeout=30).stdout.splitlines())
        except Exception:  # the head node did not answer: a fresh connection for the next look
            if not self.stopped.is_set():
                self.session.reopen()
            raise


def hang_request(run_id: str, action: str) -> calls.HangStatus | calls.HangCollect:
    """The node call that asks one node about the run's ranks: `status`, or `collect` the evidence."""
    folder = contract.progress_dir(run_id)  # relative to the home the call starts in
    return calls.HangStatus(folder, run_id) if action == "status" else calls.HangCollect(folder, run_id, COLLECT_WAIT_S)


def ask_command(cluster: ClusterInfo, python: str, run_id: str, action: str) -> str:
    """That call as a shell command (the batch job's watch runs it on each node through srun)."""
    words = calls.command_words(hang_request(run_id, action), nodecall.version())
    return f". {node_paths.ENV_FILE} 2>/dev/null; cd && " + node_paths.node_module(cluster, python, "calls", *words)


def tell_ranks_command(cluster: ClusterInfo, python: str, node: str) -> str:
    """What a Slurm-held run's batch job has a straggler's node run before it is replaced (`--on-straggler
    replace`): SIGUSR1 to that node's ranks, as a spot notice does (node/spot_watch.py)."""
    words = node_paths.node_module(cluster, python, "spot_watch", "--tell-ranks", "--node", node)
    return f". {node_paths.ENV_FILE} 2>/dev/null; cd && {words}"


def keep_evidence(folder: Path, payloads: list[dict], line: str) -> Path:
    """The run folder's `hang/`: the verdict, each rank's recorder dump and stacks, the raw answers."""
    state.make_private_dir(folder)
    state.write_atomic(folder / "verdict.txt", line + "\n")
    for payload in payloads:
        for rank, dump in payload.get("dumps", {}).items():
            state.write_atomic(folder / f"rank-{rank}.flight-recorder.json", json.dumps(dump, indent=1) + "\n")
        for rank, text in payload.get("py_spy", {}).items():
            state.write_atomic(folder / f"rank-{rank}.py-spy.txt", text)
        node = next((r.get("node") for r in payload.get("ranks", []) if r.get("node")), "node")
        state.write_atomic(folder / f"{node}.progress.json", json.dumps(payload.get("ranks", []), indent=1) + "\n")
    return folder
