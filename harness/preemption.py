"""The spot notice's contract for a training loop: SIGUSR1 means "save and exit, you will be started again".

On a spot interruption notice the cluster sends SIGUSR1 to every rank of the node being reclaimed (Slurm's
and PyTorch Lightning's convention), then requeues the run; it starts again with the same
`$CLUSTER_RUN_DIR`, and `$CLUSTER_RESTART_COUNT` counts the restarts. A loop keeps its promise thus:

    preemption = Preemption()              # before training: SIGUSR1 now only raises a flag
    for step in ...:
        train_step(...)
        if preemption.agreed(device):       # at each step boundary: one all-reduce of the flag
            save_checkpoint(...); break     # every rank stops at the same step, no step is lost
    # at start: resume from the checkpoint, as after any restart

Only some ranks get the signal (those on the reclaimed node), so the ranks agree first: a rank that
saved alone would leave the others waiting in the next collective.
"""

import os
import signal

import torch
import torch.distributed as dist

RESTART_COUNT_VARIABLE = "CLUSTER_RESTART_COUNT"


class Preemption:
    """SIGUSR1, caught: a flag the ranks agree on at a step boundary."""

    def __init__(self):
        self.asked = False
        self.stopped_at: int | None = None
        """The step the ranks stopped after, once they agreed to (a loop sets it)."""
        signal.signal(signal.SIGUSR1, self._ask)

    def _ask(self, signum, frame) -> None:
        self.asked = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank has been asked to stop (every rank must call this at the same step)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.asked
        flag = torch.tensor([1 if self.asked else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop(self, step: int) -> None:
        self.stopped_at = step

    def step_ended(self, step: int, done: bool, due: bool, save, device) -> bool:
        """At a step boundary: `save(step)` where `due` (periodic, or the last step; `save` None: the loop
        keeps no checkpoints), then, unless it was the last step, agree on a notice; on one, save this
        step if not saved already. True when the loop must stop here."""
        if save is not None and due:
            save(step)
        if done or not self.agreed(device):
            return False
        if save is not None and not due:
            save(step)
        self.stop(step)
        return True

    def line(self, where) -> str:
        """What rank 0 prints as it exits to be started again."""
        saved = f"checkpoint at step {self.stopped_at} saved in {where}" if where else "no checkpoint folder"
        return f"preempted (SIGUSR1) at step {self.stopped_at}: {saved}; exiting to be started again"


def restart_count() -> int:
    """How many times the cluster has started this run again (0 on its first start)."""
    value = os.environ.get(RESTART_COUNT_VARIABLE, "0")
    return int(value) if value.isdigit() else 0
