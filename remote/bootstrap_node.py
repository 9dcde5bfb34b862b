"""Bootstrap's stages of each node's own: the code (synced by hash), the probe (OS, Python, GPUs, the interface
to MASTER_ADDR), the deps (the node venv, node/python_env.py and node/uv_env.py through the node kit) and the
env file every job sources."""

from pathlib import Path

from infra.errors import OperationError, UsageError
from node import calls, contract, kit
from remote import node_paths, nodecall, protocol
from remote.bootstrap_stage import REPO, SYNCED, BootstrapBase, NodeRecord, Outcome, StageFailed, digest


class NodeStages(BootstrapBase):
    """The code, probe, deps and env stages, each on every node at once."""

    def code(self, record: NodeRecord) -> Outcome:
        """Sync the code by hash: once on shared storage, else on every node. Needs no Python."""
        if self.cluster.shared_dir and record is not self.records[0]:
            return Outcome("shared", f"via {self.records[0].name}")
        destination = node_paths.code_dir(self.cluster)
        remote = record.session.run(protocol.hash_files_command(destination, SYNCED))
        if remote.exited != 0:
            raise StageFailed("could not hash the code on the node", remote.stdout + remote.stderr)
        remote_manifest = protocol.parse_hashes(remote.stdout)
        changed = [path for path, sha in self.manifest.items() if remote_manifest.get(path) != sha]
        stale = [path for path in remote_manifest if path not in self.manifest]
        if not changed and not stale:
            return Outcome("up to date", f"{len(self.manifest)} files")
        folders = sorted({str(Path(p).parent) for p in changed})
        if folders:
            record.session.run(
                "mkdir -p " + " ".join(node_paths.shell_path(f"{destination}/{f}") for f in folders), warn=False
            )
        for path in changed:
            record.session.conn.put(str(REPO / path), remote=_sftp(destination, path))
        if stale:
            record.session.run(
                "rm -f " + " ".join(node_paths.shell_path(f"{destination}/{p}") for p in stale), warn=False
            )
        self._record(record, "code", digest(self.manifest), {"files": len(self.manifest)})
        return Outcome("done", f"{len(changed)} sent, {len(stale)} removed")

    def probe(self, record: NodeRecord) -> Outcome:
        python = self.cluster.python
        wanted = digest(self.manifest.get("node/probe.py"), self.cluster.head.private_ip, python)
        if self._up_to_date(record, "probe", wanted):
            return Outcome("up to date", _hardware(record.facts("probe")))
        try:
            facts = nodecall.call(record.session, python, calls.ProbeNode(self.cluster.head.private_ip)).facts
        except (UsageError, OperationError) as exc:
            raise StageFailed(f"the probe failed (is {python} there?)", str(exc)) from None
        if not facts.get("interface"):
            raise StageFailed(f"no route from this node to MASTER_ADDR {self.cluster.head.private_ip}")
        self._record(record, "probe", wanted, facts)
        return Outcome("done", _hardware(facts))

    def deps(self, record: NodeRecord) -> Outcome:
        """The node venv over the inventory's `python`; pip runs only where something is missing."""
        requirements = (REPO / "requirements-node.txt").read_text()
        code = [self.manifest.get(f"node/{name}.py") for name in ("python_env", "uv_env")]
        wanted = digest(requirements, self.cluster.python, *code)
        if self._up_to_date(record, "deps", wanted):
            return Outcome("up to date", _torch(record.facts("deps")))
        facts = self._apply_kit(record, "deps", kit.NodeKit(record.name, self.cluster.python, requirements))
        self._record(record, "deps", wanted, facts)
        return Outcome("done", _torch(facts))

    def env(self, record: NodeRecord) -> Outcome:
        interface = record.facts("probe")["interface"]
        text = self.env_text(record)
        wanted = digest(text)
        if self._up_to_date(record, "env", wanted):
            return Outcome("up to date", f"iface {interface}")
        self._apply_kit(record, "env", kit.NodeKit(record.name, self.cluster.python, env=text))
        self._record(record, "env", wanted, {"interface": interface})
        return Outcome("done", f"iface {interface}")


def _hardware(facts: dict) -> str:
    gpus = facts.get("gpus") or []
    if not gpus:
        return "CPU node: gloo"
    return f"{len(gpus)}x {gpus[0]['name']}, driver {facts.get('driver')}, CUDA {facts.get('cuda')}"


def _torch(facts: dict) -> str:
    """`torch 2.13.0 (CPU)`, and how the venv was topped up where it was (`, with pip: no uv on this node`)."""
    torch = (
        f"torch {facts.get('torch')}, NCCL {facts['nccl']}"
        if facts.get("nccl")
        else f"torch {facts.get('torch')} (CPU)"
    )
    if facts.get("installer") == "pip" and facts.get("installer_why"):
        return f"{torch}, with pip: {facts['installer_why']}"
    return f"{torch}, with uv" if facts.get("installed") and facts.get("installer") == "uv" else torch


def _sftp(destination: str, relative: str) -> str:
    """SFTP does not expand $HOME; relative paths start in the login directory."""
    return f"{contract.home_relative(destination)}/{relative}"
