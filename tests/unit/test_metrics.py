"""`/metrics` of the dashboard (dashboard/metrics.py, dashboard/app.py): a synthetic stack's files served
through the real app (Starlette's TestClient), read back with prometheus_client's own parser."""

import asyncio
import json
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboard import app, metrics, sources
from tests.support.dashboards import synthetic_stack

TOKEN = "t0ken-for-tests"


def samples(text: str) -> dict[str, list]:
    """{sample name: [(labels, value)]} as prometheus_client's parser reads the scrape."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


@pytest.fixture
def stack(state_dir):
    """The bench's synthetic stack (2 nodes, 3 finished runs), then a running fault-tolerant run with two
    replica groups and GPU samples, and a kept preflight that named node-1."""
    synthetic_stack(state_dir, "s", nodes=2, runs=3)
    from remote.runs import Run

    folder = state_dir / "s" / "runs" / "ft-run"
    folder.mkdir()
    Run("ft-run", "run", "77", "/log", ["node-0", "node-1"], time.time() - 60, state="RUNNING",
        started_at=time.time() - 50, requeues=1).save(folder)  # fmt: skip
    lines = [
        {"kind": "ft_step", "time": 100.0, "step": 4, "replica": 0, "participants": 2},
        {"kind": "ft_step", "time": 101.0, "step": 4, "replica": 1, "participants": 2},
        {"kind": "ft_step", "time": 102.5, "step": 5, "replica": 0, "participants": 1},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    reading = {"kind": "gpu", "node": "node-1", "index": 0, "util_pct": 87, "mem_used_gib": 2.0, "temp_c": 41,
               "power_w": 120.5, "sm_clock_mhz": 1980, "ecc_uncorrected": 0, "xid_events": 1}  # fmt: skip
    (folder / "gpu-node-1.jsonl").write_text(json.dumps({**reading, "temp_c": 39}) + "\n" + json.dumps(reading) + "\n")
    finished = state_dir / "s" / "runs" / "run-0000" / "gpu-node-0.jsonl"  # its last reading: no GPU's state now
    finished.write_text(json.dumps({"kind": "gpu", "node": "node-0", "index": 0, "util_pct": 5}) + "\n")
    preflight = {"nodes": [{"node": "node-0", "verdict": "OK", "why": ""}, {"node": "node-1", "verdict": "WARN"}]}
    (state_dir / "s" / "preflight.json").write_text(json.dumps(preflight))
    return state_dir


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    text: str


class Client:
    """GET through the ASGI app itself, as uvicorn calls it (no socket, no HTTP client package)."""

    def __init__(self, statuses: dict):
        live = sources.Live("s", None)
        live.statuses = statuses
        self.app = app.build_app(live, TOKEN, 8765)

    def get(self, target: str, headers: dict[str, str] | None = None) -> Reply:
        path, _, query = target.partition("?")
        pairs = {"host": "127.0.0.1:8765", **{k.lower(): v for k, v in (headers or {}).items()}}
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
            "headers": [(k.encode(), v.encode()) for k, v in pairs.items()],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8765),
        }  # fmt: skip
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        asyncio.run(self.app(scope, receive, send))
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return Reply(start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body.decode())


def client(statuses: dict | None = None) -> Client:
    return Client(statuses or {})


def test_metrics_carry_run_states_steps_participants_cost_and_node_health(stack):
    statuses = {"s": {"node-0": {"reachable": True, "scheduler_daemons": {"slurmd": "up", "munged": "down"}}}}
    response = client(statuses).get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(response.text)
    states = {s["run"]: s["state"] for s, v in found["gpucluster_run_state"] if v == 1}
    assert states == {"run-0000": "COMPLETED", "run-0001": "COMPLETED", "run-0002": "COMPLETED", "ft-run": "RUNNING"}
    assert ({"stack": "s", "run": "ft-run"}, 5.0) in found["gpucluster_run_step"]
    assert ({"stack": "s", "run": "ft-run"}, 102.5) in found["gpucluster_run_last_step_timestamp_seconds"]
    assert ({"stack": "s", "run": "run-0002"}, 19.0) in found["gpucluster_run_step"]  # metrics.jsonl's last step
    assert sorted((s["replica"], v) for s, v in found["gpucluster_run_participants"]) == [("0", 1.0), ("1", 2.0)]
    assert ({"stack": "s", "run": "ft-run"}, 1.0) in found["gpucluster_run_requeues_total"]
    assert all(v > 0 for _, v in found["gpucluster_run_cost_usd"])
    assert found["gpucluster_stack_hourly_usd"] == [({"stack": "s"}, 0.526 * 2)]
    assert found["gpucluster_stack_cost_usd"][0][1] > 0
    assert found["gpucluster_node_up"] == [({"stack": "s", "node": "node-0"}, 1.0)]  # node-1: not asked yet
    assert sorted((s["daemon"], v) for s, v in found["gpucluster_node_daemon_up"]) == [("munged", 0.0), ("slurmd", 1.0)]
    assert sorted((s["node"], s["verdict"], v) for s, v in found["gpucluster_node_preflight"]) == [
        ("node-0", "OK", 0.0),
        ("node-1", "WARN", 1.0),
    ]
    gpu = {"stack": "s", "run": "ft-run", "node": "node-1", "gpu": "0"}
    assert [labels for labels, _ in found["gpucluster_gpu_utilization_ratio"]] == [gpu]  # not run-0000's
    assert (gpu, 0.87) in found["gpucluster_gpu_utilization_ratio"]
    assert (gpu, 2.0 * 2**30) in found["gpucluster_gpu_memory_used_bytes"]
    assert (gpu, 1.98e9) in found["gpucluster_gpu_sm_clock_hertz"]
    assert (gpu, 1.0) in found["gpucluster_gpu_xid_events"]
    assert "gpucluster_gpu_memory_clock_hertz" not in found  # not in the record: no sample, not a zero


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"X-Dashboard-Token": TOKEN},  # the page's header is not the scrape's
    ],
)
def test_metrics_need_the_token_as_a_bearer_token(stack, headers):
    response = client().get("/metrics", headers=headers)
    assert response.status_code == 401 and "gpucluster" not in response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert client().get(f"/metrics?token={TOKEN}").status_code == 401  # nor in the URL: Prometheus sends a header


def test_a_running_runs_steps_come_from_the_log_its_page_follows(stack):
    from dashboard import shape

    tail = shape.LogTail()
    tail.add("node-0", "[node-0]      7    0.5000     200.0        10.0     0.10    0.000     0.0000\n", 55.0)
    found = metrics.Reader().progress_of(stack / "s" / "runs" / "no-metrics-yet", tail)
    assert (found.step, found.step_at) == (7, 55.0)


def test_a_run_whose_metrics_grow_is_read_again(stack):
    reader = metrics.Reader()
    folder = stack / "s" / "runs" / "ft-run"
    assert reader.progress_of(folder, None).step == 5
    with (folder / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({"kind": "ft_step", "time": 103.0, "step": 6, "replica": 1, "participants": 2}) + "\n")
    assert reader.progress_of(folder, None).step == 6


def test_the_running_runs_gpu_readings_come_from_the_head_nodes_samples_files(stack, tmp_path):
    """What `gpus.bring` asks of the head node, run by a shell on a run folder and read back: each node's
    newest reading per GPU, a line the tail cut skipped, never metrics.jsonl; a scrape exports them."""
    import subprocess

    from dashboard import gpus
    from tests.support import inventories

    cluster = inventories.cluster()
    command = gpus.tail_command(cluster, ["ft-run", "other"])
    assert command.count(gpus.MARK) == 2 and "ft-run/gpu-*.jsonl" in command and "metrics.jsonl" not in command
    older = {"kind": "gpu", "node": "node-1", "index": 0, "temp_c": 40}
    newer = {**older, "temp_c": 44}
    folder = tmp_path / "ft-run"
    folder.mkdir()
    (folder / "gpu-node-1.jsonl").write_text(f"{json.dumps(older)}\n{json.dumps(newer)}\n")
    (folder / "gpu-node-0.jsonl").write_text(json.dumps({**older, "node": "node-0"}) + "\n" + '{"kind": "gpu", "no')
    (folder / "metrics.jsonl").write_text(json.dumps({**older, "node": "node-9"}) + "\n")
    remote = str(gpus.node_paths.remote_run_dir(cluster, "ft-run"))
    local = command.replace(gpus.node_paths.shell_path(remote), str(folder))
    assert local != command
    found = gpus.parse(subprocess.run(["sh", "-c", local], capture_output=True, text=True, check=True).stdout)
    assert found == {"ft-run": {("node-1", "0"): newer, ("node-0", "0"): {**older, "node": "node-0"}}, "other": {}}
    found["ft-run"].pop(("node-0", "0"))
    scrape = metrics.Reader().scrape(["s"], {}, {}, time.time(), {("s", "ft-run"): found["ft-run"]})
    assert scrape.progress[("s", "ft-run")].gpus[("node-1", "0")]["temp_c"] == 44
    text = metrics.render(scrape).decode()
    assert 'gpucluster_gpu_temperature_celsius{gpu="0",node="node-1",run="ft-run",stack="s"} 44.0' in text
