"""GPU utilisation, memory, power, temperature, clocks and ECC sampled in a thread, through the one GPU
reader (node/nvml.py: NVML).

A no-op where there is no NVIDIA driver or GPU (CPU nodes, the local provider), so callers never ask.
Every run already has its GPUs sampled on every node by the node's torchrun (`nvml.run_sampler`); this
monitor is for a script that wants the readings in its own metrics sink.
"""

from node import nvml
from node.nvml import GpuReading, read_gpus

__all__ = ["GpuMonitor", "GpuReading", "busy", "read_gpus"]


class GpuMonitor:
    """Samples every GPU each `interval_s` into `sink(kind="gpu", **fields)` until stopped."""

    def __init__(self, sink, node_rank: int, interval_s: float = 5.0, library=None):
        self.sampler = nvml.Sampler(
            lambda record: self._write(sink, node_rank, record), f"node-{node_rank}", interval_s, library
        )

    @staticmethod
    def _write(sink, node_rank: int, record: dict) -> None:
        fields = {k: v for k, v in record.items() if k not in ("kind", "time")}
        sink(record["kind"], node_rank=node_rank, **fields)

    def __enter__(self) -> "GpuMonitor":
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)


def busy(threshold_pct: int = 5, library=None) -> bool:
    """Whether any GPU on this node is doing work now (the watchdog's idle test)."""
    readings = read_gpus() if library is None else nvml.read(library)
    return any((r.util_pct or 0) >= threshold_pct for r in readings)
