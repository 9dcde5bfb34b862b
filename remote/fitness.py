"""`fab preflight`: every node's fitness for a job, judged (node/fitness.py's rules).

The checks are one torchrun job of `harness/fitness.py`, one process per node, run over the job sessions
as bootstrap's health check ran its all-reduce (the same `run_job`): it is bootstrap's last stage, and a
launch's first step with `--preflight`. Rank 0 prints the report; `node.fitness.judge` gives each node
OK, WARN or CRITICAL with its reasons; a CRITICAL node makes the preflight fail (exit 1) and a launch
refuse to start, unless `--skip-preflight`.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra import state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from node import fitness
from remote import job_command, node_paths, options, protocol
from remote.connect import NodeSession
from remote.job_spec import JobSpec, NodeSetup
from remote.launch import run_job
from remote.stream import console

SCRIPT = "harness/fitness.py"


@dataclass
class Fitness:
    """One preflight: the report rank 0 printed, each node's verdict, and how long it took."""

    report: dict
    verdicts: dict
    seconds: float
    failed: dict = field(default_factory=dict)
    """{node: why} where the job itself failed on a node (no report: each such node is CRITICAL)."""
    tails: dict = field(default_factory=dict)
    """{node: the last lines of its output}, where the job failed."""

    @property
    def named(self) -> list:
        """The verdicts that are not OK, worst first."""
        return fitness.named(self.verdicts)

    @property
    def critical(self) -> list:
        return [v for v in self.named if v.level == fitness.CRITICAL]

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "nodes": [self.verdicts[n["node"]].as_dict() | n for n in self._nodes()],
            "pairs": self.report.get("pairs", []),
            "named": [v.node for v in fitness.named(self.verdicts)],
            "thresholds": thresholds(),
        }

    def _nodes(self) -> list:
        return self.report.get("nodes") or [{"node": name} for name in self.verdicts]


def thresholds() -> dict:
    return {
        "slow_fraction": fitness.SLOW_FRACTION,
        "very_slow_fraction": fitness.VERY_SLOW_FRACTION,
        "shared_machine_slow_fraction": fitness.SHARED_SLOW_FRACTION,
        "shared_machine_very_slow_fraction": fitness.SHARED_VERY_SLOW_FRACTION,
        "min_free_disk_gb": fitness.MIN_FREE_DISK_GB,
        "low_free_disk_gb": fitness.LOW_FREE_DISK_GB,
        "min_available_memory_gb": fitness.MIN_AVAILABLE_MEMORY_GB,
        "clock_skew_warn_s": fitness.CLOCK_SKEW_WARN_S,
        "clock_skew_critical_s": fitness.CLOCK_SKEW_CRITICAL_S,
        "critical_xids": sorted(fitness.CRITICAL_XIDS),
    }


def refuse_busy(cluster: ClusterInfo, head: NodeSession, port: int) -> None:
    """UsageError where MASTER_PORT is taken on the head node: a job runs (its rendezvous holds it), and a
    preflight beside it would measure the job, not the nodes, and could not form its own group."""
    source = (Path(__file__).resolve().parent.parent / "node" / "port_free.py").read_text()
    verdict = head.run(protocol.python_json_command(cluster.python, source, cluster.head.private_ip, str(port)))
    if verdict.stdout.strip().startswith("in use"):
        raise UsageError(
            f"a job holds MASTER_PORT {port} on {head.node.name}: the preflight measures an idle cluster; "
            "wait for the job (fab jobs) or stop it (fab stop), then run it again"
        )


def check(cluster: ClusterInfo, sessions: list[NodeSession], setup: NodeSetup, log_dir: Path) -> Fitness:
    """Run the preflight job on every node and judge it."""
    started = time.monotonic()
    spec = JobSpec(
        "preflight",
        SCRIPT,
        ["--expect-world-size", str(len(sessions)), "--timeout", "60"],
        nproc_per_node=1,
        hang=options.hang_policy("0", None),
    )
    run_id = job_command.new_run_id("preflight")
    result = run_job(cluster, sessions, spec, setup, run_id, log_dir / run_id, echo=False)
    sessions[0].run(f"rm -rf {node_paths.shell_path(node_paths.remote_run_dir(cluster, run_id))}", warn=True)
    if result.interrupted:  # Ctrl-C stopped the job: no measurement, no verdict on any node
        raise KeyboardInterrupt
    head_log = log_dir / run_id / f"{sessions[0].node.name}.log"
    report = fitness.report_line(head_log.read_text(errors="replace")) if head_log.exists() else None
    seconds = time.monotonic() - started
    if report is None or any(code != 0 for code in result.exit_codes.values()):
        failed = {
            name: f"the preflight job failed (exit {code})" for name, code in result.exit_codes.items() if code != 0
        } or {sessions[0].node.name: "the preflight job printed no report"}
        verdicts = {s.node.name: fitness.Verdict(s.node.name) for s in sessions}
        for name, why in failed.items():
            verdicts[name].add(fitness.CRITICAL, why)
        return Fitness(report or {}, verdicts, seconds, failed, result.tails)
    return Fitness(report, fitness.judge(report), seconds)


def save(cluster: ClusterInfo, found: Fitness) -> Path:
    path = state.stack_file(cluster.stack, state.PREFLIGHT)
    state.write_atomic(path, json.dumps(found.as_dict(), indent=2) + "\n")
    return path


def recorded(cluster: ClusterInfo) -> dict:
    """{node: "VERDICT why"} of the last preflight ({} where none was kept)."""
    try:
        kept = json.loads(state.stack_file(cluster.stack, state.PREFLIGHT).read_text())
        return {n["node"]: f"{n['verdict']}: {n['why']}" for n in kept["nodes"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def recorded_critical(cluster: ClusterInfo) -> list:
    """The nodes the last preflight found CRITICAL, each with why: [(node, why)]."""
    return [
        (node, line.split(": ", 1)[1])
        for node, line in recorded(cluster).items()
        if line.startswith(fitness.CRITICAL + ":") and node in {n.name for n in cluster.nodes}
    ]


def show(found: Fitness) -> None:
    """The verdict table, then the named nodes (one line each) and the bandwidth matrix."""
    from rich.table import Table  # rich loads only for a table: fab's start stays short (issue 41)

    table = Table(title=f"preflight ({found.seconds:.1f} s)")
    for column in ("node", "verdict", "GFLOP/s", "mem avail GB", "disk free GB", "clock ms", "why"):
        table.add_column(column)
    colour = {fitness.OK: "green", fitness.WARN: "yellow", fitness.CRITICAL: "red"}
    for node in found._nodes():
        verdict = found.verdicts[node["node"]]
        table.add_row(
            node["node"],
            f"[{colour[verdict.level]}]{verdict.level}[/]",
            _number(node.get("gflops")),
            _number(node.get("memory_available_gb")),
            _number(node.get("disk_free_gb")),
            _number(None if node.get("clock_offset_s") is None else node["clock_offset_s"] * 1000),
            verdict.why(),
        )
    out = console()
    out.print(table)
    pairs = found.report.get("pairs") or []
    if pairs:
        out.print("all-reduce GB/s per pair: " + ", ".join(f"{p['a']}-{p['b']} {p['gbps']:.3f}" for p in pairs))


def _number(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def refusal(critical: list) -> str:
    """The one line a launch refuses with, naming every CRITICAL node and why ([(node, why)])."""
    named = "; ".join(f"{node}: {why}" for node, why in critical)
    return (
        f"preflight: {named} (CRITICAL): nothing was started; replace the node, fab preflight again once "
        "it is fixed, or launch with --skip-preflight"
    )


def gate(cluster: ClusterInfo) -> None:
    """Before a launch: OperationError (exit 1, the cluster is not fit) where the last preflight found a
    node CRITICAL."""
    critical = recorded_critical(cluster)
    if critical:
        raise OperationError(refusal(critical))
