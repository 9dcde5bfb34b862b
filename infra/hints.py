"""The `fab ...` commands a command tells its user to run next, written so that they run from where the
user is: fab finds its tasks by looking for `fabfile.py` in the current folder and each folder above it,
so from anywhere else (a project of the user's, `python ~/gpu-cluster/deploy.py up`, `fab -r ...`) the
hint carries `-r` and this repository's folder."""

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fab(words: str, cwd: Path | None = None) -> str:
    """`fab WORDS`, with `-r REPO` where fab started in `cwd` (default: the current folder) would load
    another fabfile or none."""
    try:
        here = (cwd or Path.cwd()).resolve()
    except OSError:  # the current folder was removed
        here = Path("/")
    for folder in (here, *here.parents):
        if (folder / "fabfile.py").is_file() or (folder / "fabfile").is_dir():
            if folder == REPO:
                return f"fab {words}"
            break
    return f"fab -r {shlex.quote(str(REPO))} {words}"
