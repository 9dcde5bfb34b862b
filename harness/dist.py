"""Distributed setup from the environment torchrun and the node environment provide.

NCCL on CUDA GPUs, gloo on CPU, picked by itself. A script started without torchrun runs as a world
of one, so every example also works as plain `python examples/x.py`.
"""

import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist


class RendezvousError(RuntimeError):
    """The process group could not be formed; the message says what to check."""


@dataclass(frozen=True)
class DistEnv:
    """What the launcher told this process, read once from the environment."""

    rank: int
    """Global rank (torchrun's RANK): use it for logging and saving."""
    local_rank: int
    """Rank within the node (LOCAL_RANK): use it for the device."""
    world_size: int
    """All ranks of the job."""
    local_world_size: int
    """Ranks on this node."""
    node_rank: int
    """This node's index in the inventory (NODE_RANK), 0 for the head node."""
    nnodes: int
    """Nodes in the job."""
    master_addr: str
    """Where rank 0's store listens."""
    master_port: int
    """Its port."""
    run_dir: Path | None
    """`$CLUSTER_RUN_DIR`: metrics and results of this run; None outside a `fab` launch."""
    shared_dir: Path | None
    """`$CLUSTER_SHARED_DIR`: storage every node sees (checkpoints)."""
    hourly_usd: float
    """`$CLUSTER_HOURLY_USD`: what the whole cluster costs per hour."""

    @classmethod
    def from_environ(cls, environ=os.environ) -> "DistEnv":
        def path(name: str) -> Path | None:
            value = environ.get(name)
            return Path(value) if value else None

        world_size = int(environ.get("WORLD_SIZE", 1))
        return cls(
            rank=int(environ.get("RANK", 0)),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
            node_rank=int(environ.get("NODE_RANK", environ.get("GROUP_RANK", 0))),
            nnodes=int(environ.get("NNODES", 1)),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", 0) or 0),
            run_dir=path("CLUSTER_RUN_DIR"),
            shared_dir=path("CLUSTER_SHARED_DIR"),
            hourly_usd=float(environ.get("CLUSTER_HOURLY_USD", 0) or 0),
        )


@dataclass(frozen=True)
class Distributed:
    """A joined process group: who we are, where to compute, which backend."""

    env: DistEnv
    """The launch environment."""
    device: torch.device
    """`cuda:<local_rank>` on GPU nodes, `cpu` otherwise."""
    backend: str
    """`nccl` or `gloo`."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0


def pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout_s: float = 300.0) -> Distributed:
    """Join the process group (or make a world of one); RendezvousError names what to check."""
    if "RANK" not in os.environ:
        _single_process_defaults()
    env = DistEnv.from_environ()
    device, backend = pick_device(env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            **_attempt_store(env, timeout_s),
        )
    except (RuntimeError, ValueError, dist.DistError) as exc:
        raise RendezvousError(
            f"rank {env.rank} could not join the process group at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} within {timeout_s:.0f} s ({str(exc).splitlines()[0]}). "
            "Check that every node reaches MASTER_ADDR:MASTER_PORT (security group, firewall), that "
            "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME name the interface that routes there, and that all "
            "nodes started the same job."
        ) from exc
    return Distributed(env, device, backend)


def _attempt_store(env: DistEnv, timeout_s: float) -> dict:
    """Under torchrun's shared rendezvous store, join through a prefix of our own per restart attempt.

    torch 2.13 reuses the agent's store across restarts without separating attempts, so a restarted
    rank can read the address a dead rank published the attempt before and fail to connect to it.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"harness/attempt-{attempt}", store),
        "rank": env.rank,
        "world_size": env.world_size,
    }


def _single_process_defaults() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


_KEPT_UNTIL_EXIT: list = []


def keep_until_exit(ddp) -> None:
    """Never free this DDP model: one with a Python comm hook (a `Future.then` callback) deadlocks when
    freed at `main()`'s return, seen under load: its Reducer frees the gloo process group, which joins
    gloo's threads holding the GIL while one of them waits for the GIL to drop the hook's callback. `run`
    ends the process with `os._exit`, so what is kept here is never freed."""
    _KEPT_UNTIL_EXIT.append(ddp)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run(main: Callable[[], int]) -> NoReturn:
    """Run a script's `main()` and end the process with its exit code, skipping interpreter teardown.

    In torch 2.13, once `torch._inductor` is imported (`torch.optim` imports it), a gloo process group
    outlives `destroy_process_group()`, and its worker threads, still releasing tensors while the
    interpreter shuts down, can abort the process ("terminate called without an active exception"):
    a finished, successful rank would then fail the whole job. Everything is flushed first.
    """
    try:
        code = main()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only, flushed (logs are streamed line by line)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def fail(message: str, code: int = 1) -> None:
    """End this rank with a message on stderr; torchrun and `fab` take it from there."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    cleanup()
    sys.exit(code)
