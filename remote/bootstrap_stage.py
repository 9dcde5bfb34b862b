"""A bootstrap's stages and what they record: a stage done on every node at once (`NodeStage`) or once across
the cluster (`ClusterStage`), each node's outcome (`Outcome`), and each node's record of earlier bootstraps
(`NodeRecord`, mirrored in its ~/.gpu-cluster/state.json: a stage whose inputs' digest is unchanged does
nothing). `BootstrapBase`: what every stage reads and records, shared by the stage groups of
`remote/bootstrap.py`'s `Bootstrap`."""

import dataclasses
import hashlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra import state
from infra.errors import NodeCallError
from infra.inventory import ClusterInfo
from node import calls, contract, kit
from remote import job_command, node_paths, nodecall
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

REPO = Path(__file__).resolve().parent.parent
SYNCED = contract.SYNCED


class StageFailed(Exception):
    """A stage could not be done on a node; `output` is what the node said."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


@dataclass
class Outcome:
    """One stage on one node."""

    status: str
    """done, up to date, shared (done once for all nodes) or failed."""
    detail: str = ""
    """A short note for the table."""
    output: str = ""
    """What the node printed, kept for failures."""
    seconds: float | None = None
    """How long the stage took on this node (a stage done on every node at once)."""


@dataclass
class NodeRecord:
    """What a node has recorded of earlier bootstraps, and what this one learned."""

    session: NodeSession
    """The node's connection."""
    stages: dict = field(default_factory=dict)
    """stage -> {"digest": ..., "facts": {...}}, mirrored in ~/.gpu-cluster/state.json."""

    @property
    def name(self) -> str:
        return self.session.node.name

    def facts(self, stage: str) -> dict:
        return self.stages.get(stage, {}).get("facts", {})


def digest(*parts: object) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(json.dumps(part, sort_keys=True, default=str).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()[:16]


def local_manifest() -> dict[str, str]:
    """sha256 of every file bootstrap syncs, by path relative to the repository."""
    manifest = {}
    for top in SYNCED:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                manifest[str(path.relative_to(REPO))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return manifest


@dataclass(frozen=True)
class NodeStage:
    """A stage done on every node at once; a node where it fails is retried on a dropped connection
    and otherwise reported, while the others finish it."""

    name: str
    apply: Callable[[NodeRecord], Outcome]

    def run(self, records: list[NodeRecord]) -> dict[str, Outcome]:
        by_session = {id(r.session): r for r in records}

        def on_node(session: NodeSession) -> Outcome:
            record, started = by_session[id(session)], time.monotonic()
            try:
                outcome = session.retrying(lambda _: self.apply(record), on_retry=say)
            except StageFailed as exc:
                outcome = Outcome("failed", str(exc), exc.output)
            outcome.seconds = time.monotonic() - started
            return outcome

        results = on_all_nodes([r.session for r in records], on_node)
        return {r.name: r.value if r.value is not None else Outcome("failed", describe(r.error)) for r in results}


@dataclass(frozen=True)
class ClusterStage:
    """A stage done once across the cluster (the health check): it gives every node's outcome itself."""

    name: str
    apply: Callable[[], dict[str, Outcome]]

    def run(self, records: list[NodeRecord]) -> dict[str, Outcome]:
        return self.apply()


Stage = NodeStage | ClusterStage


def remembered_setup(cluster: ClusterInfo) -> state.BootstrapRecord:
    """What the last bootstrap of the cluster chose (`bootstrap.json`: master_port, scheduler); empty if none."""
    return state.bootstrap_record(cluster.stack)


class BootstrapBase:
    """What every stage of one bootstrap reads (the cluster, the choices) and where it records its outcome
    on each node; `Bootstrap` (remote/bootstrap.py) sets these and runs the stages."""

    cluster: ClusterInfo
    force: bool
    """Redo every stage even where it is up to date."""
    master_port: int
    manifest: dict[str, str]
    """`local_manifest()`: what the code stage syncs, and part of other stages' digests."""
    records: list[NodeRecord]
    """Every node's record, head node first."""
    stack_dir: Path

    def _record_of(self, session: NodeSession) -> NodeRecord:
        return next(r for r in self.records if r.session is session)

    def _up_to_date(self, record: NodeRecord, stage: str, wanted: str) -> bool:
        return not self.force and record.stages.get(stage, {}).get("digest") == wanted

    def _record(self, record: NodeRecord, stage: str, wanted: str, facts: dict) -> None:
        record.stages[stage] = {"digest": wanted, "facts": facts}
        self._write_state(record)

    def _forget(self, record: NodeRecord, stage: str) -> None:
        if record.stages.pop(stage, None) is not None:
            self._write_state(record)

    def _write_state(self, record: NodeRecord) -> None:
        text = json.dumps(record.stages, indent=1)
        tmp = f"{contract.STATE}.tmp"  # SFTP paths start in the login directory
        record.session.run(f"mkdir -p {contract.shell(contract.PIDS)}", warn=False)
        record.session.conn.put(io.StringIO(text), remote=tmp)
        record.session.run(
            f"chmod 600 {contract.shell(tmp)} && mv {contract.shell(tmp)} {node_paths.STATE_FILE}", warn=False
        )

    def python_for(self, record: NodeRecord) -> str:
        """The interpreter that runs jobs: the node venv (before the deps stage, the inventory's)."""
        return record.facts("deps").get("python") or self.cluster.python

    def env_text(self, record: NodeRecord) -> str:
        """The node's environment file, as every job on it sources it."""
        environment = job_command.node_environment(
            self.cluster,
            self.records.index(record),
            record.facts("probe")["interface"],
            self.python_for(record),
            self.master_port,
        )
        return job_command.env_file_text(environment)

    def _call(self, record: NodeRecord, request: calls.Request, **run_options):
        """A node call on `record`'s node, with the inventory's interpreter (the node venv may not be there)."""
        return nodecall.call(record.session, self.cluster.python, request, **run_options)

    def _apply_kit(self, record: NodeRecord, part: str, recipe: kit.NodeKit) -> dict:
        """One part of the node's kit applied there (node/kit.py, the ApplyKit node call); its facts. The kit
        goes as a 0600 file in the private ~/.gpu-cluster (the scheduler's holds the munge key), which the
        node removes once read."""
        sent = f"{contract.HOME_DIR}/kit-{part}.json"
        record.session.run(f"mkdir -p {contract.shell(contract.HOME_DIR)} && : > {contract.shell(sent)}", warn=False)
        record.session.conn.put(io.StringIO(json.dumps(dataclasses.asdict(recipe))), remote=sent)
        try:
            return self._call(record, calls.ApplyKit(sent, [part]), timeout=1800).facts[part]
        except NodeCallError as exc:
            raise StageFailed(exc.line) from None

    def _on_every_record(
        self, work: Callable[[NodeRecord], Outcome], records: list[NodeRecord] | None = None
    ) -> dict[str, Outcome]:
        """`work` on each of `records` (default: every node's) at once; a node where it raised, failed."""
        chosen = self.records if records is None else records
        answers = on_all_nodes([r.session for r in chosen], lambda s: work(self._record_of(s)))
        return {a.name: a.value if a.value is not None else Outcome("failed", describe(a.error)) for a in answers}
