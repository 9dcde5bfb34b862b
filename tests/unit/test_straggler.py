"""The straggler rule (node/straggler.py) on records shaped as the rank monitor writes them: each rank's
last steps' own compute time, `compute: [[step, seconds], ...]`."""

import json
import random
import statistics
import time

from node import straggler
from tests.support import REPO


def record(rank: int, times: dict) -> dict:
    return {"rank": rank, "node": f"node-{rank}", "compute": [[step, seconds] for step, seconds in times.items()]}


def ranks(count: int, slow: dict, steps=range(1, 41), base: float = 0.010) -> list:
    """`count` ranks over `steps`; `slow`: {rank: (factor, the steps it is slow in)}."""
    return [
        record(
            rank,
            {step: base * (slow[rank][0] if rank in slow and step in slow[rank][1] else 1.0) for step in steps},
        )
        for rank in range(count)
    ]


def test_a_rank_slower_than_1_3x_for_20_steps_is_named_with_its_node():
    (found,) = straggler.find_stragglers(ranks(4, {2: (1.5, range(11, 31))}))
    assert (found.rank, found.node, found.first_step, found.last_step) == (2, "node-2", 11, 30)
    assert found.line("r1") == (
        "STRAGGLER run=r1: rank 2 on node-2: compute 1.5x the other ranks' median for 20 steps in a row (steps 11-30)"
    )
    assert found.as_dict()["steps"] == [11, 30]


def test_19_slow_steps_or_1_25x_name_nobody():
    assert straggler.find_stragglers(ranks(4, {2: (1.5, range(11, 30))})) == []
    assert straggler.find_stragglers(ranks(4, {2: (1.25, range(1, 41))})) == []


def test_single_normal_steps_are_tolerated_twice_and_two_in_a_row_start_the_count_again():
    # A healthy rank's own hiccup makes the slow one not slower than it for a step: that step is not
    # counted, and does not start the count again, twice in a window.
    (found,) = straggler.find_stragglers(ranks(2, {1: (2.0, [s for s in range(1, 41) if s != 15])}))
    assert (found.first_step, found.last_step, found.slow_steps) == (1, 21, 20)  # named at the rule met
    assert found.why().endswith("in 20 of 21 steps (steps 1-21)")
    for normal in ({14, 15}, {5, 10, 15}):  # two in a row, or a third: the count starts again after
        (found,) = straggler.find_stragglers(ranks(2, {1: (2.0, [s for s in range(1, 41) if s not in normal])}))
        assert (found.first_step, found.last_step) == (16, 35), normal
    assert straggler.find_stragglers(ranks(2, {1: (2.0, [s for s in range(1, 40) if s % 3 != 0])})) == []


def test_two_ranks_name_the_slow_one_only():
    found = straggler.find_stragglers(ranks(2, {1: (3.0, range(1, 41))}))
    assert [s.rank for s in found] == [1]


def test_noisy_healthy_ranks_are_never_named():
    rng = random.Random(7)
    for _ in range(200):
        noisy = [record(r, {s: 0.010 * rng.uniform(0.85, 1.15) for s in range(1, 41)}) for r in range(4)]
        assert straggler.find_stragglers(noisy) == []


def test_only_steps_every_rank_reported_count():
    early = ranks(2, {1: (2.0, range(1, 41))})
    early[0]["compute"] = early[0]["compute"][:15]  # rank 0's record is older: steps 1-15 only
    assert straggler.find_stragglers(early) == []
    assert straggler.find_stragglers([early[1]]) == []
    assert straggler.find_stragglers([{"rank": 0, "node": "node-0"}, {"rank": 1, "compute": None}]) == []


def test_a_watch_names_each_straggler_once_and_keeps_every_one_in_its_record():
    named = straggler.Named()
    assert named.update(ranks(4, {})) == []
    (first,) = named.update(ranks(4, {2: (1.5, range(11, 31))}))
    assert first.rank == 2
    assert named.update(ranks(4, {2: (1.5, range(11, 31)), 3: (2.0, range(1, 41))}))[0].rank == 3  # 2 not again
    kept = json.loads(named.record())
    assert [(r["rank"], r["node"], r["steps"]) for r in kept] == [(2, "node-2", [11, 30]), (3, "node-3", [1, 20])]
    assert all(r["why"].startswith("compute ") and r["named_at"] > 0 for r in kept)


def test_the_verdict_counts_steps_not_looks():
    # A watch that looks every 90 steps, at a monitor keeping its last 200: rank 1 slow from step 31 is
    # named at step 50 (the rule met), whichever look saw it, with the step every rank had reached then.
    named = straggler.Named()
    steps = range(1, 301)
    everything = ranks(2, {1: (2.0, range(31, 301))}, steps=steps)
    fresh = []
    for look in (90, 180, 270):
        fresh += named.update([{**r, "compute": [c for c in r["compute"] if c[0] <= look][-200:]} for r in everything])
    (found,) = fresh
    assert (found.rank, found.first_step, found.last_step) == (1, 31, 50)
    (kept,) = json.loads(named.record())
    assert (kept["steps"], kept["seen_step"]) == ([31, 50], 90)


def test_looks_that_miss_steps_between_them_start_the_count_again():
    named = straggler.Named()
    everything = ranks(2, {1: (2.0, range(1, 301))}, steps=range(1, 301))
    for look in (15, 150):  # a look at 15 and the next keeping steps 141-150 only: 15 then 10 slow in a row
        assert (
            named.update([{**r, "compute": [c for c in r["compute"] if c[0] <= look][-10:]} for r in everything]) == []
        )


def test_a_rank_slow_now_brings_the_next_look_forward_to_when_it_is_due():
    named = straggler.Named()
    named.update(ranks(2, {}, steps=range(1, 11)))
    assert named.next_look_s(4.0) == 4.0  # nobody slow: the regular poll
    named.pace = [(100.0, 10), (101.0, 60)]  # 50 steps a second
    named.update(ranks(2, {1: (2.0, range(51, 61))}, steps=range(1, 61)))
    named.pace = [(100.0, 10), (101.0, 60)]
    assert named.next_look_s(4.0) == straggler.MIN_LOOK_S  # 10 more steps: due at once, looked at in 1 s
    named.pace = [(100.0, 10), (102.0, 20)]  # 5 steps a second: due in 2 s
    assert named.next_look_s(4.0) == 2.0
    named.update(ranks(2, {1: (2.0, range(58, 61))}, steps=range(1, 61)))  # only 3 slow in a row: noise
    assert named.next_look_s(4.0) == 4.0


def test_the_other_ranks_median_is_the_median_of_the_others():
    rng = random.Random(3)
    for count in (2, 3, 4, 9, 128):
        values = [rng.choice([0.01, 0.02, rng.uniform(0.005, 0.05)]) for _ in range(count)]
        ordered = sorted(values)
        for index, value in enumerate(values):
            others = values[:index] + values[index + 1 :]
            assert straggler._median_without(ordered, value) == statistics.median(others)


def test_a_rank_monitor_shares_its_last_step_times_where_the_launch_asked_and_a_watch_reads_them(tmp_path, monkeypatch):
    import sys
    import threading
    import time
    import types

    from node import contract
    from node.rankhook import gpu_cluster_rank_monitor as monitor_module

    metrics = types.SimpleNamespace(last_step=None, step_compute=[])
    monkeypatch.setitem(sys.modules, "harness.metrics", metrics)
    monkeypatch.setenv(contract.NODE_VARIABLE, "node-1")
    shared = tmp_path / "run" / contract.STEP_TIMES
    unasked = monitor_module.RankMonitor(str(tmp_path / "progress"), 1, threading.main_thread())
    monkeypatch.setenv(contract.STEP_TIMES_VARIABLE, str(shared))
    monitor = monitor_module.RankMonitor(str(tmp_path / "progress"), 1, threading.main_thread())
    monitor.share_step_times()  # no step yet
    assert not shared.exists()
    metrics.step_compute, metrics.last_step = [(step, 0.01) for step in range(1, 101)], 100
    unasked.share_step_times()
    assert not shared.exists()  # a launch without a shared folder: nothing written there
    monitor.share_step_times()  # handed to its writer thread
    written = shared / "rank-1.json"
    deadline = time.monotonic() + 30
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shared.stat().st_mode & 0o777 == 0o700
    (shared / "rank-0.json").write_text('{"rank": 0, "node": "node-0", "comp')  # not a record: skipped
    expected = {"rank": 1, "node": "node-1", "compute": [[step, 0.01] for step in range(37, 101)]}
    assert straggler.read_step_times(str(shared)) == [expected]  # the last STEP_TIMES_KEPT steps
    assert contract.json_objects([(shared / "rank-1.json").read_text(), "garbage", '{"rank": 2, "no']) == [expected]


def test_shared_looks_and_the_polls_feed_one_verdict_that_says_a_straggler_once():
    import time

    named = straggler.Named()
    said, then = [], []
    records = ranks(2, {1: (2.0, range(1, 41))})
    reads = iter([OSError("the head node did not answer")])

    def read():
        failure = next(reads, None)
        if failure:
            raise failure  # a failed read: the next look reads again
        return records

    looks = straggler.SharedLooks(named, read, said.append, then.append).start()
    try:
        deadline = time.monotonic() + 60
        while not then and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        looks.stop()
    assert named.update(records, said.append) == []  # the polls' records hold the same steps: named already
    assert [[found.rank for found in fresh] for fresh in said] == [[1]] and then == said
    assert not looks.thread.is_alive()


def test_two_threads_feeding_one_verdict_say_each_straggler_once_and_keep_every_one_in_the_record():
    import threading
    import time

    named = straggler.Named()
    said, records_written = [], []

    def say(fresh):
        said.extend(found.rank for found in fresh)
        time.sleep(0.05)  # a slow write: the other thread's update waits, then finds them named
        records_written.append(json.loads(named.record()))

    everything = ranks(4, {1: (2.0, range(1, 41)), 3: (2.0, range(1, 41))})
    halves = [[r for r in everything if r["rank"] != 3], everything]  # one thread sees rank 3 later
    threads = [threading.Thread(target=named.update, args=(records, say)) for records in halves * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(said) == [1, 3]
    assert sorted(r["rank"] for r in records_written[-1]) == [1, 3]  # the last record written has both


def test_any_scripts_model_forward_passes_are_its_steps_and_a_loss_module_beside_it_is_not(monkeypatch):
    """A script that is not on the harness: the outermost module with the most parameters is its model, each
    of its training forward passes is one step, timed; forwards in other threads, of other modules and in
    evaluation do not count; nothing of ours is put on the user's model (a pickled model does not name us)."""
    import pickle
    import threading

    import torch
    from torch import nn
    from torch.nn.modules import module as torch_module

    monkeypatch.syspath_prepend(str(REPO / "node" / "rankhook"))
    from gpu_cluster_forward_steps import DISCOVERY_FORWARDS, ForwardSteps

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

        def forward(self, x):
            time.sleep(0.01)
            return self.inner(x)

    model, loss = Slow(), nn.CrossEntropyLoss()
    hooks_before = len(torch_module._global_forward_pre_hooks)
    steps = ForwardSteps().install()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])

    def train_step():
        loss(model(x), y).backward()
        thread = threading.Thread(target=lambda: model(x))  # a data loader's or an evaluator's thread
        thread.start()
        thread.join()
        model.eval()
        with torch.no_grad():
            model(x)  # an evaluation: not a step
        model.train()

    for _ in range(DISCOVERY_FORWARDS):  # the model is known by its second pass (model, loss, model)
        if steps.model is None:
            train_step()
    for _ in range(5):
        train_step()
    assert steps.model is model
    assert steps.step == 5  # the training passes after the model was known
    entries = steps.entries()
    assert [step for step, _ in entries] == [1, 2, 3, 4, 5] and all(s >= 0.01 for _, s in entries), entries
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert b"gpu_cluster_forward_steps" not in pickle.dumps(model.inner)  # a torch.save of the model names us not
    steps.remove()
    assert len(torch_module._global_forward_pre_hooks) == hooks_before


def test_a_forward_step_hook_that_fails_removes_itself_and_the_training_goes_on(monkeypatch, capfd):
    import torch
    from torch import nn
    from torch.nn.modules import module as torch_module

    monkeypatch.syspath_prepend(str(REPO / "node" / "rankhook"))
    from gpu_cluster_forward_steps import ForwardSteps

    hooks_before = len(torch_module._global_forward_pre_hooks)
    steps = ForwardSteps().install()
    monkeypatch.setattr(steps, "_discovered", lambda mod: 1 / 0)
    model = nn.Linear(4, 2)
    assert model(torch.randn(3, 4)).shape == (3, 2)  # the user's forward is not the one that fails
    assert len(torch_module._global_forward_pre_hooks) == hooks_before
    assert "step times of this script stop (ZeroDivisionError" in capfd.readouterr().err
