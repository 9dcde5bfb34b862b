"""A small filesystem of the test's own (tmpfs), mounted over a folder for a while: a node's disk or the
shared folder running out of space, as users hit it. Needs root; `unavailable` says why not."""

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path


def unavailable() -> str | None:
    """Why a test cannot mount a filesystem here, or None where it can."""
    if os.geteuid() != 0:
        return "mounting a small filesystem needs root"
    return None


@contextmanager
def small_filesystem(folder: Path, size: str = "2m"):
    """A tmpfs of `size` over `folder` (made where missing; what was in it hidden meanwhile), always unmounted."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
