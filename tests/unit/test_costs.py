"""Prices, the ledger and the watchdog's decisions, with recorded AWS answers and fake clocks."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from datetime import datetime, timezone

import boto3
import botocore.exceptions
import pytest
from botocore.stub import ANY, Stubber

from harness import watchdog
from infra import costs, pricing
from infra.errors import UsageError
from infra.ledger import Ledger
from node import contract
from tests.support import REPO
from tests.support.aws_fakes import pricing_client, recorded_price_list
from tests.support.ledgers import write_runs


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------- prices


def test_on_demand_price_is_parsed_from_a_recorded_price_list_answer(state_dir):
    source = pricing.PriceSource(pricing_client("0.7520000000"), None)
    price = source.on_demand("g4dn.2xlarge", "us-east-1")
    assert (price.usd, price.unit, price.source, price.as_of) == (0.752, "hour", "AWS Price List API", "2026-11-01")
    assert source.ebs_gp3("us-east-1").usd == 0.08 and source.efs_standard("us-east-1").usd == 0.30


def test_the_price_list_is_asked_for_plain_linux_on_demand_capacity():
    fields = {f["Field"]: f["Value"] for f in pricing.on_demand_filters("g6.2xlarge", "us-west-2")}
    assert fields == {
        "instanceType": "g6.2xlarge",
        "regionCode": "us-west-2",
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
    }


def test_reserved_terms_are_not_taken_for_on_demand():
    usd, _ = pricing.parse_on_demand([recorded_price_list("g5.xlarge", "us-east-1", "1.0060000000")])
    assert usd == 1.006


def test_spot_price_comes_from_the_zones_latest_history(state_dir):
    ec2 = boto3.client("ec2", region_name="us-east-1")
    stub = Stubber(ec2)
    older, newer = datetime(2026, 11, 20, tzinfo=timezone.utc), datetime(2026, 11, 21, tzinfo=timezone.utc)
    stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                {
                    "AvailabilityZone": "us-east-1b",
                    "InstanceType": "g4dn.2xlarge",
                    "ProductDescription": "Linux/UNIX",
                    "SpotPrice": "0.3001",
                    "Timestamp": older,
                },
                {
                    "AvailabilityZone": "us-east-1b",
                    "InstanceType": "g4dn.2xlarge",
                    "ProductDescription": "Linux/UNIX",
                    "SpotPrice": "0.2256",
                    "Timestamp": newer,
                },
            ]
        },
        {
            "InstanceTypes": ["g4dn.2xlarge"],
            "ProductDescriptions": ["Linux/UNIX"],
            "AvailabilityZone": "us-east-1b",
            "StartTime": ANY,
            "MaxResults": 1,
        },
    )
    stub.activate()
    price = pricing.PriceSource(None, ec2).spot("g4dn.2xlarge", "us-east-1b")
    assert price.usd == 0.2256 and price.source == "EC2 spot price history (us-east-1b)"
    assert price.as_of.startswith("2026-11-21")


class Unreachable:
    def get_products(self, **kwargs):
        raise botocore.exceptions.EndpointConnectionError(endpoint_url="https://api.pricing.us-east-1.amazonaws.com")


def test_without_a_network_the_bundled_dated_table_is_used_and_says_so(state_dir):
    source = pricing.PriceSource(Unreachable(), None)
    price = source.on_demand("g4dn.2xlarge", "us-east-1")
    assert price.usd == 0.752 and price.source.startswith("bundled table") and price.as_of == pricing.BUNDLED["as_of"]
    assert any("Price List API unavailable" in note for note in source.notes)
    assert pricing.PriceSource().on_demand("g6.2xlarge", "us-west-2").usd == 0.9776


def test_an_unknown_type_or_region_says_what_to_do(state_dir):
    with pytest.raises(UsageError, match="no bundled price for region eu-west-3"):
        pricing.PriceSource().on_demand("g4dn.2xlarge", "eu-west-3")
    with pytest.raises(UsageError, match="p5.48xlarge has no bundled price .* Price List API"):
        pricing.PriceSource().on_demand("p5.48xlarge", "us-east-1")
    with pytest.raises(UsageError, match="'g4dn.99xlarge' is not supported"):
        pricing.PriceSource().on_demand("g4dn.99xlarge", "us-east-1")
    client = boto3.client("pricing", region_name="us-east-1")
    stub = Stubber(client)
    stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": []})
    stub.activate()
    with pytest.raises(UsageError, match="knows no Linux on-demand g4dn.99xlarge"):
        pricing.PriceSource(client).on_demand("g4dn.99xlarge", "us-east-1")


def test_api_answers_are_cached_with_a_time_stamp_for_a_day(state_dir):
    clock = Clock()
    first = pricing.PriceSource(pricing_client("0.7520000000"), None, clock=clock)
    first.on_demand("g4dn.2xlarge", "us-east-1")
    cached = json.loads((state_dir / "prices.json").read_text())["on-demand/us-east-1/g4dn.2xlarge"]
    assert cached["fetched_at"] == clock.now and cached["price"]["usd"] == 0.752
    spent = boto3.client("pricing", region_name="us-east-1")
    Stubber(spent).activate()  # a stub with no answers: any call would fail the test
    assert pricing.PriceSource(spent, None, clock=clock).on_demand("g4dn.2xlarge", "us-east-1").usd == 0.752
    clock.now += pricing.CACHE_TTL_S + 1
    refreshed = pricing.PriceSource(pricing_client("0.8000000000"), None, clock=clock).on_demand(
        "g4dn.2xlarge", "us-east-1"
    )
    assert refreshed.usd == 0.8


def test_the_issues_reference_estimate(state_dir):
    estimate = pricing.PriceSource().estimate("g4dn.2xlarge", "us-east-1", nodes=2, root_volume_gb=150)
    assert estimate.instances_hourly_usd == pytest.approx(1.504)
    assert estimate.storage_hourly_usd == pytest.approx(2 * 150 * 0.08 / 730)
    assert estimate.as_dict()["monthly_usd"] == pytest.approx(estimate.hourly_usd * 730, abs=0.01)


# ---------------------------------------------------------------------------------------- ledger


def test_intervals_are_billed_per_second_with_a_one_minute_minimum(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, hourly_usd=1.504)
    clock.now += 5400  # 1.5 h
    ledger.cluster_down("dev")
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, hourly_usd=1.504)
    clock.now += 10  # a 10-second interval is billed as 60 s
    ledger.cluster_down("dev")
    [first, second] = ledger.clusters("dev")
    assert first.cost_usd(clock.now) == pytest.approx(1.504 * 1.5)
    assert second.cost_usd(clock.now) == pytest.approx(1.504 * 60 / 3600)
    assert second.seconds(clock.now) == 10


def test_a_new_up_of_a_stack_whose_interval_never_closed_bills_no_hour_twice(tmp_path):
    """Its state deleted while it ran and no `down`: the next up of the stack ends the old interval."""
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.cluster_up("r2", "local", "g4dn.2xlarge", 2, hourly_usd=3.6)  # $0.001 a second
    ledger.cluster_up("other", "local", "g4dn.2xlarge", 2, hourly_usd=3.6)
    clock.now += 100
    ledger.cluster_up("r2", "local", "g4dn.2xlarge", 2, hourly_usd=3.6)
    clock.now += 100
    first, second = ledger.clusters("r2")
    assert first.cost_usd(clock.now) == pytest.approx(0.1) and first.intervals[0].end_reason == "a new up of the stack"
    assert second.is_up and second.cost_usd(clock.now) == pytest.approx(0.1)
    assert ledger.open_cluster("other").cost_usd(clock.now) == pytest.approx(0.2)  # another stack's goes on


def test_an_open_interval_is_costed_up_to_now_and_runs_by_their_duration(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, hourly_usd=3.6)  # $0.001 a second
    clock.now += 100
    ledger.run_started("r1", "dev", "run-ddp", 2, 3.6)
    clock.now += 25
    assert ledger.run_ended("r1", {"node-0": 0, "node-1": 0}) == pytest.approx(0.025)
    clock.now += 875
    cluster = ledger.open_cluster("dev")
    assert cluster.is_up and cluster.cost_usd(clock.now) == pytest.approx(1.0)
    run = ledger.run("r1")
    assert run.exit_codes == {"node-0": 0, "node-1": 0} and run.cost_usd(clock.now) == pytest.approx(0.025)


def test_a_run_no_fab_saw_end_is_closed_and_priced_up_to_its_cluster_going_down(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, hourly_usd=3.6)
    ledger.run_started("held", "dev", "run", 2, 3.6, scheduled=True)  # held by Slurm: no fab heartbeats it
    ledger.run_started("other", "prod", "run", 2, 3.6, scheduled=True)
    clock.now += 50
    ledger.cluster_down("dev")
    clock.now += 1000
    held, other = ledger.run("held"), ledger.run("other")
    assert held.ended_at == clock.now - 1000 and held.end_reason == "ended with its cluster (down)"
    assert held.cost_usd(clock.now) == pytest.approx(0.05)
    assert other.ended_at is None  # another stack's run goes on


def test_an_interruption_is_priced_as_the_whole_cluster_waiting_for_the_replacement(state_dir):
    clock = Clock()
    ledger = Ledger(clock=clock)
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, hourly_usd=3.6)  # $0.001 a second, both nodes
    ledger.cluster_up("other", "aws", "g4dn.2xlarge", 2, hourly_usd=36.0)
    ledger.event("dev", "spot interruption", "node-1", "replaced; rejoined in 40 s", at=clock.now + 10, seconds=40)
    ledger.close()
    [event] = costs.report("dev")["events"]
    assert event["kind"] == "spot interruption" and event["node"] == "node-1" and event["seconds"] == 40
    assert event["cost_usd"] == pytest.approx(0.04) and event["detail"] == "replaced; rejoined in 40 s"


def test_local_clusters_cost_nothing_but_say_what_they_would_have_cost(tmp_path):
    clock = Clock()
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)
    ledger.cluster_up("local", "local", "g4dn.2xlarge", 2, hourly_usd=0.0, reference_hourly_usd=1.504)
    clock.now += 3600
    ledger.cluster_down("local")
    [cluster] = ledger.clusters()
    assert cluster.cost_usd(clock.now) == 0 and cluster.reference_cost_usd(clock.now) == pytest.approx(1.504)


def test_two_writers_at_once_lose_nothing(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=write_runs, args=(path, w, 40)) for w in range(4)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    runs = Ledger(path).runs()
    assert len(runs) == 160 and all(r.ended_at is not None for r in runs)


def test_a_corrupt_ledger_is_kept_aside_and_a_new_one_started(tmp_path):
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"this is not a database, it was truncated by a full disk" * 100)
    ledger = Ledger(path)
    assert len(ledger.warnings) == 1 and "corrupt" in ledger.warnings[0]
    backups = list(tmp_path.glob("ledger.sqlite.corrupt-*"))
    assert len(backups) == 1 and backups[0].read_bytes().startswith(b"this is not a database")
    ledger.cluster_up("dev", "aws", "g4dn.2xlarge", 2, 1.0)
    assert len(Ledger(path).clusters()) == 1


# -------------------------------------------------------------------------------------- watchdog


def watch(tmp_path, clock, **guards):
    values = {"hourly_usd": 3.6, "started_at": clock.now, "interval_s": 30.0, **guards}
    return watchdog.Watchdog(
        watchdog.Guards(**values),
        tmp_path / "shared",
        tmp_path / "job",
        clock=clock,
        gpus_are_busy=lambda: False,
        progress_dir=tmp_path / "progress",
        runs_are_queued=lambda: False,
    )


def test_the_budget_guard_stops_before_the_next_check_would_cross_it(tmp_path):
    clock = Clock()
    dog = watch(tmp_path, clock, max_total_usd=1.0)  # $0.001/s: $1 after 1000 s
    clock.now += 960
    assert not dog.check().stop
    clock.now += 15  # $0.975 now, $1.005 at the next check
    decision = dog.check()
    assert decision.stop and decision.reason.startswith("budget: $0.97 spent of maxTotalUsd $1")


def test_the_idle_guard_counts_time_without_jobs_or_gpu_work(tmp_path):
    clock = Clock()
    busy = {"gpu": False}
    dog = watch(tmp_path, clock, idle_minutes=10)
    dog.gpus_are_busy = lambda: busy["gpu"]
    clock.now += 540
    assert not dog.check().stop
    busy["gpu"] = True
    clock.now += 60
    assert not dog.check().stop  # the GPUs worked: idle starts again
    busy["gpu"] = False
    job = subprocess.Popen(["sleep", "300"])
    try:
        (tmp_path / "job").write_text(f"{job.pid} run-1 run-ddp\n")
        clock.now += 599
        assert not dog.check().stop  # a job is running
    finally:
        job.kill()
        job.wait()
    lock = subprocess.Popen(
        [sys.executable, str(REPO / "node/job_lock.py"), str(tmp_path / "job.lock"), "run-2", "run", "me"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert lock.stdout.readline().strip() == "locked"
        clock.now += 599
        assert not dog.check().stop  # a launch holds the job lock (syncing, installing): no job yet, not idle
    finally:
        lock.stdin.close()
        lock.wait()
    dog.runs_are_queued = lambda: True
    clock.now += 599
    assert not dog.check().stop  # a run waits in Slurm's queue: the cluster is not idle
    dog.runs_are_queued = lambda: False
    clock.now += 599
    assert not dog.check().stop
    clock.now += 1
    decision = dog.check()
    assert decision.stop and "idle" in decision.reason and decision.idle_s == 600


def test_a_queued_run_is_read_from_squeue_where_the_node_has_a_scheduler(tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    assert not watchdog.runs_queued(conf)  # no scheduler on this node
    conf.write_text("ClusterName=x\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(f'#!/bin/sh\n[ "$SLURM_CONF" = "{conf}" ] && echo "$QUEUED"\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("QUEUED", "")
    assert not watchdog.runs_queued(conf)  # Slurm answers: nothing waits
    monkeypatch.setenv("QUEUED", "12")
    assert watchdog.runs_queued(conf)


def test_a_job_whose_ranks_stop_progressing_is_stalled_and_one_that_progresses_slowly_is_not(tmp_path):
    clock = Clock()
    dog = watch(tmp_path, clock, idle_minutes=10)
    dog.gpus_are_busy = lambda: True  # a hung NCCL collective keeps GPUs busy: that is no progress
    ranks = tmp_path / "progress" / "run-1"
    ranks.mkdir(parents=True)

    def progress(completed: int, step=None, pid=None):
        pid = os.getpid() if pid is None else pid
        for rank in (0, 1):
            record = {
                "rank": rank,
                "pid": pid,
                "step": step,
                "groups": {"0": {"ranks": [0, 1], "enqueued": completed + 1, "completed": completed}},
            }
            (ranks / f"rank-{rank}.json").write_text(json.dumps(record))

    job = subprocess.Popen(["sleep", "300"])
    try:
        (tmp_path / "job").write_text(f"{job.pid} run-1 run-ddp\n")
        for completed in range(1, 5):  # slow but healthy: a collective completes every 9 minutes
            progress(completed)
            clock.now += 540
            assert not dog.check().stop
        progress(4, step=7)  # a harness step with no new collective is progress too
        clock.now += 540
        assert not dog.check().stop
        clock.now += 599  # the same record for 10 minutes: stalled
        assert not dog.check().stop
        clock.now += 1
        decision = dog.check()
        progress(4, step=7, pid=job.pid + 10_000_000)  # ranks that exited report nothing: torchrun tearing down
        teardown = watch(tmp_path, clock, idle_minutes=10)
        assert not teardown.check().stop
        clock.now += 660
        assert not teardown.check().stop
    finally:
        job.kill()
        job.wait()
    assert (
        decision.stop
        and decision.reason.startswith("stalled: job run-1 made no progress")
        and "idleMinutes 10" in decision.reason
    )


def test_powering_off_stops_the_job_and_writes_the_marker_every_node_obeys(tmp_path):
    clock = Clock()
    dog = watch(tmp_path, clock, idle_minutes=1)
    job = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (tmp_path / "job").write_text(f"{job.pid} run-1 run-ddp\n")
    dog.power_off(watchdog.Decision(True, "idle: test", 0.5, 60))
    assert job.wait(timeout=5) == -signal.SIGTERM
    marker = json.loads((tmp_path / "shared" / contract.STOP_MARKER).read_text())
    assert marker["reason"] == "idle: test" and marker["at"] == clock.now and marker["by"] == "watchdog"


def test_the_check_interval_keeps_the_idle_guard_prompt():
    assert watchdog.check_interval_s(None) == 30
    assert watchdog.check_interval_s(30) == 30
    assert watchdog.check_interval_s(0.05) == 1


def test_an_interruption_lasts_until_the_run_it_held_started_again(state_dir):
    """The supervisor records the wait for the replacement; the run stood idle from its requeue (a notice,
    before the node went) until Slurm started it again, after the replacement: the interruption covers it."""
    ledger = Ledger()
    try:
        ledger.event("s", "spot interruption", "node-1", "replaced; rejoined in 20 s", at=1000.0, seconds=20.0)
        ledger.event("s", "node lost", "node-0", "replaced", at=1010.0, seconds=5.0)
        assert not ledger.run_idle("s", "node-1", stopped_at=None, restarted_at=999.0)  # none before it
        assert not ledger.run_idle("s", "node-1", stopped_at=None, restarted_at=5000.0)  # too long after
        assert ledger.run_idle("s", "node-1", stopped_at=990.0, restarted_at=1035.0)
        events = {e.node: (e.at, e.seconds) for e in ledger.events("s")}
    finally:
        ledger.close()
    assert events == {"node-1": (990.0, 45.0), "node-0": (1010.0, 5.0)}
