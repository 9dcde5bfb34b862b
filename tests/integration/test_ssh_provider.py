"""The `ssh` provider end to end on stock OpenSSH servers: up --hosts, bootstrap, launches, faults, down.

The two "machines" are real sshd processes on loopback, each logging in a Unix user of its own
(tests/support/openssh.py), so every command goes through OpenSSH's login shell, environment and process
handling, not through the local provider's server.
"""

import json
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env, run_cli, run_fab
from tests.support.network import CuttingProxy, free_port
from tests.support.openssh import Sshd, processes_of

# Every test here logs in as the same Unix users (gcnode0, gcnode1): under xdist they run on one worker.
pytestmark = pytest.mark.xdist_group("openssh")

STACK = "hosts"


class HostsCluster:
    """The module's `hosts` stack, with its own state folder."""

    def __init__(self, hosts, state_dir: Path):
        self.hosts, self.state_dir = hosts, state_dir
        self.env = {"CLUSTER_STATE_DIR": str(state_dir)}
        self.master_port = free_port()

    @property
    def inventory_path(self) -> Path:
        return self.state_dir / STACK / "inventory.json"

    def inventory(self) -> dict:
        return json.loads(self.inventory_path.read_text())

    def cli(self, *args: str, **kwargs):
        return run_cli(*args, **self.env, **kwargs)

    def fab(self, *args: str, **kwargs):
        return run_fab(*args, **self.env, **kwargs)

    def popen_fab(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("fab")), *args],
            cwd=REPO,
            env=child_env(**self.env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def last_summary(self) -> dict:
        runs = sorted((self.state_dir / STACK / "runs").glob("*"))
        return json.loads((runs[-1] / "summary.json").read_text())

    def home(self, user: str) -> Path:
        return Path("/home") / user


@pytest.fixture(scope="module")
def cluster(openssh_hosts, tmp_path_factory):
    """`deploy.py up --hosts` on the two sshd machines; `down` afterwards, pass or fail."""
    folder = tmp_path_factory.mktemp("hosts-stack")
    handle = HostsCluster(openssh_hosts, folder / "state")
    handle.hosts_file = openssh_hosts.hosts_file(folder / "hosts.yaml")
    try:
        handle.up = handle.cli("up", "--hosts", str(handle.hosts_file))
        yield handle
    finally:
        handle.cli("down", "--stack", STACK)


def job_processes(users: list[str]) -> list[int]:
    """What the node users still run besides their sshd sessions."""
    found = []
    for user in users:
        for pid in processes_of(user):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if command and not command.startswith(b"sshd"):
                found.append(pid)
    return found


def wait_until_no_job_processes(users: list[str], timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(users)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_for_output(proc: subprocess.Popen, text: str, count: int = 1, timeout_s: float = 90) -> str:
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline and seen.count(text) < count:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert seen.count(text) >= count, seen
    return seen


def start_sleeping_job(cluster, tmp_path) -> subprocess.Popen:
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    job = cluster.popen_fab("run", "--script", str(script))
    wait_for_output(job, "sleeping", count=2)
    return job


def fingerprint(public_key_file: Path) -> str:
    return subprocess.run(
        ["ssh-keygen", "-lf", str(public_key_file)], capture_output=True, text=True, check=True
    ).stdout.split()[1]


# -------------------------------------------------------------------------------------------- up


def test_up_checks_every_host_pins_its_key_and_creates_nothing_there(cluster):
    assert cluster.up.returncode == 0, cluster.up.stdout + cluster.up.stderr
    servers = cluster.hosts.servers
    for server in servers:  # the fingerprint printed is the one sshd really has, and it is pinned
        assert fingerprint(server.folder / "ssh_host_ed25519_key.pub") in cluster.up.stdout
    inventory = cluster.inventory()
    assert inventory["provider"] == "ssh" and inventory["python"] == str(cluster.hosts.python)
    assert [(n["public_ip"], n["ssh_user"]) for n in inventory["nodes"]] == [(s.address, s.user) for s in servers]
    assert [n["private_ip"] for n in inventory["nodes"]] == [s.address for s in servers]  # probed
    assert inventory["daemon"] == "detached" and all(n["gpus"] == 0 for n in inventory["nodes"])
    pinned = Path(inventory["known_hosts"]).read_text().splitlines()
    assert [line.split()[0] for line in pinned] == [f"[{s.address}]:{s.port}" for s in servers]
    for user in cluster.hosts.users:
        assert not (cluster.home(user) / ".gpu-cluster").exists()

    assert cluster.cli("ssh", "node-1", "--", "whoami").stdout.strip() == servers[1].user
    status = cluster.cli("status", "--json")
    assert status.returncode == 0 and [n["state"] for n in json.loads(status.stdout)["nodes"]] == ["up", "up"]


def test_every_bad_host_is_named_in_one_line_and_nothing_is_recorded(cluster, tmp_path):
    servers = cluster.hosts.servers
    closed = free_port()
    hosts_file = tmp_path / "bad.yaml"
    hosts_file.write_text(
        yaml.safe_dump(
            {
                "key": str(cluster.hosts.key),
                "python": str(cluster.hosts.python),
                "hosts": [
                    {"address": servers[0].address, "port": servers[0].port, "user": servers[1].user},  # not allowed
                    {"address": "127.0.0.1", "port": closed, "user": servers[0].user},
                ],
            }
        )
    )
    result = cluster.cli("up", "--hosts", str(hosts_file), "--stack", "bad")
    assert_one_line_error(
        result,
        "2 of 2 host(s)",
        f"{servers[0].address}:{servers[0].port}: the key",
        "refused",
        f"127.0.0.1:{closed}: unreachable",
    )
    assert not (cluster.state_dir / "bad").exists()


def test_up_again_reads_the_file_and_a_second_stack_may_not_share_a_login(cluster, tmp_path):
    again = cluster.cli("up", "--hosts", str(cluster.hosts_file))
    assert again.returncode == 0 and "already up" in again.stdout, again.stdout + again.stderr
    assert_one_line_error(cluster.cli("up", "--hosts", str(tmp_path / "missing.yaml")), "no hosts file")
    fewer = tmp_path / "fewer.yaml"
    data = yaml.safe_load(cluster.hosts_file.read_text())
    fewer.write_text(yaml.safe_dump({**data, "hosts": data["hosts"][:1]}))
    assert_one_line_error(cluster.cli("up", "--hosts", str(fewer)), "is up on", "not changed in place", "down --stack")
    server = cluster.hosts.servers[0]
    assert_one_line_error(
        cluster.cli("up", "--hosts", str(fewer), "--stack", "second"),
        f"{server.user}@{server.address}:{server.port} is in use by stack '{STACK}'",
    )
    assert not (cluster.state_dir / "second").exists()


def test_hosts_that_share_one_home_are_refused_before_bootstrap_writes(cluster, tmp_path):
    """Two hosts, one home (an NFS $HOME): here a second sshd that logs in the first host's user."""
    first = cluster.hosts.servers[0]
    prefix, last = first.address.rsplit(".", 1)
    twin = Sshd(first.user, f"{prefix}.{int(last) + 2}", first.port, tmp_path / "sshd-twin")
    twin.start()
    try:
        data = yaml.safe_load(cluster.hosts_file.read_text())
        data["hosts"] = [{"address": s.address, "port": s.port, "user": s.user} for s in (first, twin)]
        hosts_file = tmp_path / "hosts.yaml"
        hosts_file.write_text(yaml.safe_dump(data))
        env = {"CLUSTER_STATE_DIR": str(tmp_path / "state")}
        up = run_cli("up", "--hosts", str(hosts_file), "--stack", "twins", **env)
        assert up.returncode == 0, up.stdout + up.stderr
        folder = cluster.home(first.user) / ".gpu-cluster"
        listed = sorted(folder.iterdir()) if folder.exists() else []
        assert_one_line_error(
            run_fab("bootstrap", "--master-port", str(free_port()), **env),
            "node-0 and node-1 share one home",
            str(cluster.home(first.user)),
        )
        assert sorted(folder.iterdir()) == listed  # nothing written, the claims removed
    finally:
        twin.stop()


def test_a_malformed_hosts_file_lists_every_problem(state_dir, tmp_path):
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(
        yaml.safe_dump(
            {
                "key": str(tmp_path / "no-such-key"),
                "user": "u",
                "colour": "blue",
                "hosts": [{"address": "10.0.0.1"}, {"address": "10.0.0.1", "port": 22}, {"address": "h", "port": 0}],
            }
        )
    )
    result = run_cli("up", "--hosts", str(hosts_file))
    assert_one_line_error(
        result,
        "no-such-key does not exist",
        "unknown key(s) colour",
        "10.0.0.1:22 is listed twice",
        "port must be 1..65535",
    )
    hosts_file.write_text("hosts: [unclosed\n")
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "not valid YAML")
    assert_one_line_error(run_cli("up", "--hosts", str(tmp_path / "missing.yaml")), "no hosts file")
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file), "--nodes", "3"), "--nodes", "--hosts")
    hosts_file.write_text(
        yaml.safe_dump({"key": str(tmp_path / "k"), "user": "u", "hosts": [{"address": "h", "user": ""}]})
    )
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "hosts[0] user: is empty")
    hosts_file.write_text(yaml.safe_dump({"key": str(tmp_path / "k"), "user": "", "hosts": [{"address": "h"}]}))
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "user: is empty", "hosts[0]: no user")
    base = {"key": str(tmp_path / "k"), "user": "u"}
    hosts_file.write_text(yaml.safe_dump({**base, "slurm": "ours", "hosts": ["h"]}))
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "slurm: 'ours' is not understood")
    hosts_file.write_text(yaml.safe_dump({**base, "partition": "gpu", "hosts": [{"address": "h", "slurm_name": "a"}]}))
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "partition: is for a Slurm", "slurm_name: is for")
    existing = {**base, "slurm": "existing", "partition": "a b", "slurm_conf": "etc/slurm.conf"}
    hosts = [{"address": "h", "slurm_name": "x"}, {"address": "i", "slurm_name": "x"}]
    hosts_file.write_text(yaml.safe_dump({**existing, "hosts": hosts}))
    assert_one_line_error(
        run_cli("up", "--hosts", str(hosts_file)),
        "partition 'a b' is not a Slurm partition name",
        "slurm_conf 'etc/slurm.conf' must be an absolute path",
        "two hosts name the same Slurm node",
    )
    empty = {**base, "slurm": "existing", "partition": "", "slurm_conf": ""}  # as an empty user: is refused
    hosts_file.write_text(yaml.safe_dump({**empty, "hosts": [{"address": "h", "slurm_name": ""}]}))
    assert_one_line_error(
        run_cli("up", "--hosts", str(hosts_file)),
        "partition: is empty",
        "slurm_conf: is empty",
        "hosts[0] slurm_name: is empty",
    )
    hosts_file.write_text(f"key: {tmp_path / 'k'}\nuser: u\nhosts:\n  - address: h\n    port: 22\n    port: 23\n")
    assert_one_line_error(run_cli("up", "--hosts", str(hosts_file)), "at line 6: key 'port' is given twice")
    assert not state_dir.exists() or not any(state_dir.iterdir())


# ------------------------------------------------------------------------------------- bootstrap


def test_bootstrap_layers_the_venv_over_the_hosts_python_without_pip(cluster):
    first = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "all-reduce ok (2 ranks)" in first.stdout
    setup = json.loads((cluster.state_dir / STACK / "bootstrap.json").read_text())
    # Two users: Slurm would run a job as one of them on both hosts, so the default leaves runs to fab.
    assert setup["scheduler"] == "" and "the nodes' users differ" in setup["scheduler_why"], setup
    assert "runs stay in fab's connections, not in Slurm: the nodes' users differ" in first.stdout, first.stdout
    base_site = next((cluster.hosts.python.parent.parent / "lib").glob("python3*/site-packages"))
    for node, user in zip(("node-0", "node-1"), cluster.hosts.users, strict=True):
        venv = cluster.home(user) / ".gpu-cluster" / "venv"
        assert setup["python"][node] == str(venv / "bin" / "python")
        assert setup["nodes"][node]["deps"]["installed"] == []  # torch was there: pip never ran
        layer = next(venv.glob("lib/python3*/site-packages/_gpu_cluster_layer.pth")).read_text().split()
        assert str(base_site) in layer
        home = cluster.home(user) / ".gpu-cluster"  # another user of the host reads none of it
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        for private in (home / "env", home / "state.json"):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    second = cluster.fab("bootstrap", "--master-port", str(cluster.master_port))
    assert second.returncode == 0 and "nodes up to date" in second.stdout
    insisted = cluster.fab("bootstrap", "--master-port", str(cluster.master_port), "--scheduler", "slurm")
    assert insisted.returncode == 1 and "node-1: scheduler failed: the nodes' users differ" in insisted.stdout
    assert json.loads((cluster.state_dir / STACK / "bootstrap.json").read_text())["scheduler_choice"] == "auto"
    sourced = cluster.cli("ssh", "node-1", "--", ". ~/.gpu-cluster/env && echo $NODE_RANK $MASTER_ADDR")
    assert sourced.stdout.split() == ["1", cluster.hosts.servers[0].address]


# -------------------------------------------------------------------------------------- launches


def test_run_ddp_trains_across_both_hosts(cluster):
    result = cluster.fab("run-ddp", "--args", "--steps 10 --log-every 5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parameters identical on all 2 ranks" in result.stdout
    said = [line for line in result.stdout.splitlines() if "lives in fab's connections" in line]
    assert len(said) == 1 and "users differ" in said[0], result.stdout  # why, once
    assert_one_line_error(cluster.fab("hello", "--detach"), "--detach needs runs held by Slurm", "users differ")
    run_dir = sorted((cluster.state_dir / STACK / "runs").glob("*"))[-1]
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "step"
    ]
    assert steps == [5, 10]
    fetched = [p for p in run_dir.rglob("*") if p.is_file()]  # private here, as everything under .cluster
    assert fetched and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in fetched), fetched


def test_a_failing_rank_stops_the_job_on_both_hosts(cluster, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(  # the last rank fails; the first would wait for it in the barrier forever
        "import os, sys, time\n"
        "if int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1:\n"
        "    time.sleep(1); sys.exit(1)\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo'); dist.barrier(); print('never', flush=True)\n"
    )
    result = cluster.fab("run", "--script", str(script), timeout=180)
    assert result.returncode == 1 and "never" not in result.stdout
    assert "node-1 exited 1" in result.stderr
    assert wait_until_no_job_processes(cluster.hosts.users) == []


def test_ctrl_c_stops_the_job_on_both_hosts(cluster, tmp_path):
    job = start_sleeping_job(cluster, tmp_path)
    try:
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=60) == 130
    finally:
        job.kill()
    assert wait_until_no_job_processes(cluster.hosts.users) == []


def test_a_node_whose_connection_drops_is_reconnected_and_stopped(cluster, tmp_path):
    inventory_text = cluster.inventory_path.read_text()
    known_hosts = Path(cluster.inventory()["known_hosts"])
    known_text = known_hosts.read_text()
    server = cluster.hosts.servers[1]
    proxy = CuttingProxy(server.address, (server.address, server.port))
    try:  # node-1 reached through the proxy, its pinned key under the proxy's port too
        inventory = cluster.inventory()
        inventory["nodes"][1]["ssh_port"] = proxy.port
        cluster.inventory_path.write_text(json.dumps(inventory))
        known_hosts.write_text(known_text + f"[{server.address}]:{proxy.port} {server.host_public_key()}\n")
        job = start_sleeping_job(cluster, tmp_path)
        try:
            proxy.cut()
            output, _ = job.communicate(timeout=90)
        finally:
            job.kill()
    finally:
        proxy.close()
        cluster.inventory_path.write_text(inventory_text)
        known_hosts.write_text(known_text)
    assert job.returncode == 1, output
    assert wait_until_no_job_processes([server.user], timeout_s=5) == []  # OpenSSH alone would leave it running
    assert "node-1's connection dropped; reconnected and stopped its part (stopped" in output
    assert wait_until_no_job_processes(cluster.hosts.users) == []


# ------------------------------------------------------------------------------------------ down


def test_down_cleans_both_hosts_forgets_the_stack_and_leaves_the_machines_running(cluster):
    down = cluster.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "they were not powered off" in down.stdout
    for user in cluster.hosts.users:
        assert not (cluster.home(user) / ".gpu-cluster").exists()
        assert (cluster.home(user) / ".bashrc").exists()  # nothing else of the user's is touched
    assert wait_until_no_job_processes(cluster.hosts.users) == []
    assert not cluster.inventory_path.exists()
    for server in cluster.hosts.servers:
        with socket.socket() as sock:
            assert sock.connect_ex((server.address, server.port)) == 0
    [record] = json.loads(cluster.cli("cost", "--json").stdout)["clusters"]
    assert record["provider"] == "ssh" and not record["up"]
    assert "nothing to do" in cluster.cli("down", "--stack", STACK).stdout


def test_nodes_are_numbered_as_torchrun_ranks_them():
    from infra.providers.hosts import Host, HostCheck, _rank_order

    checks = [HostCheck(Host(f"h{i}", 22, "u", ip), "") for i, ip in enumerate(["10.0.0.9", "10.0.0.10", "10.0.0.11"])]
    # torchrun's c10d rendezvous sorts the nodes by address as text: node-0 must be the first of them
    assert [c.host.private_ip for c in _rank_order(checks)] == ["10.0.0.10", "10.0.0.11", "10.0.0.9"]
