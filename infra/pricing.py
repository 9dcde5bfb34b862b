"""What a cluster costs, line by line as AWS bills it: on-demand or spot instance hours, gp3 root volumes,
public IPv4 addresses (exact), and EFS storage and throughput and data transfer out (estimates).

Prices come from the AWS Price List API (on-demand, storage) and the spot price history of the
cluster's zone when AWS answers, else from the bundled, dated table `infra/prices.json`. Every figure
says where it came from and how old it is. API answers are cached in `.cluster/prices.json` for a day.
"""

import json
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from infra import catalog, state
from infra.errors import UsageError

BUNDLED = json.loads((Path(__file__).parent / "prices.json").read_text())
HOURS_PER_MONTH = BUNDLED["hours_per_month"]
CACHE_TTL_S = 24 * 3600
PRICING_API_REGION = "us-east-1"  # the Price List API answers in us-east-1 for every region


@dataclass(frozen=True)
class Price:
    """One price and where it came from."""

    usd: float
    """Dollars per unit (per instance-hour, or per GB-month for storage)."""
    unit: str
    """`hour` or `GB-month`."""
    source: str
    """`AWS Price List API`, `EC2 spot price history (us-east-1a)` or the bundled table."""
    as_of: str
    """When the source said so (a date or an ISO time)."""

    def describe(self) -> str:
        return f"{self.source}, {self.as_of}"


@dataclass(frozen=True)
class BilledLine:
    """One line of the bill a cluster runs up while it is up: what AWS charges, at what rate."""

    kind: str
    """One of LINE_KINDS: how `cost --reconcile` matches it with the bill's usage types."""
    usage_type: str
    """The AWS usage type it bills under, without the region's prefix (`BoxUsage:g4dn.xlarge`)."""
    quantity: float
    """How much of it exists while the cluster is up: instances, GB stored, addresses; for a line billed
    per GB moved (`unit` GB), the GB per hour assumed."""
    unit: str
    """What `unit_usd` is per: `instance-hour`, `GB-month`, `address-hour`, `GB`."""
    unit_usd: float
    """The price per unit, in force when the cluster came up."""
    hourly_usd: float
    """What the line costs per hour the cluster is up."""
    exact: bool
    """True where the quantity and the price are both known (the bill will match); False: an estimate."""
    source: str
    """Where the price came from, and for an estimate what was assumed."""

    def as_dict(self) -> dict:
        return {**asdict(self), "hourly_usd": round(self.hourly_usd, 6)}

    def describe(self) -> str:
        return describe_quantity(self.quantity, self.unit, self.unit_usd)


def describe_quantity(quantity: float, unit: str, unit_usd: float) -> str:
    """`2 x $0.526/instance-hour`; a line billed per GB moved has a quantity per hour: `0.2 GB/h x $0.04/GB`."""
    per_hour = " GB/h" if unit == "GB" else ""
    return f"{quantity:g}{per_hour} x ${unit_usd:g}/{unit}"


LINE_KINDS = ("instances", "ebs", "public ipv4", "efs storage", "efs throughput", "data transfer")
"""Every line a cluster is billed for, in the order they are shown: the exact ones, then the estimates."""


@dataclass(frozen=True)
class Estimate:
    """The cost of a whole cluster, line by line."""

    instance: Price
    """Per instance-hour."""
    nodes: int
    """How many instances."""
    root_volume_gb: int
    """Each node's gp3 root volume."""
    ebs: Price
    """gp3 per GB-month."""
    efs: Price
    """EFS Standard per GB-month (charged for what is stored)."""
    spot: bool = False
    """Spot instances (`SpotUsage`), else on-demand (`BoxUsage`)."""
    instance_type: str = ""
    """The EC2 type, which names the instances' usage type."""
    region: str = "us-east-1"
    """Where the flat prices (addresses, transfer, EFS throughput) are looked up."""

    @property
    def instances_hourly_usd(self) -> float:
        return self.instance.usd * self.nodes

    @property
    def storage_hourly_usd(self) -> float:
        """Root volumes only (EFS is charged for what is stored: its own, estimated, line)."""
        return self.ebs.usd * self.root_volume_gb * self.nodes / HOURS_PER_MONTH

    @property
    def lines(self) -> list[BilledLine]:
        """Every billed line, exact ones first: instances, root volumes, public addresses; then the
        estimates (EFS storage and elastic throughput, data transfer out), at the bundled usage assumed."""
        assumed, table = BUNDLED["assumed_usage"], f"bundled table, {BUNDLED['as_of']}"
        market = "SpotUsage" if self.spot else "BoxUsage"
        gb = self.root_volume_gb * self.nodes
        efs_gb, efs_moved = assumed["efs_stored_gb"], assumed["efs_transferred_gb_per_node_hour"] * self.nodes
        out_gb = assumed["transfer_out_gb_per_node_hour"] * self.nodes
        ipv4 = _flat("public_ipv4_usd_per_hour", self.region)
        elastic = _flat("efs_elastic_usd_per_gb_transferred", self.region)
        transfer = _flat("transfer_out_usd_per_gb", self.region)
        return [
            BilledLine(
                "instances",
                f"{market}:{self.instance_type}",
                self.nodes,
                "instance-hour",
                self.instance.usd,
                self.instances_hourly_usd,
                True,
                _short(self.instance) if not self.spot else self.instance.describe(),
            ),
            BilledLine(
                "ebs", "EBS:VolumeUsage.gp3", gb, "GB-month", self.ebs.usd, self.storage_hourly_usd, True,
                f"{self.nodes} x {self.root_volume_gb} GB gp3, baseline IOPS and throughput; {_short(self.ebs)}",
            ),
            BilledLine(
                "public ipv4", "PublicIPv4:InUseAddress", self.nodes, "address-hour", ipv4, ipv4 * self.nodes, True,
                f"one public address per node; {table}",
            ),
            BilledLine(
                "efs storage", "TimedStorage-ByteHrs", efs_gb, "GB-month", self.efs.usd,
                self.efs.usd * efs_gb / HOURS_PER_MONTH, False,
                f"assumes {efs_gb} GB stored on /shared; {_short(self.efs)}",
            ),
            BilledLine(
                "efs throughput", "ElasticThroughput", efs_moved, "GB", elastic, elastic * efs_moved, False,
                f"elastic: assumes {efs_moved:g} GB/h read and written; reads $0.03, writes $0.06 per GB",
            ),
            BilledLine(
                "data transfer", "DataTransfer-Out-Bytes", out_gb, "GB", transfer, transfer * out_gb, False,
                f"assumes {out_gb:g} GB/h out to the internet; in, and within the zone, free",
            ),
        ]  # fmt: skip

    @property
    def hourly_usd(self) -> float:
        return sum(line.hourly_usd for line in self.lines)

    def as_dict(self) -> dict:
        exact = sum(line.hourly_usd for line in self.lines if line.exact)
        return {
            "hourly_usd": round(self.hourly_usd, 6),
            "daily_usd": round(self.hourly_usd * 24, 4),
            "monthly_usd": round(self.hourly_usd * HOURS_PER_MONTH, 2),
            "exact_hourly_usd": round(exact, 6),
            "estimated_hourly_usd": round(self.hourly_usd - exact, 6),
            "instances_hourly_usd": round(self.instances_hourly_usd, 6),
            "storage_hourly_usd": round(self.storage_hourly_usd, 6),
            "nodes": self.nodes,
            "lines": [line.as_dict() for line in self.lines],
            "instance": asdict(self.instance),
            "ebs_gp3": asdict(self.ebs),
            "efs_standard": asdict(self.efs),
        }

    def text_lines(self) -> list[str]:
        """The estimate as a person reads it: one row per billed line, then their sum."""
        per_day, per_month = self.hourly_usd * 24, self.hourly_usd * HOURS_PER_MONTH
        rows = [
            f"{'+' if index else ' '} ${line.hourly_usd:.4f}/h  {line.kind:<15} {line.describe()}"
            f"{'' if line.exact else ' (estimate)'}  ({line.source})"
            for index, line in enumerate(self.lines)
        ]
        return [
            *rows,
            f"= ${self.hourly_usd:.3f}/h, ${per_day:.2f}/day, ${per_month:.0f}/month if left running",
        ]


def _short(price: Price) -> str:
    """A price's source in few words (the bundled table's long name is in `infra/prices.json`)."""
    source = "bundled table" if price.source.startswith("bundled table") else price.source
    return f"{source}, {price.as_of}"


def _flat(key: str, region: str = "us-east-1") -> float:
    """A bundled price that is one number, or one per region (us-east-1's where the region has none)."""
    value = BUNDLED[key]
    if isinstance(value, dict):
        found = _region_table(value, region)
        return float(found if isinstance(found, (int, float)) else value["us-east-1"])
    return float(value)


# ---------------------------------------------------------------------------------------- bundled


def _region_table(table: dict, region: str) -> dict | float | None:
    entry = table.get(region)
    return table.get(entry) if isinstance(entry, str) else entry


def bundled_on_demand(instance_type: str, region: str) -> Price:
    if not catalog.lookup(instance_type).bundled_price:
        raise UsageError(
            f"{instance_type} has no bundled price (the instance catalog leaves it to the AWS Price "
            "List API): run with AWS credentials so the API can be asked"
        )
    prices = _region_table(BUNDLED["on_demand_usd_per_hour"], region)
    if not isinstance(prices, dict):
        known = ", ".join(k for k in BUNDLED["on_demand_usd_per_hour"])
        raise UsageError(
            f"no bundled price for region {region} (it has {known}): run with AWS credentials "
            "so the Price List API can be asked"
        )
    if instance_type not in prices:
        raise UsageError(
            f"no bundled price for {instance_type} in {region}: run with AWS credentials so the "
            "Price List API can be asked, or check the type name"
        )
    return Price(prices[instance_type], "hour", BUNDLED["source"], BUNDLED["as_of"])


def bundled_storage(region: str, key: str) -> Price:
    value = _region_table(BUNDLED[key], region)
    if not isinstance(value, (int, float)):
        value = BUNDLED[key]["us-east-1"]
        return Price(value, "GB-month", BUNDLED["source"] + " (us-east-1's, none for " + region + ")", BUNDLED["as_of"])
    return Price(value, "GB-month", BUNDLED["source"], BUNDLED["as_of"])


# -------------------------------------------------------------------------------- Price List API


def on_demand_filters(instance_type: str, region: str) -> list[dict]:
    """The one product that is a plain Linux on-demand instance-hour (no SQL, no licence, not a reservation)."""
    fields = {
        "instanceType": instance_type,
        "regionCode": region,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
    }
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in fields.items()]


def parse_on_demand(price_list: list[str], unit: str = "Hrs") -> tuple[float, str]:
    """(USD per unit, publication date) from get_products' PriceList (JSON strings)."""
    for text in price_list:
        product = json.loads(text)
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = float(dimension.get("pricePerUnit", {}).get("USD", "nan"))
                if dimension.get("unit") == unit and usd > 0:
                    return usd, product.get("publicationDate", term.get("effectiveDate", ""))[:10]
    raise LookupError("no on-demand price in the Price List answer")


def api_on_demand(pricing_client, instance_type: str, region: str) -> Price:
    answer = pricing_client.get_products(
        ServiceCode="AmazonEC2", Filters=on_demand_filters(instance_type, region), FormatVersion="aws_v1", MaxResults=10
    )
    if not answer["PriceList"]:
        raise UsageError(
            f"the Price List API knows no Linux on-demand {instance_type} in {region}: check the type and region names"
        )
    usd, published = parse_on_demand(answer["PriceList"])
    return Price(usd, "hour", "AWS Price List API", published)


def api_storage(pricing_client, region: str, service: str, filters: dict) -> Price:
    answer = pricing_client.get_products(
        ServiceCode=service,
        FormatVersion="aws_v1",
        MaxResults=10,
        Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in {"regionCode": region, **filters}.items()],
    )
    usd, published = parse_on_demand(answer["PriceList"], unit="GB-Mo")
    return Price(usd, "GB-month", "AWS Price List API", published)


def api_spot(ec2_client, instance_type: str, zone: str) -> Price:
    """The latest Linux spot price in `zone`."""
    answer = ec2_client.describe_spot_price_history(
        InstanceTypes=[instance_type],
        ProductDescriptions=["Linux/UNIX"],
        AvailabilityZone=zone,
        StartTime=datetime.now(timezone.utc),
        MaxResults=1,
    )
    history = answer.get("SpotPriceHistory", [])
    if not history:
        raise LookupError(f"no spot price for {instance_type} in {zone}")
    latest = max(history, key=lambda h: h["Timestamp"])
    return Price(
        float(latest["SpotPrice"]),
        "hour",
        f"EC2 spot price history ({zone})",
        latest["Timestamp"].isoformat(timespec="seconds"),
    )


# ---------------------------------------------------------------------------------------- sources


class PriceSource:
    """Prices from AWS when `clients` can reach it, else from the bundled table; answers cached."""

    def __init__(self, pricing_client=None, ec2_client=None, cache_path: Path | None = None, clock=time.time):
        self.pricing, self.ec2, self.clock = pricing_client, ec2_client, clock
        self.cache_path = cache_path if cache_path is not None else state.state_root() / "prices.json"
        self.notes: list[str] = []

    def on_demand(self, instance_type: str, region: str) -> Price:
        return self._cached(
            f"on-demand/{region}/{instance_type}",
            lambda: api_on_demand(self.pricing, instance_type, region),
            lambda: bundled_on_demand(instance_type, region),
        )

    def spot(self, instance_type: str, zone: str) -> Price:
        """Spot is only known live; without AWS the on-demand price stands in, and says so."""
        if self.ec2 is not None:
            try:
                return api_spot(self.ec2, instance_type, zone)
            except Exception as exc:  # no credentials, throttled, no history: fall back, and say so
                self.notes.append(f"spot price unavailable ({_brief(exc)})")
        region = zone.rstrip("abcdefghijklmnopqrstuvwxyz")
        fallback = self.on_demand(instance_type, region)
        return Price(
            fallback.usd,
            "hour",
            f"{fallback.source}, on-demand (spot price unknown offline: at most this)",
            fallback.as_of,
        )

    def ebs_gp3(self, region: str) -> Price:
        return self._cached(
            f"ebs-gp3/{region}",
            lambda: api_storage(
                self.pricing, region, "AmazonEC2", {"productFamily": "Storage", "volumeApiName": "gp3"}
            ),
            lambda: bundled_storage(region, "ebs_gp3_usd_per_gb_month"),
        )

    def efs_standard(self, region: str) -> Price:
        return self._cached(
            f"efs-standard/{region}",
            lambda: api_storage(
                self.pricing, region, "AmazonEFS", {"productFamily": "Storage", "storageClass": "General Purpose"}
            ),
            lambda: bundled_storage(region, "efs_standard_usd_per_gb_month"),
        )

    def estimate(
        self, instance_type: str, region: str, nodes: int, root_volume_gb: int, spot_zone: str | None = None
    ) -> Estimate:
        instance = self.spot(instance_type, spot_zone) if spot_zone else self.on_demand(instance_type, region)
        ebs, efs = self.ebs_gp3(region), self.efs_standard(region)
        return Estimate(instance, nodes, root_volume_gb, ebs, efs, spot_zone is not None, instance_type, region)

    def _cached(self, key: str, ask_api, ask_table) -> Price:
        cache = self._read_cache()
        hit = _cached_price(cache.get(key), self.clock())
        if hit is not None:
            return hit
        if self.pricing is not None:
            try:
                price = ask_api()
                cache[key] = {"fetched_at": self.clock(), "price": asdict(price)}
                self._write_cache(cache)
                return price
            except UsageError:
                raise
            except Exception as exc:  # no network or credentials: the bundled table, and a note why
                self.notes.append(f"Price List API unavailable ({_brief(exc)}); using the bundled table")
        return ask_table()

    def _read_cache(self) -> dict:
        """The cached answers; a damaged cache (not JSON, not a mapping) counts as empty and is rewritten."""
        try:
            cache = json.loads(self.cache_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return cache if isinstance(cache, dict) else {}

    def _write_cache(self, cache: dict) -> None:
        state.write_atomic(self.cache_path, json.dumps(cache, indent=1) + "\n")


def _cached_price(entry, now: float) -> Price | None:
    """The price in a fresh, well-formed cache entry, else None (asked again)."""
    try:
        if now - float(entry["fetched_at"]) < CACHE_TTL_S:
            price = Price(**entry["price"])
            return price if isinstance(price.usd, (int, float)) else None
    except (TypeError, KeyError, ValueError):
        pass
    return None


def _brief(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]
