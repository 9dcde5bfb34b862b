"""Everything `deploy.py up` checks on AWS before it creates anything; all problems reported together.

The Pulumi CLI is there; AWS credentials work (STS); the instance type exists and which zones of the
region offer it; the running-instance vCPU quota (G and VT, or P; on-demand or spot) covers what is
already running plus the request; the Deep Learning AMI exists in the region (or the pinned
image, `amiId` or `up --image`, exists there and is available); sshCidr (default: your
public IP /32); and what it will cost per hour, refused above maxHourlyUsd.

It also asks Cost Explorer whether billing lists the stack tag yet (`costAllocationTag`): that decides
whether the program activates it this time, and never stops `up`.
"""

import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3
import botocore.exceptions

from infra import catalog, reconcile
from infra.automation import INSTALL_HINT
from infra.cluster import DLAMI_PARAMETER
from infra.config import StackConfig
from infra.errors import OperationError, UsageError
from infra.pricing import PRICING_API_REGION, Estimate, PriceSource
from infra.tags import STACK_TAG

# Service Quotas codes for running-instance vCPUs (https://docs.aws.amazon.com/ec2/latest/instancetypes/ec2-instance-quotas.html).
QUOTAS = {
    ("G", False): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("P", False): ("L-417A185B", "Running On-Demand P instances"),
    ("G", True): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("P", True): ("L-7212CCBC", "All P Spot Instance Requests"),
}
IP_LOOKUP_URL = "https://checkip.amazonaws.com"
AWS_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


@dataclass(frozen=True)
class AwsClients:
    """The boto3 clients preflight, pricing and teardown use (tests pass moto- or Stubber-backed ones)."""

    # boto3's clients are built at run time from service models: no static type to name.
    sts: Any
    ec2: Any
    quotas: Any
    ssm: Any
    pricing: Any
    efs: Any
    autoscaling: Any = None
    ce: Any = None
    """Cost Explorer (its one endpoint): whether billing lists the stack tag."""

    @classmethod
    def for_region(cls, region: str) -> "AwsClients":
        session = boto3.Session(region_name=region)
        return cls(
            sts=session.client("sts"),
            ec2=session.client("ec2"),
            quotas=session.client("service-quotas"),
            ssm=session.client("ssm"),
            pricing=session.client("pricing", region_name=PRICING_API_REGION),
            efs=session.client("efs"),
            autoscaling=session.client("autoscaling"),
            ce=session.client("ce", region_name=reconcile.CE_REGION),
        )


@dataclass
class PreflightResult:
    """What preflight found."""

    problems: list[str] = field(default_factory=list)
    """Everything that stops `up`; empty when it may go ahead."""
    account: str | None = None
    """The AWS account the credentials belong to."""
    zones: list[str] = field(default_factory=list)
    """Zones of the region that offer the type, sorted: the order `up` tries them in."""
    vcpus_needed: int = 0
    """vCPUs the request adds."""
    vcpus_free: float | None = None
    """Quota minus what already runs."""
    ssh_cidr: str | None = None
    """Who may SSH in."""
    estimate: Estimate | None = None
    """The cost per hour."""
    notes: list[str] = field(default_factory=list)
    """Things worth saying that stop nothing (a fallback price source, say)."""
    cost_tag_seen: bool = False
    """Billing lists the stack tag, so the program may activate it as a cost-allocation tag."""


def lookup_public_ip(timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(IP_LOOKUP_URL, timeout=timeout_s) as answer:
        return answer.read().decode().strip()


def quota_family(instance_type: str) -> str:
    return catalog.lookup(instance_type).quota_family


def run(
    config: StackConfig, clients: AwsClients, cli_present: bool, lookup_ip: Callable[[], str] = lookup_public_ip
) -> PreflightResult:
    result = PreflightResult()
    if not cli_present:
        result.problems.append(f"the Pulumi CLI is not installed: {INSTALL_HINT}")
    result.account = _check_credentials(clients, result)
    if result.account:
        vcpus = _check_instance_type(config, clients, result)
        if vcpus:
            _check_quota(config, clients, result, vcpus)
        if config.ami_id:
            _check_pinned_image(config, clients, result)
        else:
            _check_ami(config, clients, result)
        _check_cost_tag(config, clients, result)
    _check_ssh_cidr(config, lookup_ip, result)
    _estimate(config, clients, result)
    return result


def _check_credentials(clients: AwsClients, result: PreflightResult) -> str | None:
    try:
        return clients.sts.get_caller_identity()["Account"]
    except AWS_ERRORS as exc:
        result.problems.append(credentials_problem(exc))
        return None


def credentials_problem(exc: BaseException) -> str:
    return (
        f"AWS credentials do not work ({_brief(exc)}): run `aws configure` or set "
        "AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    )


CREDENTIAL_ERRORS = (
    "AuthFailure",
    "UnauthorizedOperation",
    "InvalidClientTokenId",
    "ExpiredToken",
    "SignatureDoesNotMatch",
    "AccessDenied",
)


@contextmanager
def aws_answers(doing: str):
    """botocore failures as one line: credentials are the user's to fix (exit 2), the rest a failed step."""
    try:
        yield
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as exc:
        raise UsageError(f"{doing}: {credentials_problem(exc)}") from None
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in CREDENTIAL_ERRORS:
            raise UsageError(f"{doing}: {credentials_problem(exc)}") from None
        raise OperationError(f"{doing}: AWS said: {_brief(exc)}") from None
    except botocore.exceptions.BotoCoreError as exc:
        raise OperationError(f"{doing}: {_brief(exc)}") from None


def _check_instance_type(config: StackConfig, clients: AwsClients, result: PreflightResult) -> int | None:
    try:
        described = clients.ec2.describe_instance_types(InstanceTypes=[config.instance_type])["InstanceTypes"]
    except AWS_ERRORS as exc:
        if "InvalidInstanceType" in str(exc):
            result.problems.append(
                f"instance type {config.instance_type} does not exist: check the name (e.g. g4dn.2xlarge, g6.2xlarge)"
            )
        else:
            result.problems.append(f"could not describe {config.instance_type}: {_brief(exc)}")
        return None
    offerings = clients.ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [config.instance_type]}],
    )["InstanceTypeOfferings"]
    result.zones = sorted(o["Location"] for o in offerings)
    if config.availability_zone and config.availability_zone not in result.zones:
        result.problems.append(
            f"{config.instance_type} is not offered in {config.availability_zone} "
            f"(it is in: {', '.join(result.zones) or 'no zone of ' + config.region})"
        )
    elif not result.zones:
        result.problems.append(
            f"{config.instance_type} is not offered in any zone of {config.region}: "
            "pick another region (aws:region) or type"
        )
    # The request is counted from the catalog (what validation and pricing also read); AWS's answer
    # only proves the type exists here.
    return catalog.lookup(config.instance_type).vcpus if described else None


def _check_quota(config: StackConfig, clients: AwsClients, result: PreflightResult, vcpus_per_node: int) -> None:
    code, name = QUOTAS[(quota_family(config.instance_type), config.spot)]
    result.vcpus_needed = vcpus_per_node * config.nodes
    try:
        quota = clients.quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except AWS_ERRORS as exc:
        result.notes.append(f"could not read the '{name}' quota ({_brief(exc)}); not checked")
        return
    in_use = _running_vcpus(clients.ec2, quota_family(config.instance_type), config.spot)
    result.vcpus_free = quota - in_use
    if result.vcpus_needed > result.vcpus_free:
        result.problems.append(
            f"the '{name}' quota is {quota:g} vCPUs with {in_use} in use, and {config.nodes} x "
            f"{config.instance_type} needs {result.vcpus_needed}: request more in the Service Quotas console "
            f"(quota {code}) or ask for fewer or smaller nodes"
        )


def _running_vcpus(ec2, family: str, spot: bool) -> int:
    """vCPUs of running instances that count against the same quota."""
    prefixes = ("p",) if family == "P" else ("g", "vt")
    counts: dict[str, int] = {}
    for page in ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
    ):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                is_spot = instance.get("InstanceLifecycle") == "spot"
                if instance["InstanceType"].startswith(prefixes) and is_spot == spot:
                    counts[instance["InstanceType"]] = counts.get(instance["InstanceType"], 0) + 1
    if not counts:
        return 0
    types = ec2.describe_instance_types(InstanceTypes=list(counts))["InstanceTypes"]
    return sum(t["VCpuInfo"]["DefaultVCpus"] * counts[t["InstanceType"]] for t in types)


def _check_ami(config: StackConfig, clients: AwsClients, result: PreflightResult) -> None:
    try:
        clients.ssm.get_parameter(Name=DLAMI_PARAMETER)
    except AWS_ERRORS as exc:
        result.problems.append(
            f"no Deep Learning Base GPU AMI found in {config.region} ({_brief(exc)}): "
            "set gpu-cluster:amiId to an Ubuntu 22.04 image with the NVIDIA driver"
        )


def _check_pinned_image(config: StackConfig, clients: AwsClients, result: PreflightResult) -> None:
    """amiId (or `up --image`): the image exists in the region and is available, ours or another."""
    from infra import images

    assert config.ami_id is not None
    try:
        problem = images.usable_problem(clients.ec2, config.ami_id, config.region)
    except AWS_ERRORS as exc:
        problem = f"could not describe image {config.ami_id}: {_brief(exc)}"
    if problem:
        result.problems.append(problem)


def _check_cost_tag(config: StackConfig, clients: AwsClients, result: PreflightResult) -> None:
    """Does billing list the stack tag yet? AWS activates a key only once it has seen it on a resource (up
    to 24 h after the first: hashicorp/terraform-provider-aws#29068), and only in an organization's payer
    account. Any answer but "listed" skips the activation this time, said once; none stops `up`."""
    if not config.cost_allocation_tag:
        return
    skipped = f"{STACK_TAG} is not activated as a cost-allocation tag by this up"
    try:
        result.cost_tag_seen = reconcile.CostExplorer(clients.ce).stack_tag() is not None
    except AWS_ERRORS as exc:
        error = exc.response.get("Error", {}) if isinstance(exc, botocore.exceptions.ClientError) else {}
        message = (str(error.get("Message") or "").splitlines() or [""])[0][:200]
        said = f"{error.get('Code')}: {message}" if error else _brief(exc)
        if str(error.get("Code", "")).startswith("AccessDenied"):
            result.notes.append(
                f"{skipped}: Cost Explorer refused to list cost-allocation tags ({said}); in a member account of "
                "an organization the payer account activates it (Billing > Cost allocation tags), elsewhere "
                "allow ce:ListCostAllocationTags and ce:UpdateCostAllocationTagsStatus; "
                "gpu-cluster:costAllocationTag false stops asking"
            )
        else:
            result.notes.append(
                f"{skipped}: could not ask Cost Explorer whether billing lists it ({said}); the next up asks again"
            )
        return
    if not result.cost_tag_seen:
        result.notes.append(
            f"{skipped}: AWS billing does not list the key yet (it does up to 24 h after the first resource tagged "
            "with it); the first up after that activates it, or Billing > Cost allocation tags does"
        )


def _check_ssh_cidr(config: StackConfig, lookup_ip: Callable[[], str], result: PreflightResult) -> None:
    if config.ssh_cidr:
        result.ssh_cidr = config.ssh_cidr
        return
    try:
        address = lookup_ip()
        result.ssh_cidr = f"{address}/{128 if ':' in address else 32}"
    except Exception as exc:  # no network, a proxy, a malformed answer: the user can say it
        result.problems.append(f"could not look up your public IP ({_brief(exc)}): pass --ssh-cidr YOUR.IP/32")


def _estimate(config: StackConfig, clients: AwsClients, result: PreflightResult) -> None:
    connected = result.account is not None
    source = PriceSource(clients.pricing if connected else None, clients.ec2 if connected else None)
    spot_zone = (config.availability_zone or (result.zones[0] if result.zones else None)) if config.spot else None
    try:
        result.estimate = source.estimate(
            config.instance_type,
            config.region,
            config.nodes,
            config.root_volume_gb,
            spot_zone=spot_zone or (f"{config.region}a" if config.spot else None),
        )
    except Exception as exc:  # an unknown price is a problem only where a budget needs it
        result.notes.append(f"no price for {config.instance_type} in {config.region}: {_brief(exc)}")
        if config.max_hourly_usd:
            result.problems.append(f"cannot check maxHourlyUsd: {_brief(exc)}")
        return
    result.notes.extend(source.notes)
    if config.max_hourly_usd is not None and result.estimate.hourly_usd > config.max_hourly_usd:
        result.problems.append(
            f"{config.nodes} x {config.instance_type} would cost ${result.estimate.hourly_usd:.3f}/h, above "
            f"maxHourlyUsd ${config.max_hourly_usd:g}: raise gpu-cluster:maxHourlyUsd or ask for less"
        )


def _brief(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
