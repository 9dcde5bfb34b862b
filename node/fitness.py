"""A node's fitness for a job (`fab preflight`): what each node reports, and the verdict rules.

The checks run as one torchrun job, one process per node (harness/fitness.py); this module is their
standard-library half, so that the node and the operator read the same rules:

- per node: matmul throughput (each round's kept), the CPUs its cgroup's quota lets it use, memory, free
  disk; on GPU nodes NVML (node/nvml.py; `nvidia-smi -q -x` where
  NVML does not load): ECC errors, retired pages, remapped rows, clock-event (throttle) reasons, PCIe width,
  clocks; `dcgmi diag -r 1 -j` where DCGM is installed, and NVIDIA's Xid lines in the kernel log;
- across nodes: a pairwise all-reduce bandwidth matrix and each node's clock against the head node's.

`judge` turns one report into a verdict per node, OK, WARN or CRITICAL, each with its reasons; every
threshold is a constant below (README "fab preflight" lists them).
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field

OK, WARN, CRITICAL = "OK", "WARN", "CRITICAL"
LEVELS = (OK, WARN, CRITICAL)

SLOW_FRACTION = 0.8
"""A node whose compute, or whose pairs' bandwidth, is under this fraction of the other nodes' (pairs')
median is named."""
VERY_SLOW_FRACTION = 0.5
"""Under this fraction it is CRITICAL: a node at half speed halves the whole job (every step waits for it)."""
SHARED_SLOW_FRACTION, SHARED_VERY_SLOW_FRACTION = 0.5, 0.25
"""The same, where nodes share one machine (the local provider: one boot id): each measures while the
machine's other work takes its cores, so a healthy node read 43 to 53% of its neighbour on a busy 2-core
machine. A node throttled by a CPU quota is refused whatever the load by its quota (`cpu_allowance`)."""
MIN_FREE_DISK_GB = 1.0
"""CRITICAL under this: checkpoints and logs fail to write."""
LOW_FREE_DISK_GB = 5.0
"""WARN under this."""
MIN_AVAILABLE_MEMORY_GB = 1.0
"""CRITICAL under this much available memory: the job's first allocation may be killed."""
CLOCK_SKEW_WARN_S = 1.0
"""WARN past this: logs and timelines of two nodes no longer line up."""
CLOCK_SKEW_CRITICAL_S = 300.0
"""CRITICAL past this: munge credentials (Slurm's) expire after 300 s (munged --ttl default)."""
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
"""Xids that mean the GPU must be reset or replaced (NVIDIA's Xid catalog:
https://docs.nvidia.com/deploy/xid-errors/index.html); any other Xid is WARN."""
THROTTLE_REASONS = {
    "hw_slowdown": "hardware slowdown",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "power brake",
    "sw_thermal_slowdown": "software thermal slowdown",
}
"""Clock-event reasons that slow a GPU down against its will (WARN); idle, application clocks, the power
cap and sync boost are how a healthy GPU runs."""
REPORT_MARKER = "__gpu_cluster_fitness__ "
"""Rank 0 prints the whole report on one line after this marker; fab reads it from the head node's log."""


# ------------------------------------------------------------------------------- what a node reports


def memory_facts(meminfo: str) -> dict:
    """Total and available memory (GB) from /proc/meminfo's text."""
    values = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            values[name] = int(words[0]) * 1024
    return {
        "memory_total_gb": round(values.get("MemTotal", 0) / 1e9, 2),
        "memory_available_gb": round(values.get("MemAvailable", values.get("MemFree", 0)) / 1e9, 2),
    }


def host_facts(home: str) -> dict:
    """Memory and free disk (of the home's filesystem, where runs, envs and checkpoints go) on this host."""
    try:
        with open("/proc/meminfo") as f:
            facts = memory_facts(f.read())
    except OSError:
        facts = {}
    facts["disk_free_gb"] = round(shutil.disk_usage(home).free / 1e9, 2)
    return facts


def cpu_allowance(cgroups: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> dict:
    """The CPUs this process may use: `cpus` (the affinity mask's count, less where a cgroup's CPU quota is
    smaller) and `cpu_quota` (the smallest quota of its cgroup and the cgroup's ancestors in CPUs, v1's
    cpu.cfs_quota_us / cpu.cfs_period_us or v2's cpu.max; None where none is set). A quota holds whatever
    load the machine has: what a container limit or a throttled node gets, read, not measured."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 1)
    quota = _cgroup_quota(cgroups, mountinfo)
    return {"cpus": round(min(cpus, quota), 3) if quota else cpus, "cpu_quota": quota}


def _cgroup_quota(cgroups: str, mountinfo: str) -> float | None:
    try:
        with open(cgroups) as f:
            memberships = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    found: list[float] = []
    for _, controllers, path in memberships:
        for fields in mounts:
            if "-" not in fields:
                continue
            kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
            v1 = kind == "cgroup" and "cpu" in options and "cpu" in controllers.split(",")
            if v1 or (kind == "cgroup2" and controllers == ""):
                found += _quotas_up(fields[4], fields[3], path, v1)
    return min(found) if found else None


def _quotas_up(mount: str, root: str, path: str, v1: bool) -> list[float]:
    """The quotas of the cgroup at `path` and of each ancestor under the mount (`root`: the mount's own
    place in the hierarchy)."""
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    folder = os.path.normpath(os.path.join(mount, relative))
    found = []
    while folder.startswith(mount):
        try:
            if v1:
                with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                    quota = int(f.read())
                with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                    period = int(f.read())
            else:
                with open(os.path.join(folder, "cpu.max")) as f:
                    limit, _, rest = f.read().partition(" ")
                quota, period = (-1 if limit == "max" else int(limit)), int(rest or 100000)
        except (OSError, ValueError):
            quota, period = -1, 1
        if quota > 0 and period > 0:
            found.append(quota / period)
        if folder == mount:
            break
        folder = os.path.dirname(folder)
    return found


def gpu_facts(timeout_s: float = 60.0) -> dict:
    """What NVML (node/nvml.py; `nvidia-smi -q -x` where NVML does not load), dcgmi and the kernel log say,
    where they exist. `{}` on a host with neither NVML nor nvidia-smi (a CPU node)."""
    from node import nvml  # ctypes and NVML load only where the GPUs are read

    gpus = nvml.preflight_gpus()
    if gpus is None and shutil.which("nvidia-smi") is None:
        return {}
    if gpus is None:
        gpus = nvidia_smi_gpus(_output(["nvidia-smi", "-q", "-x"], timeout_s))
    facts: dict = {"gpus": gpus}
    if shutil.which("dcgmi"):
        facts["dcgm"] = dcgm_results(_output(["dcgmi", "diag", "-r", "1", "-j"], timeout_s))
    facts["xids"] = xid_events(kernel_log(timeout_s))
    return facts


def kernel_log(timeout_s: float) -> str:
    """The kernel's messages: dmesg where this user may read them, else journalctl -k."""
    text = _output(["dmesg"], timeout_s)
    if not text.strip() and shutil.which("journalctl"):
        text = _output(["journalctl", "-k", "--no-pager", "-q"], timeout_s)
    return text


def _output(argv: list, timeout_s: float) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def nvidia_smi_gpus(xml_text: str) -> list:
    """Each GPU of `nvidia-smi -q -x`: name, bus id, ECC, retired pages, remapped rows, active clock-event
    reasons, PCIe link, clocks. Older drivers say `clocks_throttle_reasons` and `double_bit` counts;
    newer ones `clocks_event_reasons` and `dram_uncorrectable`: both are read."""
    try:
        root = ElementTree.fromstring(xml_text)
    except ElementTree.ParseError:
        return []
    return [_gpu(gpu) for gpu in root.iter("gpu")]


def _gpu(gpu) -> dict:
    reasons = gpu.find("clocks_event_reasons")
    if reasons is None:
        reasons = gpu.find("clocks_throttle_reasons")
    active = []
    for reason in list(reasons) if reasons is not None else []:
        if (reason.text or "").strip() == "Active":
            active.append(re.sub(r"^clocks?_(event|throttle)_reasons?_", "", reason.tag))
    return {
        "name": _text(gpu, "product_name"),
        "bus_id": gpu.get("id", ""),
        "ecc_volatile_uncorrectable": _count(gpu, "ecc_errors/volatile", ("dram_uncorrectable", "double_bit/total")),
        "ecc_aggregate_uncorrectable": _count(gpu, "ecc_errors/aggregate", ("dram_uncorrectable", "double_bit/total")),
        "retired_pages": sum(
            _number(_text(gpu, f"retired_pages/{kind}/retired_count"))
            for kind in ("multiple_single_bit_retirement", "double_bit_retirement")
        ),
        "retired_pending": _text(gpu, "retired_pages/pending_retirement") == "Yes"
        or _text(gpu, "retired_pages/pending_blacklist") == "Yes",
        "remapped_pending": _text(gpu, "remapped_rows/remapped_row_pending") == "Yes",
        "remapped_failure": _text(gpu, "remapped_rows/remapped_row_failure") == "Yes",
        "clock_event_reasons": active,
        "pcie_width": _number(_text(gpu, "pci/pci_gpu_link_info/link_widths/current_link_width")),
        "pcie_max_width": _number(_text(gpu, "pci/pci_gpu_link_info/link_widths/max_link_width")),
        "pcie_gen": _number(_text(gpu, "pci/pci_gpu_link_info/pcie_gen/current_link_gen")),
        "pcie_max_gen": _number(_text(gpu, "pci/pci_gpu_link_info/pcie_gen/max_link_gen")),
        "sm_clock_mhz": _number(_text(gpu, "clocks/sm_clock")),
        "sm_max_clock_mhz": _number(_text(gpu, "max_clocks/sm_clock")),
    }


def _text(element, path: str) -> str:
    found = element.find(path)
    return (found.text or "").strip() if found is not None else ""


def _number(text: str) -> int:
    match = re.match(r"\d+", text or "")
    return int(match.group()) if match else 0


def _count(gpu, folder: str, names: tuple) -> int:
    for name in names:
        if gpu.find(f"{folder}/{name}") is not None:
            return _number(_text(gpu, f"{folder}/{name}"))
    return 0


def dcgm_results(json_text: str) -> list:
    """Each test result of `dcgmi diag -j` (DCGM 3 and 4 shapes): test, GPU, status, what it said."""
    try:
        data = json.loads(json_text)
    except ValueError:
        return []
    found = []
    for test in _tests_in(data):
        for result in test.get("results") or []:
            said = result.get("warnings") or result.get("info") or ""
            if isinstance(said, list):
                said = "; ".join(w.get("warning", str(w)) if isinstance(w, dict) else str(w) for w in said)
            found.append(
                {
                    "test": str(test.get("name", "")),
                    "gpu": str(result.get("gpu_id", result.get("entity_id", ""))),
                    "status": str(result.get("status", "")),
                    "said": str(said),
                }
            )
    return found


def _tests_in(data) -> list:
    if isinstance(data, dict):
        if isinstance(data.get("tests"), list):
            return [t for t in data["tests"] if isinstance(t, dict)]
        return [t for value in data.values() for t in _tests_in(value)]
    if isinstance(data, list):
        return [t for value in data for t in _tests_in(value)]
    return []


XID_LINE = re.compile(r"NVRM: Xid \((?P<device>[^)]*)\): (?P<xid>\d+)(?:, (?P<rest>.*))?")


def xid_events(log: str) -> list:
    """NVIDIA's Xid lines of a kernel log: {xid, device, line}."""
    events = []
    for line in log.splitlines():
        match = XID_LINE.search(line)
        if match:
            events.append({"xid": int(match["xid"]), "device": match["device"], "line": line.strip()[-240:]})
    return events


# ------------------------------------------------------------------------------------- the schedule


def pair_rounds(count: int) -> list:
    """Every pair of `count` nodes, in rounds of disjoint pairs (the circle method): a round's pairs
    run at once, and no node is in two of them, so each pair is measured alone on its links."""
    bye = -1  # an odd count sits one node out of each round
    players = list(range(count)) + ([bye] if count % 2 else [])
    rounds = []
    for _ in range(len(players) - 1):
        pairs = [(players[i], players[-1 - i]) for i in range(len(players) // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if bye not in p])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


# -------------------------------------------------------------------------------------- the verdicts


@dataclass
class Verdict:
    """One node's verdict: its level and each reason (worst first)."""

    node: str
    level: str = OK
    reasons: list = field(default_factory=list)

    def add(self, level: str, reason: str) -> None:
        self.reasons.append((level, reason))
        if LEVELS.index(level) > LEVELS.index(self.level):
            self.level = level

    def why(self) -> str:
        ordered = sorted(self.reasons, key=lambda r: -LEVELS.index(r[0]))
        return "; ".join(reason for level, reason in ordered if level != OK) or "healthy"

    def as_dict(self) -> dict:
        return {"node": self.node, "verdict": self.level, "why": self.why()}


def judge(report: dict) -> dict:
    """{node: Verdict} for a report shaped as harness/fitness.py writes it: {"nodes": [{node, gflops,
    memory_*, disk_free_gb, clock_offset_s, gpu: {...}}], "pairs": [{a, b, gbps}]}."""
    nodes = report.get("nodes", [])
    verdicts = {n["node"]: Verdict(n["node"]) for n in nodes}
    limits = (
        (SHARED_SLOW_FRACTION, SHARED_VERY_SLOW_FRACTION)
        if report.get("shared_machine")
        else (SLOW_FRACTION, VERY_SLOW_FRACTION)
    )
    _judge_compute(nodes, verdicts, limits)
    _judge_cpus(nodes, verdicts)
    _judge_pairs(report.get("pairs", []), verdicts, limits)
    for facts in nodes:
        verdict = verdicts[facts["node"]]
        _judge_host(facts, verdict)
        _judge_gpus(facts.get("gpu") or {}, verdict)
    return verdicts


def _judge_compute(nodes: list, verdicts: dict, limits: tuple) -> None:
    """A node under 80% of the median of the other nodes' compute is named, under 50% CRITICAL (`limits`;
    half that on one machine); the others' median: with two nodes, a median that counted the slow node
    itself would halve the difference. A measurement alone cannot refuse a throttled node on a loaded
    machine (a node held to a tenth of a core read 49% of a healthy one whose share of the machine was a
    fifth of a core): its quota is judged apart (`_judge_cpus`)."""
    slow, very_slow = limits
    rates = {n["node"]: n["gflops"] for n in nodes if n.get("gflops")}
    if len(rates) < 2:
        return
    for facts in nodes:
        median = statistics.median(rate for node, rate in rates.items() if node != facts["node"])
        share = (facts.get("gflops") or 0) / median
        if share < slow:
            level = CRITICAL if share < very_slow else WARN
            verdicts[facts["node"]].add(
                level,
                f"compute {facts.get('gflops', 0):.1f} GFLOP/s is {share:.0%} of the other nodes' median {median:.1f}",
            )


def _judge_cpus(nodes: list, verdicts: dict) -> None:
    """A node whose cgroup lets it use under 80% of the CPUs the other nodes' median may use is named,
    under 50% CRITICAL: a quota holds whatever the machine's load, so this needs no allowance for noise.
    Only a node limited by a quota is named (machines with fewer cores are the user's choice)."""
    allowed = {n["node"]: float(n["cpus"]) for n in nodes if n.get("cpus")}
    if len(allowed) < 2:
        return
    for facts in nodes:
        if not facts.get("cpu_quota") or facts["node"] not in allowed:
            continue
        median = statistics.median(c for node, c in allowed.items() if node != facts["node"])
        share = allowed[facts["node"]] / median if median else 1.0
        if share < SLOW_FRACTION:
            verdicts[facts["node"]].add(
                CRITICAL if share < VERY_SLOW_FRACTION else WARN,
                f"compute: its cgroup's CPU quota allows {allowed[facts['node']]:g} CPU, "
                f"{share:.0%} of the other nodes' median {median:g}",
            )


def _judge_pairs(pairs: list, verdicts: dict, limits: tuple) -> None:
    """A node whose pairs are slow (their median under 80% of the median of the pairs it is not in) is
    named; a pair under half the median pair whose two ends are both fast elsewhere names both ends (a
    bad link between them; a pair at 60% is within what a busy host's measurement varies)."""
    slow, very_slow = limits
    measured = [p for p in pairs if p.get("gbps") is not None]
    if len(measured) < 2:
        return
    named = set()
    for node, verdict in verdicts.items():
        own = [p["gbps"] for p in measured if node in (p["a"], p["b"])]
        others = [p["gbps"] for p in measured if node not in (p["a"], p["b"])]
        if len(own) < 2 or not others:
            continue
        reference = statistics.median(others)
        share = statistics.median(own) / reference if reference else 1.0
        if share < slow:
            named.add(node)
            level = CRITICAL if share < very_slow else WARN
            verdict.add(level, f"all-reduce bandwidth with its peers is {share:.0%} of the other pairs' median")
    median = statistics.median(p["gbps"] for p in measured)
    for pair in measured:
        share = pair["gbps"] / median if median else 1.0
        if share < very_slow and not named & {pair["a"], pair["b"]}:
            for end, other in ((pair["a"], pair["b"]), (pair["b"], pair["a"])):
                verdicts[end].add(WARN, f"pair with {other} at {share:.0%} of the median pair")


def _judge_host(facts: dict, verdict: Verdict) -> None:
    disk = facts.get("disk_free_gb")
    if disk is not None and disk < MIN_FREE_DISK_GB:
        verdict.add(CRITICAL, f"{disk:.1f} GB free disk")
    elif disk is not None and disk < LOW_FREE_DISK_GB:
        verdict.add(WARN, f"{disk:.1f} GB free disk")
    memory = facts.get("memory_available_gb")
    if memory is not None and memory < MIN_AVAILABLE_MEMORY_GB:
        verdict.add(CRITICAL, f"{memory:.1f} GB memory available")
    skew = abs(facts.get("clock_offset_s") or 0.0)
    if skew >= CLOCK_SKEW_CRITICAL_S:
        verdict.add(CRITICAL, f"clock {skew:.0f} s off the head node's")
    elif skew >= CLOCK_SKEW_WARN_S:
        verdict.add(WARN, f"clock {skew:.1f} s off the head node's")


def _judge_gpus(gpu: dict, verdict: Verdict) -> None:
    for index, card in enumerate(gpu.get("gpus") or []):
        where = f"GPU {index}"
        if card.get("ecc_volatile_uncorrectable"):
            verdict.add(CRITICAL, f"{where}: {card['ecc_volatile_uncorrectable']} uncorrectable ECC errors")
        elif card.get("ecc_aggregate_uncorrectable"):
            verdict.add(WARN, f"{where}: {card['ecc_aggregate_uncorrectable']} uncorrectable ECC errors in its life")
        if card.get("retired_pending"):
            verdict.add(CRITICAL, f"{where}: page retirement pending (reset the GPU)")
        if card.get("remapped_failure"):
            verdict.add(CRITICAL, f"{where}: row remapping failed")
        elif card.get("remapped_pending"):
            verdict.add(WARN, f"{where}: row remapping pending (reset the GPU)")
        slowed = [THROTTLE_REASONS[r] for r in card.get("clock_event_reasons", []) if r in THROTTLE_REASONS]
        if slowed:
            verdict.add(WARN, f"{where}: clocks throttled ({', '.join(slowed)})")
        if card.get("pcie_max_width") and card.get("pcie_width", 0) < card["pcie_max_width"]:
            verdict.add(WARN, f"{where}: PCIe x{card['pcie_width']} of x{card['pcie_max_width']}")
    for result in gpu.get("dcgm") or []:
        status = result["status"].lower()
        if status in ("fail", "failed"):
            verdict.add(CRITICAL, f"dcgmi diag {result['test']} failed on GPU {result['gpu']}: {result['said']}")
        elif status in ("warn", "warning"):
            verdict.add(WARN, f"dcgmi diag {result['test']} warned on GPU {result['gpu']}: {result['said']}")
    for xid in sorted({e["xid"] for e in gpu.get("xids") or []}):
        if xid in CRITICAL_XIDS:
            verdict.add(CRITICAL, f"Xid {xid} ({CRITICAL_XIDS[xid]}) in the kernel log")
        else:
            verdict.add(WARN, f"Xid {xid} in the kernel log")


def named(verdicts: dict) -> list:
    """The nodes that are not OK, worst first."""
    bad = [v for v in verdicts.values() if v.level != OK]
    return sorted(bad, key=lambda v: (-LEVELS.index(v.level), v.node))


def report_line(log_text: str) -> dict | None:
    """The report rank 0 printed, from a log that holds it (a node's prefixed output)."""
    for line in reversed(log_text.splitlines()):
        at = line.find(REPORT_MARKER)
        if at >= 0:
            try:
                return json.loads(line[at + len(REPORT_MARKER) :])
            except ValueError:
                return None
    return None
