"""GPU utilisation, memory, power and temperature sampled in a thread with nvidia-ml-py.

A no-op where there is no NVIDIA driver or GPU (CPU nodes, the local provider), so callers never ask.
"""

import threading
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU."""

    index: int
    """NVML device index on the node."""
    name: str
    """Device name, e.g. Tesla T4."""
    util_pct: int
    """GPU utilisation over the last sample period."""
    mem_used_gib: float
    """Device memory in use."""
    mem_total_gib: float
    """Device memory in all."""
    power_w: float | None
    """Board power draw; None where the GPU does not report it."""
    temp_c: int | None
    """GPU temperature."""


def read_gpus() -> list[GpuSample]:
    """One sample of every GPU on this node; empty without a driver or GPUs."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        return [_sample(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _sample(pynvml, index: int) -> GpuSample:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name = pynvml.nvmlDeviceGetName(handle)
    return GpuSample(
        index=index,
        name=name.decode() if isinstance(name, bytes) else name,
        util_pct=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        mem_used_gib=round(memory.used / 2**30, 3),
        mem_total_gib=round(memory.total / 2**30, 3),
        power_w=_optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, pynvml),
        temp_c=_optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU), pynvml),
    )


def _optional(read, pynvml):
    try:
        return read()
    except pynvml.NVMLError:
        return None


class GpuMonitor:
    """Samples every GPU each `interval_s` into `sink(kind="gpu", **fields)` until stopped."""

    def __init__(self, sink, node_rank: int, interval_s: float = 5.0):
        self.sink = sink
        self.node_rank = node_rank
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)

    def __enter__(self) -> "GpuMonitor":
        if read_gpus():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            for sample in read_gpus():
                self.sink("gpu", node_rank=self.node_rank, **asdict(sample))
            self._stop.wait(self.interval_s)


def busy(threshold_pct: int = 5) -> bool:
    """Whether any GPU on this node is doing work now (the watchdog's idle test)."""
    return any(s.util_pct >= threshold_pct for s in read_gpus())
