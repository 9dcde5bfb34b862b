"""`fab run --requirements FILE`: the job's own packages, installed once per file on every node.

Each node gets a venv per requirements file, named by the file's digest (`~/.gpu-cluster/envs/<digest>`)
and layered over the node venv (node/job_env.py), so torch is never installed again. The
launch's first command reads each node's ready marker; nodes that have the environment get nothing,
the others install at once, in parallel, before any rank starts. A failed install stops the launch
(exit 2) naming the node, pip's error line and its log.
"""

import dataclasses
import hashlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from node import calls, contract
from remote import nodecall, protocol
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

INSTALL_TIMEOUT_S = 3600
# Options that make pip read another file. The file is sent alone (an include would be looked for beside
# it on the node, under ~/.gpu-cluster/envs/), and pip quotes a file it cannot parse in its error, which
# fab prints: `-r /etc/shadow` would show that file's first line. pip's option parser takes any unique
# prefix of a long option (`--requ`), and a short one joined to its value (`-r/etc/shadow`).
INCLUDE_OPTIONS = ("--requirement", "--constraint")
INCLUDE_SHORT = ("-r", "-c")


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
        f"the installer's output in ~/{requirements.env_dir}.log)"
    )
    started = time.monotonic()
    outcomes = on_all_nodes(missing, lambda s: _install(cluster, s, python[s.node.name], requirements, workdir_key))
    failed: dict[str, list[str]] = {}
    by: dict[str, list[str]] = {}
    for result in outcomes:
        outcome: dict = result.value if result.value is not None else {"ok": False, "error": describe(result.error)}
        if not outcome.get("ok"):
            failed.setdefault(protocol.with_stale_code_hint(str(outcome["error"])), []).append(result.name)
        elif outcome.get("installer"):
            why = outcome.get("installer_why")
            by.setdefault(f"{outcome['installer']}" + (f" ({why})" if why else ""), []).append(result.name)
    if failed:
        why = "; ".join(f"on {', '.join(nodes)}: {error}" for error, nodes in failed.items())
        raise UsageError(
            f"{requirements.path} could not be installed {why} (the installer's log on each node: "
            f"~/{requirements.env_dir}.log); no rank was started"
        )
    how = "; ".join(f"with {installer} on {', '.join(nodes)}" for installer, nodes in by.items())
    say(f"fab: requirements: installed on {names} in {time.monotonic() - started:.1f} s" + (f", {how}" if how else ""))


def _install(
    cluster: ClusterInfo, session: NodeSession, python: str, requirements: Requirements, workdir_key: str | None
) -> dict:
    """Send the file, then have the node make the environment in the synced workdir, so the file's relative
    paths are the project's."""
    session.run(f"mkdir -p {contract.shell(contract.ENVS)}", warn=False)
    session.conn.put(io.BytesIO(requirements.text), remote=f"{requirements.env_dir}.txt")
    where = f"{contract.workdir_cache(workdir_key)}/{contract.WORKDIR_FILES}" if workdir_key else ""
    request = calls.InstallRequirements(
        requirements.env_dir, f"{requirements.env_dir}.txt", f"{requirements.env_dir}.log", where
    )
    try:
        return dataclasses.asdict(nodecall.call(session, python, request, timeout=INSTALL_TIMEOUT_S))
    except (UsageError, OperationError) as exc:
        return {"ok": False, "error": str(exc).removeprefix(f"{session.node.name}: ")}


def include_problem(text: bytes, path: str) -> str | None:
    """Why a requirements file cannot be sent as it is (a line that includes another file), or None."""
    lines = text.decode("utf-8", errors="replace").splitlines()
    number, joined = 0, ""
    for index, line in enumerate(lines, start=1):
        if not joined:
            number = index
        if line.endswith("\\"):  # pip joins a line ending in a backslash with the next one
            joined += line[:-1]
            continue
        logical, joined = joined + line, ""
        option = _include_option(logical)
        if option:
            return (
                f"--requirements {path}, line {number}: {option!r} makes pip read another file, which is "
                "refused (-r, -c, --requirement, --constraint): list those packages in this file itself"
            )
    return None


def _include_option(line: str) -> str | None:
    for word in line.split():
        if word.startswith("#"):  # a comment runs to the end of the line
            return None
        name = word.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in INCLUDE_OPTIONS):
            return word
        if not name.startswith("--") and word.startswith(INCLUDE_SHORT):
            return word
    return None
