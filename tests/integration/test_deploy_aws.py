"""`deploy.py` on AWS as a user runs it, with no credentials and no Pulumi CLI: bad input is one line,
exit 2, nothing created; `plan` still works offline."""

import json
import os
import secrets
import subprocess

import pytest

from infra.cloud_init import SCHEDULER_SETUP, STOP_MARKER, user_data
from infra.providers.aws import host_keys_from_console
from tests.support import REPO
from tests.support.aws_fakes import CUR_FIXTURE
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.ledgers import billed_cluster


@pytest.fixture
def offline(state_dir, tmp_path, monkeypatch):
    """No AWS credentials or config, no instance metadata, no Pulumi CLI on PATH."""
    env = {
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(tmp_path),
        "PATH": os.pathsep.join(
            p for p in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(p, "pulumi"))
        ),
    }
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    return env


def nothing_created(state_dir) -> bool:
    return not (state_dir / "dev").exists() and not (state_dir / "pulumi").exists()


@pytest.mark.parametrize(
    "args,words",
    [
        (["--nodes", "0"], ["nodes must be from 1 to 16"]),
        (["--nodes", "17"], ["nodes must be from 1 to 16"]),
        (["--instance-type", "t3.large"], ["t3.large", "not supported"]),
        (["--instance-type", ""], ["instance type ''", "not supported"]),
        (["--instance-type", "g4dn.xlarge\n"], ["not supported"]),
        (["--instance-type", "p4d.48xlarge"], ["not supported"]),
        (["--nodes", ""], ["nodes must be a whole number"]),
        (["--ssh-cidr", ""], ["sshCidr", "CIDR"]),
        (["--stack", ""], ["bad stack name ''"]),
        (["--ssh-cidr", "1.2.3.4/99"], ["sshCidr", "CIDR"]),
        (["--ssh-cidr", "0.0.0.0/0"], ["whole internet", "allowWorldSsh"]),
    ],
)
def test_bad_input_is_refused_before_anything_is_created(offline, state_dir, args, words):
    result = run_cli("up", "--stack", "dev", "--yes", *args, **offline)
    assert_one_line_error(result, *words)
    assert nothing_created(state_dir)


def test_missing_cli_and_credentials_are_reported_together(offline, state_dir):
    result = run_cli("up", "--stack", "dev", "--yes", "--ssh-cidr", "203.0.113.7/32", **offline)
    assert_one_line_error(
        result,
        "preflight found 2 problem(s)",
        "Pulumi CLI is not installed",
        "get.pulumi.com",
        "AWS credentials do not work",
    )
    assert nothing_created(state_dir)


def test_plan_works_offline_and_prices_the_cluster(offline, state_dir):
    result = run_cli("plan", "--stack", "dev", "--json", **offline)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["instances_hourly_usd"] == pytest.approx(1.504)
    assert plan["hourly_usd"] > plan["instances_hourly_usd"]
    instances = [r for r in plan["resources"] if r["type"].endswith("Instance")]
    assert len(instances) == 2 and instances[0]["settings"]["imds"] == "v2 required"
    text = run_cli("plan", "--stack", "l4", **offline)
    assert text.returncode == 0 and "g6.2xlarge" in text.stdout and "/month" in text.stdout
    assert nothing_created(state_dir)


def test_plan_refuses_a_bad_stack_name_and_stacks_that_are_no_cloud_program(offline, state_dir):
    assert_one_line_error(run_cli("plan", "--stack", "Bad Name", **offline), "bad stack name")
    assert_one_line_error(run_cli("plan", "--stack", "local", **offline), "the local provider creates no cloud")
    assert_one_line_error(run_cli("plan", "--stack", "hosts", **offline), "your own machines) creates no cloud")


def test_image_commands_refuse_bad_input_in_one_line(offline, state_dir):
    assert_one_line_error(run_cli("image", "create", "--stack", "local", **offline), "stack 'local' is the local")
    assert_one_line_error(run_cli("image", "create", "--stack", "hosts", **offline), "whose nodes boot no image")
    assert_one_line_error(run_cli("image", "create", "--name", "x", **offline), "an image name is 3 to 128")
    assert_one_line_error(run_cli("image", "delete", "ubuntu", **offline), "not an AMI id")
    ami = "ami-0123456789abcdef0"
    for action in (["list"], ["delete", ami]):  # never a question to EC2 about a stack with no region
        said = f"image {action[0]}: --stack 'local' is the local"
        assert_one_line_error(run_cli("image", *action, "--stack", "local", **offline), said, "--region REGION")
        assert_one_line_error(run_cli("image", *action, "--region", "", **offline), "--region '' is not a region")
        assert_one_line_error(run_cli("image", *action, "--region", "us-east-1\n", **offline), "--region")
    assert_one_line_error(run_cli("image", **offline), "required: ACTION")
    assert_one_line_error(run_cli("up", "--local", "--image", "ami-0123456789abcdef0", **offline), "--image")
    assert_one_line_error(run_cli("up", "--yes", "--image", "ubuntu", **offline), "not an AMI id")
    assert nothing_created(state_dir)


def test_down_of_an_aws_stack_needs_the_cli(offline, state_dir):
    (state_dir / "dev").mkdir(parents=True)
    assert_one_line_error(run_cli("down", "--stack", "dev", **offline), "Pulumi CLI is not installed")


CONSOLE = """[   12.3] cloud-init[1021]: Cloud-init v. 24.1 running 'modules:final'
ec2:
ec2: #############################################################
ec2: -----BEGIN SSH HOST KEY FINGERPRINTS-----
ec2: 256 SHA256:abc root@ip-10-42-1-10 (ED25519)
ec2: -----END SSH HOST KEY FINGERPRINTS-----
-----BEGIN SSH HOST KEY KEYS-----
ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY root@ip-10-42-1-10
ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBqVkYtZ9k root@ip-10-42-1-10
-----END SSH HOST KEY KEYS-----
"""


def test_host_keys_are_read_from_the_console_ed25519_first():
    assert host_keys_from_console(CONSOLE) == [
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBqVkYtZ9k",
        "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY",
    ]
    assert host_keys_from_console("booting...") == []


def test_cloud_init_mounts_efs_with_retries_and_installs_the_guard(tmp_path):
    script = user_data("fs-1234.efs.us-east-1.amazonaws.com")
    assert script.startswith("#!/bin/bash")
    # The instance boots while its mount target is created: the mount loop, run by bash with a `mount` that
    # fails until the target answers (the third try), mounts on that try, without a long wait between.
    loop = script[script.index("for attempt in") : script.index("\ndone\n") + len("\ndone\n")]
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, body in {
        "mountpoint": f"[ -f {tmp_path}/mounted ]",
        "mount": f'echo "$@" >> {tmp_path}/tries; [ $(wc -l < {tmp_path}/tries) -ge 3 ] && touch {tmp_path}/mounted',
        "sleep": f'echo "$1" >> {tmp_path}/slept',
    }.items():
        (fakes / name).write_text(f"#!/bin/bash\n{body}\n")
        (fakes / name).chmod(0o755)
    subprocess.run(["bash", "-c", loop], env={"PATH": f"{fakes}:/usr/bin:/bin"}, check=True, timeout=30)
    tries = (tmp_path / "tries").read_text().splitlines()
    assert len(tries) == 3 and "fs-1234.efs.us-east-1.amazonaws.com:/ /shared" in tries[0], tries
    assert (tmp_path / "slept").read_text().split() == ["2", "2"]
    assert f"[ -f {STOP_MARKER} ]" in script and "systemctl poweroff" in script
    assert "systemctl enable --now gpu-cluster-guard.timer" in script


def test_status_of_an_aws_cluster_without_credentials_is_one_line(offline, state_dir):
    stack_dir = state_dir / "dev"
    stack_dir.mkdir(parents=True)
    for name in ("id_ed25519", "known_hosts"):
        (stack_dir / name).touch(mode=0o600)
    (stack_dir / "inventory.json").write_text(
        json.dumps(
            {
                "stack": "dev",
                "provider": "aws",
                "region": "us-east-1",
                "instance_type": "g4dn.2xlarge",
                "hourly_usd": 1.537,
                "ssh_user": "ubuntu",
                "ssh_key": str(stack_dir / "id_ed25519"),
                "known_hosts": str(stack_dir / "known_hosts"),
                "shared_dir": "/shared",
                "created_at": "2026-11-21T00:00:00+00:00",
                "nodes": [
                    {
                        "name": "node-0",
                        "public_ip": "203.0.113.10",
                        "private_ip": "10.42.1.10",
                        "ssh_port": 22,
                        "gpus": 1,
                    }
                ],
            }
        )
    )
    assert_one_line_error(
        run_cli("status", "--stack", "dev", **offline), "AWS credentials do not work", "aws configure"
    )


def test_ssh_passes_the_remote_command_through_whole():
    from deploy import ssh_argv
    from infra.inventory import ClusterInfo, NodeInfo

    cluster = ClusterInfo(
        "dev",
        "aws",
        "us-east-1",
        "g4dn.2xlarge",
        1.5,
        "ubuntu",
        "/k",
        "/kh",
        "/shared",
        "t",
        (NodeInfo("node-0", "203.0.113.10", "10.42.1.10", 22, 1),),
    )
    argv = ssh_argv(cluster, "node-0", ["grep", "--", "-x", "file"])
    assert argv[-6:] == ["ubuntu@203.0.113.10", "--", "grep", "--", "-x", "file"]
    assert "StrictHostKeyChecking=yes" in argv and "UserKnownHostsFile=/kh" in argv


def test_cloud_init_installs_slurm_with_its_system_services_masked_first_and_a_failed_install_is_not_fatal(tmp_path):
    """The node's Slurm section run by bash against stand-in apt-get and systemctl: the system's daemons are
    masked before the packages can start them, and an apt failure leaves the rest of the boot to go on."""
    calls = tmp_path / "calls"
    for name, code in (("systemctl", 0), ("apt-get", 100)):
        tool = tmp_path / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit {code}\n')
        tool.chmod(0o755)
    script = f"set -euo pipefail\n{SCHEDULER_SETUP}echo booted\n"
    done = subprocess.run(
        ["bash", "-c", script], env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("booted"), done.stdout + done.stderr
    assert "slurm-wlm, munge, slurmdbd, mariadb-server not installed" in done.stdout
    lines = calls.read_text().splitlines()
    assert lines[0] == "systemctl mask munge slurmctld slurmd slurmdbd mariadb"
    assert any(line.startswith("apt-get") for line in lines[1:])
    assert SCHEDULER_SETUP in user_data("fs-1234.efs.us-east-1.amazonaws.com")


# ------------------------------------------------------------------------------ every billed line


@pytest.fixture
def small_stack():
    """`Pulumi.<name>.yaml` of 2 x g4dn.xlarge (EFS, as every AWS cluster has), written in the repository
    where deploy.py reads it; removed afterwards."""
    name = f"t-{secrets.token_hex(4)}"
    path = REPO / f"Pulumi.{name}.yaml"
    path.write_text("config:\n  gpu-cluster:nodes: 2\n  gpu-cluster:instanceType: g4dn.xlarge\n")
    yield name
    path.unlink(missing_ok=True)


def test_plan_of_two_g4dn_xlarge_shows_each_billed_line_and_their_sum(offline, state_dir, small_stack):
    text = run_cli("plan", "--stack", small_stack, **offline)
    assert text.returncode == 0, text.stderr
    rows = text.stdout[text.stdout.index("line by line") :].splitlines()[1:]
    kinds = ["instances", "ebs", "public ipv4", "efs storage", "efs throughput", "data transfer"]
    assert [row.split("/h", 1)[1].split()[0] for row in rows[:6]] == [k.split()[0] for k in kinds]
    assert "2 x $0.526/instance-hour" in rows[0] and "2 x $0.005/address-hour" in rows[2]
    assert [("(estimate)" in row) for row in rows[:6]] == [False, False, False, True, True, True]
    assert rows[6].strip().startswith("= $1.116/h")
    plan = json.loads(run_cli("plan", "--stack", small_stack, "--json", **offline).stdout)
    assert [line["kind"] for line in plan["lines"]] == kinds
    assert plan["hourly_usd"] == pytest.approx(sum(line["hourly_usd"] for line in plan["lines"]), abs=1e-5)
    assert any(r["type"].endswith("CostAllocationTag") for r in plan["resources"])
    assert nothing_created(state_dir)


def test_cost_reconcile_refuses_what_has_no_bill_or_is_not_one_in_one_line(
    offline, state_dir, tmp_path, monkeypatch, capsys
):
    assert_one_line_error(run_cli("cost", "--reconcile", "--stack", "local", **offline), "no bill to compare")
    assert_one_line_error(run_cli("cost", "--reconcile", "--days", "0", **offline), "--days 0", "1..365")
    # the rest in this process (each deploy.py started costs seconds): the same main(), the same one line
    for key, value in offline.items():
        monkeypatch.setenv(key, value)
    not_cur = tmp_path / "costs.csv"
    not_cur.write_text("date,cost\n2026-11-20,1.0\n")

    def refused(*args: str) -> str:
        from deploy import main

        umask = os.umask(0o077)  # main() makes this process's files private: put the test's umask back after
        try:
            assert main(["cost", *args]) == 2
        finally:
            os.umask(umask)
        said = capsys.readouterr()
        assert said.out == "" and said.err.startswith("error: ") and said.err.count("\n") == 1, said
        return said.err

    assert "no bill to compare" in refused("--reconcile", "--stack", "hosts")
    assert "--days goes with --reconcile" in refused("--days", "3")
    assert "no such file" in refused("--bill", str(tmp_path / "none.csv"))
    assert not state_dir.exists() or not any(state_dir.iterdir())  # nothing created, not even a ledger
    billed_cluster_in(state_dir)
    assert "not a CUR 2.0 export" in refused("--bill", str(not_cur), "--stack", "dev")
    assert "AWS credentials do not work" in refused("--reconcile", "--stack", "dev")


def test_cost_bill_sets_a_cur_export_beside_the_ledger(offline, state_dir):
    billed_cluster_in(state_dir)
    result = run_cli("cost", "--bill", str(CUR_FIXTURE), "--stack", "dev", "--json", **offline)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(d["day"], d["within_2pct"]) for d in data["days"]] == [("2026-11-20", True), ("2026-11-21", True)]
    assert {s["resource_id"] for s in data["leak_suspects"]} == {"vol-0dead0beef0000001"}
    from dashboard import sources

    assert sources.reconciliation("dev") is None  # the stack is down: its figures are not kept for a page
    (state_dir / "dev").mkdir(mode=0o700)  # up: the dashboard shows the last reconciliation's figures
    assert run_cli("cost", "--bill", str(CUR_FIXTURE), "--stack", "dev", "--json", **offline).returncode == 0
    shown = sources.reconciliation("dev")
    assert shown is not None and shown["days"] == 2 and shown["leak suspects"] == 1 and shown["source"], shown
    assert abs(float(shown["difference"].rstrip("%"))) <= 2.0, shown
    text = run_cli("cost", "--bill", str(CUR_FIXTURE), "--stack", "dev", **offline).stdout
    assert "leak suspect: 2026-11-20 EBS:VolumeUsage.gp3 vol-0dead0beef0000001" in text
    assert "unmatched" in text and "EBS:SnapshotUsage" in text and "Cost Explorer requests: 0" in text


def billed_cluster_in(state_dir) -> None:
    """The fixture's cluster (2 x g4dn.xlarge, 2026-11-20 06:00 to 2026-11-21 18:00 UTC) in the ledger."""
    from datetime import datetime, timezone

    from infra.ledger import Ledger

    ledger = Ledger(state_dir / "ledger.sqlite")
    start, end = (datetime(2026, 11, d, h, tzinfo=timezone.utc).timestamp() for d, h in ((20, 6), (21, 18)))
    billed_cluster(ledger, "dev", start, end)
    ledger.close()
