"""Watch this node's instance metadata for a spot interruption notice or a rebalance recommendation.

    python node/spot_watch.py [--interval-s 5] [--signal-ranks] [--preempt] [--node NAME] [--hook COMMAND]
                              [--endpoint URL] [--once]
    python node/spot_watch.py --tell-ranks --node NAME   # SIGUSR1 to the node's ranks now, as a notice does

Polls `spot/instance-action` and `events/recommendations/rebalance` every `--interval-s` with an IMDSv2
session token (asked again before it expires, and at once when the service refuses it). The service is
`$AWS_EC2_METADATA_SERVICE_ENDPOINT` where set (botocore's variable; each local node serves its own),
else EC2's http://169.254.169.254. Each new notice prints one line and runs `--hook` through the shell
with `SPOT_EVENT` (`interruption` or `rebalance`), `SPOT_ACTION` and `SPOT_TIME` in its environment.
With `--signal-ranks`, an interruption notice also sends SIGUSR1 (Slurm's and PyTorch Lightning's
"save and requeue") to every rank of every run on this node: the torchrun workers, found in /proc by
their CLUSTER_RUN_ID and RANK (and CLUSTER_NODE, where several nodes share one machine). `--preempt`
(how the scheduler stage runs it on every node, node/slurm_daemons.py) first drains this node in Slurm, its
reason starting with `contract.SPOT_DRAIN_REASON`, then signals the ranks: the ranks save and exit, and
the run's batch job (node/slurm_run.py) sees the drain and requeues the run. Where no service answers
(not on EC2) it says so once and keeps looking. `--tell-ranks` is that signal alone, at once: what a run's
batch job has a straggler's node do before it is replaced (`--on-straggler replace`). Standard library only.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

if not __package__:  # run as a file (`python node/X.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, procfs, slurm_nodes  # noqa: E402
from node.slurm_conf import Paths, UsageError  # noqa: E402

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TOKEN_TTL_S = 21600
REQUEST_TIMEOUT_S = 2.0


class Unreachable(Exception):
    """No metadata service answered (not on EC2, or the service is down)."""


class MetadataClient:
    """GETs with an IMDSv2 token, renewed when half its lifetime has passed or the service refuses it."""

    def __init__(self, endpoint: str, token_ttl_s: int = DEFAULT_TOKEN_TTL_S, timeout_s: float = REQUEST_TIMEOUT_S):
        self.endpoint = endpoint.rstrip("/")
        self.token_ttl_s = token_ttl_s
        self.timeout_s = timeout_s
        self.token = ""
        self.renew_at = 0.0
        self.tokens_asked = 0

    def get_json(self, path: str) -> dict | None:
        """The document at `path`, or None where there is none (404); Unreachable without a service."""
        status, body = self._get(path)
        if status == 401:  # expired early, or the service restarted: a new token, once
            self.renew_at = 0.0
            status, body = self._get(path)
        if status == 404:
            return None
        if status != 200:
            raise Unreachable(f"{self.endpoint}{path} answered {status}")
        try:
            document = json.loads(body)
        except ValueError:
            raise Unreachable(f"{self.endpoint}{path} answered something that is not JSON") from None
        return document if isinstance(document, dict) else None

    def _get(self, path: str) -> tuple[int, str]:
        headers = {contract.IMDS_TOKEN_HEADER: self._token()}
        return self._request(urllib.request.Request(self.endpoint + path, headers=headers))

    def _token(self) -> str:
        if time.monotonic() >= self.renew_at:
            request = urllib.request.Request(
                self.endpoint + contract.IMDS_TOKEN_PATH,
                method="PUT",
                headers={contract.IMDS_TTL_HEADER: str(self.token_ttl_s)},
            )
            status, body = self._request(request)
            if status != 200:
                raise Unreachable(f"{self.endpoint} gave no token ({status})")
            self.token, self.tokens_asked = body.strip(), self.tokens_asked + 1
            self.renew_at = time.monotonic() + self.token_ttl_s / 2
        return self.token

    def _request(self, request: urllib.request.Request) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(f"no metadata service at {self.endpoint} ({getattr(exc, 'reason', exc)})") from None


@dataclass(frozen=True)
class Notice:
    """One thing the metadata service told."""

    event: str
    """`interruption` (spot/instance-action) or `rebalance` (the rebalance recommendation)."""
    action: str
    """`terminate`, `stop` or `hibernate` for an interruption; empty for a rebalance recommendation."""
    time: str
    """When: the interruption's time, or the recommendation's `noticeTime` (ISO UTC)."""

    def line(self, node: str) -> str:
        if self.event == "interruption":
            return f"spot-watch {node}: spot interruption notice: {self.action} at {self.time}"
        return f"spot-watch {node}: rebalance recommendation at {self.time}"


def read_notices(client: MetadataClient) -> list[Notice]:
    """What the service posts now (raises Unreachable)."""
    notices = []
    action = client.get_json(contract.SPOT_ACTION_PATH)
    if action is not None:
        notices.append(Notice("interruption", str(action.get("action", "")), str(action.get("time", ""))))
    rebalance = client.get_json(contract.REBALANCE_PATH)
    if rebalance is not None:
        notices.append(Notice("rebalance", "", str(rebalance.get("noticeTime", ""))))
    return notices


def ranks_on_this_node(node: str) -> dict[int, str]:
    """pid -> run id of every torchrun worker of any run on this node (`node` empty: of any node): the
    node user's (its HOME: the local provider's nodes, of every cluster on the machine, share one machine
    and differ by their homes)."""
    found = {}
    home = os.path.expanduser("~")
    for pid, variables in procfs.environments(exclude={os.getpid()}):
        run_id = variables.get(contract.RUN_ID_VARIABLE)
        if not run_id or not variables.get("RANK", "").isdigit() or variables.get("HOME") != home:
            continue
        if node and variables.get(contract.NODE_VARIABLE) != node:
            continue
        found[pid] = run_id
    return found


def signal_ranks(node: str, sig: int = signal.SIGUSR1) -> dict[int, str]:
    """Send `sig` to every rank on this node; the ranks it reached (pid -> run id)."""
    reached = {}
    for pid, run_id in ranks_on_this_node(node).items():
        try:
            os.kill(pid, sig)
            reached[pid] = run_id
        except OSError:  # ended meanwhile
            pass
    return reached


class SpotWatch:
    """Polls, prints each new notice once, signals the ranks (when asked) and runs the hook."""

    def __init__(
        self,
        client: MetadataClient,
        hook: str = "",
        node: str = "",
        out=None,
        signal_ranks: bool = False,
        preempt: bool = False,
    ):
        self.client = client
        self.hook = hook
        self.preempt = preempt
        self.signal_ranks = signal_ranks or preempt
        self.node = node or os.environ.get(contract.NODE_VARIABLE, "") or "this node"
        self.out = out or (lambda line: print(line, flush=True))
        self.seen: set[Notice] = set()
        self.reachable: bool | None = None

    def check(self) -> list[Notice]:
        """One poll; the notices not seen before (each one's line printed and hook run)."""
        try:
            notices = read_notices(self.client)
        except Unreachable as exc:
            if self.reachable is not False:
                self.out(f"spot-watch {self.node}: {exc}; still looking")
            self.reachable = False
            return []
        if self.reachable is False:
            self.out(f"spot-watch {self.node}: the metadata service at {self.client.endpoint} answers")
        self.reachable = True
        new = [n for n in notices if n not in self.seen]
        for notice in new:
            self.seen.add(notice)
            self.out(notice.line(self.node))
            if self.preempt and notice.event == "interruption":
                self.drain(notice)
            if self.signal_ranks and notice.event == "interruption":
                self.tell_ranks()
            self.run_hook(notice)
        return new

    def drain(self, notice: Notice) -> None:
        """No new run on this node; the running one is requeued when it ends (node/slurm_run.py)."""
        try:
            answer = slurm_nodes.drain_for_notice(
                Paths(os.path.expanduser("~")), self.node, f"{notice.action} at {notice.time}"
            )
        except (OSError, subprocess.SubprocessError, UsageError) as exc:
            answer = str(exc)
        self.out(f"spot-watch {self.node}: Slurm: {answer}")

    def tell_ranks(self) -> None:
        node = os.environ.get(contract.NODE_VARIABLE, "") or (self.node if self.preempt else "")
        reached = signal_ranks(node)
        runs = ", ".join(sorted(set(reached.values()))) or "no run"
        self.out(f"spot-watch {self.node}: SIGUSR1 to {len(reached)} rank(s) ({runs})")

    def run_hook(self, notice: Notice) -> None:
        if not self.hook:
            return
        env = {**os.environ, "SPOT_EVENT": notice.event, "SPOT_ACTION": notice.action, "SPOT_TIME": notice.time}
        code = subprocess.call(self.hook, shell=True, env=env)
        if code != 0:
            self.out(f"spot-watch {self.node}: the hook exited {code}")

    def run(self, interval_s: float = DEFAULT_INTERVAL_S, stop: threading.Event | None = None) -> None:
        """Poll until `stop` is set (never, by default: the node's power-off ends it)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            self.check()
            stop.wait(interval_s)


def endpoint_from(environ: dict[str, str]) -> str:
    return environ.get(contract.METADATA_ENDPOINT_VARIABLE) or contract.METADATA_DEFAULT_ENDPOINT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spot_watch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S, help="seconds between polls")
    parser.add_argument("--hook", default="", help="shell command run on each new notice")
    parser.add_argument(
        "--signal-ranks", action="store_true", help="on an interruption notice, SIGUSR1 to every rank on this node"
    )
    parser.add_argument(
        "--preempt",
        action="store_true",
        help="on an interruption notice, drain this node in Slurm, then SIGUSR1 to its ranks (implies --signal-ranks)",
    )
    parser.add_argument("--node", default="", help=f"this node's name (default: ${contract.NODE_VARIABLE})")
    parser.add_argument(
        "--endpoint",
        default=None,
        help=f"the metadata service (default: ${contract.METADATA_ENDPOINT_VARIABLE}, "
        f"else {contract.METADATA_DEFAULT_ENDPOINT})",
    )
    parser.add_argument("--token-ttl-s", type=int, default=DEFAULT_TOKEN_TTL_S, help="IMDSv2 token lifetime asked for")
    parser.add_argument("--once", action="store_true", help="poll once and exit")
    parser.add_argument(
        "--tell-ranks", action="store_true", help="SIGUSR1 to this node's ranks now (save and exit), then exit"
    )
    args = parser.parse_args(argv)
    if args.interval_s <= 0 or not 1 <= args.token_ttl_s <= DEFAULT_TOKEN_TTL_S:
        parser.error("--interval-s must be above 0 and --token-ttl-s in 1..21600")
    client = MetadataClient(args.endpoint or endpoint_from(dict(os.environ)), args.token_ttl_s)
    watch = SpotWatch(client, args.hook, node=args.node, signal_ranks=args.signal_ranks, preempt=args.preempt)
    if args.tell_ranks:
        watch.preempt = True  # the ranks of the node named, where several nodes share one machine
        watch.tell_ranks()
        return 0
    if args.once:
        watch.check()
        return 0
    watch.out(f"spot-watch {watch.node}: watching {client.endpoint} every {args.interval_s:g} s")
    try:
        watch.run(args.interval_s)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
