"""Where an example puts what a person wants back from a run: JSON figures and plots.

Under `fab`, what the head node writes into `$CLUSTER_RESULTS_DIR` is fetched to the operator's
machine after the run, and nothing else is (checkpoints stay on the shared storage). Without it the
run folder (`$CLUSTER_RUN_DIR`) is used, and under plain torchrun `results/` in the working directory
(ignored by git, so running an example in the checkout leaves it clean).
"""

import json
import os
from pathlib import Path

LOCAL_RESULTS = "results"
"""Under plain torchrun: the folder, in the working directory, that results go to (`.gitignore` has it)."""


def results_dir(environ=os.environ) -> Path:
    """`$CLUSTER_RESULTS_DIR`, else `$CLUSTER_RUN_DIR`, else `results/` in the working directory."""
    for name in ("CLUSTER_RESULTS_DIR", "CLUSTER_RUN_DIR"):
        if environ.get(name):
            return Path(environ[name])
    return Path.cwd() / LOCAL_RESULTS


def results_path(path: Path | str | None, default_name: str, environ=os.environ) -> Path:
    """An absolute path as given, a relative one (or `default_name`) inside `results_dir()`; its
    folder is made, so the caller only writes."""
    path = Path(path or default_name)
    path = path if path.is_absolute() else results_dir(environ) / path
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(data: dict, path: Path) -> Path:
    """Write `data` as indented JSON; returns the path."""
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
