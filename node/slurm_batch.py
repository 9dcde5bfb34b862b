"""In a Slurm-held run's batch job, on the head node (its script runs this file): the run's one step, the
watch (node/slurm_watch.py) or the replica groups' restarts (node/slurm_restarts.py) beside it, the requeue
of a run a spot notice or a lost node ended, and the end record.

    python node/slurm_batch.py SPEC_BASE64   # the spec as node/run_spec.py describes it

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import json
import os
import shutil
import signal
import sys
import time

if not __package__:  # run as a file: import its siblings from the code folder, ahead of any other `node`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from node import contract, slurm_existing, slurm_exit, slurm_nodes, slurm_output, slurm_restarts  # noqa: E402
from node.run_spec import RunSpec  # noqa: E402
from node.slurm_conf import DaemonError, Paths, UsageError  # noqa: E402
from node.slurm_daemons import program, write_private  # noqa: E402
from node.slurm_step import exit_status, step_argv  # noqa: E402


def step_options(spec: RunSpec) -> tuple[str, ...]:
    """The run's step: one node's failure ends every node's task, except in a fault-tolerant run
    (`replicas`), where each node's task is a replica group of its own that the others outlive."""
    if spec.replicas:
        return ("--kill-on-bad-exit=0", "--no-kill")
    return ("--kill-on-bad-exit=1",)


def supervise(spec: RunSpec) -> int:
    """In the batch job, on the head node: the run's step; the hang watch beside it where asked
    (`spec.watch`), so a hung run is found and stopped while no fab is connected (a verdict goes into
    the run's log and `hang.json`), or a fault-tolerant run's groups started again on replaced nodes
    (node/slurm_restarts.py); and when the step has ended, the requeue of a run a spot notice ended."""
    srun = program("srun")
    step_from = slurm_exit.log_size(spec.log)  # the batch job's code: the run's own (slurm_exit)
    first_start = os.path.join(spec.folder, contract.FIRST_START_RECORD)
    if not os.path.exists(first_start):
        write_private(first_start, json.dumps({"at": time.time()}).encode(), 0o600)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restart:
        note_restart(spec.folder, restart)
        print(f"{contract.RESTART_LINE} {restart}: the run starts again", flush=True)
    if spec.watch is not None and spec.watch.shared_dir:  # the step times a start Slurm requeued left (its straggler's)
        shutil.rmtree(os.path.join(spec.folder, contract.STEP_TIMES), ignore_errors=True)
    output = slurm_output.RunOutput.start()
    try:
        main = slurm_output.popen(step_argv(spec, srun, *step_options(spec)))
        restarts = slurm_restarts.GroupRestarts(spec, srun) if spec.replicas else None

        def forward(number, _frame):
            main.send_signal(number)
            if restarts is not None:
                restarts.signal(number)

        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, forward)
        if spec.watch is not None:
            from node import slurm_watch  # here only: its imports would add 50 ms to every start of this file

            try:
                code = slurm_watch.watch(spec, spec.watch, main, srun)
            except Exception as exc:  # noqa: BLE001 - the watch's own fault (its set-up) never ends the run
                print(f"[watch] hang watch: {type(exc).__name__}: {exc}; the run goes on unwatched", flush=True)
                code = exit_status(main.wait())
        elif restarts is not None:
            code = restarts.beside(main)
        else:
            code = exit_status(main.wait())
    finally:
        output.close()  # every node's lines in the log (`survived` and `run_code` read their markers there)
    if spec.replicas and slurm_restarts.survived(spec):
        code = 0  # a replica group trained to the end: the run completed, whatever another group's node did
    else:
        code = slurm_exit.run_code(spec.log, step_from, code, spec.node_names)
        code = requeue_if_preempted(spec, code)  # requeued: Slurm ends this script before it goes on
    record = {"exit_code": code, "at": time.time(), "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
    write_private(os.path.join(spec.folder, contract.END_RECORD), json.dumps(record).encode(), 0o600)
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


def requeue_if_preempted(spec: RunSpec, code: int) -> int:
    """Where a node of the run was drained for a spot notice, or taken out as lost, while it ran, the run
    goes back to the queue (its ranks were told to save and exit, or lost a peer) and starts again, with
    the same run id and folders, once every node is in service: `preempted.json` in the run's folder
    says why; else the step's exit status."""
    paths = Paths(spec.head.home)  # the batch job's HOME is the user's, not the node's
    reasons = slurm_nodes.node_reasons(paths)
    noticed = [
        (name, reasons[name][1])
        for name in spec.node_names
        if slurm_nodes.lost_or_noticed(reasons.get(name, ("", ""))[1])
    ]
    job = os.environ.get("SLURM_JOB_ID", "")
    if not noticed or not job:
        return code
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    record = {"nodes": [n for n, _ in noticed], "reason": noticed[0][1], "at": time.time(), "restart": restart}
    write_private(os.path.join(spec.folder, contract.PREEMPTED_RECORD), json.dumps(record).encode(), 0o600)
    names = ", ".join(n for n, _ in noticed)
    print(f"[cluster] {names}: {noticed[0][1]}: the run (exit {code}) is requeued (restart {restart})", flush=True)
    result = slurm_nodes.scontrol(paths, "requeue", job)
    if result.returncode != 0:
        print(f"[cluster] could not requeue: {result.stderr.strip()}", flush=True)
        return code
    time.sleep(slurm_existing.CLIENT_TIMEOUT_S)  # Slurm ends this script as it requeues the job
    return code


def main(argv: list | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: slurm_batch.py SPEC_BASE64 (the batch script runs it; not for people)", file=sys.stderr)
        return 2
    try:
        return supervise(RunSpec.decoded(args[0]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: supervise: {exc}", file=sys.stderr)
        return 2
    except (UsageError, DaemonError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
