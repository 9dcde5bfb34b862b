"""On a fresh node: join the cluster from the shared folder alone, with nobody connected.

    python3 join.py --node NAME [--shared DIR] [--address ADDRESS]

A replacement node (a spot instance the Auto Scaling group started in place of a reclaimed one, or
the local provider's fresh node) has an empty home. `fab bootstrap`'s scheduler stage leaves what a node
needs to join in the shared folder (`contract.JOIN_KIT`, 0600, the node user's own): the interpreter
to layer the venv over, the venv's requirements, each node's environment file, and the scheduler's
description with the cluster's munge key (null where runs are held by fab's connections, `--scheduler
none`). This script applies this node's kit (node/kit.py), the recipe bootstrap's deps, env and scheduler
stages apply: the venv (node/python_env.py), `~/.gpu-cluster/env`, then Slurm's daemons (node/scheduler.py
start), whose slurmd registers with the head node and returns the node to service; a run that waits for the
node starts again. Without Slurm the node is ready once its env file is written: a fab-held fault-tolerant
run that lost it starts its replica group there again (remote/heal.py). The code is already there: it lives
in the shared folder.

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
import sys
import time

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import calls, contract, kit, slurm_nodes  # noqa: E402
from node.slurm_conf import Paths  # noqa: E402


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
            f"no {path}: the cluster was not bootstrapped since it had a shared folder, so there is nothing to "
            "join; run fab bootstrap"
        ) from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} cannot be read ({exc}); run fab bootstrap to write it again") from None
    if not well_formed(kit):
        raise BadInput(f"{path} is not a join kit (run fab bootstrap to write it again)")
    return kit


def well_formed(kit) -> bool:
    """The kit's shape, as bootstrap writes it (node/slurm_conf.py checks the description's own fields);
    `scheduler` null: no Slurm of ours (the nodes are the env's, head node first)."""
    if not isinstance(kit, dict) or not {"python", "requirements", "env", "scheduler"} <= set(kit):
        return False
    env = kit["env"]
    if kit["scheduler"] is None:
        nodes = [{"name": name, "address": ""} for name in env] if isinstance(env, dict) else None
    else:
        nodes = kit["scheduler"].get("nodes") if isinstance(kit["scheduler"], dict) else None
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


def join(cluster_kit: dict, node: str, home: str, code: str, address: str | None) -> dict:
    started = time.monotonic()
    description = cluster_kit["scheduler"]
    names = [entry.get("name") for entry in description.get("nodes", [])] if description else list(cluster_kit["env"])
    if node not in names or node not in cluster_kit["env"]:
        raise BadInput(f"{node!r} is not a node of this cluster (its nodes: {', '.join(map(str, names))})")
    if node == names[0]:
        raise BadInput(f"{node} is the head node: it is prepared by fab bootstrap, not joined")
    if address and description:
        for entry in description["nodes"]:
            if entry["name"] == node and entry["address"] != node:  # a name given in Slurm stays the name
                entry["address"] = address
    parts = kit.PARTS if description else tuple(part for part in kit.PARTS if part != "scheduler")
    try:  # the same recipe bootstrap's deps, env and scheduler stages apply
        done = kit.apply(kit.for_node(cluster_kit, node), home, code, parts)
    except calls.BadInput as exc:
        raise BadInput(str(exc)) from None
    except Exception as exc:  # whichever part failed says so in its line
        raise JoinError(" ".join(str(exc).split()) or type(exc).__name__) from None
    in_slurm = ""  # no Slurm of ours: the env file written is the node ready
    if description:
        # Started is not back in service: where the head node was being replaced at the same time, the
        # controller could not resume this node yet. Asked again here; a failure fails the join (tried again).
        try:
            in_slurm = slurm_nodes.rejoined(Paths(home), node)
        except (calls.BadInput, calls.Failed) as exc:
            raise JoinError(f"the scheduler's controller: {exc}") from None
    venv = done["deps"]
    return {
        "node": node,
        "took_s": round(time.monotonic() - started, 1),
        "venv": {k: venv[k] for k in ("torch", "installed") if k in venv},
        "scheduler": done["scheduler"].get("action", "started") if description else "none",
        "slurm": in_slurm,
    }


def join_reply(node: str) -> dict:
    """node/calls.py's JoinCluster: from the kit in the shared folder this code lives in."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return join(
            read_kit(os.path.dirname(os.path.dirname(here))), node, os.path.expanduser("~"), os.path.dirname(here), None
        )
    except BadInput as exc:
        raise calls.BadInput(str(exc)) from None
    except JoinError as exc:
        raise calls.Failed(f"{node} did not join: {exc}") from None


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
