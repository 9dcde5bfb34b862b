"""`fab bootstrap`: prepare every node, stage by stage, in parallel, each stage idempotent.

code      harness/, examples/ and node/ into $CLUSTER_SHARED_DIR/code once (into each node's
          ~/.gpu-cluster/code without shared storage), only files whose hash differs
probe     OS, Python, GPUs, driver and CUDA, and the interface that routes to MASTER_ADDR
deps      the node venv ~/.gpu-cluster/venv over the inventory's `python`, topped up from
          requirements-node.txt only where torch (or nvidia-ml-py, matplotlib) is missing: with uv
          (node/uv_env.py), pip-installed first where the node has none; with pip where uv cannot run
env       ~/.gpu-cluster/env: the node environment every job sources
health    every node reaches MASTER_ADDR:MASTER_PORT, then the preflight job (harness/fitness.py: one
          process per node, all-reduces across all of them, each node's compute, memory, disk, GPUs,
          every pair's bandwidth, clocks)
watchdog  the budget and idle guard on the head node, as the inventory's `daemon` says
preflight the health stage's measurements judged per node (OK / WARN / CRITICAL, remote/fitness.py):
          a CRITICAL node does not fail bootstrap, but launches refuse it until a preflight passes

The same path for every provider: what differs (the interpreter, the shared folder, systemd or not)
is a fact of the inventory. What runs on a node runs from a file of node/, synced first.

A stage records a digest of its inputs in the node's ~/.gpu-cluster/state.json; when the digest is
unchanged the stage is "up to date" and does nothing. Stages run one at a time on all nodes at
once; when one fails on some node, every node finishes that stage (none is left half-done) and the
bootstrap stops there, showing the failing node's output.
"""

import base64
import dataclasses
import enum
import hashlib
import io
import json
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from infra import hints, state
from infra.errors import NodeCallError, OperationError, ReportedFailure, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from node import calls, contract, kit
from remote import fitness, job_command, node_paths, nodecall, protocol
from remote.connect import NodeSession, describe, on_all_nodes, open_sessions
from remote.launch import NodeSetup
from remote.stream import console, say

REPO = Path(__file__).resolve().parent.parent
SCHEDULER_PORTS = 60
"""Slurm's ports, just above MASTER_PORT: slurmctld, one slurmd per node, srun's range."""
SCHEDULER_CODE = (
    "node/scheduler.py",
    "node/slurm_conf.py",
    "node/slurm_daemons.py",
    "node/slurm_nodes.py",
    "node/slurm_existing.py",
    "node/slurm_login.py",
    "node/slurm_accounting.py",
)
"""The code the scheduler stage runs on a node (`scheduler.py start`, `adopt`): part of the stage's digest."""
SYNCED = contract.SYNCED
# The watchdog's code: a change to any of it restarts the watchdog.
WATCHDOG_CODE = ("harness/watchdog.py", "node/contract.py", "node/procfs.py", "node/billing.py")
WATCHDOG_UNIT = """[Unit]
Description=gpu-cluster budget and idle watchdog
After=network-online.target remote-fs.target

[Service]
User={user}
WorkingDirectory={code}
Environment=PYTHONPATH={code}
Environment=CLUSTER_NODE=node-0
ExecStart={argv}
Restart=on-failure
RestartSec=10

[Install]
WantedBy=multi-user.target
"""


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


class Scheduler(str, enum.Enum):
    """`fab bootstrap --scheduler`: who holds the runs."""

    AUTO = "auto"
    """Slurm where every node has it and one user, else fab's connections, saying why."""
    SLURM = "slurm"
    NONE = "none"


class Bootstrap:
    """One `fab bootstrap` run over a cluster."""

    def __init__(
        self,
        cluster: ClusterInfo,
        force: bool,
        master_port: int,
        scheduler: str | None = None,
        timeline: Timeline | None = None,
        accounting: str | None = None,
    ):
        self.cluster, self.force, self.master_port = cluster, force, master_port
        self.timeline = timeline or Timeline(time.time(), clock=time.monotonic())
        """Connect, then each stage (per node in `nodes`), then the record: in bootstrap.json, one line at the end."""
        remembered = remembered_setup(cluster)
        held_before = remembered.slurm_holds
        self.scheduler_choice = Scheduler(
            scheduler or remembered.scheduler_choice or (Scheduler.SLURM if held_before else Scheduler.AUTO)
        )
        """auto (the default): Slurm where every node has it, else runs held by fab; slurm; none."""
        self.slurm_holds = self.scheduler_choice is Scheduler.SLURM
        """What the scheduler stage settled on: Slurm holds the runs, or fab's connections do."""
        self.scheduler_why = ""
        """Why `auto` settled on none (one line), for the launches to say."""
        self.slurm_held_before = held_before
        """Whether Slurm held the runs after the last bootstrap."""
        self.accounting = accounting or remembered.accounting or "auto"
        """auto (the default): Slurm's accounting (slurmdbd over MariaDB) where the head node has them; none."""
        self.stack_dir = state.stack_dir(cluster.stack)
        self.manifest = local_manifest()
        self.records: list[NodeRecord] = []
        self.fitness: fitness.Fitness | None = None
        """The preflight the health stage ran (None where health was up to date)."""
        self.outcomes: dict[str, dict[str, Outcome]] = {}
        self.write_lock = threading.Lock()

    # -------------------------------------------------------------------------------- driver

    def run(self) -> None:
        """The whole bootstrap; a second one of the same stack at once is refused, naming the first."""
        self._refuse_ssh_port()
        stack = self.cluster.stack
        with state.stack_lock(f"{stack}.bootstrap", f"fab bootstrap of stack '{stack}'", wait=False):
            self._run()

    def _run(self) -> None:
        started = time.monotonic()
        private = f"mkdir -p {node_paths.STATE_DIR} && chmod 700 {node_paths.STATE_DIR}"  # the job's env and code
        sessions, recorded = open_sessions(
            self.cluster, f"{private}; cat {node_paths.STATE_FILE} 2>/dev/null || echo '{{}}'"
        )
        try:
            self._refuse_shared_home(sessions)
            self._refuse_busy_port(sessions[0])
            self._refuse_busy_slurm_ports(sessions)
            self.records = [NodeRecord(s, _parse_state(text)) for s, text in zip(sessions, recorded, strict=True)]
            self.timeline.mark("connect")
            for stage in self.stages():
                name = stage.name
                stage_started = time.monotonic()
                self.outcomes[name] = stage.run(self.records)
                self.timeline.mark(name)
                for node, outcome in self.outcomes[name].items():
                    if outcome.seconds is not None:
                        self.timeline.nodes.setdefault(node, {})[name] = round(outcome.seconds, 3)
                statuses = sorted({o.status for o in self.outcomes[name].values()})
                say(f"bootstrap: {name:7s} {', '.join(statuses)} ({time.monotonic() - stage_started:.1f} s)")
                if "failed" in statuses:
                    self._report(failed_stage=name)
                    raise ReportedFailure(1)
            self.timeline.close("record")
            self._save_setup()
            self._report()
            fresh = all(
                o.status in ("up to date", "shared", "n/a") for per in self.outcomes.values() for o in per.values()
            )
            say(
                f"bootstrap: {len(sessions)} nodes {'up to date' if fresh else 'ready'} "
                f"in {time.monotonic() - started:.1f} s; "
                f"next: {hints.fab('hello')}, {hints.fab('run-ddp')}"
            )
            say(f"bootstrap: {self.timeline.line()}")
        finally:
            for session in sessions:
                session.close()

    def _refuse_ssh_port(self) -> None:
        """MASTER_PORT may not be a node's SSH port; checked before anything connects."""
        for node in self.cluster.nodes:
            if node.ssh_port == self.master_port:
                raise UsageError(
                    f"--master-port {self.master_port} is the SSH port of {node.name}: "
                    "pick another, e.g. --master-port 29500"
                )

    def _refuse_shared_home(self, sessions: list[NodeSession]) -> None:
        """Every node needs a ~/.gpu-cluster of its own: where two share one home (an NFS `$HOME`) one
        would run as the other. Each node leaves a file in contract.HOME_CLAIMS, then (once all have)
        lists them: a node that finds another's shares its home. Checked before any stage writes."""
        claims = contract.shell(contract.HOME_CLAIMS)
        made = on_all_nodes(
            sessions,
            lambda s: s.run(f'umask 077 && mkdir -p {claims} && basename "$(mktemp {claims}/XXXXXXXXXX)"').stdout,
        )
        owner = {(r.value or "").strip(): r.name for r in made if (r.value or "").strip()}
        own = {name: token for token, name in owner.items()}
        found = on_all_nodes(
            sessions,
            lambda s: (
                s.run(
                    f"ls {claims}; rm -f {claims}/{own.get(s.node.name, '-')}; rmdir {claims} 2>/dev/null; echo $HOME"
                ).stdout
            ),
        )
        for answer in found:
            *listed, home = (answer.value or "").split() or [""]
            others = sorted({owner[t] for t in listed if owner.get(t, answer.name) != answer.name})
            if others:
                sharing = " and ".join(sorted([answer.name, *others]))
                raise UsageError(
                    f"{sharing} share one home ({home}, an NFS $HOME?): each node needs "
                    "a ~/.gpu-cluster of its own; log in to each host as a user whose home is its own "
                    "(user: per host in the hosts file)"
                )

    def _refuse_busy_port(self, head: NodeSession) -> None:
        """MASTER_PORT must be free on the head node's MASTER_ADDR, checked before any stage writes."""
        address, port = self.cluster.head.private_ip, self.master_port
        python = self.cluster.python
        source = (REPO / "node" / "port_free.py").read_text()
        result = head.run(protocol.python_json_command(python, source, address, str(port)))
        verdict = result.stdout.strip()
        if verdict == "free":
            return
        if not verdict.startswith("in use"):
            raise OperationError(
                f"could not check MASTER_PORT {port} on {head.node.name}: {(result.stderr.strip() or verdict)[-200:]}"
            )
        job, _ = protocol.parse_job_status(head.run(protocol.job_status_command()).stdout)
        why = (
            f"job {job['run_id']} ({job['task']}) runs there: wait for it or run fab stop"
            if job
            else f"{verdict}: pick another with --master-port"
        )
        raise UsageError(f"MASTER_PORT {port} is not free on {head.node.name} ({address}): {why}")

    def _refuse_busy_slurm_ports(self, sessions: list[NodeSession]) -> None:
        """The ports our Slurm's daemons will listen on (the controller on the head node, each node's slurmd)
        must be free on every node, checked before any stage writes: another stack's Slurm on this machine
        with the same --master-port would otherwise take this one's nodes without a word. Not where Slurm
        is the site's or not wanted, nor where our own daemons already hold these very ports."""
        remembered = remembered_setup(self.cluster)
        ours_already = self.slurm_held_before and remembered.master_port == self.master_port
        if self.cluster.slurm_existing or self.scheduler_choice is Scheduler.NONE or ours_already:
            return
        first = self.master_port + 1
        source = (REPO / "node" / "port_free.py").read_text()

        def check(session: NodeSession) -> str:
            index = sessions.index(session)
            ports = [first, first + 1 + index] if index == 0 else [first + 1 + index]
            command = protocol.python_json_command(self.cluster.python, source, "@host", *map(str, ports))
            return session.run(command).stdout.strip()

        for session, answer in zip(sessions, on_all_nodes(sessions, check), strict=True):
            verdict = answer.value or ""
            if verdict.startswith("in use"):
                raise UsageError(
                    f"a port Slurm's daemons need on {session.node.name} is taken "
                    f"({verdict.removeprefix('in use: ')}): "
                    f"another stack's Slurm with the same --master-port? pick another --master-port "
                    f"(Slurm uses {first} to {first + SCHEDULER_PORTS} above it)"
                )

    def stages(self) -> list[Stage]:
        """The stages in order: each runs on every node at once, or (health) once across the cluster."""
        return [
            NodeStage("code", self.code),
            NodeStage("probe", self.probe),
            NodeStage("deps", self.deps),
            NodeStage("env", self.env),
            ClusterStage("health", self.health),
            ClusterStage("scheduler", self.scheduler_stage),
            NodeStage("watchdog", self.watchdog),
            ClusterStage("preflight", self.preflight),
        ]

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

    # -------------------------------------------------------------------------------- stages

    def code(self, record: NodeRecord) -> Outcome:
        """Sync the code by hash: once on shared storage, else on every node. Needs no Python."""
        if self.cluster.shared_dir and record is not self.records[0]:
            return Outcome("shared", f"via {self.records[0].name}")
        destination = node_paths.code_dir(self.cluster)
        remote = record.session.run(protocol.hash_files_command(destination, SYNCED))
        if remote.exited != 0:
            raise StageFailed("could not hash the code on the node", remote.stdout + remote.stderr)
        remote_manifest = protocol.parse_hashes(remote.stdout)
        changed = [path for path, sha in self.manifest.items() if remote_manifest.get(path) != sha]
        stale = [path for path in remote_manifest if path not in self.manifest]
        if not changed and not stale:
            return Outcome("up to date", f"{len(self.manifest)} files")
        folders = sorted({str(Path(p).parent) for p in changed})
        if folders:
            record.session.run(
                "mkdir -p " + " ".join(node_paths.shell_path(f"{destination}/{f}") for f in folders), warn=False
            )
        for path in changed:
            record.session.conn.put(str(REPO / path), remote=_sftp(destination, path))
        if stale:
            record.session.run(
                "rm -f " + " ".join(node_paths.shell_path(f"{destination}/{p}") for p in stale), warn=False
            )
        self._record(record, "code", digest(self.manifest), {"files": len(self.manifest)})
        return Outcome("done", f"{len(changed)} sent, {len(stale)} removed")

    def probe(self, record: NodeRecord) -> Outcome:
        python = self.cluster.python
        wanted = digest(self.manifest.get("node/probe.py"), self.cluster.head.private_ip, python)
        if self._up_to_date(record, "probe", wanted):
            return Outcome("up to date", _hardware(record.facts("probe")))
        try:
            facts = nodecall.call(record.session, python, calls.ProbeNode(self.cluster.head.private_ip)).facts
        except (UsageError, OperationError) as exc:
            raise StageFailed(f"the probe failed (is {python} there?)", str(exc)) from None
        if not facts.get("interface"):
            raise StageFailed(f"no route from this node to MASTER_ADDR {self.cluster.head.private_ip}")
        self._record(record, "probe", wanted, facts)
        return Outcome("done", _hardware(facts))

    def deps(self, record: NodeRecord) -> Outcome:
        """The node venv over the inventory's `python`; pip runs only where something is missing."""
        requirements = (REPO / "requirements-node.txt").read_text()
        code = [self.manifest.get(f"node/{name}.py") for name in ("python_env", "uv_env")]
        wanted = digest(requirements, self.cluster.python, *code)
        if self._up_to_date(record, "deps", wanted):
            return Outcome("up to date", _torch(record.facts("deps")))
        facts = self._apply_kit(record, "deps", kit.NodeKit(record.name, self.cluster.python, requirements))
        self._record(record, "deps", wanted, facts)
        return Outcome("done", _torch(facts))

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

    def env(self, record: NodeRecord) -> Outcome:
        interface = record.facts("probe")["interface"]
        text = self.env_text(record)
        wanted = digest(text)
        if self._up_to_date(record, "env", wanted):
            return Outcome("up to date", f"iface {interface}")
        self._apply_kit(record, "env", kit.NodeKit(record.name, self.cluster.python, env=text))
        self._record(record, "env", wanted, {"interface": interface})
        return Outcome("done", f"iface {interface}")

    def health(self) -> dict[str, Outcome]:
        wanted = digest([r.stages.get("env", {}).get("digest") for r in self.records], self.manifest, self.master_port)
        if all(self._up_to_date(r, "health", wanted) for r in self.records):
            return {r.name: Outcome("up to date", "all-reduce ok") for r in self.records}
        reachable = self._check_master_reachable()
        if any(o.status == "failed" for o in reachable.values()):
            return reachable
        outcomes = self._check_all_reduce()
        if all(o.status == "done" for o in outcomes.values()):
            on_all_nodes(
                [r.session for r in self.records], lambda s: self._record(self._record_of(s), "health", wanted, {})
            )
        return outcomes

    def scheduler_stage(self) -> dict[str, Outcome]:
        """Slurm on every node (node/scheduler.py): slurmctld on the head node, slurmd everywhere, one munge
        key per cluster; with `--scheduler none`, whatever an earlier bootstrap started is stopped."""
        users = self._users_differ() if self.scheduler_choice is not Scheduler.NONE else ""
        if users and (self.cluster.slurm_existing or self.scheduler_choice is Scheduler.SLURM):
            return {r.name: Outcome("failed", users) for r in self.records}
        if self.cluster.slurm_existing and self.scheduler_choice is not Scheduler.NONE:
            self.slurm_holds = True
            return self._adopt_existing_slurm()
        if self.scheduler_choice is Scheduler.AUTO:
            why, unasked = (users, {}) if users else self._slurm_missing()
            if unasked:  # a node that could not be asked decides nothing: Slurm is not turned off for it
                return unasked
            if why and self.slurm_held_before:  # runs may be queued there: never stopped silently
                why = (
                    f"{why}; Slurm held this cluster's runs at the last bootstrap: install it again, or "
                    "fab bootstrap --scheduler none to stop it and hold runs in fab's connections"
                )
                return {r.name: Outcome("failed", why) for r in self.records}
            self.slurm_holds, self.scheduler_why = not why, why
            if why:
                say(f"bootstrap: runs stay in fab's connections, not in Slurm: {why}")
        if not self.slurm_holds:
            if not any("scheduler" in r.stages for r in self.records):
                self._write_join_kit(None)
                return {r.name: Outcome("n/a", "none") for r in self.records}

            def stopped(record: NodeRecord) -> Outcome:
                try:
                    self._call(record, calls.StopScheduler(), timeout=120)
                except NodeCallError as exc:  # an existing Slurm's jobs not cancelled: ask again
                    return Outcome("failed", f"not stopped: {exc.line}"[:300])
                self._forget(record, "scheduler")
                return Outcome("n/a", "none")

            outcomes = self._on_every_record(stopped)
            if all(o.status != "failed" for o in outcomes.values()):
                self._write_join_kit(None)  # no replacement node joins a Slurm that is gone: the kit has none
            return outcomes
        # Always asked: `start` leaves running daemons of an unchanged configuration alone (about 0.4 s), and
        # starts what is not running (a node restarted since), which no recorded digest can know.
        description = self._scheduler_description()
        wanted = digest(description, [self.manifest.get(path) for path in SCHEDULER_CODE])

        def start(record: NodeRecord) -> Outcome:
            recipe = kit.NodeKit(record.name, self.cluster.python, scheduler=description)
            try:
                started = self._apply_kit(record, "scheduler", recipe)
            except StageFailed as exc:
                return Outcome("failed", str(exc)[-300:])
            fresh = started.get("action") == "unchanged"
            if not fresh:
                self._record(record, "scheduler", wanted, {"scheduler": "slurm"})
            daemons = "slurmctld, slurmd" if record is self.records[0] else "slurmd"
            if started.get("started"):  # what had died, or did not serve (a munged killed), or a new configuration
                daemons = f"{daemons}; started {', '.join(started['started'])}"
            if started.get("room"):  # a node Slurm drained while its disk was full
                daemons = f"{daemons}; {started['room']}"
            return Outcome("up to date" if fresh else "done", daemons)

        outcomes = {
            self.records[0].name: start(self.records[0])
        }  # the controller first: every slurmd registers with it
        if outcomes[self.records[0].name].status == "failed":
            return {
                r.name: outcomes.get(r.name, Outcome("failed", "not started: the head node's failed"))
                for r in self.records
            }
        outcomes.update(self._on_every_record(start, self.records[1:]))
        if all(o.status != "failed" for o in outcomes.values()):
            self._write_join_kit(description)
        return outcomes

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

    def _adopt_existing_slurm(self) -> dict[str, Outcome]:
        """Own machines that already run Slurm (`slurm: existing`): each node finds its NodeName there
        (the hosts file's `slurm_name`, else its address, else its host name), then every node records the
        names, the partition and this stack's tag (contract.SLURM_EXISTING); no daemon of ours starts."""
        existing = self.cluster.slurm_existing
        partition, conf = existing.get("partition", ""), existing.get("conf", "")

        def identify(record: NodeRecord) -> Outcome:
            node = self.cluster.node(record.name)
            addresses = list(dict.fromkeys((node.public_ip, node.private_ip)))
            try:
                found = self._call(record, calls.IdentifyNode(partition, conf, node.slurm_name, addresses), timeout=60)
            except NodeCallError as exc:
                return Outcome("failed", exc.line[-300:])
            return Outcome("done", found.name)

        outcomes = self._on_every_record(identify)
        if any(o.status == "failed" for o in outcomes.values()):
            return outcomes
        names = {name: outcome.detail for name, outcome in outcomes.items()}
        taken: dict[str, str] = {}
        for node_name, slurm_name in names.items():
            if slurm_name in taken:
                why = (
                    f"{taken[slurm_name]} and {node_name} are both Slurm node {slurm_name}: "
                    "set slurm_name: for each host in the hosts file"
                )
                return {r.name: Outcome("failed", why) for r in self.records}
            taken[slurm_name] = node_name
        text = json.dumps({**existing, "names": names})
        wanted = digest(text, [self.manifest.get(path) for path in SCHEDULER_CODE])

        def adopt(record: NodeRecord) -> Outcome:
            where = f"existing Slurm: {names[record.name]}" + (f" ({partition})" if partition else "")
            if self._up_to_date(record, "scheduler", wanted):
                return Outcome("up to date", where)
            try:
                self._call(record, calls.AdoptSlurm({**existing, "names": names}), timeout=60)
            except NodeCallError as exc:
                return Outcome("failed", exc.line[-300:])
            self._record(record, "scheduler", wanted, {"scheduler": "slurm", "existing": names[record.name]})
            return Outcome("done", where)

        return self._on_every_record(adopt)

    def _on_every_record(
        self, work: Callable[[NodeRecord], Outcome], records: list[NodeRecord] | None = None
    ) -> dict[str, Outcome]:
        """`work` on each of `records` (default: every node's) at once; a node where it raised, failed."""
        chosen = self.records if records is None else records
        answers = on_all_nodes([r.session for r in chosen], lambda s: work(self._record_of(s)))
        return {a.name: a.value if a.value is not None else Outcome("failed", describe(a.error)) for a in answers}

    def _users_differ(self) -> str:
        """Why Slurm cannot run this cluster's jobs as one user (one line), or '' where every node logs in
        as the same user: a Slurm job runs as one user on every node."""
        users = {node.name: node.ssh_user or self.cluster.ssh_user for node in self.cluster.nodes}
        if len(set(users.values())) <= 1:
            return ""
        named = ", ".join(f"{user} on {name}" for name, user in users.items())
        return f"the nodes' users differ ({named}) and a Slurm job runs as one user on every node"

    def _slurm_missing(self) -> tuple[str, dict[str, Outcome]]:
        """Why Slurm cannot hold this cluster's runs (one line, '' where it can: Slurm's and munge's
        programs on every node, and no Slurm of the host's own to adopt instead), and the failed outcomes of
        the nodes that could not be asked ({} where all were)."""

        def check(record: NodeRecord) -> str:
            try:  # a node that answers no: its one line is the reason; one that does not answer raises
                self._call(record, calls.CheckScheduler(head=record is self.records[0]))
            except (UsageError, OperationError) as exc:
                return str(exc)[:300]
            return ""

        answers = on_all_nodes([r.session for r in self.records], lambda s: check(self._record_of(s)))
        if any(a.error is not None for a in answers):
            return "", {
                a.name: Outcome("failed", f"could not check for Slurm: {describe(a.error)}")
                if a.error is not None
                else Outcome("failed", "not decided: another node could not be checked")
                for a in answers
            }
        return next((a.value for a in answers if a.value), ""), {}

    def _write_join_kit(self, description: dict | None) -> None:
        """What a replacement node needs to join with nobody connected (node/join.py), in the shared folder
        (none without one), 0600 like the munge key it holds; `description` None: runs are fab's, no Slurm to
        join (the venv and the env file, which a fab-held fault-tolerant run's restarted group needs)."""
        if not self.cluster.shared_dir:
            return
        cluster_kit = {
            "python": self.cluster.python,
            "requirements": (REPO / "requirements-node.txt").read_text(),
            "env": {r.name: self.env_text(r) for r in self.records},
            "scheduler": description,
        }
        path = f"{self.cluster.shared_dir.rstrip('/')}/{contract.JOIN_KIT}"
        head = self.records[0].session
        quoted = node_paths.shell_path(path)
        # The file is made 0600 before the key goes in: SFTP writes into it and keeps its mode.
        folder = node_paths.shell_path(str(Path(path).parent))
        head.run(f"umask 077 && mkdir -p {folder} && : > {quoted}.tmp && chmod 600 {quoted}.tmp", warn=False)
        head.conn.put(io.StringIO(json.dumps(cluster_kit)), remote=f"{path}.tmp")
        head.run(f"mv {quoted}.tmp {quoted}", warn=False)

    def _scheduler_description(self) -> dict:
        """The scheduler's cluster description (node/slurm_conf.py): the nodes, the ports (above MASTER_PORT), the
        key."""
        first = self.master_port + 1
        if first + SCHEDULER_PORTS > 65535:
            raise UsageError(
                f"--master-port {self.master_port} leaves no room for Slurm's ports above it: "
                f"use at most {65535 - SCHEDULER_PORTS}"
            )
        key_path = state.stack_file(self.cluster.stack, state.MUNGE_KEY)
        if not key_path.exists():
            state.write_atomic(key_path, base64.b64encode(secrets.token_bytes(1024)).decode() + "\n")
        nodes = []
        for record, node in zip(self.records, self.cluster.nodes, strict=True):
            probe = record.facts("probe")
            nodes.append(
                {
                    "name": node.name,
                    "address": node.name if self.cluster.nodes_move else node.private_ip,
                    "cpus": int(probe.get("cpus") or 1),
                    "memory_mb": max(256, int(int(probe.get("memory_mb") or 1024) * 0.9)),
                    "gpus": node.gpus,
                }
            )
        return {
            "cluster": self.cluster.stack,
            "munge_key": key_path.read_text().strip(),
            "ports": {
                "slurmctld": first,
                "slurmd": first + 1,  # node i's: first + 1 + i, 16 nodes at most
                "srun": [first + 20, first + SCHEDULER_PORTS],
                **({"slurmdbd": first + 18} if self._head_keeps_accounting() else {}),
            },
            "nodes": nodes,
            "state_save": f"{self.cluster.shared_dir}/{contract.SCHEDULER_STATE}" if self.cluster.shared_dir else "",
        }

    def _head_keeps_accounting(self) -> bool:
        """Slurm's accounting (node/slurm_accounting.py) where the head node has slurmdbd and MariaDB: the AWS
        image installs them with Slurm, .ci/run too; elsewhere `sacct` has no history, and nothing fails.
        `--accounting none`: never (the database's first start takes 4 to 17 s)."""
        if self.accounting == "none":
            return False
        programs = " && ".join(f"command -v {name}" for name in ("slurmdbd", "mariadbd", "mariadb-install-db"))
        found = self.records[0].session.run(f"PATH=$PATH:/usr/sbin:/sbin; {programs}", warn=True)
        return found.ok

    def _check_master_reachable(self) -> dict[str, Outcome]:
        head = self.records[0]
        address, port = self.cluster.head.private_ip, str(self.master_port)
        listen_command = node_paths.node_module(
            self.cluster, self.python_for(head), "reach", "listen", address, port, str(len(self.records))
        )
        listened = []
        listener = threading.Thread(target=lambda: listened.append(head.session.run(listen_command)))
        listener.start()
        results = on_all_nodes(
            [r.session for r in self.records],
            lambda s: s.run(
                node_paths.node_module(
                    self.cluster, self.python_for(self._record_of(s)), "reach", "connect", address, port
                )
            ),
        )
        listener.join()
        outcomes = {}
        for record, answer in zip(self.records, results, strict=True):
            result = answer.value
            if result is None:
                outcomes[record.name] = Outcome("failed", describe(answer.error))
            elif result.exited != 0:
                why = result.stdout.strip() or result.stderr.strip()[-200:]
                outcomes[record.name] = Outcome("failed", f"cannot reach MASTER_ADDR {address}:{port}: {why}")
            else:
                outcomes[record.name] = Outcome("done", f"reaches {address}:{port}")
        if not listened or listened[0].exited != 0:
            why = listened[0].stderr if listened else "the listener's connection failed"
            outcomes[head.name] = Outcome("failed", f"cannot listen on {address}:{port}", why)
        return outcomes

    def _check_all_reduce(self) -> dict[str, Outcome]:
        """The preflight job (all-reduces across every node, and the fitness measurements the preflight
        stage judges): one job, so that a bootstrap starts torch on the nodes once."""
        setup = NodeSetup(self.master_port, {r.name: self.python_for(r) for r in self.records})
        found = fitness.check(self.cluster, [r.session for r in self.records], setup, self.stack_dir / "bootstrap")
        world = len(self.records)
        outcomes = {}
        for record in self.records:
            why = found.failed.get(record.name)
            if why is None and not found.failed:
                outcomes[record.name] = Outcome("done", f"all-reduce ok ({world} ranks)")
            else:
                outcomes[record.name] = Outcome(
                    "failed",
                    f"all-reduce failed: {why or 'on another node'}",
                    "\n".join(found.tails.get(record.name, [])),
                )
        if not found.failed:
            self.fitness = found
            fitness.save(self.cluster, found)
        return outcomes

    def preflight(self) -> dict[str, Outcome]:
        """Each node's verdict from the health stage's measurements (remote/fitness.py); a CRITICAL node is
        shown, and refused by launches, but bootstrap completes (--skip-preflight can still use it)."""
        found = self.fitness
        if found is None:
            recorded = fitness.recorded(self.cluster)
            return {r.name: Outcome("up to date", recorded.get(r.name, "")) for r in self.records}
        outcomes = {}
        for record in self.records:
            verdict = found.verdicts[record.name]
            gflops = next((n.get("gflops") for n in found.report["nodes"] if n["node"] == record.name), None)
            detail = f"{gflops:.1f} GFLOP/s" if gflops else ""
            status = "done" if verdict.level == "OK" else verdict.level
            outcomes[record.name] = Outcome(status, f"{detail}; {verdict.why()}" if verdict.level != "OK" else detail)
        for verdict in found.critical:
            say(f"bootstrap: preflight: {verdict.node} is CRITICAL ({verdict.why()}): launches refuse it")
        return outcomes

    def watchdog(self, record: NodeRecord) -> Outcome:
        """The budget and idle guard on node-0, from `.cluster/<stack>/guards.json` (written by `up`)."""
        if record is not self.records[0]:
            return Outcome("n/a", "")
        guards = {k: v for k, v in _read_json(self.stack_dir / state.GUARDS).items() if v is not None}
        wanted = digest(
            guards,
            self.cluster.hourly_usd,
            self.cluster.created_at,
            self.python_for(record),
            *((REPO / path).read_text() for path in WATCHDOG_CODE),
        )
        alive = record.session.run(self._watchdog_alive_command()).exited == 0
        if self._up_to_date(record, "watchdog", wanted) and alive == bool(guards):
            return Outcome("up to date", _guard_text(guards))
        if alive:
            record.session.run(self._watchdog_stop_command())
        if guards and not self.cluster.shared_dir:
            raise StageFailed("the watchdog needs shared storage to reach every node; this cluster has none")
        # Recorded before it starts: a watchdog that powers the node off at once (a short idle guard)
        # must not cut the stage short. A recorded watchdog that is not running is started again.
        self._record(record, "watchdog", wanted, guards)
        if guards:
            result = record.session.run(self._watchdog_start_command(record, guards), timeout=120)
            if result.exited != 0:
                raise StageFailed("could not start the watchdog", result.stdout + result.stderr)
        return Outcome("done", _guard_text(guards))

    def _watchdog_argv(self, record: NodeRecord, guards: dict) -> list[str]:
        from datetime import datetime

        home = record.facts("probe").get("home") or "~"
        argv = [
            self.python_for(record),
            "-m",
            "harness.watchdog",
            "--shared-dir",
            self.cluster.shared_dir,
            "--hourly-usd",
            f"{self.cluster.hourly_usd:g}",
            "--started-at",
            f"{datetime.fromisoformat(self.cluster.created_at).timestamp():.0f}",
            "--job-file",
            f"{home}/{contract.JOB}",
            "--progress-dir",
            f"{home}/{contract.PROGRESS}",
        ]
        if guards.get("max_total_usd") is not None:
            argv += ["--max-total-usd", f"{guards['max_total_usd']:g}"]
        if guards.get("idle_minutes") is not None:
            argv += ["--idle-minutes", f"{guards['idle_minutes']:g}"]
        return argv

    def _watchdog_start_command(self, record: NodeRecord, guards: dict) -> str:
        code = node_paths.code_dir(self.cluster)
        argv = " ".join(shlex.quote(a) for a in self._watchdog_argv(record, guards))
        if self.cluster.daemon == "detached":
            # Its own session, output to a file, registered in the node's pid registry: the SSH session
            # ends at once, and powering the node off (or `down`) finds it.
            # The braces matter: `cd X && Y &` would put a subshell in the background that keeps the
            # session's output open (the command would not return until the watchdog exits) and whose
            # pid, not the watchdog's, `$!` would record.
            return (
                f"cd {node_paths.shell_path(code)} && {{ PYTHONPATH={node_paths.shell_path(code)} setsid {argv} "
                f">> {contract.shell(contract.WATCHDOG_LOG)} 2>&1 < /dev/null & "
                f"echo $! > {contract.shell(contract.WATCHDOG_PID)}; }}"
            )
        unit = WATCHDOG_UNIT.format(user=record.session.node.ssh_user, code=code, argv=argv)
        record.session.conn.put(io.StringIO(unit), remote=contract.WATCHDOG_UNIT_FILE)
        return (
            f"sudo -n install -m 644 {contract.shell(contract.WATCHDOG_UNIT_FILE)} /etc/systemd/system/ && "
            f"sudo -n systemctl daemon-reload && sudo -n systemctl enable {contract.WATCHDOG_UNIT} && "
            f"sudo -n systemctl restart {contract.WATCHDOG_UNIT}"
        )

    def _watchdog_alive_command(self) -> str:
        if self.cluster.daemon == "detached":
            pid = contract.shell(contract.WATCHDOG_PID)
            return f'[ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null'
        return f"systemctl is-active --quiet {contract.WATCHDOG_UNIT}"

    def _watchdog_stop_command(self) -> str:
        if self.cluster.daemon == "detached":
            pid = contract.shell(contract.WATCHDOG_PID)
            return f'kill -TERM -- -"$(cat {pid})" 2>/dev/null; rm -f {pid}; true'
        return f"sudo -n systemctl disable --now {contract.WATCHDOG_UNIT}; true"

    # ------------------------------------------------------------------------------- results

    def _save_setup(self) -> None:
        state.BootstrapRecord(
            master_port=self.master_port,
            python={r.name: self.python_for(r) for r in self.records},
            code_dir=node_paths.code_dir(self.cluster),
            slurm_holds=self.slurm_holds,
            scheduler_choice=self.scheduler_choice.value,
            scheduler_why=self.scheduler_why,
            accounting=self.accounting,
            nodes={r.name: {"probe": r.facts("probe"), "deps": r.facts("deps")} for r in self.records},
            completed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            timeline=self.timeline.as_dict(),
        ).write(self.cluster.stack)

    def _report(self, failed_stage: str | None = None) -> None:
        table = Table(title=f"bootstrap of '{self.cluster.stack}'", show_lines=False)
        table.add_column("node")
        for stage in self.outcomes:
            table.add_column(stage)
        for record in self.records:
            cells = []
            for stage in self.outcomes:
                outcome = self.outcomes[stage][record.name]
                mark = {"failed": "[red]FAILED[/red]", "done": "[green]ok[/green]", "n/a": "-"}.get(
                    outcome.status, outcome.status
                )
                cells.append(f"{mark} {outcome.detail}".strip())
            table.add_row(record.name, *cells)
        out = console()
        out.print(table)
        if failed_stage:
            for name, outcome in self.outcomes[failed_stage].items():
                if outcome.status == "failed":
                    out.print(f"[bold]{name}[/bold]: {failed_stage} failed: {outcome.detail}")
                    for line in outcome.output.strip().splitlines()[-20:]:
                        out.print(f"  [{name}] {line}", markup=False)


def remembered_setup(cluster: ClusterInfo) -> state.BootstrapRecord:
    """What the last bootstrap of the cluster chose (`bootstrap.json`: master_port, scheduler); empty if none."""
    return state.bootstrap_record(cluster.stack)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _guard_text(guards: dict) -> str:
    parts = []
    if guards.get("max_total_usd") is not None:
        parts.append(f"budget ${guards['max_total_usd']:g}")
    if guards.get("idle_minutes") is not None:
        parts.append(f"idle {guards['idle_minutes']:g} min")
    return ", ".join(parts) or "no guard set"


def _parse_state(text: str) -> dict:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {}  # a damaged state file only means every stage runs again


def _hardware(facts: dict) -> str:
    gpus = facts.get("gpus") or []
    if not gpus:
        return "CPU node: gloo"
    return f"{len(gpus)}x {gpus[0]['name']}, driver {facts.get('driver')}, CUDA {facts.get('cuda')}"


def _torch(facts: dict) -> str:
    """`torch 2.13.0 (CPU)`, and how the venv was topped up where it was (`, with pip: no uv on this node`)."""
    torch = (
        f"torch {facts.get('torch')}, NCCL {facts['nccl']}"
        if facts.get("nccl")
        else f"torch {facts.get('torch')} (CPU)"
    )
    if facts.get("installer") == "pip" and facts.get("installer_why"):
        return f"{torch}, with pip: {facts['installer_why']}"
    return f"{torch}, with uv" if facts.get("installed") and facts.get("installer") == "uv" else torch


def _sftp(destination: str, relative: str) -> str:
    """SFTP does not expand $HOME; relative paths start in the login directory."""
    return f"{contract.home_relative(destination)}/{relative}"
