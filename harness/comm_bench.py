"""Collective bandwidth, measured and printed the way nccl-tests does, so the figures compare with
`all_reduce_perf` on the same nodes (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

size is the whole buffer in bytes (for all-gather the gathered output, for reduce-scatter the input),
time is the mean over ranks of each rank's mean time per operation, algbw = size / time, and busbw
= algbw x the operation's bus factor: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, 1 for broadcast. #wrong counts elements that differ from the expected result in a
separate, verified run of each size.
"""

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ELEMENT_BYTES = 4  # float32
# torch 2.13 renamed the tensor forms (the old names warn); images with an older torch have only those.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
HEADER = (
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)        "
)


@dataclass(frozen=True)
class CollectiveResult:
    """One row of the table: one operation at one size."""

    op: str
    """all_reduce, all_gather, reduce_scatter or broadcast."""
    size_bytes: int
    """Bytes of the whole buffer."""
    count: int
    """Elements of the whole buffer."""
    dtype: str
    """Element type (float)."""
    redop: str
    """Reduction (sum), or none."""
    root: int
    """Root rank for broadcast, -1 otherwise."""
    time_us: float
    """Mean time per operation."""
    algbw_gbps: float
    """size / time, in GB/s (1e9 bytes)."""
    busbw_gbps: float
    """algbw x bus factor: comparable across operations and world sizes."""
    wrong: int
    """Elements that differed from the expected result, summed over ranks."""

    def as_dict(self) -> dict:
        return asdict(self)


def bus_factor(op: str, world_size: int) -> float:
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "broadcast": 1.0}[
        op
    ]


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    result, size = [], max(min_bytes, ELEMENT_BYTES)
    while size <= max_bytes:
        result.append(size)
        size *= factor
    return result


def element_count(size_bytes: int, world_size: int) -> int:
    """Elements for a buffer of about `size_bytes`, a multiple of the world size (chunks must be equal)."""
    count = max(size_bytes // ELEMENT_BYTES, 1)
    return -(-count // world_size) * world_size


class Collective:
    """Buffers for one operation at one size, a way to run it, and a way to check it."""

    def __init__(self, op: str, count: int, device: torch.device):
        self.op, self.count, self.device = op, count, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        chunk = count // self.world
        shapes = {
            "all_reduce": (count, count),
            "all_gather": (chunk, count),
            "reduce_scatter": (count, chunk),
            "broadcast": (count, count),
        }[op]
        self.input = torch.empty(shapes[0], device=device)
        self.output = self.input if op in ("all_reduce", "broadcast") else torch.empty(shapes[1], device=device)

    def run(self) -> None:
        if self.op == "all_reduce":
            dist.all_reduce(self.input)
        elif self.op == "all_gather":
            ALL_GATHER(self.output, self.input)
        elif self.op == "reduce_scatter":
            REDUCE_SCATTER(self.output, self.input)
        else:
            dist.broadcast(self.input, src=0)

    def fill_known(self) -> None:
        """Inputs whose correct result is known: small integers, exact in float32."""
        positions = torch.arange(self.input.numel(), device=self.device, dtype=torch.float32) % 97
        self.input.copy_(positions + self.rank)
        if self.op == "broadcast" and self.rank != 0:
            self.input.fill_(-1.0)

    def expected(self) -> torch.Tensor:
        n, rank_sum = self.world, self.world * (self.world - 1) / 2
        positions = torch.arange(self.count, device=self.device, dtype=torch.float32) % 97
        if self.op == "all_reduce":
            return positions * n + rank_sum
        if self.op == "all_gather":
            chunk = self.count // n
            return torch.cat([torch.arange(chunk, device=self.device, dtype=torch.float32) % 97 + r for r in range(n)])
        if self.op == "reduce_scatter":
            chunk = self.count // n
            return (positions * n + rank_sum)[self.rank * chunk : (self.rank + 1) * chunk]
        return positions

    def count_wrong(self) -> int:
        self.fill_known()
        self.run()
        synchronize(self.device)
        return int((self.output != self.expected()).sum().item())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_op_s(collective: Collective, warmup: int, iters: int) -> float:
    """This rank's mean seconds per operation, device work included, after `warmup` untimed runs."""
    collective.input.normal_()
    for _ in range(warmup):
        collective.run()
    synchronize(collective.device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        collective.run()
    synchronize(collective.device)
    return (time.perf_counter() - started) / iters


def mean_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def sum_over_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor)
    return int(tensor.item())


def measure(op: str, size_bytes: int, device: torch.device, warmup: int, iters: int) -> CollectiveResult:
    world = dist.get_world_size()
    collective = Collective(op, element_count(size_bytes, world), device)
    seconds = mean_over_ranks(time_per_op_s(collective, warmup, iters), device)
    wrong = sum_over_ranks(collective.count_wrong(), device)
    size = collective.count * ELEMENT_BYTES
    algbw = size / seconds / 1e9
    return CollectiveResult(
        op=op,
        size_bytes=size,
        count=collective.count,
        dtype="float",
        redop="sum" if op in ("all_reduce", "reduce_scatter") else "none",
        root=0 if op == "broadcast" else -1,
        time_us=seconds * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * bus_factor(op, world),
        wrong=wrong,
    )


def format_row(result: CollectiveResult) -> str:
    return (
        f"{result.size_bytes:>12d}  {result.count:>12d}  {result.dtype:>8s}  {result.redop:>6s}  {result.root:>6d}  "
        f"{result.time_us:>7.1f}  {result.algbw_gbps:>6.2f}  {result.busbw_gbps:>6.2f}  {result.wrong:>6d}"
    )


def format_table(op: str, world_size: int, backend: str, results: list[CollectiveResult]) -> str:
    rows = [r for r in results if r.op == op]
    lines = [f"# {op}: {world_size} ranks, {backend}", HEADER, *(format_row(r) for r in rows)]
    wrong = sum(r.wrong for r in rows)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {average_busbw(rows):.4f} ")
    return "\n".join(lines)


def average_busbw(results: list[CollectiveResult]) -> float:
    return sum(r.busbw_gbps for r in results) / len(results) if results else 0.0
