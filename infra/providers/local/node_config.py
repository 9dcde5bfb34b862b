"""What `deploy.py up --local` and a local node's server (node_server.py) share: the server's module, the node's
pid registry, the node's configuration file and its token. Apart from the server, so that `deploy.py` commands
start without the server's SSH library (asyncssh): only `up` makes keys, and it loads it then."""

import json
from dataclasses import dataclass
from pathlib import Path

from node import contract

SERVER_MODULE = "infra.providers.local.node_server"
SUPERVISOR_MODULE = "infra.providers.local.supervisor"
TOKEN_VARIABLE = "CLUSTER_NODE_TOKEN"
# Daemons started on the node (the watchdog, a detached job) register `<name>.pid` here, so that
# powering the node off ends them too, as it would on a real machine.
PID_REGISTRY = contract.PIDS


@dataclass(frozen=True)
class NodeConfig:
    """What `deploy.py up --local` tells one node server."""

    name: str
    """`node-<i>`."""
    address: str
    """The loopback address to bind."""
    port: int
    """The SSH port to bind."""
    host_key: str
    """Path of the node's ed25519 host key."""
    authorized_key: str
    """The one public key allowed to log in (the cluster's)."""
    user: str
    """The one user name allowed to log in."""
    home: str
    """The node's home folder: each command's working directory and `$HOME`."""
    shared_dir: str
    """The folder all nodes share (`$CLUSTER_SHARED_DIR`)."""
    pid_file: str
    """Written once the port is bound: the server's pid alone (`kill $(cat sshd.pid)`); its time of
    writing is the node's start (`read_pid`)."""
    token: str
    """Put in every session's environment as CLUSTER_NODE_TOKEN, so power-off finds all it started."""
    metadata_port: int = 0
    """The port of the node's instance metadata service on `address` (metadata.py); 0: none."""
    notice_file: str = ""
    """Where the operator posts a spot notice for this node; the node powers off at its time."""

    @classmethod
    def load(cls, path: str) -> "NodeConfig":
        return cls(**json.loads(Path(path).read_text()))


def token_entry(token: str) -> str:
    return f"{TOKEN_VARIABLE}={token}"


def pid_text(pid: int) -> str:
    """A pid file's text: the pid and a newline, as daemons write them."""
    return f"{pid}\n"


def read_pid(path: Path) -> tuple[int, float] | None:
    """The node server's pid from its pid file, and when the file was written (the node's start); None
    where there is none or it holds no pid. A pid file written before it held the pid alone (JSON with a
    `pid`) is read too, so a `down` after an upgrade still finds the servers."""
    try:
        text, written_at = path.read_text(), path.stat().st_mtime
    except OSError:
        return None
    if text.strip().isdigit():
        return int(text), written_at
    try:
        record = json.loads(text)
        return int(record["pid"]), float(record.get("started_at", written_at))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
