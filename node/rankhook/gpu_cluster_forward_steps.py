"""The compute of any training script's steps, for the straggler verdict (node/straggler.py), where the
script does not use the harness (whose StepLogger files its own: `harness.metrics.step_compute`).

In a data-parallel step the ranks wait for each other in the gradients' all-reduce, so a step's wall time
is the slowest rank's on every rank; the forward pass waits for nobody. So each call of the model's
forward is a step here, and its time the rank's own compute. The model is found, not named: global module
hooks watch the first forward passes of the script's main thread, the outermost module with the most
parameters is taken (the model, not a loss module called beside it; inside a DistributedDataParallel
wrapper, the module it wraps, whose forward leaves out the wrapper's buffer broadcast), and from then on
only that module is hooked, so the cost is two hook calls a step. On a GPU the forward is timed with CUDA
events read once they are done (no synchronization added); on the CPU by the clock.

Loaded by the rank monitor (gpu_cluster_rank_monitor.py) once the script has formed its process group;
torch is imported by then. Standard library only otherwise.
"""

import collections
import threading
import time

DISCOVERY_FORWARDS = 3
"""Outermost forward passes watched before the model is chosen."""
KEPT = 200
"""Steps whose compute is kept (node/straggler.py's KEPT_STEPS)."""


class ForwardSteps:
    """Counts the model's forward passes in the main thread and keeps (step, seconds) of the last `KEPT`."""

    def __init__(self, main_ident: int | None = None):
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident
        self.step: int | None = None
        """Forward passes of the model so far (None until its first one ended)."""
        self.compute: collections.deque = collections.deque(maxlen=KEPT)
        self.model = None
        self._seen: list = []
        self._depth = 0
        self._outer = None
        self._started: float | None = None
        self._events = None
        self._pending: collections.deque = collections.deque()
        self._handles: list = []

    def install(self) -> "ForwardSteps":
        """Watch every module's forward until the model is known (`_choose`)."""
        from torch.nn.modules import module

        self._handles = [
            module.register_module_forward_pre_hook(self._discover_before),
            module.register_module_forward_hook(self._discover_after),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _discover_before(self, mod, _inputs) -> None:
        if threading.get_ident() != self.main_ident:
            return
        if self._depth == 0:
            self._outer = mod
        self._depth += 1

    def _discover_after(self, mod, _inputs, _output) -> None:
        if threading.get_ident() != self.main_ident or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and mod is self._outer:
            self._seen.append(mod)
            if len(self._seen) >= DISCOVERY_FORWARDS:
                self._choose()

    def _choose(self) -> None:
        """The model: the outermost module seen with the most parameters; its own hooks from now on."""
        self.remove()
        outer = max(self._seen, key=_parameter_count)
        self._seen = []
        model = getattr(outer, "module", outer) if type(outer).__name__ == "DistributedDataParallel" else outer
        self.model, self._events = model, _cuda_events(model)
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, _mod, _inputs) -> None:
        if threading.get_ident() != self.main_ident:
            return
        self._settle()
        if self._events is not None:
            start = self._events(enable_timing=True)
            start.record()
            self._started = start
        else:
            self._started = time.perf_counter()

    def _after(self, _mod, _inputs, _output) -> None:
        if threading.get_ident() != self.main_ident or self._started is None:
            return
        step = (self.step or 0) + 1
        self.step = step
        if self._events is not None:
            end = self._events(enable_timing=True)
            end.record()
            self._pending.append((step, self._started, end))
        else:
            self.compute.append((step, round(time.perf_counter() - self._started, 6)))
        self._started = None

    def _settle(self) -> None:
        """File the GPU forwards whose events are done (a step later, typically)."""
        while self._pending and self._pending[0][2].query():
            step, start, end = self._pending.popleft()
            self.compute.append((step, round(start.elapsed_time(end) / 1000, 6)))

    def entries(self) -> list:
        """[[step, seconds]] as the rank monitor reports them."""
        try:
            return [list(entry) for entry in list(self.compute)]
        except RuntimeError:  # the main thread appended while this one copied: the next report has them
            return []


def _parameter_count(mod) -> int:
    try:
        return sum(p.numel() for p in mod.parameters())
    except Exception:
        return 0


def _cuda_events(model):
    """torch.cuda.Event where the model's parameters are on a GPU, else None (timed by the clock)."""
    try:
        parameter = next(model.parameters())
    except (StopIteration, AttributeError):
        return None
    if parameter.device.type != "cuda":
        return None
    import torch

    return torch.cuda.Event
