"""The providers' registry, and what every provider shares, done once.

`deploy.py` picks a provider with `for_up`, `for_stack` or `for_cluster` and never asks which one it
has; `bring_up` and `bring_down` wrap a provider's own `up` and `down` with the bookkeeping they all
share: the flags it does not accept refused in one line, a stack of another kind refused, the ledger's
cluster interval opened and closed, the guards saved, the run logs brought home and named.
"""

import dataclasses
import json

from infra import costs, inventory, report, runlog, state
from infra.errors import UsageError
from infra.inventory import ClusterInfo
from infra.providers.aws import AwsProvider
from infra.providers.base import CONFIG_FLAGS, DownReport, Provider, UpRequest, UpResult
from infra.providers.hosts import SshProvider
from infra.providers.local import orphans
from infra.providers.local.provider import LocalProvider

__all__ = ["CONFIG_FLAGS", "DownReport", "Provider", "UpRequest", "UpResult", "PROVIDERS"]

PROVIDERS: dict[str, Provider] = {p.name: p for p in (LocalProvider(), AwsProvider(), SshProvider())}
LOCAL, AWS, HOSTS = (PROVIDERS[name] for name in ("local", "aws", "ssh"))


def current(cluster: ClusterInfo, say) -> ClusterInfo:
    """The cluster as it is now: nodes the cloud replaced by itself (spot workers in Auto Scaling groups)
    are adopted before anyone connects. Nothing is asked of a cluster whose nodes never move."""
    return for_cluster(cluster).adopt_replacements(cluster, say) if cluster.nodes_move else cluster


def bring_up(chosen: Provider, request: UpRequest, say) -> UpResult:
    """`up` through the chosen provider, with what every provider shares: the request checked against
    what it accepts and against a stack of another kind, then, for a cluster it created, the ledger
    row and the guards (where they apply) where bootstrap finds them."""
    refused = [flag for key, flag in request.given().items() if key not in chosen.accepts]
    if refused:
        raise UsageError(f"{', '.join(refused)} do(es) not apply to {chosen.flag or chosen.what}: {chosen.why_not}")
    chosen.check(request)
    request.timeline.mark("checks")
    with state.stack_lock(request.stack, f"up of stack '{request.stack}'", say):  # two ups at once: one by one
        request.timeline.mark("lock")
        return _bring_up(chosen, request, say)


def _bring_up(chosen: Provider, request: UpRequest, say) -> UpResult:
    other = _inventory_provider(request.stack)
    if other is not None and other != chosen.name:
        raise UsageError(
            f"stack {request.stack!r} is {PROVIDERS[other].what}, not {chosen.what}: pick another with --stack NAME"
        )
    result = chosen.up(request, say)
    request.timeline.mark("nodes")  # what a provider did not mark itself
    if result.created:
        guarded, reference_usd = chosen.bookkeeping(request)
        if guarded is not None:
            costs.save_guards(request.stack, guarded)
        costs.record_up(result.cluster, reference_usd, say=say, lines=result.billed_lines)
        request.timeline.close("ledger")
        cluster = dataclasses.replace(result.cluster, timeline=request.timeline.as_dict())
        inventory.save(cluster)
        return dataclasses.replace(result, cluster=cluster)
    request.timeline.close("ledger")
    return result


def bring_down(chosen: Provider, stack: str, say) -> int:
    """`down` through the stack's provider, then the ledger's interval closed once (at the time the
    cluster stopped itself, where it did), and where the run logs are kept; returns the exit code."""
    was_current = _is_current(stack)
    if state.state_root().exists():  # with no state at all there is nothing to race over (and nothing is made)
        with state.stack_lock(stack, state.down_holder(stack), say):
            unfinished = runlog.before_down(stack, say)  # the logs live on the cluster until they are here
            done: DownReport = chosen.down(stack, say)
            if done.code == 0 and done.ended:
                runlog.after_down(unfinished, say)
    else:
        done = chosen.down(stack, say)
    if done.ended:
        if done.stopped_itself:
            costs.record_self_stop(
                stack, done.stopped_itself.get("reason", "stopped"), done.stopped_itself.get("at"), say
            )
        costs.record_down(stack, say=say)
    if done.code == 0:
        runs = state.runs_dir(stack)
        if runs.exists():
            say(f"run logs kept in {report.relative(runs)}")
        if was_current and state.current_stack() is None:
            _pass_current_on(say)
    return done.code


def _is_current(stack: str) -> bool:
    try:
        return state.current_stack() == stack
    except UsageError:
        return False


def _pass_current_on(say) -> None:
    """The current stack went down: the one stack still up becomes current (several: name them)."""
    left = state.stacks_up()
    if len(left) == 1:
        state.set_current_stack(left[0])
        say(f"stack '{left[0]}' is still up and is now the current stack")
    elif left:
        say(f"stacks {', '.join(left)} are still up: pass --stack NAME (or set CLUSTER_STACK) to pick one")


def config_flag(key: str) -> str:
    return CONFIG_FLAGS.get(key, key)


def for_up(local_flag: bool, hosts_file: str | None, stack_flag: str | None) -> tuple[Provider, str]:
    """The provider and stack `up` means: `--local`, `--hosts FILE`, else the stack's own (AWS for a new one)."""
    if local_flag and hosts_file:
        raise UsageError("--local and --hosts exclude each other: the nodes are either here or your machines")
    if hosts_file is not None and not hosts_file.strip():
        raise UsageError("--hosts needs a file: the YAML list of your machines (see README, 'Your own machines')")
    if local_flag:
        return LOCAL, state.check_stack_name(LOCAL.default_stack if stack_flag is None else stack_flag)
    if hosts_file is not None:
        return HOSTS, state.check_stack_name(HOSTS.default_stack if stack_flag is None else stack_flag)
    stack = state.resolve_stack(stack_flag, default=AWS.default_stack)
    return for_stack(stack), stack


def for_stack(stack: str) -> Provider:
    """The stack's provider: its inventory says (even a damaged one, where its `provider` can be read);
    else a local stack's node folders, or the default stack names of `--local` and `--hosts`; else AWS,
    whose state is Pulumi's."""
    name = _inventory_provider(stack)
    if name is None and (stack == LOCAL.default_stack or (state.stack_dir(stack) / "nodes").exists()):
        name = LOCAL.name
    if name is None and orphans.find(stack).count:  # a local stack whose state folder was deleted while it ran
        name = LOCAL.name
    if name is None and stack == HOSTS.default_stack:
        name = HOSTS.name
    if name is None:  # a stack taken down already: the ledger still says what it was (a second down needs no Pulumi)
        name = _ledger_provider(stack)
    return PROVIDERS.get(name or AWS.name, AWS)


def _ledger_provider(stack: str) -> str | None:
    """The provider of the stack's newest cluster in the ledger; None where it has none (or no ledger)."""
    ledger = costs.open_ledger(say=lambda line: None, create=False)
    if ledger is None:
        return None
    try:
        records = ledger.clusters(stack)
    finally:
        ledger.close()
    return records[-1].provider if records else None


def _inventory_provider(stack: str) -> str | None:
    try:
        data = json.loads(inventory.inventory_path(stack).read_text())
    except (OSError, ValueError):
        return None
    name = data.get("provider") if isinstance(data, dict) else None
    return name if name in PROVIDERS else None


def for_cluster(cluster: ClusterInfo) -> Provider:
    if cluster.provider not in PROVIDERS:
        raise UsageError(f"stack {cluster.stack!r} names an unknown provider {cluster.provider!r} in its inventory")
    return PROVIDERS[cluster.provider]


def note_self_stops(say) -> None:
    """Close the ledger intervals of clusters that powered themselves off, at the time they did."""
    for provider in PROVIDERS.values():
        for stack, record in provider.self_stops().items():
            costs.record_self_stop(stack, record.get("reason", "stopped"), record.get("at"), say)


def interrupted_stacks() -> list[str]:
    """Every stack an interrupted `up` left behind, whatever its provider."""
    return sorted(stack for provider in PROVIDERS.values() for stack in provider.interrupted_stacks())
