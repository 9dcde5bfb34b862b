"""`fab run --requirements FILE`: the job's own packages, installed once per file on every node.

Each node gets a venv per requirements file, named by the file's digest (`~/.gpu-cluster/envs/<digest>`)
and layered over the node venv (node/job_env.py), so torch is never installed again. The
launch's first command reads each node's ready marker; nodes that have the environment get nothing,
the others install at once, in parallel, before any rank starts. A failed install stops the launch
(exit 2) naming the node, pip's error line and its log.
"""

import hashlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

from infra.errors import UsageError
from infra.inventory import ClusterInfo
from node import contract
from remote import node_paths, protocol
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

INSTALL_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Requirements:
    """A requirements file as read on this machine."""

    path: Path
    """Where it is here (named in messages)."""
    text: bytes
    """Its content, as sent."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text).hexdigest()[:16]

    @property
    def env_dir(self) -> str:
        """The environment on every node (relative to the home)."""
        return contract.job_env(self.digest)

    @property
    def python(self) -> str:
        """The environment's interpreter, as the launch command names it."""
        return f"$HOME/{self.env_dir}/bin/python"


def ensure(
    cluster: ClusterInfo,
    sessions: list[NodeSession],
    python: dict[str, str],
    requirements: Requirements,
    ready_over: dict[str, str | None],
    workdir_key: str | None,
) -> None:
    """Install `requirements` where a node's environment is not ready (made over its interpreter)."""
    missing = [s for s in sessions if ready_over.get(s.node.name) != python[s.node.name]]
    if not missing:
        say(
            f"fab: requirements: {requirements.path.name} already installed on {len(sessions)} nodes, nothing to "
            f"install (~/{requirements.env_dir})"
        )
        return
    names = ", ".join(s.node.name for s in missing)
    say(
        f"fab: requirements: installing {requirements.path.name} on {names} (~/{requirements.env_dir}; "
        f"pip's output in ~/{requirements.env_dir}.log)"
    )
    started = time.monotonic()
    outcomes = on_all_nodes(missing, lambda s: _install(cluster, s, python[s.node.name], requirements, workdir_key))
    failed: dict[str, list[str]] = {}
    for result in outcomes:
        outcome: dict = result.value if result.value is not None else {"ok": False, "error": describe(result.error)}
        if not outcome.get("ok"):
            failed.setdefault(protocol.with_stale_code_hint(str(outcome["error"])), []).append(result.name)
    if failed:
        why = "; ".join(f"on {', '.join(nodes)}: {error}" for error, nodes in failed.items())
        raise UsageError(
            f"{requirements.path} could not be installed {why} (pip's log on each node: "
            f"~/{requirements.env_dir}.log); no rank was started"
        )
    say(f"fab: requirements: installed on {names} in {time.monotonic() - started:.1f} s")


def _install(
    cluster: ClusterInfo, session: NodeSession, python: str, requirements: Requirements, workdir_key: str | None
) -> dict:
    """Send the file, then run job_env.py in the synced workdir, so the file's relative paths are the project's."""
    session.run(f"mkdir -p {contract.shell(contract.ENVS)}", warn=False)
    session.conn.put(io.BytesIO(requirements.text), remote=f"{requirements.env_dir}.txt")
    where = [f"{contract.workdir_cache(workdir_key)}/{contract.WORKDIR_FILES}"] if workdir_key else []
    command = node_paths.node_module(
        cluster,
        python,
        "job_env",
        requirements.env_dir,
        f"{requirements.env_dir}.txt",
        f"{requirements.env_dir}.log",
        *where,
    )
    result = session.run(f"cd && {command}", timeout=INSTALL_TIMEOUT_S)
    try:
        return protocol.parse_last_json(result.stdout)
    except ValueError:
        lines = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exited}").splitlines()
        return {"ok": False, "error": lines[-1]}
