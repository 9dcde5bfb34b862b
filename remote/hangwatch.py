"""While a job runs: watch every rank's collectives, and when the job hangs, name the culprit and act.

Every launch turns on torch's flight recorder and a monitor thread in each rank (node/rankhook/;
nothing in the user's script changes). `HangWatch` asks each node every `poll_s` (sooner where a rank is
slow and due to be named a straggler: `straggler.Named.next_look_s`) what its ranks are
doing (the HangStatus node call, node/calls.py, over SSH connections of its own): it is fab's adapter of
the one run watch, node/run_watch.py, which a Slurm-held run's batch job runs too (node/slurm_watch.py).
On a hang it collects from
every node the recorder dumps and the `py-spy dump` stacks of every rank, keeps them in the run folder
(`hang/`), prints one verdict line, and then stops the job everywhere (`--on-hang stop`, the default) or
leaves it running for a person (`--on-hang wait`).
"""

import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from infra import state
from infra.inventory import ClusterInfo
from node import calls, contract
from node.run_watch import RunWatch, WatchPolicy
from remote import node_paths, nodecall
from remote.connect import NodeSession, on_all_nodes
from remote.stream import say

DEFAULT_HANG_TIMEOUT_S = 300
ON_HANG = ("stop", "wait")
ON_STRAGGLER = ("report", "replace")
# Ring-buffer entries of torch's flight recorder per rank: enough for the collectives in flight plus
# their recent history. Recording costs the same whatever the size; dumping the buffer is ~0.5 ms per
# 1000 entries, and happens only when a rank sits in one collective for a whole monitor interval.
RECORDER_ENTRIES = 1000
COLLECT_WAIT_S = 5


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
    """fab's adapter of the run watch (node/run_watch.py): it asks every node over SSH connections of its own,
    on a thread beside the launch, until told to stop or until it has dealt with a hang."""

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
        self.local_dir, self.on_hang = local_dir, on_hang
        self.report: HangReport | None = None
        self.finished = threading.Event()
        self.sessions: list[NodeSession] = []
        self.head: NodeSession | None = None
        """The straggler verdict's own connection to the head node, for the shared step times."""
        folder = step_times_dir(cluster, run_id)
        shared = f"{node_paths.shell_path(folder)}/{contract.RANK_PROGRESS_GLOB}" if folder else ""
        self.shared = f"cat {shared} 2>/dev/null; true"
        self.watch = RunWatch(
            run_id,
            WatchPolicy(policy.timeout_s, policy.poll_s, policy.on_hang),
            self._payloads,
            stop_job,
            self.finished.wait,
            say,
            self._keep,
            on_verdict=self._verdict,
            read_shared=self._read_shared if folder else None,
            note_prefix="fab: ",
        )
        self.thread = threading.Thread(target=self._run, name=f"hang-watch-{run_id}", daemon=True)

    def start(self) -> "HangWatch":
        if self.policy.enabled:
            self.thread.start()
        return self

    def stopping(self) -> bool:
        """The watch is stopping the job (fail-fast then has nothing to add)."""
        return self.watch.stopping

    def stats(self) -> dict | None:
        """What the watch did (summary.json's `hang_watch`); None where it was off."""
        if not self.policy.enabled:
            return None
        return {"timeout_s": self.policy.timeout_s, "polls": self.watch.polls, "ranks_seen": self.watch.ranks_seen}

    def close(self) -> None:
        self.finished.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.policy.poll_s + 60)

    def _run(self) -> None:
        self.sessions = [NodeSession(self.cluster, node) for node in self.cluster.nodes]
        try:
            self.watch.run()
        finally:
            for session in [*self.sessions, *([self.head] if self.head else [])]:
                session.close()

    def _keep(self, name: str, text: str) -> None:
        state.make_private_dir(self.local_dir)
        state.write_atomic(self.local_dir / name, text)

    def _verdict(self, record: dict) -> str:
        """The evidence kept in the run folder's `hang/`, the report made (and handed to `on_hang`)."""
        folder = keep_evidence(self.local_dir / "hang", record["collected"], record["verdict"])
        self.report = HangReport(record["verdict"], record["stalled_at"], record["detected_at"], folder)
        if self.on_hang:
            self.on_hang(self.report)
        return f"fab: flight-recorder dumps and stacks of every rank in {folder}"

    def _read_shared(self) -> list:
        """The ranks' shared step times, read on the head node through a connection of the watch's own."""
        self.head = self.head or NodeSession(self.cluster, self.cluster.head)
        try:
            return contract.json_objects(self.head.run(self.shared, timeout=30).stdout.splitlines())
        except Exception:  # the head node did not answer: a fresh connection for the next look
            if not self.finished.is_set():
                self.head.reopen()
            raise

    def _payloads(self, action: str) -> list[dict]:
        """Every node's answer to the watch's call (`status`, `collect`); a node that does not answer gives none."""
        request = hang_request(self.run_id, action)

        def ask(session: NodeSession) -> dict:
            python = self.python.get(session.node.name, "python3")
            try:
                result = session.run(ask_command(self.cluster, python, self.run_id, action), timeout=60)
            except Exception:  # the node did not answer: a fresh connection for the next poll
                session.reopen()
                raise
            try:
                return dataclasses.asdict(calls.reply_from(request, result.exited, result.stdout, result.stderr))
            except calls.CallError:
                return {}

        return [r.value for r in on_all_nodes(self.sessions, ask) if isinstance(r.value, dict)]


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
