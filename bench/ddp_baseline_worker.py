"""Plain DDP of examples/ft_training.py's model, batch and pretend work per step, for bench_ft's
throughput baseline: the same nodes, one torchrun job across them, gloo. Rank 0 appends one line per
step to `$CLUSTER_RUN_DIR/metrics.jsonl` (`kind` ddp_step, `step`, `time`), as a replica group does.

    fab run --script bench/ddp_baseline_worker.py --args "--steps 60 --step-sleep 0.05"
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from examples.ft_training import batch, build_model, parse_args  # noqa: E402
from node import contract  # noqa: E402


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    metrics = Path(os.environ.get("CLUSTER_RUN_DIR") or ".") / contract.METRICS_FILE
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        inputs, targets = batch(step, rank, args.batch_size)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        time.sleep(args.step_sleep)
        optimizer.step()
        if rank == 0:
            with metrics.open("a") as f:
                f.write(json.dumps({"kind": "ddp_step", "step": step, "time": time.time()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
