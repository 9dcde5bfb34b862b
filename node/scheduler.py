"""On a node: the cluster's Slurm scheduler (munged, slurmctld on the head node, slurmd on every node).

    python node/scheduler.py start --node NAME [--conf-json FILE]   # the description on stdin without FILE
    python node/scheduler.py stop                                   # this node's daemons, nothing left
    python node/scheduler.py lost --node NAME [--why TEXT]          # that node is gone: DOWN, runs requeued
    python node/scheduler.py rejoined --node NAME                   # a replacement: back in service
    python node/scheduler.py replaced --node NAME                   # its old machine's jobs requeued
    python node/scheduler.py state [--json]                         # daemons alive, Slurm's node state
    python node/scheduler.py env                                    # `export SLURM_CONF=...` for clients
    python node/scheduler.py check [--head]                         # Slurm's programs are here (exit 2 if not)
    python node/scheduler.py identify [--partition P] [--conf F] [--name N] [--address A]...
                                                                    # this host's node in a Slurm it already runs
    python node/scheduler.py adopt --conf-json FILE                 # runs go to that Slurm (contract.SLURM_EXISTING)

The CLI and the node calls' replies; the work is done in node/slurm_conf.py (the description and its
files), slurm_daemons.py, slurm_nodes.py (Slurm's node states) and slurm_existing.py (a host's own Slurm).

Standard library only; run as a file, it imports its siblings from the code folder.
"""

import argparse
import json
import os
import shlex
import sys

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, slurm_daemons, slurm_existing, slurm_login, slurm_nodes  # noqa: E402
from node.slurm_conf import Cluster, DaemonError, Paths, UsageError, parse_cluster  # noqa: E402


def start(cluster: Cluster, node_name: str, home: str) -> dict:
    """This node's daemons running with this description and serving (slurm_daemons.start); a slurmd the
    controller finds not responding (a munged that died took it out) restarted, so that it registers
    again; and the node back in service where gpu-cluster took it out and it is whole again: set DOWN as
    lost (it answers now), or drained for a spot notice where its slurmd just started (a replacement), or
    drained by Slurm while its disk was full and it has room again (`room` says so); what was done."""
    done = slurm_daemons.start(cluster, node_name, home)
    paths = Paths(home)
    if "slurmd" not in done.get("started", ()) and not slurm_nodes.responding(paths, done["node"]):
        again = slurm_daemons.start(cluster, node_name, home, renew=("slurmd",))
        done = {
            **again,
            "started": sorted({*done.get("started", ()), *again.get("started", ())}),
            "restarted": sorted({*done.get("restarted", ()), *again.get("restarted", ())}),
        }
    fresh = "slurmd" in done.get("started", ())
    slurm_login.write(home, client_environment(paths))
    resumed = slurm_nodes.resume_if_ours(paths, done["node"], fresh=fresh)
    return {**done, "resumed": resumed, "room": slurm_nodes.resume_if_room_back(paths, done["node"])}


def read_description(path: str | None) -> Cluster:
    try:
        if path is None:
            text = sys.stdin.read()
        else:
            with open(path) as f:
                text = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read --conf-json {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"the description is not JSON ({exc}); pass it with --conf-json FILE or on stdin") from None
    return parse_cluster(data)


SQUEUE_FORMAT = "%.10i %.9P %.32j %.8u %.2t %.10M %.6D %R"
"""squeue's default with a NAME column wide enough for a run id (the default's 8 show only its date)."""


def client_environment(paths: Paths) -> dict:
    """What `env` prints: how Slurm's clients reach the Slurm that holds this cluster's runs, and squeue
    showing whole run ids. UsageError where no Slurm holds them, rather than nothing for `eval`."""
    environment = slurm_existing.client_environment(paths)
    conf = environment.get("SLURM_CONF")
    if slurm_existing.existing(paths) is None and not (conf and os.path.exists(conf)):
        raise UsageError("Slurm does not hold this cluster's runs here (fab bootstrap chose fab's connections)")
    return {**environment, "SQUEUE_FORMAT": SQUEUE_FORMAT}


def check_reply(head: bool) -> dict:
    """node/calls.py's CheckScheduler: Slurm's programs are here, and no Slurm of the host's own runs
    (adopt that one rather than start another beside it)."""
    slurm_daemons.check(head)
    site = slurm_existing.site_conf()
    if site:
        raise UsageError(
            f"this host already runs Slurm ({site}): add slurm: existing to the hosts file to send runs to it, "
            "or fab bootstrap --scheduler slurm for one of gpu-cluster's own beside it"
        )
    return {"said": "ok"}


def adopt_reply(existing: dict) -> dict:
    """node/calls.py's AdoptSlurm. The site's logins reach its Slurm already: ours no longer set SLURM_CONF."""
    home = os.path.expanduser("~")
    adopted = slurm_existing.adopt(Paths(home), existing)
    slurm_login.remove(home)
    return adopted


def stop_reply() -> dict:
    """node/calls.py's StopScheduler: our daemons, or this stack's jobs in a Slurm the hosts already run."""
    paths = Paths(os.path.expanduser("~"))
    slurm_login.remove(paths.home)
    if slurm_existing.existing(paths) is not None:  # none of the daemons is ours: this stack's jobs go
        cancelled = slurm_existing.cancel_tagged(paths)  # a DaemonError keeps the record: ask again later
        os.unlink(paths.at(contract.SLURM_EXISTING))
        return {"said": "cancelled " + " ".join(cancelled) if cancelled else "nothing of ours in the existing Slurm"}
    stopped = slurm_daemons.stop(paths)
    return {"said": "stopped " + " ".join(stopped) if stopped else "not running"}


def state_reply(node: str | None) -> dict:
    """node/calls.py's AskScheduler: configured or not, each daemon's pid while it runs, Slurm's node states."""
    paths = Paths(os.path.expanduser("~"))
    adopted = slurm_existing.existing(paths)
    configured = adopted is not None or os.path.exists(paths.conf)
    daemons = (
        {} if adopted else {name: slurm_daemons.running_daemon(paths, name) for name in contract.SCHEDULER_DAEMONS}
    )
    reasons = slurm_nodes.node_reasons(paths) if adopted or (configured and daemons["munged"]) else {}
    nodes = {name: node_state for name, (node_state, _) in reasons.items()} or None
    return {
        "node": node,
        "configured": configured,
        "existing": adopted is not None,
        # the controller where this node runs it: running, or registered (its pid file) and gone
        "daemons": {
            name: pid
            for name, pid in daemons.items()
            if pid or name not in slurm_daemons.HEAD_ONLY or os.path.exists(paths.pid(name))
        },
        "node_state": (nodes or {}).get(slurm_existing.slurm_name(paths, node)) if node else None,
        "nodes": nodes,
    }


def lost_reply(node: str, why: str) -> dict:
    """node/calls.py's MarkLost."""
    return {"said": slurm_nodes.mark_lost(Paths(os.path.expanduser("~")), node, why)}


def replaced_reply(node: str) -> dict:
    """node/calls.py's ForgetStaleJobs."""
    return {"said": slurm_nodes.forget_stale_jobs(Paths(os.path.expanduser("~")), node)}


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start_parser = commands.add_parser("start", help="write the configuration and start this node's daemons")
    start_parser.add_argument("--conf-json", help="the cluster's description (default: stdin)")
    start_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    commands.add_parser("stop", help="stop this node's daemons (an existing Slurm: cancel this stack's jobs there)")
    replaced_parser = commands.add_parser("replaced", help="a node replaced while the head was: requeue its old jobs")
    replaced_parser.add_argument("--node", required=True, help="the replaced node")
    rejoined_parser = commands.add_parser("rejoined", help="a replacement node: back in service (node/join.py)")
    rejoined_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    lost_parser = commands.add_parser("lost", help="tell Slurm a node is gone (its run is requeued)")
    lost_parser.add_argument("--node", required=True, help="the node that is gone")
    lost_parser.add_argument("--why", default="gone", help="the reason Slurm shows")
    state_parser = commands.add_parser("state", help="this node's scheduler state")
    state_parser.add_argument("--json", action="store_true", help="one JSON object")
    state_parser.add_argument("--node", default=os.environ.get(contract.NODE_VARIABLE), help="this node's name")
    commands.add_parser("env", help="the environment Slurm's clients need (shell `export` lines)")
    check_parser = commands.add_parser("check", help="are Slurm's and munge's programs installed here")
    check_parser.add_argument("--head", action="store_true", help="this node runs the controller too")
    identify_parser = commands.add_parser("identify", help="this host's node in a Slurm it already runs")
    identify_parser.add_argument("--partition", default="", help="the partition runs go to (default: Slurm's)")
    identify_parser.add_argument("--conf", default="", help="its slurm.conf (default: Slurm's own)")
    identify_parser.add_argument("--name", default="", help="the node's NodeName, where the hosts file gives it")
    identify_parser.add_argument("--address", action="append", default=[], help="an address of this host")
    adopt_parser = commands.add_parser("adopt", help="runs go to a Slurm the hosts already run")
    adopt_parser.add_argument("--conf-json", help="{partition, conf, tag, names} (default: stdin)")
    args = parser.parse_args(argv)
    home = os.path.expanduser("~")
    try:
        if args.command == "start":
            if not args.node:
                raise UsageError(f"start needs --node NAME (or {contract.NODE_VARIABLE} in the environment)")
            result = start(read_description(args.conf_json), args.node, home)
            print(json.dumps(result))
        elif args.command == "replaced":
            print(f"{args.node}: {replaced_reply(args.node)['said']}")
        elif args.command == "rejoined":
            if not args.node:
                raise UsageError(f"rejoined needs --node NAME (or {contract.NODE_VARIABLE} in the environment)")
            print(f"{args.node}: {slurm_nodes.rejoined(Paths(home), args.node)}")
        elif args.command == "lost":
            print(f"{args.node}: {lost_reply(args.node, args.why)['said']}")
        elif args.command == "stop":
            print(stop_reply()["said"])
        elif args.command == "identify":
            print(json.dumps(slurm_existing.identify(args.partition, args.conf, args.name, args.address)))
        elif args.command == "adopt":
            text = open(args.conf_json).read() if args.conf_json else sys.stdin.read()
            try:
                data = json.loads(text)
            except ValueError:
                raise UsageError("adopt: the description is not JSON") from None
            print(json.dumps(adopt_reply(data)))
        elif args.command == "check":
            print(check_reply(args.head)["said"])
        elif args.command == "state":
            result = state_reply(args.node)
            if args.json:
                print(json.dumps(result))
            else:
                alive = " ".join(f"{name}={'up' if pid else 'down'}" for name, pid in result["daemons"].items())
                print(f"{result['node'] or '?'}: {alive} slurm={result['node_state'] or 'unknown'}")
        else:
            for key, value in client_environment(Paths(home)).items():
                print(f"export {key}={shlex.quote(value)}")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DaemonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
