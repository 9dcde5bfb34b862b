"""A local stack's processes found without its state folder (infra/providers/local/orphans.py), with real
processes: what the stack's nodes started is found, a user's own shell in a node's folder is not."""

import os
import shutil
import subprocess

from infra.providers.local import orphans
from infra.providers.local.node_config import TOKEN_VARIABLE


def started(cwd, seconds: int, **env: str) -> subprocess.Popen:
    plain = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
    return subprocess.Popen(["sleep", str(seconds)], cwd=cwd, env={**plain, **env})


def test_only_what_the_nodes_started_is_the_stacks_once_its_folder_is_gone(state_dir, tmp_path):
    home = state_dir / "r2" / "nodes" / "node-0"
    (home / ".gpu-cluster").mkdir(parents=True)
    session = started(home, 4324, **{TOKEN_VARIABLE: "token-of-node-0"})  # a node session, in its home
    rank = started(tmp_path, 4325, **{TOKEN_VARIABLE: "token-of-node-0"})  # one of its ranks, elsewhere
    users_shell = started(home, 4326)  # the user went into the node's folder; no node started it
    other_stack = started(tmp_path, 4327, **{TOKEN_VARIABLE: "token-of-another-stack"})
    try:
        shutil.rmtree(state_dir / "r2")
        found = orphans.find("r2").others
        assert session.pid in found and rank.pid in found
        assert users_shell.pid not in found and other_stack.pid not in found
    finally:
        for process in (session, rank, users_shell, other_stack):
            process.kill()
            process.wait()
