"""The preflight's rules (node/fitness.py): what nvidia-smi, dcgmi and the kernel log say, read from
recorded output, and each node's verdict from a report shaped as harness/fitness.py prints it.

nvidia-smi-h200.xml is `nvidia-smi -q -x` of an idle H200 (driver 580; serial and UUID zeroed); the
sick GPUs are that record with one field changed, as a sick GPU reports it. The dcgmi files follow
`dcgmi diag -r 1 -j` (DCGM 3), the kernel logs NVRM's Xid lines.
"""

import json
from itertools import combinations
from pathlib import Path

import pytest

from node import fitness

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpu"
H200 = (FIXTURES / "nvidia-smi-h200.xml").read_text()


def gpu_verdict(gpu: dict) -> fitness.Verdict:
    report = {"nodes": [{"node": "node-0", "gpu": gpu}], "pairs": []}
    return fitness.judge(report)["node-0"]


def sick(old: str, new: str) -> str:
    assert old in H200
    return H200.replace(old, new, 1)


def test_a_healthy_h200_reads_whole_and_is_ok():
    (card,) = fitness.nvidia_smi_gpus(H200)
    assert card["name"] == "NVIDIA H200"
    assert (card["pcie_width"], card["pcie_max_width"], card["pcie_gen"], card["pcie_max_gen"]) == (16, 16, 5, 5)
    assert card["sm_max_clock_mhz"] == 1980
    assert card["clock_event_reasons"] == ["gpu_idle"]  # idle is how a healthy GPU waits
    assert card["ecc_volatile_uncorrectable"] == 0 and not card["remapped_pending"]
    assert gpu_verdict({"gpus": [card]}).level == fitness.OK


@pytest.mark.parametrize(
    "old, new, level, said",
    [
        (
            "<dram_uncorrectable>0</dram_uncorrectable>",
            "<dram_uncorrectable>2</dram_uncorrectable>",
            fitness.CRITICAL,
            "2 uncorrectable ECC errors",
        ),
        (
            "<remapped_row_pending>No</remapped_row_pending>",
            "<remapped_row_pending>Yes</remapped_row_pending>",
            fitness.WARN,
            "row remapping pending",
        ),
        (
            "<remapped_row_failure>No</remapped_row_failure>",
            "<remapped_row_failure>Yes</remapped_row_failure>",
            fitness.CRITICAL,
            "row remapping failed",
        ),
        (
            "<clocks_event_reason_hw_thermal_slowdown>Not Active</clocks_event_reason_hw_thermal_slowdown>",
            "<clocks_event_reason_hw_thermal_slowdown>Active</clocks_event_reason_hw_thermal_slowdown>",
            fitness.WARN,
            "clocks throttled (hardware thermal slowdown)",
        ),
        (
            "<current_link_width>16x</current_link_width>",
            "<current_link_width>8x</current_link_width>",
            fitness.WARN,
            "PCIe x8 of x16",
        ),
    ],
)
def test_a_sick_gpu_is_named_with_what_nvidia_smi_says(old, new, level, said):
    verdict = gpu_verdict({"gpus": fitness.nvidia_smi_gpus(sick(old, new))})
    assert verdict.level == level
    assert said in verdict.why()


def test_the_power_cap_is_no_throttle_to_warn_of():
    text = sick(
        "<clocks_event_reason_sw_power_cap>Not Active</clocks_event_reason_sw_power_cap>",
        "<clocks_event_reason_sw_power_cap>Active</clocks_event_reason_sw_power_cap>",
    )
    assert gpu_verdict({"gpus": fitness.nvidia_smi_gpus(text)}).level == fitness.OK


def test_an_older_driver_says_throttle_and_double_bit():
    text = (
        "<nvidia_smi_log><gpu id='00000000:3B:00.0'><product_name>Tesla V100-SXM2-16GB</product_name>"
        "<clocks_throttle_reasons><clocks_throttle_reason_hw_slowdown>Active</clocks_throttle_reason_hw_slowdown>"
        "</clocks_throttle_reasons><ecc_errors><volatile><double_bit><total>3</total></double_bit></volatile>"
        "</ecc_errors><retired_pages><pending_retirement>Yes</pending_retirement></retired_pages></gpu>"
        "</nvidia_smi_log>"
    )
    verdict = gpu_verdict({"gpus": fitness.nvidia_smi_gpus(text)})
    assert verdict.level == fitness.CRITICAL
    assert "3 uncorrectable ECC errors" in verdict.why()
    assert "page retirement pending" in verdict.why()
    assert "hardware slowdown" in verdict.why()


def test_a_dcgm_failure_is_critical_and_its_warning_named():
    results = fitness.dcgm_results((FIXTURES / "dcgmi-diag-r1-fail.json").read_text())
    verdict = gpu_verdict({"dcgm": results})
    assert verdict.level == fitness.CRITICAL
    assert "dcgmi diag Page Retirement/Row Remap failed on GPU 1: GPU 1 had uncorrectable" in verdict.why()
    assert "Persistence Mode warned on GPU 0" in verdict.why()
    passed = fitness.dcgm_results((FIXTURES / "dcgmi-diag-r1-pass.json").read_text())
    assert passed and gpu_verdict({"dcgm": passed}).level == fitness.OK


def test_xid_48_79_94_are_critical_and_another_xid_a_warning():
    events = fitness.xid_events((FIXTURES / "kern-xid.log").read_text())
    assert [e["xid"] for e in events] == [13, 48, 79, 94]
    assert events[2]["device"] == "PCI:0000:86:00"
    verdict = gpu_verdict({"xids": events})
    assert verdict.level == fitness.CRITICAL
    for said in ("Xid 48 (double-bit ECC error)", "Xid 79 (GPU has fallen off the bus)", "Xid 94 (contained"):
        assert said in verdict.why()
    assert ("WARN", "Xid 13 in the kernel log") in verdict.reasons
    assert fitness.xid_events((FIXTURES / "kern-clean.log").read_text()) == []


def node(name: str, gflops: float = 30.0, **facts) -> dict:
    return {"node": name, "gflops": gflops, "memory_available_gb": 20.0, "disk_free_gb": 80.0, **facts}


def test_a_node_under_80_percent_of_the_median_compute_is_named_and_under_half_critical():
    rates = {"node-0": 30, "node-1": 22, "node-2": 31, "node-3": 9, "node-4": 26}  # node-1's others: 28
    verdicts = fitness.judge({"nodes": [node(name, rate) for name, rate in rates.items()]})
    assert verdicts["node-0"].level == verdicts["node-2"].level == verdicts["node-4"].level == fitness.OK
    assert verdicts["node-1"].level == fitness.WARN
    assert verdicts["node-1"].why() == "compute 22.0 GFLOP/s is 79% of the other nodes' median 28.0"
    rates["node-1"] = 23  # 82%
    assert fitness.judge({"nodes": [node(n, r) for n, r in rates.items()]})["node-1"].level == fitness.OK
    assert verdicts["node-3"].level == fitness.CRITICAL
    assert [v.node for v in fitness.named(verdicts)] == ["node-3", "node-1"]


def test_nodes_sharing_one_machine_are_judged_against_its_noise_and_a_throttled_one_still_critical():
    """On one machine (the local provider) a healthy node read 43% of its neighbour under load: not named
    there, where separate machines would be CRITICAL; a node throttled to a tenth reads under 10%."""
    noisy = {"nodes": [node("node-0", 7.3), node("node-1", 17.2)]}
    assert fitness.judge(noisy)["node-0"].level == fitness.CRITICAL
    assert fitness.judge({**noisy, "shared_machine": True})["node-0"].level == fitness.WARN  # 42%: said, not refused
    assert (
        fitness.judge({"nodes": [node("node-0", 9.0), node("node-1", 17.2)], "shared_machine": True})["node-0"].level
        == fitness.OK
    )  # 52%
    throttled = {"nodes": [node("node-0", 1.5), node("node-1", 17.2)], "shared_machine": True}
    assert fitness.judge(throttled)["node-0"].level == fitness.CRITICAL


def test_a_node_held_to_a_tenth_of_a_core_is_refused_on_a_busy_machine_where_its_speed_passed():
    """Recorded by tests/integration/test_fitness.py on a 2-core machine at load 8: node-1 held to a tenth
    of a core read 49% of node-0 (whose share of the machine was about a fifth of a core), which the
    shared-machine limits passed (WARN, exit 0); its quota, read on the node, refuses it."""
    report = json.loads((FIXTURES.parent / "preflight" / "tenth-of-a-core-on-a-busy-machine.json").read_text())
    verdicts = fitness.judge(report)
    assert verdicts["node-1"].level == fitness.CRITICAL and verdicts["node-0"].level == fitness.OK
    assert verdicts["node-1"].why().startswith("compute: its cgroup's CPU quota allows 0.1 CPU, 5% of the other")
    measured_only = {**report, "nodes": [{k: v for k, v in n.items() if k != "cpu_quota"} for n in report["nodes"]]}
    assert fitness.judge(measured_only)["node-1"].level == fitness.WARN  # before: said, and passed


def test_on_a_quiet_machine_the_tenth_of_a_core_is_refused_by_its_speed_and_its_quota_alike():
    quiet = {"nodes": [node("node-0", 17.2, cpus=2.0), node("node-1", 1.5, cpus=0.1, cpu_quota=0.1)]}
    for report in (quiet, {**quiet, "shared_machine": True}):
        verdict = fitness.judge(report)["node-1"]
        assert verdict.level == fitness.CRITICAL
        assert [level for level, _ in verdict.reasons] == [fitness.CRITICAL, fitness.CRITICAL]


def test_equal_quotas_and_fewer_cores_without_a_quota_name_nobody():
    containers = [node(f"node-{i}", cpus=4.0, cpu_quota=4.0) for i in range(3)]
    assert fitness.named(fitness.judge({"nodes": containers})) == []
    smaller = [node("node-0", cpus=16.0), node("node-1", cpus=16.0), node("node-2", cpus=4.0)]
    assert fitness.named(fitness.judge({"nodes": smaller})) == []
    halved = [*containers[:2], node("node-2", cpus=2.5, cpu_quota=2.5)]
    assert fitness.judge({"nodes": halved})["node-2"].level == fitness.WARN  # 62% of the others' 4


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroups_cpu_quota_is_read_from_the_group_or_an_ancestor(tmp_path, version):
    """/proc/self/cgroup and mountinfo as the kernel writes them, over a cgroup tree on disk: the smallest
    quota on the way up from the process's group counts (a parent's limit holds its children)."""
    mount = tmp_path / "cgroup"
    leaf = mount / "nodes" / "node-1"
    leaf.mkdir(parents=True)
    if version == "v1":
        for folder, quota in ((mount, "-1"), (mount / "nodes", "5000"), (leaf, "-1")):
            (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
            (folder / "cpu.cfs_period_us").write_text("50000\n")
        cgroup = "12:cpu,cpuacct:/nodes/node-1\n4:memory:/nodes\n"
        kind, options = "cgroup", "rw,cpu,cpuacct"
    else:
        (mount / "nodes" / "cpu.max").write_text("max 100000\n")
        (leaf / "cpu.max").write_text("10000 100000\n")
        cgroup, kind, options = "0::/nodes/node-1\n", "cgroup2", "rw,nsdelegate"
    (tmp_path / "cgroup.txt").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(
        f"22 21 0:20 / /proc rw - proc proc rw\n35 24 0:30 / {mount} rw,nosuid shared:9 - {kind} cgroup {options}\n"
    )
    found = fitness.cpu_allowance(str(tmp_path / "cgroup.txt"), str(tmp_path / "mountinfo"))
    assert found["cpu_quota"] == 0.1 and found["cpus"] == 0.1
    (tmp_path / "cgroup.txt").write_text("0::/\n1:cpu:/\n")
    assert fitness.cpu_allowance(str(tmp_path / "cgroup.txt"), str(tmp_path / "mountinfo"))["cpu_quota"] is None


def test_two_nodes_one_throttled_names_the_throttled_one_only():
    verdicts = fitness.judge({"nodes": [node("node-0", 30), node("node-1", 13)]})
    assert verdicts["node-0"].level == fitness.OK
    assert verdicts["node-1"].level == fitness.CRITICAL  # 43% of node-0 (of the two's median, it would be 61%)


def pairs_with(slow: set, count: int = 4, fast: float = 1.0, slow_gbps: float = 0.3) -> list:
    names = [f"node-{i}" for i in range(count)]
    return [
        {"a": a, "b": b, "gbps": slow_gbps if ({a, b} & slow if len(slow) == 1 else {a, b} == slow) else fast}
        for a, b in combinations(names, 2)
    ]


@pytest.mark.parametrize("count", [3, 4, 16])
def test_a_node_slow_with_every_peer_is_named_not_its_peers(count):
    report = {"nodes": [node(f"node-{i}") for i in range(count)], "pairs": pairs_with({"node-2"}, count)}
    verdicts = fitness.judge(report)
    assert [v.node for v in fitness.named(verdicts)] == ["node-2"]
    assert "bandwidth with its peers is 30% of the other pairs' median" in verdicts["node-2"].why()


def test_one_slow_link_names_both_its_ends_and_a_noisy_one_nobody():
    report = {"nodes": [node(f"node-{i}") for i in range(4)], "pairs": pairs_with({"node-0", "node-3"})}
    verdicts = fitness.judge(report)
    assert {v.node: v.level for v in fitness.named(verdicts)} == {"node-0": fitness.WARN, "node-3": fitness.WARN}
    assert "pair with node-3 at 30% of the median pair" in verdicts["node-0"].why()
    noisy = {**report, "pairs": pairs_with({"node-0", "node-3"}, slow_gbps=0.6)}
    assert fitness.named(fitness.judge(noisy)) == []


@pytest.mark.parametrize(
    "facts, level, said",
    [
        ({"disk_free_gb": 0.4}, fitness.CRITICAL, "0.4 GB free disk"),
        ({"disk_free_gb": 3.0}, fitness.WARN, "3.0 GB free disk"),
        ({"memory_available_gb": 0.5}, fitness.CRITICAL, "0.5 GB memory available"),
        ({"clock_offset_s": -2.5}, fitness.WARN, "clock 2.5 s off the head node's"),
        ({"clock_offset_s": 400.0}, fitness.CRITICAL, "clock 400 s off"),
        ({"clock_offset_s": 0.02}, fitness.OK, "healthy"),
    ],
)
def test_host_limits(facts, level, said):
    verdict = fitness.judge({"nodes": [node("node-0", **facts)]})["node-0"]
    assert verdict.level == level and said in verdict.why()


def test_meminfo_is_read_in_gigabytes():
    facts = fitness.memory_facts("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   16000000 kB\n")
    assert facts == {"memory_total_gb": 32.77, "memory_available_gb": 16.38}


@pytest.mark.parametrize("count", [2, 3, 4, 7, 16])
def test_pair_rounds_measure_every_pair_once_and_no_node_twice_in_a_round(count):
    rounds = fitness.pair_rounds(count)
    every = [pair for pairs in rounds for pair in pairs]
    assert sorted(every) == list(combinations(range(count), 2))
    for pairs in rounds:
        ends = [end for pair in pairs for end in pair]
        assert len(ends) == len(set(ends))
    assert len(rounds) == count - (count % 2 == 0)


def test_the_report_is_found_in_a_prefixed_log():
    log = 'hello\n[node-0] [rank0]: __gpu_cluster_fitness__ {"nodes": [], "pairs": []}\n[node-0] bye\n'
    assert fitness.report_line(log) == {"nodes": [], "pairs": []}
    assert fitness.report_line("nothing here\n") is None
