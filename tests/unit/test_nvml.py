"""The one GPU reader (node/nvml.py) against a fake NVML that answers from the recorded H200
(tests/support/fake_nvml.py): what the preflight, the harness's monitor and watchdog, and the run's sampler
read through it, and that it tells the preflight what nvidia-smi told it of the same GPU."""

import json
import time
from pathlib import Path

import pytest

from harness import gpu_monitor
from node import contract, fitness, gpu_samples, nvml
from tests.support.fake_nvml import FakeNvml, kernel_xids

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpu"
H200 = (FIXTURES / "nvidia-smi-h200.xml").read_text()


def test_the_recorded_h200_reads_whole_through_nvml():
    (gpu,) = nvml.read(FakeNvml(H200))
    assert (gpu.name, gpu.bus_id) == ("NVIDIA H200", "00000000:00:06.0")
    assert (gpu.util_pct, gpu.mem_used_gib, gpu.mem_total_gib) == (0, 0.0, round(143771 / 1024, 3))
    assert (gpu.temp_c, gpu.power_w, gpu.sm_clock_mhz, gpu.mem_clock_mhz) == (34, 78.99, 345, 3201)
    assert (gpu.ecc_corrected, gpu.ecc_uncorrected, gpu.retired_pages) == (0, 0, None)  # retired: N/A on an H200
    assert gpu.clock_event_reasons == ["gpu_idle"]


@pytest.mark.parametrize(
    "old, new",
    [
        ("", ""),
        ("<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>2</dram_uncorrectable>"),
        ("<remapped_row_failure>No</remapped_row_failure>", "<remapped_row_failure>Yes</remapped_row_failure>"),
        (
            "<clocks_event_reason_hw_thermal_slowdown>Not Active</clocks_event_reason_hw_thermal_slowdown>",
            "<clocks_event_reason_hw_thermal_slowdown>Active</clocks_event_reason_hw_thermal_slowdown>",
        ),
        ("<current_link_width>16x</current_link_width>", "<current_link_width>8x</current_link_width>"),
    ],
)
def test_the_preflight_hears_from_nvml_what_nvidia_smi_says_of_the_same_gpu(old, new):
    text = H200.replace(old, new, 1)
    through_nvml = [reading.preflight() for reading in nvml.read(FakeNvml(text))]
    assert through_nvml == fitness.nvidia_smi_gpus(text)


def test_the_preflight_asks_nvml_first_and_nvidia_smi_only_without_it(monkeypatch):
    monkeypatch.setattr(nvml.Library, "load", classmethod(lambda cls: FakeNvml(H200.replace("345 MHz", "1980 MHz"))))
    monkeypatch.setattr(fitness, "_output", lambda argv, timeout_s: "" if argv[0] != "nvidia-smi" else H200)
    assert fitness.gpu_facts()["gpus"][0]["sm_clock_mhz"] == 1980  # NVML's, not nvidia-smi's 345
    monkeypatch.setattr(nvml.Library, "load", classmethod(lambda cls: None))
    monkeypatch.setattr(fitness.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "nvidia-smi" else None)
    assert fitness.gpu_facts()["gpus"][0]["sm_clock_mhz"] == 345
    monkeypatch.setattr(fitness.shutil, "which", lambda name: None)
    assert fitness.gpu_facts() == {}  # a CPU node


def test_a_runs_sampler_keeps_every_gpus_figures_and_its_xid_events(tmp_path):
    xids = [(0, xid) for xid in kernel_xids((FIXTURES / "kern-xid.log").read_text())]
    assert [x for _, x in xids] == [13, 48, 79, 94]
    path = tmp_path / "metrics.jsonl"
    sampler = nvml.Sampler(nvml.file_sink(str(path)), "node-1", library=FakeNvml(H200, xids))
    counts: dict[int, int] = {}
    sampler.once(counts)
    sampler.once(counts)  # no new event: the count stays
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["xid"] for r in records if r["kind"] == "xid"] == [13, 48, 79, 94]
    gpu = [r for r in records if r["kind"] == "gpu"]
    assert len(gpu) == 2 and {r["xid_events"] for r in gpu} == {4}
    assert gpu[0]["node"] == "node-1" and gpu[0]["power_w"] == 78.99 and gpu[0]["sm_clock_mhz"] == 345


def test_a_runs_samples_go_to_the_nodes_own_file_not_the_runs_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTER_RUN_DIR", str(tmp_path))
    sampler = nvml.run_sampler("node-1")
    sampler.library = FakeNvml(H200)  # what __enter__ would load on a GPU node
    sampler.once({})
    assert not (tmp_path / contract.METRICS_FILE).exists()
    (record,) = [json.loads(line) for line in (tmp_path / "gpu-node-1.jsonl").read_text().splitlines()]
    assert record["kind"] == "gpu" and record["temp_c"] == 34
    assert gpu_samples.newest_in(str(tmp_path / "gpu-node-1.jsonl")) == {("node-1", "0"): record}


def test_a_long_runs_samples_file_stays_bounded_and_spans_the_whole_run_evenly(tmp_path):
    """A day of 8 GPUs every 5 s would be about 40 MB; the file is thinned instead: never over its bound,
    its first and newest rounds kept, its readings evenly spaced, every Xid event kept."""
    path = tmp_path / "gpu-node-0.jsonl"
    sink = gpu_samples.SampleFile(str(path), 20_000)
    rounds = 2000
    for at in range(rounds):
        for index in range(2):
            sink({"kind": "gpu", "time": float(at), "node": "node-0", "index": index, "temp_c": 40})
        if at in (7, 1500):
            sink({"kind": "xid", "time": float(at), "node": "node-0", "index": 0, "xid": 79})
        assert path.stat().st_size <= 20_000
    records = [json.loads(line) for line in path.read_text().splitlines()]
    times = [r["time"] for r in records if r["kind"] == "gpu" and r["index"] == 0]
    assert times[0] == 0.0 and times[-1] >= rounds - sink.stride and len(times) > 50
    assert len({b - a for a, b in zip(times, times[1:], strict=False)}) == 1  # one step: evenly spaced
    assert [r["time"] for r in records if r["kind"] == "xid"] == [7.0, 1500.0]
    written = len(records)
    sink({"kind": "gpu", "time": float(rounds), "node": "node-0", "index": 0, "temp_c": 40})
    assert len(path.read_text().splitlines()) in (written, written + 1)


def test_the_sampler_runs_in_a_thread_and_stops_with_the_run(tmp_path):
    found: list[dict] = []
    with nvml.Sampler(found.append, "node-0", interval_s=0.05, library=FakeNvml(H200)):
        deadline = time.monotonic() + 5
        while len(found) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    seen = len(found)
    time.sleep(0.15)
    assert seen >= 2 and len(found) == seen  # stopped


def test_no_driver_no_thread_and_nothing_read(monkeypatch):
    monkeypatch.setattr(nvml.Library, "load", classmethod(lambda cls: None))
    with nvml.Sampler(lambda record: None, "node-0") as sampler:
        assert sampler.thread is None
    assert nvml.read_gpus() == [] and nvml.preflight_gpus() is None
    assert not gpu_monitor.busy()


def test_the_idle_watchdog_and_the_ddp_monitor_read_through_the_same_reader():
    assert not gpu_monitor.busy(library=FakeNvml(H200))  # the recorded H200 is idle
    assert gpu_monitor.busy(library=FakeNvml(H200, util_pct=87))
    written: list[tuple[str, dict]] = []
    monitor = gpu_monitor.GpuMonitor(lambda kind, **fields: written.append((kind, fields)), 1, library=FakeNvml(H200))
    monitor.sampler.once({})
    ((kind, fields),) = written
    assert kind == "gpu" and fields["node_rank"] == 1 and fields["temp_c"] == 34
