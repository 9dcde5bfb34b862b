"""A run's states, whichever holder holds it, and Slurm's job states onto them: the one place that names them.

Standard library only.
"""

from enum import Enum


class RunState(str, Enum):
    """A run's state (`fab jobs --json`'s `state`; a `str`, so a record's JSON holds its name)."""

    PENDING = "PENDING"
    """Waits to start (in Slurm's queue)."""
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    """Stopped from outside: fab stop, Ctrl-C, scancel, a down."""
    HUNG = "HUNG"
    """The hang watch found it hung and stopped it."""
    PREEMPTED = "PREEMPTED"
    """Waits to start again: a spot notice or a lost node requeued it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_final(self) -> bool:
        """It runs no more."""
        return self in FINAL

    @classmethod
    def from_slurm(cls, slurm_state: str) -> "RunState":
        """A run's state for Slurm's job state (an unknown one is taken as running: it has not ended)."""
        return SLURM_STATES.get(slurm_state, cls.RUNNING)


FINAL = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.HUNG})

SLURM_STATES = {
    **dict.fromkeys(
        ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"), RunState.PENDING
    ),
    **dict.fromkeys(("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING"), RunState.RUNNING),
    **dict.fromkeys(("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), RunState.FAILED),
    "COMPLETED": RunState.COMPLETED,
    "CANCELLED": RunState.CANCELLED,
    "PREEMPTED": RunState.PREEMPTED,
    "HUNG": RunState.HUNG,
}
"""Slurm's job states onto a run's. COMPLETING (a slurmctld restart shows it for a while) is still running;
TIMEOUT, NODE_FAIL and the like are failures."""
