"""Bad input on the operator's side through `deploy.py` and `fab` as a user runs them, without a cluster:
every file a user can damage gives one line, and reading commands create nothing. What each value is
checked against: tests/unit/test_validation.py."""

import json
import secrets

import pytest

from infra import config, state
from infra.errors import UsageError
from tests.support import REPO
from tests.support.cli import assert_one_line_error, run_cli, run_fab
from tests.support.ledgers import damage_ledger

# ----------------------------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "content,words",
    [
        (b"evil\nmore\n", "bad stack name in"),
        (b"\xff\xfe\n", "not UTF-8"),
    ],
)
def test_a_damaged_current_file_is_one_line(state_dir, content, words):
    state_dir.mkdir()
    (state_dir / "current").write_bytes(content)
    with pytest.raises(UsageError, match=words):
        state.resolve_stack(None)
    assert_one_line_error(run_cli("status"), words, "--stack")


# -------------------------------------------------------------------------------------- stack files


@pytest.fixture
def stack_file():
    """Write `Pulumi.<name>.yaml` in the repository (where deploy.py reads it); removed afterwards."""
    made = []

    def write(content: bytes | None, folder: bool = False) -> str:
        name = f"t-{secrets.token_hex(4)}"
        path = REPO / f"Pulumi.{name}.yaml"
        made.append(path)
        if folder:
            path.mkdir()
        else:
            path.write_bytes(content)
        return name

    yield write
    for path in made:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "content,words,command",
    [
        (b"config:\n  - gpu-cluster:nodes\n", "`config:` must be a mapping", None),
        (b"config: 3\n", "`config:` must be a mapping", None),
        (b"just a string\n", "must be a YAML mapping", None),
        (b"- a\n- b\n", "must be a YAML mapping", ["plan"]),
        (b"config:\n  gpu-cluster:nodes: 2\n  gpu-cluster:instanceType: \xe9\n", "not UTF-8", ["up", "--local"]),
        (b"config: [unclosed\n", "not valid YAML", None),
        (None, "it is a folder", ["up", "--yes"]),
    ],
)
def test_a_damaged_stack_file_is_one_line_for_plan_and_both_ups(state_dir, stack_file, content, words, command):
    name = stack_file(content, folder=content is None)
    with pytest.raises(UsageError, match=words):
        config.load_stack(name)
    if command:  # each entry point that reads stack files, once
        assert_one_line_error(run_cli(*command, "--stack", name), f"Pulumi.{name}.yaml", words)
        assert not state_dir.exists()


# ------------------------------------------------------------------------------------- inventories


def test_an_inventory_that_is_a_folder_is_one_line_everywhere(state_dir):
    (state_dir / "dev" / "inventory.json").mkdir(parents=True)
    for result in (run_cli("status", "--stack", "dev"), run_fab("hello", "--stack", "dev")):
        assert_one_line_error(result, "inventory", "corrupt", "it is a folder", "down --stack dev")
    (state_dir / "local" / "inventory.json").mkdir(parents=True)  # down still cleans up a local stack
    down = run_cli("down", "--stack", "local")
    assert down.returncode == 0 and down.stderr == "", down.stderr
    assert not (state_dir / "local").exists()


# ------------------------------------------------------------------------------------------ ledger


def test_cost_with_a_damaged_ledger_warns_and_reports(state_dir):
    state_dir.mkdir()
    damage_ledger(
        state_dir / "ledger.sqlite",
        "UPDATE intervals SET started_at = 'yesterday'; "
        "INSERT INTO clusters (stack, provider, instance_type, nodes, hourly_usd, created_at) "
        "VALUES ('dev', 'aws', 'g4dn.2xlarge', 2, 'one dollar', 1.0);",
    )
    result = run_cli("cost", "--json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "was corrupt" in result.stdout and json.loads(result.stdout[result.stdout.index("{") :])["total_usd"] == 0


# --------------------------------------------------------------------------- reading creates nothing


def test_cost_status_ssh_and_plan_on_a_fresh_machine_create_nothing(state_dir):
    assert run_cli("cost").returncode == 0
    assert run_cli("cost", "--json", "--stack", "dev").returncode == 0
    assert_one_line_error(run_cli("status"), "no cluster")
    assert_one_line_error(run_cli("ssh"), "no cluster")
    assert run_cli("down").returncode == 0
    assert run_cli("plan", "--json").returncode == 0
    assert not state_dir.exists()


def test_down_of_an_unknown_local_stack_creates_nothing(state_dir):
    result = run_cli("down", "--stack", "local")
    assert result.returncode == 0 and "nothing to do" in result.stdout
    assert not state_dir.exists()


# ----------------------------------------------------------------------------------- command lines


@pytest.mark.parametrize(
    "args,words",
    [
        (["up", "--local", "--nodes", ""], ["nodes must be a whole number", "''"]),
        (["up", "--local", "--instance-type", ""], ["instance type ''", "not supported"]),
        (["up", "--local", "--stack", ""], ["bad stack name ''"]),
        (["up", "--local", "--stack", "evil\n"], ["bad stack name 'evil\\n'"]),
        (["up", "--local", "--instance-type", "g4dn.xlarge\n"], ["not supported"]),
        (["up", "--local", "--bind", ""], ["--bind ''"]),
        (["up", "--local", "--ssh-port", "80"], ["--ssh-port 80", "1024..65535"]),
        (["up", "--local", "--ssh-port", " 2222"], ["--ssh-port", "' 2222'"]),
        (["up", "--local", "--nodes", "2", "--ssh-port", "65535"], ["--ssh-port 65535", "node-1", "1024..65534"]),
        (["up", "--local", "--nodes", "2", "--bind", "127.0.89.255"], ["127.0.89.1..127.0.89.254", "1 to 253"]),
        (["up", "--local", "--bind", "127.0.89.0"], ["--bind 127.0.89.0", "127.0.89.1..127.0.89.254"]),
        (["up", "--local", "--max-total-usd", ""], ["maxTotalUsd"]),
        (["up", "--local", "--instance-type", "g5.96xlarge"], ["g5.96xlarge", "not supported"]),
        (["status", "--stack", ""], ["bad stack name ''"]),
        (["down", "--stack", "evil\n"], ["bad stack name"]),
        (["cost", "--stack", ""], ["bad stack name ''"]),
        (["up", "--local", "--", "--nodes", "3"], ["unrecognized arguments after --"]),
        (["up", "--local", "--spot", "--yes"], ["--yes", "do(es) not apply to --local"]),
        (["up", "--local", "--ssh-cidr", "203.0.113.7/32"], ["--ssh-cidr", "not apply to --local"]),
        (["up", "--hosts", "hosts.yaml", "--nodes", "2"], ["--nodes", "not apply to --hosts"]),
        (["up", "--stack", "dev", "--bind", "127.0.0.20"], ["--bind", "not apply to AWS"]),
        (["up", "--local", "--gpus", "9"], ["--gpus 9", "0 to 8"]),
        (["up", "--local", "--gpus", "-1"], ["--gpus", "whole number"]),
        (["up", "--stack", "dev", "--gpus", "1"], ["--gpus", "not apply to AWS"]),
    ],
)
def test_bad_command_lines_are_one_line_and_create_nothing(state_dir, args, words):
    assert_one_line_error(run_cli(*args), *words)
    assert not state_dir.exists()


# ----------------------------------------------------------------------------------------- catalog


def test_plan_of_a_type_only_the_price_list_api_prices_says_so(state_dir, stack_file):
    name = stack_file(b"config:\n  gpu-cluster:instanceType: p5.48xlarge\n  gpu-cluster:nodes: 1\n")
    result = run_cli("plan", "--stack", name, "--json")
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    assert planned["hourly_usd"] is None and "Price List API" in planned["price_note"]
    assert [r["settings"]["type"] for r in planned["resources"] if r["type"].endswith("Instance")] == ["p5.48xlarge"]
