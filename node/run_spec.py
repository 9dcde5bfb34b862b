"""A Slurm-held run's spec: what fab submits (remote/scheduled.py builds it here and sends `as_dict`), what
node/slurm_run.py writes into the batch script, and what node/slurm_batch.py and every node's
node/slurm_step.py read back (`decoded`), once, at their start. Everything after takes the typed spec.

A spec that does not fit (a key missing, one this code does not know, a value of the wrong kind) is a
`SpecError` naming the key, never a KeyError.

Standard library only (node/slurm_step.py imports it at every start of every node's step).
"""

import base64
import dataclasses
import json
import os


class SpecError(ValueError):
    """The spec does not fit: one line naming the key."""


def _fields(data, cls, where: str) -> dict:
    """`data`'s keys checked against `cls`'s fields: every one without a default there, none other."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: not a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}")
    for f in dataclasses.fields(cls):
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{where}: missing key {f.name!r}")
    return data


def _commands(data, where: str) -> dict:
    """{node name: shell command}."""
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise SpecError(f"{where}: not a {{node: command}} object")
    return dict(data)


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: not a number")
    return value


@dataclasses.dataclass(frozen=True)
class SpecNode:
    """One node of the run, head node first."""

    name: str
    """`node-<i>`."""
    home: str
    """The node user's home there (the step's HOME and working folder)."""
    command: str
    """The shell command the node runs (the run's `launch_command`, or a watch's probe)."""
    slurm_name: str = ""
    """Its NodeName in Slurm where that differs (a Slurm the hosts already ran); set by `submit`."""

    @property
    def in_slurm(self) -> str:
        """The name Slurm knows the node by."""
        return self.slurm_name or self.name

    @classmethod
    def from_dict(cls, data, where: str = "run spec: nodes[]") -> "SpecNode":
        _fields(data, cls, where)
        for key, value in data.items():
            if not isinstance(value, str):
                raise SpecError(f"{where}: {key!r} is not a string")
        return cls(**data)

    def replace(self, **changes) -> "SpecNode":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        found = {"name": self.name, "home": self.home, "command": self.command}
        return {**found, "slurm_name": self.slurm_name} if self.slurm_name else found


@dataclasses.dataclass(frozen=True)
class WatchSpec:
    """The hang watch the batch job runs beside the step (node/slurm_watch.py); the values of `--hang-timeout`,
    `--on-hang` and `--on-straggler`, and each node's commands that answer it."""

    timeout_s: float
    poll_s: float
    on_hang: str = "stop"
    on_straggler: str = ""
    """`replace`: a straggler's node is drained and replaced (slurm_watch.StragglerReplacement)."""
    overdue_grace_s: float | None = None
    """node/run_watch.py's WatchPolicy field; None: its default."""
    shared_dir: str = ""
    """The cluster's shared folder ('' where it has none): step times and power-off markers go there."""
    status: dict = dataclasses.field(default_factory=dict)
    """{node: the command that answers the watch's poll}"""
    collect: dict = dataclasses.field(default_factory=dict)
    """{node: the command that collects a hung run's evidence}"""
    tell_ranks: dict = dataclasses.field(default_factory=dict)
    """{node: the command that tells its ranks to save and exit}"""

    @classmethod
    def from_dict(cls, data) -> "WatchSpec":
        where = "run spec: watch"
        _fields(data, cls, where)
        found = dict(data)
        for key in ("timeout_s", "poll_s"):
            found[key] = _number(found[key], f"{where}: {key!r}")
        if found.get("overdue_grace_s") is not None:
            found["overdue_grace_s"] = _number(found["overdue_grace_s"], f"{where}: 'overdue_grace_s'")
        found["shared_dir"] = found.get("shared_dir") or ""  # fab writes null where the cluster has none
        for key in ("status", "collect", "tell_ranks"):
            found[key] = _commands(found.get(key, {}), f"{where}: {key!r}")
        return cls(**found)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run as its batch job and its steps see it."""

    run_id: str
    log: str
    """The run's log on the head node; its folder is the run's (records, the batch script)."""
    python: str
    """The interpreter on every node."""
    nodes: tuple[SpecNode, ...]
    """The run's SpecNode, head node first."""
    watch: WatchSpec | None = None
    """The hang watch beside the step, where asked."""
    replicas: int = 0
    """torchft replica groups (a fault-tolerant run); 0: none."""

    @property
    def folder(self) -> str:
        """The run's folder on the head node (beside its log)."""
        return os.path.dirname(self.log)

    @property
    def head(self) -> SpecNode:
        return self.nodes[0]

    @property
    def node_names(self) -> list:
        return [node.name for node in self.nodes]

    def node(self, name: str) -> SpecNode | None:
        """The run's node called `name`; None where it has none."""
        return next((node for node in self.nodes if node.name == name), None)

    def replace(self, **changes) -> "RunSpec":
        """A copy with `changes` (other nodes, no watch, ...)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data) -> "RunSpec":
        _fields(data, cls, "run spec")
        for key in ("run_id", "log", "python"):
            if not isinstance(data[key], str):
                raise SpecError(f"run spec: {key!r} is not a string")
        nodes = data["nodes"]
        if not isinstance(nodes, list) or not nodes:
            raise SpecError("run spec: 'nodes' is not a list of nodes")
        replicas = data.get("replicas") or 0
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise SpecError("run spec: 'replicas' is not a count")
        watch = data.get("watch")
        return cls(
            run_id=data["run_id"],
            log=data["log"],
            python=data["python"],
            nodes=tuple(SpecNode.from_dict(node) for node in nodes),
            watch=WatchSpec.from_dict(watch) if watch else None,
            replicas=replicas,
        )

    def as_dict(self) -> dict:
        found: dict = {
            "run_id": self.run_id,
            "log": self.log,
            "python": self.python,
            "nodes": [node.as_dict() for node in self.nodes],
        }
        if self.watch is not None:
            found["watch"] = self.watch.as_dict()
        if self.replicas:
            found["replicas"] = self.replicas
        return found

    def encoded(self) -> str:
        """The spec as a command line carries it (the batch script, srun's step)."""
        return base64.b64encode(json.dumps(self.as_dict()).encode()).decode()

    @classmethod
    def decoded(cls, text: str) -> "RunSpec":
        """`encoded`'s spec; SpecError where it is not one."""
        try:
            data = json.loads(base64.b64decode(text, validate=True))
        except ValueError:
            raise SpecError("run spec: not base64 of JSON") from None
        return cls.from_dict(data)
