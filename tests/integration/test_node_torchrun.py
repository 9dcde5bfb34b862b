"""node/torchrun.py, the wrapper every node of a launch runs, started as fab starts it (two nodes on
loopback, no SSH): how a healthy job ends, and the line it leaves for fab."""

import json
import subprocess
import sys

from node import contract
from tests.support import REPO
from tests.support.cli import child_env
from tests.support.network import free_endpoint

HELLO = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""

# node-1's agent reaches torchrun's rendezvous shutdown 2 s after node-0's, as a loaded or slower node
# does now and then (7 of 37 healthy runs of the audit): the head's store must still be there.
LATE_SHUTDOWN = """
import os, time
if "RANK" not in os.environ:  # torchrun's agent, not its workers
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    shutdown = handler.shutdown
    def late(self):
        time.sleep(2)
        return shutdown(self)
    handler.shutdown = late
"""


def start_node(rank: int, address: str, port: int, script, pythonpath: str = "") -> subprocess.Popen:
    prefix = address.rsplit(".", 1)[0]
    env = child_env(NODE_RANK=str(rank), NNODES="2", MASTER_ADDR=address, MASTER_PORT=str(port), PYTHONPATH=pythonpath)
    env[contract.WARM_VARIABLE] = "0"  # the agent's stores are what this holds; no warm launcher is left behind
    env.pop(contract.NODE_VARIABLE, None)
    env.pop(contract.PROGRESS_VARIABLE, None)
    argv = [
        sys.executable,
        str(REPO / "node" / "torchrun.py"),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={address}:{port}",
        f"--rdzv-conf=is_host={int(rank == 0)}",
        f"--rdzv-id=run-{port}",
        f"--local-addr={prefix}.{10 + rank}",
        str(script),
    ]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_healthy_job_ends_quietly_when_one_node_closes_the_rendezvous_late(tmp_path):
    script, hook = tmp_path / "hello.py", tmp_path / "late"
    script.write_text(HELLO)
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LATE_SHUTDOWN)
    address, port = free_endpoint(2)
    nodes = [start_node(0, address, port, script), start_node(1, address, port, script, pythonpath=str(hook))]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for rank, output in enumerate(outputs):
        lines = output.splitlines()
        assert lines[:-1] == [f"[node-{rank}] rank {rank} sum 2"], output  # nothing but the script's own line
        marker, _, report = lines[-1].partition(" ")
        said = json.loads(report)
        assert said.pop("times")["started"] > 0  # when this node's torchrun started, for the launch's timeline
        assert marker == contract.RANKS_MARKER and said == {"exit_codes": {}, "exited_at": {}, "process_group": None}
