"""A node's output under Slurm as records (node/frames.py): each fits one of Slurm's I/O messages, and
records of two nodes that come interleaved, one by one, are joined back into each node's whole lines."""

from node import frames


def test_two_nodes_records_interleaved_one_by_one_come_back_as_each_nodes_whole_pieces():
    long_line = b"[node-0] " + b"L" * 5000 + b" end\n"
    sent = {
        b"node-0": [b"[node-0] a\n[node-0] b\n", long_line, b"[node-0] 10%\r", b"[node-0] 20%\r[node-0] done\n"],
        b"node-1": [b"[node-1] " + b"x" * 2500 + b"\n", b"[node-1] c\n"],
    }
    queues = {node: [frames.frame(node, piece) for piece in pieces] for node, pieces in sent.items()}
    records = {node: [r + b"\n" for r in b"".join(framed).split(b"\n")[:-1]] for node, framed in queues.items()}
    assert all(len(r) <= frames.RECORD_BYTES for rs in records.values() for r in rs)
    assert all(b"".join(framed).endswith(b"\n") for framed in queues.values())  # no record left open
    wire = []  # one record of each in turn, as srun gathers them
    while any(records.values()):
        for node in records:
            if records[node]:
                wire.append(records[node].pop(0))
    wire.insert(3, b"srun: error: a line of srun's own\n")
    got: dict[bytes, list[bytes]] = {}
    reader = frames.Unframer(lambda node, piece: got.setdefault(node, []).append(piece))
    data = b"".join(wire)
    for at in range(0, len(data), 777):  # read in pieces that cut records anywhere
        reader.feed(data[at : at + 777])
    reader.end()
    assert got.pop(b"") == [b"srun: error: a line of srun's own\n"]
    assert {node: b"".join(pieces) for node, pieces in got.items()} == {n: b"".join(p) for n, p in sent.items()}
    assert all(piece.endswith((b"\n", b"\r")) for pieces in got.values() for piece in pieces)
    assert long_line in got[b"node-0"]  # whole, in one piece
    assert frames.unframed(data).count(b"\n") == 7
