"""A fab-held fault-tolerant run's replica groups started again on their replaced nodes: the fab holder's half
of what a Slurm-held run's batch job does (node/slurm_restarts.py); both are adapters of the one restarter,
node/replicas.py `GroupRestarter` (which group starts again and when, the bookkeeping, the heal's pricing record).

A group whose node's job session dropped (the node died: `launch.LOST`) is dropped by the launch
(`launch._drop_group`) and its peers go on. While some group still trains, this watch asks each lost node every
`POLL_S`, over a fresh connection, whether it is back in service: it answers (a replacement comes up on the same
address; its new host key is pinned by whoever replaced it), is bootstrapped (node/join.py wrote its env file from
the shared folder's kit) and runs no job. Then the group's nodes get what the launch gave every node (the run's
`--env` values, its workdir copy and requirements, the script where there is no shared folder) and the group's own
commands, with `CLUSTER_RESTART_COUNT` 0: torchft heals it from a live peer (no checkpoint read) and it rejoins
the quorum. The launch streams it as it streams every node (`Healer.started` hands it the new job sessions). Its
interruption is priced in the ledger (`Ledger.run_idle`) from when its node was found gone until the group's
first step back.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from infra.inventory import ClusterInfo
from node import replicas
from remote import node_paths, protocol
from remote.connect import NodeSession, describe
from remote.stream import say

POLL_S = 1.0
"""How often a lost node is asked whether it is back (a connection refused costs a millisecond), and the
head node how many groups are in the quorum."""
METRICS_TAIL_BYTES = 1 << 14
"""How much of the run's metrics.jsonl end the participants are read from (a line per group per step)."""


class Healer:
    """One fab-held fault-tolerant run's group restarts. `prepare(session)` readies one node for the run (env
    values, workdir, requirements, upload) and `start(session)` starts its job, returning the job session's
    future; both are the launch's own steps. `shown(participants)` hears the groups in the quorum (`1/2`) as
    they change, read from the run's `metrics` on the head node (`fab jobs`' participants, as a Slurm-held
    run's batch job reads them)."""

    def __init__(
        self,
        cluster: ClusterInfo,
        groups: list[list[str]],
        ask: str,
        prepare: Callable[[NodeSession], None],
        start: Callable[[NodeSession], Future],
        metrics: str = "",
        shown: Callable[[str], None] | None = None,
    ):
        self.cluster, self.groups, self.ask = cluster, groups, ask
        self.prepare, self.start = prepare, start
        self.metrics, self.shown, self.participants = metrics, shown, ""
        self.records: list = []
        """The contract lines of the newest look at the run's metrics (`replicas.contract_records`)."""
        self.head: NodeSession | None = None
        self.lock = threading.Lock()
        self.lost: set[str] = set()  # nodes whose job session dropped, until their group starts again
        self.training: set[str] = {name for group in groups for name in group}  # nodes whose job session runs
        self.restarted: dict[Future, int] = {}  # a start of a group again: its group
        self.back: dict[str, NodeSession] = {}  # at a look: the lost nodes back in service, a session on each
        self.restarter = replicas.GroupRestarter(groups, self._asked_back, self._start_again)
        self.fresh: queue.Queue[tuple[Future, NodeSession]] = queue.Queue()
        self.sessions: list[NodeSession] = []
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "Healer":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        for session in [*self.sessions, *([self.head] if self.head else [])]:
            session.close()

    def ended_on(self, name: str, future: Future, code: int | None, lost: bool) -> None:
        """The launch saw a node's job session end (`lost`: its connection dropped, the node gone)."""
        with self.lock:
            self.training.discard(name)
            number = self.restarted.pop(future, None)
            if lost:
                self.lost.add(name)
        if number is not None:
            self.restarter.ended_start(number, code)
        if lost:
            self.restarter.left(next(n for n, group in enumerate(self.groups) if name in group))

    def started(self) -> list[tuple[Future, NodeSession]]:
        """The job sessions started again since the last call, for the launch to follow."""
        found = []
        while True:
            try:
                found.append(self.fresh.get_nowait())
            except queue.Empty:
                return found

    def _watch(self) -> None:
        while not self.closed.wait(POLL_S):
            self._show_participants()
            with self.lock:
                due = bool(self.lost) and self._peers()
            if not due:  # nothing to start again, or no live peer to heal from
                continue
            self.restarter.look()
            for session in self.back.values():  # back, but its group is not due (another of its nodes is not)
                session.close()
            self.back = {}

    def _asked_back(self) -> set:
        """The lost nodes back in service now, each with a session kept for its group's start."""
        with self.lock:
            lost = sorted(self.lost)
        self.back = {name: session for name in lost if (session := self._back(name)) is not None}
        return set(self.back)

    def orphans(self) -> list[tuple[int, list[str]]]:
        """The groups started again that have not rejoined (no step since that start), where no other group
        trains whole any more: no peer is left to heal from, so the launch stops them (else they wait for
        torchft's quorum timeout, and the finished run sits RUNNING at 1/2)."""
        waiting = set(self.restarter.not_rejoined(self.records))
        with self.lock:
            others = any(
                all(name in self.training for name in group)
                for number, group in enumerate(self.groups)
                if number not in waiting
            )
        return [] if others else [(number, self.groups[number]) for number in sorted(waiting)]

    def stop_orphans(self, stop: Callable[[list[str]], threading.Thread], dropped: set[str]) -> list:
        """Each orphan group not dropped yet, said once and stopped (`stop`: the launch's background stop of
        those nodes); the stops, as (thread, nodes), for the launch to wait for. Its nodes join `dropped`."""
        stops = []
        for number, members in self.orphans():
            if set(members) & dropped:
                continue
            say(
                f"fab: replica group {number} ({', '.join(members)}) had not rejoined when the run's other groups "
                "ended: no peer is left to heal from, so it is stopped"
            )
            stops.append((stop(members), members))
            dropped.update(members)
        return stops

    def _peers(self) -> bool:
        """Whether some group still trains whole (a live peer to heal from); under `lock`."""
        return any(all(name in self.training for name in group) for group in self.groups)

    def _show_participants(self) -> None:
        """The newest contract lines kept (`records`), their participants told to `shown` where they changed."""
        if not self.metrics:
            return
        try:
            self.head = self.head or NodeSession(self.cluster, self.cluster.head)
            tail = self.head.run(f"tail -c {METRICS_TAIL_BYTES} {node_paths.shell_path(self.metrics)} 2>/dev/null")
        except Exception:  # the head node does not answer now: asked again next time
            return
        text = tail.stdout
        self.records = replicas.contract_records(text, cut=len(text) >= METRICS_TAIL_BYTES)
        newest = replicas.newest_participants(self.records)
        participants = f"{newest}/{len(self.groups)}" if newest is not None else ""
        if self.shown is not None and participants and participants != self.participants:
            self.participants = participants
            self.shown(participants)

    def _back(self, name: str) -> NodeSession | None:
        """A session on the node where it is back in service (answers, bootstrapped, no job), else None."""
        node = next(node for node in self.cluster.nodes if node.name == name)
        session = None
        try:
            session = NodeSession(self.cluster, node)
            job, bootstrapped = protocol.parse_job_status(session.run(self.ask).stdout)
        except Exception:  # not up yet (refused, reset, a host key not pinned yet): asked again next time
            if session is not None:
                session.close()
            return None
        if job is None and bootstrapped:
            return session
        session.close()
        return None

    def _start_again(self, number: int) -> bool:
        """Group `number` readied and started again on its nodes back in service; True where it started."""
        members = self.groups[number]
        sessions = [self.back.pop(name) for name in members]
        say(
            f"fab: replica group {number} ({', '.join(members)}): back in service after a replacement; "
            "it starts again and heals from a live peer"
        )
        try:
            for session in sessions:
                self.prepare(session)
        except Exception as exc:  # one line; its nodes are asked again next time
            say(f"fab: replica group {number} could not be started again: {describe(exc)}")
            for session in sessions:
                session.close()
            return False
        with self.lock:
            if self.closed.is_set() or not self._peers():  # the run's last group ended while this one was readied
                for session in sessions:
                    session.close()
                return False
            self.lost -= set(members)
            for session in sessions:
                self.sessions.append(session)
                self.training.add(session.node.name)
                future = self.start(session)
                self.restarted[future] = number
                self.fresh.put((future, session))
        return True

    def stop(self) -> None:
        """No group is started again from now on (the run's last group ended, or it was interrupted)."""
        self.closed.set()
        self.thread.join(timeout=30)

    def price(self, metrics: Path) -> None:
        """Each group started again, into the ledger: its node's interruption lasts until the group's first
        step back (the run's fetched `metrics.jsonl`), not only until the node was replaced."""
        healed = self.restarter.heal_records(str(metrics), tail_bytes=0, last=True)
        if not healed:
            return
        from infra.ledger import Ledger

        ledger = Ledger()
        try:
            for heal in healed:  # no metrics, or no step back: priced until the group's start
                for name in heal["nodes"]:
                    ledger.run_idle(self.cluster.stack, name, heal["stopped_at"], heal["at"])
        finally:
            ledger.close()
