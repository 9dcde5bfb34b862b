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

import json
import threading
import time

from rich.table import Table

from infra import hints, state
from infra.errors import OperationError, ReportedFailure, UsageError
from infra.inventory import ClusterInfo
from infra.timeline import Timeline
from node import contract
from remote import fitness, node_paths, protocol
from remote.bootstrap_health import HealthStages
from remote.bootstrap_node import NodeStages
from remote.bootstrap_slurm import Scheduler, SlurmStage
from remote.bootstrap_stage import (
    REPO,
    ClusterStage,
    NodeRecord,
    NodeStage,
    Outcome,
    Stage,
    local_manifest,
    remembered_setup,
)
from remote.bootstrap_watchdog import WatchdogStage
from remote.connect import NodeSession, on_all_nodes, open_sessions
from remote.stream import console, say


class Bootstrap(NodeStages, HealthStages, SlurmStage, WatchdogStage):
    """One `fab bootstrap` run over a cluster: the driver. Each group of stages is a class of its own module
    (remote/bootstrap_node.py, bootstrap_health.py, bootstrap_slurm.py, bootstrap_watchdog.py)."""

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


def _parse_state(text: str) -> dict:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {}  # a damaged state file only means every stage runs again
