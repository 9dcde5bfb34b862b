"""The tags every AWS resource of a stack carries: how `down` proves nothing is left, and how a node's
instance is found (a worker an Auto Scaling group replaced has a new instance under the same node tag)."""

STACK_TAG = "gpu-cluster:stack"
NODE_TAG = "gpu-cluster:node"
