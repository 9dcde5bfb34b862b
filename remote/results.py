"""A run's results, back from the head node once it has ended (both holders, and `fab results`): its
`$CLUSTER_RESULTS_DIR` and `metrics.jsonl`, each file under a cap; what the node logs show of a failure."""

import os
from dataclasses import dataclass
from pathlib import Path

from infra import state
from infra.inventory import ClusterInfo
from node import calls, contract
from node import hang_rule as hang
from remote import free_space, node_paths, nodecall
from remote.connect import NodeSession, describe
from remote.stream import say
from remote.workdir import count_files, human_bytes

FETCHED_SHOWN = 6  # file names listed in the "fetched" line


@dataclass(frozen=True)
class Fetched:
    """What came back from the head node after a run."""

    names: list[str]
    """Fetched files, relative to the local run folder."""
    total_bytes: int
    """Their size."""
    refused: list[tuple[str, int, str]]
    """(name, size, where it is on the node) of the files over the cap, left there."""
    failed: tuple[str, str] | None = None
    """(name, why) of the file whose copy failed (a full disk); the ones after it were not tried."""


def fetch_results(
    cluster: ClusterInfo, session: NodeSession, python: str, run_id: str, local_dir: Path, max_bytes: int
) -> Fetched:
    """Copy the head node's `$CLUSTER_RESULTS_DIR` (whole) and the run's `metrics.jsonl`, and nothing
    else: checkpoints and whatever else the job left in its folders stay on the nodes."""
    listing = calls.ListResults(
        contract.home_relative(node_paths.remote_run_dir(cluster, run_id)),
        contract.home_relative(node_paths.results_dir(run_id)),
    )
    entries = nodecall.call(session, python, listing).files
    names: list[str] = []
    total, refused = 0, []
    for entry in entries:
        name, size = _local_name(entry["name"]), int(entry["size"])
        if size > max_bytes:
            refused.append((name, size, entry["remote"]))
            continue
        target = local_dir / name
        try:
            state.make_private_dir(target.parent)
            _get_whole(session, entry["remote"], target)
        except OSError as exc:
            return Fetched(names, total, refused, (name, exc.strerror or describe(exc)))
        names.append(name)
        total += size
    return Fetched(names, total, refused)


def _get_whole(session: NodeSession, remote: str, target: Path) -> None:
    """Copy one file under a temporary name, made private (0600, as everything in .cluster), then
    renamed: a copy cut short (a full disk) never stands under the result's name."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        session.conn.get(remote, str(partial), preserve_mode=False)
        os.chmod(partial, state.PRIVATE_FILE_MODE)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _local_name(name: str) -> str:
    """A name the node gave, refused unless it stays inside the local run folder."""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"the node named a result {name!r} outside the run folder")
    return name


def report_fetched(fetched: Fetched, local_dir: Path, head: str, max_bytes: int) -> None:
    if fetched.names:
        shown = ", ".join(fetched.names[:FETCHED_SHOWN]) + (
            f" and {len(fetched.names) - FETCHED_SHOWN} more" if len(fetched.names) > FETCHED_SHOWN else ""
        )
        say(
            f"fab: fetched {count_files(len(fetched.names))} ({human_bytes(fetched.total_bytes)}) "
            f"into {local_dir}: {shown}"
        )
    elif not fetched.refused and not fetched.failed:
        say(f"fab: nothing to fetch: {head}'s $CLUSTER_RESULTS_DIR is empty and the run wrote no metrics.jsonl")
    if fetched.failed:
        name, why = fetched.failed
        say(
            f"fab: could not fetch {name} from {head}: {why}; it and the results after it stay there "
            "(free space here, then copy them with scp -F, see python deploy.py ssh-config)"
        )
    for name, size, remote in fetched.refused:
        where = remote if remote.startswith("/") else f"~/{remote}"
        say(
            f"fab: not fetched: {name} ({human_bytes(size)}, over --max-result-mb {max_bytes // 1_000_000}); "
            f"it stays on {head} in {where}"
        )


def explain_failure(local_dir: Path) -> None:
    """Say what the node logs show about a failed job beyond its exit codes (a collective mismatch, a full disk)."""
    for log in sorted(local_dir.glob("node-*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for line in (hang.mismatch_line(log.stem, text), free_space.full_disk_line(log.stem, text)):
            if line:
                say(line)
