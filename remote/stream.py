"""Remote output, copied as it arrives to the terminal and to each node's log file; what the nodes said of
their ranks (`RankOutcome`).

The nodes prefix their own lines (`[node-1]`, `[node-1 rank 3]`: `node/output.py`, run by
`node/torchrun.py`), so this side copies bytes in large reads and never splits the output into lines:
a job writing as fast as it can is not slowed by fab, and a progress bar redrawn with `\\r` shows live.
What is done per read is one search for the launch's markers (lines starting with
`contract.MARKER_START`, kept out of the terminal and the log) and, on the terminal only, ending a line
that another node's output or fab's own line would otherwise continue.
"""

import json
import math
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from infra import runlog, state
from node import contract

if TYPE_CHECKING:  # rich loads only where a table is printed
    from rich.console import Console

READ_BYTES = 1 << 16
TAIL_BYTES = 1 << 14  # kept of each node's output, for the lines shown when a step fails
TAIL_LINES = 40
MARKER = contract.MARKER_START.encode()


class Writer(Protocol):
    """Who writes on the terminal: a node's stream, or one writer of a scheduled run's log."""

    resumed: bool
    """Set by the terminal when another writer ended this writer's unfinished line."""
    line_prefix: bytes
    """The prefix its next bytes need after `resumed`."""


class LogWriter:
    """One writer of a scheduled run's log (a node, a rank, the cluster): each of its pieces starts with
    its own prefix, so a line of it that another writer ended needs none again."""

    line_prefix = b""

    @property
    def resumed(self) -> bool:
        return False

    @resumed.setter
    def resumed(self, value: bool) -> None:
        pass


class Terminal:
    """fab's standard output, shared by every node's stream and fab's own lines.

    A node's unfinished line (bytes after its last line end, no `\\r` among them) is held up to `HOLD_S`
    for the rest of it: SSH delivers output in pieces that can end mid-line, and another node's line
    written meanwhile would cut it in two. Held longer (a prompt, `loading...` then ` done` much later),
    it is shown; whoever then writes ends that line first, and its writer's next bytes start with the
    line's prefix again. A line redrawn with `\\r` (a progress bar) is never held."""

    HOLD_S = 0.2

    def __init__(self):
        self.lock = threading.Lock()
        self.unfinished: Writer | None = None
        self.held: dict[Writer, bytes] = {}
        self.timer: threading.Timer | None = None

    def write(self, writer: Writer | None, data: bytes) -> None:
        with self.lock:
            if writer is not None:
                data = self.held.pop(writer, b"") + data
                cut = data.rfind(b"\n") + 1
                if b"\r" not in data[cut:] and data[cut:]:
                    self.held[writer] = data[cut:]
                    data = data[:cut]
                    self._flush_later()
            self._write(writer, data)

    def release(self, writer: Writer | None = None) -> None:
        """Show what is held (of `writer`, or of every writer)."""
        with self.lock:
            for held in [writer] if writer is not None else list(self.held):
                self._write(held, self.held.pop(held, b""))

    def _flush_later(self) -> None:
        if self.timer is None or not self.timer.is_alive():
            self.timer = threading.Timer(self.HOLD_S, self.release)
            self.timer.daemon = True
            self.timer.start()

    def _write(self, writer: Writer | None, data: bytes) -> None:
        if not data:
            return
        sys.stdout.flush()
        out = getattr(sys.stdout, "buffer", None) or _Text(sys.stdout)
        if self.unfinished is not None and self.unfinished is not writer:
            out.write(b"\n")
            self.unfinished.resumed = True
            self.unfinished = None
        if writer is not None and writer.resumed:
            writer.resumed = False
            if data[:1] not in (b"\n", b"\r"):
                out.write(writer.line_prefix)
        out.write(data)
        out.flush()
        # a line redrawn with `\r` is unfinished too: another writer would draw over it
        self.unfinished = writer if writer is not None and not data.endswith(b"\n") else None


terminal = Terminal()


class _Text:
    """A text stream (one without `.buffer`) taking bytes."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


class NodeStream:
    """One node's output: bytes go to the terminal and to the node's log as they come; lines that
    start with `contract.MARKER_START` are kept in `markers` (by the marker's name) and not shown."""

    def __init__(self, name: str, index: int, log_path: Path | None, echo: bool = True):
        self.name = name
        self.echo = echo
        self.log: IO[bytes] | None = state.open_private(log_path, "ab", buffering=0) if log_path else None
        self.times: IO[bytes] | None = None
        """`runlog.line_times`: the log's size and the time after each write that ended a line."""
        self.logged = 0
        if log_path and self.log:
            self.times = state.open_private(runlog.line_times(log_path), "ab", buffering=0)
            self.logged = os.fstat(self.log.fileno()).st_size
        self.held = b""
        """Bytes at a line's start that may be the start of a marker: shown once they are not."""
        self.at_line_start = True
        self.resumed = False
        """Set by the terminal when another writer ended this stream's unfinished line."""
        self.line_prefix = f"[{name}] ".encode()
        """The prefix of the line under way (the node's own, `[node-1 rank 3] `), for `resumed`."""
        self.tail_bytes = b""
        self.markers: dict[str, str] = {}
        self.lock = threading.Lock()
        self.closed = False
        """After `close` (a stopped launch gives up on a node) what still arrives is dropped."""

    def feed(self, data: bytes) -> None:
        """Bytes as the node sent them."""
        with self.lock:
            if not self.closed:
                self._feed(data)

    def _feed(self, data: bytes) -> None:
        data, self.held = self.held + data, b""
        start = 0
        while True:
            at = self._marker_at(data, start)
            if at < 0:
                break
            end = data.find(b"\n", at)
            if end < 0:  # the marker's line is not whole yet
                self._emit(data[start:at])
                self.held = data[at:]
                return
            self._emit(data[start:at])
            self._note_marker(data[at:end].decode(errors="replace").rstrip("\r"))
            start = end + 1
            self.at_line_start = True
        rest = data[start:]
        line_start = rest.rfind(b"\n") + 1 if b"\n" in rest else (0 if self.at_line_start else -1)
        if line_start >= 0 and rest[line_start:] and MARKER.startswith(rest[line_start:]):
            self.held = rest[line_start:]  # could still become a marker
            rest = rest[:line_start]
        self._emit(rest)

    def _marker_at(self, data: bytes, start: int) -> int:
        if start == 0 and self.at_line_start and data.startswith(MARKER):
            return 0
        if start > 0 and data.startswith(MARKER, start):
            return start
        found = data.find(b"\n" + MARKER, start)
        return found + 1 if found >= 0 else -1

    def _note_marker(self, line: str) -> None:
        name, _, rest = line.partition(" ")
        self.markers[name] = rest

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        self.at_line_start = data.endswith(b"\n")
        self.tail_bytes = (self.tail_bytes + data)[-TAIL_BYTES:]
        self._learn_prefix(data)
        if self.log:
            self.log.write(data)
            self.logged += len(data)
            if self.times and b"\n" in data:
                self.times.write(f"{self.logged} {time.time():.6f}\n".encode())
        if self.echo:
            terminal.write(self, data)

    def _learn_prefix(self, data: bytes) -> None:
        line = data[data.rfind(b"\n") + 1 :].rsplit(b"\r", 1)[-1]
        if line.startswith(b"[") and b"] " in line[:64]:
            self.line_prefix = line[: line.index(b"] ") + 2]

    def write(self, text: str) -> int:
        """A line of fab's own about this node, with the node's prefix."""
        with self.lock:
            if not self.closed:
                prefix = "" if self.at_line_start else "\n"
                self._emit(f"{prefix}[{self.name}] {text}".encode())
        return len(text)

    @property
    def tail(self) -> list[str]:
        """The last lines of the node's output."""
        return self.tail_bytes.decode(errors="replace").splitlines()[-TAIL_LINES:]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            if self.held:
                self._emit(self.held)
                self.held = b""
            if not self.at_line_start:
                self._emit(b"\n")
            self.closed = True
            if self.echo:
                terminal.release(self)
            if self.log:
                self.log.close()
                self.log = None
            if self.times:
                self.times.close()
                self.times = None


@dataclass(frozen=True)
class RankOutcome:
    """What node/torchrun.py said of a node's ranks when its torchrun returned (`contract.RANKS_MARKER`)."""

    exit_codes: dict[str, int] = field(default_factory=dict)
    """The failed ranks' own exit codes by global rank, from torchrun's failure record (-N: signal N)."""
    process_group: bool | None = None
    """Whether any rank of the node formed a process group; None where unknown (no monitor, a failure)."""
    times: dict = field(default_factory=dict)
    """The node's clock: `started` and `ended` (its torchrun), `group`, `first_step` (its ranks')."""
    exited_at: dict[str, float] = field(default_factory=dict)
    """When each failed rank's process exited, by the node's clock (absent where the node did not say)."""

    @classmethod
    def parse(cls, text: str | None) -> "RankOutcome":
        try:
            data = json.loads(text or "")
            codes = {str(rank): int(code) for rank, code in dict(data.get("exit_codes") or {}).items()}
            group = data.get("process_group")
            times = {k: float(v) for k, v in dict(data.get("times") or {}).items() if isinstance(v, (int, float))}
            ended = data.get("exited_at") if isinstance(data.get("exited_at"), dict) else {}
            exited_at = {str(r): float(at) for r, at in ended.items() if _finite(at) and str(r) in codes}
            return cls(codes, group if isinstance(group, bool) else None, times, exited_at)
        except (ValueError, TypeError, AttributeError, ArithmeticError):
            return cls()

    def describe(self) -> str:
        """`rank 1 exited 3, rank 2 was killed by SIGKILL`, or empty."""
        return ", ".join(f"rank {rank} {_ended(code)}" for rank, code in self.exit_codes.items())


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def node_exited(node: str, code: int | None, outcome: RankOutcome) -> str:
    """`node-1 exited 1 (rank 1 exited 3)`: the node's code, and its failed ranks' own."""
    ranks = outcome.describe()
    return f"{node} exited {code}" + (f" ({ranks})" if ranks else "")


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Feed(Protocol):
    """What takes a command's output as it comes (`feed`), bytes as they arrive."""

    def feed(self, data: bytes) -> None: ...


def copy_channel(channel, stream: Feed, errors: Feed | None = None) -> int:
    """Copy an SSH channel's output (stderr merged in, or into `errors` where given) into `stream` until
    the command exits; its exit status (-1 where the channel closed without one)."""
    while errors is not None:
        moved = False
        for ready, receive, feed in (
            (channel.recv_ready, channel.recv, stream),
            (channel.recv_stderr_ready, channel.recv_stderr, errors),
        ):
            if ready():
                data = receive(READ_BYTES)
                if data:
                    feed.feed(data)
                    moved = True
        if moved:
            continue
        if channel.closed or (channel.exit_status_ready() and channel.eof_received):
            if not (channel.recv_ready() or channel.recv_stderr_ready()):
                break
        select.select([channel], [], [], 0.2)
    while errors is None:
        data = channel.recv(READ_BYTES)
        if not data:
            break
        stream.feed(data)
    return channel.recv_exit_status()


def console() -> "Console":
    """rich output for tables: the terminal's width, or a wide page when piped (logs, CI)."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def say(message: str) -> None:
    """A line of `fab`'s own, kept apart from node output."""
    terminal.write(None, (message + "\n").encode())
