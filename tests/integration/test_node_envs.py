"""A `--requirements` environment on a node (node/job_env.py), made for real: with uv where it runs, with
pip where it cannot, each one importing its package over the layers below it (no cluster: the node
side alone, as the InstallRequirements call and a job's own step run it)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

from tests.support import REPO
from tests.support.packages import tiny_wheel

REQUIREMENTS = "--no-index\n--find-links wheels\ngc-tinypkg==0.1\n"
CHECK = "import gc_tinypkg, torch; print(gc_tinypkg.MESSAGE)"
CHECK_TINY = "import gc_tinypkg; print(gc_tinypkg.MESSAGE)"


def make_env(node_python: str, tmp_path: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    project = tmp_path / "project"
    tiny_wheel(project / "wheels")
    (tmp_path / "req.txt").write_text(REQUIREMENTS)
    dest = tmp_path / "envs" / "abc"
    argv = [node_python, str(REPO / "node" / "job_env.py"), "--job", str(dest), str(tmp_path / "req.txt")]
    argv += [str(tmp_path / "abc.log"), str(project)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    return done, dest


def test_uv_makes_the_env_with_only_the_package_the_layers_lack(tmp_path):
    environ = {**os.environ, "HOME": str(tmp_path)}  # the uv cache in the node's home
    done, dest = make_env(sys.executable, tmp_path, environ)  # the project's venv: uv beside its interpreter
    assert done.returncode == 0, done.stdout + (tmp_path / "abc.log").read_text()
    assert "gpu-cluster: requirements installed in" in done.stdout and done.stdout.rstrip().endswith("with uv")
    check = subprocess.run([str(dest / "bin" / "python"), "-c", CHECK], capture_output=True, text=True)
    assert check.stdout.strip() == "tiny package 0.1", check.stderr
    own = {p.name for p in next((dest / "lib").glob("python*/site-packages")).iterdir()}
    assert "gc_tinypkg" in own and "torch" not in own  # torch comes from the layer, not installed again
    assert (tmp_path / ".gpu-cluster" / "uv-cache").is_dir()


def test_pip_makes_the_env_where_uv_cannot_run_and_says_why(tmp_path):
    # A node interpreter with no uv beside it or in a layer below it, and a uv on PATH that does not run.
    node = tmp_path / "node-venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(node)
    broken = tmp_path / "bin"
    broken.mkdir()
    (broken / "uv").write_text("#!/bin/sh\necho uv is broken here >&2\nexit 3\n")
    (broken / "uv").chmod(0o755)
    environ = {"PATH": f"{broken}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done, dest = make_env(str(node / "bin" / "python"), tmp_path, environ)
    assert done.returncode == 0, done.stdout + (tmp_path / "abc.log").read_text()
    assert "with pip (" in done.stdout and "does not run (uv is broken here)" in done.stdout, done.stdout
    check = subprocess.run([str(dest / "bin" / "python"), "-c", CHECK_TINY], capture_output=True, text=True)
    assert check.stdout.strip() == "tiny package 0.1", check.stderr
