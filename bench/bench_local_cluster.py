"""Local provider: 2 nodes from `up` to all-SSH-ready, and `down`, on this machine.

Requirement (issue 2): up under 3 s and down under 1 s on a 2-core machine. Each figure is the median
of 5 cycles of the real `python deploy.py up --local --nodes 2` / `down`, wall clock, CLI start included.
"""

import time

from bench.common import Check, deploy, median, scratch_env

CYCLES = 5


def run() -> list[Check]:
    env = scratch_env()
    up_s, down_s = [], []
    for _ in range(CYCLES):
        started = time.perf_counter()
        deploy("up", "--local", "--nodes", "2", "--bind", "127.0.200.10", "--ssh-port", "2322", env=env)
        up_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        deploy("down", "--stack", "local", env=env)
        down_s.append(time.perf_counter() - started)
    print(f"up   (s): {' '.join(f'{t:.2f}' for t in up_s)}")
    print(f"down (s): {' '.join(f'{t:.2f}' for t in down_s)}")
    return [
        Check("2-node up to all-SSH-ready", f"{median(up_s):.2f} s", "< 3 s", median(up_s) < 3.0),
        Check("2-node down", f"{median(down_s):.2f} s", "< 1 s", median(down_s) < 1.0),
    ]
