"""The node contract: every path, file and environment variable name of the node side, spelled once.

The files under `~/.gpu-cluster`, the stop marker and the watchdog's heartbeat in the shared folder,
each rank's progress files, a run's folders, the exit marker of the launch command and the variables
a launch reserves. Paths under the home are relative to it, as SFTP takes them; `shell()` gives the
`~/...` form for commands. Standard library only, Python 3.7 syntax: bootstrap, `fab`, the providers
and the harness import it, the node scripts import it beside them, the rank monitor loads it by its
path, and stop_jobs.py and cleanup.py carry its text (standalone.py).
"""

HOME_DIR = ".gpu-cluster"
ENV = f"{HOME_DIR}/env"
"""The node environment every job sources (written by bootstrap's env stage)."""
STATE = f"{HOME_DIR}/state.json"
"""Each bootstrap stage's digest and facts on this node."""
JOB = f"{HOME_DIR}/job"
"""`PID RUN_ID TASK` of the job running on this node (its session leader)."""
JOB_LOCK = f"{HOME_DIR}/job.lock"
"""flock'd on the head node by the launch that owns the cluster's one job (node/job_lock.py)."""
PIDS = f"{HOME_DIR}/pids"
"""Daemons started on the node register `<name>.pid` (a process group id) here."""
WARM = f"{HOME_DIR}/warm"
"""The warm launcher's folder (node/warm.py), mode 0700: its socket `launcher.sock` (0600), its log
`launcher.log`, and `ranks/<pid>`, the environment of each rank it forked, while that rank runs."""
WARM_SOCKET = f"{WARM}/launcher.sock"
WARM_LOG = f"{WARM}/launcher.log"
WARM_RANKS = f"{WARM}/ranks"
WARM_SHORT_FOLDER = "/tmp/gpu-cluster-warm-{uid}-{key}"
"""The warm launcher's socket folder where the home is too deep for a socket's path (at most 108 bytes)."""
WARM_PID = f"{PIDS}/warm-launcher.pid"
"""The warm launcher's process group, while it runs (`deploy.py down` ends it with the other daemons)."""
WARM_VARIABLE = "GPU_CLUSTER_WARM_LAUNCH"
"""`1`: torchrun's ranks are forked from the node's warm launcher (node/warm.py) where it can serve them;
`0`: every rank starts a fresh interpreter, as torchrun starts it. Not reserved: `--env` may set it."""
VENV = f"{HOME_DIR}/venv"
"""The node venv, layered over the inventory's `python`."""
REQUIREMENTS = f"{HOME_DIR}/requirements-node.txt"
"""What the venv installs where torch is missing."""
CODE = f"{HOME_DIR}/code"
"""harness/, examples/ and node/, where the cluster has no shared folder."""
RUNS = f"{HOME_DIR}/runs"
"""Each run's node-local folder, on every node: `<run-id>/workdir` (the job's working directory) and
`<run-id>/results` (`$CLUSTER_RESULTS_DIR`); also the run folder itself where there is no shared folder."""
WORKDIRS = f"{HOME_DIR}/workdirs"
"""`fab run --workdir` caches, one per project folder: `<key>/files/`, `manifest.json` and `digest`."""
ENVS = f"{HOME_DIR}/envs"
"""`fab run --requirements` environments, one per requirements file: `<digest>/` (a venv), with
`<digest>.txt` (the file), `<digest>.log` (pip's output) and `<digest>.lock` (held while it is made) beside it."""
UV_CACHE = f"{HOME_DIR}/uv-cache"
"""uv's cache for the node venv and every `--requirements` env: in the home folder, on the venvs' own
filesystem (uv hard-links from it; across filesystems, such as the shared folder, it copies every file)."""
HOME_CLAIMS = f"{HOME_DIR}/homes"
"""Bootstrap's first step: each node leaves a file of its own here, then lists them; a node that finds
another's shares its home with it (NFS `$HOME`), and bootstrap refuses the cluster."""
PROGRESS = f"{HOME_DIR}/progress"
"""`<run-id>/rank-<R>.json`: each rank's collective progress, for hang detection (always node-local)."""
WATCHDOG_PID = f"{PIDS}/watchdog.pid"
"""The detached watchdog's process group."""
WATCHDOG_LOG = f"{HOME_DIR}/watchdog.log"
"""The detached watchdog's output."""
WATCHDOG_UNIT = "gpu-cluster-watchdog"
"""The systemd unit of the watchdog, where the node runs systemd."""
WATCHDOG_UNIT_FILE = f"{HOME_DIR}/{WATCHDOG_UNIT}.service"
"""The unit file as sent, before it is installed into /etc/systemd/system."""
SCHEDULER = f"{HOME_DIR}/slurm"
"""The scheduler's folder on every node (node/scheduler.py): the Slurm and munge configuration, state,
logs and sockets of this node's daemons."""
SLURM_CONF = f"{SCHEDULER}/slurm.conf"
"""This node's slurm.conf; clients (`sbatch`, `squeue`, `scancel`) find it through `SLURM_CONF`."""
SLURM_EXISTING = f"{SCHEDULER}/existing.json"
"""Where the hosts already run Slurm (`slurm: existing`) and runs go to it: {"partition", "conf" (its
slurm.conf, '' for Slurm's default), "tag" (the comment this stack's jobs carry), "names" (node-i: the
node's NodeName there)}. Written by bootstrap on every node; its presence means no daemon here is ours."""
SLURM_LOGIN = f"{HOME_DIR}/slurm-login.sh"
"""`export SLURM_CONF=...` (and SQUEUE_FORMAT) for a login on this node, written where Slurm holds the
cluster's runs (node/slurm_login.py); every shell sources it, so Slurm's clients work as typed."""
GRES_CONF = f"{SCHEDULER}/gres.conf"
"""The GPUs of the nodes that have any, beside slurm.conf (Slurm reads it from the same folder)."""
SCHEDULER_DIGEST = f"{SCHEDULER}/digest"
"""The digest of the configuration (and munge key) the running daemons were started with."""
MUNGE = f"{SCHEDULER}/munge"
"""munged's key (0400), socket, pid, seed and log: this node's own, never /etc/munge or /run/munge."""
JOB_COMPLETIONS = f"{SCHEDULER}/jobcomp.log"
"""On the head node: Slurm's job-completion log (jobcomp/filetxt), one line per ended job."""
SCHEDULER_SHORT_FOLDER = "/tmp/gpu-cluster-{uid}-{key}"
"""Where this node's Unix sockets (munge's, slurmd's spool with the steps' sockets) go when the home is too
deep for them: a socket's path is at most 108 bytes. `key` is a digest of the scheduler folder's path."""
RUN_END_MARKER = "__GPU_CLUSTER_RUN_END__"
"""The line `slurm_run.py follow` ends with, after a newline of its own: `RUN_END_MARKER STATE EXIT_CODE
LOG_BYTES` (Slurm's job state; the log's size, where the log ends and this line begins)."""
FOLLOW_FAILED_MARKER = "__GPU_CLUSTER_FOLLOW_FAILED__"
"""The last line `slurm_run.py follow` writes on its stderr where it cannot learn the run's end (the
controller does not answer): `FOLLOW_FAILED_MARKER WHY`."""
HANG_RECORD = "hang.json"
"""In a scheduled run's folder on the head node: the cluster-side hang watch's verdict, where it found one."""
STRAGGLER_RECORD = "stragglers.json"
"""In a run's local folder: the ranks the straggler verdict named (node/straggler.py), as the hang watch found them."""
STEP_TIMES = "step-times"
"""In a run's folder on the shared folder (`$CLUSTER_STEP_TIMES_DIR`, set only where the cluster has one): each
rank's last step times, `rank-<RANK>.json` (`rank_progress`), one line of JSON {rank, node, compute}, rewritten by
its monitor every `CLUSTER_STEP_TIMES_INTERVAL_S` while it steps. The hang watches read them on the head node for
the straggler verdict, so that a slow node's own answer is not waited for (node/straggler.py, `SharedLooks`)."""
STEP_TIMES_VARIABLE = "CLUSTER_STEP_TIMES_DIR"
"""Where a rank's monitor writes its step times on the shared folder (a run's `STEP_TIMES`); unset: nowhere."""
RUN_LOG = "output.log"
"""A scheduled run's log in its run folder on the head node: every node's output, `[node-i] `-prefixed."""
SCHEDULER_DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "spot-watch")
"""The scheduler's daemons, in start order (mariadbd, slurmdbd and slurmctld run on the head node only, the
first two where the cluster keeps Slurm's accounting: node/slurm_accounting.py; spot-watch is
node/spot_watch.py, which drains this node and tells its ranks on a spot interruption notice)."""
PREEMPTED_RECORD = "preempted.json"
"""In a scheduled run's folder on the head node: the last spot notice that requeued the run (node, reason,
the restart it began)."""
RESTARTS_RECORD = "restarts.jsonl"
"""In a scheduled run's folder on the head node: one line per restart after a requeue (`restart`, `at`: when
it started again, `stopped_at`: when it was requeued where its batch job said, `nodes`: the nodes that went),
so `deploy.py cost` prices the time the run stood idle."""
HEALS_RECORD = "heals.jsonl"
"""In a fault-tolerant run's folder on the head node: one line per replica group started again on a replaced
node (`group`, `nodes`, `stopped_at`: when its batch job saw the group's nodes leave, `at`: when the group's
first step back was written, else when it started), so `deploy.py cost` prices the group's interruption
as a requeue's restart is priced."""
METRICS_FILE = "metrics.jsonl"
"""In a run's folder (`CLUSTER_RUN_DIR`): the metrics lines, among them a fault-tolerant run's per-step
contract lines (`participants`), which `fab jobs` reads for a running run. GPU samples are not here: they go
to each node's `GPU_SAMPLES` file, so a long run's samples never push this file past the fetch limit."""
GPU_SAMPLES_PREFIX, GPU_SAMPLES_SUFFIX = "gpu-", ".jsonl"
"""In a run's folder: `gpu-<node>.jsonl`, one node's NVML samples (`gpu`, `xid` and `gpu_error` records,
node/nvml.py), bounded at `GPU_SAMPLES_MAX_BYTES` by thinning: the whole run at an ever coarser step."""
GPU_SAMPLES_MAX_BYTES = 2_000_000
"""A node's GPU samples file is thinned to half its samples when it would grow past this (8 GPUs every 5 s:
about 2.5 kB a round, so the first thinning comes after about an hour)."""


def gpu_samples(node: str) -> str:
    """The name of `node`'s GPU samples file in a run's folder."""
    return f"{GPU_SAMPLES_PREFIX}{node}{GPU_SAMPLES_SUFFIX}"


def is_gpu_samples(name: str) -> bool:
    return name.startswith(GPU_SAMPLES_PREFIX) and name.endswith(GPU_SAMPLES_SUFFIX)


END_RECORD = "ended.json"
"""In a scheduled run's folder on the head node: the batch job's own end (the step's exit status, when), for
a Slurm that forgets an ended job (MinJobAge) and keeps no accounting (an existing one without slurmdbd)."""
FIRST_START_RECORD = "started.json"
"""In a scheduled run's folder on the head node: when its batch job first started (a requeue starts it again;
Slurm keeps only the last start, and the run is priced from the first)."""
SPOT_DRAIN_REASON = "spot interruption notice"
"""How a Slurm node drained by spot-watch's notice starts its reason (`sinfo -o %E`)."""
NODE_LOST_REASON = "node lost"
"""How the reason of a node set DOWN by gpu-cluster's replacement (a node found dead) starts."""
STRAGGLER_DRAIN_REASON = "straggler"
"""How the reason of a node drained for `--on-straggler replace` starts (its run is requeued and the node
powered off, to be replaced as a reclaimed spot node is: node/slurm_run.py)."""
RESTART_COUNT_VARIABLE = "CLUSTER_RESTART_COUNT"
"""In every rank: how many times the run was requeued and started again (0 on the first start)."""
SCHEDULER_VARIABLE = "CLUSTER_SCHEDULER_DIR"
"""Carried by the scheduler's daemons (and what they fork): this node's scheduler folder, so `stop`
finds them all where several nodes share one machine."""


def surviving_group(groups: list, exit_codes: dict) -> bool:
    """The one rule for a fault-tolerant run's end, for both holders and the batch job that holds it under
    Slurm: it completed where every node of at least one replica group (node names) exited 0."""
    return any(all(exit_codes.get(name) == 0 for name in group) for group in groups)


MAX_GROUP_STARTS = 5
"""Starts of one replica group again that failed, after which it is not started again (a fault of its own)."""

RUN_ROOM_MB = 64
"""The least room a run needs free on a node's disk and in the shared folder (its log, the ranks' files, results,
Slurm's spool): a launch onto less is refused, and a node Slurm drained while its disk was full is resumed only
once it has this much again."""


def groups_to_restart(groups: list, back: set, running: set, ended: dict) -> list:
    """The one rule for which replica groups of a fault-tolerant run start again now, for both holders (the
    fab holder's launch, the Slurm holder's batch job): every node of the group (node names) is `back` in
    service after a replacement (what says so is the holder's fact), no start of the group runs (`running`:
    group numbers), and its last start did not end 0 (`ended`: {group: its starts' exit codes}) nor has
    failed MAX_GROUP_STARTS times. Group 0 never: it holds the Lighthouse (and, under Slurm, the batch job);
    its loss is the checkpoint's."""
    due = []
    for number, members in enumerate(groups):
        codes = ended.get(number, [])
        if number == 0 or number in running or 0 in codes or len(codes) >= MAX_GROUP_STARTS:
            continue
        if all(name in back for name in members):
            due.append(number)
    return due


def json_objects(lines) -> list:
    """The JSON objects among `lines`, one a line (a node's answers, the ranks' step times); any other line,
    and a line that is not whole, is skipped."""
    import json  # here: this file imports nothing at its top (standalone.py carries its text)

    found = []
    for line in lines:
        text = line.strip()
        if not text.startswith("{"):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def daemon_pid(name: str) -> str:
    """The registered process group of a detached daemon (`PIDS`), which power-off and `down` end."""
    return f"{PIDS}/{name}.pid"


SYNCED = ("harness", "examples", "node")
"""The code folders bootstrap syncs (relative to the repository and to the code folder)."""

SHARED_STATE = ".gpu-cluster"
"""Under the shared folder (`$CLUSTER_SHARED_DIR`): what every node sees of the watchdog."""
STOP_MARKER = f"{SHARED_STATE}/stop.json"
"""Relative to the shared folder: the watchdog writes it with the reason; every node powers itself off
when it appears (cloud-init's guard on AWS, the node server on the local provider)."""
POWER_OFF_DIR = f"{SHARED_STATE}/power-off"
"""Relative to the shared folder: a file named after a node tells that node to power itself off, as the
stop marker tells every node (`--on-straggler replace`: the spot path then replaces it). Only a marker
written after the machine started counts: its replacement, with the same name, stays up."""


def power_off_marker(node: str) -> str:
    """Relative to the shared folder: the marker that powers `node` off (POWER_OFF_DIR)."""
    return f"{POWER_OFF_DIR}/{node}"


WATCHDOG_HEARTBEAT = f"{SHARED_STATE}/watchdog.json"
"""Relative to the shared folder: the watchdog's last check (its pid, the cost so far, its guards)."""
SCHEDULER_STATE = f"{SHARED_STATE}/slurm-state"
"""Relative to the shared folder: slurmctld's StateSaveLocation (the queue outlives a replaced head node)."""
NODE_ADDRESSES = f"{SHARED_STATE}/hosts"
"""Relative to the shared folder: where nodes that move (AWS spot workers) write their address at boot, one
file per node name; every node's /etc/hosts maps the names from it (Slurm knows such nodes by name)."""
JOIN_KIT = f"{SHARED_STATE}/join.json"
"""Relative to the shared folder (0600): what a replacement node needs to join with nobody connected
(node/join.py): the interpreter, the venv's requirements, each node's env file, the scheduler's
description with the munge key. Written by bootstrap's scheduler stage."""


def node_run(run_id: str) -> str:
    """A run's node-local folder."""
    return f"{RUNS}/{run_id}"


def workdir_cache(key: str) -> str:
    """The cache of one project folder (`remote/workdir.py` names the key)."""
    return f"{WORKDIRS}/{key}"


def progress_dir(run_id: str) -> str:
    """A run's progress folder on each node (`$CLUSTER_PROGRESS_DIR`)."""
    return f"{PROGRESS}/{run_id}"


RANK_PROGRESS_GLOB = "rank-*.json"
"""In a progress folder: matches every rank's progress file, and its dump (`rank_dump`) too."""
DUMP_SUFFIX = ".fr.json"
"""How a rank's dump ends, to tell it from the progress files `RANK_PROGRESS_GLOB` matches."""
DUMP_REQUEST = "dump.request"
"""In a progress folder: written by `node/hang.py collect`; each rank answers with its dump."""


def rank_progress(rank) -> str:
    """In a progress folder: the rank's progress, rewritten every second by its monitor."""
    return f"rank-{rank}.json"


def rank_dump(rank) -> str:
    """In a progress folder: the rank's whole flight-recorder buffer and thread stacks, on request."""
    return f"rank-{rank}{DUMP_SUFFIX}"


RUN_WORKDIR = "workdir"
"""In a run's node-local folder: the job's working directory (a copy of the workdir cache, or empty)."""
RUN_RESULTS = "results"
"""In a run's node-local folder: `$CLUSTER_RESULTS_DIR`."""
RUN_WORKDIR_PARTIAL = f"{RUN_WORKDIR}.partial"
"""In a run's node-local folder: the job's working directory while it is copied from the run's stage (renamed
to `RUN_WORKDIR` once whole, so a copy cut short is never taken for the project)."""
RUN_COPIES = (RUN_WORKDIR, RUN_WORKDIR_PARTIAL, RUN_RESULTS)
"""What `fab clean-runs` removes from a run's node-local folder."""
RUN_STAGE = "stage"
"""In a queued run's folder on the shared folder: what a node needs to run it that is not on the shared folder
otherwise, copied once at submit (a later sync does not change it): `STAGE_FILES` (the project of
`--workdir`) and `STAGE_REQUIREMENTS` (the `--requirements` file). A node's job that lacks its workdir copy
or its requirements environment (a replaced node) makes them from here. `fab clean-runs` removes old ones."""
STAGE_FILES = "files"
"""In a run's stage: the project's files, as the workdir cache held them at submit."""
STAGE_REQUIREMENTS = "requirements.txt"
"""In a run's stage: the requirements file, as sent at submit."""
RUN_ENV_VALUES = "env-values"
"""The run's `--env` and `--env-file` values (0600, `export KEY='value'` lines), which the job's command
sources so that no value is on any command line: in a fab-held run's node-local folder, removed by the
command once read; for a Slurm-held run in its stage (or, without a shared folder, each node's run folder),
read at every start and removed when the run is seen ended."""

MARKER_START = "__gpu_cluster_"
"""How every line a launch prints for fab (never shown) starts, at the start of a line."""
EXIT_MARKER = f"{MARKER_START}exit__"
"""The line a launch command prints after torchrun returns: its exit code and the node's own clock."""
RANKS_MARKER = f"{MARKER_START}ranks__"
RESTART_LINE = "[cluster] restart"
"""How a Slurm-held run's batch job begins its log at each start after a requeue: what the nodes said of the
earlier start (their markers) is forgotten there (infra/runlog.py), as the batch job's own exit code reads the
log since its step began (node/slurm_exit.py)."""
"""The line node/torchrun.py prints when torchrun returns: how the ranks that failed exited (torchrun's
failure record), and whether any rank formed a process group; JSON after the marker."""

RUN_ID_VARIABLE = "CLUSTER_RUN_ID"
"""Carried by every process of a launch (ranks, torchrun, the job lock's holder): how they are found."""
JOB_LOCK_VARIABLE = "CLUSTER_JOB_LOCK"
"""Set on the head node of a run held by fab's connections: the job lock its launch holds (`JOB_LOCK`).
node/torchrun.py starts no rank where that launch holds it no more (a `fab stop` ended the holder first)."""
RUN_ID_PATTERN = r"[0-9]{8}-[0-9]{6}-[a-z0-9-]+-[0-9a-f]{4}"
"""How a run id reads (`20261128-081210-run-ddp-4570`): the name of a run's Slurm job, by which `fab stop`
knows the stack's jobs in Slurm's queue from a user's own."""
NODE_VARIABLE = "CLUSTER_NODE"
"""The node's name (`node-<i>`), which tells nodes apart where several share one machine."""
PROGRESS_VARIABLE = "CLUSTER_PROGRESS_DIR"
"""Where a rank's monitor writes (the run's `progress_dir`)."""
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
)
"""What torchrun gives every worker, beside what the node environment and the launch set."""
LIGHTHOUSE_BIND_VARIABLE = "CLUSTER_LIGHTHOUSE_BIND"
"""Set on the head node of a fault-tolerant run (`--replicas`): the address:port its node/torchrun.py
serves torchft's Lighthouse on, for as long as its torchrun runs."""
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
"""torchft's own: the Lighthouse's URL, which every replica group's Manager reads."""
REPLICA_VARIABLE = "REPLICA_GROUP_ID"
"""torchft's examples' name: this node's replica group, 0..N-1."""
REPLICAS_VARIABLE = "NUM_REPLICA_GROUPS"
"""torchft's examples' name: how many replica groups the run started with."""
LIGHTHOUSE_PORT_ABOVE_MASTER = 61
"""The Lighthouse listens on MASTER_PORT + this on the head node: above the 60 ports Slurm's daemons take
(remote/bootstrap_slurm.py SCHEDULER_PORTS)."""
RESERVED_PREFIXES = ("CLUSTER_", "TORCHELASTIC_")
"""Variables a user's --env may not set: any of these prefixes, and `RESERVED_VARIABLES`."""
RESERVED_VARIABLES = (
    "NODE_RANK",
    "NNODES",
    "NPROC_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    LIGHTHOUSE_VARIABLE,
    REPLICA_VARIABLE,
    REPLICAS_VARIABLE,
    *TORCHRUN_VARIABLES,
)
"""The node environment's, torchrun's and the launch's own variables."""


def job_env(digest: str) -> str:
    """The environment of one requirements file."""
    return f"{ENVS}/{digest}"


ENV_READY = ".installed"
"""In a requirements environment: written only after pip succeeded; holds the interpreter it is layered over."""
WORKDIR_FILES = "files"
"""In a workdir cache: the synced files."""
WORKDIR_MANIFEST = "manifest.json"
"""In a workdir cache: {path: sha256} of the files, written after a sync completes."""
WORKDIR_DIGEST = "digest"
"""In a workdir cache: the manifest's digest, which a launch's first command reads."""


def in_home(path: str) -> str:
    """`path` (relative to the home) as `$HOME/path`: a shell expands it (`shell_path` leaves it unquoted)."""
    return f"$HOME/{path}"


def home_relative(path: str) -> str:
    """`$HOME/x` as `x`, for a program's argument list (programs start in the home); other paths as they are."""
    return path[len("$HOME/") :] if path.startswith("$HOME/") else path


def shell(path: str) -> str:
    """`path` (relative to the home) for a shell command: `~/` expands, nothing else does."""
    return f"~/{path}"


METADATA_ENDPOINT_VARIABLE = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
"""botocore's own variable: where the node's instance metadata service answers. The local provider
sets it in every session on its nodes (each node serves its own); on EC2 it is unset."""
METADATA_DEFAULT_ENDPOINT = "http://169.254.169.254"
"""EC2's instance metadata service, where the variable above is unset."""
IMDS_TOKEN_PATH = "/latest/api/token"
"""IMDSv2: `PUT` here with `IMDS_TTL_HEADER` for a session token."""
IMDS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
"""IMDSv2: the token's lifetime asked for (1..21600 s), and given back with the token."""
IMDS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
"""IMDSv2: the token, on every `GET`."""
SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
"""404 until the instance is to be reclaimed, then `{"action": "terminate", "time": ISO UTC}`
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html)."""
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
"""404 until the instance is at elevated risk of interruption, then `{"noticeTime": ISO UTC}`
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html)."""
