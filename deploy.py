#!/usr/bin/env python3
"""gpu-cluster: bring a multi-node GPU training cluster up, see it, price it, and take it down.

    python deploy.py up --local --nodes 2      # on this machine, no cloud account needed
    python deploy.py up --hosts hosts.yaml     # on your own machines, over SSH (stack: hosts)
    python deploy.py up                        # on AWS, from Pulumi.<stack>.yaml (default stack: dev)
    python deploy.py status | plan | cost | ssh [NODE] | ssh-config | down
    python deploy.py image create | list | delete AMI_ID   # AWS: a baked AMI; up --image AMI_ID boots it

Exit codes: 0 success; 1 a step failed; 2 bad input or a missing prerequisite (nothing was created).
"""

import signal
import sys


def _interrupted_while_loading(signum, frame):
    """Ctrl-C while the imports below load (seconds on a busy machine): nothing has run yet."""
    print("interrupted", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":  # main() answers Ctrl-C itself; before it, Python would print a traceback
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

from infra import config, costs, inventory, providers, report, state  # noqa: E402
from infra.errors import ClusterError, UsageError, shown  # noqa: E402
from infra.providers.local import provider as local  # noqa: E402
from infra.ssh import openssh_config, openssh_options  # noqa: E402


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
    up.add_argument("--hosts", metavar="FILE", help="your own machines, from a YAML hosts file (stack 'hosts')")
    up.add_argument(
        "--stack", help="stack name (default: 'local' with --local, 'hosts' with --hosts, else $CLUSTER_STACK or 'dev')"
    )
    up.add_argument("--nodes", type=str, default=None, help="number of nodes, 1..16 (default: the stack's, or 2)")
    up.add_argument("--instance-type", help="EC2 instance type, e.g. g4dn.2xlarge or g6.2xlarge (local: priced as)")
    up.add_argument(
        "--spot",
        action="store_true",
        default=None,
        help="spot instances instead of on-demand (local: a reclaimed or dead node is replaced and rejoins)",
    )
    up.add_argument("--yes", action="store_true", help="AWS: do not ask to confirm the hourly cost")
    up.add_argument(
        "--image", metavar="AMI_ID", help="AWS: boot the nodes from this AMI (e.g. from `image create`), not the DLAMI"
    )
    up.add_argument("--ssh-cidr", help="AWS: who may SSH in (default: your public IP /32)")
    up.add_argument("--max-total-usd", help="guard: power the cluster off before it has cost this much")
    up.add_argument("--idle-minutes", help="guard: power the cluster off after this long with no job and idle GPUs")
    low, high = local.SSH_PORT_RANGE
    up.add_argument(
        "--ssh-port",
        type=_whole_number,
        default=None,
        help=f"local: SSH port, {low}..{high} (default {local.DEFAULT_SSH_PORT})",
    )
    up.add_argument(
        "--bind", help="local: node-0's loopback address (default 127.0.0.10; node i gets +i, all in its /24)"
    )
    up.add_argument(
        "--gpus",
        type=_whole_number,
        default=None,
        help=f"local: fake GPUs per node in Slurm, 0..{local.MAX_FAKE_GPUS} (a device file each; torch on the CPU)",
    )

    down = commands.add_parser("down", help="remove everything the stack created, and prove it")
    down.add_argument("--stack", help=stack_help)

    status = commands.add_parser("status", help="nodes, reachability (a real SSH round trip), uptime, cost")
    status.add_argument("--stack", help=stack_help)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    plan = commands.add_parser("plan", help="offline: the resources `up` would create and their cost")
    plan.add_argument("--stack", help="stack name (default: $CLUSTER_STACK, else 'dev')")
    plan.add_argument("--json", action="store_true", help='machine-readable: {"hourly_usd", "resources"}')

    cost = commands.add_parser("cost", help="what each cluster and run has cost, from the ledger")
    cost.add_argument("--stack", help="only this stack (default: all; with --reconcile: the current stack)")
    cost.add_argument("--json", action="store_true", help='machine-readable: {"clusters", "runs", "total_usd"}')
    cost.add_argument(
        "--reconcile",
        action="store_true",
        help="AWS: the ledger beside Cost Explorer's bill for the stack, by usage type and day ($0.01 a request)",
    )
    cost.add_argument("--days", type=_whole_number, metavar="N", help="with --reconcile: the last N days (14)")
    cost.add_argument(
        "--bill", metavar="FILE", help="reconcile with a Data Exports (CUR 2.0) CSV instead of Cost Explorer"
    )

    ssh = commands.add_parser(
        "ssh",
        help="interactive ssh into a node (default node-0), or run COMMAND there",
        usage="python deploy.py ssh [NODE] [--stack NAME] [-- COMMAND...]",
    )
    ssh.add_argument("node", nargs="?", default="node-0", help="node name, e.g. node-1")
    ssh.add_argument("--stack", help=stack_help)
    ssh.add_argument(
        "words",
        nargs="*",
        metavar="COMMAND",
        help="after --: run this instead of a shell (everything after the first -- goes to the node untouched)",
    )
    ssh_config = commands.add_parser(
        "ssh-config",
        help="print an OpenSSH config block per node: ssh -F FILE node-1, scp, rsync -e, editors' remote modes",
    )
    ssh_config.add_argument("--stack", help=stack_help)

    drill = commands.add_parser(
        "drill", help="rehearse a failure: `drill spot NODE` posts a spot notice, then reclaims"
    )
    drill.add_argument("failure", choices=["spot"], help="spot: a spot interruption notice, then the node reclaimed")
    drill.add_argument("node", help="node name, e.g. node-1")
    drill.add_argument(
        "--notice", type=_seconds, default=120.0, metavar="S", help="seconds from notice to reclaim (120)"
    )
    drill.add_argument("--fis-role", metavar="ARN", help="AWS: the IAM role AWS FIS assumes to interrupt the instance")
    drill.add_argument(
        "--yes", action="store_true", help="drill a cluster started without --spot, whose node nothing replaces"
    )
    drill.add_argument("--stack", help=stack_help)
    _image_parser(commands, stack_help)
    dashboard = commands.add_parser(
        "dashboard", help="a local web page (127.0.0.1 only, a token in its URL): stacks, runs, logs, plots, cost"
    )
    dashboard.add_argument(
        "--port", type=_port, default=8787, metavar="P", help="the port on 127.0.0.1 (default 8787; 0: any free one)"
    )
    dashboard.add_argument("--stack", help="only this stack (default: every stack with an inventory here)")
    return parser


def _image_parser(commands, stack_help: str) -> None:
    image = commands.add_parser(
        "image", help="AWS: bake an AMI from a bootstrapped node (`up --image` boots from it), list, delete"
    )
    actions = image.add_subparsers(dest="image_command", metavar="ACTION", required=True, parser_class=Parser)
    create = actions.add_parser("create", help="CreateImage of a node's instance; prints the AMI id and its cost")
    create.add_argument("--stack", help=stack_help)
    create.add_argument("--node", default="node-0", help="the node to image (default node-0)")
    create.add_argument("--name", help="the image's name (default gpu-cluster-STACK-NODE-TIME)")
    create.add_argument(
        "--reboot", action="store_true", help="let EC2 reboot the instance first (a consistent file system)"
    )
    listing = actions.add_parser("list", help="this project's images: id, name, stack, created, size, state")
    listing.add_argument("--stack", help="only this stack's images (default: all, in the current stack's region)")
    listing.add_argument("--region", help="the region to list (default: the stack's, else us-east-1)")
    listing.add_argument("--json", action="store_true", help="machine-readable: a list of images")
    delete = actions.add_parser("delete", help="deregister one of our images and delete its snapshots")
    delete.add_argument("image_id", metavar="AMI_ID", help="the image, e.g. ami-0123456789abcdef0")
    delete.add_argument("--stack", help="a stack whose region to use (default: the current stack's)")
    delete.add_argument("--region", help="the image's region (default: the stack's, else us-east-1)")


def _whole_number(text: str) -> int:
    """int() as typed: ' 80' or '8_0' are refused, not trimmed, and 5,000 digits are no number."""
    if not config.WHOLE_NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a whole number, not {shown(text)}")
    return int(text)


def _seconds(text: str) -> float:
    """float() as typed: ' 5', '5\\n', 'nan', 'inf', '1e3' and '1_0' are refused, not read."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {shown(text)}")
    return float(text)


def _port(text: str) -> int:
    port = _whole_number(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0..65535, not {text}")
    return port


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options before the first `--` are deploy.py's; after it, for `ssh`, the node's command, untouched
    (`ssh node-0 --stack local -- ls --stack x` runs `ls --stack x` on node-0 of stack local)."""
    parser = build_parser()
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(head)
    if args.command == "ssh":
        args.remote_command = [*args.words, *tail]
    elif "--" in argv:
        parser.error(f"unrecognized arguments after --: {' '.join(tail) or '(nothing)'}")
    return args


# ------------------------------------------------------------------------------------------- up


def cmd_up(args) -> int:
    chosen, stack = providers.for_up(args.local, args.hosts, args.stack)
    request = providers.UpRequest(stack, _overrides(args), args.yes, args.bind, args.ssh_port, args.hosts, args.gpus)
    started = time.perf_counter()
    result = providers.bring_up(chosen, request, say=report.console.print)
    report.up_summary(result.cluster, result.created, time.perf_counter() - started, inventory.inventory_path(stack))
    if result.created:
        image = f" (nodes from image {result.cluster.image})" if result.cluster.image else ""
        report.console.print(f"up: {request.timeline.line()}{image}")
    return 0


def _overrides(args) -> dict:
    return {
        "nodes": args.nodes,
        "instanceType": args.instance_type,
        "spot": args.spot,
        "sshCidr": args.ssh_cidr,
        "maxTotalUsd": args.max_total_usd,
        "idleMinutes": args.idle_minutes,
        "amiId": args.image,
    }


# ----------------------------------------------------------------------------------------- down


def cmd_down(args) -> int:
    stack = state.resolve_stack(args.stack)
    if stack is None:
        stack = _interrupted_local_stack()
    if stack is None:
        report.console.print("nothing to do: no stack is current (pass --stack NAME)")
        return 0
    return providers.bring_down(providers.for_stack(stack), stack, say=report.console.print)


def _interrupted_local_stack() -> str | None:
    """With no stack current, the one stack an interrupted `up` left behind (several: exit 2)."""
    leftovers = providers.interrupted_stacks()
    if len(leftovers) > 1:
        raise UsageError(
            f"no stack is current, and stacks {', '.join(leftovers)} were left by interrupted "
            "ups: run python deploy.py down --stack NAME for each"
        )
    if leftovers:
        report.console.print(f"no stack is current; taking down stack '{leftovers[0]}', left by an interrupted up")
    return leftovers[0] if leftovers else None


# --------------------------------------------------------------------------------------- status


def say_on_stderr(line: str) -> None:
    """What a command says beside its output (a replaced node adopted): never into `--json` or ssh-config."""
    print(line, file=sys.stderr)


def cmd_status(args) -> int:
    try:
        cluster = providers.current(inventory.load_current(args.stack), say_on_stderr)
    except UsageError:
        leftovers = [] if state.resolve_stack(args.stack) else providers.interrupted_stacks()
        if leftovers:
            raise UsageError(
                f"no cluster, but stack '{leftovers[0]}' has node folders left by an interrupted "
                f"up: run python deploy.py down --stack {leftovers[0]}"
            ) from None
        raise
    rows, stopped = providers.for_cluster(cluster).status(cluster)
    rows = _with_scheduler_states(cluster, rows)
    if stopped:
        costs.record_self_stop(cluster.stack, stopped.get("reason", "stopped"), stopped.get("at"), report.console.print)
    spent = costs.cost_so_far(cluster.stack, say=report.console.print)
    reason = stopped.get("reason", "") if stopped else ""
    if args.json:
        report.print_json(
            {
                "stack": cluster.stack,
                "provider": cluster.provider,
                "stopped_reason": reason,
                "cost_so_far_usd": spent,
                "nodes": [row.as_dict() for row in rows],
                "up_timeline": cluster.timeline,  # how the up that made it spent its time (infra/timeline.py)
                "image": cluster.image,
            }
        )
    else:
        report.status_table(cluster, rows, reason, spent)
    if not all(r.reachable for r in rows):
        return 1
    down = [r for r in rows if r.scheduler is not None and not r.scheduler_serves]
    if down:  # the runs are held by Slurm, which cannot start, follow or end one now
        say_on_stderr(
            "the scheduler that holds the runs is down ("
            + "; ".join(f"{r.name}: {r.scheduler}" for r in down)
            + "): fab bootstrap restarts it"
        )
        return 1
    return 0


def _with_scheduler_states(cluster: inventory.ClusterInfo, rows: list) -> list:
    """Each reachable node's Slurm state where bootstrap started Slurm (the AskScheduler node call)."""
    import asyncio
    import dataclasses

    from infra import nodecall
    from node import calls
    from node.slurm_nodes import out_of_service

    setup = state.bootstrap_record(cluster.stack)
    if not setup.slurm_holds:
        return rows
    code = setup.code_dir

    async def ask(node):
        try:
            found = await nodecall.call(cluster, node, cluster.python, code, calls.AskScheduler(node.name), 15)
        except Exception:  # an answer that did not come is shown as such
            return "no answer", {}, False
        down = [name for name, pid in found.daemons.items() if not pid]
        serves = bool(found.node_state) and not down and not out_of_service(found.node_state)
        if found.node_state:
            shown = found.node_state
        elif found.existing:  # a site's Slurm: no daemon of ours runs, so what failed is their controller
            shown = "their Slurm controller does not answer"
        else:
            shown = "no answer from the controller" if found.daemons else "daemons down"
        if down:
            shown += f" ({', '.join(down)} down)"
        return shown, {name: "up" if pid else "down" for name, pid in found.daemons.items()}, serves

    async def every():
        up = [n for n, row in zip(cluster.nodes, rows, strict=True) if row.reachable]
        return dict(zip([n.name for n in up], await asyncio.gather(*(ask(n) for n in up)), strict=True))

    states = asyncio.run(every())
    return [
        dataclasses.replace(
            row,
            scheduler=states[row.name][0],
            scheduler_daemons=states[row.name][1],
            scheduler_serves=states[row.name][2],
        )
        if row.name in states
        else dataclasses.replace(row, scheduler="-")
        for row in rows
    ]


# ------------------------------------------------------------------------------------ plan, cost


def cmd_plan(args) -> int:
    """The real Pulumi program under Pulumi's mocks: no credentials, no CLI, nothing created."""
    from infra import plan

    stack = state.resolve_stack(args.stack, default=providers.AWS.default_stack)
    kind = providers.for_stack(stack)
    if not kind.cloud_plan:
        raise UsageError(f"plan is for AWS stacks (e.g. --stack dev); {kind.what} creates no cloud resources")
    stack_config = config.load_stack(stack)
    run = plan.run_program(plan.plan_config(stack_config))
    estimate, price_note = plan.estimate(stack_config)
    resources = [
        {"type": r.type, "name": r.name, "settings": plan.describe(r)}
        for r in sorted(run.resources, key=plan.display_order)
        if not r.type.startswith("gpu-cluster:")
    ]
    if args.json:
        prices = estimate.as_dict() if estimate else {"hourly_usd": None, "price_note": price_note}
        report.print_json({**prices, "stack": stack, "resources": resources})
        return 0
    report.plan_table(stack, stack_config, resources, estimate, price_note)
    return 0


def cmd_cost(args) -> int:
    """Per cluster and per run, from the ledger; local clusters also show what AWS would have charged."""
    if args.reconcile or args.bill is not None or args.days is not None:
        return _cost_reconcile(args)
    stack = None if args.stack is None else state.check_stack_name(args.stack)
    providers.note_self_stops(report.console.print)
    data = costs.report(stack, say=report.console.print)
    if args.json:
        report.print_json(data)
    else:
        report.cost_tables(data)
    return 0


def cmd_dashboard(args) -> int:
    """Serve the dashboard until Ctrl-C (dashboard/: Starlette and uvicorn, loaded only here)."""
    from dashboard import app

    stack = None if args.stack is None else state.check_stack_name(args.stack)
    if stack is not None and not state.stack_file(stack, state.INVENTORY).exists():
        raise UsageError(f"no stack '{stack}' here (python deploy.py up --stack {stack}), or leave --stack out")
    app.serve(args.port, stack, _node_rows, say=report.console.print)
    return 0


def _node_rows(cluster: inventory.ClusterInfo) -> list[dict]:
    """`status --json`'s node rows, for the dashboard: each node's state, uptime and Slurm state."""
    rows, _ = providers.for_cluster(cluster).status(cluster)
    return [row.as_dict() for row in _with_scheduler_states(cluster, rows)]


def _cost_reconcile(args) -> int:
    """The ledger beside the bill (infra/reconcile.py): Cost Explorer, or a CUR 2.0 CSV with --bill."""
    import json
    import time
    from pathlib import Path

    from infra import preflight, reconcile

    if not args.reconcile and args.bill is None:
        raise UsageError("--days goes with --reconcile: python deploy.py cost --reconcile --days N")
    days = None if args.days is None else reconcile.check_days(args.days)
    stack = state.resolve_stack(args.stack, default=providers.AWS.default_stack)
    kind = providers.for_stack(stack)
    if kind is not providers.AWS:
        raise UsageError(
            f"stack '{stack}' is {kind.what}: AWS bills nothing for it, so there is no bill to compare "
            "(python deploy.py cost shows its ledger)"
        )
    bill = None if args.bill is None else Path(args.bill)
    if bill is not None and not bill.is_file():
        found = "is empty" if not args.bill else "is not a file" if bill.exists() else "no such file"
        raise UsageError(f"--bill {shown(args.bill)}: {found}; download the CUR 2.0 export's CSV (gunzip it first)")
    ledger = costs.open_ledger(say_on_stderr, create=False)
    try:
        with preflight.aws_answers("cost --reconcile"):
            data = reconcile.reconcile(ledger, stack, days, bill, reconcile.ce_client, time.time())
    finally:
        if ledger is not None:
            ledger.close()
    if state.stack_dir(stack).is_dir():  # the dashboard's figures; a stack that is down has no page
        state.write_atomic(
            state.stack_file(stack, state.RECONCILIATION), json.dumps(reconcile.figures(data, time.time()))
        )
    if args.json:
        report.print_json(data)
    else:
        report.reconcile_tables(data)
    return 0


# ------------------------------------------------------------------------------------------ ssh


def ssh_argv(cluster: inventory.ClusterInfo, node_name: str, remote_command: list[str]) -> list[str]:
    """The stock OpenSSH command line for a node, under the one SSH policy (infra/ssh.py)."""
    node = cluster.node(node_name)
    argv = [
        "ssh",
        "-p", str(node.ssh_port),
        *openssh_options(cluster.ssh_key, cluster.known_hosts),
        f"{node.ssh_user}@{node.public_ip}",
    ]  # fmt: skip
    if remote_command:
        argv += ["--", *remote_command]
    return argv


def cmd_ssh(args) -> int:
    cluster = providers.current(inventory.load_current(args.stack), say_on_stderr)
    argv = ssh_argv(cluster, args.node, args.remote_command)
    if shutil.which("ssh") is None:
        raise UsageError("no ssh client on PATH: install OpenSSH (e.g. apt install openssh-client)")
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def cmd_ssh_config(args) -> int:
    """The nodes as ssh_config blocks on stdout, under the one SSH policy (infra/ssh.py)."""
    cluster = providers.current(inventory.load_current(args.stack), say_on_stderr)
    try:
        text = openssh_config(cluster)
    except ValueError as exc:
        raise UsageError(f"{exc}: move the stack's files to a path without quotes or newlines") from None
    sys.stdout.write(text)
    return 0


def cmd_drill(args) -> int:
    """A spot interruption as the cloud gives one: the notice on the node's metadata service, the node gone later."""
    if not 0 <= args.notice <= 3600:
        raise UsageError(f"--notice {args.notice:g}: give the seconds from notice to reclaim, 0..3600 (EC2 gives 120)")
    cluster = providers.current(inventory.load_current(args.stack), say_on_stderr)
    chosen = providers.for_cluster(cluster)
    chosen.spot_drill(cluster, args.node, args.notice, say=report.console.print, fis_role=args.fis_role, yes=args.yes)
    return 0


# ---------------------------------------------------------------------------------------- image


def cmd_image(args) -> int:
    """Baked AMIs (infra/images.py): they outlive clusters, so they are listed and deleted by region."""
    return {"create": _image_create, "list": _image_list, "delete": _image_delete}[args.image_command](args)


def _image_create(args) -> int:
    from infra import images, preflight
    from infra.timeline import Timeline

    timeline = Timeline.since_process_start()
    stack = state.resolve_stack(args.stack, default=providers.AWS.default_stack)
    kind = providers.for_stack(stack)
    if kind is not providers.AWS:
        raise UsageError(f"image create makes an AWS AMI; stack '{stack}' is {kind.what}, whose nodes boot no image")
    name = images.check_name(args.name) if args.name is not None else images.default_name(stack, args.node)
    cluster = inventory.load(stack)
    ec2 = preflight.AwsClients.for_region(cluster.region).ec2
    request = images.BakeRequest(args.node, name, args.reboot)
    with preflight.aws_answers(f"image create of {args.node}"):
        made = images.bake(cluster, request, ec2, report.console.print, timeline)
    timeline.close("done")
    report.console.print(f"{made.id}  {made.name}  ({cluster.region}): python deploy.py up --image {made.id}")
    report.console.print(images.cost_line(made))
    report.console.print(f"image: {timeline.line()}")
    return 0


def _image_region(args) -> str:
    """The region whose images `image list|delete` means: --region, else the stack's. A stack with no
    region (local, hosts) is refused: its nodes boot no image, and EC2 would be asked about some region."""
    if args.region is not None:
        if not config.REGION.fullmatch(args.region):
            raise UsageError(f"--region {args.region!r} is not a region name like us-east-1")
        if args.stack is None:
            return args.region
    stack = state.resolve_stack(args.stack, default=providers.AWS.default_stack)
    kind = providers.for_stack(stack)
    if kind is not providers.AWS:
        given = "--stack" if args.stack is not None else "the current stack"
        raise UsageError(
            f"image {args.image_command}: {given} '{stack}' is {kind.what}, whose nodes boot no image and which "
            "has no AWS region: give an AWS stack (--stack NAME) or --region REGION"
        )
    if args.region is not None:
        return args.region
    try:
        return inventory.load(stack).region
    except UsageError:
        return config.load_stack(stack).region


def _image_list(args) -> int:
    from infra import images, preflight

    region = _image_region(args)
    stack = None if args.stack is None else state.check_stack_name(args.stack)
    with preflight.aws_answers("image list"):
        found = images.ours(preflight.AwsClients.for_region(region).ec2, stack)
    if args.json:
        report.print_json([i.as_dict() for i in found])
    else:
        report.image_table(region, found)
    return 0


def _image_delete(args) -> int:
    from infra import config as stack_config
    from infra import images, preflight

    if not stack_config.AMI_ID.fullmatch(args.image_id):
        raise UsageError(f"{args.image_id!r} is not an AMI id like ami-0123456789abcdef0")
    region = _image_region(args)
    with preflight.aws_answers(f"image delete {args.image_id}"):
        gone = images.delete(preflight.AwsClients.for_region(region).ec2, args.image_id)
    report.console.print(f"deleted {gone.id} ({gone.name}) and {len(gone.snapshots)} snapshot(s) in {region}")
    return 0


COMMANDS = {
    "up": cmd_up,
    "down": cmd_down,
    "status": cmd_status,
    "plan": cmd_plan,
    "cost": cmd_cost,
    "ssh": cmd_ssh,
    "ssh-config": cmd_ssh_config,
    "drill": cmd_drill,
    "image": cmd_image,
    "dashboard": cmd_dashboard,
}


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
    signal.signal(signal.SIGINT, signal.default_int_handler)  # loaded: Ctrl-C is main()'s KeyboardInterrupt again
    sys.exit(main())
