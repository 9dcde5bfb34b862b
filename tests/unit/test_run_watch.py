"""The one run watch both holders use (node/run_watch.py), given fake nodes: its own faults never end a run."""

import threading

from node import contract
from node.run_watch import RunWatch, WatchPolicy
from tests.unit.test_hang import NOW, WAITING_IN_4, record


def watch(ask, said, kept, polls=3, on_hang="stop"):
    """A watch over a run that ends after `polls` pauses (or once stopped)."""
    stopped = threading.Event()
    pauses = []

    def ended(timeout_s: float) -> bool:
        pauses.append(timeout_s)
        return stopped.is_set() or len(pauses) > polls

    return RunWatch(
        "r1",
        WatchPolicy(timeout_s=10, poll_s=0.01, on_hang=on_hang),
        ask,
        stopped.set,
        ended,
        said.append,
        lambda name, text: kept.update({name: text}),
        note_prefix="fab: ",
    ), stopped


def test_a_watch_that_raises_on_every_poll_says_it_once_and_never_stops_the_run():
    said: list[str] = []
    kept: dict[str, str] = {}

    def ask(action):
        return [{"now": NOW, "ranks": [{"rank": "not a number"}]}]  # a record the rule cannot read

    run_watch, stopped = watch(ask, said, kept, polls=5)
    assert run_watch.run() is None
    assert not stopped.is_set() and run_watch.polls == 0
    assert len(said) == 1 and said[0].startswith("fab: hang watch: ValueError: "), said
    assert "the run is not at fault" in said[0]


def test_a_hang_is_said_kept_and_stopped_once_and_its_evidence_collected():
    said: list[str] = []
    kept: dict[str, str] = {}
    asked: list[str] = []
    hung = {"now": NOW, "ranks": [record(0, 4, [WAITING_IN_4]), record(1, 3, node="node-1")]}

    def ask(action):
        asked.append(action)
        return [hung]

    run_watch, stopped = watch(ask, said, kept)
    verdicts: list[dict] = []

    def on_verdict(found: dict) -> str:
        verdicts.append(found)
        return "evidence in hang/"

    run_watch.on_verdict = on_verdict
    found = run_watch.run()
    assert stopped.is_set() and asked == ["status", "collect"] and verdicts == [found]
    assert found["verdict"].startswith("HANG run=r1: rank 1 (node-1, pid 4701) never entered all_reduce #4")
    assert said[:2] == [found["verdict"], "evidence in hang/"]
    assert said[2].startswith("fab: stopping the hung run on every node")
    assert contract.STRAGGLER_RECORD not in kept  # no rank named slow: no straggler record
