"""node/warm.py, the node's warm launcher, as torchrun's agent asks it (node/warm_ask.py): one real
launcher per module (it imports torch once), ranks forked from it."""

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from node import contract, procfs, warm_ask
from tests.support import REPO
from tests.support.cli import child_env
from tests.support.clusters import run_processes

REPORT = """
import faulthandler, json, os, random, sys, threading
import torch
print(json.dumps({
    "name": __name__, "argv": sys.argv, "rank": os.environ.get("RANK"), "cwd": os.getcwd(),
    "path0": sys.path[0], "random": random.random(), "torch": torch.rand(1).item(),
    "node_module": getattr(sys.modules.get("node"), "__file__", None), "faulthandler": faulthandler.is_enabled(),
}), flush=True)
sys.exit(int(os.environ.get("CODE", "0")))
"""
SLEEP = "import time\ntime.sleep(60)\n"
RAISE = "raise RuntimeError('boom')\n"


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """A warm launcher serving a fresh home; yields (home, the rank environment it was started with, pid)."""
    home = str(tmp_path_factory.mktemp("warm-home"))
    env = child_env(HOME=home)
    warm_ask.start(env, home)
    wait_for(lambda: os.path.exists(warm_ask.socket_path(home)))
    with open(os.path.join(home, contract.WARM_PID)) as f:
        pid = int(f.read())
    yield home, env, pid
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    wait_for(lambda: not procfs.alive(pid), 30)


def rank(launcher, script, tmp_path, *args, **env):
    """Ask for one rank of `script`; (WarmRank, the read end of its output)."""
    home, base, _ = launcher
    path = tmp_path / "script.py"
    path.write_text(script)
    read_fd, write_fd = os.pipe()
    try:
        proc = warm_ask.ask([sys.executable, "-u", str(path), *args], dict(base, **env), write_fd, home)
    finally:
        os.close(write_fd)
    return proc, read_fd


def output(read_fd: int) -> str:
    with os.fdopen(read_fd) as f:
        return f.read()


def test_a_forked_rank_runs_its_script_as_torchrun_would_and_keeps_no_state_of_another(launcher, tmp_path):
    seen = []
    for index in range(2):
        proc, read_fd = rank(
            launcher,
            REPORT,
            tmp_path,
            "--lr",
            "0.1",
            RANK=str(index),
            CODE=str(3 * index),
            PYTHONFAULTHANDLER=str(index or ""),
        )
        assert proc.wait(60) == 3 * index
        seen.append(json.loads(output(read_fd)))
    for index, said in enumerate(seen):
        assert said["name"] == "__main__"
        assert said["argv"] == [str(tmp_path / "script.py"), "--lr", "0.1"]
        assert said["rank"] == str(index)
        assert said["path0"] == str(tmp_path)
        assert said["node_module"] is None  # the launcher's own `node` package is not the rank's
    assert seen[0]["random"] != seen[1]["random"] and seen[0]["torch"] != seen[1]["torch"]
    assert [said["faulthandler"] for said in seen] == [False, True]  # PYTHONFAULTHANDLER, as at a start


def test_the_launcher_is_single_threaded_without_cuda_and_only_its_user_can_ask(launcher, tmp_path):
    home, _, pid = launcher
    proc, read_fd = rank(launcher, "pass\n", tmp_path)
    assert proc.wait(60) == 0
    output(read_fd)
    assert os.listdir(f"/proc/{pid}/task") == [str(pid)]  # still one thread after a fork
    path = warm_ask.socket_path(home)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_fork_hazards_are_named():
    """The launcher refuses to fork with a second thread or a CUDA context (faked: no GPU here)."""
    code = (
        "import threading, time, torch\n"
        "from node import warm\n"
        "assert warm.fork_hazard() is None\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
        "print(warm.fork_hazard()); t.join()\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "print(warm.fork_hazard())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "the warm launcher runs 2 Python threads",
        "a CUDA context exists in the warm launcher",
    ]


def test_a_failing_rank_exits_1_with_its_traceback(launcher, tmp_path):
    proc, read_fd = rank(launcher, RAISE, tmp_path)
    assert proc.wait(60) == 1
    assert "RuntimeError: boom" in output(read_fd)


def test_a_rank_is_found_by_its_run_and_ends_with_the_agent_that_asked(launcher, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", launcher[0])  # stop_jobs.py and the watches run as the node user
    proc, read_fd = rank(launcher, SLEEP, tmp_path, **{contract.RUN_ID_VARIABLE: "run-warm-1"})
    wait_for(lambda: proc.pid in procfs.pids_with_environment(f"{contract.RUN_ID_VARIABLE}=run-warm-1"), 10)
    assert proc.pid in run_processes("run-warm-1")  # /proc/<pid>/environ itself, as any tool reads it
    proc.conn.close()  # the agent is gone (killed, or its Slurm step cancelled)
    wait_for(lambda: not procfs.alive(proc.pid), 10)
    os.close(read_fd)


def test_torchruns_stop_reaches_a_forked_rank(launcher, tmp_path):
    proc, read_fd = rank(launcher, SLEEP, tmp_path)
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's agent closes a worker
    assert proc.wait(10) == -signal.SIGTERM
    os.close(read_fd)


def test_an_ask_under_other_import_time_values_is_cold_and_retires_the_launcher(tmp_path):
    home = str(tmp_path)
    env = child_env(HOME=home)
    warm_ask.start(env, home)
    wait_for(lambda: os.path.exists(warm_ask.socket_path(home)))
    with open(os.path.join(home, contract.WARM_PID)) as f:
        pid = int(f.read())
    with pytest.raises(warm_ask.Cold, match="OMP_NUM_THREADS"):
        warm_ask.ask([sys.executable, "-u", "x.py"], dict(env, OMP_NUM_THREADS="2"), 1, home)
    wait_for(lambda: not procfs.alive(pid), 30)
    with pytest.raises(warm_ask.Cold, match="no warm launcher"):
        warm_ask.ask([sys.executable, "-u", "x.py"], env, 1, home)


def test_the_launchers_folder_is_made_private_again(tmp_path):
    folder = tmp_path / contract.WARM
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    warm_ask.private_folder(str(folder))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert procfs.WARM_RANKS == contract.WARM_RANKS  # procfs, inlined without contract, spells it too


def test_a_start_up_hook_of_the_users_on_pythonpath_starts_the_rank_cold(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("")
    with pytest.raises(warm_ask.Cold, match="sitecustomize.py on PYTHONPATH"):
        warm_ask.ask([sys.executable, "-u", "x.py"], {"PYTHONPATH": str(tmp_path)}, 1, str(tmp_path))


def test_another_interpreters_rank_starts_cold_and_the_launcher_stays(launcher, tmp_path):
    home, env, pid = launcher
    with pytest.raises(warm_ask.Cold, match="another interpreter"):
        warm_ask.ask(["/envs/abc/bin/python", "-u", "x.py"], env, 1, home)  # a --requirements environment
    proc, read_fd = rank(launcher, "pass\n", tmp_path)
    assert proc.wait(60) == 0
    os.close(read_fd)
