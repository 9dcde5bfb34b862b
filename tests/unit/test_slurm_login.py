"""node/slurm_login.py: the login file a shell sources, and the one line at the top of ~/.bashrc."""

import os
import subprocess

from node import contract, slurm_login


def login_shell(home, command: str, **env) -> str:
    """`bash -c` as sshd runs a command (bash reads ~/.bashrc first where built with SSH_SOURCE_BASHRC;
    the line is sourced here by hand to be independent of how this host's bash was built)."""
    script = f'. "{home}/.bashrc"; {command}'
    return subprocess.run(
        ["bash", "-c", script],
        env={"HOME": str(home), "PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_a_login_gets_the_clients_environment_before_a_bashrc_that_returns_early(tmp_path):
    (tmp_path / ".bashrc").write_text("case $- in *i*) ;; *) return;; esac\necho interactive\n")
    slurm_login.write(str(tmp_path), {"SLURM_CONF": "/a path/slurm.conf", "SQUEUE_FORMAT": "%.10i %j"})
    slurm_login.write(str(tmp_path), {"SLURM_CONF": "/a path/slurm.conf", "SQUEUE_FORMAT": "%.10i %j"})

    assert (tmp_path / ".bashrc").read_text().count(slurm_login.MARK) == 1
    assert login_shell(tmp_path, 'echo "$SLURM_CONF|$SQUEUE_FORMAT"') == "/a path/slurm.conf|%.10i %j\n"
    assert login_shell(tmp_path, 'echo "$SLURM_CONF"', SLURM_CONF="/mine") == "/mine\n"  # the user's own wins

    slurm_login.remove(str(tmp_path))

    assert not (tmp_path / contract.SLURM_LOGIN).exists()
    assert login_shell(tmp_path, 'echo "${SLURM_CONF:-unset}"') == "unset\n"


def test_a_linked_bashrc_gets_the_line_in_its_target_and_stays_a_link(tmp_path):
    (tmp_path / "dotfiles").mkdir()
    target = tmp_path / "dotfiles" / "bashrc"
    target.write_text("alias ll='ls -l'\n")
    (tmp_path / ".bashrc").symlink_to(target)

    slurm_login.write(str(tmp_path), {"SLURM_CONF": "/c"})

    assert (tmp_path / ".bashrc").is_symlink()
    assert target.read_text() == slurm_login.LINE + "alias ll='ls -l'\n"
