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
redo no step; the last group in the quorum saves a checkpoint first, for the run's requeue.
"""

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torchft import Optimizer

from harness.args import ExampleParser, positive_float, positive_int
from harness.fault_tolerance import StepLog, bound_manager, bound_process_group
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
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    model = build_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict:  # what a healing group fetches from a live peer
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = bound_manager(
        pg=bound_process_group(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{replica}",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    resume_when_every_group_was_lost(manager, load_state_dict)
    optimizer = Optimizer(manager, inner)
    log = StepLog(replica) if int(os.environ.get("RANK", "0")) == 0 else None
    train(args, manager, model, optimizer, replica, log, preemption)
    manager.shutdown(wait=False)


def resume_when_every_group_was_lost(manager, load_state_dict) -> None:
    """A run started again whole (a requeue) resumes from the checkpoint; a group restarted alone
    heals from a live peer instead, and reads no file."""
    path = checkpoint_path()
    if int(os.environ.get("CLUSTER_RESTART_COUNT", "0")) > 0 and path.exists():
        saved = torch.load(path, weights_only=False)
        load_state_dict(saved["user"])
        manager.load_state_dict(saved["torchft"])
        print(f"replica {manager._replica_id}: resumed from {path} at step {manager.current_step()}", flush=True)


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


def train(args, manager, model, optimizer, replica: int, log: StepLog | None, preemption: Preemption) -> None:
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum: a group dropped or healed here
        inputs, targets = batch(step, replica, args.batch_size)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        average_gradients(manager, model)
        time.sleep(args.step_sleep)
        optimizer.step()  # commits only where every participant's all-reduce succeeded
        if manager.current_step() == step:
            continue  # not committed: the step is done again with the new quorum
        if log:
            line = log.write(manager.current_step(), manager.num_participants(), model, loss=round(loss.item(), 6))
            print(
                f"replica {replica} step {line['step']:4d} loss {loss.item():.4f} participants {line['participants']}"
            )
        if manager.current_step() % args.checkpoint_every == 0 and manager.participating_rank() == 0 and log:
            save_checkpoint(manager, model, optimizer)
        if preemption.asked:
            leave(manager, model, optimizer, replica, log)
            return


def leave(manager, model, optimizer, replica: int, log: StepLog | None) -> None:
    """A spot notice, at a step boundary: the group leaves the quorum (its peers' next quorum goes on
    without it, no step of theirs undone); the last group saves the step first, for the run's requeue."""
    alone = manager.num_participants() <= 1
    if alone and log:
        save_checkpoint(manager, model, optimizer)
    where = f"; checkpoint at step {manager.current_step()} saved" if alone else "; its peers go on"
    print(f"replica {replica} preempted (SIGUSR1) at step {manager.current_step()}{where}", flush=True)


def save_checkpoint(manager, model, optimizer) -> None:
    """Atomically, by the first participating group's first rank."""
    path = checkpoint_path()
    partial = path.with_suffix(".partial")
    state = {"user": {"model": model.state_dict(), "optim": optimizer.state_dict()}, "torchft": manager.state_dict()}
    torch.save(state, partial)
    partial.replace(path)


if __name__ == "__main__":
    main()
