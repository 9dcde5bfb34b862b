"""A fake NVML with `node.nvml.Library`'s methods, answering from a recorded GPU: `nvidia-smi -q -x` of it
(tests/fixtures/gpu/nvidia-smi-h200.xml), each value as NVML's own call gives it (bytes, milliwatts, a
reason bitmask), and N/A as NVML's NOT_SUPPORTED. Xid events are handed in, as the kernel reported them
(tests/fixtures/gpu/kern-xid.log), and delivered once, as NVML's event set does."""

import re
import xml.etree.ElementTree as ElementTree

from node import nvml

MIB = 2**20


class FakeNvml:
    def __init__(self, xml_text: str, xids: list[tuple[int, int]] | None = None, util_pct: int | None = None):
        self.gpus = list(ElementTree.fromstring(xml_text).iter("gpu"))
        self.pending_xids = list(xids or [])
        self.util_override = util_pct
        self.closed = False

    def _value(self, index: int, path: str) -> int:
        """A number at `path` of GPU `index` ('16x', '3201 MHz', '78.99 W' read as their number)."""
        found = self.gpus[index].find(path)
        text = (found.text or "").strip() if found is not None else "N/A"
        match = re.match(r"-?\d+(\.\d+)?", text)
        if match is None:
            raise nvml.NvmlError(nvml.NOT_SUPPORTED, path)
        return float(match.group()) if match.group(1) else int(match.group())  # type: ignore[return-value]

    def _yes(self, index: int, path: str) -> bool:
        found = self.gpus[index].find(path)
        if found is None or (found.text or "").strip() == "N/A":
            raise nvml.NvmlError(nvml.NOT_SUPPORTED, path)
        return (found.text or "").strip() == "Yes"

    def count(self) -> int:
        return len(self.gpus)

    def name(self, index: int) -> str:
        return (self.gpus[index].findtext("product_name") or "").strip()

    def bus_id(self, index: int) -> str:
        return self.gpus[index].get("id", "")

    def utilization_pct(self, index: int) -> int:
        return self.util_override if self.util_override is not None else self._value(index, "utilization/gpu_util")

    def memory_bytes(self, index: int) -> tuple[int, int]:
        used, total = self._value(index, "fb_memory_usage/used"), self._value(index, "fb_memory_usage/total")
        return used * MIB, total * MIB

    def temperature_c(self, index: int) -> int:
        return self._value(index, "temperature/gpu_temp")

    def power_mw(self, index: int) -> int:
        return round(self._value(index, "gpu_power_readings/instant_power_draw") * 1000)

    def clock_mhz(self, index: int, kind: int, maximum: bool = False) -> int:
        name = {nvml.SM: "sm_clock", nvml.MEM: "mem_clock"}[kind]
        return self._value(index, f"{'max_clocks' if maximum else 'clocks'}/{name}")

    def ecc_errors(self, index: int, uncorrected: bool, aggregate: bool) -> int:
        folder = f"ecc_errors/{'aggregate' if aggregate else 'volatile'}"
        return self._value(index, f"{folder}/dram_{'uncorrectable' if uncorrected else 'correctable'}")

    def retired_pages(self, index: int) -> tuple[int, bool]:
        pages = sum(
            self._value(index, f"retired_pages/{kind}/retired_count")
            for kind in ("multiple_single_bit_retirement", "double_bit_retirement")
        )
        return pages, self._yes(index, "retired_pages/pending_retirement")

    def remapped_rows(self, index: int) -> tuple[bool, bool]:
        return self._yes(index, "remapped_rows/remapped_row_pending"), self._yes(
            index, "remapped_rows/remapped_row_failure"
        )

    def clock_event_reasons(self, index: int) -> int:
        mask = 0
        for bit, name in nvml.CLOCK_REASONS.items():
            if (
                self.gpus[index].findtext(f"clocks_event_reasons/clocks_event_reason_{name}") or ""
            ).strip() == "Active":
                mask |= bit
        return mask

    def pcie(self, index: int) -> tuple[int, int, int, int]:
        link = "pci/pci_gpu_link_info"
        return (
            self._value(index, f"{link}/link_widths/current_link_width"),
            self._value(index, f"{link}/link_widths/max_link_width"),
            self._value(index, f"{link}/pcie_gen/current_link_gen"),
            self._value(index, f"{link}/pcie_gen/max_link_gen"),
        )

    def xid_events(self, timeout_ms: int) -> list[tuple[int, int]]:
        found, self.pending_xids = self.pending_xids, []
        return found

    def close(self) -> None:
        self.closed = True


def kernel_xids(log_text: str) -> list[int]:
    """The Xid numbers of NVRM's lines in a kernel log, in order."""
    return [int(m.group(1)) for m in re.finditer(r"NVRM: Xid \([^)]*\): (\d+),", log_text)]
