"""One trial of a training (or inference) step at a given batch size.

This module knows how to build a batch of ``n`` rows, how to call a model on it, how to get a loss,
and how to run one step; it measures the step's peak memory through the backend registry. It
never decides which size to try (that is :mod:`autobatch.search`).
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from autobatch import _batch
from autobatch._accounting import storages
from autobatch._backends import DeviceMemory, free_memory
from autobatch._log import get_logger, user_stacklevel
from autobatch._oom import failure_kind
from autobatch._state import Snapshot, modules_referenced
from autobatch._units import format_bytes
from autobatch.search import Outcome

logger = get_logger("trial")

Batch = Any
LossFn = Callable[..., torch.Tensor]
StepFn = Callable[[nn.Module, Batch], Any]
OptimizerLike = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None


def call_model(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    """Run the forward pass the way a training loop would; returns ``(output, target)``.

    A tensor batch is ``model(batch)``; a mapping is ``model(**batch)`` (Hugging Face style,
    labels inside); a 2-tuple or 2-list is ``(inputs, target)`` and runs ``model(inputs)``.
    """
    if isinstance(batch, torch.Tensor):
        return model(batch), None
    if isinstance(batch, Mapping):
        return model(**batch), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return model(batch[0]), batch[1]
    raise TypeError(
        f"cannot tell how to call the model on a batch of {_batch.describe(batch)}; a batch is a "
        "tensor, a dict of model keyword arguments, or an (inputs, target) pair. Pass "
        "step_fn=lambda model, batch: ... to run your own step"
    )


def loss_of(output: Any, target: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar to call ``backward`` on.

    ``loss_fn(output, target)`` (or ``loss_fn(output)`` without a target) when given; else a
    scalar output, an output's ``.loss`` or ``["loss"]`` (a model's own loss, e.g. a Hugging
    Face model given ``labels``); else a stand-in that costs at least what a training loss
    does: a cross-entropy over the last dimension of every floating-point output that needs a
    gradient (for a language model's logits that is the loss it trains with; it keeps the
    log-probabilities for backward, as a real classification loss does), the mean of those
    with fewer than two dimensions. A plain mean would keep nothing, so a language model would
    look cheaper than it is. When ``loss_fn`` cannot take what the model returned (an object
    such as a ``ModelOutput``), the error says in one line what came back and what to pass.
    """
    if loss_fn is not None:
        try:
            return loss_fn(output) if target is None else loss_fn(output, target)
        except (TypeError, AttributeError) as error:
            if isinstance(output, torch.Tensor):
                raise
            problem = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
        raise TypeError(
            f"the model returned {_batch.describe(output)}, not a tensor, and "
            f"loss_fn={getattr(loss_fn, '__name__', type(loss_fn).__name__)} cannot take it "
            f"({problem}); pass a loss_fn that reads the field it needs (e.g. "
            "lambda output, target: cross_entropy(output.logits.flatten(0, -2), "
            "target.flatten())), or no loss_fn and labels the model computes its own loss from"
        )
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    parts = [
        _stand_in(t)
        for t in _batch.tensors(output)
        if t.is_floating_point() or t.is_complex()
        if t.requires_grad
    ]
    if not parts:
        raise TypeError(
            "the model's output has no tensor that needs a gradient, so there is nothing to "
            "back-propagate; pass loss_fn=, step_fn=, or train=False for inference"
        )
    return torch.stack(parts).sum()


def _stand_in(output: torch.Tensor) -> torch.Tensor:
    """A loss over one output tensor that keeps as much for backward as a training loss does."""
    if output.is_complex():
        output = output.abs()
    if output.dim() < 2:
        return output.float().mean()
    scores = output.flatten(0, -2).float()
    targets = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return torch.nn.functional.cross_entropy(scores, targets)


def language_model_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss: each position predicts the next token.

    ``output`` is the logits ``(batch, length, vocabulary)`` or an object with ``.logits`` (a
    Hugging Face ``ModelOutput``); ``tokens`` the input ids, which are the labels.

    >>> logits, tokens = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    >>> float(language_model_loss(logits, tokens)) > 0
    True
    """
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tokens.dim() != 2:
        raise TypeError(
            f"a language-model loss needs logits (batch, length, vocabulary) and tokens (batch, "
            f"length); the model returned {_batch.describe(output)} for tokens "
            f"{tuple(tokens.shape)}"
        )
    predicted = logits[:, :-1].flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(predicted, tokens[:, 1:].flatten())


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    train: bool = True,
    scaler: Any = None,
) -> Callable[[Batch], None]:
    """The one step every front-end runs (finder, planner, throughput).

    ``step_fn(model, batch)`` when given; otherwise zero_grad (``set_to_none``, as torch does by
    default), forward, loss, backward and the optimizer step (through ``scaler`` when given), or
    a forward under ``torch.inference_mode()`` when ``train`` is False.
    """

    def step(batch: Batch) -> None:
        if step_fn is not None:
            step_fn(model, batch)
            return
        if not train:
            with torch.inference_mode():
                call_model(model, batch)
            return
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        output, target = call_model(model, batch)
        loss = loss_of(output, target, loss_fn)
        del output
        if scaler is not None:
            scaler.scale(loss).backward()
            if optimizer is not None:
                scaler.step(optimizer)
                scaler.update()
        else:
            loss.backward()
            if optimizer is not None:
                optimizer.step()

    return step


def make_optimizer(optimizer: OptimizerLike, model: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer instance as is, or a class/factory called on the model's parameters (a
    temporary optimizer that the caller throws away)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        made = optimizer(model.parameters())
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer={optimizer!r} returned {type(made).__name__}, not a torch.optim.Optimizer"
            )
        return made
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer, an optimizer class or factory, or None; "
        f"got {type(optimizer).__name__}"
    )


class PeakKeeping(DeviceMemory):
    """A device's memory whose peak counter autobatch may reset, as the user never sees.

    Measuring a trial (or a micro-batch) means resetting the device's peak statistic
    (``torch.cuda.reset_peak_memory_stats``), which would wipe the peak the user logs with
    ``max_memory_allocated()``. Every reset through this wrapper first reads the peak it ends,
    and :meth:`restore_peak` puts back the peak the device really reached since the user's own
    last reset: the highest of those readings, reached again by a transient allocation of the
    difference (which the device's allocator rounds as it does any allocation) when the counter
    is lower. Everything else is the wrapped backend's.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        super().__init__(memory.device)
        self.inner = memory
        self.has_statistics = memory.has_statistics  # type: ignore[misc]
        self.highest = memory.peak_bytes() if memory.has_statistics else 0

    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes()

    def allocated_bytes(self) -> int:
        return self.inner.allocated_bytes()

    def peak_bytes(self) -> int:
        return self.inner.peak_bytes()

    def reset_peak(self) -> None:
        if self.has_statistics:
            self.highest = max(self.highest, self.inner.peak_bytes())
        self.inner.reset_peak()

    def free_bytes(self) -> int:
        return self.inner.free_bytes()

    def reserved_bytes(self) -> int | None:
        return self.inner.reserved_bytes()

    def peak_reserved_bytes(self) -> int | None:
        return self.inner.peak_reserved_bytes()

    def memory_stats(self) -> dict[str, int] | None:
        return self.inner.memory_stats()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    @property
    def name(self) -> str:
        return self.inner.name

    def restore_peak(self) -> None:
        """Raise the device's peak counter back to the highest peak seen (see the class)."""
        if not self.has_statistics:
            return
        if self.inner.peak_bytes() >= self.highest:
            return
        missing = self.highest - self.inner.allocated_bytes()  # allocated on top of what is
        if missing <= 0 or missing > self.inner.free_bytes():
            return
        try:
            with torch.no_grad():
                torch.empty(missing, dtype=torch.uint8, device=self.device)
        except Exception as error:  # another process took the memory: the counter stays low
            if failure_kind(error) is None:
                raise
        self.highest = max(self.highest, self.inner.peak_bytes())


@dataclass(frozen=True)
class Workload:
    """What a front-end runs trials with: the step, and the optimizer it steps (if any)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    step: Callable[[Batch], None]
    memory: PeakKeeping
    compiled: bool = False  # the model has compiled parts
    measured_eager: bool = False  # ... and the trials run their eager originals

    def drop_gradients(self) -> None:
        """Set every gradient to None: after a failed trial, and between trials."""
        self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)


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
) -> Iterator[Workload]:
    """The one setup and teardown around trials: the optimizer made, everything a trial may
    change saved (:class:`~autobatch._state.Snapshot`), the model in eval mode for inference;
    afterwards gradients dropped, everything put back, the device's peak counter raised back to
    what it would read had no trial reset it (``work.memory``, :class:`PeakKeeping`, is what
    trials measure with) and the device cache emptied, also when a trial raised."""
    made = make_optimizer(optimizer if train else None, model)
    _warn_uncounted(memory, model, made if made is optimizer else None)
    snapshot = Snapshot(
        model, made, tuple(x for x in (scaler,) if x is not None),
        modules=tuple(m for m in modules_referenced(loss_fn, step_fn) if m is not model),
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
    work = Workload(
        runs,
        made,
        make_step(runs, made, loss_fn=loss_fn, step_fn=step_fn, train=train, scaler=scaler),
        PeakKeeping(memory),
        compiled=compiled,
        measured_eager=compiled and under_mode,
    )
    try:
        if not train:
            model.eval()
        yield work
    finally:
        views.close()
        work.drop_gradients()
        snapshot.restore()
        memory.empty_cache()
        work.memory.restore_peak()  # the user's max_memory_allocated() as if never reset
        memory.empty_cache()


def _warn_uncounted(
    memory: DeviceMemory, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Warn when a simulated GPU does not count the model (or the caller's optimizer state):
    built before the simulator was entered and not adopted, its bytes would be missing from
    every trial, and the size found too large by that much."""
    from autobatch.testing._simulator import SimulatedMemory  # the simulator imports the backends

    if not isinstance(memory, SimulatedMemory):
        return
    ledger = memory.gpu.ledger
    held: list[Any] = [model] if optimizer is None else [model, optimizer]
    missing = sum(
        ledger.size_of(storage)
        for storage in storages(held)
        if storage.device.type == memory.device.type and storage not in ledger
    )
    if missing:
        warnings.warn(
            f"{format_bytes(missing)} of the model's parameters, buffers, gradients or "
            "optimizer state are not counted by the active SimulatedGPU (created before it was "
            "entered): every trial would leave them out and find a batch too large. Call "
            "gpu.adopt(model, optimizer) first",
            stacklevel=user_stacklevel(),
        )


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) without a forward pass, so that every
    trial runs in the steady state of training, where that state is resident.

    One step on all-zero gradients creates the state; the step's effect on the parameters is
    undone later by the snapshot. Optimizers that need a closure (LBFGS) are left unprimed.
    """
    params = [
        p for group in optimizer.param_groups for p in group["params"]
        if p.requires_grad and p not in optimizer.state
    ]
    if not params:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    except TypeError as error:  # LBFGS and friends: step(closure) is required
        if "closure" not in str(error):
            raise
    finally:
        for p in params:
            p.grad = None


def attempt(run: Callable[[], None]) -> str | None:
    """Runs ``run``; returns None, or the kind of a batch-size-dependent failure (an OOM or a
    size limit). Any other error propagates. The failed attempt's tensors die with ``run``'s
    frame and the exception, both gone once this returns: clean up after it, not inside."""
    try:
        run()
    except Exception as error:
        kind = failure_kind(error)
        if kind is None:  # not a matter of batch size: not ours to handle
            raise
        return kind
    return None


@dataclass(frozen=True)
class TrialRecord:
    """One trial: the size, whether it fit, its peak (bytes, when measured), its duration and,
    when it failed, the kind of error (``"cuda_allocator"``, ``"size_limit:int32_index"``, ...)."""

    size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str | None = None

    def __str__(self) -> str:
        verdict = "fits" if self.fits else f"OOM ({self.error})"
        peak = "" if self.peak_bytes is None else f", peak {format_bytes(self.peak_bytes)}"
        return f"batch {self.size:>6}: {verdict}{peak}, {self.seconds:.2f} s"


class TrialRunner:
    """Runs the step at a size and reports an :class:`~autobatch.search.Outcome`.

    ``make_batch(n)`` builds the batch on the device, ``step(batch)`` runs one step. Every trial
    starts from the same state: ``cleanup`` (dropping the gradients) runs first, so no part of
    a trial's memory depends on what the trial before it left. After a failure the runner
    leaves the ``except`` block, cleans up and frees cached memory before the next trial.
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
        on_trial: Callable[[TrialRecord], None] | None = None,
        per_operator: bool = True,
    ) -> None:
        self.make_batch = make_batch
        self.step = step
        self.memory = memory
        self.steps_per_trial = steps_per_trial
        self.cleanup = cleanup
        self.on_trial = on_trial
        self.per_operator = per_operator
        self.records: list[TrialRecord] = []
        self._storage_trials: list[Any] = []  # (size, base, events, peak, shape) of fits

    def _attempt(self, size: int, peaks: _StepPeaks) -> str | None:
        """Runs the trial; returns None, or the kind of a batch-size-dependent failure."""

        def run() -> None:
            with peaks:
                batch = self.make_batch(size)
                for _ in range(self.steps_per_trial):
                    self.step(batch)
                self.memory.synchronize()

        return attempt(run)

    def __call__(self, size: int) -> Outcome:
        self.cleanup()
        self.memory.reset_peak()
        peaks = _StepPeaks(self.memory, per_operator=self.per_operator)
        start = time.perf_counter()
        error = self._attempt(size, peaks)
        seconds = time.perf_counter() - start
        events = None if peaks.storages is None else list(peaks.storages.events)
        peak: int | None = None
        parts: tuple[int, ...] = ()
        phases: tuple[int, ...] = ()
        curve: Callable[[int], int] | None = None
        if error is None and self.memory.has_statistics:
            peak, parts, phases = peaks.peak, peaks.parts(), peaks.phases()
            if events is not None and peaks.storages is not None and peaks.storages.exact:
                curve = self._storage_curve(size, peaks.base, events, peak)
        else:  # out of the except block: the failed attempt's tensors are gone
            self.cleanup()
            free_memory(self.memory.device)
        record = TrialRecord(size, error is None, peak, seconds, error)
        self.records.append(record)
        logger.info("%s", record)
        if self.on_trial is not None:
            self.on_trial(record)
        return Outcome(
            fits=error is None, peak_bytes=peak, error=error, parts=parts, phases=phases,
            curve=curve,
        )

    def _storage_curve(
        self, size: int, base: int, events: list[tuple[int, int, int]], peak: int
    ) -> Callable[[int], int] | None:
        """The peak at any size from this trial's storages and an earlier trial's whose
        operators created and freed them alike (see :func:`_curve`), with the allocator's
        512-byte blocks, or whole bytes; ``None`` when neither gives both peaks exactly."""
        shape = tuple((segment, serial, nbytes >= 0) for segment, serial, nbytes in events)
        record = (size, base, events, peak)
        earlier = [r for r in self._storage_trials if r[0] != size and r[4] == shape]
        self._storage_trials = [*self._storage_trials[-3:], (*record, shape)]
        for other in reversed(earlier):
            for block in (512, 1):
                curve = _curve([other[:4], record], block)
                if curve is not None:
                    return curve
        return None


def _compiled_class() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule is compiled (``torch.compile(module)`` or
    ``module.compile()``)."""
    optimized = _compiled_class()
    return any(
        (optimized is not None and isinstance(module, optimized))
        or getattr(module, "_compiled_call_impl", None) is not None
        for module in model.modules()
    )


def without_compiled(model: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """``(eager, undo)``: ``model`` with every compiled part swapped for its eager original (the
    root itself too, when compiled), and the function that puts them back. Parameters are
    shared, not copied."""
    optimized = _compiled_class()
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    cleared: list[tuple[nn.Module, Any]] = []

    def undo() -> None:
        for module, name, child in reversed(swapped):
            module._modules[name] = child
        for module, impl in reversed(cleared):
            module._compiled_call_impl = impl

    root: Any = model
    while optimized is not None and isinstance(root, optimized):
        root = cast(Any, root)._orig_mod
    try:
        for module in list(root.modules()):
            if getattr(module, "_compiled_call_impl", None) is not None:
                cleared.append((module, module._compiled_call_impl))
                module._compiled_call_impl = None
            for name, child in list(module._modules.items()):
                original: Any = child
                while optimized is not None and isinstance(original, optimized):
                    original = cast(Any, original)._orig_mod
                if original is not child and child is not None:
                    swapped.append((module, name, child))
                    module._modules[name] = original
                    for inner in original.modules():
                        if getattr(inner, "_compiled_call_impl", None) is not None:
                            cleared.append((inner, inner._compiled_call_impl))
                            inner._compiled_call_impl = None
    except BaseException:
        undo()
        raise
    return root, undo


@contextlib.contextmanager
def eager_view(model: nn.Module) -> Iterator[nn.Module]:
    """The model with every compiled part swapped for its eager original, put back after.

    Compiled code cannot run under a ``TorchDispatchMode`` (a simulated GPU's accounting,
    per-operator recording, the planner's counting): torch's compiler then not only runs it
    eagerly, it marks the code to be skipped for good, so the user's compiled model would stay
    eager for the rest of the process. Trials under such a mode run this eager view instead;
    the compiled modules themselves never see the mode.
    """
    eager, undo = without_compiled(model)
    try:
        yield eager
    finally:
        undo()


def mark_batch_dynamic(batch: Batch) -> Batch:
    """Mark dimension 0 of every tensor of ``batch`` dynamic for ``torch.compile``, so a compiled
    model is not compiled again for each trial's size (sizes 0 and 1 stay specialised)."""
    dynamo = sys.modules.get("torch._dynamo")
    mark = getattr(dynamo, "maybe_mark_dynamic", None)
    if mark is None:
        return batch
    for tensor in _batch.tensors(batch):
        if tensor.dim() >= 1 and tensor.shape[0] >= 2:
            mark(tensor, 0)
    return batch


def per_operator_possible(model: nn.Module) -> bool:
    """Whether per-operator peaks measure ``model`` as it really runs: not when it (or a
    submodule) is compiled, since compiled code runs eagerly while a dispatch mode is active."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    for module in model.modules():
        if optimized is not None and isinstance(module, optimized):
            return False
        if getattr(module, "_compiled_call_impl", None) is not None:  # nn.Module.compile()
            return False
    return True


class _StepPeaks:
    """The peaks of a trial's parts: of every operator it dispatches, and of its two phases.

    The trial's time is cut into segments, one per dispatched operator (from its call to the
    next operator's) and at the optimizer step's start and end; a segment's part is its peak,
    so the parts' maximum is the trial's peak. Each part is affine in the batch size when the
    same operators run at every size, so the step's convex curve (the maximum of those lines)
    is known from two small trials. The phases are the parts' maxima outside ``optimizer.step``
    (forward, backward) and inside it. Only :class:`~autobatch._backends.DeviceMemory` is
    asked (its peak, read and reset around each operator), so any backend with statistics
    works. The operator mode is entered last, so it wraps any other dispatch mode (a simulated
    GPU's accounting included).
    """

    def __init__(self, memory: DeviceMemory, *, per_operator: bool = True) -> None:
        self.memory = memory
        self.statistics = memory.has_statistics
        self.per_operator = per_operator and self.statistics
        self.storages: _Storages | None = _Storages() if self.per_operator else None
        self.base = 0
        self.operators: list[int] = []
        self.outside = 0
        self.inside: int | None = None
        self._stepping = False
        self._hooks: list[Any] = []
        self._mode: _OperatorMode | None = None

    def close_segment(self, restart: bool = True) -> None:
        """Ends the current segment: its peak becomes a part, and (``restart``) a new
        measurement starts."""
        memory = self.memory
        peak = memory.peak_bytes()
        if restart:
            memory.reset_peak()
        if self.per_operator:
            self.operators.append(peak)
            if self.storages is not None:
                self.storages.segment += 1
        if self._stepping:
            self.inside = peak if self.inside is None else max(self.inside, peak)
        elif peak > self.outside:
            self.outside = peak

    def _before_step(self, *_: Any) -> None:
        self.close_segment()
        self._stepping = True

    def _after_step(self, *_: Any) -> None:
        self.close_segment()
        self._stepping = False

    def __enter__(self) -> _StepPeaks:
        self.base = self.memory.allocated_bytes() if self.statistics else 0
        if self.statistics:
            self._hooks = [
                register_optimizer_step_pre_hook(self._before_step),
                register_optimizer_step_post_hook(self._after_step),
            ]
        if self.per_operator:
            try:
                mode = _OperatorMode(self)
                mode.__enter__()
            except BaseException:
                self._remove_hooks()
                raise
            self._mode = mode
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        self._remove_hooks()
        if self.statistics:  # the last segment; the peak is left running, as it was found
            self.close_segment(restart=False)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def peak(self) -> int:
        """The trial's peak: the maximum of its parts."""
        return max(self.outside, self.inside or 0)

    def parts(self) -> tuple[int, ...]:
        """Every segment's peak in order (one per operator), or ``()`` when not recorded."""
        return tuple(self.operators) if len(self.operators) >= 2 else ()

    def phases(self) -> tuple[int, ...]:
        """``(outside, inside)`` when an optimizer stepped, else ``()``."""
        return () if self.inside is None else (self.outside, self.inside)


class _OperatorMode(TorchDispatchMode):
    """Closes a segment of :class:`_StepPeaks` as each operator starts."""

    def __init__(self, peaks: _StepPeaks) -> None:
        super().__init__()
        self.close = peaks.close_segment
        self.storages = peaks.storages

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.close()
        out = func(*args, **(kwargs or {}))
        if self.storages is not None:
            self.storages.born(out, (args, kwargs))
        return out


class _Storages:
    """Every storage a trial's operators create, in order: when each is born (its raw bytes)
    and when it dies, by the segment (operator) it happens in. Two trials with the same events
    give each storage's size as a line in the batch size, so the peak at any size is known to
    the byte, the allocator's rounding of each storage included (see :func:`_curve`)."""

    def __init__(self) -> None:
        self.segment = 0
        self.events: list[tuple[int, int, int]] = []  # (segment, serial, bytes; -1: died)
        self.serials: dict[int, int] = {}
        self.sizes: dict[int, int] = {}  # serial -> bytes at birth
        self.exact = True  # False once something happened that the events cannot replay

    def born(self, out: Any, inputs: Any) -> None:
        """Record the new storages among an operator's outputs (a view of an input, or of a
        storage made before the trial, is none)."""
        views: set[int] | None = None
        stack = [out]
        while stack:
            value = stack.pop()
            if isinstance(value, (list, tuple)):
                stack.extend(reversed(value))
            elif isinstance(value, torch.Tensor):
                if value.layout is not torch.strided or value.is_nested:
                    continue
                storage = value.untyped_storage()
                key = int(storage._cdata)
                nbytes = int(storage.nbytes())
                serial = self.serials.get(key)
                if serial is None:
                    if views is None:
                        views = _storage_keys(inputs)
                    if key in views:
                        continue
                    serial = self.serials[key] = len(self.sizes)
                    self.sizes[serial] = nbytes
                    self.events.append((self.segment, serial, nbytes))
                    weakref.finalize(storage, self._died, key, serial)
                elif nbytes != self.sizes[serial]:
                    self.exact = False  # a storage grew in place

    def _died(self, key: int, serial: int) -> None:
        if self.serials.get(key) == serial:
            del self.serials[key]
        self.events.append((self.segment, serial, -1))

    def structure(self) -> tuple[tuple[int, int, bool], ...]:
        return tuple((segment, serial, nbytes >= 0) for segment, serial, nbytes in self.events)


def _storage_keys(values: Any) -> set[int]:
    """The storages of every tensor among an operator's arguments."""
    keys: set[int] = set()
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif (
            isinstance(value, torch.Tensor)
            and value.layout is torch.strided
            and not value.is_nested
        ):
            keys.add(int(value.untyped_storage()._cdata))
    return keys


def _curve(
    trials: list[tuple[int, int, list[tuple[int, int, int]], int]], block: int
) -> Callable[[int], int] | None:
    """The peak at any size from two trials' storage events (``(size, base, events, peak)``,
    alike but for sizes): each storage's bytes are a line through its two sizes (``None`` when
    one is not), every storage is rounded up to ``block``, and the peak is the highest the
    running total reaches. ``None`` unless it gives both trials' measured peaks exactly."""
    (n1, base1, events1, peak1), (n2, base2, events2, peak2) = trials[-2:]
    if base1 != base2 or n1 == n2:
        return None
    lines: dict[int, tuple[int, int]] = {}
    for (_, serial, a), (_, _, b) in zip(events1, events2, strict=True):
        if a < 0:
            continue
        slope, rest = divmod(b - a, n2 - n1)
        if rest:
            return None  # not affine in the size: no storage-exact curve
        lines[serial] = (slope, a - slope * n1)
    order = [(serial, nbytes < 0) for _, serial, nbytes in events1]

    def peak(n: int) -> int:
        live: dict[int, int] = {}
        total = highest = base1
        for serial, died in order:
            if died:
                total -= live.pop(serial, 0)
            else:
                slope, offset = lines[serial]
                raw = slope * n + offset
                if raw < 0:
                    raise ValueError(f"a storage would have {raw} bytes at size {n}")
                size = -(-raw // block) * block
                live[serial] = size
                total += size
                highest = max(highest, total)
        return highest

    if peak(n1) != peak1 or peak(n2) != peak2:
        return None
    return peak


class _PhasePeaks(_StepPeaks):
    """The peaks of a trial's phases: outside ``optimizer.step`` (forward, backward) and inside it.

    The step's peak is their maximum; fitted apart, each is a straight line in the batch size,
    while their maximum bends where the optimizer step stops setting the peak.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        super().__init__(memory, per_operator=False)

    def peaks(self) -> tuple[int, ...]:
        """``(outside, inside)`` when an optimizer stepped, else ``()``."""
        return self.phases()
