"""Bad input on the operator's side, checked where it is read: every value is checked whole (an empty
string is a bad value, a trailing newline is not ignored), and every file a user can damage is one error.
The same through `deploy.py` and `fab`: tests/integration/test_validation.py."""

import json
import os
import re
import sqlite3
from dataclasses import replace

import pytest
import yaml

from infra import catalog, config, inventory, state
from infra.errors import UsageError
from infra.ledger import Ledger
from infra.providers import hosts
from remote import options
from tests.support import REPO
from tests.support.ledgers import damage_ledger

# ----------------------------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("nodes", "", "nodes must be a whole number"),
        ("nodes", "2\n", "nodes must be a whole number"),
        ("nodes", " 2", "nodes must be a whole number"),
        ("nodes", True, "nodes must be a whole number"),
        ("nodes", 2.5, "nodes must be a whole number"),
        ("instanceType", "", "is not supported"),
        ("instanceType", "g4dn.xlarge\n", "is not supported"),
        ("instanceType", "g5.96xlarge", "is not supported"),  # an unlisted multi-GPU type, not one process per node
        ("region", "us-east-1\n", "not a region name"),
        ("region", "", "not a region name"),
        ("availabilityZone", "", "not a zone name"),
        ("availabilityZone", "us-east-1a\n", "not a zone name"),
        ("availabilityZone", "us-west-2a", "is not in aws:region us-east-1"),
        ("amiId", "ami-0123456789abcdef0\n", "not an AMI id"),
        ("sshCidr", "", "not a CIDR block"),
        ("sshCidr", "203.0.113.7/32\n", "not a CIDR block"),
        ("sshPublicKey", "ssh-ed25519 AAAAC3Nz\nssh-rsa AAAAB3Nz", "not one OpenSSH public key line"),
        ("rootVolumeGb", "100\n", "rootVolumeGb has a bad value"),
        ("maxTotalUsd", "", "maxTotalUsd must be a positive number"),
        ("maxTotalUsd", "5\n", "maxTotalUsd must be a positive number"),
        ("idleMinutes", "nan", "idleMinutes must be a positive number"),
        ("spot", "true\n", "spot has a bad value"),
    ],
)
def test_every_config_value_is_checked_whole(key, value, words):
    with pytest.raises(UsageError, match=words.replace(".", r"\.")):
        config.validate("dev", {key: value})


def test_good_values_still_pass_as_text_or_yaml_types():
    parsed = config.validate(
        "dev",
        {
            "nodes": "3",
            "instanceType": "g6.2xlarge",
            "maxTotalUsd": "2.5",
            "idleMinutes": 30,
            "rootVolumeGb": 200,
            "spot": "true",
            "availabilityZone": "us-east-1b",
            "sshCidr": "203.0.113.7/32",
            "sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA user@host",
        },
    )
    assert (parsed.nodes, parsed.max_total_usd, parsed.idle_minutes, parsed.spot) == (3, 2.5, 30.0, True)
    assert config.validate("dev", {"nodes": None}).nodes == 2  # None is "not given"


@pytest.mark.parametrize("name", ["", "evil\n", "Bad", "-x", "a" * 41, "../x"])
def test_stack_names_are_matched_whole(name, monkeypatch):
    with pytest.raises(UsageError, match="bad stack name"):
        state.check_stack_name(name)
    with pytest.raises(UsageError, match="bad stack name"):
        state.resolve_stack(name)
    monkeypatch.setenv("CLUSTER_STACK", name)
    if name:  # an empty $CLUSTER_STACK counts as unset, as `export CLUSTER_STACK=` means in a shell
        with pytest.raises(UsageError, match=r"bad \$CLUSTER_STACK"):
            state.resolve_stack(None)


# ------------------------------------------------------------------------------------- inventories


def write_inventory(state_dir, stack: str, data) -> None:
    (state_dir / stack).mkdir(parents=True, exist_ok=True)
    (state_dir / stack / "inventory.json").write_text(json.dumps(data))


GOOD_INVENTORY = {
    "stack": "dev",
    "provider": "aws",
    "region": "us-east-1",
    "instance_type": "g4dn.2xlarge",
    "hourly_usd": 1.5,
    "ssh_user": "ubuntu",
    "ssh_key": "/k",
    "known_hosts": "/kh",
    "shared_dir": "/shared",
    "created_at": "t",
    "nodes": [{"name": "node-0", "public_ip": "203.0.113.10", "private_ip": "10.42.1.10", "ssh_port": 22, "gpus": 1}],
}


@pytest.mark.parametrize(
    "data,words",
    [
        ([1, 2], "not a JSON object"),
        ({**GOOD_INVENTORY, "nodes": {}}, "nodes must be a non-empty list"),
        ({**GOOD_INVENTORY, "nodes": ["node-0"]}, "must be a JSON object"),
        ({**GOOD_INVENTORY, "hourly_usd": "1.5"}, "hourly_usd must be a number"),
        ({**GOOD_INVENTORY, "ssh_key": None}, "ssh_key must be a string"),
        (
            {**GOOD_INVENTORY, "nodes": [{**GOOD_INVENTORY["nodes"][0], "ssh_port": "22"}]},
            "ssh_port must be a whole number",
        ),
    ],
)
def test_an_inventory_of_the_wrong_shape_is_corrupt(state_dir, data, words):
    write_inventory(state_dir, "dev", data)
    with pytest.raises(UsageError, match=f"corrupt.*{words}"):
        inventory.load("dev")


# ------------------------------------------------------------------------------------------ ledger


@pytest.mark.parametrize(
    "statement",
    [
        "DROP TABLE runs; CREATE TABLE runs (id INTEGER PRIMARY KEY, note TEXT);",
        "INSERT INTO runs (run_id, stack, task, nodes, hourly_usd, started_at, exit_codes) "
        "VALUES ('r1', 'dev', 'hello', 2, 1.0, 1.0, '{not json');",
        "INSERT INTO runs (run_id, stack, task, nodes, hourly_usd, started_at, exit_codes) "
        "VALUES ('r1', 'dev', 'hello', 2, 1.0, 1.0, '[0, 1]');",
        "INSERT INTO clusters (stack, provider, instance_type, nodes, hourly_usd, created_at) "
        "VALUES ('dev', 'aws', 'g4dn.2xlarge', 2, 'one dollar', 1.0);",
    ],
)
def test_a_ledger_that_does_not_read_back_is_kept_aside_like_a_corrupt_file(tmp_path, statement):
    path = tmp_path / "ledger.sqlite"
    damage_ledger(path, statement)
    ledger = Ledger(path)
    assert len(ledger.warnings) == 1 and "corrupt" in ledger.warnings[0]
    assert ledger.clusters() == [] and ledger.runs() == []
    [backup] = tmp_path.glob("ledger.sqlite.corrupt-*")
    assert sqlite3.connect(backup).execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0


# ----------------------------------------------------------------------------------- command lines


def test_help_lists_every_command_and_each_has_its_own(capsys):
    import deploy

    with pytest.raises(SystemExit):
        deploy.parse_args(["--help"])
    commands_section = capsys.readouterr().out.split("COMMAND", 2)[-1]
    for command in ("up", "down", "status", "plan", "cost", "ssh"):
        assert any(line.split()[:1] == [command] for line in commands_section.splitlines()), command
        with pytest.raises(SystemExit) as exited:
            deploy.parse_args([command, "--help"])  # a deleted subcommand is a UsageError, not a help page
        assert exited.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python deploy.py {command}")


# ----------------------------------------------------------------------------------------- catalog


def test_every_catalog_type_validates_prices_and_plans(state_dir):
    from infra import plan, pricing

    for name, facts in catalog.instance_types().items():
        parsed = config.validate("dev", {"instanceType": name, "nodes": 2})
        assert parsed.gpus_per_node == facts.gpus >= 1 and facts.quota_family == name[0].upper()
        bundled = pricing.BUNDLED["on_demand_usd_per_hour"]["us-east-1"]
        assert (name in bundled) == facts.bundled_price, f"{name}: the catalog and prices.json disagree"
        estimate, note = plan.estimate(parsed)
        if facts.bundled_price:
            assert estimate.instances_hourly_usd == pytest.approx(2 * bundled[name]) and not note
        else:
            assert estimate is None and "Price List API" in note
        run = plan.run_program(plan.plan_config(parsed))
        instances = [r for r in run.resources if r.type == "aws:ec2/instance:Instance"]
        assert [r.inputs["instanceType"] for r in instances] == [name, name]
        assert facts.gpu in catalog.gpu_peak_tflops()
    assert set(pricing.BUNDLED["on_demand_usd_per_hour"]["us-east-1"]) <= set(catalog.instance_types())


def test_validation_preflight_pricing_and_the_harness_read_the_one_catalog(monkeypatch, tmp_path):
    from harness import metrics
    from infra import preflight, pricing

    document = json.loads(catalog.CATALOG_PATH.read_text())
    document["instance_types"]["g9.xlarge"] = {
        "gpu": "Z1",
        "gpus": 2,
        "vcpus": 6,
        "quota_family": "P",
        "bundled_price": False,
    }
    document["gpu_peak_tflops"]["Z1"] = {"bf16": 123.0}
    monkeypatch.setattr(catalog, "_document", lambda: document)
    assert config.validate("dev", {"instanceType": "g9.xlarge"}).gpus_per_node == 2
    assert preflight.quota_family("g9.xlarge") == "P"
    with pytest.raises(UsageError, match="g9.xlarge has no bundled price"):
        pricing.bundled_on_demand("g9.xlarge", "us-east-1")

    assert metrics.CATALOG_PATH == catalog.CATALOG_PATH  # the harness reads the same file, shipped with it
    copy = tmp_path / "catalog.json"
    copy.write_text(json.dumps(document))
    monkeypatch.setattr(metrics, "CATALOG_PATH", copy)
    assert metrics.peak_tflops("NVIDIA Z1 96GB", "bf16") == 123.0


def test_the_key_is_checked_before_a_command_logs_in(tmp_path):
    key, known_hosts = tmp_path / "key", tmp_path / "known_hosts"
    cluster = inventory.ClusterInfo.from_dict({**GOOD_INVENTORY, "ssh_key": str(key), "known_hosts": str(known_hosts)})
    with pytest.raises(UsageError, match="the cluster key .* is missing"):
        inventory.check_login_files(cluster)
    key.write_text("k")
    for mode in (0o644, 0o640, 0o604):
        key.chmod(mode)
        with pytest.raises(UsageError, match=f"mode {mode:04o}.*chmod 600 {key}"):
            inventory.check_login_files(cluster)
    key.chmod(0o600)
    with pytest.raises(UsageError, match="pinned host keys .* are missing"):
        inventory.check_login_files(cluster)
    known_hosts.write_text("")
    inventory.check_login_files(replace(cluster))


# ------------------------------------------------------------------------ what jobs on a node can write


def test_a_damaged_stop_marker_cannot_damage_the_ledger(state_dir):
    from infra import costs

    Ledger().cluster_up("local", "local", "g4dn.2xlarge", 2, 0.0)
    costs.record_self_stop("local", ["not", "text"], "yesterday", say=print)
    reopened = Ledger()
    [cluster] = reopened.clusters("local")
    assert reopened.warnings == [] and isinstance(cluster.intervals[0].ended_at, float)
    assert cluster.intervals[0].end_reason == "stopped itself: ['not', 'text']"


def test_a_node_server_never_signals_its_own_init_or_every_group_from_a_pid_file(tmp_path):
    from infra.providers.local.node_server import PID_REGISTRY, ProcessTable

    registry = tmp_path / PID_REGISTRY
    registry.mkdir(parents=True)
    for name, text in {"a": "0", "b": "1", "c": "-1", "d": "abc", "e": str(os.getpid()), "f": "4242 x"}.items():
        (registry / f"{name}.pid").write_text(text)
    assert ProcessTable(tmp_path, "token").registered_daemons() == [4242]


@pytest.mark.parametrize("given,name", [("1", "node-1"), ("node-1", "node-1"), ("0", "node-0"), (None, None)])
def test_a_node_is_named_by_its_name_or_its_number(given, name):
    assert options.node_name("--node", given) == name


@pytest.mark.parametrize("given", ["", " 1", "node-", "node-01", "-1", "node-1\n", "head"])
def test_a_node_that_names_no_node_is_one_line(given):
    with pytest.raises(UsageError, match="--node must name a node as node-1 or 1"):
        options.node_name("--node", given)


@pytest.mark.parametrize(
    "text, line, key",
    [
        ("key: /k\nuser: a\nhosts: [h]\nuser: b\n", 4, "user"),
        ("key: /k\nhosts:\n  - address: h\n    port: 22\n    port: 23\n", 5, "port"),
        ("key: /k\nhosts:\n  - {address: h, slurm_name: a, slurm_name: b}\n", 3, "slurm_name"),
    ],
)
def test_a_hosts_file_key_given_twice_at_any_level_is_named_with_its_line(tmp_path, text, line, key):
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=rf"at line {line}: key '{key}' is given twice \(first at line "):
        hosts.read_hosts_file(str(path))


def test_a_yaml_merge_may_still_override_what_it_brings_in():
    assert yaml.load("a: &x {k: 1, j: 2}\nb: {<<: *x, k: 3}\n", Loader=hosts.UniqueKeyLoader)["b"] == {"k": 3, "j": 2}


@pytest.mark.parametrize(
    "args,refused",
    [
        ("--precision fp32 --steps 5", ""),  # the replica loop's own precision
        ("--precision=fp32", ""),
        ("--co", ""),  # too short to be read as --compile here; the example's argparse says what it is
        ("--precision fp16", "--precision"),
        ("--precision", "--precision"),
        ("--preci=bf16 --comp", "--compile --precision"),
        ("--profile-dir /tmp/p", "--profile-dir"),
    ],
)
def test_run_ddp_flags_a_replica_group_does_not_take_are_named(args, refused):
    from remote.tasks_launch import EXAMPLE_TASKS

    ddp = next(task for task in EXAMPLE_TASKS if task.name == "run-ddp")
    words = options.script_arguments(args)
    if not refused:
        options.refuse_plain_only(words, ddp.plain_only, ddp.name)
        return
    with pytest.raises(UsageError, match=f"^--args {refused}: run-ddp --replicas"):
        options.refuse_plain_only(words, ddp.plain_only, ddp.name)


def test_the_plain_only_flags_of_run_ddp_are_the_examples_own():
    """The operator's list and the example's (which refuses them on the nodes for torchrun users) agree."""
    import ast

    from remote.tasks_launch import EXAMPLE_TASKS

    source = ast.parse((REPO / "examples" / "ddp_training.py").read_text())
    assigned = next(
        n for n in ast.walk(source) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PLAIN_ONLY"
    )
    names = {f"--{name.replace('_', '-')}" for name in ast.literal_eval(assigned.value)}
    ddp = next(task for task in EXAMPLE_TASKS if task.name == "run-ddp")
    assert {entry.partition("=")[0] for entry in ddp.plain_only} == names


@pytest.mark.parametrize("written", ["shared_dir: ''", "shared_dir:", "shared_dir: ' '"])
def test_a_hosts_file_shared_dir_written_empty_is_refused_not_read_as_none(tmp_path, written):
    key = tmp_path / "id_ed25519"
    key.write_text("")
    key.chmod(0o600)
    path = tmp_path / "hosts.yaml"
    path.write_text(f"key: {key}\nuser: a\nhosts: [h]\n{written}\n")
    with pytest.raises(UsageError, match=r"hosts.yaml: shared_dir: (is empty|must be one line of text)"):
        hosts.read_hosts_file(str(path))


@pytest.mark.parametrize("notice", [" 5", "5\n", "nan", "inf", "1e3", "1_0", "", "-1"])
def test_a_drill_notice_is_read_as_typed(notice):
    import deploy

    with pytest.raises(UsageError, match=re.escape(f"argument --notice: must be a number of seconds, not {notice!r}")):
        deploy.parse_args(["drill", "spot", "node-1", "--notice", notice])
    assert deploy.parse_args(["drill", "spot", "node-1", "--notice", "0.5"]).notice == 0.5


# ------------------------------------------------------------------------- hostile numbers (h51's audit)

DIGITS_5000 = "9" * 5000  # int() refuses text over 4,300 digits with a ValueError of its own


@pytest.mark.parametrize(
    "read",
    [
        lambda v: options.integer("--lines", v, 50, minimum=0),
        lambda v: options.integer("since", v, 0, minimum=0),  # the dashboard's ?since=
        lambda v: options.port("--master-port", v, 29500),
        lambda v: config.check_nodes(v),
    ],
    ids=["fab-integer", "dashboard-since", "fab-port", "up-nodes"],
)
@pytest.mark.parametrize("value", [DIGITS_5000, "-" + DIGITS_5000, "1" + "0" * 19])
def test_a_number_of_thousands_of_digits_is_one_line_that_does_not_echo_it(read, value):
    with pytest.raises(UsageError) as refused:
        read(value)
    line = str(refused.value)
    assert "\n" not in line and len(line) < 200, line
    assert f"({len(value)} characters)" in line or len(value) < 60


@pytest.mark.parametrize(
    "argv",
    [
        ["cost", "--reconcile", "--days", DIGITS_5000],
        ["dashboard", "--port", DIGITS_5000],
        ["up", "--local", "--ssh-port", DIGITS_5000],
        ["up", "--local", "--gpus", DIGITS_5000],
        ["drill", "spot", "node-1", "--notice", DIGITS_5000 + "x"],
    ],
)
def test_deploy_refuses_thousands_of_digits_in_one_short_line(argv):
    import deploy

    with pytest.raises(UsageError) as refused:
        deploy.parse_args(argv)
    line = str(refused.value)
    assert "must be" in line and "_whole_number" not in line and len(line) < 250, line


@pytest.mark.parametrize("value", ["1001", "99999999999999999999"])
def test_max_restarts_has_a_ceiling(value):
    from remote import tasks_launch as tasks

    with pytest.raises(UsageError, match="--max-restarts must be a whole number from 0 to 1000"):
        tasks.restarts(value)
    assert tasks.restarts("1000") == 1000


def test_an_over_long_stack_name_is_named_in_short(monkeypatch):
    with pytest.raises(UsageError) as refused:
        state.check_stack_name("a" * 5000)
    assert len(str(refused.value)) < 200 and "(5000 characters)" in str(refused.value)


@pytest.mark.parametrize("given", ["/dev/zero", "fifo", "big"])
def test_a_requirements_file_that_never_ends_or_is_not_a_file_is_one_line(given, tmp_path):
    path = tmp_path / given
    if given == "fifo":
        os.mkfifo(path)
    elif given == "big":
        path.write_text("torch\n" * 1_000_000)
    else:
        path = given
    with pytest.raises(UsageError, match=r"--requirements .* (is not a regular file|is over 4,000,000 bytes)"):
        options.requirements_file(str(path))


@pytest.mark.parametrize("given", ["/dev/zero", "fifo", "big", "nul"])
def test_a_hosts_file_that_never_ends_or_is_not_yaml_text_is_one_line(given, tmp_path):
    path = tmp_path / given
    if given == "fifo":
        os.mkfifo(path)
    elif given == "big":
        path.write_text("# a log, not a hosts file\n" * 100_000)
    elif given == "nul":
        path.write_bytes(b"key: k\nhosts:\n  - address: 127.0.0.1\n\x00\n")
    else:
        path = given
    with pytest.raises(UsageError) as refused:
        hosts.read_hosts_file(str(path))
    assert "\n" not in str(refused.value)
    assert re.search(
        r"not a regular file|is over 1,000,000 bytes|not valid YAML: unacceptable character", str(refused.value)
    )


def test_down_of_a_local_stack_already_down_needs_no_pulumi(state_dir, capsys):
    """A second `down` of a local stack found no inventory and went to AWS: 'the Pulumi CLI is not installed'."""
    import deploy

    ledger = Ledger(state_dir / "ledger.sqlite")
    ledger.cluster_up("gone", "local", "g4dn.2xlarge", 2, 0.0, at=1.0)
    ledger.cluster_down("gone", at=2.0)
    ledger.close()
    assert deploy.main(["down", "--stack", "gone"]) == 0
    assert "stack 'gone' is not up" in capsys.readouterr().out


@pytest.mark.parametrize("task", ["results", "logs"])
def test_an_empty_run_id_is_refused_by_every_task_that_takes_one(task, state_dir):
    """`fab results --run ''` fetched the newest run's results instead: an empty value is no run."""
    import invoke

    from remote import tasks

    with pytest.raises(UsageError, match=r"--run '' is not a run id"):
        getattr(tasks, task)(invoke.Context(), run="", stack="nosuch")


@pytest.mark.parametrize(
    "given,said",
    [("", "--bill '': is empty"), ("/dev/null", "--bill '/dev/null': is not a file"), (".", "is not a file")],
)
def test_a_bill_that_is_no_file_is_named_as_given(given, said, state_dir):
    """`--bill ''` was named '.' and /dev/null 'no such file'."""
    import deploy
    from tests.support.ledgers import billed_cluster

    ledger = Ledger(state_dir / "ledger.sqlite")
    billed_cluster(ledger, "dev", 1.0, 2.0)
    ledger.close()
    with pytest.raises(UsageError, match=re.escape(said)):
        deploy._cost_reconcile(deploy.parse_args(["cost", "--stack", "dev", "--bill", given]))
