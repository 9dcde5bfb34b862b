"""Counting what collectives carry as they are issued, never computed from parameter counts.

Two ways in, one tally:
- DDP's communication hooks run wrapped (`register_counted_hook`): the hook is handed a
  `CountingProcessGroup` that forwards every all-reduce to the real group and counts it, whichever
  thread issues it (PowerSGD issues its second all-reduce from a completion callback).
- `CollectiveCounter` is torch's CommDebugMode (which sees the collectives issued on the calling
  thread, FSDP's all-gathers and reduce-scatters, tensor parallelism's all-reduces) adding up sizes.

Each collective is recorded with its size as nccl-tests counts it (the all-reduced tensor, the
all-gathered output, the reduce-scattered input) and with the bytes each rank sends for it in a
ring, size x bus factor: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter.
"""

import threading
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.distributed_c10d import GroupName
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from harness.comm_bench import bus_factor
from harness.dist import keep_until_exit

HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class OpTally:
    """One kind of collective, added up."""

    calls: int = 0
    """How many were issued."""
    size_bytes: int = 0
    """Their sizes, nccl-tests style."""
    sent_bytes: float = 0.0
    """What each rank sent for them in a ring (size x bus factor)."""


class CommTally:
    """Collectives by kind; safe to add to from any thread."""

    def __init__(self):
        self.ops: dict[str, OpTally] = {}
        self._lock = threading.Lock()

    def add(self, op: str, size_bytes: int, group_size: int) -> None:
        factor = (
            bus_factor(op, group_size)
            if op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
            else (group_size - 1) / group_size
        )
        with self._lock:
            tally = self.ops.setdefault(op, OpTally())
            tally.calls += 1
            tally.size_bytes += size_bytes
            tally.sent_bytes += size_bytes * factor

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()

    @property
    def calls(self) -> int:
        return sum(t.calls for t in self.ops.values())

    @property
    def size_bytes(self) -> int:
        return sum(t.size_bytes for t in self.ops.values())

    @property
    def sent_bytes(self) -> float:
        return sum(t.sent_bytes for t in self.ops.values())


def tensor_bytes(tensors) -> int:
    """Bytes of a tensor or of a (nested) list of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(tensor_bytes(t) for t in tensors)
    return 0


# ------------------------------------------------------------------------------------- DDP's hooks


class CountingProcessGroup(dist.ProcessGroup):
    """A process group that hands every all-reduce to a real one and counts what it carried.

    torch calls a Python ProcessGroup's methods for collectives issued on it; DDP's hooks issue only
    all-reduces, so that is all this forwards.
    """

    def __init__(self, inner: dist.ProcessGroup, tally: CommTally):
        # The binding also takes (rank, size), for Python subclasses; torch's stub lists only (store, rank, size).
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.inner, self.tally = inner, tally

    # torch calls a Python group's collectives as (tensors, opts); the stub's other overloads are ways to call
    # a C++ group from Python, which nothing does with this one.
    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        self.tally.add("all_reduce", tensor_bytes(tensors), self.size())
        return self.inner.allreduce(tensors, opts) if opts is not None else self.inner.allreduce(tensors)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.inner.getBackendName() if hasattr(self.inner, "getBackendName") else self.inner.name()


def register_counted_hook(
    ddp,
    hook: str,
    tally: CommTally,
    powersgd_rank: int = 1,
    start_iter: int = 2,
    group: dist.ProcessGroup | None = None,
):
    """Register DDP's `hook` (none, fp16, bf16 or powersgd) so that its all-reduces are counted into
    `tally`; returns the hook's state (PowerSGD's holds its error feedback and low-rank buffers)."""
    inner = group or dist.group.WORLD
    if inner is None:
        raise RuntimeError("register_counted_hook needs torch.distributed initialised first")
    counting = CountingProcessGroup(inner, tally)
    keep_until_exit(ddp)  # its hook is Python's: freeing it at exit can deadlock
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=counting, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=start_iter
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    plain = {
        "none": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }[hook]
    ddp.register_comm_hook(counting, plain)
    return counting


def bucket_cap_mb(model: torch.nn.Module, backend: str) -> float | None:
    """DDP's bucket size for the hooks: one bucket holding every gradient on gloo, DDP's default on NCCL.

    PowerSGD issues its second and third all-reduces from completion callbacks. On gloo those run
    on its worker threads, so with two buckets in flight two ranks can issue them in different
    orders, and the job hangs. NCCL runs them in order on the calling thread.
    """
    if backend == "nccl":
        return None
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1


def bf16_problem(hook: str, backend: str) -> str | None:
    """Why `hook` cannot run on `backend`, or None: the bf16 hook needs NCCL (gloo has no bf16 sum)."""
    if hook == "bf16" and backend != "nccl":
        return f"--hook bf16 needs NCCL (CUDA GPUs); this job uses {backend}: use --hook fp16"
    return None


# ------------------------------------------------------------------ everything else: a dispatch mode


def _group_size_of(group) -> int:
    if isinstance(group, str):  # functional collectives name their group
        return dist.distributed_c10d._resolve_process_group(GroupName(group)).size()
    return dist.ProcessGroup.unbox(group).size()


def collective_size(name: str, args) -> tuple[str, int, int] | None:
    """(kind, size in bytes, group size) of a collective op called with `args`, None for other ops."""
    if name in ("allreduce_", "allreduce_coalesced_"):
        return "all_reduce", tensor_bytes(args[0]), _group_size_of(args[1])
    if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
        return "all_reduce", tensor_bytes(args[0]), _group_size_of(args[2])
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        output, shard = tensor_bytes(args[0]), tensor_bytes(args[1])
        return "all_gather", output, max(1, output // max(shard, 1))
    if name == "allgather_":
        return "all_gather", tensor_bytes(args[0]), len(args[0][0])
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return "all_gather", tensor_bytes(args[0]) * args[1], args[1]
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        whole, shard = tensor_bytes(args[1]), tensor_bytes(args[0])
        return "reduce_scatter", whole, max(1, whole // max(shard, 1))
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return "reduce_scatter", tensor_bytes(args[0]), args[2]
    if name == "broadcast_":
        return "broadcast", tensor_bytes(args[0]), _group_size_of(args[1])
    if name == "broadcast":
        return "broadcast", tensor_bytes(args[0]), _group_size_of(args[2])
    if name in ("alltoall_base_", "all_to_all_single"):
        return "all_to_all", tensor_bytes(args[1] if name == "alltoall_base_" else args[0]), dist.get_world_size()
    return None


class CollectiveCounter(CommDebugMode):
    """CommDebugMode (collectives counted per kind and module, forward and backward) that also adds up
    the bytes each collective carries into `tally`."""

    def __init__(self, tally: CommTally | None = None):
        super().__init__()
        self.tally = tally if tally is not None else CommTally()

    def __enter__(self):
        # Two warnings that only this mode brings out, about things the lab's models never do:
        # CommDebugMode tracks modules with full backward hooks, which warn when the model's input
        # (token ids) needs no gradient; and under a dispatch mode FSDP sees the model's output (a
        # linear layer's, reshaped) as a view and warns against in-place ops on it.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(t is DTensor for t in types) and not isinstance(func, torch._ops.HigherOrderOperator):
            found = collective_size(func._overloadpacket.__name__, args) if _is_collective(func) else None
            if found:
                self.tally.add(*found)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _is_collective(func) -> bool:
    return func.namespace in ("c10d", "_c10d_functional", "c10d_functional")
