"""Rank 0's step lines, fixed width, and the metrics file (`$CLUSTER_RUN_DIR/metrics.jsonl`)."""

import collections
import json
import resource
import sys
import time
from pathlib import Path

import torch

from harness.cost import CostMeter

STEP_HEADER = f"{'step':>6} {'loss':>9} {'ms/step':>9} {'samples/s':>11} {'mem GiB':>8} {'$/h':>8} {'$ so far':>10}"


class MetricsWriter:
    """Appends one JSON object per line; a no-op where there is no run folder or on other ranks."""

    def __init__(self, run_dir: Path | None, enabled: bool, name: str = "metrics.jsonl"):
        self.path = run_dir / name if (run_dir and enabled) else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        record = {"kind": kind, "time": round(time.time(), 3), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocator memory on a GPU; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak_kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


def format_step(
    step: int, loss: float, step_ms: float, samples_per_s: float, mem_gib: float, hourly_usd: float, usd_so_far: float
) -> str:
    return (
        f"{step:>6d} {loss:>9.4f} {step_ms:>9.1f} {samples_per_s:>11.1f} {mem_gib:>8.2f} "
        f"{hourly_usd:>8.3f} {usd_so_far:>10.4f}"
    )


last_step: int | None = None
"""The last training step any StepLogger saw in this process: the rank monitor a `fab` launch starts
(node/rankhook/) reports it, so the head node's watchdog can tell a stalled job from a slow one."""


step_compute: collections.deque = collections.deque(maxlen=200)
"""(step, seconds) of this rank's own compute in its last steps (the forward pass, which no collective
waits in): the rank monitor reports them, and node/straggler.py names a rank that stays slower than the
others. Its length is node.straggler.KEPT_STEPS."""
forward_s: float | None = None
"""The last step's forward pass (train.train_step sets it; StepLogger.step files it under its step)."""


class ForwardTimer:
    """Times a forward pass: wall time on CPU, CUDA events on a GPU (read once the step has synchronized,
    as `loss.item()` does, so timing adds no synchronization)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events: tuple | None = None
        self.started = 0.0
        self.ended = 0.0

    def __enter__(self) -> "ForwardTimer":
        if self.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.perf_counter()
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float:
        """After the step synchronized."""
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1000
        return self.ended - self.started


class StepLogger:
    """One line per logged step from rank 0 (the header first), each also kept in the metrics."""

    def __init__(
        self, is_rank0: bool, device: torch.device, meter: CostMeter, metrics: MetricsWriter, global_batch: int
    ):
        self.is_rank0 = is_rank0
        self.device = device
        self.meter = meter
        self.metrics = metrics
        self.global_batch = global_batch
        self.samples = 0
        self.printed_header = False

    def step(self, step: int, loss: float, step_s: float, log: bool) -> None:
        global last_step
        last_step = step
        if forward_s is not None:
            step_compute.append((step, round(forward_s, 6)))
        self.samples += self.global_batch
        if not (log and self.is_rank0):
            return
        if not self.printed_header:
            print(STEP_HEADER, flush=True)
            self.printed_header = True
        samples_per_s = self.global_batch / step_s if step_s > 0 else 0.0
        mem = peak_memory_gib(self.device)
        usd = self.meter.usd_so_far()
        print(format_step(step, loss, step_s * 1000, samples_per_s, mem, self.meter.hourly_usd, usd), flush=True)
        self.metrics.write(
            "step",
            step=step,
            loss=loss,
            step_ms=round(step_s * 1000, 3),
            samples_per_s=round(samples_per_s, 2),
            mem_gib=round(mem, 4),
            hourly_usd=self.meter.hourly_usd,
            usd_so_far=usd,
        )


# Datasheet peaks come from the instance catalog, which infra/ reads too and bootstrap ships with the
# harness (the harness may not import infra/): one table for validation, pricing and MFU.
CATALOG_PATH = Path(__file__).with_name("catalog.json")


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense datasheet peak for a GPU name as CUDA reports it ("Tesla T4", "NVIDIA H100 80GB HBM3")."""
    tokens = device_name.replace("-", " ").split()
    peaks_by_model = json.loads(CATALOG_PATH.read_text(encoding="utf-8"))["gpu_peak_tflops"]
    for model, peaks in peaks_by_model.items():
        if model in tokens:
            return peaks.get(precision)
    return None
