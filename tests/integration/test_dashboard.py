"""`python deploy.py dashboard` in a real browser (Debian's chromium, headless, driven by Playwright) against a
real local cluster whose runs Slurm holds: a running run and a queued one on the page, the running run's
plot and log growing live, cancel through the page, a wrong token refused, loopback only, Ctrl-C ends it."""

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from node import contract, gpu_samples, nvml
from tests.support import REPO, network, slurm
from tests.support.cli import assert_one_line_error, child_env, run_cli
from tests.support.clusters import bootstrapped_cluster
from tests.support.fake_nvml import FakeNvml

CHROMIUM = Path("/usr/bin/chromium")
PROMETHEUS = shutil.which("prometheus")
H200 = (REPO / "tests" / "fixtures" / "gpu" / "nvidia-smi-h200.xml").read_text()
pytestmark = [
    pytest.mark.skipif(slurm.unavailable() is not None, reason=f"Slurm: {slurm.unavailable()}"),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium; .ci/run does)"),
]

# Rank 0 prints the harness's step line (harness/metrics.py format_step) every 0.2 s, for a minute at most.
TRAINING = """
import os, time
for step in range(300):
    if os.environ["RANK"] == "0":
        print(f"{step:>6d} {1 / (step + 1):>9.4f} {200.0:>9.1f} {10.0:>11.1f} {0.1:>8.2f} {0.0:>8.3f} {0.0:>10.4f}",
              flush=True)
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with bootstrapped_cluster(tmp_path_factory, "dashboard", master_port=slurm.free_ports(), scheduler=None) as handle:
        yield handle


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """A running run and, behind it in Slurm's queue, a queued one."""
    script = tmp_path_factory.mktemp("dashboard-script") / "train.py"
    script.write_text(TRAINING)
    ids = []
    for _ in range(2):
        result = cluster.fab("run", "--script", str(script), "--detach")
        assert result.returncode == 0, result.stdout + result.stderr
        ids.append(result.stdout.strip().splitlines()[-1])
    return ids


@pytest.fixture(scope="module")
def dashboard(cluster):
    """The dashboard, as a user starts it; its URL; Ctrl-C at the end (the last test checks what it leaves)."""
    process = subprocess.Popen(
        [sys.executable, "deploy.py", "dashboard", "--port", "0", "--stack", cluster.stack],
        cwd=REPO,
        env=child_env(**cluster.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("dashboard: http://127.0.0.1:"), line
    yield process, line.split()[1]
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def page(dashboard):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser.new_page()
        browser.close()


def status_of(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize(
    "args,words",
    [
        (["--port", "70000"], ["--port", "0..65535"]),
        (["--port", " 80"], ["--port", "whole number"]),
        (["--stack", ""], ["bad stack name ''"]),
        (["--stack", "nosuch"], ["no stack 'nosuch'", "--stack"]),
    ],
)
def test_bad_flags_are_one_line_and_create_nothing(state_dir, args, words):
    assert_one_line_error(run_cli("dashboard", *args), *words)
    assert not state_dir.exists()


def test_no_token_or_a_wrong_one_gets_no_page_and_it_listens_on_loopback_only(dashboard, cluster):
    process, url = dashboard
    base, token = url.split("/?token=")
    assert status_of(url) == 200
    for refused in (base + "/", base + "/?token=wrong", base + "/api/state", base + "/api/state?token=" + token[:-1]):
        assert status_of(refused) == 403, refused
    assert status_of(url, {"Host": "evil.example:80"}) == 400  # a DNS name rebound to 127.0.0.1 reaches nothing
    sockets = [s for s in slurm.listening_sockets() if s[2] == process.pid]
    assert sockets and all(address == "127.0.0.1" for address, _, _ in sockets), sockets
    taken = base.rsplit(":", 1)[1]
    assert_one_line_error(cluster.cli("dashboard", "--port", taken), f"127.0.0.1:{taken}", "--port 0")


def test_the_page_shows_the_running_and_the_queued_run_a_live_plot_and_a_growing_log(dashboard, runs, page, cluster):
    running, queued = runs
    page.goto(dashboard[1])
    page.wait_for_selector(f'tr.run[data-run="{running}"][data-state="RUNNING"]', timeout=60_000)
    page.wait_for_selector(f'tr.run[data-run="{queued}"][data-state="PENDING"]')
    assert page.locator("tr.node").count() == 2  # each up, with its Slurm state (status's SSH round trip)
    right = "document.querySelector('{}').getBoundingClientRect().right"
    fits = f"{right.format('table.runs')} <= {right.format('.stack')}"
    assert page.evaluate(fits), "the runs table overflows its card"
    assert "stragglers" not in page.inner_text("table.runs")  # no straggler named, no verdict said
    page.wait_for_function(
        "[...document.querySelectorAll('tr.node')].every(row =>"
        " row.children[2].textContent === 'up' && ['idle', 'allocated', 'mixed'].includes(row.children[3].textContent))"
    )
    page.click(f'a[href="#run/local/{running}"]')
    page.wait_for_function("Number(document.querySelector('#plot-loss').dataset.points) > 0", timeout=30_000)
    seen = page.evaluate("window.dashboard.logLines")
    page.wait_for_function(f"window.dashboard.logLines > {seen}", timeout=10_000)  # it follows, no reload
    assert "[node-0]" in page.inner_text("#log")
    # A finished fab-held run's log: its nodes' logs as fab's streams wrote them, shown in the order they came
    finished = finished_fab_run(Path(cluster.env["CLUSTER_STATE_DIR"]) / cluster.stack / "runs")
    page.goto(dashboard[1] + f"#run/local/{finished}")
    page.wait_for_function("document.querySelector('#log').textContent.includes('fourth')", timeout=30_000)
    assert page.inner_text("#log").splitlines()[:4] == [
        "[node-1] first",
        "[node-0] second",
        "[node-1] third",
        "[node-0] fourth",
    ]


def finished_fab_run(runs_dir: Path) -> str:
    """A run fab's connections held, ended: each node's log and line times written by its stream, the nodes
    taking turns (the page showed node-0's log, then node-1's)."""
    from remote.runs import Run
    from remote.stream import NodeStream

    run_id = "20200101-000000-run-fab1"
    folder = runs_dir / run_id
    folder.mkdir()
    streams = [NodeStream(f"node-{i}", i, folder / f"node-{i}.log", echo=False) for i in range(2)]
    for index, word in enumerate(["first", "second", "third", "fourth"]):
        streams[1 - index % 2].feed(f"[node-{1 - index % 2}] {word}\n".encode())
        time.sleep(0.01)
    for stream in streams:
        stream.close()
    Run(run_id, "run", "", "", ["node-0", "node-1"], 1.0, state="COMPLETED", started_at=1.0, ended_at=2.0,
        exit_code=0, finished=True, holder="fab").save(folder)  # fmt: skip
    return run_id


def test_cancel_after_a_confirmation_stops_the_run(dashboard, runs, page, cluster):
    running, queued = runs
    page.goto(dashboard[1] + f"#run/local/{queued}")
    page.once("dialog", lambda dialog: dialog.dismiss())  # said no: nothing happens
    page.click("#cancel")
    assert page.inner_text("#cancel-result") == ""
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel")
    page.wait_for_function("document.querySelector('#cancel-result').textContent.includes('cancelled')")
    rows = {row["run_id"]: row for row in json.loads(cluster.fab("jobs", "--json").stdout)}
    assert rows[queued]["state"] == "CANCELLED" and rows[running]["state"] == "RUNNING", rows


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus (apt-get install prometheus; .ci/run does)")
def test_a_real_prometheus_scrapes_the_runs_with_the_scrape_config_of_the_docs(dashboard, runs, cluster, tmp_path):
    """Debian's Prometheus with dashboard/prometheus.yml as a user saves it beside .cluster/ (the port the
    only change), the token read from the file the dashboard keeps: its query API has the running run, and
    the GPU readings its sampler writes on the cluster while it runs."""
    url = dashboard[1]
    port = url.split(":")[2].split("/")[0]
    (tmp_path / ".cluster").symlink_to(cluster.env["CLUSTER_STATE_DIR"])
    config = (REPO / "dashboard" / "prometheus.yml").read_text()
    assert "127.0.0.1:8765" in config and "dashboard-8765.token" in config
    (tmp_path / "prometheus.yml").write_text(config.replace("8765", port))
    web = f"127.0.0.1:{network.free_port()}"
    process = subprocess.Popen(
        [PROMETHEUS, "--config.file=prometheus.yml", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address={web}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )  # fmt: skip
    try:
        running = runs[0]
        query = urllib.parse.quote(f'gpucluster_run_state{{run="{running}",state="RUNNING"}}')
        found: list = []

        def scraped() -> bool:
            found[:] = prometheus_query(f"http://{web}/api/v1/query?query={query}")
            return bool(found)

        slurm.wait_for(
            scraped,
            "Prometheus has the running run's state",
            lambda: (tmp_path / "prometheus.log").read_text()[-2000:],
            deadline_s=60,
        )
        assert found[0]["metric"]["stack"] == cluster.stack and found[0]["value"][1] == "1"
        (up,) = prometheus_query(f"http://{web}/api/v1/query?query=up")
        assert up["metric"]["job"] == "gpu-cluster" and up["value"][1] == "1"
        # The run's sampler on its node, with a fake NVML answering as the recorded H200 (no GPU here): the
        # dashboard brings the running run's newest readings from the head node, Prometheus has them.
        samples = Path(cluster.info["shared_dir"]) / "runs" / running / contract.gpu_samples("node-1")
        sink = gpu_samples.SampleFile(str(samples), contract.GPU_SAMPLES_MAX_BYTES)
        nvml.Sampler(sink, "node-1", library=FakeNvml(H200)).once({})
        query = urllib.parse.quote(f'gpucluster_gpu_temperature_celsius{{run="{running}"}}')
        slurm.wait_for(scraped, "Prometheus has the running run's GPU temperature", deadline_s=60)
        assert [(r["metric"]["node"], r["metric"]["gpu"], r["value"][1]) for r in found] == [("node-1", "0", "34")]
    finally:
        process.terminate()
        process.wait(timeout=30)


def prometheus_query(url: str) -> list:
    """The result of a query of Prometheus' HTTP API ([] until it has scraped, or where it is not up yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]
    except (urllib.error.URLError, ConnectionError):
        return []


def test_ctrl_c_stops_it_and_leaves_nothing_running(dashboard, runs, cluster):
    """Not the server, nor the follow of the running run's log it started on the head node."""
    process, url = dashboard
    running = runs[0]
    assert followers_of(running), "the run page's follow is not running on the head node"
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 130  # as any Ctrl-C of the CLI
    assert "Traceback" not in process.stdout.read()  # the run page's log stream was open: it ended, not cancelled
    port = int(url.split(":")[2].split("/")[0])
    slurm.wait_for(lambda: not followers_of(running), f"the follow of {running} ended", deadline_s=15)
    assert not any(p == port for _, p, _ in slurm.listening_sockets())
    assert not (Path(cluster.env["CLUSTER_STATE_DIR"]) / f"dashboard-{port}.token").exists()  # the token goes too
    assert cluster.fab("stop", "--run", running).returncode == 0


def followers_of(run_id: str) -> list[int]:
    """`slurm_run.py follow` processes of this run's log (the local nodes' processes are this machine's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"follow" in words and any(run_id.encode() in w for w in words) and any(b"slurm_run" in w for w in words):
            found.append(int(proc.name))
    return found
