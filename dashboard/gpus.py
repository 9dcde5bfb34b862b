"""The GPU readings of the runs that run now, brought from the cluster for `/metrics`.

Every node's torchrun samples its GPUs into its own file in the run's folder while the run goes
(node/nvml.py, `contract.gpu_samples`: `gpu-<node>.jsonl`), and those files come to this machine only when
the run ends. So the dashboard asks the head node for the end of each running run's samples files (one SSH
command per stack, every `EVERY_S`, as `fab jobs` reads a fault-tolerant run's participants there) and keeps
each GPU's newest `gpu` record. Where the run folder is on the shared folder (AWS's EFS, the local
provider's folder) the head node sees every node's file.
"""

import shlex

from infra.inventory import ClusterInfo
from node import contract, gpu_samples
from remote import node_paths
from remote.connect import NodeSession

EVERY_S = 10.0
"""How often the running runs' readings are brought (a GPU is sampled every node/nvml.py SAMPLE_S)."""
TAIL_BYTES = 1 << 14
"""How much of each node's samples file's end is read: a round of 8 GPUs is about 2.5 kB."""
MARK = "__gpu_cluster_dashboard_run__"

Readings = dict[tuple[str, str], dict]
"""(node, GPU index) to its newest `gpu` record."""


def tail_command(cluster: ClusterInfo, run_ids: list[str]) -> str:
    """One shell command that prints, for each run, a mark line with its id and the end of each node's
    samples file (each ended by a newline of its own: a line the tail cut never joins the next file's)."""
    parts = []
    for run_id in run_ids:
        folder = node_paths.shell_path(node_paths.remote_run_dir(cluster, run_id))
        files = f"{folder}/{contract.GPU_SAMPLES_PREFIX}*{contract.GPU_SAMPLES_SUFFIX}"
        parts.append(
            f'echo {MARK} {shlex.quote(run_id)}; for f in {files}; do [ -f "$f" ] && tail -c {TAIL_BYTES} "$f"; '
            "echo; done"
        )
    return "; ".join(parts)


def parse(text: str) -> dict[str, Readings]:
    """`tail_command`'s output as each run's newest reading per GPU (a line cut by the tail is skipped)."""
    found: dict[str, Readings] = {}
    run_id: str | None = None
    lines: list[str] = []
    for line in [*text.splitlines(), f"{MARK} "]:
        if line.startswith(MARK + " "):
            if run_id is not None:
                found[run_id] = gpu_samples.newest(lines)
            run_id, lines = line[len(MARK) + 1 :].strip(), []
        else:
            lines.append(line)
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
