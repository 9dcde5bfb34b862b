"""Spot recovery (issue 19) on a 2-node `up --local --spot` cluster under Slurm, with the course's
ddp_training: a drilled notice on node-1, then node-1 killed without notice.

Requirements (the issue's goals; Ray Train on two loopback nodes, measured here before: 5 steps lost,
32.9 s from the kill to the resumed step):
- steps trained twice after a notice: 0 (the step the ranks saved at is the step they resume from);
- notice posted to checkpoint saved: at most 15 s;
- node reclaimed to the first step trained after the resume: at most 60 s;
- node death without notice: steps redone at most the checkpoint interval; death to the first resumed
  step at most 90 s.
The notice is 20 s here (EC2 gives 120 s): the recovery after the reclaim is the same either way.
Times are read by polling the run's log every 0.1 s (the figures are that much late at most).
"""

import calendar
import json
import os
import re
import signal
import time
from pathlib import Path

from bench.common import Check, deploy, fab, scratch_env, without_slurm

NOTICE_S = 20
CHECKPOINT_EVERY = 200
LOG_EVERY = 10
STEP = re.compile(r"^\[node-0\]\s+(\d+)\s+\d", re.M)
PREEMPTED = re.compile(r"\[node-0\] preempted \(SIGUSR1\) at step (\d+)")
RESUMED = re.compile(r"\[node-0\] resuming from step (\d+) \(.*; restart (\d+)\)")


class Log:
    def __init__(self, path: Path):
        self.path = path

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def wait(self, pattern: re.Pattern, after: str = "", timeout_s: float = 300) -> tuple[re.Match, float]:
        """The first match after the text `after`, and when it was seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.text()
            match = pattern.search(text, text.find(after) + len(after) if after else 0)
            if match:
                return match, time.time()
            time.sleep(0.1)
        raise RuntimeError(f"not seen within {timeout_s:.0f} s: {pattern.pattern}\n{self.text()[-2000:]}")


def run() -> list[Check]:
    from tests.support import slurm

    if without_slurm():
        return []
    env = scratch_env()
    state = Path(env["CLUSTER_STATE_DIR"])
    deploy("up", "--local", "--spot", "--nodes", "2", "--bind", "127.0.204.10", "--ssh-port", "2452", env=env)
    try:
        fab("bootstrap", "--scheduler", "slurm", "--master-port", str(slurm.free_ports()), env=env)
        args = f"--steps 100000000 --checkpoint-every {CHECKPOINT_EVERY} --log-every {LOG_EVERY}"
        run_id = fab("run-ddp", "--args", args, "--detach", env=env).stdout.strip().splitlines()[-1]
        log = Log(state / "local" / "shared" / "runs" / run_id / "output.log")
        log.wait(STEP)

        posted = time.time()
        deploy("drill", "spot", "node-1", "--notice", str(NOTICE_S), env=env)
        checkpoint = state / "local" / "shared" / "runs" / run_id / "checkpoints" / "latest.pt"
        saved_line, _ = log.wait(PREEMPTED)
        saved_step, saved_at = int(saved_line.group(1)), checkpoint.stat().st_mtime
        notice = json.loads((state / "local" / "notices" / "node-1.json").read_text())
        reclaimed = calendar.timegm(time.strptime(notice["time"], "%Y-%m-%dT%H:%M:%SZ"))
        resumed, _ = log.wait(RESUMED)
        first_step, first_at = log.wait(STEP, after=resumed.group(0))
        twice = saved_step - int(resumed.group(1))

        pid_file = state / "local" / "nodes" / "node-1" / "sshd.pid"
        text = log.text()
        before = [int(s) for s in STEP.findall(text[text.find(resumed.group(0)) :])]
        killed = time.time()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        again, _ = log.wait(RESUMED, after=first_step.group(0))
        after_death, after_death_at = log.wait(STEP, after=again.group(0))
        text = log.text()
        span = text[text.find(first_step.group(0)) : text.find(again.group(0))]
        last_before_death = max([*before, *(int(s) for s in STEP.findall(span))])
        redone = last_before_death - int(again.group(1))
        fab("stop", "--run", run_id, env=env, check=False)
        cost = json.loads(deploy("cost", "--json", env=env).stdout)
    finally:
        deploy("down", "--stack", "local", env=env, check=False)

    notice_to_saved = saved_at - posted
    reclaim_to_step = first_at - reclaimed
    death_to_step = after_death_at - killed
    print(f"notice posted; checkpoint of step {saved_step} saved {notice_to_saved:.1f} s later")
    print(f"reclaimed; resumed from step {resumed.group(1)}; first step trained {reclaim_to_step:.1f} s after")
    print(
        f"killed at step <= {last_before_death}; resumed from step {again.group(1)} ({redone} redone, <= "
        f"{LOG_EVERY} more unseen); first step {death_to_step:.1f} s after the kill"
    )
    print(f"ledger: {[(e['node'], e['kind'], e['seconds']) for e in cost['events']]}")
    return [
        Check("steps trained twice after a notice", str(twice), "0", twice == 0),
        Check("notice to checkpoint saved", f"{notice_to_saved:.1f} s", "<= 15 s", notice_to_saved <= 15),
        Check("reclaimed to first resumed step", f"{reclaim_to_step:.1f} s", "<= 60 s", reclaim_to_step <= 60),
        Check(
            "steps redone after a death without notice",
            f"{redone} (checkpoint every {CHECKPOINT_EVERY})",
            f"<= {CHECKPOINT_EVERY}",
            0 <= redone <= CHECKPOINT_EVERY,
        ),
        Check("death to first resumed step", f"{death_to_step:.1f} s", "<= 90 s", death_to_step <= 90),
    ]
