"""Launch overhead and bootstrap idempotence on a 2-node local cluster.

Requirements (issues 3 and 10):
- the same 2-node torchrun script through `fab run --script` against two raw `torchrun` processes
  started by hand (one per "node", c10d rendezvous, the same arguments): at most 1.3x;
- a project (a 3-second script, a helper module, a config and 20 MB of data) through `fab run
  --workdir`, unchanged since its first launch, against two raw `torchrun` processes running it in
  its folder: at most 1.3x;
- a second `fab bootstrap` at most 25% of the first.
Each launch figure is the median of 3 alternated runs of each; wall clock, CLI start included.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Check, deploy, fab, median, scratch_env

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""
PROJECT_SCRIPT = """
import json, time, torch, torch.distributed as dist
from helpers import expected
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == expected(json.load(open("config.json")))
time.sleep(3)
dist.destroy_process_group()
"""
ROUNDS = 3


def raw_torchrun(script: Path, env: dict[str, str], port: int, cwd: Path = REPO) -> float:
    """What a user would start by hand on two nodes, both on this machine."""
    rendezvous_id = f"raw-{port}-{time.time_ns()}"  # one id for both "nodes", or they never meet
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.201.10:{port}",
                f"--rdzv-id={rendezvous_id}",
                f"--local-addr=127.0.201.{10 + i}",
                str(script),
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(2)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"raw torchrun failed: {codes}")
    return time.perf_counter() - started


def make_project() -> Path:
    root = Path(tempfile.mkdtemp(prefix="gpu-cluster-bench-project-"))
    (root / "train.py").write_text(PROJECT_SCRIPT)
    (root / "helpers.py").write_text("def expected(config):\n    return config['world_size']\n")
    (root / "config.json").write_text('{"world_size": 2}')
    (root / "data.bin").write_bytes(bytes(range(256)) * (20_000_000 // 256))
    return root


def run() -> list[Check]:
    env = scratch_env()
    script = Path(tempfile.mkdtemp()) / "allreduce.py"
    script.write_text(SCRIPT)
    project = make_project()
    deploy("up", "--local", "--nodes", "2", "--bind", "127.0.201.10", "--ssh-port", "2422", env=env)
    try:
        started = time.perf_counter()
        fab("bootstrap", "--master-port", "29611", "--scheduler", "none", env=env)
        first = time.perf_counter() - started
        started = time.perf_counter()
        fab("bootstrap", "--master-port", "29611", "--scheduler", "none", env=env)
        second = time.perf_counter() - started
        node_like = {**env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        via_fab, raw = [], []
        for round_ in range(ROUNDS):
            started = time.perf_counter()
            fab("run", "--script", str(script), env=env)
            via_fab.append(time.perf_counter() - started)
            raw.append(raw_torchrun(script, node_like, 29620 + round_))
        fab("run", "--workdir", str(project), "--script", "train.py", env=env)  # the first sync, not measured
        via_workdir, raw_project = [], []
        for round_ in range(ROUNDS):
            started = time.perf_counter()
            fab("run", "--workdir", str(project), "--script", "train.py", env=env)
            via_workdir.append(time.perf_counter() - started)
            raw_project.append(
                raw_torchrun(
                    project / "train.py", {**node_like, "PYTHONPATH": str(project)}, 29630 + round_, cwd=project
                )
            )
    finally:
        deploy("down", "--stack", "local", env=env, check=False)
    print(f"bootstrap: first {first:.2f} s, second {second:.2f} s")
    print(f"fab run --script (s): {' '.join(f'{t:.2f}' for t in via_fab)}")
    print(f"raw torchrun x2 (s):  {' '.join(f'{t:.2f}' for t in raw)}")
    print(f"fab run --workdir (s): {' '.join(f'{t:.2f}' for t in via_workdir)}")
    print(f"raw torchrun x2, 3 s script (s): {' '.join(f'{t:.2f}' for t in raw_project)}")
    overhead = median(via_fab) / median(raw)
    workdir_overhead = median(via_workdir) / median(raw_project)
    return [
        Check(
            "fab run --script vs raw torchrun x2",
            f"{overhead:.2f}x ({median(via_fab):.2f} / {median(raw):.2f} s)",
            "<= 1.3x",
            overhead <= 1.3,
        ),
        Check(
            "fab run --workdir (unchanged, 3 s script) vs raw torchrun x2",
            f"{workdir_overhead:.2f}x ({median(via_workdir):.2f} / {median(raw_project):.2f} s)",
            "<= 1.3x",
            workdir_overhead <= 1.3,
        ),
        Check(
            "second bootstrap / first",
            f"{second / first:.0%} ({second:.2f} / {first:.2f} s)",
            "<= 25%",
            second / first <= 0.25,
        ),
    ]
