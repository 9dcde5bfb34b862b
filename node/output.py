"""A node's job output, prefixed on the node: `[node-1]` on every line, `[node-1 rank 3]` where the node
runs several ranks, written as it arrives (a progress bar redrawn with `\\r` shows live).

`node/torchrun.py` gives every rank a pipe of its own (stdout and stderr together, in the order the
rank wrote them) and sends its own output (torchrun's agent, torch's C++ warnings) through one more;
a thread per pipe copies what it reads, a prefix after every line end and every carriage return, into
a spool file on the node's disk, from which one more thread sends it to the node's real output. The work
per read is two `bytes.replace` calls and a write to that file, so a rank writing as fast as it can is
slowed no more than by writing to a file, however slowly its output is read; whoever reads the node's
output (fab over SSH, or a log file) copies bytes and never splits lines. Where two ranks' lines would
meet in one line (one wrote part of a line, then another wrote), the unfinished line is ended first,
and its rest gets its prefix again. Standard library only.
"""

import fcntl
import os
import re
import select
import tempfile
import threading
import time
from typing import Protocol

READ_BYTES = 1 << 20
PIPE_BYTES = 1 << 20  # a rank's pipe holds this much before the rank waits (Linux's default: 64 kB)
DRAIN_WAIT_S = 2.0  # for the pipes to be read to their end, all of them together
IDLE_S = 0.1  # how often an idle pipe's thread looks whether the job has ended


def rank_pipe() -> tuple[int, int]:
    """A pipe for a rank's output, as large as this Linux lets a user make it (fewer wake-ups when a rank
    writes a lot)."""
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(write_fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or not Linux: the default size works too
        pass
    return read_fd, write_fd


def node_prefix(node: str, rank: int | None = None) -> bytes:
    """`[node-1] `, or `[node-1 rank 3] ` where the node runs several ranks."""
    return (f"[{node}] " if rank is None else f"[{node} rank {rank}] ").encode()


def prefixed(data: bytes, prefix: bytes, at_line_start: bool) -> tuple[bytes, bool]:
    """`data` with `prefix` at the start of every line and after every carriage return; and whether
    the output ends at a line's start (after `\\n` or `\\r`), where the next byte needs a prefix."""
    if not data:
        return b"", at_line_start
    data = data.replace(b"\r\n", b"\n")
    body = data.replace(b"\n", b"\n" + prefix).replace(b"\r", b"\r" + prefix)
    ends_line = data.endswith((b"\n", b"\r"))
    if ends_line and prefix:
        body = body[: -len(prefix)]
    lead = prefix if at_line_start and not data.startswith(b"\r") else b""  # `\r` brings its own
    return lead + body, ends_line


PREFIX = re.compile(r"^\[node-\d+(?: rank \d+)?\] ", re.M)
"""A prefix `node_prefix` makes, at a line's start."""


def unprefixed(text: str) -> str:
    """A node's output as its ranks wrote it, for reading it back (the prefixes and the redrawn parts of
    lines gone: what follows a line's last `\r`)."""
    return "\n".join(PREFIX.sub("", line.rsplit("\r", 1)[-1]) for line in text.split("\n"))


class Source:
    """One writer (a rank, or torchrun itself): its prefix, and whether its output stands at a line's start."""

    def __init__(self, prefix: bytes):
        self.prefix = prefix
        self.at_line_start = True


class Spool:
    """What the node sends, kept in a file on the node's disk as it is written, and copied from there to
    the node's real output by a thread of its own. A rank writes at the speed of that disk, never at
    the speed of whoever reads the output (fab over SSH, in the thousands of miles or on a loaded
    machine): a burst of output waits here, and the copy catches up. The file is unlinked from the
    start, so it goes when the process does."""

    def __init__(self, fd: int, folder: str | None = None):
        self.fd = fd
        self.folder = folder if folder and os.path.isdir(folder) else tempfile.gettempdir()
        self.file = tempfile.TemporaryFile(dir=self.folder)
        self.unspooled: OSError | None = None
        """Why the spool file took no more (its disk full): what came after went straight to the output."""
        self.size = 0
        self.sent = 0
        self.more = threading.Condition()
        self.finished = False
        self.broken = False
        self.thread = threading.Thread(target=self._copy, name="gpu-cluster-spool", daemon=True)
        self.thread.start()

    def append(self, data: bytes) -> bool:
        """Add to the end (callers hold one lock, so appends never interleave). Where the spool's disk is full,
        what was spooled is sent, and this and all after it go straight to the output, as slowly as it is read;
        False the first time (`unspooled` says why), so that the caller can say so."""
        if not data:
            return True
        written, first = 0, False
        if self.unspooled is None:
            try:
                while written < len(data):
                    written += os.write(self.file.fileno(), data[written:])
            except OSError as exc:  # ENOSPC, EDQUOT: never lose the output for want of a spool
                self.unspooled, first = exc, True
            with self.more:
                self.size += written
                self.more.notify()
        if written < len(data):
            self.finish()  # what was spooled goes out first
            self._send(data[written:])
        return not first

    def _copy(self) -> None:
        while True:
            with self.more:
                while self.sent == self.size and not self.finished:
                    self.more.wait()
                if self.sent == self.size:
                    return
                wanted = min(READ_BYTES * 4, self.size - self.sent)
            data = os.pread(self.file.fileno(), wanted, self.sent)
            self._send(data)
            self.sent += len(data)
            if self.broken:
                return

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except InterruptedError:
                continue
            except OSError:  # the reader went away (a dropped connection): the job goes on regardless
                self.broken = True
                return

    def finish(self) -> None:
        """Wait until everything appended has been sent (or the output is gone)."""
        with self.more:
            self.finished = True
            self.more.notify()
        self.thread.join()
        self.file.close()


class Reader(Protocol):
    """What a pipe's reader does with what it reads (`feed`), and at the pipe's end (`end`)."""

    def feed(self, data: bytes) -> None: ...

    def end(self) -> None: ...


class AsItComes:
    """A pipe's output, as it comes, from one source."""

    def __init__(self, mux: "Mux", source: Source):
        self.mux, self.source = mux, source

    def feed(self, data: bytes) -> None:
        self.mux.write(self.source, data)

    def end(self) -> None:
        pass


class Mux:
    """Everything a node's job writes, prefixed, through one `Spool` onto one file descriptor (the
    node's real output)."""

    def __init__(self, fd: int, spool_folder: str | None = None, prefix: bytes = b""):
        self.spool = Spool(fd, spool_folder)
        self.prefix = prefix
        """The node's own prefix, for what the mux itself has to say."""
        self.lock = threading.Lock()
        self.unfinished: Source | None = None
        """The source whose last write ended mid-line."""
        self.threads: list[threading.Thread] = []
        self.ended = threading.Event()
        """Set when torchrun has returned: its ranks have exited, what they wrote is in the pipes already."""

    def write(self, source: Source, data: bytes) -> None:
        with self.lock:
            head = b""
            if self.unfinished is not None and self.unfinished is not source:
                head = b"\n"  # end the other source's line before this one starts
                self.unfinished.at_line_start = True
            out, source.at_line_start = prefixed(data, source.prefix, source.at_line_start)
            if out:  # a line redrawn with `\r` is unfinished too: another rank's line would draw over it
                self.unfinished = None if out.endswith(b"\n") else source
            if not self.spool.append(head + out):
                self._say_unspooled()

    def _say_unspooled(self) -> None:
        """One line in the output itself where the spool's disk is full: the operator learns it from the log."""
        head = b""
        if self.unfinished is not None:
            head, self.unfinished.at_line_start, self.unfinished = b"\n", True, None
        why = self.spool.unspooled
        text = f"gpu-cluster: this node's disk is full ({why.strerror if why else 'no space'}: {self.spool.folder}); "
        self.spool.append(head + self.prefix + (text + "its output goes on unspooled\n").encode())

    def follow(
        self, read_fd: int, prefix: bytes, name: str = "gpu-cluster-output", reader: "Reader | None" = None
    ) -> threading.Thread:
        """Copy a pipe's output from a thread of its own until every writer has closed it; `reader`: what
        turns what is read into the sources' writes (else one source with `prefix`, as it comes)."""
        if reader is None:
            reader = AsItComes(self, Source(prefix))

        def copy() -> None:
            try:
                while True:
                    # Once the job has ended, a pipe with nothing left is done even if it is still open (a
                    # rank's child left running holds it; torchrun signals only the ranks still alive).
                    if not select.select([read_fd], [], [], 0 if self.ended.is_set() else IDLE_S)[0]:
                        if self.ended.is_set():
                            return
                        continue
                    data = os.read(read_fd, READ_BYTES)
                    if not data:
                        return
                    reader.feed(data)
            finally:
                reader.end()
                os.close(read_fd)

        thread = threading.Thread(target=copy, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def drain(self, timeout_s: float = DRAIN_WAIT_S) -> None:
        """Once the job has ended: read what the pipes hold (within `timeout_s` in all), end a line left
        unfinished, and send all that the spool holds."""
        self.ended.set()
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            if self.unfinished is not None:
                self.spool.append(b"\n")
                self.unfinished = None
        self.spool.finish()


class OwnOutput:
    """This process's own stdout and stderr (file descriptors 1 and 2) sent through `mux` with `prefix`;
    `restore()` puts them back, so what is printed after it goes out bare (the launch's markers)."""

    def __init__(self, mux: Mux, prefix: bytes, saved: tuple[int, int]):
        self.mux, self.saved = mux, saved
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = mux.follow(read_fd, prefix, name="gpu-cluster-own-output")

    @classmethod
    def start(cls, node: str, spool_folder: str | None = None) -> "OwnOutput":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        saved = (os.dup(1), os.dup(2))
        return cls(Mux(saved[0], spool_folder, node_prefix(node)), node_prefix(node), saved)

    def restore(self) -> None:
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.saved[0], 1)  # the pipe's last writers close: its reader sees its end
        os.dup2(self.saved[1], 2)
        self.mux.drain()
        os.close(self.saved[1])
