"""On a node: what each rank of a running job is doing, for `fab`'s hang detection and diagnosis, asked
through node/calls.py: HangStatus (every rank's last progress record) and HangCollect (also the
flight-recorder dumps and py-spy stacks), each of a run's progress folder.

The ranks' monitors (rankhook/gpu_cluster_rank_monitor.py) write `rank-<R>.json` into PROGRESS_DIR
every second. `status` adds what only this node can tell: how old each record is by this node's
clock, and whether the rank's process runs, is stopped (SIGSTOP) or is gone. `collect` asks every
rank for its whole recorder buffer and thread stacks (the `dump.request` file), waits a few seconds
for the ranks that can still answer, and runs `py-spy dump` on every rank, which works on a stopped
process too. Standard library only.
"""

import glob
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from node import contract, procfs

PY_SPY_TIMEOUT_S = 20


def rank_processes(run_id: str) -> dict[int, int]:
    """{rank: pid} of this run's torchrun workers on this node, found by their environment (a rank
    that stopped or hung before its monitor wrote anything is found too). Where several nodes share
    one machine (the local provider), CLUSTER_NODE tells this node's workers from the others'."""
    node = os.environ.get(contract.NODE_VARIABLE)
    found = {}
    for pid, variables in procfs.environments():
        if variables.get(contract.RUN_ID_VARIABLE) != run_id:
            continue
        if node and variables.get(contract.NODE_VARIABLE) != node:
            continue
        rank = variables.get("RANK")
        if rank is not None and rank.isdigit():
            found[int(rank)] = pid
    return found


def progress_records(folder: str) -> list[dict]:
    """The ranks' progress records in `folder` (`rank-<R>.json`), those that read whole; one being
    replaced right now, or damaged, is left for the next look."""
    found = []
    for path in glob.glob(os.path.join(folder, contract.RANK_PROGRESS_GLOB)):
        if path.endswith(contract.DUMP_SUFFIX):
            continue
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def read_ranks(folder: str, run_id: str, now: float) -> list[dict]:
    """Every rank of the run on this node: its last progress record, if any, and its process state."""
    records = {}
    for record in progress_records(folder):
        try:
            records[int(record["rank"])] = record
        except (KeyError, TypeError, ValueError):
            continue
    for rank, pid in rank_processes(run_id).items():
        if rank not in records or records[rank].get("pid") != pid:
            records[rank] = {"rank": rank, "pid": pid, "time": now, "reported": False}
    ranks = []
    for _rank, record in sorted(records.items()):
        record.setdefault("reported", True)
        record["node"] = record.get("node") or os.environ.get(contract.NODE_VARIABLE, "")
        record["age_s"] = round(now - float(record.get("time", now)), 3)
        record["state"] = procfs.process_state(int(record.get("pid", 0)))
        ranks.append(record)
    return ranks


def status(folder: str, run_id: str) -> dict:
    now = time.time()
    return {"now": now, "ranks": read_ranks(folder, run_id, now)}


def collect(folder: str, run_id: str, wait_s: float, py_spy: str | None) -> dict:
    requested_at = time.time()
    with open(os.path.join(folder, contract.DUMP_REQUEST), "w") as f:
        f.write(f"{requested_at}\n")
    ranks = read_ranks(folder, run_id, requested_at)
    dumps = _wait_for_dumps(folder, ranks, requested_at, wait_s)
    with ThreadPoolExecutor(max_workers=max(1, len(ranks))) as pool:
        answers = pool.map(lambda r: py_spy_dump(py_spy, r["pid"]), ranks)
        stacks = dict(zip((str(r["rank"]) for r in ranks), answers, strict=True))
    now = time.time()
    return {"now": now, "ranks": read_ranks(folder, run_id, now), "dumps": dumps, "py_spy": stacks}


def _wait_for_dumps(folder: str, ranks: list[dict], requested_at: float, wait_s: float) -> dict:
    """Each rank's fresh dump; a stopped or gone rank cannot answer, so it is not waited for."""
    expected = {r["rank"] for r in ranks if r["state"] == "running" and r["reported"] and not r.get("finished")}
    dumps, deadline = {}, time.monotonic() + wait_s
    while True:
        for rank in list(expected):
            path = os.path.join(folder, contract.rank_dump(rank))
            try:
                if os.stat(path).st_mtime >= requested_at:
                    with open(path) as f:
                        dumps[str(rank)] = json.load(f)
                    expected.discard(rank)
            except (OSError, ValueError):
                continue
        if not expected or time.monotonic() > deadline:
            return dumps
        time.sleep(0.1)


def py_spy_dump(py_spy: str | None, pid: int) -> str:
    """The process's Python stacks from py-spy, or why there are none. `--nonblocking` reads the
    process's memory without pausing it, which also works when it is stopped."""
    if not py_spy:
        return "py-spy is not installed on this node"
    try:
        result = subprocess.run(
            [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"py-spy timed out after {PY_SPY_TIMEOUT_S} s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["no output"])[0]
        return f"py-spy failed: {why} (on Ubuntu, kernel.yama.ptrace_scope=1 allows it only with sudo)"
    return result.stdout


def find_py_spy() -> str | None:
    """py-spy installed with the packages this interpreter sees (python_env.py puts it there)."""
    from node.python_env import find_program

    return find_program("py-spy")


def status_reply(folder: str, run_id: str) -> dict:
    """node/calls.py's HangStatus."""
    folder = os.path.expanduser(folder)
    os.makedirs(folder, exist_ok=True)
    return status(folder, run_id)


def collect_reply(folder: str, run_id: str, wait_s: float) -> dict:
    """node/calls.py's HangCollect."""
    folder = os.path.expanduser(folder)
    os.makedirs(folder, exist_ok=True)
    return collect(folder, run_id, wait_s, find_py_spy())
