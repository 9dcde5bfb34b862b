"""The dashboard's `/metrics` (issue 43): a scrape of a stack with 16 nodes and 200 runs takes under 100 ms.

The bench's synthetic stack (tests/support/dashboards.py: an inventory of 16 nodes, 200 finished run records
with metrics, their ledger rows), a kept preflight of every node, and 8 GPUs' samples on every node in the
newest run. `deploy.py dashboard` serves it; Prometheus' request is made SCRAPES times over HTTP with the
bearer token (the first one apart: it reads every run's metrics file once), beside the page's own overview
(`/api/state`) of the same stack asked as often, as the baseline. The scrape is parsed with
prometheus_client's parser to check it carries every run.

    python -m bench metrics
"""

import json
import os
import time
import urllib.request
from pathlib import Path

from bench.bench_dashboard import start_dashboard
from bench.common import Check, median, scratch_env

SCRAPES = 30
NODES, RUNS, GPUS = 16, 200, 8
LIMIT_S = 0.100


def extras(state_dir: Path, stack: str) -> None:
    """A preflight verdict of every node, and the newest run running, with GPU samples of every node."""
    from remote.runs import Run

    nodes = [{"node": f"node-{i}", "verdict": "OK" if i else "WARN", "why": ""} for i in range(NODES)]
    (state_dir / stack / "preflight.json").write_text(json.dumps({"nodes": nodes}))
    folder = state_dir / stack / "runs" / f"run-{RUNS - 1:04d}"
    record = Run.load(folder)
    assert record is not None
    record.state, record.ended_at, record.finished, record.exit_code = "RUNNING", None, False, None
    record.save(folder)
    for n in range(NODES):  # each node's own samples file (node/gpu_samples.py)
        samples = [
            {"kind": "gpu", "time": time.time(), "node": f"node-{n}", "index": g, "util_pct": 90,
             "mem_used_gib": 60.0, "temp_c": 50, "power_w": 500.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
             "ecc_uncorrected": 0, "ecc_corrected": 0, "xid_events": 0}
            for g in range(GPUS)
        ]  # fmt: skip
        (folder / f"gpu-node-{n}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def timed_get(url: str, headers: dict[str, str]) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        body = response.read()
    return time.perf_counter() - started, body


def scrape_cpu_s(state_dir: Path) -> float:
    """One scrape's own CPU time (gathered and rendered in this process, warm), the median of SCRAPES: what
    the scrape costs whatever else the machine runs."""
    from dashboard import metrics

    old = os.environ.get("CLUSTER_STATE_DIR")
    os.environ["CLUSTER_STATE_DIR"] = str(state_dir)
    try:
        reader, times = metrics.Reader(), []
        for _ in range(SCRAPES + 1):
            started = time.process_time()
            metrics.render(reader.scrape(["big"], {}, {}, time.time()))
            times.append(time.process_time() - started)
        return median(times[1:])
    finally:
        if old is None:
            os.environ.pop("CLUSTER_STATE_DIR")
        else:
            os.environ["CLUSTER_STATE_DIR"] = old


def run() -> list[Check]:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.dashboards import synthetic_stack

    env = scratch_env()
    state_dir = Path(env["CLUSTER_STATE_DIR"])
    synthetic_stack(state_dir, "big", nodes=NODES, runs=RUNS)
    extras(state_dir, "big")
    process, url = start_dashboard(env)
    try:
        base, token = url.split("/?token=")
        bearer = {"Authorization": f"Bearer {token}"}
        first, body = timed_get(base + "/metrics", bearer)
        scrapes, pages = [], []
        for _ in range(SCRAPES):
            scrapes.append(timed_get(base + "/metrics", bearer)[0])
            pages.append(timed_get(base + "/api/state", {"X-Dashboard-Token": token})[0])
    finally:
        process.send_signal(2)
        process.wait(timeout=15)
    cpu = scrape_cpu_s(state_dir)
    load = os.getloadavg()[0]
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    runs = len(families["gpucluster_run_state"].samples)
    gpus = len(families["gpucluster_gpu_utilization_ratio"].samples)
    scrape, page = median(scrapes), median(pages)
    print(
        f"/metrics, {NODES} nodes, {RUNS} runs ({len(body)} bytes, {runs} runs and {gpus} GPUs in it): first "
        f"{1000 * first:.1f} ms, then median {1000 * scrape:.1f} ms, slowest {1000 * max(scrapes):.1f} ms of "
        f"{SCRAPES}; /api/state median {1000 * page:.1f} ms ({scrape / page:.2f}x); one scrape's CPU time "
        f"{1000 * cpu:.1f} ms; load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    return [
        Check(
            f"/metrics scrape, {NODES} nodes, {RUNS} runs (median of {SCRAPES})",
            f"{1000 * scrape:.1f} ms ({scrape / page:.2f}x /api/state; first {1000 * first:.1f} ms; "
            f"CPU {1000 * cpu:.1f} ms; load {load:.1f})",
            f"< {1000 * LIMIT_S:.0f} ms",
            scrape < LIMIT_S and runs == RUNS and gpus == NODES * GPUS,
        )
    ]
