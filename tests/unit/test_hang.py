"""The hang rule and the verdict line, on progress records shaped as the rank monitor writes them."""

from node import hang_rule as hang

NOW = 1_800_000_000.0


def record(rank, entered, active=(), node="node-0", pid=None, state="running", stack=(), groups=None):
    """One rank's progress record as `node/hang.py status` reports it."""
    groups = groups or {"0": {"ranks": [0, 1], "enqueued": entered, "completed": entered - len(active)}}
    return {
        "rank": rank,
        "node": node,
        "pid": pid or 4700 + rank,
        "state": state,
        "time": NOW - 0.5,
        "groups": groups,
        "stack": [dict(zip(("function", "file", "line", "library"), f, strict=True)) for f in stack],
        "active": [
            {"group": g, "seq": s, "op": op, "sizes": sizes, "dtypes": ["Float"], "since": NOW - waited}
            for g, s, op, sizes, waited in active
        ],
    }


def views(*records):
    return hang.parse_ranks({"now": NOW, "ranks": list(records)})


WAITING_IN_4 = ("0", 4, "all_reduce", [[1024]], 30.0)
TRAIN_STACK = (
    ("<module>", "train.py", 20, False),
    ("load_batch", "train.py", 14, False),
    ("sleep", "time.py", 1, True),
)


def test_a_rank_that_never_entered_the_collective_is_named_with_where_it_is():
    ranks = views(record(0, 4, [WAITING_IN_4]), record(1, 3, node="node-1", stack=TRAIN_STACK))
    found = hang.find_hang(ranks, hang_timeout_s=10)
    assert [v.rank for v in found.missing] == [1] and [v.rank for v in found.waiting] == [0]
    line = hang.verdict("r1", found)
    assert line.startswith("HANG run=r1: rank 1 (node-1, pid 4701) never entered all_reduce #4 (1024 x float32)")
    assert "rank 0 waiting since" in line and "rank 1 was last seen in load_batch (train.py:14)" in line


def test_no_hang_before_the_timeout_or_while_every_rank_computes_or_every_rank_has_joined():
    assert hang.find_hang(views(record(0, 4, [WAITING_IN_4]), record(1, 3)), hang_timeout_s=60) is None
    assert hang.find_hang(views(record(0, 3), record(1, 3)), hang_timeout_s=1) is None
    slow_but_joined = views(record(0, 4, [WAITING_IN_4]), record(1, 4, [WAITING_IN_4]))
    assert hang.find_hang(slow_but_joined, hang_timeout_s=1) is None


def test_a_finished_rank_waits_in_nothing_and_one_that_finished_without_joining_is_named_so():
    # The script ended (the monitor's last record, written at exit) while the process lingers in
    # shutdown: the record it wrote a moment before, inside the last all-reduce, no longer counts.
    done = dict(record(0, 4, [WAITING_IN_4]), finished=True)
    assert hang.find_hang(views(done, record(1, 3, state="gone")), hang_timeout_s=1) is None
    early = dict(record(1, 3, node="node-1"), finished=True)  # rank 1 ended without the 4th all-reduce
    found = hang.find_hang(views(record(0, 4, [WAITING_IN_4]), early), hang_timeout_s=10)
    assert "rank 1 (node-1, pid 4701) finished its script and never entered all_reduce #4" in hang.verdict("r1", found)


def test_a_different_collective_under_the_same_number_names_both():
    ranks = views(record(0, 4, [WAITING_IN_4]), record(1, 4, [("0", 4, "broadcast", [[1024]], 29.0)]))
    found = hang.find_hang(ranks, hang_timeout_s=10)
    line = hang.verdict("r1", found)
    assert "rank 1 (node-0, pid 4701) called broadcast #4 (1024 x float32) where rank 0 called all_reduce #4" in line


def test_the_same_collective_with_another_shape_is_a_mismatch_and_the_majority_is_the_reference():
    waiting = [("0", 7, "all_reduce", [[1024]], 20.0)]
    groups = {"0": {"ranks": [0, 1, 2], "enqueued": 7, "completed": 6}}
    ranks = views(
        record(0, 7, waiting, groups=groups),
        record(1, 7, [("0", 7, "all_reduce", [[512]], 20.0)], groups=groups),
        record(2, 7, waiting, groups=groups),
    )
    line = hang.verdict("r1", hang.find_hang(ranks, hang_timeout_s=5))
    assert (
        "rank 1 (node-0, pid 4701) called all_reduce #7 (512 x float32) where ranks 0, 2 called all_reduce #7 "
        "(1024 x float32)" in line
    )


def test_a_stopped_rank_is_said_to_be_stopped_and_its_stack_comes_from_py_spy():
    ranks = views(record(0, 4, [WAITING_IN_4]), record(1, 3, state="stopped", stack=TRAIN_STACK[:1]))
    spied = (
        'Process 4701: python train.py\n\nThread 4701 (idle): "MainThread"\n'
        "    sleep (time.py:1)\n    load_batch (train.py:14)\n    <module> (train.py:20)\n"
        'Thread 4702 (idle): "gpu-cluster-rank-monitor"\n    run (gpu_cluster_rank_monitor.py:57)\n'
    )
    evidence = hang.Evidence(ranks=ranks, py_spy={"1": spied})
    line = hang.verdict("r1", hang.find_hang(ranks, hang_timeout_s=10), evidence)
    assert "rank 1 (node-0, pid 4701) is stopped (SIGSTOP) and never entered all_reduce #4" in line
    assert line.endswith("rank 1 is in load_batch (train.py:14)")


def test_a_rank_that_never_reported_still_counts_as_not_entered():
    silent = {"rank": 1, "pid": 4701, "node": "node-1", "state": "running", "time": NOW, "reported": False}
    found = hang.find_hang(views(record(0, 4, [WAITING_IN_4]), silent), hang_timeout_s=10)
    assert [v.rank for v in found.missing] == [1]


def test_ranks_outside_a_subgroup_are_not_blamed_for_it():
    sub = {
        "0": {"ranks": [0, 1, 2, 3], "enqueued": 2, "completed": 2},
        "1": {"ranks": [0, 1], "enqueued": 5, "completed": 4},
    }
    other = {
        "0": {"ranks": [0, 1, 2, 3], "enqueued": 2, "completed": 2},
        "2": {"ranks": [2, 3], "enqueued": 9, "completed": 9},
    }
    ranks = views(
        record(0, 5, [("1", 5, "all_reduce", [[8]], 40.0)], groups=sub),
        record(1, 5, [("1", 5, "all_reduce", [[8]], 40.0)], groups=sub),
        record(2, 9, groups=other),
        record(3, 9, groups=other),
    )
    assert hang.find_hang(ranks, hang_timeout_s=10) is None
    sub_behind = {**sub, "1": {"ranks": [0, 1], "enqueued": 4, "completed": 4}}
    ranks[1] = views(record(1, 4, groups=sub_behind))[0]
    found = hang.find_hang(ranks, hang_timeout_s=10)
    assert [v.rank for v in found.missing] == [1] and "all_reduce #5 in group 1 (8 x float32)" in hang.verdict(
        "r", found
    )


def test_py_spy_frames_of_installed_packages_and_the_standard_library_are_not_the_users():
    text = (
        'Thread 1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
        "    wrapper (torch/distributed/c10d_logger.py:83)\n    step (/home/me/proj/train.py:31)\n"
        "    <module> (/home/me/proj/train.py:40)\n"
    )
    frames = hang.py_spy_main_thread(text)
    assert hang.RankView.user_frame_of(frames).describe() == "step (train.py:31)"


GLOO_ABORT_LOG = """terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 4096 vs 1024. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
Fatal Python error: Aborted

Thread 0x00007f5b0d7fa6c0 (most recent call first):
  File "/code/node/rankhook/gpu_cluster_rank_monitor.py", line 69 in run
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f5b177beb80 (most recent call first):
  File "<frozen importlib._bootstrap_external>", line 128 in _path_split
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/me/train.py", line 15 in <module>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:09:48
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 4017)  (SIGABRT)
"""


def test_a_gloo_size_abort_is_explained_with_the_rank_and_its_frame():
    line = hang.mismatch_line("node-0", GLOO_ABORT_LOG)
    assert line == (
        "fab: collective mismatch: rank 0 (node-0) aborted in <module> (train.py:15): gloo received "
        "4096 bytes where 1024 were expected; the ranks called one collective with different sizes"
    )
    assert hang.mismatch_line("node-1", "RuntimeError: Connection reset by peer\n") is None


def test_a_rank_reported_by_its_node_wins_over_the_same_rank_found_only_as_a_process():
    found_elsewhere = {"rank": 0, "pid": 4700, "node": "node-1", "state": "running", "time": NOW, "reported": False}
    ranks = views(record(0, 4, [WAITING_IN_4]), record(1, 3, node="node-1"), found_elsewhere)
    assert [v.rank for v in hang.find_hang(ranks, hang_timeout_s=10).missing] == [1]


def test_past_the_grace_a_silent_node_or_a_collective_nobody_finishes_is_still_a_hang():
    alone = views(record(0, 4, [WAITING_IN_4], stack=TRAIN_STACK))  # node-1 did not answer: no rank 1 at all
    assert hang.find_hang(alone, hang_timeout_s=10) is None
    assert hang.find_hang(alone, hang_timeout_s=10, overdue_s=40) is None  # waited 30 s: within the grace
    found = hang.find_hang(alone, hang_timeout_s=10, overdue_s=25)
    assert found.silent == (1,) and [v.rank for v in found.waiting] == [0]
    assert (
        "rank 1 of all_reduce #4 (1024 x float32) not reported (their node did not answer) while rank 0 "
        "waited 30 s" in hang.verdict("r1", found)
    )
    both = views(record(0, 4, [WAITING_IN_4]), record(1, 4, [WAITING_IN_4], stack=TRAIN_STACK))
    assert hang.find_hang(both, hang_timeout_s=10) is None  # every rank joined: slow, not hung
    line = hang.verdict("r1", hang.find_hang(both, hang_timeout_s=10, overdue_s=25))
    assert "ranks 0-1 entered all_reduce #4 (1024 x float32) and none finished it in 30 s" in line
    assert line.endswith("rank 1 was last seen in load_batch (train.py:14)")


def test_past_the_grace_a_member_that_left_the_collective_by_its_own_count_is_named_with_where_it_is():
    # rank 1's count says it went past #4 (gloo matched its calls some other way) while rank 0 still waits.
    gone_on = dict(record(1, 6, node="node-1", stack=TRAIN_STACK), finished=True)
    ranks = views(record(0, 4, [WAITING_IN_4]), gone_on)
    assert hang.find_hang(ranks, hang_timeout_s=10) is None  # within the grace the rule blames no one
    line = hang.verdict("r1", hang.find_hang(ranks, hang_timeout_s=10, overdue_s=25))
    assert (
        "rank 0 waited 30 s in all_reduce #4 (1024 x float32), which the others left: rank 1 (node-1, pid 4701) "
        "finished its script and is past it by its own count (entered #6) and inside no collective" in line
    ), line
    assert line.endswith("rank 1 was last seen in load_batch (train.py:14)"), line


class FakeRecorder:
    """torch's flight recorder as the monitor reads it: counters, and the buffer's entries."""

    def __init__(self, enqueued, completed, entries=()):
        self.state, self.entries, self.full_reads = (enqueued, completed), list(entries), 0

    def counters(self):
        return {"0": self.state}

    def full(self):
        self.full_reads += 1
        return {"entries": self.entries}


def test_the_first_record_inside_a_collective_names_it_and_a_failed_report_never_stops_the_monitor(
    tmp_path, monkeypatch
):
    import json
    import threading

    from node.rankhook import gpu_cluster_rank_monitor as monitor_module

    entry = {"pg_id": 0, "process_group": ["0", ""], "collective_seq_id": 4, "profiling_name": "gloo:all_reduce"}
    entry |= {"input_sizes": [[1024]], "input_dtypes": ["Float"], "time_created_ns": 1, "retired": False}
    recorder = FakeRecorder(4, 3, [entry])
    monkeypatch.setattr(monitor_module, "_recorder", lambda: recorder)
    monkeypatch.setattr(monitor_module, "group_ranks", lambda dist: {"0": [0, 1]})
    monitor = monitor_module.RankMonitor(str(tmp_path), 0, threading.main_thread())
    monitor.report(dist=None)
    written = json.loads((tmp_path / "rank-0.json").read_text())
    assert [(a["seq"], a["op"], a["sizes"]) for a in written["active"]] == [(4, "all_reduce", [[1024]])]
    assert recorder.full_reads == 1

    # A report that raises (here: the folder is gone) is said in the next one, and the loop goes on.
    reports = []
    fail_once = iter([OSError("No space left on device")])

    def report(dist):
        failure = next(fail_once, None)
        if failure:
            raise failure
        reports.append(monitor.failure)
        raise SystemExit  # end the loop after the second report

    monkeypatch.setattr(monitor, "report", report)
    monkeypatch.setattr(monitor_module, "_initialized_dist", lambda: object())
    monitor.interval_s = 0
    try:
        monitor.run()
    except SystemExit:
        pass
    assert reports == ["OSError: No space left on device"]


def test_a_collective_the_buffer_retired_is_left_even_where_the_groups_counter_lags(tmp_path, monkeypatch):
    """gloo retired all_reduce #3 and the rank entered broadcast #4 while `last_completed` still said 2 (seen
    under load for 34 s): the record names broadcast #4, never a nameless #3."""
    import json
    import threading

    from node.rankhook import gpu_cluster_rank_monitor as monitor_module

    def entry(seq, op, retired):
        return {"pg_id": 0, "process_group": ["0", ""], "collective_seq_id": seq, "profiling_name": f"gloo:{op}"} | {
            "input_sizes": [[1024]],
            "input_dtypes": ["Float"],
            "time_created_ns": seq * 10**9,
            "retired": retired,
        }

    recorder = FakeRecorder(4, 2, [entry(3, "all_reduce", True), entry(4, "broadcast", False)])
    monkeypatch.setattr(monitor_module, "_recorder", lambda: recorder)
    monkeypatch.setattr(monitor_module, "group_ranks", lambda dist: {"0": [0, 1]})
    monitor = monitor_module.RankMonitor(str(tmp_path), 1, threading.main_thread())
    for _ in range(2):  # the first report learns the buffer; the next one reads only the counters
        monitor.report(dist=None)
        written = json.loads((tmp_path / "rank-1.json").read_text())
        assert [(a["seq"], a["op"], a["since"]) for a in written["active"]] == [(4, "broadcast", 4.0)]
        assert written["groups"]["0"]["completed"] == 3
    assert recorder.full_reads == 1


def test_a_frame_whose_line_is_unknown_still_gives_a_verdict():
    # A frame object starting or ending reports f_lineno None; the watch once raised TypeError on it.
    stack = (("<module>", "train.py", None, False), ("step", None, "12", False))
    ranks = views(record(0, 4, [WAITING_IN_4]), record(1, 3, node="node-1", stack=stack))
    line = hang.verdict("r1", hang.find_hang(ranks, hang_timeout_s=10))
    assert line.endswith("rank 1 was last seen in step (?:12)"), line
    assert hang.parse_ranks({"now": NOW, "ranks": [{**record(1, 3), "stack": [None, {}]}]})[0].stack[0].line == 0
