"""torchrun --standalone --nproc-per-node 2 examples/profile_communication.py
fab profile --args "--max-bytes 256M --plot busbw.png"

Sweeps all-reduce, all-gather, reduce-scatter and broadcast over message sizes and prints one
nccl-tests table per operation (size, count, type, redop, root, time, algbw, busbw, #wrong), so the
figures compare directly with `all_reduce_perf -b 8 -e 256M -f 2 -g 1` run on the same nodes. Every
size is also checked for correct data (#wrong). The results go to JSON (`--json`, default `profile.json`)
and, with `--plot`, to a PNG of bus bandwidth against size, both in the results folder
(`$CLUSTER_RESULTS_DIR`, else `$CLUSTER_RUN_DIR`, else here) unless the path is absolute.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._plots import NO_MATPLOTLIB, pyplot
from harness.args import (
    ExampleParser,
    add_results_arguments,
    add_run_arguments,
    non_negative_int,
    positive_int,
)
from harness.comm_bench import OPS, average_busbw, format_table, measure, sizes
from harness.dist import cleanup, init_distributed, print0, run
from harness.metrics import MetricsWriter
from harness.results import results_path, write_json

RESULTS_JSON = "profile.json"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def byte_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8, 64K, 16M or 1G")
    return int(match.group(1)) * UNITS[match.group(2)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--min-bytes", type=byte_size, default=byte_size("1K"), help="smallest message (default 1K)")
    parser.add_argument(
        "--max-bytes", type=byte_size, default=None, help="largest message (default 64M on GPUs, 4M on CPU)"
    )
    parser.add_argument("--factor", type=positive_int, default=2, help="size multiplier between rows (default 2)")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed runs per size (default 5)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed runs per size (default 20)")
    add_results_arguments(parser, json_name=RESULTS_JSON, plot_what="busbw against size")
    add_run_arguments(parser, seed=False)
    args = parser.parse_args(argv)
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        parser.error(f"unknown --ops {', '.join(sorted(unknown))}; choose from {', '.join(OPS)}")
    if args.factor < 2:
        parser.error("--factor must be at least 2 (the sizes grow by it)")
    if args.max_bytes is not None and args.max_bytes < args.min_bytes:
        parser.error(f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}")
    return args


def plot(path: Path, results, world_size: int, backend: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r.op for r in results):
        rows = [r for r in results if r.op == op]
        axes.plot([r.size_bytes for r in rows], [r.busbw_gbps for r in rows], marker="o", label=op)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(f"collectives, {world_size} ranks, {backend}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"plot: {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        max_bytes = args.max_bytes or byte_size("64M" if ctx.device.type == "cuda" else "4M")
        ops = args.ops.split(",")
        results = []
        for op in ops:
            rows = [
                measure(op, size, ctx.device, args.warmup, args.iters)
                for size in sizes(args.min_bytes, max_bytes, args.factor)
            ]
            results += rows
            print0(format_table(op, ctx.world_size, ctx.backend, rows))
            print0()
        wrong = sum(r.wrong for r in results)
        summary = {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "warmup": args.warmup,
            "iters": args.iters,
            "results": [r.as_dict() for r in results],
            "avg_busbw_gbps": {op: average_busbw([r for r in results if r.op == op]) for op in ops},
            "wrong": wrong,
        }
        if ctx.is_rank0:
            print(f"results: {write_json(summary, results_path(args.json, RESULTS_JSON))}", flush=True)
            if args.plot:
                print(plot(results_path(args.plot, "busbw.png"), results, ctx.world_size, ctx.backend), flush=True)
        MetricsWriter(ctx.env.run_dir, ctx.is_rank0).write(
            "summary", example="profile_communication", avg_busbw_gbps=summary["avg_busbw_gbps"], wrong=wrong
        )
        return 0 if wrong == 0 else 1
    finally:
        cleanup()


if __name__ == "__main__":
    run(main)
