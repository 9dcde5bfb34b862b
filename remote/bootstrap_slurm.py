"""Bootstrap's scheduler stage: Slurm on every node (node/scheduler.py: slurmctld on the head node, slurmd
everywhere, one munge key per cluster, accounting where the head node has it), or a Slurm of the site's own
adopted (`slurm: existing`), or none (`--scheduler none`, or `auto` where Slurm cannot hold the runs, saying
why); and the join kit a replacement node joins with."""

import base64
import enum
import io
import json
import secrets
from pathlib import Path

from infra import state
from infra.errors import NodeCallError, OperationError, UsageError
from node import calls, contract, kit
from remote import node_paths, protocol
from remote.bootstrap_stage import (
    REPO,
    BootstrapBase,
    NodeRecord,
    Outcome,
    StageFailed,
    digest,
    remembered_setup,
)
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

SCHEDULER_PORTS = 60
"""Slurm's ports, just above MASTER_PORT: slurmctld, one slurmd per node, srun's range."""


SCHEDULER_CODE = (
    "node/scheduler.py",
    "node/slurm_conf.py",
    "node/slurm_daemons.py",
    "node/slurm_nodes.py",
    "node/slurm_existing.py",
    "node/slurm_login.py",
    "node/slurm_accounting.py",
)
"""The code the scheduler stage runs on a node (`scheduler.py start`, `adopt`): part of the stage's digest."""


class Scheduler(str, enum.Enum):
    """`fab bootstrap --scheduler`: who holds the runs."""

    AUTO = "auto"
    """Slurm where every node has it and one user, else fab's connections, saying why."""
    SLURM = "slurm"
    NONE = "none"


class SlurmStage(BootstrapBase):
    """The scheduler stage, and the check of Slurm's ports before any stage writes."""

    scheduler_choice: Scheduler
    slurm_holds: bool
    scheduler_why: str
    slurm_held_before: bool
    accounting: str

    def _refuse_busy_slurm_ports(self, sessions: list[NodeSession]) -> None:
        """The ports our Slurm's daemons will listen on (the controller on the head node, each node's slurmd)
        must be free on every node, checked before any stage writes: another stack's Slurm on this machine
        with the same --master-port would otherwise take this one's nodes without a word. Not where Slurm
        is the site's or not wanted, nor where our own daemons already hold these very ports."""
        remembered = remembered_setup(self.cluster)
        ours_already = self.slurm_held_before and remembered.master_port == self.master_port
        if self.cluster.slurm_existing or self.scheduler_choice is Scheduler.NONE or ours_already:
            return
        first = self.master_port + 1
        source = (REPO / "node" / "port_free.py").read_text()

        def check(session: NodeSession) -> str:
            index = sessions.index(session)
            ports = [first, first + 1 + index] if index == 0 else [first + 1 + index]
            command = protocol.python_json_command(self.cluster.python, source, "@host", *map(str, ports))
            return session.run(command).stdout.strip()

        for session, answer in zip(sessions, on_all_nodes(sessions, check), strict=True):
            verdict = answer.value or ""
            if verdict.startswith("in use"):
                raise UsageError(
                    f"a port Slurm's daemons need on {session.node.name} is taken "
                    f"({verdict.removeprefix('in use: ')}): "
                    f"another stack's Slurm with the same --master-port? pick another --master-port "
                    f"(Slurm uses {first} to {first + SCHEDULER_PORTS} above it)"
                )

    def scheduler_stage(self) -> dict[str, Outcome]:
        """Slurm on every node (node/scheduler.py): slurmctld on the head node, slurmd everywhere, one munge
        key per cluster; with `--scheduler none`, whatever an earlier bootstrap started is stopped."""
        users = self._users_differ() if self.scheduler_choice is not Scheduler.NONE else ""
        if users and (self.cluster.slurm_existing or self.scheduler_choice is Scheduler.SLURM):
            return {r.name: Outcome("failed", users) for r in self.records}
        if self.cluster.slurm_existing and self.scheduler_choice is not Scheduler.NONE:
            self.slurm_holds = True
            return self._adopt_existing_slurm()
        if self.scheduler_choice is Scheduler.AUTO:
            why, unasked = (users, {}) if users else self._slurm_missing()
            if unasked:  # a node that could not be asked decides nothing: Slurm is not turned off for it
                return unasked
            if why and self.slurm_held_before:  # runs may be queued there: never stopped silently
                why = (
                    f"{why}; Slurm held this cluster's runs at the last bootstrap: install it again, or "
                    "fab bootstrap --scheduler none to stop it and hold runs in fab's connections"
                )
                return {r.name: Outcome("failed", why) for r in self.records}
            self.slurm_holds, self.scheduler_why = not why, why
            if why:
                say(f"bootstrap: runs stay in fab's connections, not in Slurm: {why}")
        if not self.slurm_holds:
            if not any("scheduler" in r.stages for r in self.records):
                self._write_join_kit(None)
                return {r.name: Outcome("n/a", "none") for r in self.records}

            def stopped(record: NodeRecord) -> Outcome:
                try:
                    self._call(record, calls.StopScheduler(), timeout=120)
                except NodeCallError as exc:  # an existing Slurm's jobs not cancelled: ask again
                    return Outcome("failed", f"not stopped: {exc.line}"[:300])
                self._forget(record, "scheduler")
                return Outcome("n/a", "none")

            outcomes = self._on_every_record(stopped)
            if all(o.status != "failed" for o in outcomes.values()):
                self._write_join_kit(None)  # no replacement node joins a Slurm that is gone: the kit has none
            return outcomes
        # Always asked: `start` leaves running daemons of an unchanged configuration alone (about 0.4 s), and
        # starts what is not running (a node restarted since), which no recorded digest can know.
        description = self._scheduler_description()
        wanted = digest(description, [self.manifest.get(path) for path in SCHEDULER_CODE])

        def start(record: NodeRecord) -> Outcome:
            recipe = kit.NodeKit(record.name, self.cluster.python, scheduler=description)
            try:
                started = self._apply_kit(record, "scheduler", recipe)
            except StageFailed as exc:
                return Outcome("failed", str(exc)[-300:])
            fresh = started.get("action") == "unchanged"
            if not fresh:
                self._record(record, "scheduler", wanted, {"scheduler": "slurm"})
            daemons = "slurmctld, slurmd" if record is self.records[0] else "slurmd"
            if started.get("started"):  # what had died, or did not serve (a munged killed), or a new configuration
                daemons = f"{daemons}; started {', '.join(started['started'])}"
            if started.get("room"):  # a node Slurm drained while its disk was full
                daemons = f"{daemons}; {started['room']}"
            return Outcome("up to date" if fresh else "done", daemons)

        outcomes = {
            self.records[0].name: start(self.records[0])
        }  # the controller first: every slurmd registers with it
        if outcomes[self.records[0].name].status == "failed":
            return {
                r.name: outcomes.get(r.name, Outcome("failed", "not started: the head node's failed"))
                for r in self.records
            }
        outcomes.update(self._on_every_record(start, self.records[1:]))
        if all(o.status != "failed" for o in outcomes.values()):
            self._write_join_kit(description)
        return outcomes

    def _adopt_existing_slurm(self) -> dict[str, Outcome]:
        """Own machines that already run Slurm (`slurm: existing`): each node finds its NodeName there
        (the hosts file's `slurm_name`, else its address, else its host name), then every node records the
        names, the partition and this stack's tag (contract.SLURM_EXISTING); no daemon of ours starts."""
        existing = self.cluster.slurm_existing
        partition, conf = existing.get("partition", ""), existing.get("conf", "")

        def identify(record: NodeRecord) -> Outcome:
            node = self.cluster.node(record.name)
            addresses = list(dict.fromkeys((node.public_ip, node.private_ip)))
            try:
                found = self._call(record, calls.IdentifyNode(partition, conf, node.slurm_name, addresses), timeout=60)
            except NodeCallError as exc:
                return Outcome("failed", exc.line[-300:])
            return Outcome("done", found.name)

        outcomes = self._on_every_record(identify)
        if any(o.status == "failed" for o in outcomes.values()):
            return outcomes
        names = {name: outcome.detail for name, outcome in outcomes.items()}
        taken: dict[str, str] = {}
        for node_name, slurm_name in names.items():
            if slurm_name in taken:
                why = (
                    f"{taken[slurm_name]} and {node_name} are both Slurm node {slurm_name}: "
                    "set slurm_name: for each host in the hosts file"
                )
                return {r.name: Outcome("failed", why) for r in self.records}
            taken[slurm_name] = node_name
        text = json.dumps({**existing, "names": names})
        wanted = digest(text, [self.manifest.get(path) for path in SCHEDULER_CODE])

        def adopt(record: NodeRecord) -> Outcome:
            where = f"existing Slurm: {names[record.name]}" + (f" ({partition})" if partition else "")
            if self._up_to_date(record, "scheduler", wanted):
                return Outcome("up to date", where)
            try:
                self._call(record, calls.AdoptSlurm({**existing, "names": names}), timeout=60)
            except NodeCallError as exc:
                return Outcome("failed", exc.line[-300:])
            self._record(record, "scheduler", wanted, {"scheduler": "slurm", "existing": names[record.name]})
            return Outcome("done", where)

        return self._on_every_record(adopt)

    def _users_differ(self) -> str:
        """Why Slurm cannot run this cluster's jobs as one user (one line), or '' where every node logs in
        as the same user: a Slurm job runs as one user on every node."""
        users = {node.name: node.ssh_user or self.cluster.ssh_user for node in self.cluster.nodes}
        if len(set(users.values())) <= 1:
            return ""
        named = ", ".join(f"{user} on {name}" for name, user in users.items())
        return f"the nodes' users differ ({named}) and a Slurm job runs as one user on every node"

    def _slurm_missing(self) -> tuple[str, dict[str, Outcome]]:
        """Why Slurm cannot hold this cluster's runs (one line, '' where it can: Slurm's and munge's
        programs on every node, and no Slurm of the host's own to adopt instead), and the failed outcomes of
        the nodes that could not be asked ({} where all were)."""

        def check(record: NodeRecord) -> str:
            try:  # a node that answers no: its one line is the reason; one that does not answer raises
                self._call(record, calls.CheckScheduler(head=record is self.records[0]))
            except (UsageError, OperationError) as exc:
                return str(exc)[:300]
            return ""

        answers = on_all_nodes([r.session for r in self.records], lambda s: check(self._record_of(s)))
        if any(a.error is not None for a in answers):
            return "", {
                a.name: Outcome("failed", f"could not check for Slurm: {describe(a.error)}")
                if a.error is not None
                else Outcome("failed", "not decided: another node could not be checked")
                for a in answers
            }
        return next((a.value for a in answers if a.value), ""), {}

    def _write_join_kit(self, description: dict | None) -> None:
        """What a replacement node needs to join with nobody connected (node/join.py), in the shared folder
        (none without one), 0600 like the munge key it holds; `description` None: runs are fab's, no Slurm to
        join (the venv and the env file, which a fab-held fault-tolerant run's restarted group needs)."""
        if not self.cluster.shared_dir:
            return
        cluster_kit = {
            "python": self.cluster.python,
            "requirements": (REPO / "requirements-node.txt").read_text(),
            "env": {r.name: self.env_text(r) for r in self.records},
            "scheduler": description,
        }
        path = f"{self.cluster.shared_dir.rstrip('/')}/{contract.JOIN_KIT}"
        head = self.records[0].session
        quoted = node_paths.shell_path(path)
        # The file is made 0600 before the key goes in: SFTP writes into it and keeps its mode.
        folder = node_paths.shell_path(str(Path(path).parent))
        head.run(f"umask 077 && mkdir -p {folder} && : > {quoted}.tmp && chmod 600 {quoted}.tmp", warn=False)
        head.conn.put(io.StringIO(json.dumps(cluster_kit)), remote=f"{path}.tmp")
        head.run(f"mv {quoted}.tmp {quoted}", warn=False)

    def _scheduler_description(self) -> dict:
        """The scheduler's cluster description (node/slurm_conf.py): the nodes, the ports (above MASTER_PORT), the
        key."""
        first = self.master_port + 1
        if first + SCHEDULER_PORTS > 65535:
            raise UsageError(
                f"--master-port {self.master_port} leaves no room for Slurm's ports above it: "
                f"use at most {65535 - SCHEDULER_PORTS}"
            )
        key_path = state.stack_file(self.cluster.stack, state.MUNGE_KEY)
        if not key_path.exists():
            state.write_atomic(key_path, base64.b64encode(secrets.token_bytes(1024)).decode() + "\n")
        nodes = []
        for record, node in zip(self.records, self.cluster.nodes, strict=True):
            probe = record.facts("probe")
            nodes.append(
                {
                    "name": node.name,
                    "address": node.name if self.cluster.nodes_move else node.private_ip,
                    "cpus": int(probe.get("cpus") or 1),
                    "memory_mb": max(256, int(int(probe.get("memory_mb") or 1024) * 0.9)),
                    "gpus": node.gpus,
                }
            )
        return {
            "cluster": self.cluster.stack,
            "munge_key": key_path.read_text().strip(),
            "ports": {
                "slurmctld": first,
                "slurmd": first + 1,  # node i's: first + 1 + i, 16 nodes at most
                "srun": [first + 20, first + SCHEDULER_PORTS],
                **({"slurmdbd": first + 18} if self._head_keeps_accounting() else {}),
            },
            "nodes": nodes,
            "state_save": f"{self.cluster.shared_dir}/{contract.SCHEDULER_STATE}" if self.cluster.shared_dir else "",
        }

    def _head_keeps_accounting(self) -> bool:
        """Slurm's accounting (node/slurm_accounting.py) where the head node has slurmdbd and MariaDB: the AWS
        image installs them with Slurm, .ci/run too; elsewhere `sacct` has no history, and nothing fails.
        `--accounting none`: never (the database's first start takes 4 to 17 s)."""
        if self.accounting == "none":
            return False
        programs = " && ".join(f"command -v {name}" for name in ("slurmdbd", "mariadbd", "mariadb-install-db"))
        found = self.records[0].session.run(f"PATH=$PATH:/usr/sbin:/sbin; {programs}", warn=True)
        return found.ok
