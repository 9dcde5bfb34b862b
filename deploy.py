#!/usr/bin/env python3
"""gpu-cluster: bring a multi-node GPU training cluster up, see it, price it, and take it down.

    python deploy.py up --local --nodes 2      # on this machine, no cloud account needed
    python deploy.py up                        # on AWS, from Pulumi.<stack>.yaml (default stack: dev)
    python deploy.py status | plan | cost | ssh [NODE] | down

Exit codes: 0 success; 1 a step failed; 2 bad input or a missing prerequisite (nothing was created).
"""

import argparse
import os
import shutil
import sys
import time

from infra import config, costs, inventory, report, state
from infra.errors import ClusterError, UsageError
from infra.local import provider as local

DEFAULT_AWS_STACK = "dev"


class Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line and exit 2, like every other refusal here."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python deploy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    stack_help = "stack name (default: $CLUSTER_STACK, else the last `up`)"

    up = commands.add_parser("up", help="create the cluster (or say it is already up)")
    up.add_argument("--local", action="store_true", help="run the nodes on this machine (stack 'local')")
    up.add_argument("--stack", help="stack name (default: 'local' with --local, else $CLUSTER_STACK or 'dev')")
    up.add_argument("--nodes", type=str, default=None, help="number of nodes, 1..16 (default: the stack's, or 2)")
    up.add_argument("--instance-type", help="EC2 instance type, e.g. g4dn.2xlarge or g6.2xlarge (local: priced as)")
    up.add_argument("--spot", action="store_true", default=None, help="AWS: spot instances instead of on-demand")
    up.add_argument("--yes", action="store_true", help="AWS: do not ask to confirm the hourly cost")
    up.add_argument("--ssh-cidr", help="AWS: who may SSH in (default: your public IP /32)")
    up.add_argument("--max-total-usd", help="guard: power the cluster off before it has cost this much")
    up.add_argument("--idle-minutes", help="guard: power the cluster off after this long with no job and idle GPUs")
    up.add_argument("--ssh-port", type=int, help=f"local: SSH port (default {local.DEFAULT_SSH_PORT})")
    up.add_argument("--bind", help="local: node-0's loopback address (default 127.0.0.10; node i gets +i)")

    down = commands.add_parser("down", help="remove everything the stack created, and prove it")
    down.add_argument("--stack", help=stack_help)

    status = commands.add_parser("status", help="nodes, reachability (a real SSH round trip), uptime, cost")
    status.add_argument("--stack", help=stack_help)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    plan = commands.add_parser("plan", help="offline: the resources `up` would create and their cost")
    plan.add_argument("--stack", help="stack name (default: $CLUSTER_STACK, else 'dev')")
    plan.add_argument("--json", action="store_true", help='machine-readable: {"hourly_usd", "resources"}')

    cost = commands.add_parser("cost", help="what each cluster and run has cost, from the ledger")
    cost.add_argument("--stack", help="only this stack (default: all)")
    cost.add_argument("--json", action="store_true", help='machine-readable: {"clusters", "runs", "total_usd"}')

    ssh = commands.add_parser("ssh", help="interactive ssh into a node (default node-0), or run COMMAND there",
                              usage="python deploy.py ssh [NODE] [--stack NAME] [-- COMMAND...]")
    ssh.add_argument("node", nargs="?", default="node-0", help="node name, e.g. node-1")
    ssh.add_argument("--stack", help=stack_help)
    ssh.add_argument("words", nargs="*", metavar="COMMAND", help="after --: run this instead of a shell "
                     "(everything after the first -- goes to the node untouched)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options before the first `--` are deploy.py's; after it, for `ssh`, the node's command, untouched
    (`ssh node-0 --stack local -- ls --stack x` runs `ls --stack x` on node-0 of stack local)."""
    parser = build_parser()
    head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(head)
    if args.command == "ssh":
        args.remote_command = [*args.words, *tail]
    elif "--" in argv:
        parser.error(f"unrecognized arguments after --: {' '.join(tail) or '(nothing)'}")
    return args


# ------------------------------------------------------------------------------------------- up


def cmd_up(args) -> int:
    if args.local:
        return up_local(args, state.check_stack_name(state.LOCAL_STACK if args.stack is None else args.stack))
    stack = state.resolve_stack(args.stack, default=DEFAULT_AWS_STACK)
    if stack == state.LOCAL_STACK:
        return up_local(args, stack)
    return up_aws(args, stack)


def up_aws(args, stack: str) -> int:
    from infra import aws_provider

    if not config.stack_file(stack).exists():
        report.console.print(f"note: no Pulumi.{stack}.yaml: using the defaults (2 x {config.DEFAULT_INSTANCE_TYPE} "
                             f"in {config.DEFAULT_REGION}) and your flags")
    overrides = _overrides(args)
    started = time.perf_counter()
    request = aws_provider.UpRequest(stack, overrides, args.yes)
    cluster, created = aws_provider.up(request, say=report.console.print)
    if created:
        costs.save_guards(stack, config.load_stack(stack, overrides))
        costs.record_up(cluster, None, say=report.console.print)
    report.up_summary(cluster, created, time.perf_counter() - started, inventory.inventory_path(stack))
    return 0


def _overrides(args) -> dict:
    return {"nodes": args.nodes, "instanceType": args.instance_type, "spot": args.spot, "sshCidr": args.ssh_cidr,
            "maxTotalUsd": args.max_total_usd, "idleMinutes": args.idle_minutes}


def up_local(args, stack: str) -> int:
    stack_config = config.load_stack(stack, {**_overrides(args), "sshCidr": None, "spot": None})
    asked = {name for name, value in (("nodes", args.nodes), ("instance_type", args.instance_type),
                                      ("first_address", args.bind), ("ssh_port", args.ssh_port)) if value is not None}
    ssh_port = local.DEFAULT_SSH_PORT if args.ssh_port is None else args.ssh_port
    options = local.LocalOptions(stack, stack_config.nodes, stack_config.instance_type, args.bind, ssh_port,
                                 asked=frozenset(asked))
    started = time.perf_counter()
    cluster, created = local.up(options)
    if created:
        costs.save_guards(stack, stack_config)
        reference = costs.reference_hourly_usd(stack_config.instance_type, stack_config.region, stack_config.nodes)
        costs.record_up(cluster, reference, say=report.console.print)
    report.up_summary(cluster, created, time.perf_counter() - started, inventory.inventory_path(stack))
    return 0


# ----------------------------------------------------------------------------------------- down


def cmd_down(args) -> int:
    stack = state.resolve_stack(args.stack)
    if stack is None:
        stack = _interrupted_local_stack()
    if stack is None:
        report.console.print("nothing to do: no stack is current (pass --stack NAME)")
        return 0
    if _provider_of(stack) == "local":
        return down_local(stack)
    return down_aws(stack)


def down_aws(stack: str) -> int:
    from infra import aws_provider, teardown

    report.console.print(f"destroying stack '{stack}' (instances, EFS and the data on it, network) ...")
    leftovers = aws_provider.down(stack, say=report.console.print)
    costs.record_down(stack, say=report.console.print)
    for line in teardown.report_lines(leftovers):
        report.console.print(line)
    if leftovers:
        report.console.print(f"run python deploy.py down --stack {stack} again, or delete these by hand")
        return 1
    runs = state.runs_dir(stack)
    if runs.exists():
        report.console.print(f"run logs kept in {report.relative(runs)}")
    return 0


def _interrupted_local_stack() -> str | None:
    """With no stack current, the one local stack an interrupted `up` left node folders for (several: exit 2)."""
    leftovers = local.stacks_without_inventory()
    if len(leftovers) > 1:
        raise UsageError(f"no stack is current, and local stacks {', '.join(leftovers)} were left by interrupted "
                         "ups: run python deploy.py down --stack NAME for each")
    if leftovers:
        report.console.print(f"no stack is current; taking down local stack '{leftovers[0]}', "
                             "left by an interrupted up")
    return leftovers[0] if leftovers else None


def down_local(stack: str) -> int:
    stopped_itself = local.stop_record(stack)
    shared = local.shared_contents(stack)
    if shared.files:
        report.console.print(f"removing {report.relative(shared.path)}: {report.plural(shared.files, 'file')}, "
                             f"{shared.describe_size()} (datasets, checkpoints, anything jobs wrote there)")
    started = time.perf_counter()
    result = local.down(stack)
    elapsed = time.perf_counter() - started
    if stopped_itself:
        costs.record_self_stop(stack, stopped_itself.get("reason", "stopped"), stopped_itself.get("at"), report.console.print)
    costs.record_down(stack, say=report.console.print)
    if result.listening:
        report.console.print(f"still listening after down: {', '.join(result.listening)}")
        return 1
    if not result.was_up:
        report.console.print(f"nothing to do: stack '{stack}' is not up")
    elif stopped_itself:
        report.console.print(f"stack '{stack}' had stopped itself ({stopped_itself.get('reason', 'stopped')}); state removed")
    elif result.stopped == 0:
        report.console.print(f"stack '{stack}': no node was running; state removed, run logs kept")
    else:
        report.console.print(
            f"stack '{stack}' is down: {report.plural(result.stopped, 'node')} stopped in {elapsed:.1f} s, "
            "no port left listening"
        )
    runs = state.runs_dir(stack)
    if runs.exists():
        report.console.print(f"run logs kept in {report.relative(runs)}")
    return 0


def _provider_of(stack: str) -> str:
    """The stack's provider: its inventory says; a local stack's node folders say even without one."""
    try:
        return inventory.load(stack).provider
    except UsageError:
        pass
    if stack == state.LOCAL_STACK or (state.stack_dir(stack) / "nodes").exists():
        return "local"
    return "aws"


# --------------------------------------------------------------------------------------- status


def cmd_status(args) -> int:
    try:
        cluster = inventory.load_current(args.stack)
    except UsageError:
        leftovers = [] if state.resolve_stack(args.stack) else local.stacks_without_inventory()
        if leftovers:
            raise UsageError(f"no cluster, but local stack '{leftovers[0]}' has node folders left by an interrupted "
                             f"up: run python deploy.py down --stack {leftovers[0]}") from None
        raise
    if cluster.provider == "aws":
        from infra import aws_provider, preflight

        rows, stopped = aws_provider.status(cluster, preflight.AwsClients.for_region(cluster.region).ec2)
    else:
        rows, stopped = _local_status(cluster)
    if stopped:
        costs.record_self_stop(cluster.stack, stopped.get("reason", "stopped"), stopped.get("at"), report.console.print)
    spent = costs.cost_so_far(cluster.stack, say=report.console.print)
    reason = stopped.get("reason", "") if stopped else ""
    if args.json:
        report.print_json({"stack": cluster.stack, "provider": cluster.provider, "stopped_reason": reason,
                           "cost_so_far_usd": spent, "nodes": rows})
    else:
        report.status_table(cluster, rows, reason, spent)
    return 0 if all(r["reachable"] for r in rows) else 1


def _local_status(cluster) -> tuple[list[dict], str]:
    rows = [
        {
            "name": s.node.name,
            "address": f"{s.node.public_ip}:{s.node.ssh_port}",
            "state": "up" if s.reachable else "down",
            "reachable": s.reachable,
            "round_trip_ms": round(s.round_trip_ms, 1),
            "uptime_s": None if s.uptime_s is None else round(s.uptime_s),
            "error": s.error,
        }
        for s in local.status(cluster)
    ]
    return rows, local.stop_record(cluster.stack)


# ------------------------------------------------------------------------------------ plan, cost


def cmd_plan(args) -> int:
    """The real Pulumi program under Pulumi's mocks: no credentials, no CLI, nothing created."""
    from infra import plan

    stack = state.resolve_stack(args.stack, default=DEFAULT_AWS_STACK)
    if stack == state.LOCAL_STACK:
        raise UsageError("plan is for AWS stacks (e.g. --stack dev); the local provider creates no cloud resources")
    stack_config = config.load_stack(stack)
    run = plan.run_program(plan.plan_config(stack_config))
    estimate, price_note = plan.estimate(stack_config)
    resources = [{"type": r.type, "name": r.name, "settings": plan.describe(r)}
                 for r in sorted(run.resources, key=plan.display_order) if not r.type.startswith("gpu-cluster:")]
    if args.json:
        prices = estimate.as_dict() if estimate else {"hourly_usd": None, "price_note": price_note}
        report.print_json({**prices, "stack": stack, "resources": resources})
        return 0
    report.plan_table(stack, stack_config, resources, estimate, price_note)
    return 0


def cmd_cost(args) -> int:
    """Per cluster and per run, from the ledger; local clusters also show what AWS would have charged."""
    stack = None if args.stack is None else state.check_stack_name(args.stack)
    for name in local.stacks_that_stopped_themselves():
        record = local.stop_record(name)
        costs.record_self_stop(name, record.get("reason", "stopped"), record.get("at"), report.console.print)
    data = costs.report(stack, say=report.console.print)
    if args.json:
        report.print_json(data)
    else:
        report.cost_tables(data)
    return 0


# ------------------------------------------------------------------------------------------ ssh


def ssh_argv(cluster: inventory.ClusterInfo, node_name: str, remote_command: list[str]) -> list[str]:
    """The stock OpenSSH command line for a node: cluster key only, pinned host keys only."""
    node = cluster.node(node_name)
    argv = [
        "ssh",
        "-i", cluster.ssh_key,
        "-p", str(node.ssh_port),
        "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={cluster.known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "LogLevel=ERROR",
        f"{cluster.ssh_user}@{node.public_ip}",
    ]  # fmt: skip
    if remote_command:
        argv += ["--", *remote_command]
    return argv


def cmd_ssh(args) -> int:
    cluster = inventory.load_current(args.stack)
    argv = ssh_argv(cluster, args.node, args.remote_command)
    if shutil.which("ssh") is None:
        raise UsageError("no ssh client on PATH: install OpenSSH (e.g. apt install openssh-client)")
    sys.stdout.flush()
    os.execvp(argv[0], argv)


COMMANDS = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "plan": cmd_plan, "cost": cmd_cost, "ssh": cmd_ssh}


def main(argv: list[str] | None = None) -> int:
    state.keep_private()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        return COMMANDS[args.command](args)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
