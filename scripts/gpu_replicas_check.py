"""`ddp_training --replicas 2` on one CUDA GPU, without fab: two replica groups (one rank each, both on
cuda:0, their cross-group all-reduce on torchft's gloo group, as on the cluster), the Lighthouse in this
process as node/torchrun.py serves it, group 1 killed (SIGKILL) mid-run and started again, as
remote/heal.py does. Prints the kill's figures (bench/bench_ft.py's goals) and exits 1 where one is missed.

    python scripts/gpu_replicas_check.py [--steps 3000] [--kill-at 300] [--out DIR]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node import contract, procfs  # noqa: E402
from node.torchrun import LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS, LIGHTHOUSE_JOIN_TIMEOUT_MS  # noqa: E402


def group(index: int, folder: Path, steps: int, lighthouse: str, restarted: bool) -> subprocess.Popen:
    env = {
        **os.environ,
        contract.LIGHTHOUSE_VARIABLE: lighthouse,
        contract.REPLICA_VARIABLE: str(index),
        contract.REPLICAS_VARIABLE: "2",
        "CLUSTER_RUN_DIR": str(folder / "run"),
        "CLUSTER_SHARED_DIR": str(folder),
        "CLUSTER_PRIVATE_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv += [str(ROOT / "examples" / "ddp_training.py"), "--steps", str(steps), "--log-every", "50"]
    log = open(folder / f"group-{index}{'-again' if restarted else ''}.log", "w")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill(process: subprocess.Popen) -> None:
    for pid in [process.pid, *procfs.descendants([process.pid])]:  # torchrun's workers: sessions of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def lines(folder: Path) -> list:
    path = folder / "run" / contract.METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kill-at", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    from torchft._torchft import LighthouseServer

    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}", flush=True)
    folder = Path(args.out or tempfile.mkdtemp(prefix="gpu-replicas-"))
    (folder / "run").mkdir(parents=True, exist_ok=True)
    bind = "127.0.0.1:29561"
    server = LighthouseServer(
        bind=bind,
        min_replicas=1,
        join_timeout_ms=LIGHTHOUSE_JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS,
    )
    started = time.time()
    groups = [group(i, folder, args.steps, f"http://{bind}", False) for i in (0, 1)]
    killed_at = rejoined_at = None
    try:
        while groups[0].poll() is None or groups[1].poll() is None:
            time.sleep(0.2)
            if time.time() - started > 240:
                print("FAIL: not done in 240 s", flush=True)
                return 1
            mine = [line for line in lines(folder) if line["replica"] == 1]
            if killed_at is None and mine and mine[-1]["step"] >= args.kill_at:
                kill(groups[1])
                killed_at = time.time()
                print(f"group 1 killed at its step {mine[-1]['step']}", flush=True)
                time.sleep(1)
                groups[1] = group(1, folder, args.steps, f"http://{bind}", True)
                rejoined_at = time.time()
    finally:
        for process in groups:
            if process.poll() is None:
                kill(process)
        server.shutdown()
    every = lines(folder)
    survivor = [line for line in every if line["replica"] == 0]
    steps = [line["step"] for line in survivor]
    redone = len(steps) - len(set(steps))
    times = [line["time"] for line in survivor]
    gap = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
    back = [line for line in every if line["replica"] == 1 and killed_at and line["time"] > killed_at]
    healed = back[0]["time"] - killed_at if back and killed_at is not None else float("inf")
    final = {line["replica"]: line["params_sha"] for line in every if line["step"] == args.steps}
    equal = len(final) == 2 and len(set(final.values())) == 1
    codes = [process.returncode for process in groups]
    started_s = rejoined_at - killed_at if rejoined_at is not None and killed_at is not None else 0.0
    print(
        f"exit codes {codes}; survivor steps {len(steps)}, redone {redone}, longest gap {gap:.2f} s; "
        f"group 1 back {healed:.1f} s after the kill (its start {started_s:.1f} s "
        f"after); final params_sha {'equal' if equal else 'DIFFERENT: ' + json.dumps(final)}",
        flush=True,
    )
    for name in sorted(folder.glob("group-*.log")):
        print(f"--- {name.name} (last 4 lines)\n" + "\n".join(name.read_text().splitlines()[-4:]), flush=True)
    ok = codes == [0, 0] and redone == 0 and gap <= 2 and equal and back
    print("OK" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
