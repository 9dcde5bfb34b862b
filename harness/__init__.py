"""The library that runs on the nodes: distributed init, models, data, training pieces, the
communication benchmark, pipeline schedules, the GPU monitor, the cost meter and the watchdog; the
examples' argument checks and results folder; and the parallelism lab's pieces (the model config and
device mesh, byte counting, per-rank memory, the check line, sharded checkpoints).

It imports only torch, nvidia-ml-py and the standard library, and reads only environment variables
(torchrun's and the node environment's), never the operator's machine's files.
"""
