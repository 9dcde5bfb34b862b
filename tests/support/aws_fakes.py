"""AWS for tests: moto where it implements the API, botocore's Stubber where it does not (Service
Quotas, the DLAMI SSM parameter, the Price List API, placement groups, spot prices, Cost Explorer's
cost-allocation tags)."""

import csv
import json
from contextlib import contextmanager
from datetime import date, timedelta
from pathlib import Path

import boto3
from botocore.stub import ANY, Stubber
from moto import mock_aws

from infra.cluster import DLAMI_PARAMETER
from infra.preflight import AwsClients
from infra.tags import STACK_TAG

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION": "true",
}


def recorded_price_list(instance_type: str, region: str, usd: str, published: str = "2026-11-01T00:00:00Z") -> str:
    """One product of a get_products answer, as the Price List API returns it (trimmed to what matters)."""
    sku = "JRTCKXETXF" if instance_type == "g4dn.2xlarge" else "SKU0000001"
    return json.dumps(
        {
            "product": {
                "productFamily": "Compute Instance",
                "sku": sku,
                "attributes": {
                    "instanceType": instance_type,
                    "regionCode": region,
                    "operatingSystem": "Linux",
                    "tenancy": "Shared",
                    "preInstalledSw": "NA",
                    "capacitystatus": "Used",
                    "vcpu": "8",
                    "gpu": "1",
                },
            },
            "serviceCode": "AmazonEC2",
            "terms": {
                "OnDemand": {
                    f"{sku}.JRTCKXETXF": {
                        "offerTermCode": "JRTCKXETXF",
                        "sku": sku,
                        "effectiveDate": published,
                        "priceDimensions": {
                            f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                                "unit": "Hrs",
                                "pricePerUnit": {"USD": usd},
                                "appliesTo": [],
                                "description": f"${usd} per On Demand Linux {instance_type} Instance Hour",
                            }
                        },
                    }
                },
                "Reserved": {
                    f"{sku}.4NA7Y494T4": {
                        "priceDimensions": {"x": {"unit": "Hrs", "pricePerUnit": {"USD": "0.4750000000"}}}
                    }
                },
            },
            "version": "20261101000000",
            "publicationDate": published,
        }
    )


def recorded_storage(unit_price: str, service: str) -> str:
    return json.dumps(
        {
            "product": {"productFamily": "Storage", "attributes": {"regionCode": "us-east-1"}},
            "serviceCode": service,
            "terms": {
                "OnDemand": {"T": {"priceDimensions": {"D": {"unit": "GB-Mo", "pricePerUnit": {"USD": unit_price}}}}}
            },
            "publicationDate": "2026-11-01T00:00:00Z",
        }
    )


def stubbed(service: str, region: str = "us-east-1"):
    client = boto3.client(service, region_name=region)
    return client, Stubber(client)


def quota_client(vcpus: float, code: str = "L-DB2E81BA"):
    client, stub = stubbed("service-quotas")
    stub.add_response(
        "get_service_quota",
        {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "Value": vcpus}},
        {"ServiceCode": "ec2", "QuotaCode": code},
    )
    stub.activate()
    return client


def ssm_client(found: bool = True):
    client, stub = stubbed("ssm")
    if found:
        stub.add_response(
            "get_parameter",
            {"Parameter": {"Name": DLAMI_PARAMETER, "Type": "String", "Value": "ami-0123456789abcdef0", "Version": 42}},
            {"Name": DLAMI_PARAMETER},
        )
    else:
        stub.add_client_error("get_parameter", "ParameterNotFound", "Parameter not found.", 400)
    stub.activate()
    return client


def pricing_client(instance_usd: str = "0.7520000000", instance_type: str = "g4dn.2xlarge"):
    client, stub = stubbed("pricing")
    stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [recorded_price_list(instance_type, "us-east-1", instance_usd)]},
        {"ServiceCode": "AmazonEC2", "Filters": ANY, "FormatVersion": "aws_v1", "MaxResults": 10},
    )
    stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [recorded_storage("0.0800000000", "AmazonEC2")]},
        {"ServiceCode": "AmazonEC2", "Filters": ANY, "FormatVersion": "aws_v1", "MaxResults": 10},
    )
    stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [recorded_storage("0.3000000000", "AmazonEFS")]},
        {"ServiceCode": "AmazonEFS", "Filters": ANY, "FormatVersion": "aws_v1", "MaxResults": 10},
    )
    stub.activate()
    return client


LINKED_ACCOUNT = "Failed to list Cost Allocation Tags: Linked account doesn't have access to cost allocation tags."
"""What Cost Explorer answers a member account of an organization (aws/aws-parallelcluster-ui#242)."""


def cost_tags_client(status: str | None = "Active", error: tuple[str, str] | None = None):
    """Cost Explorer's ListCostAllocationTags for the stack tag: listed with `status` (Active or Inactive),
    not listed yet (None), or refused with `error` (code, message)."""
    client, stub = stubbed("ce")
    if error:
        stub.add_client_error("list_cost_allocation_tags", error[0], error[1], 400)
    else:
        listed = [] if status is None else [
            {"TagKey": STACK_TAG, "Type": "UserDefined", "Status": status, "LastUpdatedDate": "2026-11-01T00:00:00Z"}
        ]  # fmt: skip
        stub.add_response(
            "list_cost_allocation_tags", {"CostAllocationTags": listed}, {"TagKeys": [STACK_TAG], "Type": "UserDefined"}
        )
    stub.activate()
    return client


@contextmanager
def moto_aws(monkeypatch):
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield


def clients(
    region: str = "us-east-1", quota_vcpus: float = 64, ami_found: bool = True, pricing=None, ce=None
) -> AwsClients:
    """moto for STS, EC2, EFS and Auto Scaling; Stubber for the rest (Cost Explorer: the stack tag listed)."""
    return AwsClients(
        sts=boto3.client("sts", region_name=region),
        ec2=boto3.client("ec2", region_name=region),
        quotas=quota_client(quota_vcpus),
        ssm=ssm_client(ami_found),
        pricing=pricing or pricing_client(),
        efs=boto3.client("efs", region_name=region),
        autoscaling=boto3.client("autoscaling", region_name=region),
        ce=ce or cost_tags_client(),
    )


# -------------------------------------------------------------------------------- Cost Explorer

CUR_FIXTURE = Path(__file__).parent.parent / "fixtures" / "cur2-dev-2026-11.csv"
"""A CUR 2.0 export (its column layout, built by hand) of stack dev: 2 x g4dn.xlarge up from 2026-11-20
06:00 to 2026-11-21 18:00 UTC, with their gp3 roots, public addresses, EFS, transfer out, a snapshot,
one volume left behind with no stack tag, another stack's instance and the month's tax."""


def ce_daily(stack: str | None, estimated: dict[str, float] | None = None) -> dict:
    """Cost Explorer's GetCostAndUsage answer (daily, grouped by usage type) for the fixture's usage
    tagged `stack`, or with no stack tag (None). `estimated`: day -> the share of that day billed so far,
    its rows marked Estimated (as CE has them until the day's figures are final)."""
    totals: dict[str, dict[str, float]] = {}
    with CUR_FIXTURE.open(newline="") as handle:
        for item in csv.DictReader(handle):
            tags = json.loads(item["resource_tags"]) if item["resource_tags"] else {}
            if item["line_item_line_item_type"] != "Usage" or tags.get("user_gpu-cluster:stack") != stack:
                continue
            day = totals.setdefault(item["line_item_usage_start_date"][:10], {})
            usage = item["line_item_usage_type"]
            day[usage] = day.get(usage, 0.0) + float(item["line_item_unblended_cost"])
    estimated = estimated or {}
    periods = []
    for day, by_usage in sorted(totals.items()):
        share = estimated.get(day, 1.0)
        groups = [
            {"Keys": [usage], "Metrics": {"UnblendedCost": {"Amount": f"{usd * share:.10f}", "Unit": "USD"}}}
            for usage, usd in sorted(by_usage.items())
        ]
        end = (date.fromisoformat(day) + timedelta(days=1)).isoformat()
        periods.append(
            {"TimePeriod": {"Start": day, "End": end}, "Total": {}, "Groups": groups, "Estimated": day in estimated}
        )
    return {"ResultsByTime": periods, "DimensionValueAttributes": []}


def queue_ce_results(*results: dict) -> None:
    """Queue GetCostAndUsage answers in moto (its API: each new request takes the next one in turn)."""
    import requests

    answer = requests.post(
        "http://motoapi.amazonaws.com/moto-api/static/ce/cost-and-usage-results", json={"results": list(results)}
    )
    assert answer.status_code == 201


class CostExplorerClient:
    """moto's Cost Explorer for GetCostAndUsage; botocore's Stubber for the tag status, which moto lacks."""

    def __init__(self, tag_status: str | None, activated: str = "2026-11-01T00:00:00Z", forecast: str | None = ""):
        """`forecast`: GetCostForecast's answer where a cluster is up ("": not asked; None: too little history)."""
        self.moto = boto3.client("ce", region_name="us-east-1")
        self.stubbed, stub = stubbed("ce")
        tags = [] if tag_status is None else [
            {"TagKey": STACK_TAG, "Type": "UserDefined", "Status": tag_status, "LastUpdatedDate": activated}
        ]  # fmt: skip
        stub.add_response(
            "list_cost_allocation_tags", {"CostAllocationTags": tags}, {"TagKeys": [STACK_TAG], "Type": "UserDefined"}
        )
        if forecast is None:
            stub.add_client_error("get_cost_forecast", "DataUnavailableException", "Insufficient amount of data")
        elif forecast:
            stub.add_response(
                "get_cost_forecast", {"Total": {"Amount": forecast, "Unit": "USD"}, "ForecastResultsByTime": []}
            )
        stub.activate()
        self.stub = stub

    def get_cost_and_usage(self, **request):
        return self.moto.get_cost_and_usage(**request)

    def get_cost_forecast(self, **request):
        return self.stubbed.get_cost_forecast(**request)

    def list_cost_allocation_tags(self, **request):
        return self.stubbed.list_cost_allocation_tags(**request)
