"""The job's command line on each node: the node environment bootstrap writes, torchrun's argv, the
variables a launch sets, the whole `launch_command` and its exit marker. Pure functions; every value
that reaches a shell goes through `shlex.quote` (or `shell_path`)."""

import secrets
import shlex
from dataclasses import dataclass
from datetime import datetime, timezone

from infra.inventory import ClusterInfo, NodeInfo
from node import contract
from remote.node_paths import (
    ENV_FILE,
    JOB_FILE,
    code_dir,
    job_workdir,
    node_run_dir,
    python_path,
    remote_run_dir,
    results_dir,
    shell_path,
)

EXIT_MARKER = contract.EXIT_MARKER
DEFAULT_MASTER_PORT = 29500


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
            return (
                f"--nproc-per-node {requested} is more than {node.name}'s {node.gpus} GPU(s): "
                f"use at most {node.gpus} (one process per GPU)"
            )
    return None


def replicas_problem(node_count: int, replicas: int) -> str | None:
    """Why `--replicas replicas` cannot run on `node_count` nodes, or None where it can (0: not asked)."""
    if replicas == 0:
        return None
    if replicas < 2:
        return f"--replicas must be at least 2 (one group is plain DDP: leave --replicas out), not {replicas}"
    if replicas > node_count:
        return (
            f"--replicas {replicas} is more than the cluster's {node_count} node(s): one replica group per node at most"
        )
    if node_count % replicas:
        return (
            f"--replicas {replicas} does not split the cluster's {node_count} nodes into equal groups: "
            f"use a divisor of {node_count}"
        )
    return None


def replica_groups(nodes: tuple[NodeInfo, ...], replicas: int) -> list[tuple[NodeInfo, ...]]:
    """Each replica group's nodes, consecutive in the inventory's order (one node each by default); one
    group of every node where the run is not fault tolerant (`replicas` 0)."""
    count = max(replicas, 1)
    size = len(nodes) // count
    return [tuple(nodes[i * size : (i + 1) * size]) for i in range(count)]


surviving_group = contract.surviving_group
"""The one rule for a fault-tolerant run's end (node/contract.py: the batch job applies it too)."""


def dropped_nodes(groups: list[list[str]], exit_codes: dict) -> list[str]:
    """The nodes of the replica groups that failed while another went on to the end."""
    if not surviving_group(groups, exit_codes):
        return []
    return [name for group in groups if any(exit_codes.get(n) != 0 for n in group) for name in group]


def group_names(nodes: list[str], replicas: int) -> list[list[str]]:
    """`replica_groups` by node name (a run's record keeps names)."""
    size = len(nodes) // max(replicas, 1)
    return [nodes[i * size : (i + 1) * size] for i in range(max(replicas, 1))]


def group_of(cluster: ClusterInfo, node: NodeInfo, replicas: int) -> tuple[int, tuple[NodeInfo, ...]]:
    """(the replica group's number, its nodes) for `node`."""
    for number, members in enumerate(replica_groups(cluster.nodes, replicas)):
        if node in members:
            return number, members
    raise ValueError(f"{node.name} is not a node of {cluster.stack}")


def lighthouse_address(cluster: ClusterInfo, master_port: int) -> str:
    """Where torchft's Lighthouse listens: the head node's private address, never every interface."""
    return f"{cluster.head.private_ip}:{master_port + contract.LIGHTHOUSE_PORT_ABOVE_MASTER}"


def new_run_id(task: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{task}-{secrets.token_hex(2)}"


def node_environment(
    cluster: ClusterInfo, index: int, interface: str, python: str, master_port: int = DEFAULT_MASTER_PORT
) -> dict[str, str]:
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
    return {**env, **cluster.env}


def env_file_text(env: dict[str, str]) -> str:
    lines = ["# Written by `fab bootstrap`; every job on this node sources it."]
    for key, value in env.items():
        # $HOME stays unquoted so the shell expands it; everything else is taken literally.
        quoted = value if value.startswith("$HOME/") and " " not in value else shlex.quote(value)
        lines.append(f"export {key}={quoted}")
    return "\n".join(lines) + "\n"


TORCHRUN = "$CLUSTER_CODE_DIR/node/torchrun.py"


def torchrun_argv(
    cluster: ClusterInfo,
    node: NodeInfo,
    run_id: str,
    max_restarts: int,
    master_port: int,
    nproc: int | None = None,
    replicas: int = 0,
) -> list[str]:
    """torchrun with c10d rendezvous on node-0 and a fresh rendezvous id per run (the script follows).

    `--local-addr` is each node's private address: c10d ranks nodes by (address, pid), so with the
    inventory's ascending addresses node-0 gets global rank 0, and workers reach each other there.
    torchrun runs through node/torchrun.py, which binds the job's stores to the node's address;
    `is_host` says that node-0 hosts the rendezvous (every local node would think itself the host).
    It is started by its path, not as a module, so a project folder of the user's (the working
    directory, whose own `node/` would come first for `-m`) cannot hide it.

    With `replicas` (torchft replica groups), each group is a torchrun job of its own, its rendezvous on
    its first node: a group that fails ends only its own torchrun.
    """
    number, members = group_of(cluster, node, replicas)
    return [
        TORCHRUN,
        f"--nnodes={len(members)}",
        f"--nproc-per-node={nproc_per_node(node.gpus, nproc)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={members[0].private_ip}:{master_port}",
        f"--rdzv-conf=is_host={int(node == members[0])}",
        f"--rdzv-id={run_id}-replica-{number}" if replicas else f"--rdzv-id={run_id}",
        f"--local-addr={node.private_ip}",
        f"--max-restarts={max_restarts}",
    ]


def job_variables(
    cluster: ClusterInfo,
    node: NodeInfo,
    run_id: str,
    nproc: int | None = None,
    python: str | None = None,
    replicas: int = 0,
    master_port: int = DEFAULT_MASTER_PORT,
) -> dict[str, str]:
    """What the launch sets on top of the node environment; each value a word or a path (`shell_path`).

    MASTER_PORT, NPROC_PER_NODE and CLUSTER_PYTHON come from the node environment (`node_environment`,
    which bootstrap writes with the master port every launch uses); a launch sets the last two only
    where it asks for other values (`--nproc-per-node`, `--requirements`)."""
    variables = {
        contract.RUN_ID_VARIABLE: run_id,
        "CLUSTER_RUN_DIR": remote_run_dir(cluster, run_id),
        "CLUSTER_RESULTS_DIR": results_dir(run_id),
        "PYTHONUNBUFFERED": "1",
    }
    if nproc is not None:
        variables["NPROC_PER_NODE"] = str(nproc_per_node(node.gpus, nproc))
    if python:
        variables["CLUSTER_PYTHON"] = python  # the job's own environment (--requirements), for its children
    if replicas:
        variables.update(replica_variables(cluster, node, replicas, master_port))
    return variables


def replica_variables(cluster: ClusterInfo, node: NodeInfo, replicas: int, master_port: int) -> dict[str, str]:
    """A fault-tolerant run's: the group's own MASTER_ADDR, NODE_RANK and NNODES (over the node
    environment's, which name the whole cluster), torchft's Lighthouse and group number; on the head node,
    where node/torchrun.py serves the Lighthouse."""
    number, members = group_of(cluster, node, replicas)
    lighthouse = lighthouse_address(cluster, master_port)
    variables = {
        "MASTER_ADDR": members[0].private_ip,
        "NODE_RANK": str(members.index(node)),
        "NNODES": str(len(members)),
        contract.LIGHTHOUSE_VARIABLE: f"http://{lighthouse}",
        contract.REPLICA_VARIABLE: str(number),
        contract.REPLICAS_VARIABLE: str(replicas),
        # torchft's Rust side logs several INFO lines per step (every quorum), Lighthouse and Managers alike:
        # on a busy node that costs steps. Its warnings stay; `--env RUST_LOG=info` (set after) brings them back.
        "RUST_LOG": "warn",
    }
    if node == cluster.head:
        variables[contract.LIGHTHOUSE_BIND_VARIABLE] = lighthouse
    return variables


@dataclass(frozen=True)
class Stage:
    """What a queued run's job rebuilds from the run's stage on the shared folder where its node lacks it
    (a replaced node): the job's copy of the workdir, the requirements environment."""

    folder: str
    """The run's stage (`node_paths.run_stage`)."""
    files: bool = False
    """The project of `--workdir` is staged (`contract.STAGE_FILES`)."""
    env_dir: str | None = None
    """The `--requirements` environment (relative to the home) that the staged file builds."""


@dataclass(frozen=True)
class EnvValues:
    """Where the job's command finds the `--env` values (`contract.RUN_ENV_VALUES`, written beforehand
    by `env_values_text` over SSH stdin): never on the command line, which every local user can read
    (/proc/PID/cmdline) and which Linux caps at 128 kB per argument."""

    path: str
    """The file on the node (`$HOME/...` or absolute)."""
    once: bool
    """Removed as soon as it is read (a fab-held run starts once); else read at every start (Slurm's requeues)."""


def env_values_text(env: dict[str, str]) -> str:
    """The file `EnvValues` names: one `export KEY='value'` per variable, sourced as written."""
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def env_values_step(values: EnvValues) -> str:
    """Source the values (a missing file is said, in one line, and fails the job before torchrun)."""
    path = shell_path(values.path)
    missing = f"echo 'error: the run'\\''s --env values are gone from {values.path}' >&2"
    step = f"{{ [ -r {path} ] || {{ {missing}; false; }}; }} && . {path}"
    return f"{step} && rm -f {path}" if values.once else step


def reserved_variable(key: str) -> bool:
    """Whether `key` is set by the node environment, torchrun or the launch (not for --env)."""
    return key in contract.RESERVED_VARIABLES or key.startswith(contract.RESERVED_PREFIXES)


def launch_command(
    cluster: ClusterInfo,
    node: NodeInfo,
    run_id: str,
    task: str,
    script: str,
    script_args: list[str],
    max_restarts: int,
    master_port: int,
    nproc: int | None = None,
    job_env: dict[str, str] | None = None,
    pythonpath_first: tuple[str, ...] = (),
    *,
    workdir_key: str | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
    stage: Stage | None = None,
    values: EnvValues | None = None,
    replicas: int = 0,
    locked: bool = False,
) -> str:
    """Source the node environment, make the run's folders, record the job, run torchrun, then print
        the exit marker.

        The job runs in its own folder on each node (`job_workdir`): a copy of the workdir cache
        (`workdir_key`, from `fab run --workdir`) or an empty folder, so two nodes writing the same
        relative file never meet. That folder and the synced code are on PYTHONPATH. `script` may start
        with `$HOME/` or `$CLUSTER_CODE_DIR/`; `python` (a --requirements environment) replaces the node's
        interpreter; `job_env` values (the hang watch's) are shell words (`$HOME`, `${X:-default}` expand)
        and `pythonpath_first` paths come first on PYTHONPATH; `env` (--env) values arrive literally, after
        them, so they win: they are sourced from `values` (required with `env`), never written into the
    command. A queued run's `stage` makes what the node lacks before torchrun starts: the job's
        copy of the workdir, the requirements environment (the same command for a first start and a requeue,
        on a node that kept them or on its replacement). The hang watch's progress folder is made fresh, old
        runs' folders removed. `locked`: the launch holds the head node's job lock for as long as the job
        runs (a fab-held run), and the head node's torchrun starts no rank once it holds it no more. The
        pid recorded is the session leader's, so `stop` can signal the whole process group; torchrun's
        workers (which start their own sessions) are found by CLUSTER_RUN_ID in their environment. The
        marker carries the time this node saw torchrun end, by its own clock, so fail-fast can name the
        node that failed first however late its SSH call returns.
    """
    variables = job_variables(cluster, node, run_id, nproc, python, replicas, master_port)
    if locked and node == cluster.head:
        variables[contract.JOB_LOCK_VARIABLE] = f"$HOME/{contract.JOB_LOCK}"
    assignments = [f"{key}={shell_path(value)}" for key, value in variables.items()]
    assignments += [f"{key}={value}" for key, value in (job_env or {}).items()]
    search_path = ":".join(shell_path(p) for p in python_path(run_id, pythonpath_first))
    assignments.append(f'PYTHONPATH={search_path}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    if env and values is None:
        raise ValueError("--env values go in a file (EnvValues), never on the job's command line")
    interpreter = shell_path(python) if python else '"$CLUSTER_PYTHON"'
    torchrun = " ".join(
        shell_path(a) for a in torchrun_argv(cluster, node, run_id, max_restarts, master_port, nproc, replicas)
    )
    arguments = " ".join(shlex.quote(a) for a in script_args)
    progress = f"~/{contract.PROGRESS}"
    return (
        " && ".join(
            [
                f". {ENV_FILE}",
                f"mkdir -p {shell_path(remote_run_dir(cluster, run_id))} {shell_path(results_dir(run_id))}",
                workdir_step(run_id, workdir_key, stage),
                *environment_step(stage),
                f"cd {shell_path(job_workdir(run_id))}",
                f"rm -rf {progress} && mkdir -p {progress}/{shlex.quote(run_id)}",
                f'echo "$$ {shlex.quote(run_id)} {shlex.quote(task)}" > {JOB_FILE}',
                f"export {' '.join(assignments)}",
                *([env_values_step(values)] if env and values else []),
                f"{interpreter} {torchrun} {shell_path(script)} {arguments} 2>&1",
            ]
        )
        + f'; code=$?; echo "{EXIT_MARKER} $code ${{EPOCHREALTIME:-$(date +%s.%N)}}"; exit $code'
    )


def workdir_step(run_id: str, workdir_key: str | None, stage: Stage | None = None) -> str:
    """The job's folder: a copy (never links: a job writing a file would change the cache) or empty. With
    a staged project, the copy the node already has (made at submit, or by an earlier start), else one
    from the stage, made under another name and renamed once whole."""
    target = shell_path(job_workdir(run_id))
    if stage is not None and stage.files:
        partial = shell_path(f"{node_run_dir(run_id)}/{contract.RUN_WORKDIR_PARTIAL}")
        staged = shell_path(f"{stage.folder}/{contract.STAGE_FILES}")
        return (
            f"{{ [ -d {target} ] || {{ rm -rf {partial} && cp -pR {staged} {partial} && mv {partial} {target}; }}; }}"
        )
    if workdir_key is None:
        return f"mkdir -p {target}"
    files = contract.in_home(f"{contract.workdir_cache(workdir_key)}/{contract.WORKDIR_FILES}")
    return f"cp -pR {shell_path(files)} {target}"


def environment_step(stage: Stage | None) -> list[str]:
    """The requirements environment made from the staged file where the node has none ready (job_env.py
    decides, by the node venv's interpreter, as the launch's install does); nothing without one."""
    if stage is None or stage.env_dir is None:
        return []
    env_dir = contract.in_home(stage.env_dir)
    arguments = [env_dir, f"{stage.folder}/{contract.STAGE_REQUIREMENTS}", f"{env_dir}.log"]
    if stage.files:  # the file's relative paths (--find-links wheels) are the project's
        arguments.append(f"{stage.folder}/{contract.STAGE_FILES}")
    words = " ".join(shell_path(a) for a in arguments)
    return [f'"$CLUSTER_PYTHON" {shell_path("$CLUSTER_CODE_DIR/node/job_env.py")} --job {words}']


def parse_exit_marker(line: str) -> tuple[int, float | None] | None:
    """(exit code, the node's epoch seconds) from the exit marker line; None for any other line."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != EXIT_MARKER:
        return None
    try:
        code = int(parts[1])
    except ValueError:
        return None
    try:  # bash's EPOCHREALTIME uses the locale's decimal point; `date` without %N (macOS) has none
        return code, float(parts[2].replace(",", "."))
    except ValueError:
        return code, None
