"""A run held by Slurm keeps its log on the cluster (`contract.RUN_LOG` in its run folder on the head node:
every node's output, `[node-i] `-prefixed, and what Slurm, srun and the batch script print, bare). This is
its copy on this machine, in the run's local folder, brought while the run goes:

- `output.log`: the log's bytes as the cluster wrote them; its size is how much of the log is here, so the
  next look brings only the rest (`slurm_run.py follow LOG JOB OFFSET`, `tail -c`);
- `node-<i>.log`: each node's lines (its ranks' `[node-i rank r]` lines too), split from it as it grows;
- `cluster.log`: the lines no node wrote (Slurm's, srun's, `[cluster]` and `[watch]` from the batch script).

A piece of the log ends at a newline or a carriage return (the nodes write whole pieces only: a progress
bar's redraw is one); a piece with no prefix is the cluster's. The launch's markers are kept apart, never
written or shown. One command at a time adds to a copy (a lock on `output.log`): a command that finds it
held leaves it, since whoever holds it is following the run. `deploy.py down` brings the rest of every
unfinished run's log here before anything is removed (`before_down`), and marks the runs it ended.
"""

import codecs
import fcntl
import heapq
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra import state
from node import contract
from node.run_state import RunState

RAW = contract.RUN_LOG
"""The local copy of the run's log, byte for byte."""
CLUSTER_LOG = "cluster.log"
"""The lines of the run's log that no node wrote."""
RECORD = "run.json"
"""A scheduled run's record in its local run folder (remote/runs.py's `Run`)."""
NODE_LINE = re.compile(r"^\[(node-\d+)(?: rank \d+)?\] ?")
"""A node's prefix at a piece's start (`[node-1] `, `[node-1 rank 3] `): the node, and the whole prefix."""
PIECE = re.compile(r"(?<=[\r\n])")
BRING_TIMEOUT_S = 60.0
LINE_TIMES_SUFFIX = ".times"
"""Beside a fab-held run's `node-<i>.log`, `node-<i>.times`: one `OFFSET EPOCH` line per read that carried a
line end, the log's size after the read and when fab got it (remote/stream.py), so the nodes' logs can be
read back as one stream in time order (`timed_lines`). A Slurm-held run's `output.log` is in that order
already: the cluster appends each piece as it comes."""

Echo = Callable[[str, str], None]
"""Shows a piece: (its writer: the prefix, or '' for the cluster's lines; the piece, with its line end)."""


def pieces(text: str) -> tuple[list[str], str]:
    """`text` cut after every newline and carriage return: the whole pieces, and the unfinished rest."""
    found = PIECE.split(text)
    rest = found.pop() if found and not found[-1].endswith(("\r", "\n")) else ""
    return [piece for piece in found if piece], rest


def writer_of(piece: str) -> tuple[str | None, str]:
    """The node that wrote a piece (None: the cluster) and its whole prefix ('' for the cluster's)."""
    match = NODE_LINE.match(piece)
    return (match.group(1), match.group(0).rstrip()) if match else (None, "")


def line_times(log: Path) -> Path:
    """Where the arrival times of `log`'s lines are kept (`LINE_TIMES_SUFFIX`)."""
    return log.with_suffix(LINE_TIMES_SUFFIX)


def timed_lines(log: Path) -> list[tuple[float, str]] | None:
    """A fab-held node log's lines, each with when its end reached fab (the time of the first read that
    took the log past it; a line not ended yet: the last read's); None where no times were kept (an older
    run) or the log cannot be read."""
    try:
        data = log.read_bytes()
        kept = line_times(log).read_text().split("\n")
    except OSError:
        return None
    marks: list[tuple[int, float]] = []
    for entry in kept:
        offset, _, at = entry.partition(" ")
        try:
            marks.append((int(offset), float(at)))
        except ValueError:
            continue  # a line being written
    if not marks:
        return None
    found, start, mark = [], 0, 0
    for line in data.split(b"\n"):
        end = start + len(line) + 1
        start = end
        if not line.strip():
            continue
        while mark < len(marks) - 1 and marks[mark][0] < min(end, len(data)):
            mark += 1
        found.append((marks[mark][1], line.decode(errors="replace")))
    return found


def time_ordered(streams: list[list[tuple[float, str]]]) -> list[tuple[float, str]]:
    """Several writers' timed lines (each writer's in its own order) as one stream in time order: a merge,
    so each writer's lines stay in their own order whatever their times say (a node's lines never pass each
    other). Lines of equal time come in the order of their writers in `streams` (node-0 before node-1): a
    read that brought several lines gave them one time."""
    return list(heapq.merge(*streams, key=lambda timed: timed[0]))


def node_logs(folder: Path) -> list[Path]:
    """A run folder's node logs in node order (node-2 before node-10)."""

    def order(path: Path) -> tuple[int, str]:
        number = path.stem.rpartition("-")[2]
        return (int(number), path.stem) if number.isdigit() else (1 << 30, path.stem)

    return sorted(folder.glob("node-*.log"), key=order)


def with_prefix(log: Path, line: str) -> str:
    """A log's line with its node's prefix (a node's lines carry it; fab's own lines about a node too)."""
    own = log.name == CLUSTER_LOG
    return line if own or line.startswith(f"[{log.stem}") else f"[{log.stem}] {line}"


def in_time_order(folder: Path, count: int = 0) -> list[tuple[float, str]] | None:
    """A fab-held run's node logs as one stream in time order (`timed_lines`, merged by `time_ordered`):
    the last `count` lines of each node (0: all), each with its node's prefix. None where the run has no
    node log, or a node's log has no times kept (an older run, or one Slurm held): shown node after node."""
    paths = node_logs(folder)
    timed = [timed_lines(path) for path in paths]
    if not paths or any(lines is None for lines in timed):
        return None
    return time_ordered(
        [
            [(when, with_prefix(path, line)) for when, line in (lines or [])[-count if count > 0 else 0 :]]
            for path, lines in zip(paths, timed, strict=True)
        ]
    )


def as_line(piece: str) -> str:
    """A piece as a line of a file: a redraw (ended by `\\r`) becomes a line of its own."""
    return piece if piece.endswith("\n") else piece.rstrip("\r") + "\n"


class LogCopy:
    """The local copy of one run's log, added to as the log arrives (`add`), each whole piece filed under
    its writer and shown through `echo`; the launch's markers (`markers`) and the follower's end marker
    (`end`) noted instead. With `write` False nothing is written (a replay, or a read of the markers)."""

    def __init__(self, folder: Path, echo: Echo | None = None, write: bool = True):
        self.folder, self.echo, self.write = folder, echo, write
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.unfinished: list[str] = []
        """The unfinished last piece, in the parts it came in: joined once when its end comes, so a long
        line costs its length, not its length squared (each part was added to all before it)."""
        self.files: dict[str, object] = {}
        self.markers: dict[str, dict[str, str]] = {}
        """Each node's marker lines, by the marker's name (contract.EXIT_MARKER, contract.RANKS_MARKER)."""
        self.end: tuple[str, int | None] | None = None
        """The follower's end marker: Slurm's state and the job's exit code."""
        self.log_bytes: int | None = None
        """The log's size on the cluster, as the follower's end marker gives it."""
        self.lock_fd: int | None = None
        self.fresh = False
        """Held with nothing of the log here yet: split files already here are from an older fab."""

    @property
    def offset(self) -> int:
        """How many of the log's bytes are here."""
        try:
            return (self.folder / RAW).stat().st_size
        except OSError:
            return 0

    def hold(self, wait_s: float = 0.0) -> bool:
        """Take the copy for this command (within `wait_s`); False where another command holds it. A copy
        without its `output.log` (split by an older fab) is split again from the log's beginning."""
        self.lock_fd = os.open(state.make_private_dir(self.folder) / RAW, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.lock_fd)
                    self.lock_fd = None
                    return False
                time.sleep(0.1)
        self.fresh = self.offset == 0
        return True

    def resume(self) -> None:
        """Go on from what is here: its markers noted, its unfinished last piece kept for its rest (shown
        through `echo` where there is one: a replay)."""
        try:
            data = (self.folder / RAW).read_bytes()
        except OSError:
            return
        write, self.write = self.write, False
        try:
            self._split(self.decoder.decode(data))
        finally:
            self.write = write

    def add(self, data: bytes) -> None:
        """Bytes of the log as they come: kept, then split."""
        if not data:
            return
        if self.write and self.lock_fd is not None:
            if self.fresh:  # what an older fab split from the log's beginning, without keeping the log
                for path in [*self.folder.glob("node-*.log"), self.folder / CLUSTER_LOG]:
                    path.unlink(missing_ok=True)
                self.fresh = False
            os.write(self.lock_fd, data)
        self._split(self.decoder.decode(data))

    @property
    def partial(self) -> str:
        return "".join(self.unfinished)

    def _split(self, text: str) -> None:
        found, rest = pieces(text)  # only the new text is cut: the unfinished piece is not cut again
        if found:
            found[0], self.unfinished = "".join([*self.unfinished, found[0]]), []
        if rest:
            self.unfinished.append(rest)
        for piece in found:
            self._piece(piece)

    def _piece(self, piece: str) -> None:
        line = piece.rstrip("\r\n")
        if not line:
            return
        if line.startswith(contract.RUN_END_MARKER):
            words = line.split()
            code = words[2] if len(words) > 2 else "-"
            self.end = (words[1] if len(words) > 1 else "UNKNOWN", int(code) if code.lstrip("-").isdigit() else None)
            self.log_bytes = int(words[3]) if len(words) > 3 and words[3].isdigit() else None
            return
        node, prefix = writer_of(piece)
        if node is None and line.startswith(contract.RESTART_LINE):  # a requeued run starts again
            self.markers.clear()
        payload = piece[len(prefix) :].lstrip(" ") if node else piece
        if node and payload.startswith(contract.MARKER_START):  # the launch's markers: kept, never shown
            self.markers.setdefault(node, {})[payload.split(" ", 1)[0]] = payload.strip()
            return
        if self.write:
            self._file(node or "cluster").write(as_line(piece))
        if self.echo:
            self.echo(prefix, piece)

    def _file(self, writer: str):
        found = self.files.get(writer)
        if found is None:
            name = CLUSTER_LOG if writer == "cluster" else f"{writer}.log"
            found = self.files[writer] = state.open_private(self.folder / name, "a", buffering=1)
        return found

    def close(self, ended: bool = False) -> None:
        """Stop adding: where the run has `ended`, its unfinished last piece is a line too; else it waits in
        `output.log` for its rest. The copy is free for the next command."""
        if ended and self.unfinished:
            self._piece(self.partial + "\n")
            self.unfinished = []
        for file in self.files.values():
            file.close()  # type: ignore[attr-defined]
        self.files = {}
        if self.lock_fd is not None:
            if self.log_bytes is not None and self.write:  # the end marker came after the log's last byte
                os.ftruncate(self.lock_fd, min(self.log_bytes, os.fstat(self.lock_fd).st_size))
            os.close(self.lock_fd)
            self.lock_fd = None


def read_markers(folder: Path) -> dict[str, dict[str, str]]:
    """The launch's markers in the copy that is here, by node."""
    copy = LogCopy(folder, write=False)
    copy.resume()
    copy.close(ended=True)
    return copy.markers


def tail_command(log: str, offset: int) -> str:
    """The log from byte `offset` on, after one line: the batch job's end record (contract.END_RECORD, one
    line of JSON) where it has ended, else an empty line."""
    ended = shlex.quote(f"{log.rsplit('/', 1)[0]}/{contract.END_RECORD}")
    return f"cat {ended} 2>/dev/null; echo; tail -c +{offset + 1} {shlex.quote(log)} 2>/dev/null; true"


# ------------------------------------------------------------------------------------------- down


@dataclass
class Unfinished:
    """A run `down` found not finished here."""

    folder: Path
    record: dict
    end: dict | None = None
    """Its batch job's end, where it had ended on the cluster (`slurm_run.end_record_state`); else down ends it."""
    started: bool = False
    """Whether its log has anything: it had started (else it waited in the queue)."""


def unfinished_runs(stack: str) -> list[Unfinished]:
    found = []
    root = state.runs_dir(stack)
    for record_path in sorted(root.glob(f"*/{RECORD}")) if root.is_dir() else []:
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and not record.get("finished") and record.get("log"):
            found.append(Unfinished(record_path.parent, record))
    return found


def before_down(stack: str, say) -> list[Unfinished]:
    """Before `down` removes anything: the rest of every unfinished run's log brought from the head node
    (where it answers); the runs, each noted ended where its batch job had."""
    runs = unfinished_runs(stack)
    if not runs:
        return []
    from infra import inventory  # `down` only: every fab start imports this module (remote/stream.py)

    try:
        cluster = inventory.load(stack)
    except Exception as exc:  # no inventory (an interrupted up): nothing to ask
        say(f"could not bring the logs of {len(runs)} run(s): {exc}")
        return runs
    for run in runs:
        _bring_before_down(cluster, run, say)
    return runs


def _bring_before_down(cluster, run: Unfinished, say) -> None:
    import asyncio

    from infra import ssh

    copy = LogCopy(run.folder)
    if not copy.hold():  # a fab follows the run: its log is here as it goes
        run.started = copy.offset > 0 or bool(run.record.get("started_at"))
        return
    try:
        result = asyncio.run(
            ssh.run(
                cluster,
                cluster.head,
                tail_command(run.record["log"], copy.offset),
                BRING_TIMEOUT_S,
                encoding=None,
            )
        )
        end_record, _, data = bytes(result.stdout or b"").partition(b"\n")
        run.end = _end_state(end_record)
        copy.resume()
        copy.add(data)
    except Exception as exc:  # the head is gone already: what came before is all there is
        say(f"could not bring the rest of run {run.record.get('run_id')}'s log: {ssh.describe(exc)}")
    finally:
        run.started = copy.offset > 0 or bool(run.record.get("started_at"))  # it wrote, or was seen running
        copy.close(ended=True)


def _end_state(line: bytes) -> dict | None:
    from node import slurm_run

    try:
        return slurm_run.end_record_state(json.loads(line))
    except ValueError:
        return None


def after_down(runs: list[Unfinished], say, at: float | None = None) -> None:
    """Once down has removed the cluster: each run recorded as it ended (nothing will finish it: no summary
    comes), those down ended as CANCELLED, and named. The ledger prices a run that never started at nothing
    (it waited in the queue: no node worked for it) and one that had ended at its batch job's own end; the
    rest end with the cluster."""
    from infra import costs  # the ledger and the prices: `down` only, not every fab start

    at = time.time() if at is None else at
    ended = {run.record.get("run_id", run.folder.name): run.end for run in runs if run.end or not run.started}
    costs.record_runs_down(ended, at, say)
    for run in runs:
        record, run_id = run.record, run.record.get("run_id", run.folder.name)
        if run.end is not None:
            record.update({key: run.end[key] for key in ("state", "ended_at", "exit_code")})
        elif record.get("ended_at") is None:
            was = "running" if run.started else "queued"
            say(f"run {run_id}, {was}, was cancelled with the cluster; its log is kept in {run.folder}")
            record.update(state=RunState.CANCELLED, ended_at=at)
        record["finished"] = True
        state.write_atomic(run.folder / RECORD, json.dumps(record, indent=2) + "\n")
