"""In a Slurm-held run's batch job, on the head node: the run's watch (node/run_watch.py), asking the nodes
through srun steps that share the run's allocation, and `--on-straggler replace` (`StragglerReplacement`).

The spec's `watch` (node/run_spec.py's WatchSpec; remote/scheduled.py fills it): `status` and `collect`, each
node's command that answers the watch; `timeout_s`, `poll_s`, `on_hang`, `overdue_grace_s`; `on_straggler`,
and `tell_ranks` (each node's command that tells its ranks to save and exit); `shared_dir` where the cluster
has a shared folder.

Standard library only.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from node import contract, frames, slurm_nodes, straggler
from node.run_spec import RunSpec, WatchSpec
from node.run_watch import OVERDUE_GRACE_S, RunWatch, WatchPolicy
from node.slurm_conf import Paths
from node.slurm_daemons import write_private
from node.slurm_step import exit_status, step_argv

STRAGGLER_EXIT_GRACE_S = 120.0
"""`--on-straggler replace`: how long a straggler's ranks have to save and exit after SIGUSR1 (a spot notice's
two minutes) before the watch ends the step itself (SIGTERM, then SIGKILL `STRAGGLER_KILL_AFTER_S` later): a
script that ignores the signal, run with `--max-restarts`, would otherwise be started again in place by
torchrun, and the node never replaced."""
STRAGGLER_KILL_AFTER_S = 30.0


def watch(spec: RunSpec, options: WatchSpec, main: subprocess.Popen, srun: str) -> int:
    """The run's watch (`options`, the spec's) beside its running step `main` (and, with `--on-straggler
    replace`, the straggler's node replaced); the step's exit status."""
    folder = spec.folder
    replacing = StragglerReplacement(spec, options, srun) if options.on_straggler == "replace" else None
    shared = os.path.join(folder, contract.STEP_TIMES) if options.shared_dir else None

    def ended(timeout_s: float) -> bool:
        try:
            main.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            pass
        number = replacing.overdue() if replacing is not None else None
        if number is not None:
            print(
                f"[watch] --on-straggler replace: the step has not ended {STRAGGLER_EXIT_GRACE_S:.0f} s after its "
                f"ranks were told to save and exit: ending it ({signal.Signals(number).name})",
                flush=True,
            )
            main.send_signal(number)
        return False

    def ask(action: str) -> list:
        commands = {"status": options.status, "collect": options.collect}[action]
        if not commands:
            return []
        return ask_nodes(with_commands(spec, commands), srun, apart=action == "collect")

    def keep(name: str, text: str) -> None:
        write_private(os.path.join(folder, name), text.encode(), 0o600)

    grace_s = OVERDUE_GRACE_S if options.overdue_grace_s is None else options.overdue_grace_s
    policy = WatchPolicy(options.timeout_s, options.poll_s, options.on_hang, grace_s)
    run_watch = RunWatch(
        spec.run_id,
        policy,
        ask,
        lambda: main.send_signal(signal.SIGTERM),
        ended,
        lambda line: print(f"[watch] {line}", flush=True),
        keep,
        # each node's recorder dumps and stacks go into the record: fab keeps them in the run's hang/
        on_verdict=lambda record: keep(contract.HANG_RECORD, json.dumps(record)),
        read_shared=(lambda: straggler.read_step_times(shared)) if shared else None,
        take_out=replacing.take_out if replacing is not None else None,
    )
    try:
        run_watch.run()
        return exit_status(main.wait())
    finally:
        if replacing is not None:
            replacing.close()  # a verdict from now on takes no node out: the step has ended
            replacing.power_off()


def with_commands(spec: RunSpec, commands: dict) -> RunSpec:
    """The spec, each node's command replaced by its own in `commands` (a node it lacks: left out), no watch."""
    nodes = tuple(node.replace(command=commands[node.name]) for node in spec.nodes if node.name in commands)
    return spec.replace(nodes=nodes, watch=None)


def ask_nodes(probe: RunSpec, srun: str, apart: bool = False) -> list:
    """Every node's answer (one JSON line each), through a step that shares the run's allocation; `apart`:
    a step per node, at once (a collect's answers are large, and srun interleaves long lines of several
    nodes' output)."""
    job = f"--jobid={os.environ.get('SLURM_JOB_ID', '')}"
    if apart and len(probe.nodes) > 1:
        one_each = [probe.replace(nodes=(node,)) for node in probe.nodes]
        with ThreadPoolExecutor(max_workers=len(one_each)) as pool:
            return [answer for answers in pool.map(lambda one: ask_nodes(one, srun), one_each) for answer in answers]
    options = ["--overlap", job]
    if len(probe.nodes) == 1:
        options.append(f"--nodelist={probe.head.in_slurm}")
    try:
        result = subprocess.run(step_argv(probe, srun, *options), capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = frames.unframed(result.stdout).decode(errors="replace").splitlines()
    return contract.json_objects(re.sub(r"^\[[^\]]*\] ", "", line) for line in lines)


class StragglerReplacement:
    """`--on-straggler replace`, in the batch job: a straggler's node goes the way of a reclaimed spot node.
    Drained in Slurm (`contract.STRAGGLER_DRAIN_REASON`: no run starts there again), its ranks told to save
    and exit (SIGUSR1, `spot_watch.py --tell-ranks`: the other ranks stop at the same step); once the step
    has ended, the node is told to power off (`contract.power_off_marker`). The run is then requeued as a
    notice's is (slurm_batch.py `requeue_if_preempted`: the drain is one of ours), the spot path replaces the
    node (the local provider's supervisor, an AWS worker's Auto Scaling group), the replacement's join lifts
    the drain, and the run starts again there and resumes from its checkpoint. The head node is not
    replaced: it holds this job and Slurm's controller."""

    def __init__(self, spec: RunSpec, options: WatchSpec, srun: str):
        self.spec, self.options, self.srun = spec, options, srun
        self.taken_out: list = []
        self.lock = threading.Lock()
        """The watch's polls and its shared looks may each name a rank of the same node."""
        self.told_at: float | None = None
        """When a straggler's ranks were last told to save and exit (monotonic)."""
        self.sent: list = []
        """The signals `overdue` has had the watch send the step."""
        self.closed = False
        """The step has ended: a straggler named now takes no node out (its run would be requeued for it)."""

    def take_out(self, fresh: list) -> None:
        with self.lock:
            if not self.closed:
                self._take_out(fresh)

    def close(self) -> None:
        with self.lock:
            self.closed = True

    def _take_out(self, fresh: list) -> None:
        head = self.spec.head
        for found in fresh:
            node = self.spec.node(found.node)
            if node is None or found.node in self.taken_out:
                continue
            if node is head:
                print(f"[watch] --on-straggler replace: {found.node} is the head node: not replaced", flush=True)
                continue
            paths = Paths(head.home)  # the batch job's HOME is the user's, not the node's
            said = slurm_nodes.drain_straggler(paths, node.in_slurm, found.why())
            if said != "drained":  # not held out: its run would not be requeued, so it is left as it is
                print(f"[watch] --on-straggler replace: {found.node} not drained ({said}): not replaced", flush=True)
                continue
            print(f"[watch] --on-straggler replace: {found.node} drained; its ranks save and exit", flush=True)
            tell = self.options.tell_ranks[found.node]
            ask_nodes(with_commands(self.spec.replace(nodes=(node,)), {found.node: tell}), self.srun)
            self.taken_out.append(found.node)
            self.told_at = time.monotonic()

    def overdue(self) -> int | None:
        """The signal the watch sends the step where it outlived the grace after the ranks were last told:
        SIGTERM once, then SIGKILL once `STRAGGLER_KILL_AFTER_S` later; else None."""
        with self.lock:
            if self.told_at is None:
                return None
            waited = time.monotonic() - self.told_at
            for number, after in ((signal.SIGTERM, 0.0), (signal.SIGKILL, STRAGGLER_KILL_AFTER_S)):
                if number not in self.sent and waited >= STRAGGLER_EXIT_GRACE_S + after:
                    self.sent.append(number)
                    return number
            return None

    def power_off(self) -> None:
        """Once the step has ended: each node taken out told to power off (the spot path replaces it)."""
        with self.lock:
            taken_out = list(self.taken_out)
        for name in taken_out:
            marker = os.path.join(self.options.shared_dir, contract.power_off_marker(name))
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            record = {"run_id": self.spec.run_id, "reason": contract.STRAGGLER_DRAIN_REASON, "at": time.time()}
            write_private(marker, json.dumps(record).encode(), 0o600)
            print(f"[watch] {name} powers off: it is replaced, and the run resumes there", flush=True)
