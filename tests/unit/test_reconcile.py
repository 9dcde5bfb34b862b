"""Every billed line, in the estimate and the ledger, and `cost --reconcile`: the ledger beside Cost
Explorer (moto, its answers queued; Stubber for the tag status) and beside a CUR 2.0 export."""

from datetime import datetime, timezone

import pytest

from infra import costs, pricing, reconcile
from infra.errors import UsageError
from infra.ledger import Ledger
from tests.support.aws_fakes import CUR_FIXTURE, CostExplorerClient, ce_daily, moto_aws, queue_ce_results
from tests.support.ledgers import billed_cluster


def epoch(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


UP, DOWN = epoch("2026-11-20T06:00:00"), epoch("2026-11-21T18:00:00")  # the fixture's cluster


@pytest.fixture
def ledger(state_dir):
    opened = Ledger()
    yield opened
    opened.close()


# ------------------------------------------------------------------------------ the estimate, the ledger


def test_the_estimate_has_every_billed_line_and_their_sum(state_dir):
    estimate = pricing.PriceSource().estimate("g4dn.xlarge", "us-east-1", nodes=2, root_volume_gb=150)
    lines = {line.kind: line for line in estimate.lines}
    assert list(lines) == list(pricing.LINE_KINDS)
    assert lines["instances"].usage_type == "BoxUsage:g4dn.xlarge"
    assert lines["instances"].hourly_usd == pytest.approx(2 * 0.526)
    assert lines["ebs"].hourly_usd == pytest.approx(300 * 0.08 / 730)
    assert lines["public ipv4"].hourly_usd == pytest.approx(2 * 0.005)  # $0.005 per address-hour since 2024-02
    assert [k for k, line in lines.items() if line.exact] == ["instances", "ebs", "public ipv4"]
    assert estimate.hourly_usd == pytest.approx(sum(line.hourly_usd for line in estimate.lines))
    text = estimate.text_lines()
    assert len(text) == 7 and all("(estimate)" in row for row in text[3:6]) and text[-1].startswith("= $1.116/h")
    spot = pricing.PriceSource().estimate("g4dn.xlarge", "us-east-1", 2, 150, spot_zone="us-east-1a")
    assert spot.lines[0].usage_type == "SpotUsage:g4dn.xlarge"


def test_the_ledger_keeps_each_billed_line_and_the_hours_it_was_billed(ledger):
    estimate = billed_cluster(ledger, "dev", UP, DOWN)
    [cluster] = costs.report("dev")["clusters"]
    assert [line["kind"] for line in cluster["lines"]] == list(pricing.LINE_KINDS)
    assert {line["hours"] for line in cluster["lines"]} == {36.0}
    ipv4 = next(line for line in cluster["lines"] if line["kind"] == "public ipv4")
    assert ipv4["cost_usd"] == pytest.approx(2 * 36 * 0.005)
    assert sum(line["cost_usd"] for line in cluster["lines"]) == pytest.approx(cluster["cost_usd"])
    assert cluster["cost_usd"] == pytest.approx(36 * estimate.hourly_usd)


def test_cost_says_when_the_cost_allocation_tag_is_too_new_for_the_bill(ledger):
    billed_cluster(ledger, "dev", UP, None)
    ledger.clock = lambda: UP + 3 * 3600
    young = costs.tag_notes(ledger.clusters(), UP + 3 * 3600)
    assert len(young) == 1 and "3.0 h ago" in young[0] and "2026-11-21T06:00:00" in young[0]
    assert costs.tag_notes(ledger.clusters(), UP + 25 * 3600) == []


# ------------------------------------------------------------------------------------ the bill's lines


@pytest.mark.parametrize(
    "usage_type,kind",
    [
        ("BoxUsage:g4dn.xlarge", "instances"),
        ("USE2-SpotUsage:g5.xlarge", "instances"),
        ("EBS:VolumeUsage.gp3", "ebs"),
        ("USW2-EBS:VolumeP-IOPS.gp3", "ebs"),
        ("TimedStorage-ByteHrs", "efs storage"),
        ("USE1-ElasticThroughput-ReadBytes", "efs throughput"),
        ("USE1-PublicIPv4:InUseAddress", "public ipv4"),
        ("EU-DataTransfer-Out-Bytes", "data transfer"),
        ("USE1-USW2-AWS-Out-Bytes", "data transfer"),
        ("EBS:SnapshotUsage", None),
        ("USE1-NatGateway-Hours", None),
    ],
)
def test_usage_types_of_any_region_belong_to_their_line(usage_type, kind):
    assert reconcile.kind_of(usage_type) == kind


def test_a_cur_export_matches_the_ledger_within_2pct_per_cluster_day_and_names_the_volume_left_behind(ledger):
    billed_cluster(ledger, "dev", UP, DOWN)
    data = reconcile.reconcile(ledger, "dev", None, CUR_FIXTURE, ce_client=None, now=epoch("2026-12-03T00:00:00"))
    assert [d["day"] for d in data["days"]] == ["2026-11-20", "2026-11-21"]
    assert all(d["final"] and d["within_2pct"] for d in data["days"]), data["days"]
    by_kind = {k["kind"]: k for k in data["usage_types"]}
    assert set(by_kind) == set(pricing.LINE_KINDS)
    for exact in ("instances", "ebs", "public ipv4"):  # what the ledger knows exactly, it has to the cent
        assert by_kind[exact]["difference_usd"] == pytest.approx(0, abs=0.01), by_kind[exact]
    assert by_kind["efs throughput"]["usage_types"] == [
        "USE1-ElasticThroughput-ReadBytes",
        "USE1-ElasticThroughput-WriteBytes",
    ]
    assert data["unmatched"] == [{"usage_type": "EBS:SnapshotUsage", "bill_usd": pytest.approx(0.1315, abs=1e-4)}]
    assert {(s["day"], s["resource_id"]) for s in data["leak_suspects"]} == {
        ("2026-11-20", "vol-0dead0beef0000001"),
        ("2026-11-21", "vol-0dead0beef0000001"),
    }
    assert data["estimated_rows"] == [] and data["ce_requests"] == 0


def test_cost_explorer_rows_still_estimated_are_shown_and_the_final_ones_match(ledger, monkeypatch):
    billed_cluster(ledger, "dev", UP, DOWN)
    with moto_aws(monkeypatch):
        queue_ce_results(
            ce_daily("dev", estimated={"2026-11-21": 0.6}), ce_daily(None), ce_daily("dev"), ce_daily(None)
        )
        early = CostExplorerClient("Active", activated="2026-11-21T10:00:00Z")
        first = reconcile.reconcile(ledger, "dev", None, None, lambda: early, now=epoch("2026-11-22T02:00:00"))
        later = CostExplorerClient("Active")
        final = reconcile.reconcile(ledger, "dev", 7, None, lambda: later, now=epoch("2026-11-24T00:00:00"))
    day_20, day_21 = first["days"]
    assert day_20["final"] and day_20["within_2pct"]
    assert not day_21["final"] and not day_21["within_2pct"]  # 60% billed so far
    assert {r["day"] for r in first["estimated_rows"]} == {"2026-11-21"}
    assert any("activated at 2026-11-21T10:00" in note for note in first["notes"])
    assert (first["ce_requests"], first["ce_cost_usd"]) == (3, 0.03)
    assert all(d["final"] and d["within_2pct"] for d in final["days"]) and final["estimated_rows"] == []
    assert final["notes"] == []
    assert [s["usage_type"] for s in final["leak_suspects"]] == ["EBS:VolumeUsage.gp3"] * 2


def test_an_inactive_tag_is_said_and_nothing_is_billed_under_it(ledger, monkeypatch):
    billed_cluster(ledger, "dev", UP, DOWN)
    with moto_aws(monkeypatch):
        data = reconcile.reconcile(
            ledger, "dev", None, None, lambda: CostExplorerClient(None), now=epoch("2026-11-24T00:00:00")
        )
    assert any("is not active" in note for note in data["notes"])
    assert all(d["bill_usd"] == 0 and not d["within_2pct"] for d in data["days"])


def test_with_a_cluster_up_cost_explorers_forecast_to_the_months_end_is_beside_the_ledgers(ledger, monkeypatch):
    estimate = billed_cluster(ledger, "dev", UP, None)
    now = epoch("2026-11-21T00:00:00")
    with moto_aws(monkeypatch):
        told = CostExplorerClient("Active", forecast="240.00")
        data = reconcile.reconcile(ledger, "dev", 3, None, lambda: told, now=now)
        told.stub.assert_no_pending_responses()
        unknown = reconcile.reconcile(
            ledger, "dev", 3, None, lambda: CostExplorerClient("Active", forecast=None), now=now
        )
    assert data["forecast"] == {
        "until": "2026-12-01",
        "ce_usd": 240.0,
        "ledger_usd": round(240 * estimate.hourly_usd, 2),
    }
    assert (data["ce_requests"], data["ce_cost_usd"]) == (4, 0.04)
    assert unknown["forecast"]["ce_usd"] is None and unknown["ce_requests"] == 4


def test_a_file_that_is_not_a_cur_export_is_one_clear_line(ledger, tmp_path):
    billed_cluster(ledger, "dev", UP, DOWN)
    wrong = tmp_path / "bill.csv"
    wrong.write_text("date,service,cost\n2026-11-20,EC2,1.0\n")
    with pytest.raises(UsageError, match="not a CUR 2.0 export: it lacks the column.s. line_item_usage_start_date"):
        reconcile.reconcile(ledger, "dev", None, wrong, None, now=UP)
    text = CUR_FIXTURE.read_text().replace("9.4680000000", "lots", 1)
    wrong.write_text(text)
    with pytest.raises(UsageError, match="line_item_unblended_cost 'lots' is not a number"):
        reconcile.reconcile(ledger, "dev", None, wrong, None, now=UP)
    wrong.write_text(CUR_FIXTURE.read_text().replace("user_gpu-cluster:stack", "user_team"))  # tag not activated
    untagged = reconcile.reconcile(ledger, "dev", None, wrong, None, now=UP)
    assert any("no row of bill.csv carries gpu-cluster:stack = dev" in note for note in untagged["notes"])
    with pytest.raises(UsageError, match="no AWS cluster of stack 'other'"):
        reconcile.reconcile(ledger, "other", None, CUR_FIXTURE, None, now=UP)
    with pytest.raises(UsageError, match="--days 0: give the days to compare, 1..365"):
        reconcile.check_days(0)


def _cell(text: str, column: str, value: str) -> str:
    """The fixture with the first data row's `column` set to `value`."""
    header, first, rest = text.split("\n", 2)
    names = header.split(",")
    cells = first.split(",")
    cells[names.index(column)] = value
    return "\n".join([header, ",".join(cells), rest])


def _hostile(kind: str) -> str:
    text = CUR_FIXTURE.read_text()
    cost, day = "line_item_unblended_cost", "line_item_usage_start_date"
    header, first, rest = text.split("\n", 2)
    return {
        "nan": lambda: _cell(text, cost, "nan"),
        "infinity": lambda: _cell(text, cost, "Infinity"),
        "1e308": lambda: _cell(text, cost, "1e308"),
        "negative": lambda: _cell(text, cost, "-9.468"),
        "underscored": lambda: _cell(text, cost, "9_468"),
        "month 13": lambda: _cell(text, day, "2026-13-20T06:00:00Z"),
        "february 30": lambda: _cell(text, day, "2026-02-30T06:00:00Z"),
        "truncated row": lambda: text.rstrip("\n").rsplit(",", 3)[0] + "\n",
        "a field too many": lambda: "\n".join([header, first + ",extra", rest]),
        "duplicated cost": lambda: "\n".join([header + ",line_item_unblended_cost", first + ",0", rest]),
        "json list tag": lambda: text.replace(
            '"{""user_gpu-cluster:stack"": ""dev"", ""user_Name"": ""dev-node-0""}"', '"[""dev""]"', 1
        ),
        "nul byte": lambda: text.replace("BoxUsage:g4dn.xlarge", "BoxUsage:g4dn\0.xlarge", 1),
    }[kind]()


@pytest.mark.parametrize(
    "kind, said",
    [
        ("nan", "line 2: line_item_unblended_cost 'nan' is not a number"),
        ("infinity", "line 2: line_item_unblended_cost 'Infinity' is not a number"),
        ("1e308", "line 2: line_item_unblended_cost '1e308' is not a usage cost"),
        ("negative", "line 2: line_item_unblended_cost '-9.468' is not a usage cost"),
        ("underscored", "line 2: line_item_unblended_cost '9_468' is not a number"),
        ("month 13", "line 2: line_item_usage_start_date '2026-13-20T06:00:00Z' is not a date"),
        ("february 30", "line 2: line_item_usage_start_date '2026-02-30T06:00:00Z' is not a date"),
        ("truncated row", "line 28: a row of other than the header's 16 fields .a truncated or torn row"),
        ("a field too many", "line 2: a row of other than the header's 16 fields"),
        ("duplicated cost", "the column.s. line_item_unblended_cost appear more than once"),
        ("json list tag", "line 2: resource_tags '.\"dev\".' is not the JSON map CUR 2.0 writes"),
        ("nul byte", "line 2: a NUL byte"),
    ],
)
def test_a_hostile_bill_is_refused_in_one_line_naming_its_row(ledger, tmp_path, kind, said):
    billed_cluster(ledger, "dev", UP, DOWN)
    bill = tmp_path / "bill.csv"
    bill.write_text(_hostile(kind))
    with pytest.raises(UsageError, match=said) as refused:
        reconcile.reconcile(ledger, "dev", None, bill, None, now=UP)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("--bill bill.csv")
