"""What the tests pass to the examples, and how they start them: torchrun on this machine."""

import os
import subprocess
import sys

from tests.support import REPO
from tests.support.cli import child_env

# The examples' transformer at its smallest (one block of width 32): a few seconds of work per run.
TINY = ["--vocab", "32", "--seq-len", "16", "--d-model", "32", "--n-heads", "4", "--n-layers", "1", "--batch-size", "8"]


def torchrun(script: str, *args: str, run_dir=None, nproc: int = 2, timeout: float = 240, **env_vars: str):
    """`python -m torch.distributed.run --standalone` of examples/SCRIPT (or SCRIPT, a path of its own), as
    the README runs it."""
    env = child_env(**env_vars)
    if run_dir is not None:
        env["CLUSTER_RUN_DIR"] = str(run_dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*command, script if os.path.isabs(script) else f"examples/{script}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
