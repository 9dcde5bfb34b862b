"""On the head node: a run as one Slurm batch job, one task per node, every node's output in the run's log.

    python node/slurm_run.py supervise SPEC_BASE64 # the batch script: the step, the hang watch, the requeue
    python node/slurm_run.py follow LOG JOB [OFFSET]  # the log from OFFSET as it grows, until the job ends

and, through node/calls.py, SubmitRun (sbatch a spec file; the job id), RunStates (each job's state and
times) and CancelRun (scancel, saying the state it had).

SPEC_FILE is JSON: {"run_id", "log": the run's log file (on the head node), "python": this interpreter
on every node, "nodes": [{"name": "node-<i>", "home": the node user's home there, "command": a shell
command}, head node first]}. `submit` writes nothing on the other nodes: the batch script (kept beside
the log) carries the spec, and srun hands it to every node's `step` on its command line.

The batch job takes every node, exclusively, so runs start one at a time in submission order, and
appends to its log across requeues. Its one step is `srun --ntasks-per-node=1 --kill-on-bad-exit=1`:
a node whose command fails ends the others at once. A fault-tolerant run's (spec `replicas`: torchft
replica groups) is `--kill-on-bad-exit=0 --no-kill` in a `--no-kill` job instead: a group's node that
fails or dies ends only that group, and the others train on in the same allocation; a group whose nodes
were replaced is started again on them, beside the step, by the batch job (GroupRestarts). Each node's
task is node/slurm_step.py, a file of its own that starts in milliseconds: it runs this node's command and
prefixes its output (`[node-i] `) in records Slurm carries whole, joined into the log by node/slurm_output.py.

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import argparse
import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, frames, slurm_existing, slurm_nodes, slurm_output  # noqa: E402
from node.slurm_conf import DaemonError, Paths, UsageError  # noqa: E402
from node.slurm_daemons import gone, program, write_private  # noqa: E402

TERMINATE_GRACE_S = 5.0
FOLLOW_POLL_S = 0.1
STATE_POLL_S = 1.0
SUBMIT_TIMEOUT_S = 30.0
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
"""Slurm's job states after which a job runs no more (a requeued job goes back to PENDING first)."""
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT"})
"""Slurm's job states of a job that waits to start (again)."""
FIELD = re.compile(r"(\w+)=(\S*)")
HEAL_POLL_S = 1.0
"""How often a fault-tolerant run's batch job looks for replica groups whose nodes were replaced."""
HEAL_END_GRACE_S = 60.0
"""How long a group started again may go on after the run's own step ended (it ends at the peers' step)."""
STRAGGLER_EXIT_GRACE_S = 120.0
"""`--on-straggler replace`: how long a straggler's ranks have to save and exit after SIGUSR1 (a spot notice's
two minutes) before the watch ends the step itself (SIGTERM, then SIGKILL `STRAGGLER_KILL_AFTER_S` later): a
script that ignores the signal, run with `--max-restarts`, would otherwise be started again in place by
torchrun, and the node never replaced."""
STRAGGLER_KILL_AFTER_S = 30.0


def _encoded(spec: dict) -> str:
    return base64.b64encode(json.dumps(spec).encode()).decode()


def step_argv(spec: dict, srun: str, here: str, *options: str) -> list:
    """srun of `node/slurm_step.py` (beside this file, `here`) on every node, one task each (`options`:
    srun's, e.g. --overlap)."""
    count = len(spec["nodes"])
    return [
        srun,
        *options,
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",  # and Slurm's line-buffered output: each of the step's records one message
        "--export=NONE",  # each node's step: Slurm's variables only (`step` sets HOME and PATH), not the head's
        spec["python"],
        "-u",
        os.path.join(os.path.dirname(here), "slurm_step.py"),
        _encoded(spec),
    ]


def step_options(spec: dict) -> tuple[str, ...]:
    """The run's step: one node's failure ends every node's task, except in a fault-tolerant run
    (`replicas`), where each node's task is a replica group of its own that the others outlive."""
    if spec.get("replicas"):
        return ("--kill-on-bad-exit=0", "--no-kill")
    return ("--kill-on-bad-exit=1",)


def batch_script(spec: dict, srun: str, here: str) -> str:
    """The job's script: this file's `supervise`, on the head node, which runs the one step (one task per
    node, this file's `step` in each)."""
    words = [spec["python"], "-u", here, "supervise", _encoded(spec)]
    return "#!/bin/bash\n" + "exec " + " ".join(shlex.quote(word) for word in words) + "\n"


def supervise(spec: dict) -> int:
    """In the batch job, on the head node: the run's step; the hang watch beside it where asked
    (`spec["watch"]`), so a hung run is found and stopped while no fab is connected (a verdict goes into
    the run's log and `hang.json`), or a fault-tolerant run's groups started again on replaced nodes
    (`GroupRestarts`); and when the step has ended, the requeue of a run a spot notice ended."""
    here, srun = os.path.abspath(__file__), program("srun")
    first_start = os.path.join(os.path.dirname(spec["log"]), contract.FIRST_START_RECORD)
    if not os.path.exists(first_start):
        write_private(first_start, json.dumps({"at": time.time()}).encode(), 0o600)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restart:
        note_restart(os.path.dirname(spec["log"]), restart)
    if (spec.get("watch") or {}).get("shared_dir"):  # the step times a start Slurm requeued left (its straggler's)
        shutil.rmtree(os.path.join(os.path.dirname(spec["log"]), contract.STEP_TIMES), ignore_errors=True)
    output = slurm_output.RunOutput.start()
    main = slurm_output.popen(step_argv(spec, srun, here, *step_options(spec)))
    restarts = GroupRestarts(spec, srun, here) if spec.get("replicas") else None

    def forward(number, _frame):
        main.send_signal(number)
        if restarts is not None:
            restarts.signal(number)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    if spec.get("watch"):
        code = _watch(spec, main, srun, here)
    elif restarts is not None:
        code = _beside(main, restarts)
    else:
        code = _status(main.wait())
    output.close()  # every node's lines in the log (`survived` reads their exit markers there)
    if spec.get("replicas") and survived(spec):
        code = 0  # a replica group trained to the end: the run completed, whatever another group's node did
    else:
        code = requeue_if_preempted(spec, code)  # requeued: Slurm ends this script before it goes on
    record = {"exit_code": code, "at": time.time(), "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
    write_private(os.path.join(os.path.dirname(spec["log"]), contract.END_RECORD), json.dumps(record).encode(), 0o600)
    return code


def note_restart(folder: str, restart: int) -> None:
    """A line in the run's RESTARTS_RECORD: this start after a requeue, and when the run was requeued where
    its batch job recorded it (`preempted.json` of this restart; a node lost outright leaves none)."""
    try:
        with open(os.path.join(folder, contract.PREEMPTED_RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    mine = isinstance(record, dict) and record.get("restart") == restart
    line = {
        "restart": restart,
        "at": time.time(),
        "stopped_at": record.get("at") if mine else None,
        "nodes": record.get("nodes") if mine else [],
    }
    descriptor = os.open(os.path.join(folder, contract.RESTARTS_RECORD), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(descriptor, "a") as f:
        f.write(json.dumps(line) + "\n")


def requeue_if_preempted(spec: dict, code: int) -> int:
    """Where a node of the run was drained for a spot notice, or taken out as lost, while it ran, the run
    goes back to the queue (its ranks were told to save and exit, or lost a peer) and starts again, with
    the same run id and folders, once every node is in service: `preempted.json` in the run's folder
    says why; else the step's exit status."""
    paths = Paths(spec["nodes"][0]["home"])  # the batch job's HOME is the user's, not the node's
    reasons = slurm_nodes.node_reasons(paths)
    noticed = [
        (n["name"], reasons[n["name"]][1])
        for n in spec["nodes"]
        if slurm_nodes.lost_or_noticed(reasons.get(n["name"], ("", ""))[1])
    ]
    job = os.environ.get("SLURM_JOB_ID", "")
    if not noticed or not job:
        return code
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    record = {"nodes": [n for n, _ in noticed], "reason": noticed[0][1], "at": time.time(), "restart": restart}
    write_private(
        os.path.join(os.path.dirname(spec["log"]), contract.PREEMPTED_RECORD), json.dumps(record).encode(), 0o600
    )
    names = ", ".join(n for n, _ in noticed)
    print(f"[cluster] {names}: {noticed[0][1]}: the run (exit {code}) is requeued (restart {restart})", flush=True)
    result = slurm_nodes.scontrol(paths, "requeue", job)
    if result.returncode != 0:
        print(f"[cluster] could not requeue: {result.stderr.strip()}", flush=True)
        return code
    time.sleep(slurm_existing.CLIENT_TIMEOUT_S)  # Slurm ends this script as it requeues the job
    return code


def replica_groups(spec: dict) -> list:
    """The spec's nodes in its replica groups (consecutive, equal; remote/job_command.py `replica_groups`)."""
    nodes, count = spec["nodes"], max(int(spec.get("replicas") or 1), 1)
    size = len(nodes) // count
    return [nodes[i * size : (i + 1) * size] for i in range(count)]


def groups_to_heal(groups: list, node_states: dict, heals: dict, ended: dict) -> list:
    """The replica groups to start again now (`contract.groups_to_restart`, the rule both holders apply),
    where a node back in service is one Slurm shows `idle` and holds out neither for a notice nor as lost: the
    run's job holds all its nodes exclusively, so an idle one has left it (Slurm took a lost node out of the
    --no-kill allocation) and its replacement is back. `heals`: {group: its start still running}; `ended`:
    {group: its starts' exit codes}."""
    named = [[node.get("slurm_name") or node["name"] for node in members] for members in groups]
    back = set()
    for name in (name for members in named for name in members):
        state, reason = node_states.get(name, ("", ""))
        if state == "idle" and not slurm_nodes.lost_or_noticed(reason):
            back.add(name)
    return contract.groups_to_restart(named, back, {number for number, runs in heals.items() if runs}, ended)


class GroupRestarts:
    """Beside a fault-tolerant run's step, in its batch job: each replica group whose nodes were replaced (a
    node lost or reclaimed leaves the --no-kill allocation; node/join.py brings its replacement back in
    service) is started again there, as a one-group step of an allocation of its own (Slurm cannot grow the
    run's), with CLUSTER_RESTART_COUNT 0: it heals from a live peer, reads no checkpoint, and rejoins the
    quorum. A line in HEALS_RECORD prices its interruption."""

    def __init__(self, spec: dict, srun: str, here: str):
        self.spec, self.srun, self.here = spec, srun, here
        self.paths, self.groups = Paths(spec["nodes"][0]["home"]), replica_groups(spec)
        self.folder = os.path.dirname(spec["log"])
        self.running: dict = {}  # group: its start's srun
        self.ended: dict = {}  # group: its starts' exit statuses
        self.left_at: dict = {}  # group: when its nodes were first seen out of the run's allocation
        self.unrecorded: dict = {}  # group: (left_at, started at), until its HEALS_RECORD line
        self.stopping = threading.Event()  # signalled (a cancel, a requeue): no group is started again

    def signal(self, number: int) -> None:
        if number != signal.SIGUSR1:
            self.stopping.set()
        for process in list(self.running.values()):
            process.send_signal(number)

    def look(self) -> None:
        """One look, every HEAL_POLL_S: the starts that ended, the groups that left, the groups due."""
        for number, process in list(self.running.items()):
            if process.poll() is not None:
                self.ended.setdefault(number, []).append(_status(process.returncode))
                del self.running[number]
        node_states = slurm_nodes.node_reasons(self.paths)
        for number, members in enumerate(self.groups):
            names = [node.get("slurm_name") or node["name"] for node in members]
            if number not in self.running and any(node_states.get(n, ("", ""))[0] != "allocated" for n in names):
                self.left_at.setdefault(number, time.time())
        if not self.stopping.is_set():
            running = {number: True for number in self.running}
            for number in groups_to_heal(self.groups, node_states, running, self.ended):
                self._start(number)
        self._record()

    def finish(self) -> None:
        """After the run's step: each group started again ends at the peers' step (a stopped one with it)."""
        for process in self.running.values():
            try:
                process.wait(timeout=TERMINATE_GRACE_S * 2 if self.stopping.is_set() else HEAL_END_GRACE_S)
            except subprocess.TimeoutExpired:
                process.terminate()
                process.wait()
        self._record(last=True)

    def _start(self, number: int) -> None:
        members = self.groups[number]
        print(
            f"[cluster] replica group {number} ({', '.join(n['name'] for n in members)}): back in service after "
            "a replacement; it starts again and heals from a live peer",
            flush=True,
        )
        names = ",".join(node.get("slurm_name") or node["name"] for node in members)
        argv = step_argv(
            {**self.spec, "nodes": members},
            self.srun,
            self.here,
            f"--job-name={self.spec['run_id']}-replica-{number}",
            f"--nodelist={names}",
        )
        # without the batch job's SLURM_* (but Slurm's configuration), srun asks for an allocation of its own
        # rather than a step of this job's, whose nodes Slurm cannot add back
        own = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        self.running[number] = slurm_output.popen(argv, env=own)
        self.unrecorded[number] = (self.left_at.pop(number, None), time.time())

    def _record(self, last: bool = False) -> None:
        """HEALS_RECORD's line for each group started again, once its first step back is in the metrics (or,
        at the end, its start): from when its nodes left until it was back in the quorum."""
        for number, (left, at) in list(self.unrecorded.items()):
            back = first_step_after(os.path.join(self.folder, contract.METRICS_FILE), number, at)
            if back is None and not last:
                continue
            nodes = [node["name"] for node in self.groups[number]]
            line = {"group": number, "nodes": nodes, "stopped_at": left, "at": back or at}
            path = os.path.join(self.folder, contract.HEALS_RECORD)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
                f.write(json.dumps(line) + "\n")
            del self.unrecorded[number]


def survived(spec: dict, tail_bytes: int = 1 << 18) -> bool:
    """Whether a fault-tolerant run completed (contract.surviving_group), from each node's last exit marker
    in the end of the run's log (a group started again writes its node's marker after the first)."""
    try:
        with open(spec["log"], "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    marker = re.compile(rf"^\[([^\]\s]+)\] {re.escape(contract.EXIT_MARKER)} (-?\d+)", re.M)
    codes = {name: int(code) for name, code in marker.findall(text)}
    return contract.surviving_group([[n["name"] for n in members] for members in replica_groups(spec)], codes)


def _beside(main: subprocess.Popen, restarts: GroupRestarts) -> int:
    """The step's exit status, once it and the groups started again beside it have ended."""
    while True:
        try:
            code = _status(main.wait(timeout=HEAL_POLL_S))
            break
        except subprocess.TimeoutExpired:
            restarts.look()
    restarts.finish()
    return code


def contract_lines(path: str, tail_bytes: int = 0) -> list:
    """The fault-tolerant contract's lines (those with `participants`) of a metrics file, oldest first;
    `tail_bytes`: only its last bytes (a running run's file grows a line per group per step)."""
    try:
        with open(path, "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - tail_bytes) if tail_bytes else 0
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return contract_records(text, cut=bool(start))


def contract_records(text: str, cut: bool = False) -> list:
    """The contract's lines in metrics text, oldest first; `cut`: the text starts mid-file (a tail), so its
    first line is no line."""
    lines = text.splitlines()[1:] if cut else text.splitlines()
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "participants" in record and "replica" in record:
            found.append(record)
    return found


def newest_participants(records: list):
    """The groups in the quorum at the newest contract line; None where there is none yet. The one reading
    of `participants` that `fab jobs` shows, for both holders."""
    return max(records, key=lambda r: r["time"])["participants"] if records else None


def first_step_after(path: str, replica: int, at: float, tail_bytes: int = 1 << 16):
    """When replica group `replica` wrote its first step line after `at` (epoch s); None if not yet.
    `tail_bytes`: only the file's last bytes (a running run's; 0: all of it)."""
    times = [r["time"] for r in contract_lines(path, tail_bytes) if r["replica"] == replica and r["time"] >= at]
    return min(times) if times else None


def participants(log: str):
    """A running fault-tolerant run's participants now: the newest contract line's (in the metrics beside
    the run's log); None where it has none."""
    return newest_participants(contract_lines(os.path.join(os.path.dirname(log), contract.METRICS_FILE), 1 << 14))


def _watch(spec: dict, main: subprocess.Popen, srun: str, here: str) -> int:
    """The hang watch beside the running step, and the straggler verdict on the same polls (and, with
    `--on-straggler replace`, the straggler's node replaced); the step's exit status."""
    from node import straggler  # here only: its import would add to every start of this file

    watch = spec["watch"]
    named = straggler.Named()
    replacing = StragglerReplacement(spec, srun, here) if watch.get("on_straggler") == "replace" else None
    looks = None
    if watch.get("shared_dir"):  # the ranks' step times on the shared folder, read here on the head node
        folder = os.path.join(os.path.dirname(spec["log"]), contract.STEP_TIMES)
        looks = straggler.SharedLooks(
            named,
            lambda: straggler.read_step_times(folder),
            lambda fresh: _say_stragglers(spec, named, fresh),
            replacing.take_out if replacing is not None else None,
        ).start()
    try:
        return _watch_step(spec, main, srun, here, named, replacing, looks)
    finally:
        if replacing is not None:
            replacing.close()  # a verdict from now on takes no node out: the step has ended
        if looks is not None:
            looks.stop()
        if replacing is not None:
            replacing.power_off()


def _watch_step(spec: dict, main: subprocess.Popen, srun: str, here: str, named, replacing, looks=None) -> int:
    """The polls (while the straggler verdict's own `looks` at the shared folder find step times, the polls keep
    their pace; else a poll comes sooner where a slow rank is due)."""
    from node import hang_rule  # here only: its import would add 50 ms to every start of this file

    watch = spec["watch"]
    probe = {**spec, "nodes": [{**node, "command": watch["status"][node["name"]]} for node in spec["nodes"]]}
    probe.pop("watch", None)
    overdue = watch["timeout_s"] + watch.get("overdue_grace_s", 30)
    while True:
        try:
            serving = looks is not None and looks.serving()
            main.wait(timeout=watch["poll_s"] if serving else named.next_look_s(watch["poll_s"]))
            break
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
        payloads = _ask(probe, srun, here)
        records = [record for payload in payloads for record in payload.get("ranks", [])]
        fresh = named.update(records, lambda fresh: _say_stragglers(spec, named, fresh))
        if replacing is not None:
            replacing.take_out(fresh)
        views = [v for payload in payloads for v in hang_rule.parse_ranks(payload)]
        found = hang_rule.find_hang(views, watch["timeout_s"], overdue) if views else None
        if found is None:
            continue
        collect = {**probe, "nodes": [{**n, "command": watch["collect"][n["name"]]} for n in probe["nodes"]]}
        collected = _ask(collect, srun, here, apart=True) if watch.get("collect") else []
        evidence = hang_rule.Evidence.from_collected(collected) if collected else None
        line = hang_rule.verdict(spec["run_id"], found, evidence)
        record = {"verdict": line, "stalled_at": hang_rule.stalled_since(found), "detected_at": time.time()}
        record["collected"] = collected  # each node's recorder dumps and stacks: fab keeps them in the run's hang/
        write_private(
            os.path.join(os.path.dirname(spec["log"]), contract.HANG_RECORD), json.dumps(record).encode(), 0o600
        )
        print(f"[watch] {line}", flush=True)
        if watch.get("on_hang", "stop") != "stop":
            print("[watch] --on-hang wait: the job keeps running; fab stop --run ends it", flush=True)
            return _status(main.wait())
        print("[watch] stopping the hung run on every node", flush=True)
        main.send_signal(signal.SIGTERM)
        break
    return _status(main.wait())


def _say_stragglers(spec: dict, named, fresh: list) -> None:
    """Say each rank the straggler rule names now (node/straggler.py) in the run's log, and keep the verdict
    beside it (`states` hands it to `fab jobs`)."""
    for found in fresh:
        print(f"[watch] {found.line(spec['run_id'])}", flush=True)
    folder = os.path.dirname(spec["log"])
    write_private(os.path.join(folder, contract.STRAGGLER_RECORD), named.record().encode(), 0o600)


class StragglerReplacement:
    """`--on-straggler replace`, in the batch job: a straggler's node goes the way of a reclaimed spot node.
    Drained in Slurm (`contract.STRAGGLER_DRAIN_REASON`: no run starts there again), its ranks told to save
    and exit (SIGUSR1, `spot_watch.py --tell-ranks`: the other ranks stop at the same step); once the step
    has ended, the node is told to power off (`contract.power_off_marker`). The run is then requeued as a
    notice's is (`requeue_if_preempted`: the drain is one of ours), the spot path replaces the node (the
    local provider's supervisor, an AWS worker's Auto Scaling group), the replacement's join lifts the
    drain, and the run starts again there and resumes from its checkpoint. The head node is not replaced:
    it holds this job and Slurm's controller."""

    def __init__(self, spec: dict, srun: str, here: str):
        self.spec, self.srun, self.here = spec, srun, here
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
        head = self.spec["nodes"][0]
        for found in fresh:
            node = next((n for n in self.spec["nodes"] if n["name"] == found.node), None)
            if node is None or found.node in self.taken_out:
                continue
            if node is head:
                print(f"[watch] --on-straggler replace: {found.node} is the head node: not replaced", flush=True)
                continue
            paths = Paths(head["home"])  # the batch job's HOME is the user's, not the node's
            said = slurm_nodes.drain_straggler(paths, node.get("slurm_name") or node["name"], found.why())
            if said != "drained":  # not held out: its run would not be requeued, so it is left as it is
                print(f"[watch] --on-straggler replace: {found.node} not drained ({said}): not replaced", flush=True)
                continue
            print(f"[watch] --on-straggler replace: {found.node} drained; its ranks save and exit", flush=True)
            tell = {**self.spec, "nodes": [{**node, "command": self.spec["watch"]["tell_ranks"][found.node]}]}
            tell.pop("watch", None)
            _ask(tell, self.srun, self.here)
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
            marker = os.path.join(self.spec["watch"]["shared_dir"], contract.power_off_marker(name))
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            record = {"run_id": self.spec["run_id"], "reason": contract.STRAGGLER_DRAIN_REASON, "at": time.time()}
            write_private(marker, json.dumps(record).encode(), 0o600)
            print(f"[watch] {name} powers off: it is replaced, and the run resumes there", flush=True)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _ask(probe: dict, srun: str, here: str, apart: bool = False) -> list:
    """Every node's answer (one JSON line each), through a step that shares the run's allocation; `apart`:
    a step per node, at once (a collect's answers are large, and srun interleaves long lines of several
    nodes' output)."""
    job = f"--jobid={os.environ.get('SLURM_JOB_ID', '')}"
    if apart and len(probe["nodes"]) > 1:
        one_each = [{**probe, "nodes": [node]} for node in probe["nodes"]]
        with ThreadPoolExecutor(max_workers=len(one_each)) as pool:
            return [answer for answers in pool.map(lambda one: _ask(one, srun, here), one_each) for answer in answers]
    options = ["--overlap", job]
    if len(probe["nodes"]) == 1:
        options.append(f"--nodelist={probe['nodes'][0].get('slurm_name') or probe['nodes'][0]['name']}")
    try:
        result = subprocess.run(step_argv(probe, srun, here, *options), capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = frames.unframed(result.stdout).decode(errors="replace").splitlines()
    return contract.json_objects(re.sub(r"^\[[^\]]*\] ", "", line) for line in lines)


def sbatch_argv(spec: dict, sbatch: str, script: str, adopted: dict | None = None) -> list:
    """The run's sbatch; `adopted`: the Slurm the hosts already ran (its partition, this stack's tag)."""
    names = ",".join(node.get("slurm_name") or node["name"] for node in spec["nodes"])
    where = []
    if adopted and adopted.get("partition"):
        where.append(f"--partition={adopted['partition']}")
    if adopted and adopted.get("tag"):
        where.append(f"--comment={adopted['tag']}")  # what down cancels there
    return [
        sbatch,
        "--parsable",
        f"--job-name={spec['run_id']}",
        *where,
        f"--nodes={len(spec['nodes'])}",
        f"--nodelist={names}",
        "--exclusive",
        *(["--no-kill"] if spec.get("replicas") else []),  # a node that fails leaves the others the allocation
        "--requeue",
        "--open-mode=append",
        # The environment sbatch is given (`batch_environment`), whole: --export=NONE would have slurmd
        # build a login environment (`su - USER -c env`) before every start, 0.3 to 1.3 s here.
        "--export=ALL",
        f"--output={spec['log']}",
        f"--chdir={os.path.dirname(spec['log'])}",
        script,
    ]


def batch_environment(paths: Paths) -> dict:
    """The batch job's environment: the submitting session's (what a launch held by fab's connections runs
    with), less that session's own SSH_* and any other job's or option's SLURM_*, SBATCH_*, SRUN_* and
    SALLOC_*, plus what Slurm's clients need (`step` sets each node's HOME and PATH itself)."""
    own = ("SSH_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
    kept = {name: value for name, value in os.environ.items() if not name.startswith(own)}
    return {**kept, **slurm_existing.client_environment(paths)}


def submit(spec: dict) -> str:
    """sbatch the run; its job id."""
    folder = os.path.dirname(spec["log"])
    os.makedirs(folder, exist_ok=True)
    paths = Paths(os.path.expanduser("~"))
    spec = {
        **spec,
        "nodes": [{**node, "slurm_name": slurm_existing.slurm_name(paths, node["name"])} for node in spec["nodes"]],
    }
    script = os.path.join(folder, f"{spec['run_id']}.sbatch")
    with open(script, "w") as f:
        f.write(batch_script(spec, program("srun"), os.path.abspath(__file__)))
    os.chmod(script, 0o700)
    down = gone(paths)
    try:
        if down:  # sbatch would wait MessageTimeout to fail
            raise DaemonError(f"{' and '.join(down)} on the head node is not running (killed or crashed)")
        result = subprocess.run(
            sbatch_argv(spec, program("sbatch"), script, slurm_existing.existing(paths)),
            env=batch_environment(paths),
            capture_output=True,
            text=True,
            timeout=SUBMIT_TIMEOUT_S,
        )
        why = "" if result.returncode == 0 else " ".join(result.stderr.split()[-40:]) or f"exit {result.returncode}"
    except subprocess.TimeoutExpired:
        why = f"no answer in {SUBMIT_TIMEOUT_S:g} s (slurmctld or munged down on the head node?)"
    except DaemonError as exc:
        why = str(exc)
    if why:  # the run's folder (its script, its stage) would be an orphan no `fab jobs` lists
        shutil.rmtree(folder, ignore_errors=True)
        fix = (
            "its administrator runs that Slurm: fab bootstrap starts none of its daemons"
            if slurm_existing.existing(paths)
            else "fab bootstrap restarts Slurm's daemons"
        )
        raise DaemonError(f"sbatch failed: {why}; nothing was queued ({fix})")
    return result.stdout.strip().split(";")[0]


# ----------------------------------------------------------------------------- the job, from the head


UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted")
"""What Slurm's clients say, exiting non-zero, when the controller (or munged) does not answer: it gives up
after MessageTimeout (5 s on one machine) rather than outlasting our own timeout."""


def _client(argv: list) -> subprocess.CompletedProcess:
    """One of Slurm's clients; DaemonError, one line, where the controller does not answer in time (at once
    where this node's munged or slurmctld is known to be gone)."""
    paths = Paths(os.path.expanduser("~"))
    down = gone(paths)
    if down:
        raise DaemonError(
            f"Slurm's controller cannot answer {argv[0]}: {' and '.join(down)} on the head node is not running "
            "(killed or crashed): fab bootstrap restarts them"
        )
    try:
        result = slurm_existing.client(slurm_existing.client_environment(paths), *argv)
    except subprocess.TimeoutExpired:
        raise DaemonError(
            f"Slurm's controller did not answer {argv[0]} in {slurm_existing.CLIENT_TIMEOUT_S:g} s "
            "(slurmctld or munged down on the head node?): fab bootstrap restarts them"
        ) from None
    if result.returncode != 0 and any(words in result.stderr for words in UNREACHABLE):
        raise DaemonError(
            f"Slurm's controller did not answer {argv[0]} ({' '.join(result.stderr.split()[-12:])}; slurmctld "
            "or munged down on the head node?): fab bootstrap restarts them"
        )
    return result


def _epoch(value: str):
    """Slurm's local `2026-11-24T10:05:01` as epoch seconds (this node's time zone); None where unknown."""
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def job_fields(text: str) -> dict:
    """One job's state, times, exit and requeues from `scontrol show job --oneliner` or a job-completion
    line; what is not known yet is None (Slurm writes an `EndTime` and `ExitCode=0:0` before a job ends,
    and for a waiting job a `StartTime` that is only its guess). Slurm's `ExitCode` is `STATUS:SIGNAL`."""
    fields = dict(FIELD.findall(text))
    code = fields.get("ExitCode", "")
    status, _, signal_number = code.partition(":")
    state = fields.get("JobState", "").split()[0] if fields.get("JobState") else None
    ended = state in FINAL_STATES
    return {
        "state": state,
        "submitted_at": _epoch(fields.get("SubmitTime", "")),
        "started_at": None if state in WAITING_STATES else _epoch(fields.get("StartTime", "")),
        "ended_at": _epoch(fields.get("EndTime", "")) if ended else None,
        # a job ended by a signal (cancelled, killed) has the shell's code for it: 128 + the signal
        "exit_code": (128 + int(signal_number) if status == "0" and signal_number not in ("", "0") else int(status))
        if ended and status.isdigit()
        else None,
        "signal": int(signal_number) if ended and signal_number.isdigit() else None,
        "requeues": int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else 0,
        "log": fields.get("StdOut") or None,
        "reason": fields.get("Reason")
        if state in WAITING_STATES and fields.get("Reason") not in ("", "None")
        else None,
    }


REASONS = {
    "Resources": "its nodes, busy with another job",
    "Priority": "jobs ahead of it in the queue",
    "Dependency": "a job it depends on",
    "BeginTime": "its start time",
    "JobHeldUser": "a release (held by its user: scontrol release)",
    "JobHeldAdmin": "a release (held by an administrator)",
    "PartitionDown": "its partition, which is down",
    "PartitionInactive": "its partition, which is inactive",
    "NodeDown": "a node of it, which is down",
    "Reservation": "a reservation",
}


def reason_words(reason: str, nodes_in_service: bool = False) -> str:
    """Slurm's reason for a waiting job (`Reason=` of scontrol, spaces written `_`), in words.
    `nodes_in_service`: every node of ours is in service, so a node "not available" is one that another
    job holds (Slurm gives a job that names its nodes that reason while they are allocated)."""
    text = reason.replace("_", " ")
    head, _, rest = text.partition(",")
    if head == "ReqNodeNotAvail" or head.startswith("Nodes required for job are DOWN"):
        if nodes_in_service:
            return REASONS["Resources"]
        nodes = rest.strip().partition("UnavailableNodes:")[2].strip()
        return f"node(s) {nodes or 'it asked for'} to be available (down, drained or reserved in Slurm)"
    return REASONS.get(head, f"Slurm: {text}")


def job_state(job_id: str, log: str = "") -> dict | None:
    """What Slurm knows of the job: the controller while it remembers it, else the completion log (ours)
    or the accounting (an existing Slurm's), else the batch job's own end record beside its `log`."""
    result = _client(["scontrol", "show", "job", "--oneliner", job_id])
    if result.returncode == 0 and "JobState=" in result.stdout:
        return job_fields(result.stdout)
    if slurm_existing.existing(Paths(os.path.expanduser("~"))) is not None:
        return accounted_state(job_id) or ended_state(log)
    completions = os.path.join(os.path.expanduser("~"), contract.JOB_COMPLETIONS)
    try:
        with open(completions, errors="replace") as f:
            lines = [line for line in f if line.startswith(f"JobId={job_id} ")]
    except OSError:
        lines = []
    return job_fields(lines[-1]) if lines else ended_state(log)


def ended_state(log: str) -> dict | None:
    """The run's end as its batch job recorded it (contract.END_RECORD beside `log`); None without one."""
    try:
        with open(os.path.join(os.path.dirname(log), contract.END_RECORD)) as f:
            return end_record_state(json.load(f), log)
    except (OSError, ValueError):
        return None


def end_record_state(record, log: str = "") -> dict | None:
    """A batch job's end record as a job's state: COMPLETED with exit 0, CANCELLED where a signal ended it
    (scancel: SIGTERM, then SIGKILL), else FAILED; None where it is not one."""
    try:
        code, at = int(record["exit_code"]), float(record["at"])
    except (ValueError, KeyError, TypeError):
        return None
    state = "COMPLETED" if code == 0 else "CANCELLED" if code in (128 + 15, 128 + 9) else "FAILED"
    return {
        "state": state,
        "submitted_at": None,
        "started_at": None,
        "ended_at": at,
        "exit_code": code,
        "signal": code - 128 if state == "CANCELLED" else None,
        "requeues": int(record.get("restarts") or 0),
        "log": log,
    }


def accounted_state(job_id: str) -> dict | None:
    """A Slurm the hosts already ran forgets an ended job after its MinJobAge (300 s by default): what its
    accounting (`sacct`) has of it, where it keeps any; None where it does not."""
    try:
        result = _client(
            [
                "sacct",
                "--allocations",
                "--noheader",
                "--parsable2",
                f"--jobs={job_id}",
                "--format=State,ExitCode,Submit,Start,End",
            ]
        )
    except (OSError, subprocess.TimeoutExpired, UsageError):
        return None
    rows = [line.split("|") for line in result.stdout.splitlines() if line.count("|") == 4]
    if result.returncode != 0 or not rows:
        return None
    state, code, submitted, started, ended = rows[-1]
    return job_fields(
        f"JobState={state.split()[0] if state else ''} ExitCode={code} SubmitTime={submitted} "
        f"StartTime={started} EndTime={ended}"
    )


def shown_state(job_id: str, log: str = "", found: dict | None = None) -> dict | None:
    """`job_state`, its `started_at` the first start; PREEMPTED for a run waiting to start again after a
    requeue (a node of it drained for a spot notice or lost: `preempted` says why, from `preempted.json`
    or the node's reason); and for a waiting run what it waits for (`waiting_for`: the nodes out of service and
    why, else Slurm's own reason where it names a fault). `found`: `job_state`'s answer, where asked already."""
    found = found or job_state(job_id, log)
    if found is not None and found.get("log") and found["requeues"]:
        try:
            with open(os.path.join(os.path.dirname(found["log"]), contract.FIRST_START_RECORD)) as f:
                found = {**found, "started_at": float(json.load(f)["at"])}  # the first start, not Slurm's last
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if found is None or found["state"] not in WAITING_STATES:
        return found
    paths = Paths(os.path.expanduser("~"))
    reasons = slurm_nodes.node_reasons(paths)
    ours = slurm_existing.existing(paths) is None  # a site's Slurm: its nodes' states are the site's business
    out = [
        f"{node}: {reason or node_state}"
        for node, (node_state, reason) in sorted(reasons.items())
        if slurm_nodes.lost_or_noticed(reason) or (ours and slurm_nodes.out_of_service(node_state))
    ]
    if not out and not reasons:
        out = ["Slurm's controller, which does not answer"]
    elif not out and found.get("reason"):  # none of ours out of service: what Slurm says it waits for
        out = [reason_words(found["reason"], nodes_in_service=ours)]
    found = {**found, "waiting_for": "; ".join(out) or None}
    if not found["requeues"]:
        return found
    record: dict = {}
    try:
        with open(os.path.join(os.path.dirname(found.get("log") or log), contract.PREEMPTED_RECORD)) as f:
            loaded = json.load(f)
        record = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    if record.get("restart") == found["requeues"]:
        return {**found, "state": "PREEMPTED", "preempted": record}
    # requeued with no record of this restart (a node Slurm found dead by itself): the run waits to start
    # again all the same; the nodes gpu-cluster took out say why, where they still are out
    taken = [(node, reason) for node, (_, reason) in sorted(reasons.items()) if slurm_nodes.lost_or_noticed(reason)]
    why = taken[0][1] if taken else "a node of the run failed"
    nodes = [n for n, _ in taken]
    return {**found, "state": "PREEMPTED", "preempted": {"nodes": nodes, "reason": why, "restart": found["requeues"]}}


def waiting_line(found: dict) -> str:
    """What `follow` says when the run waits (to start, or again after a requeue), and for what."""
    why = f": waits for {found['waiting_for']}" if found.get("waiting_for") else ": waits its turn in the queue"
    if found.get("state") == "PREEMPTED":
        record = found.get("preempted") or {}
        nodes = ", ".join(record.get("nodes") or []) or "a node"
        return (
            f"[cluster] the run was requeued (restart {found.get('requeues')}): {nodes}: {record.get('reason', '?')}; "
            f"it starts again, from its last checkpoint, once every node is in service{why}"
        )
    return f"[cluster] the run is pending{why}"


def follow(log: str, job_id: str, offset: int = 0) -> int:
    """Copy the log from `offset` as it grows, until the job has ended and all of it is copied (the batch
    job's end record, its last act, unless Slurm requeued the job since; or Slurm's final state where the
    job ended without one: a cancel before it started); then the end marker: `END_MARKER STATE EXIT_CODE
    LOG_BYTES`, Slurm's state and code where Slurm has them already, else the end record's (the log only
    shows what it can: one that cannot be read is not the run's end). On stderr, never in the log's copy:
    while the run waits, a `[cluster]` line says for what, each time that changes; where Slurm does not
    answer, FOLLOW_FAILED_MARKER WHY, and exit 1. Stopping it (a closed connection) stops only it."""
    out, notes = sys.stdout.buffer, sys.stderr
    position, checked, final, said, unreadable = offset, 0.0, None, "", ""
    end_record, earlier = os.path.join(os.path.dirname(log), contract.END_RECORD), None
    while True:
        try:
            with open(log, "rb") as f:
                f.seek(position)
                chunk = f.read(1 << 20)
        except FileNotFoundError:
            chunk = b""  # not started yet (pending)
        except OSError as exc:  # the log cannot be read (a full or failing disk): Slurm still says the end
            chunk = b""
            if not unreadable:
                unreadable = f"[cluster] the run's log cannot be read ({exc.strerror or exc}); waiting for its end"
                print(unreadable, file=notes, flush=True)
        if chunk:
            out.write(chunk)
            out.flush()
            position += len(chunk)
            continue
        if final is not None:
            break
        recorded = ended_state(log) if os.path.exists(end_record) else None
        if recorded is not None and (recorded["ended_at"], recorded["requeues"]) != earlier:
            # The batch job's last act: all of the log is written. Slurm's word wins where it has one already
            # (a TIMEOUT); a job Slurm still shows running in the same start has ended all the same (its
            # books lag); a job Slurm requeued (a node failed: the record is that start's) runs again.
            try:
                found = job_state(job_id, log)
            except DaemonError:
                found = None
            if found is None or found["state"] in FINAL_STATES:
                final = found or recorded
                continue  # one more read: what was written before the end
            if found["state"] not in WAITING_STATES and found["requeues"] <= recorded["requeues"]:
                final = recorded
                continue
            earlier = (recorded["ended_at"], recorded["requeues"])  # an earlier start's: followed on
        if time.monotonic() - checked >= STATE_POLL_S:
            checked = time.monotonic()
            try:
                found = job_state(job_id, log)
                waiting = found is not None and found["state"] in WAITING_STATES
                shown = shown_state(job_id, log, found) if waiting else None
            except DaemonError as exc:
                print(f"{contract.FOLLOW_FAILED_MARKER} {exc}", file=notes, flush=True)
                return 1
            if found is None or found["state"] in FINAL_STATES:
                final = found or {"state": "UNKNOWN", "exit_code": None}
                continue  # one more read: what was written before the end
            line = waiting_line(shown) if shown else ""
            if line and line != said:
                print(line, file=notes, flush=True)
            said = line
        time.sleep(FOLLOW_POLL_S)
    code = final.get("exit_code")
    # on a line of its own, the log's size last: the follower keeps the log, not this line
    out.write(f"\n{contract.RUN_END_MARKER} {final['state']} {'-' if code is None else code} {position}\n".encode())
    out.flush()
    return 0


def cancel(job_id: str) -> dict:
    """scancel the job; what it was before (None: Slurm does not know it)."""
    before = job_state(job_id)
    if before is not None and before["state"] not in FINAL_STATES:
        result = _client(["scancel", job_id])
        if result.returncode != 0:
            raise DaemonError(f"scancel failed: {result.stderr.strip()}")
    return {"before": before}


def submit_reply(spec: dict) -> dict:
    """node/calls.py's SubmitRun."""
    return {"job_id": submit(spec)}


def states(logs: dict) -> dict:
    """node/calls.py's RunStates: each job's `shown_state`, with its run's log; a running fault-tolerant
    run's also with its `participants` now (the newest contract line beside the log); and, where the run's
    folder is here to tell, `ever_started`, whether its batch job ever started (its first start record beside
    the log; Slurm gives a job cancelled while it waited a start and exit 0), and `stragglers`, the ranks
    its hang watch named slow (the straggler record beside the log; [] where none)."""
    found = {}
    for job, log in logs.items():
        shown = shown_state(job, log)
        if shown is not None and shown.get("state") == "RUNNING":
            shown = {**shown, "participants": participants(log)}
        folder = os.path.dirname(log) if log else ""
        if shown is not None and folder and os.path.isdir(folder):
            shown = {
                **shown,
                "ever_started": os.path.exists(os.path.join(folder, contract.FIRST_START_RECORD)),
                "stragglers": _stragglers_in(folder),
            }
        found[job] = shown
    return {"states": found}


def _stragglers_in(folder: str) -> list:
    """The run's straggler record in its folder ([] where it has none, or one that cannot be read)."""
    try:
        with open(os.path.join(folder, contract.STRAGGLER_RECORD)) as record:
            found = json.load(record)
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("supervise", "follow"))
    parser.add_argument("spec", help="supervise: the spec as sbatch passes it; follow: the log")
    parser.add_argument("more", nargs="*", help="follow: JOB [OFFSET]")
    args = parser.parse_args(argv)
    try:
        if args.action == "supervise":
            return supervise(json.loads(base64.b64decode(args.spec)))
        return follow(args.spec, args.more[0], int(args.more[1]) if len(args.more) > 1 else 0)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.action}: {exc}", file=sys.stderr)
        return 2
    except (UsageError, DaemonError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
