"""Run outcomes both holders must report alike (fab's connections and Slurm): one scenario, one expected
answer, asserted by the modules of each holder's cluster."""

import json
import subprocess
from pathlib import Path

FAILING_RANK = (  # the last rank fails before joining; the others wait for it until they fail or are stopped
    "import os, sys, time\n"
    "if int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1:\n"
    "    time.sleep(1); sys.exit(3)\n"
    "import torch.distributed as dist\n"
    "dist.init_process_group('gloo'); dist.barrier(); print('never', flush=True)\n"
)


def failing_rank_script(folder: Path) -> Path:
    path = folder / "fail.py"
    path.write_text(FAILING_RANK)
    return path


def assert_rank_1_failed_first(result: subprocess.CompletedProcess, jobs_json: str) -> dict:
    """Rank 1 (node-1) exited 3 first and rank 0 (node-0) ended after it: the run failed with rank 1's own
    code, named node-1 first by its rank's exit time, whatever order the nodes' jobs ended in; the run's
    `fab jobs --json` row, returned."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "never" not in result.stdout
    # torchrun exits 1 for any failed worker; the script's own code comes from torchrun's failure record
    assert "node-1 exited 1 (rank 1 exited 3)" in result.stderr, result.stderr
    assert "(first: node-1, rank 1 exited first by its clock, log: " in result.stderr, result.stderr
    run_id = result.stderr.split("error: run ")[1].split(" ")[0]
    [row] = [r for r in json.loads(jobs_json) if r["run_id"] == run_id]
    assert (row["state"], row["exit_code"]) == ("FAILED", 3), row
    return row
