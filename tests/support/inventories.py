"""Inventories for tests that need one but no cluster behind it."""

import json
from pathlib import Path

from infra.inventory import ClusterInfo, NodeInfo


def cluster(provider="aws", shared="/shared", gpus=(1, 1), hourly=1.504) -> ClusterInfo:
    nodes = tuple(NodeInfo(f"node-{i}", f"54.0.0.{i + 1}", f"10.0.1.{10 + i}", 22, g) for i, g in enumerate(gpus))
    return ClusterInfo(
        "dev",
        provider,
        "us-east-1",
        "g4dn.2xlarge",
        hourly,
        "ubuntu",
        "/k",
        "/kh",
        shared,
        "2026-11-21T00:00:00+00:00",
        nodes,
    )


def unreachable_stack(state_dir: Path, stack: str = "local") -> None:
    """A current, bootstrapped-looking stack whose one node (127.0.89.250:9) never answers: a command
    that gets past its checks goes on to connect, create a run folder or write the ledger."""
    folder = state_dir / stack
    folder.mkdir(parents=True)
    key = folder / "id_ed25519"
    key.write_text("not a key\n")
    key.chmod(0o600)
    (folder / "known_hosts").write_text("")
    node = NodeInfo("node-0", "127.0.89.250", "127.0.89.250", 9, 0, "nobody")
    local = ClusterInfo(
        stack,
        "local",
        "local",
        "g4dn.xlarge",
        0.0,
        "nobody",
        str(key),
        str(folder / "known_hosts"),
        "",
        "2026-11-21T00:00:00+00:00",
        (node,),
    )
    (folder / "inventory.json").write_text(local.to_json())
    setup = {"master_port": 29500, "python": {"node-0": "python3"}, "nodes": {"node-0": {"probe": {"home": "/tmp"}}}}
    (folder / "bootstrap.json").write_text(json.dumps(setup))
    (state_dir / "current").write_text(stack + "\n")


def files_under(folder: Path) -> set[str]:
    """Every path under `folder`, relative: compare before and after to prove nothing was created."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}
