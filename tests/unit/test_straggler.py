"""The straggler rule (node/straggler.py) on records shaped as the rank monitor writes them: each rank's
last steps' own compute time, `compute: [[step, seconds], ...]`."""

import json
import random

from node import straggler


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


def test_one_normal_step_starts_the_count_again():
    slow_steps = [s for s in range(1, 41) if s != 15]  # 14 slow, one not, 25 slow
    (found,) = straggler.find_stragglers(ranks(2, {1: (2.0, slow_steps)}))
    assert (found.first_step, found.last_step) == (16, 40)
    assert straggler.find_stragglers(ranks(2, {1: (2.0, [s for s in range(1, 41) if s % 20 != 0])})) == []


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
    assert [(r["rank"], r["node"], r["steps"]) for r in kept] == [(2, "node-2", [11, 30]), (3, "node-3", [1, 40])]
    assert all(r["why"].startswith("compute ") and r["named_at"] > 0 for r in kept)
