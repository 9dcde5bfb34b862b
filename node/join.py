"""On a fresh node: join the cluster from the shared folder alone, with nobody connected.

    python3 join.py --node NAME [--shared DIR] [--address ADDRESS]

A replacement node (a spot instance the Auto Scaling group started in place of a reclaimed one, or
the local provider's fresh node) has an empty home. `fab bootstrap`'s scheduler stage leaves what a node
needs to join in the shared folder (`contract.JOIN_KIT`, 0600, the node user's own): the interpreter
to layer the venv over, the venv's requirements, each node's environment file, and the scheduler's
description with the cluster's munge key. This script does on this node what bootstrap's deps, env and
scheduler stages would: the venv (node/python_env.py), `~/.gpu-cluster/env`, then Slurm's daemons
(node/scheduler.py start), whose slurmd registers with the head node and returns the node to service;
a run that waits for the node starts again. The code is already there: it lives in the shared folder.

`--address` replaces this node's address in the description (a replacement on AWS comes up at a new
private address; where the cluster names its nodes in Slurm, the name stays). The head node is not
joined this way (its watchdog and controller come from `fab bootstrap`): it is refused.

Prints one JSON object (`node`, `took_s`, `venv`, `scheduler`); exit 2 for bad input or no kit, 1 when
a step fails, naming the step. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract  # noqa: E402

STEP_TIMEOUT_S = 1800


class JoinError(Exception):
    """A step failed; the message names it and what the node said."""


class BadInput(Exception):
    """No kit, a damaged one, or a node that cannot join this way: exit 2."""


def read_kit(shared: str) -> dict:
    path = os.path.join(shared, contract.JOIN_KIT)
    try:
        with open(path) as f:
            kit = json.load(f)
    except FileNotFoundError:
        raise BadInput(
            f"no {path}: the cluster was not bootstrapped with --scheduler slurm, so there is nothing to join; "
            "run fab bootstrap"
        ) from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} cannot be read ({exc}); run fab bootstrap to write it again") from None
    if not well_formed(kit):
        raise BadInput(f"{path} is not a join kit (run fab bootstrap to write it again)")
    return kit


def well_formed(kit) -> bool:
    """The kit's shape, as bootstrap writes it (scheduler.py checks the description's own fields)."""
    if not isinstance(kit, dict) or not {"python", "requirements", "env", "scheduler"} <= set(kit):
        return False
    env, nodes = kit["env"], kit["scheduler"].get("nodes") if isinstance(kit["scheduler"], dict) else None
    return (
        isinstance(kit["python"], str)
        and isinstance(kit["requirements"], str)
        and isinstance(env, dict)
        and all(isinstance(text, str) for text in env.values())
        and isinstance(nodes, list)
        and bool(nodes)
        and all(
            isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("address"), str) for n in nodes
        )
    )


def write_private(path: str, text: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".join-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_step(name: str, argv: list, home: str) -> str:
    try:
        result = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JoinError(f"{name}: {exc}") from None
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise JoinError(f"{name} failed: {said[-1] if said else f'exit {result.returncode}'}")
    return result.stdout


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return {}


def join(kit: dict, node: str, home: str, code: str, address: str | None) -> dict:
    started = time.monotonic()
    description = kit["scheduler"]
    names = [entry.get("name") for entry in description.get("nodes", [])]
    if node not in names or node not in kit["env"]:
        raise BadInput(f"{node!r} is not a node of this cluster (its nodes: {', '.join(map(str, names))})")
    if node == names[0]:
        raise BadInput(f"{node} is the head node: it is prepared by fab bootstrap, not joined")
    if address:
        for entry in description["nodes"]:
            if entry["name"] == node and entry["address"] != node:  # a name given in Slurm stays the name
                entry["address"] = address
    os.makedirs(os.path.join(home, contract.PIDS), mode=0o700, exist_ok=True)
    os.chmod(os.path.join(home, contract.HOME_DIR), 0o700)

    requirements = os.path.join(home, contract.REQUIREMENTS)
    write_private(requirements, kit["requirements"])
    venv = last_json(
        run_step(
            "the venv", [kit["python"], os.path.join(code, "node", "python_env.py"), contract.VENV, requirements], home
        )
    )
    write_private(os.path.join(home, contract.ENV), kit["env"][node])

    fd, sent = tempfile.mkstemp(dir=os.path.join(home, contract.HOME_DIR), prefix="scheduler-description-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(description, f)
        scheduler = last_json(
            run_step(
                "the scheduler",
                [
                    kit["python"],
                    os.path.join(code, "node", "scheduler.py"),
                    "start",
                    "--node",
                    node,
                    "--conf-json",
                    sent,
                ],
                home,
            )
        )
    finally:
        os.unlink(sent)
    # Started is not back in service: where the head node was being replaced at the same time, the controller
    # could not resume this node yet. Asked again here, and a failure fails the join (it is tried again).
    in_slurm = run_step(
        "the scheduler's controller",
        [kit["python"], os.path.join(code, "node", "scheduler.py"), "rejoined", "--node", node],
        home,
    ).strip()
    return {
        "node": node,
        "took_s": round(time.monotonic() - started, 1),
        "venv": {k: venv[k] for k in ("torch", "installed") if k in venv},
        "scheduler": scheduler.get("action", "started"),
        "slurm": in_slurm.rpartition(": ")[2],
    }


def main(argv: list | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", required=True, help="this node's name (node-<i>)")
    parser.add_argument(
        "--shared",
        default=os.path.dirname(os.path.dirname(here)),
        help="the shared folder (default: the one this script is in, code/node/join.py)",
    )
    parser.add_argument("--address", help="this node's address now, where it differs from the one bootstrap saw")
    args = parser.parse_args(argv)
    try:
        kit = read_kit(args.shared)
        result = join(kit, args.node, os.path.expanduser("~"), os.path.dirname(here), args.address)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JoinError as exc:
        print(f"error: {args.node} did not join: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
