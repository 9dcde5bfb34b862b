"""torchft on the cluster: a Manager whose servers listen on this node's private address, the one line per
step that a fault-tolerant run's replica groups write, and the loop that keeps the contract (README,
"Fault-tolerant runs"): `Replica` builds the Manager around a model and its optimizer (the state a healing
group fetches live from a peer), resumes from the checkpoint only when the run started again whole, and
`Replica.train` runs the per-step quorum, the averaged gradients, the commit check, the contract's line,
the periodic checkpoint and a spot notice's leaving at a step boundary. examples/ft_training.py and
examples/ddp_training.py (under `--replicas`) both train with it; they bring the model and the loss of a step.

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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
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


READY_MARKER = "ft-group-ready"
"""In `$CLUSTER_RUN_DIR`: `ft-group-ready-<group>`, each replica group's once it is up
(`Replica.wait_for_the_groups`)."""


def replica_group() -> int:
    """This process's replica group (`REPLICA_GROUP_ID`, set by `fab ... --replicas`); 0 outside one."""
    return int(os.environ.get(contract.REPLICA_VARIABLE, "0"))


def replicated() -> bool:
    """Whether this process runs in a fault-tolerant run's replica group (`fab ... --replicas N`)."""
    return bool(os.environ.get(contract.REPLICAS_VARIABLE))


@dataclass(frozen=True)
class ReplicaConfig:
    """How a replica group trains (`Replica.train`)."""

    steps: int
    """Committed steps to train (the quorum's step: a group that heals starts at its peers')."""
    checkpoint: Path
    """The checkpoint for when every group is lost: saved by the first participating group, every
    `checkpoint_every` steps; read only when the run started again whole (`CLUSTER_RESTART_COUNT` > 0)."""
    checkpoint_every: int = 20
    """Steps between checkpoints."""
    quorum_timeout_s: float = 30.0
    """How long a quorum may take (the Lighthouse's answer) before the step fails."""
    step_sleep_s: float = 0.0
    """Seconds of pretend work per step (tests and the bench, on CPU nodes)."""
    log_every: int = 1
    """Print a step line every this many committed steps (each one writes its contract line)."""


class Replica:
    """One replica group's fault-tolerant training around `model` and its `optimizer` (torch's): a Manager
    bound to this node's private address, whose `state_dict` is everything a healing group needs."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ReplicaConfig):
        from torchft import Optimizer

        self.model, self.inner, self.config = model, optimizer, config
        self.replica = replica_group()
        self.manager = bound_manager(
            pg=bound_process_group(timeout=timedelta(seconds=10)),
            min_replica_size=1,
            load_state_dict=self.load_state_dict,
            state_dict=self.state_dict,
            replica_id=f"replica_{self.replica}",
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
        )
        self.optimizer = Optimizer(self.manager, optimizer)
        self.log = StepLog(self.replica) if int(os.environ.get("RANK", "0")) == 0 else None

    def state_dict(self) -> dict:
        """What a healing group fetches from a live peer."""
        return {"model": self.model.state_dict(), "optim": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["optim"])

    def resume_when_every_group_was_lost(self) -> None:
        """A run started again whole (a requeue) resumes from the checkpoint; a group started again alone
        heals from a live peer instead, and reads no file."""
        path = self.config.checkpoint
        if int(os.environ.get(contract.RESTART_COUNT_VARIABLE, "0")) > 0 and path.exists():
            saved = torch.load(path, weights_only=False)
            self.load_state_dict(saved["user"])
            self.manager.load_state_dict(saved["torchft"])
            print(f"replica {self.replica}: resumed from {path} at step {self.manager.current_step()}", flush=True)

    def train(self, loss_at: Callable[[int], torch.Tensor], preemption) -> int:
        """Train to `config.steps` committed steps; `loss_at(step)` is this group's loss for `step` (its own
        slice of the step's batch, the same whenever it is trained). The step reached; on a spot notice
        (`preemption.asked`) the group leaves the quorum at a step boundary."""
        self.resume_when_every_group_was_lost()
        self.wait_for_the_groups()
        manager, config = self.manager, self.config
        while manager.current_step() < config.steps:
            step = manager.current_step()
            self.optimizer.zero_grad()  # starts the quorum: a group dropped or healed here
            loss = loss_at(step)
            loss.backward()
            average_gradients(manager, self.model)
            time.sleep(config.step_sleep_s)
            self.optimizer.step()  # commits only where every participant's all-reduce succeeded
            if manager.current_step() == step:
                continue  # not committed: the step is done again with the new quorum
            self._committed(loss.item())
            if preemption.asked:
                self.leave()
                break
        manager.shutdown(wait=False)
        return manager.current_step()

    def wait_for_the_groups(self) -> None:
        """The run's first quorum waits for every group to be up: each says so with a marker in the run's
        shared folder and waits, up to the quorum timeout, for all of theirs. Else the group whose node
        imported torch first would train alone (the Lighthouse forms a quorum of whoever is there) and the
        others heal onto its step; a group started again later finds every marker at once. Without a
        shared folder the groups cannot see each other's markers: torchft's first quorum decides."""
        count = int(os.environ.get(contract.REPLICAS_VARIABLE) or 0)
        run_dir = os.environ.get("CLUSTER_RUN_DIR")
        if count < 2 or not run_dir or not os.environ.get("CLUSTER_SHARED_DIR"):
            return
        markers = [Path(run_dir) / f"{READY_MARKER}-{group}" for group in range(count)]
        with contextlib.suppress(OSError):
            markers[self.replica].touch()
        deadline = time.monotonic() + self.config.quorum_timeout_s
        while not all(marker.exists() for marker in markers) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _committed(self, loss: float) -> None:
        step = self.manager.current_step()
        if self.log is None:
            return
        line = self.log.write(step, self.manager.num_participants(), self.model, loss=round(loss, 6))
        if step % self.config.log_every == 0 or step == self.config.steps:
            print(
                f"replica {self.replica} step {line['step']:4d} loss {loss:.4f} participants {line['participants']}",
                flush=True,
            )
        if step % self.config.checkpoint_every == 0 and self.manager.participating_rank() == 0:
            self.save_checkpoint()

    def leave(self) -> None:
        """A spot notice, at a step boundary: the group leaves the quorum (its peers' next quorum goes on
        without it, no step of theirs undone); the last group saves the step first, for the run's requeue."""
        alone = self.manager.num_participants() <= 1
        if alone and self.log:
            self.save_checkpoint()
        where = f"; checkpoint at step {self.manager.current_step()} saved" if alone else "; its peers go on"
        print(f"replica {self.replica} preempted (SIGUSR1) at step {self.manager.current_step()}{where}", flush=True)

    def save_checkpoint(self) -> None:
        """Atomically, by the first participating group's first rank."""
        path = self.config.checkpoint
        partial = path.with_suffix(".partial")
        state = {"user": self.state_dict(), "torchft": self.manager.state_dict()}
        torch.save(state, partial)
        partial.replace(path)


def average_gradients(manager, model: torch.nn.Module) -> None:
    """The gradients averaged over the groups in the quorum, in one all-reduce of them all flattened (as
    DDP's buckets do: one round trip, not one per parameter); torchft 0.2.0's DistributedDataParallel fails
    its comm hook when a peer dies mid-step (README). An error here makes the step uncommitted."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
