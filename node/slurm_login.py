"""Slurm's clients as a Slurm user types them: `squeue`, `sinfo`, `sbatch` on any node, in any login, with
no `eval ... scheduler.py env` first.

Where Slurm holds the cluster's runs, `write` puts what `scheduler.py env` prints into one file
(contract.SLURM_LOGIN) and a line at the top of `~/.bashrc` that sources it, marked as ours. bash reads
`~/.bashrc` for an interactive shell and for a command sshd runs (Debian's and Ubuntu's bash are built
with SSH_SOURCE_BASHRC), and the line comes before the usual `[ -z "$PS1" ] && return`, so both
`ssh node squeue` and a terminal have SLURM_CONF. The local provider's node servers source the file in
every shell themselves. `remove` takes the file away (the line stays, and does nothing without it).
A SLURM_CONF the login already has wins. Standard library only.
"""

import os
import shlex

from node import contract

MARK = "# gpu-cluster: Slurm's clients find the cluster's Slurm"
LINE = f'[ -f "$HOME/{contract.SLURM_LOGIN}" ] && . "$HOME/{contract.SLURM_LOGIN}"  {MARK}\n'


def text(environment: dict) -> str:
    """The login file: each variable exported unless the login has its own already."""
    lines = [f"# Written by gpu-cluster (node/slurm_login.py): what `scheduler.py env` prints. {MARK}."]
    for key, value in environment.items():
        lines.append(f'[ -n "${{{key}:-}}" ] || export {key}={shlex.quote(value)}')
    return "\n".join(lines) + "\n"


def write(home: str, environment: dict) -> None:
    """The login file for `environment`, and the line in ~/.bashrc that sources it."""
    path = os.path.join(home, contract.SLURM_LOGIN)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    temporary = f"{path}.new"
    with open(temporary, "w") as f:
        f.write(text(environment))
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    ensure_sourced(os.path.join(home, ".bashrc"))


def ensure_sourced(bashrc: str) -> None:
    """LINE first in `bashrc` (made where there is none; a link's target where it is one), once; the rest
    of the file as it was."""
    bashrc = os.path.realpath(bashrc)
    try:
        with open(bashrc) as f:
            current = f.read()
    except FileNotFoundError:
        current = ""
    if MARK in current:
        return
    temporary = f"{bashrc}.gpu-cluster.new"
    with open(temporary, "w") as f:
        f.write(LINE + current)
    if os.path.exists(bashrc):
        os.chmod(temporary, os.stat(bashrc).st_mode & 0o7777)
    os.replace(temporary, bashrc)


def remove(home: str) -> None:
    try:
        os.unlink(os.path.join(home, contract.SLURM_LOGIN))
    except FileNotFoundError:
        pass
