"""infra/timeline.py: contiguous phases on one clock, summing to the wall time."""

import time

from infra.timeline import Timeline, job_phases


def test_phases_are_contiguous_and_sum_to_the_wall_time_within_five_percent():
    timeline = Timeline.since_process_start()
    time.sleep(0.05)
    timeline.mark("connect")
    time.sleep(0.1)
    timeline.mark("sync")
    timeline.close("fetch")
    ends = [timeline.started_at]
    for _, seconds in timeline.phases:
        ends.append(ends[-1] + seconds)
    assert abs(ends[-1] - timeline.at) < 1e-6 and all(s >= 0 for _, s in timeline.phases)
    assert [name for name, _ in timeline.phases] == ["startup", "connect", "sync", "fetch"]
    assert timeline.within() and abs(timeline.total_s - timeline.wall_s) <= 0.05 * timeline.wall_s
    assert timeline.phases[1][1] >= 0.05 and timeline.phases[2][1] >= 0.1


def test_another_clocks_ends_are_clamped_so_no_phase_is_negative_or_in_the_future():
    now = time.time()
    timeline = Timeline(now - 10.0, clock=time.monotonic() - 10.0)
    timeline.mark("connect")  # 10 s
    times = [{"started": now - 20.0, "group": now + 5.0}, {"started": None}]  # a clock behind, one ahead
    job_phases(timeline, times, [None, now - 30.0], queued_until=None)
    names = [name for name, _ in timeline.phases]
    assert names == ["connect", "start", "rendezvous", "training", "exit"]
    assert all(seconds >= 0 for _, seconds in timeline.phases)
    assert timeline.at <= time.time() + 1e-6 and timeline.close("fetch").within()


def test_a_wrong_wall_time_is_caught_and_the_record_reads_back():
    timeline = Timeline(time.time() - 2.0, [["a", 1.0], ["b", 1.0]], wall_s=2.5)
    assert not timeline.within()  # 2.0 against 2.5: 20 % off
    assert Timeline(0.0, [["a", 1.0]], wall_s=1.04).within()
    back = Timeline.from_dict(timeline.as_dict())
    assert back is not None and back.phases == timeline.phases and back.wall_s == 2.5
    assert timeline.line() == "timeline: a 1.0 s · b 1.0 s = 2.0 s"
    assert Timeline.from_dict({"phases": "nonsense"}) is None
