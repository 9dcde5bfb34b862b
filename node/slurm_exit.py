"""The exit code of a run held by Slurm, as its batch job ends with it: the run's own, by the rule fab's
record uses (node/outcome.py: the failed rank that exited first, by the nodes' ranks lines in the log), so
Slurm's books say what fab says; where the log has no ranks lines (a step that is not a torchrun launch),
the code of the node that failed first as srun said it, not the highest of all.

srun exits with the highest of its tasks' codes. A run's step is `--kill-on-bad-exit`: the node whose
command exits 3 ends the others, which exit 143 (SIGTERM), so srun, the batch job and Slurm's books said
143 where the run failed with 3. srun says each task's end as it learns of it (`srun: error: node-1:
task 1: Exited with exit code 3`, or the signal's name), into the run's log: the first such line is the
failure, the rest its consequence. A cancelled step's tasks are not said (srun is quiet once cancelled).
Standard library only.
"""

import os
import re

from node import outcome

TAIL_BYTES = 1 << 20
"""How much of the log's end (since the step started) is read: srun's lines come within seconds of the
failure, whatever the other nodes still wrote."""
TASK_END = re.compile(
    rb"^srun: error: \S+: tasks? [0-9,\-\[\]]+: "
    rb"(?:Exited with exit code (\d+)|([A-Z][A-Za-z0-9 ]+?)(?: \(core dumped\))?)$",
    re.M,
)
SIGNALS = {
    b"Hangup": 1,
    b"Interrupt": 2,
    b"Quit": 3,
    b"Illegal instruction": 4,
    b"Aborted": 6,
    b"Bus error": 7,
    b"Floating point exception": 8,
    b"Killed": 9,
    b"User defined signal 1": 10,
    b"Segmentation fault": 11,
    b"User defined signal 2": 12,
    b"Terminated": 15,
}
"""strsignal(3)'s words, as srun says a task a signal ended."""


def log_size(log: str) -> int:
    try:
        return os.path.getsize(log)
    except OSError:
        return 0


def first_failure(text: bytes) -> int | None:
    """The code (128 + signal for a signal) of the first task srun says failed in `text`; None if none."""
    for match in TASK_END.finditer(text):
        if match.group(1) is not None:
            return int(match.group(1))
        number = SIGNALS.get(match.group(2))
        if number is not None:
            return 128 + number
    return None


def run_code(log: str, offset: int, code: int, order: list | None = None) -> int:
    """The run's exit code: where srun's `code` says it failed, the first failed rank's own code by the
    nodes' ranks lines in the log written since `offset` (the step's start), else that of the task srun
    says failed first; else `code`."""
    if code == 0:
        return 0
    try:
        with open(log, "rb") as f:
            end = os.fstat(f.fileno()).st_size
            f.seek(max(offset, end - TAIL_BYTES))
            text = f.read()
    except OSError:
        return code
    first = outcome.from_log(text.decode(errors="replace"), order)
    if first is not None:
        return 128 - first.exit_code if first.exit_code < 0 else first.exit_code  # a signal: as a shell says it
    found = first_failure(text)
    return code if found is None else found
