"""Fabric tasks that work with a running cluster over SSH: bootstrap, launch, logs, stop.

Only the `ClusterInfo` inventory (and the state files beside it) is shared with `infra/`.
"""
