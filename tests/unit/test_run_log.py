"""A scheduled run's log, copied here as it grows (infra/runlog.py) and shown (remote/slurm_follow.py's
LogSplitter): every piece under its writer, the cluster's own lines kept, bars one line per writer."""

from types import SimpleNamespace

from invoke import Context

from infra import runlog
from infra.ledger import Ledger
from remote import runs, slurm_follow, stream, tasks_runs

LOG = (
    b"[node-0] step 0\n"
    b"[node-1 rank 3] 10%\r"
    b"srun: error: node-1: task 1: Exited with exit code 3\n"
    b"[node-0 rank 1] 10%\r"
    b"[node-1 rank 3] 20%\r"
    b"[cluster] node-1: lost: the run (exit 1) is requeued (restart 1)\n"
    b"[node-1] __gpu_cluster_exit__ 3 1795000000.5\n"
    b"\r"
    b"[node-0] unfinish"
)


def test_each_piece_goes_to_its_writers_file_and_a_bare_one_to_the_clusters():
    assert runlog.pieces("a\rb\nc") == (["a\r", "b\n"], "c")
    assert runlog.writer_of("[node-1 rank 3] 20%\r") == ("node-1", "[node-1 rank 3]")
    assert runlog.writer_of("srun: error: x\n") == (None, "")


def test_the_copy_files_every_line_and_keeps_an_unfinished_one_for_its_rest(tmp_path):
    shown: list[tuple[str, str]] = []
    copy = runlog.LogCopy(tmp_path, echo=lambda writer, piece: shown.append((writer, piece)))
    assert copy.hold()
    for at in range(0, len(LOG), 7):  # however the bytes arrive
        copy.add(LOG[at : at + 7])
    copy.close()

    assert (tmp_path / "node-0.log").read_text() == "[node-0] step 0\n[node-0 rank 1] 10%\n"
    assert (tmp_path / "node-1.log").read_text() == "[node-1 rank 3] 10%\n[node-1 rank 3] 20%\n"
    assert (tmp_path / "cluster.log").read_text() == (
        "srun: error: node-1: task 1: Exited with exit code 3\n"
        "[cluster] node-1: lost: the run (exit 1) is requeued (restart 1)\n"
    )
    assert copy.markers == {"node-1": {"__gpu_cluster_exit__": "__gpu_cluster_exit__ 3 1795000000.5"}}
    assert [writer for writer, _ in shown] == [
        "[node-0]",
        "[node-1 rank 3]",
        "",
        "[node-0 rank 1]",
        "[node-1 rank 3]",
        "",
    ]
    assert copy.offset == len(LOG)

    later = runlog.LogCopy(tmp_path)  # the next look: from where this one ended
    assert later.hold()
    later.resume()
    end = b"\n" + f"__GPU_CLUSTER_RUN_END__ FAILED 1 {len(LOG) + 3}\n".encode()  # the follower's, not the log's
    later.add(b"ed\n" + end)
    later.close(ended=True)
    assert (tmp_path / "node-0.log").read_text().endswith("[node-0] unfinished\n")
    assert later.end == ("FAILED", 1) and later.offset == len(LOG) + 3
    assert (tmp_path / "output.log").read_bytes() == LOG + b"ed\n"
    assert runlog.read_markers(tmp_path)["node-1"]


def test_a_copy_held_by_another_command_is_left_alone(tmp_path):
    first = runlog.LogCopy(tmp_path)
    assert first.hold()
    assert not runlog.LogCopy(tmp_path).hold()
    first.close()
    assert runlog.LogCopy(tmp_path).hold()


def test_the_terminal_ends_a_bar_before_another_writers_line(tmp_path, capsysbinary):
    splitter = slurm_follow.LogSplitter(tmp_path, echo=True, write=False)
    splitter.add(b"[node-0] 10%\r[node-1] 10%\r[node-0] 20%\r[node-0] 30%\rsrun: done\n")
    splitter.close(ended=True)

    out = capsysbinary.readouterr().out
    assert out == b"[node-0] 10%\r\n[node-1] 10%\r\n[node-0] 20%\r[node-0] 30%\r\nsrun: done\n"
    assert not list(tmp_path.iterdir())  # a replay writes nothing


def test_down_records_the_runs_it_ended_from_the_records_fab_wrote(state_dir):
    """infra reads remote's run.json (it may not import remote): the keys it needs are the ones Run writes."""
    folders = {}
    for run_id, state in (("running", "RUNNING"), ("queued", "PENDING"), ("ended", "RUNNING"), ("done", "COMPLETED")):
        folders[run_id] = state_dir / "local" / "runs" / run_id
        folders[run_id].mkdir(parents=True)
        run = runs.Run(run_id, "run", "7", f"/shared/runs/{run_id}/output.log", ["node-0"], 1795000000.0, state)
        run.finished = run_id == "done"
        run.save(folders[run_id])

    ledger = Ledger()
    for run_id in ("running", "queued", "ended"):  # as a Slurm-held launch records them at its submit
        ledger.run_started(run_id, "local", "run", 2, 3.6, at=1795000000.0, scheduled=True)
    ledger.close()
    found = {run.folder.name: run for run in runlog.unfinished_runs("local")}
    assert sorted(found) == ["ended", "queued", "running"]
    found["running"].started = True
    found["ended"].end = runlog._end_state(b'{"exit_code": 3, "at": 1795000100.0, "restarts": 0}')
    said: list[str] = []
    runlog.after_down(list(found.values()), said.append, at=1795000200.0)
    ledger = Ledger()
    priced = {run_id: ledger.run(run_id) for run_id in ("running", "queued", "ended")}
    ledger.close()
    assert priced["queued"].started_at is None and priced["queued"].cost_usd(1795000300.0) == 0.0  # only waited
    assert priced["ended"].ended_at == 1795000100.0  # its batch job's end, not the down's
    assert priced["running"].ended_at is None  # the cluster's down closes it at its own time

    assert said == [
        f"run queued, queued, was cancelled with the cluster; its log is kept in {folders['queued']}",
        f"run running, running, was cancelled with the cluster; its log is kept in {folders['running']}",
    ]
    records = {run_id: runs.Run.load(folder) for run_id, folder in folders.items()}
    assert {run_id: (r.state, r.ended_at, r.finished) for run_id, r in records.items()} == {
        "running": ("CANCELLED", 1795000200.0, True),
        "queued": ("CANCELLED", 1795000200.0, True),
        "ended": ("FAILED", 1795000100.0, True),
        "done": ("COMPLETED", None, True),
    }


def test_a_long_unfinished_line_costs_its_length_not_its_square(tmp_path):
    """8 MB of one line in 4 kB parts (a progress bar without its newline): cutting the whole unfinished
    line again at every part scanned 16 GB, and the local copy fell minutes behind a finished run."""
    import time

    shown = []
    copy = runlog.LogCopy(tmp_path, echo=lambda writer, piece: shown.append(piece), write=False)
    part = "[node-0] " + "x" * 4087
    started = time.monotonic()
    for _ in range(2000):
        copy.add(part.encode())
    copy.add(b"\n[node-1] next\n")
    assert time.monotonic() - started < 3
    assert [len(piece) for piece in shown] == [2000 * 4096 + 1, len("[node-1] next\n")]


def test_a_requeued_runs_earlier_start_leaves_no_markers_for_the_next(tmp_path):
    """What the nodes said of a start Slurm requeued is forgotten where the batch job says it starts again,
    so a node killed before it said anything of the new start is not judged by its old ranks line."""
    from node import contract

    copy = runlog.LogCopy(tmp_path, write=False)
    said = f'[node-1] {contract.RANKS_MARKER} {{"exit_codes": {{"1": 3}}}}\n'
    copy.add(f"{said}[node-1] {contract.EXIT_MARKER} 1 5.0\n".encode())
    assert set(copy.markers["node-1"]) == {contract.RANKS_MARKER, contract.EXIT_MARKER}
    copy.add(f"{contract.RESTART_LINE} 1: the run starts again\n[node-0] {contract.EXIT_MARKER} 143 9.0\n".encode())
    assert copy.markers == {"node-0": {contract.EXIT_MARKER: f"{contract.EXIT_MARKER} 143 9.0"}}


def test_lines_of_several_writers_are_one_stream_in_time_order_ties_in_node_order():
    node_0 = [(1.0, "[node-0] a"), (3.0, "[node-0] c"), (3.0, "[node-0] d")]
    node_1 = [(2.0, "[node-1] b"), (3.0, "[node-1] e"), (4.0, "[node-1] f")]
    assert [line for _, line in runlog.time_ordered([node_0, node_1])] == [
        "[node-0] a", "[node-1] b", "[node-0] c", "[node-0] d", "[node-1] e", "[node-1] f",
    ]  # fmt: skip
    assert [line for _, line in runlog.time_ordered([[(5.0, "late"), (1.0, "early, in the log after")]])] == [
        "late",
        "early, in the log after",
    ]  # a writer's own lines never pass each other


def test_fab_logs_shows_a_fab_held_run_in_the_order_its_lines_came_ties_in_node_order(
    state_dir, monkeypatch, capsysbinary
):
    """As the dashboard's finished log (tests/unit/test_dashboard.py): each node's stream keeps when each
    read reached fab; `fab logs` merges the nodes' logs by it (node-2 before node-10), `--lines` the last of
    each node's; a run from before the times were kept shows node after node."""
    run_dir = state_dir / "local" / "runs" / "20260101-000000-hello-ab12"
    clock = iter([10.0, 11.0, 12.0, 12.0, 13.0])
    monkeypatch.setattr(stream, "time", SimpleNamespace(time=lambda: next(clock)))
    nodes = {i: stream.NodeStream(f"node-{i}", i, run_dir / f"node-{i}.log", echo=False) for i in (0, 2, 10)}
    nodes[10].feed(b"[node-10] first\n[node-10] sec")  # 10.0: a line and a half
    nodes[0].feed(b"[node-0] third\n")  # 11.0
    nodes[10].feed(b"ond\n")  # 12.0: the half line's end
    nodes[2].feed(b"[node-2] one time with node-10's\n")  # 12.0: a tie, in node order
    nodes[0].write("a line of fab's own about node-0\n")  # 13.0
    for node in nodes.values():
        node.close()

    def shown(*lines: str) -> list[str]:
        capsysbinary.readouterr()
        tasks_runs.logs(Context(), run=run_dir.name, stack="local", lines=None if not lines else lines[0])
        return capsysbinary.readouterr().out.decode().splitlines()[1:]  # after `run <id> (<folder>)`

    assert shown() == [
        "[node-10] first",
        "[node-0] third",
        "[node-2] one time with node-10's",
        "[node-10] second",
        "[node-0] a line of fab's own about node-0",
    ]
    assert shown("1") == [
        "[node-2] one time with node-10's",
        "[node-10] second",
        "[node-0] a line of fab's own about node-0",
    ]
    (run_dir / "node-2.times").unlink()  # an older run: node after node, as before
    assert shown()[:3] == ["[node-0] third", "[node-0] a line of fab's own about node-0", "[node-10] first"]
