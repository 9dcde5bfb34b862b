"""The provider protocol: what `deploy.py up / down / status` ask of every kind of cluster.

A provider is a class in its own module (`local/provider.py`, `aws.py`, `hosts.py`) that implements
`Provider` directly. What differs between providers is a fact on the class (`accepts`, `cloud_plan`,
`costs_money`, `what`), never a branch on its name; what they share (the ledger, the guards, "run logs
kept") is done once by `infra.providers.bring_up` / `bring_down`.
"""

from dataclasses import dataclass, field

from infra.config import StackConfig
from infra.errors import UsageError
from infra.inventory import ClusterInfo, NodeStatus
from infra.timeline import Timeline

# The config keys `up` takes from the command line, and the flag that sets each.
CONFIG_FLAGS = {
    "nodes": "--nodes",
    "instanceType": "--instance-type",
    "spot": "--spot",
    "sshCidr": "--ssh-cidr",
    "maxTotalUsd": "--max-total-usd",
    "idleMinutes": "--idle-minutes",
    "amiId": "--image",
}
# `up` flags that are not stack-config keys.
OPTION_FLAGS = {"bind": "--bind", "ssh_port": "--ssh-port", "yes": "--yes", "hosts_file": "--hosts", "gpus": "--gpus"}


@dataclass(frozen=True)
class UpRequest:
    """What `deploy.py up` asks for; a provider refuses (in `bring_up`) what it does not `accept`."""

    stack: str
    """The stack to bring up."""
    overrides: dict
    """Stack-config values from the command line, by config key (None where not given)."""
    yes: bool = False
    """AWS: do not ask to confirm the hourly cost."""
    bind: str | None = None
    """local: node-0's loopback address."""
    ssh_port: int | None = None
    """local: node-0's SSH port."""
    hosts_file: str | None = None
    """ssh: the hosts file."""
    gpus: int | None = None
    """local: fake GPUs per node, in Slurm's GRES (a device file each); torch still runs on the CPU."""
    timeline: Timeline = field(default_factory=lambda: Timeline.since_process_start(), compare=False)
    """Where the provider marks its phases (infra/timeline.py): `up` prints it and keeps it in the inventory."""

    def given(self) -> dict[str, str]:
        """Every option given on the command line: config key or option name -> its flag."""
        options = {
            "bind": self.bind,
            "ssh_port": self.ssh_port,
            "yes": self.yes or None,
            "hosts_file": self.hosts_file,
            "gpus": self.gpus,
        }
        given = {key: CONFIG_FLAGS.get(key, key) for key, value in self.overrides.items() if value is not None}
        given.update({key: OPTION_FLAGS[key] for key, value in options.items() if value is not None})
        return given


@dataclass(frozen=True)
class UpResult:
    """What `up` found or made."""

    cluster: ClusterInfo
    """The cluster, as its inventory now says."""
    created: bool
    """False when the stack was up already (and matches the request)."""
    billed_lines: tuple = ()
    """What the cluster is billed for while up (`infra.pricing.BilledLine`s); empty where AWS bills nothing."""


@dataclass(frozen=True)
class DownReport:
    """What a provider's `down` did; `bring_down` closes the ledger and says the rest."""

    code: int
    """The exit code: 0 when nothing of the stack is left, 1 when something is (said already)."""
    ended: bool = True
    """The cluster no longer runs (its ledger interval closes); False when the stack was kept."""
    stopped_itself: dict | None = None
    """The watchdog's stop record when the cluster had powered itself off ({reason, at})."""


class Provider:
    """up / down / status for one kind of cluster."""

    name = ""
    """The inventory's `provider` for the stacks this provider makes."""
    accepts: frozenset[str] = frozenset()
    """The `UpRequest.given()` keys this provider takes; `bring_up` refuses the others in one line."""
    cloud_plan = False
    """Whether `deploy.py plan` applies: the stack is a cloud program whose resources can be listed offline."""
    what = ""
    """What the provider's clusters are, for messages: "the local provider", "your own machines"."""
    why_not = "they do not apply here"
    """Why the flags it does not accept do not apply, for the refusal's line."""
    flag = ""
    """The `up` flag that picks this provider ("--local"), for messages; empty for the default (AWS)."""
    default_stack = ""
    """The stack `up` with this provider's flag uses when no --stack is given."""

    def check(self, request: UpRequest) -> None:
        """Refuse bad input (UsageError, one line) before anything is made, the state folder included."""

    def up(self, request: UpRequest, say) -> UpResult:
        """Bring the cluster up (or find it up, matching the request) and write the inventory."""
        raise NotImplementedError

    def down(self, stack: str, say) -> DownReport:
        """Remove what the stack made and say what was removed."""
        raise NotImplementedError

    def status(self, cluster: ClusterInfo) -> tuple[list[NodeStatus], dict]:
        """One NodeStatus per node, and the watchdog's stop record when the cluster stopped itself ({} otherwise)."""
        raise NotImplementedError

    def bookkeeping(self, request: UpRequest) -> tuple[StackConfig | None, float | None]:
        """For a cluster `up` created: the stack config whose guards the watchdog enforces (None: no
        guards apply), and what the same hours would cost on AWS (None: the cluster is priced itself)."""
        return None, None

    def self_stops(self) -> dict[str, dict]:
        """This provider's stacks that powered themselves off, with their stop records."""
        return {}

    def interrupted_stacks(self) -> list[str]:
        """Stacks an `up` killed midway left running without an inventory (found from what is on disk)."""
        return []

    def adopt_replacements(self, cluster: ClusterInfo, say) -> ClusterInfo:
        """Where the cloud replaced nodes by itself (`cluster.nodes_move`): the inventory follows them (new
        addresses, their host keys pinned); the cluster as it is now."""
        return cluster

    def replacement_problem(self, cluster: ClusterInfo) -> str:
        """Why a node of this cluster that goes (reclaimed, dead, powered off) is not replaced by a new one
        that rejoins by itself ('' where it is): `--on-straggler replace` needs that spot path."""
        return f"{self.what} replaces no node"

    def spot_drill(
        self, cluster: ClusterInfo, node: str, notice_s: float, say, fis_role: str | None = None, yes: bool = False
    ) -> None:
        """`deploy.py drill spot`: post a spot interruption notice on `node`, reclaimed `notice_s` later
        (`fis_role`: the IAM role AWS FIS assumes to do it, where AWS does it; `yes`: a node that nothing
        will replace may be reclaimed for good)."""
        raise UsageError(f"drill spot rehearses a spot interruption: {self.what} has no spot instances")
