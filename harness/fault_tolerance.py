"""torchft on the cluster: a Manager whose servers listen on this node's private address, and the one
line per step that a fault-tolerant run's replica groups write (README, "Fault-tolerant runs").

torchft 0.2.0 binds its servers to every interface and has no option or variable to say otherwise:
the Manager's (gRPC, `[::]:port`, manager.py) and the checkpoint server that a healing group fetches the
live state from (HTTP, `("", 0)`, checkpointing/http_transport.py, advertised by host name). `bound_manager`
makes both listen on `CLUSTER_PRIVATE_IP` (loopback on the local provider) and advertise that address,
as every other server of a job does (README, "What a job exposes"). Its gloo process group builds gloo
with torch's default device (the host name's address, not GLOO_SOCKET_IFNAME's): `BoundProcessGroupGloo`
gives it a device on that address instead. The Lighthouse is served by the head node's
node/torchrun.py, bound likewise.
"""

import contextlib
import hashlib
import json
import os
import socket
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import torch

from node import contract

PRIVATE_ADDRESS_VARIABLE = "CLUSTER_PRIVATE_IP"
"""The node's private address, from the node environment (remote/job_command.py `node_environment`)."""
METRICS_FILE = contract.METRICS_FILE
"""In `$CLUSTER_RUN_DIR` (on the shared folder, so every group's lines are in one file): each replica
group's first rank appends one line per committed step, in one write."""


def private_address() -> str:
    """Where this node's servers listen: its private address, else loopback (a run outside `fab`)."""
    return os.environ.get(PRIVATE_ADDRESS_VARIABLE) or "127.0.0.1"


def host_port(address: str, port: int) -> str:
    """`address:port`, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def bound_process_group(timeout, address: str | None = None):
    """torchft's reconfigurable gloo process group, its sockets on `address` (default: `private_address()`)."""
    from torch.distributed import ProcessGroup
    from torch.distributed import ProcessGroupGloo as Gloo
    from torchft.process_group import ProcessGroupGloo

    address = address or private_address()

    class BoundProcessGroupGloo(ProcessGroupGloo):
        def _create_pg(self, store, rank: int, world_size: int):
            options = Gloo._Options()  # type: ignore[attr-defined]
            options._devices = [Gloo.create_device(hostname=address)]
            options._timeout = self._timeout
            if self._group_rank is not None and self._group_world_size:
                options.group_name = (
                    f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
                )
            backend = Gloo(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
            if torch.cuda.is_available():
                pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    return BoundProcessGroupGloo(timeout=timeout)


def bound_manager(address: str | None = None, **manager_args):
    """`torchft.Manager(**manager_args)` with its Manager server and checkpoint server on `address`
    (default: `private_address()`), and the checkpoint server's URL naming that address."""
    import torchft.manager as manager_module
    from torchft.checkpointing import http_transport

    address = address or private_address()
    if "checkpoint_transport" not in manager_args:
        timeout = manager_args.get("timeout")
        manager_args["checkpoint_transport"] = bound_transport(address, http_transport, timeout)
    server = manager_module.ManagerServer

    def bound_server(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return server(**{**kwargs, "bind": host_port(address, int(port)), "hostname": address})

    # torchft names ManagerServer in its module and builds it inside Manager.__init__, binding "[::]"
    # (torchft 0.2.0 manager.py): swapped for that call only.
    manager_module.ManagerServer = bound_server
    try:
        return manager_module.Manager(hostname=address, **manager_args)
    finally:
        manager_module.ManagerServer = server


def bound_transport(address: str, http_transport, timeout=None):
    """torchft's HTTPTransport (the live state a healing group fetches), listening on `address` only."""
    from datetime import timedelta

    family = socket.AF_INET6 if ":" in address else socket.AF_INET

    class BoundServer(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

        def __init__(self, server_address, handler):
            super().__init__((address, server_address[1]), handler)

    class BoundTransport(http_transport.HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host_port(address, port)}/checkpoint/"

    made = http_transport._IPv6HTTPServer
    http_transport._IPv6HTTPServer = BoundServer  # what HTTPTransport.__init__ serves on ("", 0) otherwise
    try:
        return BoundTransport(timeout=timeout or timedelta(seconds=60), num_chunks=0)
    finally:
        http_transport._IPv6HTTPServer = made


def params_sha(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes, in order: equal on two groups exactly when their weights are."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for parameter in model.parameters():
            digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class StepLog:
    """The contract's line per committed step, appended by each replica group's first rank."""

    def __init__(self, replica: int, folder: str | None = None):
        self.replica = replica
        root = folder or os.environ.get("CLUSTER_RUN_DIR") or "."
        self.path = Path(root) / METRICS_FILE

    def write(self, step: int, participants: int, model: torch.nn.Module, **extra) -> dict:
        line = {
            "kind": "ft_step",
            "step": step,
            "time": time.time(),
            "replica": self.replica,
            "participants": participants,
            "params_sha": params_sha(model),
            **extra,
        }
        with contextlib.suppress(OSError), self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return line
