"""Inventories for tests that need one but no cluster behind it."""

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
