"""The one GPU reader: NVML (libnvidia-ml, the driver's own library, through ctypes: stdlib only); the
preflight asks `nvidia-smi -q -x` only where NVML cannot be loaded.

Used by the preflight (node/fitness.py: ECC, retired pages, remapped rows, clock-event reasons, PCIe,
clocks), by the harness's GPU monitor and idle watchdog (harness/gpu_monitor.py), and by the sampler every
node's torchrun starts for every run (node/torchrun.py): utilisation, memory, temperature, power, clocks,
ECC counts and Xid events, one `gpu` record per GPU every `SAMPLE_S` into the node's own samples file in
the run's folder (`contract.gpu_samples`, bounded: node/gpu_samples.py), which the dashboard exports
(`/metrics`). Where there is no driver (a CPU node, the local provider) every reader reads nothing and the
sampler starts no thread.

The NVML calls are those of nvml.h (https://docs.nvidia.com/deploy/nvml-api/); `Library` is their subset
as Python methods, so the tests can put a fake NVML built from a recorded GPU in the real one's place.
"""

import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, field

SAMPLE_S = 5.0
"""How often the sampler reads every GPU during a run."""
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clocks_setting",
}
"""nvmlClocksEventReason bits, named as `nvidia-smi -q -x` names them (less its `clocks_event_reason_`)."""
SAMPLED = (
    "index", "name", "util_pct", "mem_used_gib", "mem_total_gib", "temp_c", "power_w", "sm_clock_mhz",
    "mem_clock_mhz", "ecc_corrected", "ecc_uncorrected",
)  # fmt: skip
"""What a run keeps of each reading (the dashboard exports these, harness/gpu_monitor.py writes them)."""
SM, MEM = 1, 2
"""nvmlClockType_t: NVML_CLOCK_SM, NVML_CLOCK_MEM."""
XID_CRITICAL = 0x8
"""nvmlEventTypeXidCriticalError."""
NOT_SUPPORTED, INSUFFICIENT_SIZE, TIMEOUT = 3, 7, 10


class NvmlError(Exception):
    """An NVML call failed (its nvmlReturn_t in `code`); a reading it was for is left unknown."""

    def __init__(self, code: int, call: str = ""):
        super().__init__(f"{call}: NVML error {code}")
        self.code = code


@dataclass
class GpuReading:
    """One reading of one GPU; a figure the GPU does not report is None."""

    index: int
    """NVML's device index on the node."""
    name: str
    """The product, e.g. NVIDIA H200."""
    bus_id: str = ""
    """PCI bus id, e.g. 00000000:19:00.0."""
    util_pct: int | None = None
    """GPU utilisation over the driver's last sample period."""
    mem_used_gib: float | None = None
    mem_total_gib: float | None = None
    temp_c: int | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_max_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    ecc_corrected: int | None = None
    """Corrected ECC errors since the driver loaded (volatile)."""
    ecc_uncorrected: int | None = None
    """Uncorrected ECC errors since the driver loaded (volatile)."""
    ecc_aggregate_uncorrected: int | None = None
    """Uncorrected ECC errors over the GPU's life."""
    retired_pages: int | None = None
    retired_pending: bool = False
    remapped_pending: bool = False
    remapped_failure: bool = False
    clock_event_reasons: list[str] = field(default_factory=list)
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    pcie_gen: int | None = None
    pcie_max_gen: int | None = None

    def sample(self) -> dict:
        """The figures a run keeps every `SAMPLE_S` (a `gpu` record's fields)."""
        return {key: getattr(self, key) for key in SAMPLED}

    def preflight(self) -> dict:
        """The facts the preflight judges, in `fitness.nvidia_smi_gpus`'s keys (an unknown count is 0, as
        nvidia-smi's N/A is read there)."""
        return {
            "name": self.name,
            "bus_id": self.bus_id,
            "ecc_volatile_uncorrectable": self.ecc_uncorrected or 0,
            "ecc_aggregate_uncorrectable": self.ecc_aggregate_uncorrected or 0,
            "retired_pages": self.retired_pages or 0,
            "retired_pending": self.retired_pending,
            "remapped_pending": self.remapped_pending,
            "remapped_failure": self.remapped_failure,
            "clock_event_reasons": list(self.clock_event_reasons),
            "pcie_width": self.pcie_width or 0,
            "pcie_max_width": self.pcie_max_width or 0,
            "pcie_gen": self.pcie_gen or 0,
            "pcie_max_gen": self.pcie_max_gen or 0,
            "sm_clock_mhz": self.sm_clock_mhz or 0,
            "sm_max_clock_mhz": self.sm_max_clock_mhz or 0,
        }


# ------------------------------------------------------------------------------------------ the library


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _PciInfo(ctypes.Structure):  # nvmlPciInfo_t (v3)
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class _EventData(ctypes.Structure):  # nvmlEventData_t
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class Library:
    """libnvidia-ml through ctypes: the calls the readers make, one method each (the fake's interface)."""

    def __init__(self, lib):
        self.lib = lib
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.events: ctypes.c_void_p | None = None

    @classmethod
    def load(cls) -> "Library | None":
        """NVML initialised, or None where the driver's library is missing or will not start."""
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        found = cls(lib)
        try:
            found._call("nvmlInit_v2")
        except (NvmlError, AttributeError):
            return None
        return found

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise NvmlError(code, name)

    def _handle(self, index: int) -> ctypes.c_void_p:
        if index not in self.handles:
            handle = ctypes.c_void_p()
            self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
            self.handles[index] = handle
        return self.handles[index]

    def _uint(self, name: str, index: int, *args) -> int:
        value = ctypes.c_uint()
        self._call(name, self._handle(index), *args, ctypes.byref(value))
        return value.value

    def count(self) -> int:
        value = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(value))
        return value.value

    def name(self, index: int) -> str:
        buffer = ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetName", self._handle(index), buffer, ctypes.c_uint(96))
        return buffer.value.decode(errors="replace")

    def bus_id(self, index: int) -> str:
        info = _PciInfo()
        self._call("nvmlDeviceGetPciInfo_v3", self._handle(index), ctypes.byref(info))
        return info.busId.decode(errors="replace")

    def utilization_pct(self, index: int) -> int:
        found = _Utilization()
        self._call("nvmlDeviceGetUtilizationRates", self._handle(index), ctypes.byref(found))
        return found.gpu

    def memory_bytes(self, index: int) -> tuple[int, int]:
        """(used, total)."""
        found = _Memory()
        self._call("nvmlDeviceGetMemoryInfo", self._handle(index), ctypes.byref(found))
        return found.used, found.total

    def temperature_c(self, index: int) -> int:
        return self._uint("nvmlDeviceGetTemperature", index, ctypes.c_int(0))  # NVML_TEMPERATURE_GPU

    def power_mw(self, index: int) -> int:
        return self._uint("nvmlDeviceGetPowerUsage", index)

    def clock_mhz(self, index: int, kind: int, maximum: bool = False) -> int:
        return self._uint(
            "nvmlDeviceGetMaxClockInfo" if maximum else "nvmlDeviceGetClockInfo", index, ctypes.c_int(kind)
        )

    def ecc_errors(self, index: int, uncorrected: bool, aggregate: bool) -> int:
        value = ctypes.c_ulonglong()
        self._call(
            "nvmlDeviceGetTotalEccErrors",
            self._handle(index),
            ctypes.c_int(int(uncorrected)),
            ctypes.c_int(int(aggregate)),
            ctypes.byref(value),
        )
        return value.value

    def retired_pages(self, index: int) -> tuple[int, bool]:
        """(pages retired for either cause, whether a retirement waits for a reboot)."""
        pages = 0
        for cause in (0, 1):  # multiple single-bit errors, a double-bit error
            count = ctypes.c_uint(0)
            code = self.lib.nvmlDeviceGetRetiredPages(
                self._handle(index), ctypes.c_int(cause), ctypes.byref(count), None
            )
            if code not in (0, INSUFFICIENT_SIZE):
                raise NvmlError(code, "nvmlDeviceGetRetiredPages")
            pages += count.value
        return pages, bool(self._uint("nvmlDeviceGetRetiredPagesPendingStatus", index))

    def remapped_rows(self, index: int) -> tuple[bool, bool]:
        """(a remapping waits for a reset, a remapping failed)."""
        values = [ctypes.c_uint() for _ in range(4)]
        self._call("nvmlDeviceGetRemappedRows", self._handle(index), *(ctypes.byref(v) for v in values))
        return bool(values[2].value), bool(values[3].value)

    def clock_event_reasons(self, index: int) -> int:
        value = ctypes.c_ulonglong()
        name = "nvmlDeviceGetCurrentClocksEventReasons"
        if not hasattr(self.lib, name):  # drivers before 535
            name = "nvmlDeviceGetCurrentClocksThrottleReasons"
        self._call(name, self._handle(index), ctypes.byref(value))
        return value.value

    def pcie(self, index: int) -> tuple[int, int, int, int]:
        """(link width, its maximum, link generation, its maximum)."""
        return (
            self._uint("nvmlDeviceGetCurrPcieLinkWidth", index),
            self._uint("nvmlDeviceGetMaxPcieLinkWidth", index),
            self._uint("nvmlDeviceGetCurrPcieLinkGeneration", index),
            self._uint("nvmlDeviceGetMaxPcieLinkGeneration", index),
        )

    def xid_events(self, timeout_ms: int) -> list[tuple[int, int]]:
        """The Xid errors reported since the last call, as (GPU index, Xid), waiting up to `timeout_ms` for
        the first (registered on the first call: only the events after it are seen)."""
        if self.events is None:
            events = ctypes.c_void_p()
            self._call("nvmlEventSetCreate", ctypes.byref(events))
            for index in range(self.count()):
                try:
                    self._call(
                        "nvmlDeviceRegisterEvents", self._handle(index), ctypes.c_ulonglong(XID_CRITICAL), events
                    )
                except NvmlError:
                    continue  # a GPU without Xid events (NOT_SUPPORTED): the others are still watched
            self.events = events
        found: list[tuple[int, int]] = []
        while True:
            data = _EventData()
            code = self.lib.nvmlEventSetWait_v2(self.events, ctypes.byref(data), ctypes.c_uint(timeout_ms))
            if code == TIMEOUT:
                return found
            if code != 0:
                raise NvmlError(code, "nvmlEventSetWait_v2")
            handles = {h.value: i for i, h in self.handles.items()}
            found.append((handles.get(data.device, -1), int(data.eventData)))
            timeout_ms = 0

    def close(self) -> None:
        if self.events is not None:
            self.lib.nvmlEventSetFree(self.events)
            self.events = None
        self.lib.nvmlShutdown()


# ------------------------------------------------------------------------------------------ readings


def read(library) -> list[GpuReading]:
    """Every GPU of `library` (`Library` or a fake with its methods), each figure it cannot give left None."""
    return [_reading(library, i) for i in range(library.count())]


def _reading(library, index: int) -> GpuReading:
    found = GpuReading(index, _known(lambda: library.name(index)) or "")
    found.bus_id = _known(lambda: library.bus_id(index)) or ""
    found.util_pct = _known(lambda: library.utilization_pct(index))
    memory = _known(lambda: library.memory_bytes(index))
    if memory is not None:
        found.mem_used_gib, found.mem_total_gib = round(memory[0] / 2**30, 3), round(memory[1] / 2**30, 3)
    found.temp_c = _known(lambda: library.temperature_c(index))
    power = _known(lambda: library.power_mw(index))
    found.power_w = None if power is None else power / 1000.0
    found.sm_clock_mhz = _known(lambda: library.clock_mhz(index, SM))
    found.sm_max_clock_mhz = _known(lambda: library.clock_mhz(index, SM, maximum=True))
    found.mem_clock_mhz = _known(lambda: library.clock_mhz(index, MEM))
    found.ecc_corrected = _known(lambda: library.ecc_errors(index, uncorrected=False, aggregate=False))
    found.ecc_uncorrected = _known(lambda: library.ecc_errors(index, uncorrected=True, aggregate=False))
    found.ecc_aggregate_uncorrected = _known(lambda: library.ecc_errors(index, uncorrected=True, aggregate=True))
    retired = _known(lambda: library.retired_pages(index))
    if retired is not None:
        found.retired_pages, found.retired_pending = retired
    remapped = _known(lambda: library.remapped_rows(index))
    if remapped is not None:
        found.remapped_pending, found.remapped_failure = remapped
    reasons = _known(lambda: library.clock_event_reasons(index)) or 0
    found.clock_event_reasons = [name for bit, name in CLOCK_REASONS.items() if reasons & bit]
    pcie = _known(lambda: library.pcie(index))
    if pcie is not None:
        found.pcie_width, found.pcie_max_width, found.pcie_gen, found.pcie_max_gen = pcie
    return found


def _known(read_one):
    try:
        return read_one()
    except NvmlError:
        return None


def read_gpus() -> list[GpuReading]:
    """Every GPU of this node, read once through NVML; [] without a driver."""
    library = Library.load()
    if library is None:
        return []
    try:
        return read(library)
    finally:
        library.close()


def preflight_gpus() -> list[dict] | None:
    """The preflight's GPU facts through NVML, in `fitness.nvidia_smi_gpus`'s keys; None where NVML does
    not load (the preflight asks nvidia-smi then)."""
    library = Library.load()
    if library is None:
        return None
    try:
        return [reading.preflight() for reading in read(library)]
    finally:
        library.close()


# ------------------------------------------------------------------------------------------ the sampler


class Sampler:
    """Every GPU read each `interval_s`, each reading handed to `sink` as a `gpu` record (with this node's
    name, the time and the Xid events seen since the last reading), until stopped. No thread where NVML
    does not load. `library` is for the tests (a fake); by default the node's own NVML."""

    def __init__(self, sink, node: str, interval_s: float = SAMPLE_S, library=None):
        self.sink, self.node, self.interval_s = sink, node, interval_s
        self.library = library
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "Sampler":
        if self.library is None:
            self.library = Library.load()
        if self.library is not None and self.library.count() > 0:
            self.thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=self.interval_s + 2)
        if isinstance(self.library, Library):
            self.library.close()

    def _run(self) -> None:
        xids: dict[int, int] = {}
        while not self.stopping.is_set():
            try:
                self.once(xids)
            except Exception as exc:  # a reading's failure never ends a run: said once, then quiet
                self.sink({"kind": "gpu_error", "time": time.time(), "node": self.node, "error": str(exc)})
                return
            self.stopping.wait(self.interval_s)

    def once(self, xids: dict[int, int]) -> None:
        """One reading of every GPU, with the Xid events since the last (`xids`: each GPU's count so far)."""
        for index, xid in _known(lambda: self.library.xid_events(0)) or []:
            xids[index] = xids.get(index, 0) + 1
            self.sink({"kind": "xid", "time": time.time(), "node": self.node, "index": index, "xid": xid})
        for reading in read(self.library):
            record = {"kind": "gpu", "time": time.time(), "node": self.node, **reading.sample()}
            self.sink({**record, "xid_events": xids.get(reading.index, 0)})


def file_sink(path: str):
    """A sink that appends each record to `path` as a JSON line."""
    lock = threading.Lock()

    def write(record: dict) -> None:
        with lock, open(path, "a") as out:
            out.write(json.dumps(record) + "\n")

    return write


def run_sampler(node: str) -> Sampler:
    """The sampler of a run on this node: into the run folder's `gpu-<node>.jsonl` (`$CLUSTER_RUN_DIR`;
    no run folder: no sink)."""
    from node import contract, gpu_samples

    folder = os.environ.get("CLUSTER_RUN_DIR")
    sink = (
        gpu_samples.SampleFile(os.path.join(folder, contract.gpu_samples(node)), contract.GPU_SAMPLES_MAX_BYTES)
        if folder
        else (lambda record: None)
    )
    return Sampler(sink, node)
