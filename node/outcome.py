"""The one rule from how a run's nodes and ranks ended to the node that failed first and the run's exit
code, for both run holders (fab's connections and Slurm: the operator's record, remote/runs.py, and the
Slurm batch job's own exit code, so that Slurm's books say what fab says), fed the same facts: each node's
exit code, its ranks line (the failed ranks' own codes and exit times, node/torchrun.py), and when its job
ended by its own clock (its exit marker). Standard library only.

Which call returned first says nothing (a node whose job ended first can return last: a child holding its
output open, a slow link), and neither does the order of the nodes. The evidence, best first:

1. the ranks' own exit records: the failed rank that exited earliest, by its node's clock;
2. the nodes' own exit times: the failed node whose job ended earliest, by its own clock;
3. the nodes' codes: a node whose own ranks failed, or which ended by itself, before one that was stopped
   (128+15, 128+9) because another failed; in the order given.

The line that names the node says which evidence named it.
"""

import json
import math
import re
from dataclasses import dataclass

from node import contract

STOPPED_CODES = (128 + 15, 128 + 9)
"""A node's job ended by a signal from outside (fail-fast, fab stop, scancel): not a failure of its own."""


@dataclass(frozen=True)
class FirstFailure:
    """The node that failed first, and why it is the one."""

    node: str
    """Its name."""
    exit_code: int
    """The run's exit code: the failed rank's own where known (its script's), else the node's."""
    evidence: str
    """How it was told apart, for the error line: `rank 1 exited first by its clock`."""


def first_failure(
    exit_codes: dict[str, int | None],
    rank_codes: dict[str, dict[str, int]],
    rank_exited_at: dict[str, dict[str, float]] | None = None,
    exited_at: dict[str, float | None] | None = None,
    order: list[str] | None = None,
) -> FirstFailure | None:
    """The node that failed first (None where every node exited 0 or was not heard from), from each node's
    exit code, its failed ranks' own codes and exit times ({node: {global rank: ...}}), and when its job ended;
    `order` lists the nodes to break ties and to fall back on (the run's nodes, head first)."""
    names = [n for n in (order or []) if n in exit_codes] + [n for n in exit_codes if n not in (order or [])]
    failed = [n for n in names if exit_codes[n] not in (0, None)]
    if not failed:
        return None
    times = rank_exited_at or {}
    ranked = sorted(
        (at, names.index(node), node, rank)
        for node in failed
        for rank, at in times.get(node, {}).items()
        if rank in rank_codes.get(node, {})
    )
    if ranked:
        _, _, node, rank = ranked[0]
        return FirstFailure(node, rank_codes[node][rank], f"rank {rank} exited first by its clock")
    timed = sorted((at, names.index(n), n) for n in failed if (at := (exited_at or {}).get(n)) is not None)
    if timed:
        node = timed[0][2]
        return FirstFailure(node, _own_code(node, exit_codes, rank_codes), "its job ended first by its clock")
    own = [n for n in failed if rank_codes.get(n) or exit_codes[n] not in STOPPED_CODES]
    node = (own or failed)[0]
    why = "its ranks failed by themselves" if own else "stopped first"
    return FirstFailure(node, _own_code(node, exit_codes, rank_codes), f"{why} (no exit times were reported)")


def _own_code(node: str, exit_codes: dict[str, int | None], rank_codes: dict[str, dict[str, int]]) -> int:
    """The node's first failed rank's own code, else the node's."""
    codes = rank_codes.get(node) or {}
    return next(iter(codes.values())) if codes else int(exit_codes[node] or 0)


NODE_PREFIX = re.compile(r"^\[(node-\d+)\] (__gpu_cluster_(?:exit|ranks)__) (.*)$", re.M)
"""A node's exit marker or ranks line in a run's log (contract.EXIT_MARKER, contract.RANKS_MARKER)."""


def from_log(text: str, order: list[str] | None = None) -> FirstFailure | None:
    """The same rule over what a Slurm-held run's log says of its nodes (each node's exit marker and ranks
    line, `[node-i]`-prefixed): the batch job ends with the run's own code, so Slurm's books agree with fab."""
    exit_codes: dict[str, int | None] = {}
    exited_at: dict[str, float | None] = {}
    rank_codes: dict[str, dict[str, int]] = {}
    rank_times: dict[str, dict[str, float]] = {}
    for node, marker, rest in NODE_PREFIX.findall(text):
        if marker == contract.EXIT_MARKER:
            code, _, at = rest.partition(" ")
            try:
                exit_codes[node] = int(code)
            except (ValueError, ArithmeticError):
                continue
            exited_at[node] = _finite(at.replace(",", "."))  # bash's EPOCHREALTIME: the locale's decimal point
            continue
        try:
            said = json.loads(rest)
            codes = {str(r): int(c) for r, c in dict(said.get("exit_codes") or {}).items()}
            ended = said.get("exited_at") if isinstance(said.get("exited_at"), dict) else {}
        except (ValueError, TypeError, AttributeError, ArithmeticError):
            continue
        rank_codes[node] = codes
        times = {str(r): _finite(t) for r, t in ended.items() if str(r) in codes}
        rank_times[node] = {r: t for r, t in times.items() if t is not None}
    return first_failure(exit_codes, rank_codes, rank_times, exited_at, order)


def ended_at(nodes: list, ranks_ended: dict, exited_at: dict) -> float | None:
    """When the run really ended, by its nodes' own clocks: the last node's end (its job's exit marker, else its
    torchrun's ranks line); None where a node said neither (its job was killed whole). Slurm's end can be much
    later: when a controller restarted since learned of it."""
    ends = []
    for node in nodes:
        at = _finite(exited_at.get(node))
        at = _finite(ranks_ended.get(node)) if at is None else at
        if at is None:
            return None
        ends.append(at)
    return max(ends) if ends else None


def _finite(value) -> float | None:
    """A finite number (a JSON number or its text), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
