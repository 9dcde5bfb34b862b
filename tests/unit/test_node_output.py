"""node/output.py: the prefixes a node puts on its job's output, and the pipes it copies them from."""

import os
import threading
import time

import pytest

from node.output import Mux, Source, node_prefix, prefixed, unprefixed
from tests.support import disks

P = node_prefix("node-1", 3)


def test_the_prefix_names_the_rank_only_where_the_node_runs_several():
    assert node_prefix("node-1") == b"[node-1] " and P == b"[node-1 rank 3] "


def test_every_line_and_every_redraw_gets_the_prefix_and_an_unfinished_line_waits_for_nothing():
    out, at_start = prefixed(b"a\nb\r\npart", P, True)
    assert (out, at_start) == (P + b"a\n" + P + b"b\n" + P + b"part", False)
    out, at_start = prefixed(b" more\r10%\r", P, at_start)  # the unfinished line goes on, unprefixed
    assert (out, at_start) == (b" more\r" + P + b"10%\r", True)
    out, at_start = prefixed(b"\r20%", P, at_start)  # tqdm starts each redraw with `\r`
    assert (out, at_start) == (b"\r" + P + b"20%", False)
    assert prefixed(b"", P, True) == (b"", True)


def test_the_mux_ends_a_line_another_rank_would_continue_and_reads_every_pipe_to_its_end():
    read_out, write_out = os.pipe()
    mux = Mux(write_out)
    pipes = {rank: os.pipe() for rank in (0, 1)}
    for rank, (read_fd, _) in pipes.items():
        mux.follow(read_fd, node_prefix("node-0", rank))
    os.write(pipes[0][1], b"loading")
    deadline = time.monotonic() + 30
    while mux.unfinished is None and time.monotonic() < deadline:  # rank 0's thread has copied it
        time.sleep(0.01)
    os.write(pipes[1][1], b"ready\n")
    for _, write_fd in pipes.values():
        os.close(write_fd)
    mux.drain()
    os.close(write_out)
    with os.fdopen(read_out, "rb") as f:
        assert f.read() == b"[node-0 rank 0] loading\n[node-0 rank 1] ready\n"


def test_reading_the_output_back_drops_the_prefixes_and_redrawn_parts():
    text = "[node-1 rank 3] a\n[node-1] b\r[node-1] c\n  File x\n"
    assert unprefixed(text) == "a\nc\n  File x\n"


def test_a_rank_writing_a_lot_never_waits_for_a_slow_reader():
    """What the node sends is spooled on its disk: a rank's writes return though nobody reads yet (a pipe
    alone would hold 64 kB), and all of it arrives, in order, once the reader comes."""
    read_out, write_out = os.pipe()
    mux = Mux(write_out)
    source = Source(node_prefix("node-0"))
    lines = b"".join(b"line %d\n" % i for i in range(500_000))  # about 6 MB
    writer = threading.Thread(
        target=lambda: [mux.write(source, lines[i : i + 65536]) for i in range(0, len(lines), 65536)],
        daemon=True,
    )
    writer.start()
    writer.join(30)
    assert not writer.is_alive()  # every write returned while nothing was read
    received = bytearray()
    reader = threading.Thread(
        target=lambda: [received.extend(c) for c in iter(lambda: os.read(read_out, 1 << 20), b"")]
    )
    reader.start()
    mux.drain()
    os.close(write_out)
    reader.join(60)
    assert bytes(received) == b"".join(b"[node-0] line %d\n" % i for i in range(500_000))


@pytest.mark.skipif(disks.unavailable() is not None, reason=str(disks.unavailable()))
def test_a_full_disk_under_the_spool_loses_no_line_and_the_output_says_why(tmp_path):
    """The node's run folder (where the spool is) fills up mid-run: every line still reaches the output, in
    order and whole, and one line of the node's says its disk is full, naming the folder and the error."""
    with disks.small_filesystem(tmp_path / "runs", "64k") as folder:
        with open(tmp_path / "out", "wb") as out:
            mux = Mux(out.fileno(), str(folder), node_prefix("node-1"))
            rank = Source(node_prefix("node-1", 0))
            line = b"x" * 100
            for number in range(2000):  # 200 kB through a 64 kB disk
                mux.write(rank, b"%05d " % number + line + (b"\n" if number % 2 else b""))
            mux.drain()
    text = (tmp_path / "out").read_bytes().decode()
    said = [each for each in text.splitlines() if each.startswith("[node-1] gpu-cluster:")]
    assert len(said) == 1 and "No space left on device" in said[0] and str(folder) in said[0], said
    ours = [each for each in text.splitlines() if not each.startswith("[node-1] gpu-cluster:")]
    assert len(ours) <= 1001 and all(each.startswith("[node-1 rank 0] ") for each in ours)  # one ended by the note
    joined = "".join(ours).replace("[node-1 rank 0] ", "")
    assert joined == "".join(f"{number:05d} " + "x" * 100 for number in range(2000))
