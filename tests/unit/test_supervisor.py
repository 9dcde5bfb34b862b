"""The local supervisor's decisions (infra/providers/local/supervisor.py) on a scripted sequence of node deaths:
which nodes it brings back in together. Its SSH, node servers and bootstrap are replaced by recorders."""

from dataclasses import replace

from infra import state
from infra.providers.local import supervisor
from tests.support.inventories import cluster as aws_cluster


def test_a_head_whose_bootstrap_failed_is_brought_in_again_with_the_worker_that_went_during_it(state_dir, monkeypatch):
    """Notices on both nodes: the head goes first, its bootstrap fails because the worker goes during it.
    The worker's replacement is brought in together with the head (one bootstrap of both), not joined alone
    to a controller that never started, while the head is forgotten."""
    cluster = replace(aws_cluster(provider="local"), stack="local")
    head, worker = cluster.nodes
    for name in (state.BOOTSTRAP, supervisor.PID_FILE):
        path = state.stack_file("local", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    deaths = iter([[head], [head], [worker], [worker], [], []])  # each look, twice per death (then a second)
    looks = iter(range(4))

    def load(stack):
        if next(looks, None) is None:
            raise FileNotFoundError("down removed it")  # ends the loop
        return cluster

    brought_in: list[list[str]] = []

    def rejoin(stack, cluster, nodes):
        brought_in.append([node.name for node in nodes])
        if worker in nodes and head in nodes:
            return True, "fab bootstrap exited 0"
        if head in nodes:
            return False, "fab bootstrap exited 1"  # node-1 went during it
        return False, "join failed: error: the scheduler's controller does not answer"

    monkeypatch.setattr(supervisor.inventory, "load", load)
    monkeypatch.setattr(
        supervisor, "dead_nodes", lambda stack, cluster: [(cluster.nodes.index(n), n) for n in next(deaths, [])]
    )
    monkeypatch.setattr(supervisor, "rejoin", rejoin)
    told: list[list[str]] = []
    monkeypatch.setattr(supervisor, "mark_lost", lambda cluster, lost, why="": told.append([n.name for n in lost]))
    monkeypatch.setattr(supervisor, "fresh_node", lambda *args: None)
    monkeypatch.setattr(supervisor, "forget_stale_jobs", lambda *args: None)
    monkeypatch.setattr(supervisor.provider, "end_node_leftovers", lambda folder: None)
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: None)

    assert supervisor.run("local") == 0
    assert brought_in == [["node-0"], ["node-1", "node-0"]]
    # Slurm is told of node-0 (no controller: nothing asked) and of its failed bootstrap; of node-1 not at all
    # while the head that would be told runs no controller (each call would wait out its timeout)
    assert told == [["node-0"], ["node-0"]]
    said = state.stack_file("local", supervisor.LOG_FILE).read_text()
    assert "node-0: did not rejoin" in said and "node-1: rejoined" in said, said


def test_a_node_servers_pid_file_is_read_whole_or_as_an_older_versions_json(tmp_path):
    from infra.providers.local.node_config import pid_text, read_pid

    path = tmp_path / "sshd.pid"
    path.write_text(pid_text(4242))
    assert path.read_text() == "4242\n" and read_pid(path) == (4242, path.stat().st_mtime)
    path.write_text('{"pid": 17, "started_at": 5.0, "address": "127.0.0.10", "port": 2222}')
    assert read_pid(path) == (17, 5.0)
    for damaged in ("", "pid", "[1]", '{"pid": "x"}'):
        path.write_text(damaged)
        assert read_pid(path) is None, damaged
    assert read_pid(tmp_path / "gone.pid") is None


def test_a_node_reclaimed_after_a_notice_its_watcher_saw_is_not_told_lost_on_top(state_dir, monkeypatch):
    """The watcher drained it with the notice as its reason, and the run's requeue says so: `node lost` on
    top put itself in the notice's place (in the run's record and `fab jobs`). A node killed outright, or
    reclaimed after a notice too short for its watcher to see, is told lost."""
    from infra.providers.local import metadata, provider

    cluster = replace(aws_cluster(provider="local"), stack="local")
    head, worker = cluster.nodes
    told: list[list[str]] = []
    monkeypatch.setattr(supervisor, "mark_lost", lambda cluster, lost, why="": told.append([n.name for n in lost]))
    monkeypatch.setattr(supervisor, "fresh_node", lambda *args: None)
    monkeypatch.setattr(supervisor.provider, "end_node_leftovers", lambda folder: None)
    provider.notice_path("local", worker.name).parent.mkdir(parents=True, exist_ok=True)
    for notice_s, said in ((120.0, []), (15.0, []), (2.0, [worker.name]), (None, [worker.name])):
        told.clear()
        provider.notice_path("local", worker.name).unlink(missing_ok=True)
        if notice_s is not None:
            metadata.post_notice(provider.notice_path("local", worker.name), notice_s)
        supervisor.replace("local", cluster, [(1, worker)])
        assert told == [said], (notice_s, told)
    events = supervisor.Ledger().events("local")
    assert [e.kind for e in events] == ["spot interruption"] * 3 + ["node lost"], events
