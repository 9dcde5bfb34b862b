"""On the head node: a run as one Slurm batch job, one task per node, every node's output in the run's log.

    python node/slurm_run.py follow LOG JOB [OFFSET]  # the log from OFFSET as it grows, until the job ends

and, through node/calls.py, SubmitRun (sbatch a spec file; the job id), RunStates (each job's state and
times) and CancelRun (scancel, saying the state it had).

The spec is node/run_spec.py's RunSpec (the run id, its log on the head node, the interpreter, each node's
name, home and command, head node first). `submit` writes nothing on the other nodes: the batch script (kept
beside the log) runs node/slurm_batch.py with the spec, and srun hands it to every node's `step` on its command line.

The batch job takes every node, exclusively, so runs start one at a time in submission order, and
appends to its log across requeues. Its one step is `srun --ntasks-per-node=1 --kill-on-bad-exit=1`:
a node whose command fails ends the others at once. A fault-tolerant run's (spec `replicas`: torchft
replica groups) is `--kill-on-bad-exit=0 --no-kill` in a `--no-kill` job instead: a group's node that
fails or dies ends only that group, and the others train on in the same allocation; a group whose nodes
were replaced is started again on them, beside the step, by the batch job (node/slurm_restarts.py). Each
node's task is node/slurm_step.py, a file of its own that starts in milliseconds: it runs this node's command and
prefixes its output (`[node-i] `) in records Slurm carries whole, joined into the log by node/slurm_output.py.

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, replicas, slurm_accounting, slurm_existing, slurm_nodes, straggler  # noqa: E402
from node.calls import BadInput  # noqa: E402
from node.run_spec import RunSpec, SpecError  # noqa: E402
from node.slurm_conf import DaemonError, Paths, UsageError  # noqa: E402
from node.slurm_daemons import gone, program  # noqa: E402

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


def batch_script(spec: RunSpec, srun: str, here: str) -> str:
    """The job's script: node/slurm_batch.py (beside this file, `here`), on the head node, which runs the one
    step (one task per node, node/slurm_step.py in each)."""
    words = [spec.python, "-u", os.path.join(os.path.dirname(here), "slurm_batch.py"), spec.encoded()]
    return "#!/bin/bash\n" + "exec " + " ".join(shlex.quote(word) for word in words) + "\n"


def sbatch_argv(spec: RunSpec, sbatch: str, script: str, adopted: dict | None = None) -> list:
    """The run's sbatch; `adopted`: the Slurm the hosts already ran (its partition, this stack's tag)."""
    names = ",".join(node.in_slurm for node in spec.nodes)
    where = []
    if adopted and adopted.get("partition"):
        where.append(f"--partition={adopted['partition']}")
    if adopted and adopted.get("tag"):
        where.append(f"--comment={adopted['tag']}")  # what down cancels there
    return [
        sbatch,
        "--parsable",
        f"--job-name={spec.run_id}",
        *where,
        f"--nodes={len(spec.nodes)}",
        f"--nodelist={names}",
        "--exclusive",
        *(["--no-kill"] if spec.replicas else []),  # a node that fails leaves the others the allocation
        "--requeue",
        "--open-mode=append",
        # The environment sbatch is given (`batch_environment`), whole: --export=NONE would have slurmd
        # build a login environment (`su - USER -c env`) before every start, 0.3 to 1.3 s here.
        "--export=ALL",
        f"--output={spec.log}",
        f"--chdir={spec.folder}",
        script,
    ]


def batch_environment(paths: Paths) -> dict:
    """The batch job's environment: the submitting session's (what a launch held by fab's connections runs
    with), less that session's own SSH_* and any other job's or option's SLURM_*, SBATCH_*, SRUN_* and
    SALLOC_*, plus what Slurm's clients need (`step` sets each node's HOME and PATH itself)."""
    own = ("SSH_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
    kept = {name: value for name, value in os.environ.items() if not name.startswith(own)}
    return {**kept, **slurm_existing.client_environment(paths)}


def submit(spec: RunSpec) -> str:
    """sbatch the run; its job id."""
    folder = spec.folder
    os.makedirs(folder, exist_ok=True)
    paths = Paths(os.path.expanduser("~"))
    spec = spec.replace(nodes=tuple(n.replace(slurm_name=slurm_existing.slurm_name(paths, n.name)) for n in spec.nodes))
    script = os.path.join(folder, f"{spec.run_id}.sbatch")
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
    """What Slurm knows of the job: the controller while it remembers it, else the accounting (an existing
    Slurm's, or ours where the head node keeps it), else the completion log (ours), else the batch job's own
    end record beside its `log`."""
    result = _client(["scontrol", "show", "job", "--oneliner", job_id])
    if result.returncode == 0 and "JobState=" in result.stdout:
        return job_fields(result.stdout)
    paths = Paths(os.path.expanduser("~"))
    if slurm_existing.existing(paths) is not None:
        return accounted_state(job_id) or ended_state(log)
    accounted = accounted_state(job_id) if os.path.exists(slurm_accounting.dbd_conf_path(paths)) else None
    if accounted is not None:
        return accounted
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
        fields = "--format=State,ExitCode,Submit,Start,End"
        result = _client(["sacct", "--allocations", "--noheader", "--parsable2", f"--jobs={job_id}", fields])
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
    """node/calls.py's SubmitRun (a spec that does not fit: bad input, exit 2)."""
    try:
        typed = RunSpec.from_dict(spec)
    except SpecError as exc:
        raise BadInput(str(exc)) from None
    return {"job_id": submit(typed)}


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
            shown = {**shown, "participants": replicas.participants(log)}
        folder = os.path.dirname(log) if log else ""
        if shown is not None and folder and os.path.isdir(folder):
            shown = {
                **shown,
                "ever_started": os.path.exists(os.path.join(folder, contract.FIRST_START_RECORD)),
                "stragglers": straggler.named_in(folder),
            }
        found[job] = shown
    return {"states": found}


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("supervise", "follow"))
    parser.add_argument("spec", help="supervise: the spec as sbatch passes it; follow: the log")
    parser.add_argument("more", nargs="*", help="follow: JOB [OFFSET]")
    args = parser.parse_args(argv)
    try:
        if args.action == "supervise":  # a batch script written before node/slurm_batch.py
            from node import slurm_batch

            return slurm_batch.supervise(RunSpec.decoded(args.spec))
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
