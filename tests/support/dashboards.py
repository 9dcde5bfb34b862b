"""A synthetic stack for the dashboard's bench: an inventory of N unreachable nodes, M finished run records
with metrics, and their ledger rows (nothing behind them: the page is read from the files)."""

import json
import time
from pathlib import Path

from infra.inventory import ClusterInfo, NodeInfo
from infra.ledger import Ledger
from infra.timeline import Timeline
from remote.runs import Run


def synthetic_stack(state_dir: Path, stack: str = "big", nodes: int = 16, runs: int = 200) -> None:
    folder = state_dir / stack
    (folder / "runs").mkdir(parents=True)
    key = folder / "id_ed25519"
    key.write_text("not a key\n")
    key.chmod(0o600)
    (folder / "known_hosts").write_text("")
    members = tuple(NodeInfo(f"node-{i}", "127.0.89.250", "127.0.89.250", 9, 0, "nobody") for i in range(nodes))
    info = ClusterInfo(
        stack, "local", "local", "g4dn.xlarge", 0.526 * nodes, "nobody", str(key), str(folder / "known_hosts"), "",
        "2026-11-21T00:00:00+00:00", members,
    )  # fmt: skip
    (folder / "inventory.json").write_text(info.to_json())
    now = time.time()
    ledger = Ledger(state_dir / "ledger.sqlite")
    ledger.cluster_up(stack, "local", "g4dn.xlarge", nodes, info.hourly_usd, at=now - 3600 * 24)
    names = [n.name for n in members]
    for i in range(runs):
        run_id = f"run-{i:04d}"
        started = now - 3600 * 24 + i * 400
        record = Run(run_id, "run", str(1000 + i), "/log", names, started - 5, state="COMPLETED", started_at=started)
        record.ended_at, record.exit_code, record.finished = started + 300, 0, True
        record.exit_codes = dict.fromkeys(names, 0)
        record.timeline = Timeline(started - 5, [["connect", 1.0], ["sync", 2.0], ["training", 302.0]], 305.0)
        run_dir = folder / "runs" / run_id
        run_dir.mkdir()
        record.save(run_dir)
        steps = [
            {"kind": "step", "time": started + s, "step": s, "loss": 1 / (s + 1), "step_ms": 50.0} for s in range(20)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
        ledger.run_started(run_id, stack, "run", nodes, info.hourly_usd, at=started, scheduled=True)
        ledger.run_times(run_id, started, started + 300, dict.fromkeys(names, 0))
    ledger.close()
