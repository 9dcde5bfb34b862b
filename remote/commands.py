"""Pure functions that build the shell commands `fab` sends to nodes, and parse what comes back.

Every value that reaches a shell goes through `shlex.quote`; nothing here talks to a node.
"""

import json
import re
import secrets
import shlex
from datetime import datetime, timezone

from infra.inventory import ClusterInfo, NodeInfo

STATE_DIR = "~/.gpu-cluster"
ENV_FILE = f"{STATE_DIR}/env"
STATE_FILE = f"{STATE_DIR}/state.json"
JOB_FILE = f"{STATE_DIR}/job"
DEFAULT_MASTER_PORT = 29500
# Each restart attempt gets a store of its own: torch 2.13 shares the rendezvous store with workers
# across restarts, where a restarted rank can read a dead rank's stale address (any script, not ours).
FRESH_STORE_PER_ATTEMPT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
TERMINATE_GRACE_S = 5


def nproc_per_node(gpus: int, requested: int | None = None) -> int:
    """What was asked for (`--nproc-per-node`), else one process per GPU, one on CPU nodes."""
    if requested is not None:
        return requested
    return gpus if gpus > 0 else 1


def nproc_problem(nodes: tuple[NodeInfo, ...], requested: int | None) -> str | None:
    """Why `--nproc-per-node requested` cannot run on these nodes, or None where it can.

    CPU nodes take any number (2 local nodes x 2 processes form a 4-rank mesh); a GPU node takes at
    most one process per GPU, since two ranks sharing a GPU break NCCL.
    """
    if requested is None:
        return None
    if requested < 1:
        return f"--nproc-per-node must be at least 1, not {requested}"
    for node in nodes:
        if 0 < node.gpus < requested:
            return (f"--nproc-per-node {requested} is more than {node.name}'s {node.gpus} GPU(s): "
                    f"use at most {node.gpus} (one process per GPU)")
    return None


def new_run_id(task: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{task}-{secrets.token_hex(2)}"


def shared_or_home(cluster: ClusterInfo, folder: str) -> str:
    """A folder on the shared storage, or in each node's home where the cluster has none."""
    if cluster.shared_dir:
        return f"{cluster.shared_dir.rstrip('/')}/{folder}"
    return f"$HOME/{folder}"


def code_dir(cluster: ClusterInfo) -> str:
    return shared_or_home(cluster, "code")


def remote_run_dir(cluster: ClusterInfo, run_id: str) -> str:
    return shared_or_home(cluster, f"runs/{run_id}")


def parse_route_interface(ip_route_output: str) -> str | None:
    """The `dev` of `ip route get ADDR` output: the interface that carries traffic to ADDR."""
    match = re.search(r"\bdev\s+(\S+)", ip_route_output)
    return match.group(1) if match else None


def node_environment(cluster: ClusterInfo, index: int, interface: str, python: str,
                     master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """The node environment of ARCHITECTURE.md for node `index`, as bootstrap writes it."""
    node = cluster.nodes[index]
    env = {
        "NODE_RANK": str(index),
        "NNODES": str(len(cluster.nodes)),
        "NPROC_PER_NODE": str(nproc_per_node(node.gpus)),
        "MASTER_ADDR": cluster.head.private_ip,
        "MASTER_PORT": str(master_port),
        "CLUSTER_STACK": cluster.stack,
        "CLUSTER_PROVIDER": cluster.provider,
        "CLUSTER_NODE": node.name,
        "CLUSTER_PRIVATE_IP": node.private_ip,
        "CLUSTER_SHARED_DIR": cluster.shared_dir,
        "CLUSTER_CODE_DIR": code_dir(cluster),
        "CLUSTER_HOURLY_USD": f"{cluster.hourly_usd:g}",
        "CLUSTER_PYTHON": python,
        "NCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
    }
    if cluster.provider == "local":
        # Local nodes share this machine's cores: one thread per rank avoids oversubscribing them.
        env["OMP_NUM_THREADS"] = "1"
    return env


def env_file_text(env: dict[str, str]) -> str:
    lines = ["# Written by `fab bootstrap`; every job on this node sources it."]
    for key, value in env.items():
        # $HOME stays unquoted so the shell expands it; everything else is taken literally.
        quoted = value if value.startswith("$HOME/") and " " not in value else shlex.quote(value)
        lines.append(f"export {key}={quoted}")
    return "\n".join(lines) + "\n"


def torchrun_argv(cluster: ClusterInfo, node: NodeInfo, run_id: str, max_restarts: int, master_port: int,
                  nproc: int | None = None) -> list[str]:
    """torchrun with c10d rendezvous on node-0 and a fresh rendezvous id per run (the script follows).

    `--local-addr` is each node's private address: c10d ranks nodes by (address, pid), so with the
    inventory's ascending addresses node-0 gets global rank 0, and workers reach each other there.
    """
    return [
        "-m", "torch.distributed.run",
        f"--nnodes={len(cluster.nodes)}",
        f"--nproc-per-node={nproc_per_node(node.gpus, nproc)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={cluster.head.private_ip}:{master_port}",
        f"--rdzv-id={run_id}",
        f"--local-addr={node.private_ip}",
        f"--max-restarts={max_restarts}",
    ]


def launch_command(cluster: ClusterInfo, node: NodeInfo, run_id: str, task: str, script: str,
                   script_args: list[str], max_restarts: int, master_port: int, nproc: int | None = None) -> str:
    """Source the node environment, record the job, then become torchrun (exec keeps the pid).

    The job runs in its run folder (relative outputs such as plots land there and come back with the
    logs) with the synced code on PYTHONPATH, so any script can `import harness`. `script` may start
    with `$CLUSTER_CODE_DIR/`. The pid recorded is the session leader's, so `stop` can signal the
    whole process group; torchrun's workers (which start their own sessions) are found by
    CLUSTER_RUN_ID in their environment.
    """
    run_dir = remote_run_dir(cluster, run_id)
    torchrun = " ".join(shlex.quote(a) for a in torchrun_argv(cluster, node, run_id, max_restarts, master_port, nproc))
    arguments = " ".join(shlex.quote(a) for a in script_args)
    return " && ".join([
        f". {ENV_FILE}",
        f"mkdir -p {shell_path(run_dir)}",
        f"cd {shell_path(run_dir)}",
        f"echo \"$$ {shlex.quote(run_id)} {shlex.quote(task)}\" > {JOB_FILE}",
        f"exec env CLUSTER_RUN_ID={shlex.quote(run_id)} CLUSTER_RUN_DIR={shell_path(run_dir)} MASTER_PORT={master_port} "
        f"NPROC_PER_NODE={nproc_per_node(node.gpus, nproc)} "
        f"PYTHONUNBUFFERED=1 {FRESH_STORE_PER_ATTEMPT} PYTHONPATH=\"$CLUSTER_CODE_DIR${{PYTHONPATH:+:$PYTHONPATH}}\" "
        f"\"$CLUSTER_PYTHON\" {torchrun} {shell_path(script)} {arguments} 2>&1",
    ])


def shell_path(path: str) -> str:
    """Quote a path for the shell but leave a leading $HOME/ or $CLUSTER_CODE_DIR/ to be expanded."""
    for variable in ("$HOME/", "$CLUSTER_CODE_DIR/"):
        if path.startswith(variable):
            return f"\"{variable[:-1]}\"/" + shlex.quote(path[len(variable):])
    return shlex.quote(path)


# A process is alive if /proc says so and it is not a zombie (where /proc exists), else if kill -0 works.
_ALIVE = (
    "alive() { if [ -r /proc/$1/stat ]; then ! grep -q ') Z ' /proc/$1/stat; "
    "else kill -0 \"$1\" 2>/dev/null; fi; }"
)


def job_status_command() -> str:
    """Prints `running PID RUN_ID TASK`, `idle`, plus `bootstrapped` when the env file exists."""
    return (
        f"{_ALIVE}; "
        f"if [ -f {JOB_FILE} ] && read -r pid run task < {JOB_FILE} && alive \"$pid\"; "
        "then echo \"running $pid $run $task\"; else echo idle; fi; "
        f"[ -f {ENV_FILE} ] && echo bootstrapped || true"
    )


def parse_job_status(output: str) -> tuple[dict | None, bool]:
    """(the running job as {pid, run_id, task} or None, whether the node is bootstrapped)."""
    job = None
    lines = output.split("\n")
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "running":
            job = {"pid": int(parts[1]), "run_id": parts[2], "task": parts[3]}
    return job, "bootstrapped" in (line.strip() for line in lines)


def stop_command(grace_s: int = TERMINATE_GRACE_S) -> str:
    """End the node's job: SIGTERM its process group, SIGKILL after `grace_s`, then any process of
    the run left in another session (torchrun's workers). Prints `stopped RUN_ID` or `idle`."""
    tenths = grace_s * 10
    return (
        f"{_ALIVE}; "
        f"if ! [ -f {JOB_FILE} ] || ! read -r pid run task < {JOB_FILE}; then echo idle; exit 0; fi; "
        "if alive \"$pid\"; then "
        "kill -TERM -- -\"$pid\" 2>/dev/null || kill -TERM \"$pid\" 2>/dev/null; "
        f"i=0; while alive \"$pid\" && [ $i -lt {tenths} ]; do sleep 0.1; i=$((i+1)); done; "
        "kill -KILL -- -\"$pid\" 2>/dev/null; stopped=1; fi; "
        "for env in /proc/[0-9]*/environ; do "
        "if grep -qa \"CLUSTER_RUN_ID=$run\" \"$env\" 2>/dev/null; then p=${env#/proc/}; p=${p%/environ}; "
        "[ \"$p\" != $$ ] && kill -KILL \"$p\" 2>/dev/null && stopped=1; fi; done; "
        f"rm -f {JOB_FILE}; "
        "if [ -n \"$stopped\" ]; then echo \"stopped $run\"; else echo idle; fi"
    )


def python_json_command(python: str, code: str, *args: str) -> str:
    """Run a short Python program on the node and have it print JSON."""
    return " ".join([shlex.quote(python), "-c", shlex.quote(code), *map(shlex.quote, args)])


def parse_last_json(output: str) -> dict:
    """The last line of `output` that is a JSON object (programs may print warnings first)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"no JSON in output: {output.strip()[-200:]!r}")
