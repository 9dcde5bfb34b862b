"""One node's recipe: what a node needs (a `NodeKit`) and the one module that applies it, for bootstrap's
deps, env and scheduler stages (the ApplyKit node call, one part at a time) and for a replacement that
joins alone (node/join.py: every part, from the cluster's kit on the shared folder).

The parts, in order: `deps` (the node venv layered over `python`, node/python_env.py, topped up from
`requirements` only where something is missing), `env` (`~/.gpu-cluster/env`, the node environment every
job sources, MASTER_PORT in it), `scheduler` (Slurm's daemons for this node from the cluster's
description, which holds the munge key and the scheduler's ports: node/scheduler.py `start`). A kit
file holds the munge key: it is 0600 and removed once read.

Standard library only.
"""

import dataclasses
import json
import os
import subprocess
import typing

from node import calls, contract, scheduler, slurm_conf, warm_ask

PARTS = ("deps", "env", "scheduler")
STEP_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class NodeKit:
    """What one node needs, whoever prepares it."""

    node: str
    """The node's name (`node-<i>`)."""
    python: str
    """The interpreter the node venv is layered over."""
    requirements: str = ""
    """requirements-node.txt: installed into the venv only where something is missing."""
    env: str = ""
    """The node's environment file (`~/.gpu-cluster/env`)."""
    scheduler: dict | None = None
    """The scheduler's cluster description (node/slurm_conf.py: nodes, ports, munge key); None: no Slurm of ours."""


def for_node(cluster_kit: dict, node: str) -> NodeKit:
    """This node's kit from the cluster's (`contract.JOIN_KIT`: python, requirements, each node's env,
    the scheduler's description)."""
    return NodeKit(
        node, cluster_kit["python"], cluster_kit["requirements"], cluster_kit["env"][node], cluster_kit["scheduler"]
    )


def write_private(path: str, text: str) -> None:
    """`text` at `path` (0600), whole or not at all."""
    partial = f"{path}.tmp"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(partial, 0o600)
    os.replace(partial, path)


def deps(kit: NodeKit, home: str, code: str) -> dict:
    """The node venv over `kit.python` (in a process of that interpreter: the venv layers over it); its facts."""
    requirements = os.path.join(home, contract.REQUIREMENTS)
    write_private(requirements, kit.requirements)
    argv = [kit.python, os.path.join(code, "node", "python_env.py"), contract.VENV, requirements]
    try:
        result = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise calls.Failed(f"the venv over {kit.python} could not be made: {exc}") from None
    said = [line for line in (result.stderr.strip() or result.stdout.strip()).splitlines() if line.strip()]
    if result.returncode != 0:
        raise calls.Failed(f"the venv over {kit.python} could not be made: {said[-1] if said else result.returncode}")
    for line in reversed(result.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise calls.Failed(f"the venv over {kit.python} said nothing of itself")


def env(kit: NodeKit, home: str) -> dict:
    """The node environment every job sources."""
    os.makedirs(os.path.join(home, contract.PIDS), mode=0o700, exist_ok=True)
    os.chmod(os.path.join(home, contract.HOME_DIR), 0o700)
    write_private(os.path.join(home, contract.ENV), kit.env)
    return {"written": contract.ENV, "warm_launcher": warm_launcher(home)}


def warm_launcher(home: str) -> str:
    """The warm launcher (node/warm.py) restarted with the environment just written, where it asks for one."""
    code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return warm_ask.restart_for_the_node(home, code, os.path.join(home, contract.ENV))
    except (OSError, ValueError, warm_ask.Cold) as exc:  # jobs start their ranks cold, as without it
        return f"not started: {exc}"


def slurm(kit: NodeKit, home: str) -> dict:
    """Slurm's daemons for this node, from the kit's description (running ones of the same one stay)."""
    if kit.scheduler is None:
        raise calls.BadInput("the kit has no scheduler description")
    return scheduler.start(slurm_conf.parse_cluster(kit.scheduler), kit.node, home)


def apply(kit: NodeKit, home: str, code: str, parts: typing.Sequence[str] = PARTS) -> dict:
    """The kit's `parts`, in order; each part's facts."""
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise calls.BadInput(f"no part {unknown[0]!r} in a node's kit (parts: {', '.join(PARTS)})")
    os.makedirs(os.path.join(home, contract.HOME_DIR), mode=0o700, exist_ok=True)
    done = {}
    for part in parts:
        try:
            if part == "deps":
                done[part] = deps(kit, home, code)
            elif part == "env":
                done[part] = env(kit, home)
            else:
                done[part] = slurm(kit, home)
        except calls.BadInput:
            raise
        except Exception as exc:  # the part that failed is named: `scheduler: slurmd did not start ...`
            raise calls.Failed(f"{part}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    return done


def apply_file(kit_file: str, parts: list) -> dict:
    """node/calls.py's ApplyKit: the kit fab sent (0600, removed once read), its `parts` applied here."""
    path = os.path.expanduser(kit_file)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise calls.BadInput(f"the kit {kit_file} cannot be read: {exc}") from None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        kit = NodeKit(**data)
    except TypeError as exc:
        raise calls.BadInput(f"the kit does not fit: {exc}") from None
    home = os.path.expanduser("~")
    code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"facts": apply(kit, home, code, parts)}
