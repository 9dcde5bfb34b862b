"""The command lines as a user runs them, from the repository, with the test's environment."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_cli(*args: str, timeout: float = 120, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`python deploy.py ARGS` as a user runs it, in the repository, with the test's state dir."""
    result = subprocess.run(
        [sys.executable, "deploy.py", *args],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"deploy.py {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def run_fab(*args: str, timeout: float = 300, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`fab ARGS` from the repository, as a user runs it."""
    fab = Path(sys.executable).with_name("fab")
    result = subprocess.run(
        [str(fab), *args], cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"fab {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def popen_fab(*args: str, **env: str) -> subprocess.Popen:
    """`fab ARGS` started in the background (stdout and stderr together, as text)."""
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("fab")), *args],
        cwd=REPO,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def lock_held(path: Path) -> bool:
    """Whether some process holds the flock on `path` (tried without waiting, released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2 and a single `error: ...` line that mentions `words`."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
