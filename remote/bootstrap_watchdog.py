"""Bootstrap's watchdog stage: the budget and idle guard (harness/watchdog.py) on the head node, from
`.cluster/<stack>/guards.json`, kept alive as the inventory's `daemon` says (systemd, or detached with a pid
file); a change to its code or its guards restarts it."""

import io
import json
import shlex
from pathlib import Path

from infra import state
from node import contract
from remote import node_paths
from remote.bootstrap_stage import REPO, BootstrapBase, NodeRecord, Outcome, StageFailed, digest

# The watchdog's code: a change to any of it restarts the watchdog.
WATCHDOG_CODE = ("harness/watchdog.py", "node/contract.py", "node/procfs.py", "node/billing.py")


WATCHDOG_UNIT = """[Unit]
Description=gpu-cluster budget and idle watchdog
After=network-online.target remote-fs.target

[Service]
User={user}
WorkingDirectory={code}
Environment=PYTHONPATH={code}
Environment=CLUSTER_NODE=node-0
ExecStart={argv}
Restart=on-failure
RestartSec=10

[Install]
WantedBy=multi-user.target
"""


class WatchdogStage(BootstrapBase):
    """The watchdog stage, on the head node only."""

    def watchdog(self, record: NodeRecord) -> Outcome:
        """The budget and idle guard on node-0, from `.cluster/<stack>/guards.json` (written by `up`)."""
        if record is not self.records[0]:
            return Outcome("n/a", "")
        guards = {k: v for k, v in _read_json(self.stack_dir / state.GUARDS).items() if v is not None}
        wanted = digest(
            guards,
            self.cluster.hourly_usd,
            self.cluster.created_at,
            self.python_for(record),
            *((REPO / path).read_text() for path in WATCHDOG_CODE),
        )
        alive = record.session.run(self._watchdog_alive_command()).exited == 0
        if self._up_to_date(record, "watchdog", wanted) and alive == bool(guards):
            return Outcome("up to date", _guard_text(guards))
        if alive:
            record.session.run(self._watchdog_stop_command())
        if guards and not self.cluster.shared_dir:
            raise StageFailed("the watchdog needs shared storage to reach every node; this cluster has none")
        # Recorded before it starts: a watchdog that powers the node off at once (a short idle guard)
        # must not cut the stage short. A recorded watchdog that is not running is started again.
        self._record(record, "watchdog", wanted, guards)
        if guards:
            result = record.session.run(self._watchdog_start_command(record, guards), timeout=120)
            if result.exited != 0:
                raise StageFailed("could not start the watchdog", result.stdout + result.stderr)
        return Outcome("done", _guard_text(guards))

    def _watchdog_argv(self, record: NodeRecord, guards: dict) -> list[str]:
        from datetime import datetime

        home = record.facts("probe").get("home") or "~"
        argv = [
            self.python_for(record),
            "-m",
            "harness.watchdog",
            "--shared-dir",
            self.cluster.shared_dir,
            "--hourly-usd",
            f"{self.cluster.hourly_usd:g}",
            "--started-at",
            f"{datetime.fromisoformat(self.cluster.created_at).timestamp():.0f}",
            "--job-file",
            f"{home}/{contract.JOB}",
            "--progress-dir",
            f"{home}/{contract.PROGRESS}",
        ]
        if guards.get("max_total_usd") is not None:
            argv += ["--max-total-usd", f"{guards['max_total_usd']:g}"]
        if guards.get("idle_minutes") is not None:
            argv += ["--idle-minutes", f"{guards['idle_minutes']:g}"]
        return argv

    def _watchdog_start_command(self, record: NodeRecord, guards: dict) -> str:
        code = node_paths.code_dir(self.cluster)
        argv = " ".join(shlex.quote(a) for a in self._watchdog_argv(record, guards))
        if self.cluster.daemon == "detached":
            # Its own session, output to a file, registered in the node's pid registry: the SSH session
            # ends at once, and powering the node off (or `down`) finds it.
            # The braces matter: `cd X && Y &` would put a subshell in the background that keeps the
            # session's output open (the command would not return until the watchdog exits) and whose
            # pid, not the watchdog's, `$!` would record.
            return (
                f"cd {node_paths.shell_path(code)} && {{ PYTHONPATH={node_paths.shell_path(code)} setsid {argv} "
                f">> {contract.shell(contract.WATCHDOG_LOG)} 2>&1 < /dev/null & "
                f"echo $! > {contract.shell(contract.WATCHDOG_PID)}; }}"
            )
        unit = WATCHDOG_UNIT.format(user=record.session.node.ssh_user, code=code, argv=argv)
        record.session.conn.put(io.StringIO(unit), remote=contract.WATCHDOG_UNIT_FILE)
        return (
            f"sudo -n install -m 644 {contract.shell(contract.WATCHDOG_UNIT_FILE)} /etc/systemd/system/ && "
            f"sudo -n systemctl daemon-reload && sudo -n systemctl enable {contract.WATCHDOG_UNIT} && "
            f"sudo -n systemctl restart {contract.WATCHDOG_UNIT}"
        )

    def _watchdog_alive_command(self) -> str:
        if self.cluster.daemon == "detached":
            pid = contract.shell(contract.WATCHDOG_PID)
            return f'[ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null'
        return f"systemctl is-active --quiet {contract.WATCHDOG_UNIT}"

    def _watchdog_stop_command(self) -> str:
        if self.cluster.daemon == "detached":
            pid = contract.shell(contract.WATCHDOG_PID)
            return f'kill -TERM -- -"$(cat {pid})" 2>/dev/null; rm -f {pid}; true'
        return f"sudo -n systemctl disable --now {contract.WATCHDOG_UNIT}; true"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _guard_text(guards: dict) -> str:
    parts = []
    if guards.get("max_total_usd") is not None:
        parts.append(f"budget ${guards['max_total_usd']:g}")
    if guards.get("idle_minutes") is not None:
        parts.append(f"idle {guards['idle_minutes']:g} min")
    return ", ".join(parts) or "no guard set"
