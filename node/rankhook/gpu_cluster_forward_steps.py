"""The compute of any training script's steps, for the straggler verdict (node/straggler.py), where the
script does not use the harness (whose StepLogger files its own: `harness.metrics.step_compute`).

In a data-parallel step the ranks wait for each other in the gradients' all-reduce, so a step's wall time
is the slowest rank's on every rank; the forward pass waits for nobody. So each training forward of the
model is a step here, and its time the rank's own compute. The model is found, not named: global module
hooks watch the first training forward passes of the script's main thread (in training mode, gradients on:
an evaluation's or a generation's forwards are not steps), and the outermost module with the most
parameters is taken (the model, not a loss module called beside it; inside a DistributedDataParallel
wrapper, the module it wraps, whose forward leaves out the wrapper's buffer broadcast).

Nothing is registered on the user's modules: the hooks stay global and look for the model by identity (a
weak reference), so a `torch.save(model)` or a `copy.deepcopy(model)` of the script's never carries them.
A hook that fails removes itself: the step times stop, the training goes on. On a GPU the forward is timed
with CUDA events on the model's device's current stream, read once they are done (no synchronization
added; none while a CUDA graph is being captured); on the CPU by the clock.

Loaded by the rank monitor (gpu_cluster_rank_monitor.py) once the script has formed its process group;
torch is imported by then. Standard library only otherwise.
"""

import collections
import sys
import threading
import time
import weakref

DISCOVERY_FORWARDS = 3
"""Outermost training forward passes watched before the model is chosen."""
KEPT = 200
"""Steps whose compute is kept (node/straggler.py's KEPT_STEPS)."""


class ForwardSteps:
    """Counts the model's training forward passes in the main thread and keeps (step, seconds) of the last
    `KEPT`."""

    def __init__(self, main_ident: int | None = None):
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident
        self.step: int | None = None
        """Training forward passes of the model so far (None until its first one ended)."""
        self.compute: collections.deque = collections.deque(maxlen=KEPT)
        self._model: weakref.ref | None = None
        self._seen: list = []
        self._depth = 0
        self._outer = None
        self._started = None
        self._device = None
        self._pending: collections.deque = collections.deque()
        self._handles: list = []

    @property
    def model(self):
        return self._model() if self._model is not None else None

    def install(self) -> "ForwardSteps":
        from torch.nn.modules import module

        self._handles = [
            module.register_module_forward_pre_hook(self._guarded(self._before)),
            module.register_module_forward_hook(self._guarded(self._after)),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _guarded(self, hook):
        """The hook, but one that fails is said once and removed, never the user's forward's failure."""

        def guarded(*args):
            try:
                hook(*args)
            except Exception as exc:  # noqa: BLE001 - the user's training goes on, untimed
                self.remove()
                print(f"gpu-cluster: step times of this script stop ({type(exc).__name__}: {exc})", file=sys.stderr)

        return guarded

    def _before(self, mod, _inputs) -> None:
        if threading.get_ident() != self.main_ident:
            return
        model = self.model
        if model is None:
            if self._depth == 0:
                self._outer = mod
            self._depth += 1
        elif mod is model and _training(mod):
            self._settle()
            self._started = self._start_timer()

    def _after(self, mod, _inputs, _output) -> None:
        if threading.get_ident() != self.main_ident:
            return
        model = self.model
        if model is None:
            self._discovered(mod)
        elif mod is model and self._started is not None:
            step = (self.step or 0) + 1
            self.step = step
            if isinstance(self._started, float):
                self.compute.append((step, round(time.perf_counter() - self._started, 6)))
            else:
                self._pending.append((step, self._started, self._record()))
            self._started = None

    def _discovered(self, mod) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and mod is self._outer:
            self._outer = None
            if _training(mod):
                self._seen.append(mod)
            if len(self._seen) >= DISCOVERY_FORWARDS:
                self._choose()

    def _choose(self) -> None:
        """The model: the outermost training module seen with the most parameters."""
        outer = max(self._seen, key=_parameter_count)
        self._seen = []
        model = getattr(outer, "module", outer) if type(outer).__name__ == "DistributedDataParallel" else outer
        self._device = _cuda_device(model)
        self._model = weakref.ref(model)

    def _start_timer(self):
        return time.perf_counter() if self._device is None else self._record()

    def _record(self):
        """A CUDA event recorded on the model's device's current stream (None while a graph is captured)."""
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _settle(self) -> None:
        """File the GPU forwards whose events are done (a step later, typically)."""
        while self._pending:
            step, start, end = self._pending[0]
            if start is None or end is None:
                self._pending.popleft()
                continue
            if not end.query():
                return
            self._pending.popleft()
            self.compute.append((step, round(start.elapsed_time(end) / 1000, 6)))

    def entries(self) -> list:
        """[[step, seconds]] as the rank monitor reports them."""
        try:
            return [list(entry) for entry in list(self.compute)]
        except RuntimeError:  # the main thread appended while this one copied: the next report has them
            return []


def _training(mod) -> bool:
    """A training forward: the module in training mode, with gradients on."""
    import torch

    return bool(getattr(mod, "training", False)) and torch.is_grad_enabled()


def _parameter_count(mod) -> int:
    try:
        return sum(p.numel() for p in mod.parameters())
    except Exception:
        return 0


def _cuda_device(model):
    """The GPU the model's parameters are on, else None (timed by the clock)."""
    try:
        parameter = next(model.parameters())
    except (StopIteration, AttributeError):
        return None
    return parameter.device if parameter.device.type == "cuda" else None
