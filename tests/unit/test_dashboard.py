"""The dashboard's pure shaping (dashboard/shape.py) and its read-only ledger."""

import sqlite3
from types import SimpleNamespace

import pytest

from dashboard import shape
from infra.ledger import Event, Interval, Ledger
from node.run_state import RunState


def test_step_records_become_loss_throughput_and_step_time_per_rank():
    records = [
        {"kind": "step", "time": 10.0, "step": 1, "loss": 2.0, "step_ms": 100.0, "samples_per_s": 80.0},
        {"kind": "summary", "time": 11.0},
        {"kind": "step", "time": 12.0, "step": 2, "loss": float("nan"), "step_ms": 90.0, "samples_per_s": 88.0},
        {"kind": "step", "time": 12.0, "step": 2, "rank": 1, "step_ms": 95.0},
    ]
    plots = shape.step_series(records)
    assert plots["loss"].x == [10.0, 12.0, 12.0]
    assert plots["loss"].ys["loss"] == [2.0, None, None]  # NaN is no point, not a broken plot
    assert plots["step_ms"].ys == {"rank 0": [100.0, 90.0, None], "rank 1": [None, None, 95.0]}
    assert plots["throughput"].ys["samples_per_s"] == [80.0, 88.0, None]


def test_rank_0s_step_lines_in_the_log_are_a_running_runs_curves():
    lines = [
        "[node-0]   step      loss   ms/step   samples/s  mem GiB      $/h   $ so far",
        "[node-0]      1    0.5000     200.0        10.0     0.10    0.000     0.0000",
        "[node-0 rank 0]      2    0.2500     180.5        11.0     0.10    0.000     0.0000",
        "[node-1]      3    0.1000     100.0        10.0     0.10    0.000     0.0000",
        "[node-0 rank 1]      3    0.1000     100.0        10.0     0.10    0.000     0.0000",
        "[node-0] epoch 1 done",
    ]
    found = shape.steps_from_log(lines, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert [(r["step"], r["loss"], r["step_ms"], r["time"]) for r in found] == [
        (1, 0.5, 200.0, 2.0),
        (2, 0.25, 180.5, 3.0),
    ]


def test_participants_over_time_per_replica_group():
    series = shape.participants_series(
        [
            {"kind": "ft_step", "time": 1.0, "replica": 0, "participants": 2},
            {"kind": "ft_step", "time": 2.0, "replica": 1, "participants": 1},
            {"kind": "step", "time": 3.0},
        ]
    )
    assert series.x == [1.0, 2.0] and series.ys == {"replica 0": [2, None], "replica 1": [None, 1]}


def test_cost_rises_while_up_and_stays_flat_while_down():
    intervals = [Interval(3600.0, None, None), Interval(0.0, 1800.0, "down")]
    series = shape.cost_series(intervals, 3.6, now=5400.0)
    assert series.x == [0.0, 1800.0, 3600.0, 5400.0]
    assert series.ys["usd"] == [0.0, 1.8, 1.8, 3.6]


def test_a_runs_verdicts_come_from_its_record_its_summary_or_the_ledger():
    row = {"run_id": "r", "state": "HUNG", "hang": None}
    assert shape.run_row(row, None, "rank 1 never entered all_reduce")["hang"] == "rank 1 never entered all_reduce"
    summary = {
        "hang": {"verdict": "from the summary"},
        "stragglers": [{"rank": 3, "why": "slow"}],
        "participants": "1/2",
    }
    shaped = shape.run_row(row, summary, "from the ledger")
    assert (shaped["hang"], shaped["stragglers"], shaped["participants"]) == (
        "from the summary",
        [{"rank": 3, "why": "slow"}],
        "1/2",
    )
    assert shape.run_row({"run_id": "r", "state": "COMPLETED"}, None, None)["hang"] is None


def test_the_page_offers_a_cancel_only_for_a_run_that_has_not_ended():
    final = {state: shape.run_row({"run_id": "r", "state": state}, None, None)["final"] for state in RunState}
    assert [state for state, ended in final.items() if ended] == ["COMPLETED", "FAILED", "CANCELLED", "HUNG"]


def test_interruptions_are_those_within_the_runs_time():
    events = [Event("s", "spot interruption", "node-1", "replaced", at, 9.0) for at in (5.0, 15.0, 30.0)]
    assert [e["at"] for e in shape.interruptions(events, 10.0, 20.0, now=100.0)] == [15.0]
    assert [e["at"] for e in shape.interruptions(events, 10.0, None, now=100.0)] == [15.0, 30.0]
    assert shape.interruptions(events, None, None, now=100.0) == []  # never started


def test_timelines_leave_out_what_was_not_recorded():
    phases = {"started_at": 1.0, "phases": [{"phase": "connect", "s": 0.5}], "total_s": 0.5}
    found = shape.timelines(phases, None, [("launch a", None), ("launch b", phases)])
    assert [t["what"] for t in found] == ["up", "launch b"]


def test_node_rows_say_asking_until_status_answers_and_split_the_hourly_price():
    nodes = [{"name": "node-0", "public_ip": "127.0.0.10", "ssh_port": 2222}, {"name": "node-1"}]
    statuses = {"node-0": {"address": "127.0.0.10:2222", "state": "up", "scheduler": "idle", "uptime_s": 60}}
    rows = shape.node_rows(nodes, statuses, 0.526)
    assert [(r["state"], r["slurm"], r["hourly_usd"]) for r in rows] == [("up", "idle", 0.526), ("asking", "-", 0.526)]


def test_the_log_tail_keeps_the_newest_lines_numbered_for_readers():
    tail = shape.LogTail(keep=3)
    tail.add("[node-0]", "[node-0] a\n[node-0] b\n", 1.0)
    tail.add("", "\n", 2.0)  # nothing to show
    tail.add("[node-1]", "[node-1] c\n[node-1] d\n", 3.0)
    assert [line for _, _, line in tail.since(0)] == ["[node-0] b", "[node-1] c", "[node-1] d"]
    assert [n for n, _, _ in tail.since(3)] == [4]


def test_a_writers_unfinished_line_waits_for_its_rest_and_a_redraw_is_a_line():
    tail = shape.LogTail()
    tail.add("node-0", "[node-0] ste", 1.0)
    tail.add("node-1", "[node-1] other\n", 1.0)
    tail.add("node-0", "p 1\r[node-0] step 2\r\n[node-0] las", 2.0)
    assert [line for _, _, line in tail.since(0)] == ["[node-1] other", "[node-0] step 1", "[node-0] step 2"]
    tail.end(3.0)
    assert tail.ended and tail.since(3)[0][2] == "[node-0] las"


def test_the_ledger_read_only_reads_without_writing_and_creates_nothing(tmp_path):
    path = tmp_path / "ledger.sqlite"
    assert Ledger.read_only(path) is None and not path.exists()
    writer = Ledger(path)
    writer.cluster_up("s", "local", "g4dn.xlarge", 2, 1.0, at=0.0)
    writer.db.execute("BEGIN IMMEDIATE")  # a command in the middle of writing
    reader = Ledger.read_only(path)
    assert reader is not None
    assert [c.stack for c in reader.clusters("s")] == ["s"]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.db.execute("DELETE FROM clusters")
    writer.db.execute("COMMIT")
    reader.close()
    writer.close()


def test_nothing_below_the_cli_imports_the_dashboard():
    """It is a reader on top of infra and remote: `deploy.py dashboard` alone loads it (and Starlette)."""
    import ast

    from tests.support import REPO

    for folder in ("infra", "remote", "node", "harness", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            imported = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
            imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not {m for m in imported if m.split(".")[0] in ("dashboard", "starlette", "uvicorn")}, path


def test_a_fab_held_runs_follow_gives_the_page_its_logs_and_writes_nothing_to_the_terminal(tmp_path, capfd):
    """`holder.follow(show=...)` for a run held by fab's connections: the node logs as they are here."""
    from remote.holders import FabHolder
    from remote.job_spec import NodeSetup
    from remote.runs import Run
    from tests.support import inventories

    (tmp_path / "node-0.log").write_text("[node-0] hello\n[node-0] half")
    (tmp_path / "node-1.log").write_text("[node-1] there\n")
    Run("r", "run", "", "", ["node-0", "node-1"], 1.0, state="COMPLETED", holder="fab").save(tmp_path)
    tail = shape.LogTail()
    FabHolder(inventories.cluster(), NodeSetup(29500, {})).follow(
        tmp_path, Run.load(tmp_path), show=lambda writer, text: tail.add(writer, text, 1.0)
    )
    tail.end(2.0)
    assert [line for _, _, line in tail.since(0)] == ["[node-0] hello", "[node-1] there", "[node-0] half"]
    assert capfd.readouterr().out == ""


def test_a_fault_tolerant_runs_log_lines_are_its_loss_and_participants_per_group():
    lines = [
        "[node-0] replica 0 step    4 loss 0.5000 participants 2",
        "[node-1 rank 2] replica 1 step    4 loss 0.6000 participants 2",
        "[node-1] replica 1 step    5 loss nan participants 1",
    ]
    found = shape.steps_from_log(lines, [1.0, 2.0, 3.0])
    assert shape.step_series(found)["loss"].ys == {"replica 0": [0.5, None, None], "replica 1": [None, 0.6, None]}
    assert shape.participants_series(found).ys == {"replica 0": [2, None, None], "replica 1": [None, 2, 1]}


def test_a_running_fault_tolerant_runs_page_has_its_plots_with_its_log_open(state_dir):
    """The page always opens the log: its lines are added to the run's records, never put in their place."""
    from dashboard import sources
    from remote.runs import Run

    folder = state_dir / "s" / "runs" / "ft"
    folder.mkdir(parents=True)
    Run("ft", "run", "", "", ["node-0", "node-1"], 1.0, state="RUNNING", started_at=1.0).save(folder)
    gpu = {"kind": "gpu", "time": 1.5, "node": "node-0", "index": 0, "util_pct": 50}
    (folder / "metrics.jsonl").write_text(__import__("json").dumps(gpu) + "\n")
    tail = shape.LogTail()
    tail.add("[node-1]", "[node-1] replica 1 step    3 loss 0.7000 participants 2\n", 2.0)
    view = sources.run_view("s", "ft", tail, now=3.0)
    assert view["plots"]["loss"]["ys"] == {"replica 1": [0.7]}
    assert view["plots"]["participants"]["ys"] == {"replica 1": [2]}


def test_no_stragglers_is_no_verdict():
    assert (
        shape.run_row({"run_id": "r", "state": "COMPLETED", "stragglers": []}, {"stragglers": []}, None)["stragglers"]
        is None
    )


def test_a_local_clusters_cost_has_its_aws_equivalent_beside_it():
    series = shape.cost_series([Interval(0.0, 1800.0, "down")], 0.0, now=5400.0, reference_hourly_usd=1.052)
    assert series.ys == {"usd": [0.0, 0.0], "aws equivalent usd": [0.0, 0.526]}


def test_a_finished_slurm_runs_log_is_in_the_order_the_cluster_wrote_it(tmp_path):
    """Not grouped by node: `output.log` (the cluster's own order) is read, markers left out."""
    from dashboard import sources
    from node import contract

    (tmp_path / "output.log").write_text(
        "[node-0] first\n[node-1] second\nsrun: cluster line\n"
        f"[node-1] {contract.MARKER_START}exit 0\n[node-0] third\n[node-1] last, unfinished"
    )
    (tmp_path / "node-0.log").write_text("[node-0] first\n[node-0] third\n")
    (tmp_path / "node-1.log").write_text("[node-1] second\n")
    tail = shape.LogTail()
    sources.finished_log(tmp_path, tail)
    assert [line for _, _, line in tail.since(0)] == [
        "[node-0] first",
        "[node-1] second",
        "srun: cluster line",
        "[node-0] third",
        "[node-1] last, unfinished",
    ]
    assert tail.ended


def test_a_long_unfinished_line_in_the_tail_costs_its_length_not_its_square():
    """As runlog's copy (tests/unit/test_run_log.py): the page's tail of a progress bar without its newline."""
    import time

    tail = shape.LogTail()
    started = time.monotonic()
    for _ in range(2000):
        tail.add("node-0", "x" * 4096, 1.0)
    tail.add("node-0", "\r\n", 2.0)
    assert time.monotonic() - started < 3
    assert [len(line) for _, _, line in tail.since(0)] == [2000 * 4096]


def test_a_finished_fab_held_runs_log_is_one_stream_in_the_order_its_lines_came(tmp_path, monkeypatch):
    """Each node's stream (remote/stream.py) keeps when each read reached fab beside its log; the page's
    finished log merges the nodes' logs by it, not node after node."""
    from dashboard import sources
    from remote import stream

    clock = iter([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    monkeypatch.setattr(stream, "time", SimpleNamespace(time=lambda: next(clock)))
    nodes = [stream.NodeStream(f"node-{i}", i, tmp_path / f"node-{i}.log", echo=False) for i in range(2)]
    nodes[1].feed(b"[node-1] first\n[node-1] sec")  # 10.0: one line and a half
    nodes[0].feed(b"[node-0] third\n")  # 11.0
    nodes[1].feed(b"ond\n")  # 12.0: the half line's end
    nodes[0].feed(b"[node-0] fourth\n[node-0] fifth\n")  # 13.0
    nodes[1].write("a line of fab's own about node-1\n")  # 14.0
    for node in nodes:
        node.close()
    assert (tmp_path / "node-1.times").read_text().splitlines()[0] == "27 10.000000"  # the log's size after it
    tail = shape.LogTail()
    sources.finished_log(tmp_path, tail)
    assert [line for _, _, line in tail.since(0)] == [
        "[node-1] first",
        "[node-0] third",
        "[node-1] second",
        "[node-0] fourth",
        "[node-0] fifth",
        "[node-1] a line of fab's own about node-1",
    ]
    assert tail.ended
    (tmp_path / "node-0.times").unlink()  # a run from before the times were kept: node after node
    older = shape.LogTail()
    sources.finished_log(tmp_path, older)
    assert [line for _, _, line in older.since(0)][:3] == ["[node-0] third", "[node-0] fourth", "[node-0] fifth"]


def test_ctrl_c_is_exit_130_even_where_asyncio_swallowed_uvicorns_raise_of_it(state_dir, monkeypatch):
    """uvicorn raises the captured SIGINT again inside asyncio.run, whose handler only cancels the main task:
    where the task ends without another await, `run` returns normally and the dashboard exited 0 (under load)."""
    import signal

    from dashboard import app

    def run_and_stop_as_if_nothing_happened(self, sockets=None):
        self.handle_exit(signal.SIGINT, None)  # Ctrl-C while serving; the loop then returns normally

    monkeypatch.setattr(app.Server, "run", run_and_stop_as_if_nothing_happened)
    said = []
    with pytest.raises(KeyboardInterrupt):
        app.serve(0, None, None, said.append)
    assert said[-1] == "dashboard: stopped" and not list(state_dir.glob("**/dashboard-*.token"))
