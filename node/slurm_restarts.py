"""In a fault-tolerant Slurm-held run's batch job: its replica groups started again on replaced nodes (the one
restarter, node/replicas.py, given Slurm's node states and srun), and whether the run completed.

Standard library only.
"""

import json
import os
import re
import signal
import subprocess
import threading

from node import contract, replicas, slurm_nodes, slurm_output
from node.run_spec import RunSpec, SpecNode
from node.slurm_conf import Paths
from node.slurm_step import exit_status, step_argv

HEAL_POLL_S = 1.0
"""How often a fault-tolerant run's batch job looks for replica groups whose nodes were replaced."""
HEAL_END_GRACE_S = 60.0
"""How long a group started again may go on after the run's own step ended (it ends at the peers' step)."""
STOPPED_GRACE_S = 10.0
"""How long a group started again has to end after the run was stopped (a cancel, a requeue)."""


def replica_groups(spec: RunSpec) -> list[tuple[SpecNode, ...]]:
    """The spec's nodes in its replica groups (consecutive, equal; remote/job_command.py `replica_groups`)."""
    nodes, count = spec.nodes, max(spec.replicas, 1)
    size = len(nodes) // count
    return [nodes[i * size : (i + 1) * size] for i in range(count)]


def back_in_service(groups: list[tuple[SpecNode, ...]], node_states: dict) -> set:
    """The groups' nodes (their names) back in service: Slurm shows them `idle`, held out neither for a notice
    nor as lost. The run's job holds all its nodes exclusively, so an idle one has left it (Slurm took a lost
    node out of the --no-kill allocation) and its replacement is back."""
    back = set()
    for node in (node for members in groups for node in members):
        state, reason = node_states.get(node.in_slurm, ("", ""))
        if state == "idle" and not slurm_nodes.lost_or_noticed(reason):
            back.add(node.name)
    return back


class GroupRestarts:
    """Beside a fault-tolerant run's step, in its batch job: each replica group whose nodes were replaced (a
    node lost or reclaimed leaves the --no-kill allocation; node/join.py brings its replacement back in
    service) is started again there, as a one-group step of an allocation of its own (Slurm cannot grow the
    run's), with CLUSTER_RESTART_COUNT 0: it heals from a live peer, reads no checkpoint, and rejoins the
    quorum. A line in HEALS_RECORD prices its interruption."""

    def __init__(self, spec: RunSpec, srun: str):
        self.spec, self.srun = spec, srun
        self.paths, self.groups = Paths(spec.head.home), replica_groups(spec)
        self.folder = spec.folder
        self.processes: dict = {}  # group: its start's srun
        self.node_states: dict = {}  # Slurm's, at the last look
        self.stopping = threading.Event()  # signalled (a cancel, a requeue): no group is started again
        names = [[node.name for node in members] for members in self.groups]
        self.restarter = replicas.GroupRestarter(
            names, lambda: back_in_service(self.groups, self.node_states), self._start
        )

    def signal(self, number: int) -> None:
        if number != signal.SIGUSR1:
            self.stopping.set()
        for process in list(self.processes.values()):
            process.send_signal(number)

    def look(self) -> None:
        """One look, every HEAL_POLL_S: the starts that ended, the groups that left, the groups due."""
        for number, process in list(self.processes.items()):
            if process.poll() is not None:
                self.restarter.ended_start(number, exit_status(process.returncode))
                del self.processes[number]
        self.node_states = slurm_nodes.node_reasons(self.paths)
        for number, members in enumerate(self.groups):
            if any(self.node_states.get(n.in_slurm, ("", ""))[0] != "allocated" for n in members):
                self.restarter.left(number)
        if not self.stopping.is_set():
            self.restarter.look()
        self._record()

    def finish(self) -> None:
        """After the run's step: each group started again that is back in the quorum ends at the peers' step
        (a stopped one with it); one that has not rejoined has no peer left to heal from and is stopped now."""
        metrics = os.path.join(self.folder, contract.METRICS_FILE)
        orphans = set(self.restarter.not_rejoined(replicas.contract_lines(metrics, 1 << 16)))
        for number, process in self.processes.items():
            if number in orphans and process.poll() is None:
                print(
                    f"[cluster] replica group {number} had not rejoined when the run's other groups ended: "
                    "no peer is left to heal from, so it is stopped",
                    flush=True,
                )
                process.terminate()
            try:
                process.wait(
                    timeout=STOPPED_GRACE_S if self.stopping.is_set() or number in orphans else HEAL_END_GRACE_S
                )
            except subprocess.TimeoutExpired:
                process.terminate()
                process.wait()
        self._record(last=True)

    def beside(self, main: subprocess.Popen) -> int:
        """The run's step's exit status, once it and the groups started again beside it have ended."""
        while True:
            try:
                code = exit_status(main.wait(timeout=HEAL_POLL_S))
                break
            except subprocess.TimeoutExpired:
                self.look()
        self.finish()
        return code

    def _start(self, number: int) -> bool:
        members = self.groups[number]
        print(
            f"[cluster] replica group {number} ({', '.join(n.name for n in members)}): back in service after "
            "a replacement; it starts again and heals from a live peer",
            flush=True,
        )
        argv = step_argv(
            self.spec.replace(nodes=members),
            self.srun,
            f"--job-name={self.spec.run_id}-replica-{number}",
            f"--nodelist={','.join(node.in_slurm for node in members)}",
        )
        # without the batch job's SLURM_* (but Slurm's configuration), srun asks for an allocation of its own
        # rather than a step of this job's, whose nodes Slurm cannot add back
        own = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        self.processes[number] = slurm_output.popen(argv, env=own)
        return True

    def _record(self, last: bool = False) -> None:
        """HEALS_RECORD's line for each group started again, once its first step back is in the metrics (or,
        at the end, its start): from when its nodes left until it was back in the quorum."""
        metrics = os.path.join(self.folder, contract.METRICS_FILE)
        for line in self.restarter.heal_records(metrics, last=last):
            path = os.path.join(self.folder, contract.HEALS_RECORD)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
                f.write(json.dumps(line) + "\n")


def survived(spec: RunSpec, tail_bytes: int = 1 << 18) -> bool:
    """Whether a fault-tolerant run completed (contract.surviving_group), from each node's last exit marker
    in the end of the run's log (a group started again writes its node's marker after the first)."""
    try:
        with open(spec.log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    marker = re.compile(rf"^\[([^\]\s]+)\] {re.escape(contract.EXIT_MARKER)} (-?\d+)", re.M)
    codes = {name: int(code) for name, code in marker.findall(text)}
    return contract.surviving_group([[n.name for n in members] for members in replica_groups(spec)], codes)
