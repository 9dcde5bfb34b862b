"""On every node of a run held by Slurm: its part of the run (what the batch job's srun starts, one task per
node; not for people).

    python node/slurm_step.py SPEC_BASE64

It runs this node's command from the spec (found by SLURMD_NODENAME; the spec as node/run_spec.py
describes it) with the node's own HOME (jobs run with the submitter's environment otherwise, whose HOME
is the head node's where nodes share a machine) and writes its output, as it comes, with a `[node-i] `
prefix after every newline and carriage return, so progress bars stay live, in records (node/frames.py)
that Slurm carries whole; the batch job joins every node's into the run's log (node/slurm_output.py). On
SIGTERM or SIGHUP it passes the signal to the command's session and ends it after a grace period; it exits
with the command's status (128 + signal if killed).

A file of its own, with the standard library, node/contract.py, node/frames.py and node/run_spec.py only, so
that it starts in a few milliseconds on every node at every start (slurm_run.py's imports took about 0.1 s).
"""

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

if not __package__:  # run as a file: import its siblings from the code folder, ahead of any other `node`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from node import contract, frames  # noqa: E402
from node.run_spec import RunSpec  # noqa: E402

TERMINATE_GRACE_S = 5.0
"""How long the command's session has, after the signal it was passed, before it is killed."""
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
SEPARATOR = re.compile(rb"([\r\n])")
HOLD_S = 0.2
"""How long a node's unfinished line waits for its rest before it goes into the run's log as it is."""


def step_argv(spec: RunSpec, srun: str, *options: str) -> list:
    """srun of this file on every node of `spec`, one task each (`options`: srun's, e.g. --overlap)."""
    count = len(spec.nodes)
    return [
        srun,
        *options,
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",  # and Slurm's line-buffered output: each of the step's records one message
        "--export=NONE",  # each node's step: Slurm's variables only (`step` sets HOME and PATH), not the head's
        spec.python,
        "-u",
        os.path.abspath(__file__),
        spec.encoded(),
    ]


def exit_status(code: int) -> int:
    """A process's exit status as a shell says it: 128 + the signal that ended it."""
    return 128 - code if code < 0 else code


class Prefixer:
    """Puts `prefix` at the start of every line (a line ends at a newline or a carriage return), except
    on lines that already start with `own` (node/torchrun.py prefixes its ranks' lines itself, as
    `[node-1]` or `[node-1 rank 3]`; only the launch shell's own lines and markers arrive bare)."""

    def __init__(self, prefix: bytes, own: bytes = b""):
        self.prefix, self.own = prefix, own
        self.at_start = True
        self.pending = b""  # the start of a line too short yet to tell whether it is prefixed

    def __call__(self, chunk: bytes) -> bytes:
        out = []
        pieces = SEPARATOR.split(self.pending + chunk)
        self.pending = b""
        for index, piece in enumerate(pieces):
            if piece in (b"\r", b"\n"):
                out.append(piece)
                self.at_start = True
            elif piece:
                if self.at_start:
                    last = index == len(pieces) - 1
                    if last and self.own and len(piece) < len(self.own) and self.own.startswith(piece):
                        self.pending = piece
                        break
                    if not (self.own and piece.startswith(self.own)):
                        out.append(self.prefix)
                out.append(piece)
                self.at_start = False
        return b"".join(out)


def copy_whole_lines(fd: int, prefix, out, hold_s: float = HOLD_S) -> None:
    """Copy `fd` to `out` (prefixed) until its end, in whole pieces only (each ends at a `\\n` or a `\\r`):
    srun gathers every node's output into one log, where a piece left open would take the next node's
    output into its line (an unbuffered `print` writes its text, then the newline; a progress bar writes
    `\\r` and its text, then nothing for a while). A piece without a line end is held up to `hold_s` for its
    rest; held longer, it goes out ended by a `\\r`, as a line that is redrawn, and when its rest comes the
    whole line goes out again (a bar's next `\\r` only replaces it)."""
    pending, shown, held_since = b"", b"", 0.0
    while True:
        wait = max(0.0, held_since + hold_s - time.monotonic()) if pending else None
        if select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data = prefix(chunk)
            if not pending and data.startswith(b"\r"):  # at a line's start: nothing to redraw
                data, shown = data[1:], b""
            data = pending + shown + data  # a line that went out unfinished: its rest redraws it whole
            shown = b""
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            if cut:
                out.write(data[:cut])
                out.flush()
            if data[cut:] and not pending:
                held_since = time.monotonic()
            pending = data[cut:]
        elif pending:  # held long enough (a prompt, `loading...`, a slow bar): shown as it is
            out.write(pending + b"\r")
            out.flush()
            pending, shown = b"", pending
    if pending:
        out.write(pending + b"\n")
        out.flush()


class Framed:
    """A binary output that writes what it is given as node `node`'s records (node/frames.py)."""

    def __init__(self, node: bytes, out):
        self.node, self.out = node, out

    def write(self, data: bytes) -> None:
        self.out.write(frames.frame(self.node, data))

    def flush(self) -> None:
        self.out.flush()


def step(spec: RunSpec) -> int:
    """This node's part of the run: its command, its output prefixed; the command's exit status."""
    slurm_name = os.environ.get("SLURMD_NODENAME", "")
    node = next((n for n in spec.nodes if n.in_slurm == slurm_name), None)
    if node is None:
        print(f"error: no command for node {slurm_name!r} in this run", file=sys.stderr, flush=True)
        return 2
    name = node.name
    environment = {
        **os.environ,
        "HOME": node.home,
        "PATH": os.environ.get("PATH") or DEFAULT_PATH,
        contract.RESTART_COUNT_VARIABLE: os.environ.get("SLURM_RESTART_COUNT") or "0",
    }
    child = subprocess.Popen(
        ["bash", "-c", node.command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=environment,
        cwd=node.home,
        start_new_session=True,
    )

    def forward(signum, _frame):
        try:
            os.killpg(child.pid, signum)
        except OSError:
            return
        if signum == signal.SIGUSR1:  # a checkpoint request (a spot notice, --signal=USR1): the ranks save, go on
            return
        timer = threading.Timer(TERMINATE_GRACE_S, lambda: _kill_group(child.pid))
        timer.daemon = True
        timer.start()

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    prefix = Prefixer(f"[{name}] ".encode(), own=f"[{name}".encode())
    assert child.stdout is not None
    copy_whole_lines(child.stdout.fileno(), prefix, Framed(name.encode(), sys.stdout.buffer))
    return exit_status(child.wait())


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def main(argv: list | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: slurm_step.py SPEC_BASE64 (srun starts it; not for people)", file=sys.stderr)
        return 2
    try:
        return step(RunSpec.decoded(args[0]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: step: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
