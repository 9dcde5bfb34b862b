"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, a
commit marker is written last, and loading reshards to whatever layout runs now.

    <dir>/step-00000040/            one checkpoint: a .distcp file per rank and DCP's .metadata
    <dir>/step-00000040/COMMITTED   written by rank 0 once every rank's shards are on disk

A save that is interrupted (a node lost, the job stopped) leaves a folder without the marker, and
`latest_committed` never picks it. DCP stores each tensor with its global shape and offsets, so a
checkpoint saved by 4 ranks loads on 2 (or 1): every rank reads the pieces its new shards cover.
With `async_save=True`, a save copies the state aside and writes it while training goes on; the
marker follows when the write has finished, at the next save or at the end.
"""

import argparse
import json
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from harness.args import positive_int

COMMIT_MARKER = "COMMITTED"
KEEP = 2  # committed checkpoints kept; older ones are removed after a new one commits


def add_checkpoint_arguments(parser: argparse.ArgumentParser, async_save: bool = True) -> None:
    """`--checkpoint-dir`, `--checkpoint-every` and, where the example saves with DCP (`async_save`),
    `--async-save`: an example that saves otherwise does not offer a flag it would ignore."""
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save and resume here; relative: inside $CLUSTER_SHARED_DIR (default: $CLUSTER_RUN_DIR/checkpoints)",
    )
    parser.add_argument("--checkpoint-every", type=positive_int, default=20, help="save every N steps and at the end")
    if async_save:
        parser.add_argument("--async-save", action="store_true", help="write checkpoints while training goes on")


def checkpoint_root(given: Path | None, shared_dir: Path | None, run_dir: Path | None) -> Path | None:
    """Where checkpoints go: `--checkpoint-dir` (a relative one inside `$CLUSTER_SHARED_DIR`, which every
    node sees, so another run can resume from it), else this run's folder (`$CLUSTER_RUN_DIR`, so a
    torchrun restart resumes), else nowhere."""
    if given is not None:
        return given if given.is_absolute() or shared_dir is None else shared_dir / given
    return run_dir / "checkpoints" if run_dir else None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*"):
        if (path / COMMIT_MARKER).is_file() and path.name[len("step-") :].isdigit():
            steps.append(int(path.name[len("step-") :]))
    return sorted(steps)


def latest_committed(root: Path) -> Path | None:
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def write_marker(path: Path, step: int, world_size: int) -> None:
    """The commit marker, itself written atomically (a temporary file renamed into place)."""
    tmp = path / f".{COMMIT_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"step": step, "world_size": world_size, "committed_at": time.time()}) + "\n")
    os.replace(tmp, path / COMMIT_MARKER)


class StageCheckpointer:
    """Each rank's own module and optimizer (a pipeline stage: the ranks hold different layers under the same
    names, which DCP would take for one replicated tensor), one file per rank in a committed step folder."""

    def __init__(self, root: Path):
        self.root = root
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def save(self, step: int, module: nn.Module, optimizer) -> None:
        path = step_dir(self.root, step)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".stage-{self.rank}.{os.getpid()}.tmp"
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, path / f"stage-{self.rank}.pt")
        dist.barrier()  # every stage written before the step is committed
        if self.rank == 0:
            write_marker(path, step, self.world_size)
            for old in committed_steps(self.root)[:-KEEP]:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        dist.barrier()

    def load_latest(self, module: nn.Module, optimizer, device) -> int:
        """Load this rank's stage of the newest committed step; the step, or 0 where there is none. A step
        saved by another number of stages cannot be loaded into these: ValueError naming both."""
        path = latest_committed(self.root)
        if path is None:
            return 0
        marker = json.loads((path / COMMIT_MARKER).read_text())
        if marker["world_size"] != self.world_size:
            raise ValueError(
                f"the checkpoint in {path} has {marker['world_size']} pipeline stages, this run {self.world_size}: "
                "start with the same number of ranks, or another --checkpoint-dir"
            )
        state = torch.load(path / f"stage-{self.rank}.pt", map_location=device, weights_only=True)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return int(marker["step"])


class ShardedCheckpointer:
    """Saves and loads a model and its optimizer as DCP checkpoints under `root` (shared by all nodes)."""

    def __init__(self, root: Path, async_save: bool = False):
        self.root, self.async_save = root, async_save
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pending: tuple[int, Future] | None = None
        # An async save runs collectives from a background thread: on a group of its own, so they can
        # never interleave with training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if async_save else None

    def save(self, step: int, model: nn.Module, optimizer) -> None:
        self.wait()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        path = step_dir(self.root, step)
        if self.async_save:
            saving = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
            # A Future, or with an async stager (not used here) a response whose upload_completion is one.
            self.pending = (step, saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving)
        else:
            dcp.save(state, checkpoint_id=path)
            self._commit(step)

    def wait(self) -> None:
        """Finish an async save in flight and commit it."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        future.result()
        self._commit(step)

    def _commit(self, step: int) -> None:
        # DCP's save returns on rank 0 only after every rank has reported its shards written.
        if self.rank == 0:
            write_marker(step_dir(self.root, step), step, self.world_size)
            for old in committed_steps(self.root)[:-KEEP]:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        dist.barrier()

    def load_latest(self, model: nn.Module, optimizer) -> tuple[int, int]:
        """Load the newest committed checkpoint into this layout; (the step it was saved at, how many
        ranks saved it), or (0, 0) where there is none."""
        path = latest_committed(self.root)
        if path is None:
            return 0, 0
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, dict[str, Any]] = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        marker = json.loads((path / COMMIT_MARKER).read_text())
        return marker["step"], marker["world_size"]
