"""Preflight against moto and Stubber: every check, and all problems reported together."""

from dataclasses import replace

import boto3
import pytest

from infra import catalog, preflight
from infra import config as stack_config
from infra.tags import STACK_TAG
from tests.support.aws_fakes import LINKED_ACCOUNT, clients, cost_tags_client, moto_aws


@pytest.fixture
def aws(monkeypatch, state_dir):
    with moto_aws(monkeypatch):
        yield


def check(raw: dict | None = None, cli: bool = True, ip: str | None = "203.0.113.7", **client_options):
    config = stack_config.validate("dev", {"nodes": 2, "instanceType": "g4dn.2xlarge", **(raw or {})})

    def lookup():
        if ip is None:
            raise OSError("no network")
        return ip

    return preflight.run(config, clients(config.region, **client_options), cli_present=cli, lookup_ip=lookup)


def test_a_good_request_passes_with_zones_cidr_and_a_price(aws):
    result = check()
    assert result.problems == []
    assert result.account == "123456789012"
    assert result.zones == sorted(result.zones) and "us-east-1a" in result.zones
    assert result.ssh_cidr == "203.0.113.7/32"
    assert result.vcpus_needed == 16 and result.vcpus_free == 64
    assert result.estimate.instance.source == "AWS Price List API"
    assert result.estimate.instances_hourly_usd == pytest.approx(1.504)
    assert result.cost_tag_seen and result.notes == []  # billing lists the stack tag (Active): activated, no word


def test_a_quota_too_low_is_refused_with_its_name_and_numbers(aws):
    result = check(quota_vcpus=8)
    assert len(result.problems) == 1
    assert "Running On-Demand G and VT instances" in result.problems[0]
    assert "8 vCPUs" in result.problems[0] and "needs 16" in result.problems[0] and "L-DB2E81BA" in result.problems[0]


def test_the_quota_counts_what_already_runs(aws):
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=2, MaxCount=2, InstanceType="g4dn.xlarge")  # 8 vCPUs
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="t3.large")  # another quota
    result = check(quota_vcpus=20)
    assert result.vcpus_free == 12
    assert any("with 8 in use" in p for p in result.problems)


def test_a_type_not_offered_in_the_region_is_refused(aws):
    result = check({"instanceType": "g6.2xlarge", "region": "us-west-1"})
    assert any("g6.2xlarge is not offered in any zone of us-west-1" in p for p in result.problems)


def test_a_pinned_zone_that_does_not_offer_the_type_is_refused(aws):
    result = check({"availabilityZone": "us-east-1z"})
    assert any("not offered in us-east-1z" in p for p in result.problems)


def test_a_type_aws_does_not_describe_is_refused(aws):
    config = replace(stack_config.validate("dev", {}), instance_type="g4dn.99xlarge")  # past the catalog's check
    result = preflight.run(config, clients(config.region), cli_present=True, lookup_ip=lambda: "203.0.113.7")
    assert any("g4dn.99xlarge does not exist" in p for p in result.problems)


def test_the_quota_family_and_vcpus_come_from_the_catalog(aws):
    assert preflight.quota_family("p3.2xlarge") == "P" and preflight.quota_family("g6e.xlarge") == "G"
    result = check({"instanceType": "g5.12xlarge", "nodes": 3}, quota_vcpus=100)
    assert result.vcpus_needed == 3 * catalog.lookup("g5.12xlarge").vcpus == 144
    assert any("needs 144" in p for p in result.problems)


def test_a_missing_ami_is_refused(aws):
    result = check(ami_found=False)
    assert any("no Deep Learning Base GPU AMI" in p for p in result.problems)


def test_a_pinned_image_must_exist_in_the_region_and_be_available(aws):
    missing = check({"amiId": "ami-0123456789abcdef0"}, ami_found=False).problems
    assert missing == [
        "image ami-0123456789abcdef0 does not exist in us-east-1: python deploy.py image list shows ours"
    ]
    ec2 = boto3.client("ec2", region_name="us-east-1")
    instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g4dn.xlarge")
    image = ec2.create_image(InstanceId=instance["Instances"][0]["InstanceId"], Name="baked")["ImageId"]
    assert check({"amiId": image}, ami_found=False).problems == []  # the DLAMI parameter is not asked


def test_missing_cli_credentials_and_ip_are_all_reported_at_once(monkeypatch, state_dir):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(state_dir / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(state_dir / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = check(cli=False, ip=None)
    assert len(result.problems) == 3
    assert "Pulumi CLI is not installed" in result.problems[0]
    assert "AWS credentials do not work" in result.problems[1]
    assert "--ssh-cidr" in result.problems[2]
    assert result.estimate.instance.source.startswith("bundled table")  # priced offline all the same


def test_an_estimate_above_max_hourly_usd_is_refused(aws):
    result = check({"maxHourlyUsd": 1.0})
    assert any("would cost $1.568/h, above maxHourlyUsd $1" in p for p in result.problems)
    assert check({"maxHourlyUsd": 2.0}).problems == []


@pytest.mark.parametrize(
    "answer, seen, said",
    [
        ({"status": "Inactive"}, True, None),
        ({"status": None}, False, "billing does not list the key yet"),
        ({"error": ("AccessDeniedException", LINKED_ACCOUNT)}, False, "the payer account activates it"),
        ({"error": ("ThrottlingException", "Rate exceeded")}, False, "the next up asks again"),
    ],
    ids=["inactive", "not-listed-yet", "member-account", "throttled"],
)
def test_whether_billing_lists_the_stack_tag_decides_its_activation_and_never_stops_up(aws, answer, seen, said):
    result = check(ce=cost_tags_client(**answer))
    assert result.problems == []
    assert result.cost_tag_seen is seen
    about_tag = [note for note in result.notes if STACK_TAG in note]
    if said is None:
        assert about_tag == []
    else:
        assert len(about_tag) == 1 and "not activated as a cost-allocation tag by this up" in about_tag[0]
        assert said in about_tag[0]


def test_cost_explorer_is_not_asked_when_the_stack_turns_the_tag_off(aws):
    result = check({"costAllocationTag": "false"}, ce=object())  # any call to it would fail the test
    assert result.problems == [] and result.cost_tag_seen is False
    assert not any(STACK_TAG in note for note in result.notes)
