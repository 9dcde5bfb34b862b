"""torchrun --nnodes 1 --nproc-per-node 1 examples/ft_training.py   (with a Lighthouse: torchft_lighthouse)
fab run --script examples/ft_training.py --replicas 2 --max-restarts 1

Fault-tolerant data parallel with torchft: every replica group (one per node under `fab --replicas`)
trains a copy of a tiny MLP on its own slice of each step's batch; torchft's Manager averages the
gradients across the groups that are alive. A group that dies is dropped at the next quorum (after the
Lighthouse's heartbeat timeout) and the others go on, no step redone; a group that comes back (torchrun's
`--max-restarts`, or a replacement node) fetches the model and optimizer state live from a peer
(`state_dict` / `load_state_dict` below) and rejoins at the peers' step. Each group's first rank writes
one line per committed step to `$CLUSTER_RUN_DIR/metrics.jsonl` (step, time, replica, participants,
params_sha). A checkpoint every `--checkpoint-every` steps stays for when every group is lost: a run
that starts again whole (a Slurm requeue, `$CLUSTER_RESTART_COUNT` > 0) resumes from it. On SIGUSR1 (a
spot notice on this group's node) the group leaves the quorum at the next step boundary, so its peers
redo no step; the last group in the quorum saves a checkpoint first, for the run's requeue. The loop that
does all this is harness/fault_tolerance.py's `Replica` (examples/ddp_training.py trains with it too);
this file brings the model, the optimizer and a step's loss.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from harness.args import ExampleParser, positive_float, positive_int
from harness.fault_tolerance import Replica, ReplicaConfig, replica_group
from harness.preemption import Preemption

CHECKPOINT = "ft-checkpoint.pt"


def parse_args(argv=None) -> argparse.Namespace:
    parser = ExampleParser(__doc__)
    parser.add_argument("--steps", type=positive_int, default=100, help="committed steps to train (default 100)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="samples per group per step")
    parser.add_argument("--step-sleep", type=seconds, default=0.0, help="seconds of pretend work per step")
    parser.add_argument("--checkpoint-every", type=positive_int, default=20, help="steps between checkpoints")
    parser.add_argument("--quorum-timeout", type=positive_float, default=30.0, help="seconds a quorum may take")
    return parser.parse_args(argv)


def seconds(text: str) -> float:
    """0 or more seconds."""
    return 0.0 if text.strip() in ("0", "0.0") else positive_float(text)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every group; the first quorum syncs it anyway
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def batch(step: int, replica: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This group's slice of step `step`: fixed by the step, so a step is never trained twice unseen."""
    generator = torch.Generator().manual_seed(step * 1000 + replica)
    inputs = torch.randn(size, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def checkpoint_path() -> Path:
    return Path(os.environ.get("CLUSTER_RUN_DIR") or ".") / CHECKPOINT


def main(argv=None) -> None:
    args = parse_args(argv)
    preemption = Preemption()  # a spot notice: leave at the next step boundary
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = ReplicaConfig(args.steps, checkpoint_path(), args.checkpoint_every, args.quorum_timeout, args.step_sleep)
    replica = replica_group()

    def loss_at(step: int) -> torch.Tensor:
        inputs, targets = batch(step, replica, args.batch_size)
        return torch.nn.functional.mse_loss(model(inputs), targets)

    Replica(model, optimizer, config).train(loss_at, preemption)


if __name__ == "__main__":
    main()
