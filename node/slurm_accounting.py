"""Slurm's accounting on the head node: slurmdbd over a MariaDB of this node's own, so that `sacct` lists
the cluster's jobs (state, exit code, nodes, times) after Slurm's controller has forgotten them, and
tools that follow jobs through `sacct` (torchx's Slurm scheduler) can.

Where the description asks for it (`"accounting": true`, a `slurmdbd` port), the head node runs, before
slurmctld, as this node's user and in its scheduler folder:

- mariadbd, its data in `db/` (made once by mariadb-install-db, kept across restarts and `fab bootstrap`),
  with no network at all: it answers on a Unix socket, and only to this node's user (unix_socket
  authentication: no password exists anywhere);
- slurmdbd (slurmdbd.conf, 0600, beside slurm.conf), on the address the other daemons bind.

Every node's slurm.conf points AccountingStorageHost at the head node. Standard library only.
"""

import os
import pwd
import subprocess

from node.slurm_conf import Cluster, DaemonError, Paths

INSTALL_TIMEOUT_S = 120.0
PROGRAMS = {"mariadbd": "mariadb-server", "mariadb-install-db": "mariadb-server", "slurmdbd": "slurmdbd"}


def data_folder(paths: Paths) -> str:
    return os.path.join(paths.folder, "db")


def database_socket(paths: Paths) -> str:
    return os.path.join(paths.sockets, "db.socket")


def dbd_conf_path(paths: Paths) -> str:
    return os.path.join(paths.folder, "slurmdbd.conf")


def dbd_conf(cluster: Cluster, paths: Paths, host: str, bound: str, user: str) -> str:
    """slurmdbd.conf: the head node's slurmdbd, its MariaDB reached on the Unix socket as this user."""
    return (
        "\n".join(
            [
                "# Written by gpu-cluster (node/slurm_accounting.py); `start` rewrites it and restarts on a change.",
                "AuthType=auth/munge",
                f"AuthInfo=socket={paths.munge_socket}",
                f"DbdHost={host}",
                f"DbdAddr={bound}",
                f"DbdPort={cluster.slurmdbd_port}",
                # its socket on the address of the host's name, as the other daemons' (never the wildcard)
                "CommunicationParameters=NoInAddrAny",
                f"SlurmUser={user}",
                f"PidFile={os.path.join(paths.folder, 'slurmdbd.pid')}",
                f"LogFile={paths.log('slurmdbd')}",
                "DebugLevel=info",
                "StorageType=accounting_storage/mysql",
                "StorageHost=localhost",  # the client library's Unix socket: MYSQL_UNIX_PORT (`environment`)
                f"StorageUser={user}",
                "StorageLoc=slurm_acct_db",
            ]
        )
        + "\n"
    )


def environment(paths: Paths) -> dict:
    """What slurmdbd's MariaDB client needs: the database's socket."""
    return {"MYSQL_UNIX_PORT": database_socket(paths)}


def mariadbd_argv(program: str, paths: Paths) -> list:
    return [
        program,
        "--no-defaults",
        f"--datadir={data_folder(paths)}",
        f"--socket={database_socket(paths)}",
        "--skip-networking",  # no TCP socket at all: slurmdbd comes over the Unix socket
        f"--pid-file={os.path.join(paths.folder, 'mariadbd.pid')}",
        f"--log-error={paths.log('mariadbd')}",
        "--innodb-buffer-pool-size=32M",  # a job table, not a database server's usual 128 MiB
        "--skip-log-bin",
        f"--user={pwd.getpwuid(os.getuid()).pw_name}",  # this node's user, who owns the data (root must say so)
    ]


def install(program: str, paths: Paths, user: str) -> None:
    """The database's data folder, made once (about 4 s): kept across restarts, so accounting is too."""
    folder = data_folder(paths)
    if os.path.isdir(os.path.join(folder, "mysql")):
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        result = subprocess.run(
            [
                program,
                "--no-defaults",
                f"--datadir={folder}",
                "--auth-root-authentication-method=socket",
                f"--auth-root-socket-user={user}",
                f"--user={user}",
                "--skip-test-db",
            ],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise DaemonError(f"mariadb-install-db did not finish within {INSTALL_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        tail = " | ".join(result.stderr.strip().splitlines()[-3:])
        raise DaemonError(f"mariadb-install-db failed: {tail}")
