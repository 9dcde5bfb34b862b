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


def test_when_the_runs_step_ends_a_group_started_again_but_not_rejoined_is_stopped_at_once(tmp_path, capsys):
    """A Slurm-held run's batch job (node/slurm_restarts.py `finish`): its survivor finished while group 1,
    started again on a replacement, was still healing. No peer is left: it is stopped now, not given the
    60 s a rejoined group has to end at the peers' step (a finished run sat RUNNING 1/2 for 69 s)."""
    import subprocess
    import threading
    import time

    from node import slurm_restarts

    restarter = replicas.GroupRestarter(
        [["node-0"], ["node-1"], ["node-2"]], lambda: {"node-1", "node-2"}, lambda n: True
    )
    restarter.left(1, at=1.0)
    restarter.left(2, at=1.0)
    assert restarter.look() == [1, 2]
    at = restarter.heals[0][2]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"replica": 2, "participants": 2, "time": at + 1}) + "\n")  # group 2 is back
    assert restarter.not_rejoined(replicas.contract_lines(str(metrics))) == [1]
    restarts = slurm_restarts.GroupRestarts.__new__(slurm_restarts.GroupRestarts)
    restarts.folder, restarts.restarter, restarts.stopping = str(tmp_path), restarter, threading.Event()
    restarts.processes = {1: subprocess.Popen(["sleep", "600"]), 2: subprocess.Popen(["sleep", "1"])}
    started = time.monotonic()
    restarts.finish()
    assert time.monotonic() - started < slurm_restarts.STOPPED_GRACE_S
    assert restarts.processes[1].returncode == -15 and restarts.processes[2].returncode == 0  # group 2: its own end
    assert "[cluster] replica group 1 had not rejoined when the run's other groups ended" in capsys.readouterr().out
    healed = [json.loads(line) for line in (tmp_path / "heals.jsonl").read_text().splitlines()]
    assert sorted(h["group"] for h in healed) == [1, 2]


def test_a_fab_held_runs_group_started_again_but_not_rejoined_is_stopped_once_no_peer_trains():
    """The fab holder's side (remote/heal.py): once the survivor's job ended, the launch stops group 1,
    started again and still healing, rather than wait with the run RUNNING at 1/2."""
    from remote.heal import Healer
    from tests.support import inventories

    healer = Healer(inventories.cluster(), [["node-0"], ["node-1"]], "", lambda s: None, lambda s: None)
    healer.restarter.running, healer.restarter.heals = {1}, [(1, 1.0, 100.0)]
    healer.training = {"node-0", "node-1"}
    assert healer.orphans() == []  # node-0's group trains: a peer to heal from
    healer.training.discard("node-0")  # the survivor trained to the end
    assert healer.orphans() == [(1, ["node-1"])]
    stopped: list = []
    dropped: set = set()
    stops = healer.stop_orphans(lambda nodes: stopped.append(nodes) or "thread", dropped)
    assert stops == [("thread", ["node-1"])] and stopped == [["node-1"]] and dropped == {"node-1"}
    assert healer.stop_orphans(lambda nodes: stopped.append(nodes), dropped) == []  # said and stopped once
    healer.records = [{"replica": 1, "participants": 1, "time": 101.0}]
    assert healer.orphans() == []  # it rejoined: it ends at its own last step
