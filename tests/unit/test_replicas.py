"""The one restarter of a fault-tolerant run's replica groups (node/replicas.py), both holders' rule and records."""

import json

from node import replicas


def test_a_group_starts_again_once_all_its_nodes_are_back_and_is_priced_until_its_first_step_back(tmp_path):
    back: set = set()
    started: list = []

    def start(number: int) -> bool:
        started.append(number)
        return True

    restarter = replicas.GroupRestarter([["node-0", "node-1"], ["node-2", "node-3"]], lambda: back, start)
    restarter.left(1, at=10.0)
    back.add("node-2")
    assert restarter.look() == []  # node-3 is not back yet
    back.add("node-3")
    assert restarter.look() == [1] and restarter.look() == [] and started == [1]  # its start runs: once
    metrics = tmp_path / "metrics.jsonl"
    assert restarter.heal_records(str(metrics)) == []  # no step back yet
    at = restarter.heals[0][2]
    metrics.write_text(json.dumps({"replica": 1, "participants": 2, "time": at + 3}) + "\n")
    healed = {"group": 1, "nodes": ["node-2", "node-3"], "stopped_at": 10.0, "at": at + 3}
    assert restarter.heal_records(str(metrics)) == [healed]
    assert restarter.heal_records(str(metrics), last=True) == []  # each heal's record is given once
    restarter.ended_start(1, 137)  # lost again: started again
    assert restarter.look() == [1]
    restarter.ended_start(1, 0)  # trained to the end: never again
    assert restarter.look() == []
    back |= {"node-0", "node-1"}
    assert 0 not in restarter.look()  # group 0 holds the Lighthouse: its loss is the checkpoint's


def test_a_group_whose_start_fails_to_begin_is_asked_about_again():
    restarter = replicas.GroupRestarter([["node-0"], ["node-1"]], lambda: {"node-1"}, lambda number: False)
    assert restarter.look() == [] and restarter.look() == [] and restarter.heals == []
