"""The run's log on the head node, as the batch job writes it: every node's output in whole lines.

Each srun of the run (its step, and a replica group started again beside it) sends its output through a
pipe of its own to the batch job, which joins each node's records (node/frames.py) back into the pieces
the node sent and writes them, with the batch job's own lines, through one `node/output.py` Mux onto the
log (the job's standard output): the same merge that keeps ranks' lines whole on a node of a run held by
fab's connections, so a node's line never meets another's, and a progress bar's unfinished line is ended
before another node's line starts.

    output = RunOutput.start()        # the batch job's stdout and stderr go through it too
    step = popen(argv)                # an srun whose output is read as records
    ...
    output.close()                    # everything read and in the log

Standard library only.
"""

import os
import subprocess

from node import frames
from node.output import Mux, OwnOutput, Source, rank_pipe

_current: "RunOutput | None" = None
"""This batch job's output, while it is started: where `popen` sends an srun's."""


class StepOutput:
    """One srun's output, read as each node's records."""

    def __init__(self, mux: Mux):
        self.mux = mux
        self.sources: dict[bytes, Source] = {}
        self.unframer = frames.Unframer(self._emit)

    def _emit(self, node: bytes, piece: bytes) -> None:
        self.mux.write(self.sources.setdefault(node, Source(b"")), piece)

    def feed(self, data: bytes) -> None:
        self.unframer.feed(data)

    def end(self) -> None:
        self.unframer.end()


class RunOutput:
    """The batch job's standard output (the run's log) and error, through one Mux that every step's
    output joins."""

    def __init__(self, saved: tuple[int, int]):
        self.mux = Mux(saved[0])
        self.own = OwnOutput(self.mux, b"", saved)

    @classmethod
    def start(cls) -> "RunOutput":
        global _current
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        _current = cls((os.dup(1), os.dup(2)))
        return _current

    def popen(self, argv: list, **options) -> subprocess.Popen:
        read_fd, write_fd = rank_pipe()
        try:
            process = subprocess.Popen(argv, stdout=write_fd, stderr=write_fd, **options)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.mux.follow(read_fd, b"", name="gpu-cluster-step-output", reader=StepOutput(self.mux))
        return process

    def close(self) -> None:
        """Once every srun has ended: all they and this process wrote is in the log; later lines go there
        directly."""
        global _current
        _current = None
        self.own.restore()


def popen(argv: list, **options) -> subprocess.Popen:
    """An srun of the run's node/slurm_step.py, its output read as records into the log where the batch job
    started its `RunOutput` (else inherited, as it comes)."""
    if _current is None:
        return subprocess.Popen(argv, **options)
    return _current.popen(argv, **options)
