"""A local stack's processes found without its state folder (`.cluster/<stack>` deleted while it ran), so
that `down` can still stop them all.

Nothing of the stack's files is read: its node servers are found by their command line (the node's
`node.json` path, under the stack's folder), its supervisor by its command line and its state root, and
everything the nodes started by where it works (a node's home, or below it: sessions, Slurm's daemons
and steps, jobs; a deleted folder still names them) with all below them, and by the node token every
node session carries in its environment (ranks that left for a session of their own)."""

import os
from dataclasses import dataclass
from pathlib import Path

from infra import state
from infra.providers.local.node_config import SERVER_MODULE, SUPERVISOR_MODULE, TOKEN_VARIABLE, token_entry
from node import contract, procfs


@dataclass(frozen=True)
class Orphans:
    """What still runs of a local stack."""

    servers: list[int]
    """Its node servers."""
    supervisors: list[int]
    """Its supervisor (`up --spot`)."""
    others: list[int]
    """Everything its nodes started: node sessions, Slurm's daemons and steps, jobs."""

    @property
    def count(self) -> int:
        return len(set(self.servers) | set(self.supervisors) | set(self.others))


def nodes_folder(stack: str) -> str:
    return str(state.stack_dir(stack) / "nodes") + "/"


def node_servers(stack: str) -> list[int]:
    """Live node servers started for the stack's node folders (`python -m ... nodes/node-<i>/node.json`)."""
    nodes = nodes_folder(stack)
    return [
        pid
        for pid in procfs.pids_with_argument(SERVER_MODULE)
        if any(arg.startswith(nodes) for arg in procfs.command_line(pid))
    ]


def supervisors(stack: str) -> list[int]:
    """The stack's live supervisors: `python -m SUPERVISOR_MODULE STACK` under this state root (its
    CLUSTER_STATE_DIR, or the repository's `.cluster` from the repository's folder)."""
    found = []
    root = state.state_root()
    for pid in procfs.pids_with_argument(SUPERVISOR_MODULE):
        argv = procfs.command_line(pid)
        if argv[-2:] != [SUPERVISOR_MODULE, stack]:
            continue
        environment = procfs.environment(pid) or {}
        given = str(environment.get("CLUSTER_STATE_DIR") or "")
        cwd = procfs.working_directory(pid) or ""
        theirs = Path(given if os.path.isabs(given) else os.path.join(cwd, given or ".cluster"))
        if os.path.normpath(str(theirs)) == os.path.normpath(str(root)):
            found.append(pid)
    return found


DAEMONS = (*contract.SCHEDULER_DAEMONS, "slurmstepd", "mysqld")
"""Programs the nodes start that may run with an emptied environment (Slurm's steps, in sessions of their own),
so that only their command line says they are the stack's (`mysqld`: MariaDB's older name)."""


def started_by_a_node(pid: int) -> bool:
    """A process that works in a node's folder was started there by the stack: it carries a node session's
    token, or it is one of the daemons a session starts. A shell of the user's that went into the folder is
    neither, and is no process of the stack's."""
    if TOKEN_VARIABLE in (procfs.environment(pid) or {}):
        return True
    argv = procfs.command_line(pid)
    return bool(argv) and os.path.basename(argv[0].split(":", 1)[0]) in DAEMONS


def node_processes(stack: str, servers: list[int]) -> list[int]:
    """What the stack's nodes started: what they started that works in a node's home (a folder deleted since
    included) and all below it, and whatever carries the token of one of the node sessions found so."""
    rooted = [pid for pid in procfs.pids_working_in(nodes_folder(stack)) if started_by_a_node(pid)]
    found = set(rooted) | set(procfs.descendants(rooted + servers))
    tokens = {str((procfs.environment(pid) or {}).get(TOKEN_VARIABLE) or "") for pid in found}
    for token in tokens - {""}:
        found |= set(procfs.pids_with_environment(token_entry(token)))
    return sorted(pid for pid in found - set(servers) if pid != os.getpid() and procfs.alive(pid))


def find(stack: str) -> Orphans:
    servers = node_servers(stack)
    return Orphans(servers, supervisors(stack), node_processes(stack, servers))
