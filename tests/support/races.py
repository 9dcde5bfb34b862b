"""`fab stop` racing a launch, caught at one moment on purpose, the same way for both holders."""

import os
import signal
import time
from pathlib import Path

from tests.support.clusters import Cluster, run_processes


def lock_holder(home: Path) -> str | None:
    """The run id of the launch that holds (or waits for) the job lock on the node whose HOME is `home`."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"job_lock.py" not in (proc / "cmdline").read_bytes():
                continue
            environ = dict(
                entry.split(b"=", 1) for entry in (proc / "environ").read_bytes().split(b"\0") if b"=" in entry
            )
        except OSError:
            continue
        if environ.get(b"HOME") == str(home).encode() and b"CLUSTER_RUN_ID" in environ:
            return environ[b"CLUSTER_RUN_ID"].decode()
    return None


def stop_a_launch_being_prepared(cluster: Cluster, tmp_path: Path, *launch_args: str):
    """A launch with a workdir (it prepares holding the head node's job lock), frozen the moment it holds it,
    `fab stop` run then, and the launch let go on: (its run id, stop's result, the launch's exit code and
    output, that run's processes still alive)."""
    project = tmp_path / "racing-project"
    project.mkdir()
    (project / "train.py").write_text("print('trained', flush=True)\n")
    launch = cluster.popen_fab("run", "--workdir", str(project), "--script", "train.py", *launch_args)
    home = cluster.state_dir / cluster.stack / "nodes" / "node-0"
    deadline, run_id = time.monotonic() + 120, None
    while run_id is None and time.monotonic() < deadline and launch.poll() is None:
        run_id = lock_holder(home)
        time.sleep(0.01)
    assert run_id is not None, launch.communicate()[0]
    os.kill(launch.pid, signal.SIGSTOP)  # still preparing: its sync is a round trip away at least
    try:
        stopped = cluster.fab("stop")
    finally:
        os.kill(launch.pid, signal.SIGCONT)
    output = launch.communicate(timeout=120)[0]
    return run_id, stopped, launch.returncode, output, run_processes(run_id)


def assert_stop_ended_a_launch_being_prepared(run_id: str, stopped, code: int, output: str, alive: list) -> None:
    """The one outcome for both holders: stop named the run, and the launch ran nothing of it."""
    assert stopped.returncode == 0 and f"node-0: stopped {run_id}" in stopped.stdout, stopped.stdout + stopped.stderr
    assert code == 1 and f"run {run_id} was stopped before" in output, output
    assert "trained" not in output and alive == [], output
