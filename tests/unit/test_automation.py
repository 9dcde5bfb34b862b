"""The Automation API wrapper against a fake PulumiCommand: what it asks the CLI to do, and when."""

import os
import stat

import pytest

from infra import automation, preflight
from infra import config as stack_config
from infra.errors import OperationError, UsageError
from infra.providers import aws as aws_provider
from tests.support.pulumi_fakes import OUTPUTS, FakePulumi


def config(**raw):
    values = {"sshCidr": "203.0.113.7/32", "sshPublicKey": "ssh-ed25519 AAAAC3Nza test", "nodes": 2}
    values.update(raw)
    return stack_config.validate("dev", values)


def test_up_selects_the_stack_writes_its_config_and_returns_outputs(state_dir):
    fake = FakePulumi()
    deployment = automation.Deployment("dev", fake, on_output=lambda line: None)
    deployment.configure(config(spot=True, maxHourlyUsd=2.5))
    outputs = deployment.up()
    assert outputs == OUTPUTS
    assert fake.calls[0][:4] == ["stack", "select", "--stack", "dev"]
    assert fake.config["gpu-cluster:nodes"] == "2" and fake.config["gpu-cluster:spot"] == "true"
    assert fake.config["gpu-cluster:maxHourlyUsd"] == "2.5" and fake.config["aws:region"] == "us-east-1"
    assert "gpu-cluster:amiId" not in fake.config  # unset keys are left out, not written as "None"
    up = next(c for c in fake.calls if c[0] == "up")
    assert "--yes" in up and "--skip-preview" in up and up[up.index("--stack") + 1] == "dev"


@pytest.mark.parametrize("seen", [True, False])
def test_up_hands_the_program_preflights_answer_on_the_cost_allocation_tag(state_dir, seen):
    found = preflight.PreflightResult(ssh_cidr="203.0.113.7/32", cost_tag_seen=seen)
    wanted = aws_provider.program_config(stack_config.validate("dev", {"nodes": 2}), found, "ssh-ed25519 AAAAC3Nza t")
    fake = FakePulumi()
    automation.Deployment("dev", fake, on_output=lambda line: None).configure(wanted)
    assert fake.config["gpu-cluster:costAllocationTagSeen"] == ("true" if seen else "false")
    # What the program reads back (infra/__main__.py: every key of CONFIG_KEYS) is the config up decided on.
    read_back = {key: fake.config.get(f"gpu-cluster:{key}") for key in stack_config.CONFIG_KEYS}
    assert stack_config.validate("dev", {**read_back, "region": fake.config["aws:region"]}) == wanted


def test_destroy_clears_pending_operations_refreshes_destroys_and_forgets_the_stack(state_dir):
    fake = FakePulumi(pending=[{"type": "creating", "resource": {"urn": "urn:pulumi:dev::x"}}])
    automation.Deployment("dev", fake, on_output=lambda line: None).destroy()
    assert fake.imported["deployment"]["pending_operations"] == []
    order = fake.commands()
    assert order.index("stack export") < order.index("stack import") < order.index("refresh") < order.index("destroy")
    assert fake.calls[-1][:2] == ["stack", "rm"]


def test_destroy_without_pending_operations_imports_nothing(state_dir):
    fake = FakePulumi()
    automation.Deployment("dev", fake, on_output=lambda line: None).destroy()
    assert "stack import" not in fake.commands() and fake.imported is None


def test_no_capacity_moves_up_to_the_next_zone_and_says_which_were_tried(state_dir):
    fake = FakePulumi(no_capacity={"us-east-1a"})
    said = []
    deployment = automation.Deployment("dev", fake, on_output=lambda line: None)
    outputs = aws_provider._up_with_zone_fallback(deployment, config(), ["us-east-1a", "us-east-1b"], said.append)
    assert outputs == OUTPUTS
    assert fake.config["gpu-cluster:availabilityZone"] == "us-east-1b"
    assert any("no g4dn.2xlarge capacity in us-east-1a" in line for line in said)
    assert sum(1 for c in fake.calls if c[0] == "up") == 2


def test_no_capacity_anywhere_fails_naming_every_zone(state_dir):
    fake = FakePulumi(no_capacity={"us-east-1a", "us-east-1b"})
    deployment = automation.Deployment("dev", fake, on_output=lambda line: None)
    with pytest.raises(OperationError, match="zones tried: us-east-1a, us-east-1b.*no capacity in any zone"):
        aws_provider._up_with_zone_fallback(deployment, config(), ["us-east-1a", "us-east-1b"], lambda line: None)


def test_state_is_local_and_the_passphrase_is_generated_once_and_private(state_dir, monkeypatch):
    for name in ("PULUMI_BACKEND_URL", "PULUMI_CONFIG_PASSPHRASE", "PULUMI_CONFIG_PASSPHRASE_FILE"):
        monkeypatch.delenv(name, raising=False)
    fake = FakePulumi()
    automation.Deployment("dev", fake, on_output=lambda line: None)
    assert fake.env["PULUMI_BACKEND_URL"] == (state_dir / "pulumi").as_uri()
    passphrase = state_dir / "pulumi" / "passphrase"
    assert fake.env["PULUMI_CONFIG_PASSPHRASE_FILE"] == str(passphrase)
    assert stat.S_IMODE(os.stat(passphrase).st_mode) == 0o600
    first = passphrase.read_text()
    automation.Deployment("dev", FakePulumi(), on_output=lambda line: None)
    assert passphrase.read_text() == first


def test_the_users_own_backend_and_passphrase_win(state_dir, monkeypatch):
    monkeypatch.setenv("PULUMI_BACKEND_URL", "s3://my-state")
    monkeypatch.setenv("PULUMI_CONFIG_PASSPHRASE", "mine")
    fake = FakePulumi()
    automation.Deployment("dev", fake, on_output=lambda line: None)
    assert "PULUMI_BACKEND_URL" not in fake.env and "PULUMI_CONFIG_PASSPHRASE_FILE" not in fake.env
    assert not (state_dir / "pulumi" / "passphrase").exists()


def test_a_missing_cli_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert automation.find_cli() is None
    with pytest.raises(UsageError, match="Pulumi CLI is not installed.*get.pulumi.com"):
        automation.cli_command()
