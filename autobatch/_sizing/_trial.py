"""One trial of a training (or inference) step at a given batch size.

This module sets trials up and tears them down (:func:`prepared`: everything a trial may change
is saved and put back), runs one at a size and records it (:class:`TrialRunner`, a
:class:`~autobatch._search.Trial`), measuring through :mod:`autobatch._memory._measure`. It never
decides which size to try (that is :mod:`autobatch._search`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autobatch._batch import tensors
from autobatch._log import get_logger, user_stacklevel
from autobatch._memory._backends import AllocationModel, DeviceMemory, free_memory
from autobatch._memory._measure import (
    PeakKeeping,
    Replays,
    StorageTrial,
    _curve,
    _replayed_curve,
    _StepPeaks,
)
from autobatch._oom import failure_kind
from autobatch._search import Trial
from autobatch._sizing._state import SavedState, modules_referenced, state_referenced
from autobatch._sizing._workload import (
    Batch,
    LossFn,
    OptimizerLike,
    StepFn,
    TrainingStep,
    check_default_step,
    check_initialized,
    eager_view,
    is_compiled,
    make_optimizer,
)
from autobatch._units import format_bytes

logger = get_logger("trial")


@dataclass(frozen=True)
class TrialSetup:
    """What a front-end runs trials with: the step, and the optimizer it steps (if any)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    step: TrainingStep
    memory: PeakKeeping
    compiled: bool = False  # the model has compiled parts
    measured_eager: bool = False  # ... and the trials run their eager originals

    fresh_optimizer: bool = False  # the optimizer had no state when the search began
    saved: SavedState | None = None  # the state as the search began

    def drop_gradients(self) -> None:
        """Set every gradient to None, and let the last loss go: after a failed trial, and
        between trials."""
        self.step.forget()
        torch.clear_autocast_cache()  # (a search inside torch.autocast: its weights' casts)
        if self.saved is not None:  # (a hidden state a trial kept on a module, say)
            self.saved.put_back_attributes()
        self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def start_over(self) -> None:
        """Before a trial that replays the user's first steps: the weights, buffers,
        optimizer state and random streams as the search began (see
        :meth:`~autobatch._sizing._state.SavedState.rewind`), gradients dropped, and the
        optimizer's state, if the user's had none, dropped too (its first step makes it)."""
        if self.saved is not None:
            self.saved.rewind()
        self.drop_gradients()
        if self.optimizer is not None and self.fresh_optimizer:
            self.optimizer.state.clear()


@contextlib.contextmanager
def prepared(
    model: nn.Module,
    optimizer: OptimizerLike,
    memory: DeviceMemory,
    *,
    train: bool,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    scaler: Any,
) -> Iterator[TrialSetup]:
    """The one setup and teardown around trials: the optimizer made, everything a trial may
    change saved (:class:`~autobatch._sizing._state.SavedState`), the model in eval mode for inference
    and, where it was in eval mode as a whole, in train mode for training;
    afterwards gradients dropped, everything put back, the device's peak counter raised back to
    what it would read had no trial reset it (``work.memory``, :class:`PeakKeeping`, is what
    trials measure with) and the device cache emptied, also when a trial raised."""
    if train and step_fn is None and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "train=True, but the model has nothing to train: none of its parameters requires "
            "a gradient. Unfreeze what you train (p.requires_grad_(True)), or pass train=False "
            "to size inference"
        )
    check_initialized(model)
    made = make_optimizer(optimizer if train else None, model)
    check_default_step(made, step_fn, train)
    _warn_uncounted(memory, model, made if made is optimizer else None)
    referenced = state_referenced(loss_fn, step_fn)  # (what a step_fn steps is put back too)
    saved_state = SavedState(
        model, made,
        tuple({id(x): x for x in (scaler, *referenced) if x is not None
               and not isinstance(x, torch.optim.Optimizer)}.values()),
        modules=tuple(m for m in modules_referenced(loss_fn, step_fn) if m is not model),
        optimizers=tuple(x for x in referenced if isinstance(x, torch.optim.Optimizer)),
    )
    compiled = is_compiled(model)
    under_mode = bool(_get_current_dispatch_mode_stack())
    views = contextlib.ExitStack()
    runs = views.enter_context(eager_view(model)) if compiled and under_mode else model
    if compiled and under_mode:
        warnings.warn(
            "the model is compiled, but a dispatch mode is active (a SimulatedGPU's accounting), "
            "under which compiled code cannot run: its trials run the eager model, whose memory "
            "may differ from the compiled graph's; on the real device the compiled graph is "
            "measured. The model stays compiled",
            stacklevel=user_stacklevel(),
        )
    work = TrialSetup(
        runs,
        made,
        TrainingStep(runs, made, loss_fn=loss_fn, step_fn=step_fn, train=train, scaler=scaler),
        PeakKeeping(memory),
        compiled=compiled,
        measured_eager=compiled and under_mode,
        fresh_optimizer=made is not None and not made.state,
        saved=saved_state,
    )
    try:
        if not train:
            model.eval()
        elif not model.training:  # (a from_pretrained model, or one right after validation)
            model.train()  # dropout as training runs it; the saved state puts each mode back
        yield work
    finally:
        views.close()
        work.drop_gradients()
        saved_state.restore()
        memory.empty_cache()
        work.memory.restore_peak()  # the user's max_memory_allocated() as if never reset
        memory.empty_cache()


def _warn_uncounted(
    memory: DeviceMemory, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Warn when a simulated GPU does not count the model (or the caller's optimizer state):
    built before the simulator was entered and not adopted, its bytes would be missing from
    every trial, and the size found too large by that much."""
    held: list[Any] = [model] if optimizer is None else [model, optimizer]
    missing = memory.uncounted_bytes(held)
    if missing:
        warnings.warn(
            f"{format_bytes(missing)} of the model's parameters, buffers, gradients or "
            "optimizer state are not counted by the active SimulatedGPU (created before it was "
            "entered): every trial would leave them out and find a batch too large. Call "
            "gpu.adopt(model, optimizer) first",
            stacklevel=user_stacklevel(),
        )


def failure_of(run: Callable[[], None]) -> str | None:
    """Runs ``run``; returns None, or the kind of a batch-size-dependent failure (an OOM or a
    size limit). Any other error propagates. A failed run's tensors die with ``run``'s
    frame and the exception, both gone once this returns: clean up after it, not inside."""
    try:
        run()
    except Exception as error:
        kind = failure_kind(error)
        if kind is None:  # not a matter of batch size: not ours to handle
            raise
        return kind
    return None


#: The fewest steps a trial runs where the allocator caches. Its blocks are cut anew in every
#: step (a small block still held, the last step's loss, moves where the next ones go), so a
#: layout that held in the second step can still run out in the fifth while the reserved
#: memory never grew: a size fits when this many steps of the user's loop ran.
CACHING_STEPS = 5

#: The most steps a trial adds after those while the reserved memory still grows.
MAX_STEADY_STEPS = 3


class _SteadyState:
    """Further steps of a trial where the allocator caches, while its reserved memory still
    grows at the end of the :data:`CACHING_STEPS` steps every such trial runs.

    A caching allocator reserves segments in the first steps and serves later steps from them;
    a later step can still need a new segment (the cache is cut differently), and it is then
    that memory runs out. Where the last of the steps every trial runs reserved more than the
    ones before it, the trial goes on while each step still reserves more, for at most
    :data:`MAX_STEADY_STEPS` steps. Without a caching allocator (``memory`` is ``None``), or
    not ``adaptive`` (ranks that must run the same steps cannot each decide), it runs nothing.
    """

    def __init__(self, memory: DeviceMemory | None, adaptive: bool = True) -> None:
        self.memory = memory
        self.adaptive = adaptive
        self.extra = 0  # steps run here
        self.allocated = 0  # their highest allocated peak
        self.reserved: int | None = None  # the highest reserved peak of every step

    def run(self, step: Callable[[], Any], reserved: int | None, grew: bool) -> None:
        """Step while the reserved peak grows; ``reserved``: the steps' peak so far, ``grew``:
        whether the last of them raised it."""
        memory = self.memory
        self.reserved = reserved
        if memory is None or reserved is None or not self.adaptive or not grew:
            return
        while self.extra < MAX_STEADY_STEPS:
            memory.reset_peak()
            step()
            memory.synchronize()
            self.extra += 1
            self.allocated = max(self.allocated, memory.peak_bytes())
            peak = memory.peak_reserved_bytes()
            if peak is None or peak <= reserved:
                return  # steady: this step found room in what the earlier ones reserved
            self.reserved = reserved = peak


class TrialRunner:
    """Runs the step at a size and reports a :class:`~autobatch._search.Trial`.

    ``make_batch(n)`` builds the batch on the device, ``step(batch)`` runs one step; each step
    gets a new batch, made while the last one is still held, as a training loop does. Every
    trial starts from the same state: ``cleanup`` (dropping the gradients, the last loss, and
    where the search replays the user's first steps the optimizer's fresh state) runs before
    and after it, so no part of a trial's memory depends on what the trial before it left.
    After a failure the runner leaves the ``except`` block, cleans up and frees cached memory
    before the next trial. Under a caching allocator (CUDA, the caching simulator) every trial
    starts from an empty cache, runs :data:`CACHING_STEPS` steps at least, and more while its
    reserved memory still grows (see :class:`_SteadyState`): the trial's ``reserved_bytes`` is
    the peak, and its ``steps`` how many ran. Ranks that search together pass
    ``adaptive=False``: every trial then runs those steps only, so that all of them run the
    same steps. Where the backend has a copy of its allocator (:meth:`~autobatch._memory._backends.
    DeviceMemory.allocation_model`), two trials' storages replayed through it say which sizes
    fit (the trial's ``curve``, see :func:`~autobatch._memory._measure._replayed_curve`).
    With ``per_operator`` (and memory statistics) the outcome's parts are the peaks of every
    operator the trial dispatched (see :class:`_StepPeaks`); its phases, the peaks outside and
    inside ``optimizer.step``, are measured either way.
    """

    def __init__(
        self,
        make_batch: Callable[[int], Batch],
        step: Callable[[Batch], Any],
        memory: DeviceMemory,
        *,
        steps_per_trial: int = 1,
        cleanup: Callable[[], None] = lambda: None,
        on_trial: Callable[[Trial], None] | None = None,
        per_operator: bool = True,
        adaptive: bool = True,
    ) -> None:
        self.make_batch = make_batch
        self.step = step
        self.memory = memory
        self.steps_per_trial = steps_per_trial
        self.cleanup = cleanup
        self.on_trial = on_trial
        self.per_operator = per_operator
        self.adaptive = adaptive
        self.records: list[Trial] = []
        self._storage_trials: list[tuple[StorageTrial, Any]] = []  # fits, with their shape
        self._replays: Replays = {}  # what the allocator's replays worked out, shared

    def _run(
        self, size: int, peaks: _StepPeaks, steady: _SteadyState, watched: int
    ) -> str | None:
        """Runs the trial (``watched`` steps inside ``peaks``, then ``steady``'s); returns
        None, or the kind of a batch-size-dependent failure."""

        batch: Batch = None

        def next_step() -> None:
            # A training loop's step (``x, y = x.to(device), y.to(device)``): the next batch
            # made while the last one is still held, the last one's tensors let go in order,
            # then the step.
            nonlocal batch
            last: list[torch.Tensor | None] = list(tensors(batch))
            batch = None
            batch = self.make_batch(size)
            for i in range(len(last)):
                last[i] = None
            self.step(batch)

        def run() -> None:
            before: int | None = None
            with peaks:
                for _ in range(watched):  # (before: the reserved peak before the last step)
                    before = max(peaks.reserved or 0, self.memory.peak_reserved_bytes() or 0)
                    next_step()
                self.memory.synchronize()
            grew = peaks.reserved is not None and (before is None or peaks.reserved > before)
            steady.run(next_step, peaks.reserved, grew and watched > 1)

        return failure_of(run)

    def __call__(self, size: int) -> Trial:
        self.cleanup()
        caches = self.memory.has_statistics and self.memory.caches
        if caches:  # every trial starts from an empty cache, as training after the search does
            self.memory.empty_cache()
        self.memory.reset_peak()
        peaks = _StepPeaks(self.memory, per_operator=self.per_operator)
        steady = _SteadyState(self.memory if caches else None, self.adaptive)
        model = self.memory.allocation_model() if caches and peaks.storages is not None else None
        # where the allocator caches, the steps a size must survive are all watched
        watched = max(self.steps_per_trial, CACHING_STEPS) if caches else self.steps_per_trial
        start = time.perf_counter()
        error = self._run(size, peaks, steady, watched)
        seconds = time.perf_counter() - start
        events = None if peaks.storages is None else list(peaks.storages.events)
        peak: int | None = None
        reserved: int | None = None
        parts: tuple[int, ...] = ()
        phases: tuple[int, ...] = ()
        curve: Callable[[int], int] | None = None
        if error is None and self.memory.has_statistics:
            peak, parts, phases = peaks.peak, peaks.parts(), peaks.phases()
            if events is not None and peaks.storages is not None and peaks.storages.exact and (
                not steady.extra  # (the steps past those watched are not in the events)
            ):
                curve = self._storage_curve(size, peaks.base, events, peak, model)
            if steady.allocated > peak:  # a later step peaked higher: the parts miss it
                peak, parts, phases, curve = steady.allocated, (), (), None
            reserved = steady.reserved
        self.cleanup()  # nothing of a trial (its gradients, its last loss) outlives it
        if error is not None:  # out of the except block: the failed attempt's tensors are gone
            free_memory(self.memory.device)
        record = Trial(
            size, error is None, peak, seconds, error, parts, phases, curve,
            reserved_bytes=reserved, steps=watched + steady.extra,
        )
        self.records.append(record)
        logger.info("%s", record)
        if self.on_trial is not None:
            self.on_trial(record)
        return record

    def _storage_curve(
        self, size: int, base: int, events: list[tuple[int, int, int]], peak: int,
        model: AllocationModel | None = None,
    ) -> Callable[[int], int] | None:
        """The peak at any size from this trial's storages and an earlier trial's whose
        operators created and freed them alike: replayed through ``model``, the caching
        allocator as it was when both began (see :func:`_replayed_curve`), or else with the
        allocator's 512-byte blocks, or whole bytes (see :func:`_curve`); ``None`` when none
        gives both peaks exactly."""
        shape = (
            tuple((segment, serial, nbytes >= 0) for segment, serial, nbytes in events),
            None if model is None else tuple(model.blocks()),
        )
        record = StorageTrial(size, base, events, peak)
        earlier = [r for r, s in self._storage_trials if r.size != size and s == shape]
        self._storage_trials = [*self._storage_trials[-3:], (record, shape)]
        for other in reversed(earlier):
            if model is not None:
                replayed = _replayed_curve(other, record, model, self._replays)
                if replayed is not None:
                    return replayed
                continue
            for block in (512, 1):
                curve = _curve(other, record, block)
                if curve is not None:
                    return curve
        return None
