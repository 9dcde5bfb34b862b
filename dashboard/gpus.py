"""The GPU readings of the runs that run now, brought from the cluster for `/metrics`.

Every node's torchrun samples its GPUs into the run's metrics file while the run goes (node/nvml.py), and
that file comes to this machine only when the run ends. So the dashboard asks the head node for the end of
each running run's metrics file (one SSH command per stack, every `EVERY_S`, as `fab jobs` reads a
fault-tolerant run's participants there) and keeps each GPU's newest `gpu` record. Where the run folder
is on the shared folder (AWS's EFS, the local provider's folder) the head node sees every node's readings.
"""

import json
import shlex

from infra.inventory import ClusterInfo
from node import contract
from remote import node_paths
from remote.connect import NodeSession

EVERY_S = 10.0
"""How often the running runs' readings are brought (a GPU is sampled every node/nvml.py SAMPLE_S)."""
TAIL_BYTES = 1 << 18
"""How much of each metrics file's end is read: a round of 16 nodes x 8 GPUs is about 40 KB."""
MARK = "__gpu_cluster_dashboard_run__"

Readings = dict[tuple[str, str], dict]
"""(node, GPU index) to its newest `gpu` record."""


def tail_command(cluster: ClusterInfo, run_ids: list[str]) -> str:
    """One shell command that prints, for each run, a mark line with its id and the end of its metrics."""
    parts = []
    for run_id in run_ids:
        path = node_paths.shell_path(f"{node_paths.remote_run_dir(cluster, run_id)}/{contract.METRICS_FILE}")
        parts.append(f"echo {MARK} {shlex.quote(run_id)}; tail -c {TAIL_BYTES} {path} 2>/dev/null; echo")
    return "; ".join(parts)


def parse(text: str) -> dict[str, Readings]:
    """`tail_command`'s output as each run's newest reading per GPU (a line cut by the tail is skipped)."""
    found: dict[str, Readings] = {}
    current: Readings | None = None
    for line in text.splitlines():
        if line.startswith(MARK + " "):
            current = found.setdefault(line[len(MARK) + 1 :].strip(), {})
            continue
        if current is None or '"gpu"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "gpu" and "index" in record:
            current[(str(record.get("node", "")), str(record["index"]))] = record
    return found


def bring(cluster: ClusterInfo, run_ids: list[str]) -> dict[str, Readings]:
    """The running runs' newest readings, asked of the head node ({} where none is running)."""
    if not run_ids:
        return {}
    session = NodeSession(cluster, cluster.head)
    try:
        return parse(session.run(tail_command(cluster, run_ids)).stdout)
    finally:
        session.conn.close()
