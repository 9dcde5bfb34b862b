"""A node's output under Slurm, in records that Slurm's I/O carries whole, and read back into whole lines.

srun carries each task's output to the run's log in messages of at most 1,024 bytes (Slurm's
MAX_MSG_LEN, src/common/io_hdr.h). With `--unbuffered` a message is whatever the task's pipe held, cut
anywhere, so two nodes printing fast had their lines spliced into each other in the log. Without it,
slurmstepd sends whole lines only, as long as each line fits in one message. So each node's
`node/slurm_step.py` writes its output as records, one line each of at most `RECORD_BYTES`:

    \\x1e KIND NODE \\x1f PAYLOAD \\n     KIND: `n` the payload ends a line, `c` the line goes on

and the batch job (`node/slurm_output.py`) joins each node's records back into the pieces the node sent
(each ending at `\\n` or `\\r`) before they go into the log. A line longer than a record is several
records, joined again whatever other node's records come between them. Standard library only, and
nothing else imported: slurm_step.py starts in milliseconds on every node.
"""

from collections.abc import Callable

RECORD_BYTES = 1000
"""A record's whole size on the wire, under Slurm's 1,024-byte message (less its terminating NUL)."""
START = b"\x1e"
NAME_END = b"\x1f"
ENDS_LINE = b"n"
GOES_ON = b"c"


def frame(node: bytes, data: bytes) -> bytes:
    """`data` (what node `node` sends) as records."""
    head = len(START) + 1 + len(node) + len(NAME_END)
    room = max(RECORD_BYTES - head - 1, 1)
    out = []
    lines = data.split(b"\n")
    for index, line in enumerate(lines):
        last = index == len(lines) - 1
        if last and not line:
            break
        pieces = [line[at : at + room] for at in range(0, len(line), room)] or [b""]
        for number, piece in enumerate(pieces):
            kind = ENDS_LINE if not last and number == len(pieces) - 1 else GOES_ON
            out.append(START + kind + node + NAME_END + piece + b"\n")
    return b"".join(out)


class Unframer:
    """Records read from srun's output, as each node's pieces: `emit(node, piece)` once a piece is whole
    (it ends at `\\n` or `\\r`). What is no record (srun's own messages) goes out as it is, node b""."""

    def __init__(self, emit: Callable[[bytes, bytes], None]):
        self.emit = emit
        self.rest = b""  # the start of a record whose end has not come yet
        self.pieces: dict[bytes, bytes] = {}  # node: the start of its unfinished piece

    def feed(self, data: bytes) -> None:
        records = (self.rest + data).split(b"\n")
        self.rest = records.pop()
        for record in records:
            self._record(record)

    def end(self) -> None:
        """At the output's end: what is left goes out as it is."""
        if self.rest:
            self._record(self.rest, ended=False)
            self.rest = b""
        for node, piece in list(self.pieces.items()):
            self.emit(node, piece)
        self.pieces.clear()

    def _record(self, record: bytes, ended: bool = True) -> None:
        node, named, payload = record[2:].partition(NAME_END)
        if not (record.startswith(START) and record[1:2] in (ENDS_LINE, GOES_ON) and named):
            self.emit(b"", record + (b"\n" if ended else b""))
            return
        piece = self.pieces.pop(node, b"") + payload + (b"\n" if record[1:2] == ENDS_LINE else b"")
        if piece.endswith((b"\n", b"\r")):
            self.emit(node, piece)
        else:
            self.pieces[node] = piece


def unframed(data: bytes) -> bytes:
    """Records as the text they carry, each node's pieces in the order they came (a step's answers)."""
    out: list[bytes] = []
    reader = Unframer(lambda _node, piece: out.append(piece))
    reader.feed(data)
    reader.end()
    return b"".join(out)
