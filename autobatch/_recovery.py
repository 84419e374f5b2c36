"""Recover from out-of-memory errors during training: one engine, two ways in.

:func:`retry_on_oom` decorates a step function; :class:`oom_guard` wraps the loop's iterable. Both
are thin front-ends over :class:`_Engine`, which runs a step on pieces of its batch:

1. A step runs unchanged and unmeasured until its first out-of-memory error (the fast path costs a
   ``try`` and, with ``optimizer=``, a sum of the parameters' version counters).
2. On an OOM (:func:`autobatch.is_oom_error`) the engine keeps only the exception without its
   traceback, leaves the ``except`` block, calls :func:`autobatch.free_memory`, decides a smaller
   piece size (:meth:`_Sizes.after_oom`; under torch.distributed every rank takes the smallest
   any rank chose, see :class:`_Coordination`) and runs the batch again in pieces. It never
   retries inside the ``except`` block.
3. Piece sizes are remembered per decorated function and per :func:`~autobatch._batch.shape_key`
   (an eval step has its own sizes). A batch whose rows have another shape starts from the size
   predicted for its elements per sample, so a longer sequence costs at most one retry and a
   shorter one gets a larger piece.
4. Where the device keeps statistics (CUDA, ROCm, XPU, the simulated GPU), each piece's cost (its
   peak above what was allocated when it started, optimizer step excluded) is measured and
   :func:`autobatch.search.fit_linear` fits ``cost = fixed + per_element * elements``. After an
   OOM the next size is the largest whose predicted cost fits in the device's free bytes (so
   optimizer state created since, and other processes, count) less ``headroom``. Without a model
   yet, one small measuring piece (an eighth of the failed size) runs first and the rest of the
   batch uses the model it gives. Once a line is fitted, every piece is also capped by what fits
   in the memory free at that moment, so memory taken away later shrinks the pieces before it
   causes an OOM. Without statistics the size halves.

Policies (``policy=``):

* ``"accumulate"`` (default with ``optimizer=``): the pieces of one batch make exactly one
  optimizer step. While the pieces run, each piece's gradients are weighted in place by its share
  of the batch (``reduction="mean"``; ``"sum"`` adds them) and moved into private buffers (no
  gradient is copied; call ``backward()`` once per step), so code between
  ``backward()`` and ``optimizer.step()`` (clipping, logging, ``zero_grad``) sees no gradient in
  early pieces and the whole batch's gradient in the last one. ``optimizer.step()`` and the
  ``scaler=``'s ``unscale_``/``step``/``update`` do nothing in early pieces and run once in the last
  one, so GradScaler's inf check covers the whole batch once. The LR scheduler is not touched: call
  ``scheduler.step()`` outside the decorated step. Step functions must take one step per call and
  zero the gradients themselves; once memory has run short, autobatch sets them to ``None`` before
  each batch (and before it re-runs one), so that every piece is measured alike.
  Closure-taking optimizers (LBFGS) are refused.
* ``"shrink"`` (default without an optimizer, e.g. eval steps): each piece is its own call of the
  step, so a training step takes more, smaller optimizer steps: the effective batch size shrinks.

Returned values: when the batch ran whole, the step's own value. When it was split, pieces are
joined: ``None`` stays ``None``; floating scalars (0-d tensors, floats) are weighted by their share
of the batch (``"mean"``) or added (``"sum"``), integers are added, and 0-d tensors come back
detached; tensors whose dim 0 is the piece size are concatenated, lists as long as their piece are
joined; dicts, tuples and named tuples are joined item by item; equal values pass through. If the
pieces' results cannot be joined, the list of them is returned.

An OOM inside or after ``optimizer.step()`` (with ``optimizer=``): the parameters' version counters
(in-place modification counts) tell whether the update began. An OOM before the step is retried;
one inside the first step, while the optimizer creates its state and before any parameter changed
(Adam's ``exp_avg``, ``exp_avg_sq``), is retried after the half-made state is dropped. Any other
OOM inside or after the step raises :class:`~autobatch.AutobatchError`: torch's optimizers update
their state in place before the parameters, so the update may be partly applied, and autobatch
neither retries it twice nor restores it (a copy of every parameter and state per step would cost
too much).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import operator
import types
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, cast, overload

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.nn.parallel import DistributedDataParallel

from autobatch import _distributed
from autobatch._backends import DeviceLike, DeviceMemory, free_memory, memory_for
from autobatch._batch import (
    Batch,
    batch_size,
    describe,
    elements_per_sample,
    shape_key,
    slice_batch,
    tensors,
)
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger, user_stacklevel
from autobatch._oom import MAX_CHAIN_DEPTH, is_oom_error, oom_kind
from autobatch._trial import PeakKeeping, _PhasePeaks
from autobatch._units import format_bytes
from autobatch.search import LinearModel, fit_linear

__all__ = [
    "RecoveryOptions",
    "RecoveryStats",
    "RetryingStep",
    "SizeChange",
    "oom_guard",
    "retry_on_oom",
]

logger = get_logger("recovery")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

Policy = Literal["accumulate", "shrink"]
Reduction = Literal["mean", "sum"]

#: The measuring piece after an OOM without a memory model is this fraction of the failed size.
PROBE_DIVISOR = 8
#: How many distinct piece sizes (per shape) the memory model remembers.
MAX_POINTS = 32
#: Distinct piece sizes needed before a line is fitted (two cannot tell a bent start).
MIN_FIT_SIZES = 3

_VERSION = operator.attrgetter("_version")  # a tensor's in-place modification counter

_ACTIVE_GUARD: contextvars.ContextVar[oom_guard[Any] | None] = contextvars.ContextVar(
    "autobatch_active_guard", default=None
)


# --------------------------------------------------------------------------------------------
# Public records


@dataclass(frozen=True)
class SizeChange:
    """One change of a step's micro-batch size.

    >>> SizeChange(step=3, function="train_step", old=None, new=8, reason="oom")
    SizeChange(step=3, function='train_step', old=None, new=8, reason='oom')

    Args:
        step: the index (from 0) of the call, or of the guard's batch, when it happened.
        function: the decorated step's qualified name.
        old: the size before; ``None`` when whole batches ran.
        new: the size after.
        reason: ``"oom"`` (shrunk after an OOM), ``"refine"`` (raised to what the memory model
            allows after a measuring piece), ``"grow"`` (a larger size tried after clean steps) or
            ``"grow failed"`` (back to the last good size).
    """

    step: int
    function: str
    old: int | None
    new: int
    reason: str


@dataclass(frozen=True)
class RecoveryStats:
    """What happened so far: OOMs, size changes, the current micro-batch size.

    >>> RecoveryStats().ooms
    0

    Args:
        ooms: out-of-memory errors caught (each one retried at a smaller size, or reported);
            under a process group, also attempts stopped because another rank ran out.
        shrinks: size decreases (after an OOM or a failed grow).
        grows: attempts to use a larger size (``grow_after``).
        failed_grows: grow attempts that ran out of memory and went back.
        batches: batches completed (calls of the step, or batches the guard handed out).
        samples: samples in those batches (for a step alone: in the calls since its first OOM).
        samples_recomputed: samples whose work was lost and redone (failed attempts, discarded
            pieces).
        micro_batch_size: the largest piece of the latest batch; ``None`` when it ran whole.
        history: every size change, oldest first.
    """

    ooms: int = 0
    shrinks: int = 0
    grows: int = 0
    failed_grows: int = 0
    batches: int = 0
    samples: int = 0
    samples_recomputed: int = 0
    micro_batch_size: int | None = None
    history: tuple[SizeChange, ...] = ()


@dataclass
class _Tally:
    """The mutable counters behind :class:`RecoveryStats` (a snapshot is made when read)."""

    ooms: int = 0
    shrinks: int = 0
    grows: int = 0
    failed_grows: int = 0
    batches: int = 0
    samples: int = 0
    samples_recomputed: int = 0
    micro_batch_size: int | None = None
    history: list[SizeChange] = dataclasses.field(default_factory=list)

    def change(self, change: SizeChange) -> None:
        self.history.append(change)
        self.shrinks += change.reason in ("oom", "grow failed")
        self.grows += change.reason == "grow"
        self.failed_grows += change.reason == "grow failed"

    def snapshot(self, **override: Any) -> RecoveryStats:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["history"] = tuple(self.history)
        return RecoveryStats(**{**fields, **override})


@dataclass(frozen=True)
class RecoveryOptions:
    """Every option of :func:`retry_on_oom`, validated; see there for their meaning.

    >>> RecoveryOptions(min_batch=4).policy
    'shrink'
    """

    optimizer: torch.optim.Optimizer | None = None
    policy: Policy | None = None
    reduction: Reduction = "mean"
    batch_arg: str | None = None
    min_batch: int = 1
    grow_after: int | None = None
    scaler: Any = None
    model: nn.Module | None = None
    device: DeviceLike = None
    headroom: float = 0.1
    sync_ranks: bool = True

    def __post_init__(self) -> None:
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}"
            )
        if self.policy is None:
            object.__setattr__(self, "policy", "shrink" if self.optimizer is None else "accumulate")
        if self.policy not in ("accumulate", "shrink"):
            raise ValueError(f"policy must be 'accumulate' or 'shrink', got {self.policy!r}")
        if self.policy == "accumulate" and self.optimizer is None:
            raise ValueError(
                "policy='accumulate' needs the optimizer, so that the pieces of a batch make one "
                "step: pass retry_on_oom(optimizer=opt), or use policy='shrink'"
            )
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if self.batch_arg is not None and not isinstance(self.batch_arg, str):
            raise TypeError(f"batch_arg must be a parameter name (str), got {self.batch_arg!r}")
        _check_count("min_batch", self.min_batch)
        if self.grow_after is not None:
            _check_count("grow_after", self.grow_after)
        if self.scaler is not None and not all(
            callable(getattr(self.scaler, name, None))
            for name in ("scale", "step", "update", "unscale_")
        ):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler, got {type(self.scaler).__name__}"
            )
        if self.model is not None and not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not (
            isinstance(self.headroom, (int, float))
            and not isinstance(self.headroom, bool)
            and 0 <= self.headroom < 1
        ):
            raise ValueError(f"headroom must be a fraction in [0, 1), got {self.headroom!r}")


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


# --------------------------------------------------------------------------------------------
# Size decisions: pure bookkeeping, no torch.


@dataclass
class _KeyState:
    """What is known about one shape key."""

    eps: int  # elements per sample
    limit: int  # the piece size in use
    ceiling: int | None = None  # the smallest size that failed
    clean: int = 0  # calls without OOM since the last change
    wait: int = 0  # clean calls before the next grow attempt
    refine: bool = False  # the limit came from a rough model; raise it once a better one exists
    grow_from: int | None = None  # the last good size while a grow attempt is in flight


class _TooSmall(Exception):
    """The smallest allowed size failed."""


class _Sizes:
    """Piece sizes per shape key, the memory model, and the grow/back-off rules.

    Decisions, each pinned by tests: the size after an OOM is always smaller than the size that
    failed and at least ``min_batch``; it comes from the memory model when one exists and predicts
    a smaller size, else from a measuring piece (statistics) or halving (none). A grow doubles the
    size after ``wait`` clean calls (never past the batch, never past what the model allows); a
    failed grow returns to the last good size and doubles ``wait``. ``room`` is always the free
    bytes on the device (``None`` without statistics).
    """

    def __init__(self, *, min_batch: int, grow_after: int | None, headroom: float) -> None:
        self.min_batch = min_batch
        self.grow_after = grow_after
        self.headroom = headroom
        self.states: dict[Hashable, _KeyState] = {}
        # (shape key, elements in the piece) -> the largest cost measured (bytes above what was
        # allocated when the piece started); the least recently measured size goes first.
        self.points: dict[tuple[Hashable, int], int] = {}

    # The memory model -------------------------------------------------------------------------

    def model(self, key: Hashable) -> tuple[LinearModel, bool] | None:
        """The cost model (bytes a piece adds, by elements) for ``key``, and whether it was
        fitted.

        The key's own points are used when it has some, else every key's (in elements). With three
        or more sizes :func:`fit_linear` fits a line (and drops a first piece that also paid for
        creating the gradients, if it does not sit on the line); with fewer, the cost of the
        largest piece is taken as proportional to its size, which overestimates the slope.
        """
        own = [(x, cost) for (k, x), cost in self.points.items() if k == key]
        points = own or [(x, cost) for (_, x), cost in self.points.items()]
        if not points:
            return None
        if len({x for x, _ in points}) >= MIN_FIT_SIZES:
            fitted = fit_linear(points)
            if fitted is not None:
                return fitted, True
        elements, cost = max(points)
        # The whole cost taken as proportional to the piece: an overestimate of the slope.
        return LinearModel(0.0, cost / elements), False

    def model_size(self, key: Hashable, eps: int, room: int | None) -> tuple[int, bool] | None:
        """The largest piece whose predicted cost fits in ``room`` less headroom, and whether the
        model was fitted."""
        if room is None:
            return None
        found = self.model(key)
        if found is None:
            return None
        model, fitted = found
        elements = model.largest_within(room)
        return math.floor(elements / eps * (1 - self.headroom)), fitted

    def record(self, key: Hashable, eps: int, n: int, cost: int) -> None:
        """Remember a measured piece (a cost of 0 or less says nothing and is dropped)."""
        if cost <= 0:
            return
        point = (key, n * eps)
        cost = max(cost, self.points.pop(point, cost))  # re-inserted: the most recent
        self.points[point] = cost
        if len(self.points) > MAX_POINTS:
            del self.points[next(iter(self.points))]

    # Choosing sizes ---------------------------------------------------------------------------

    @property
    def pressure(self) -> bool:
        """Whether any OOM was seen (until then every batch runs whole)."""
        return bool(self.states)

    def limit_for(self, key: Hashable, eps: int, room: int | None) -> int | None:
        """The piece size for ``key``; ``None`` for whole batches.

        A learned limit is capped by what a fitted model says fits in the room now, so that
        memory taken since (optimizer state, another process) is respected before it fails.
        """
        state = self.states.get(key)
        if state is not None:
            found = self.model_size(key, eps, room)
            if found is not None and found[1] and state.grow_from is None:
                return max(min(state.limit, found[0]), self.min_batch)
            return state.limit
        if not self.states:
            return None
        found = self.model_size(key, eps, room)
        if found is not None:
            return max(found[0], self.min_batch)
        # No statistics: scale the other shapes' sizes by their elements per sample.
        return max(min(s.limit * s.eps // eps for s in self.states.values()), self.min_batch)

    def piece(self, key: Hashable, eps: int, remaining: int, room: int | None) -> int:
        """The next piece of ``remaining`` rows: balanced pieces of at most the limit."""
        limit = self.limit_for(key, eps, room)
        if limit is None or limit >= remaining:
            return remaining
        count = -(-remaining // limit)
        return -(-remaining // count)

    # Learning ---------------------------------------------------------------------------------

    def after_oom(
        self, key: Hashable, eps: int, failed: int, room: int | None
    ) -> tuple[int | None, int, str]:
        """Decide the size after an OOM at ``failed`` rows: ``(old, new, reason)``.

        The one place where the new size is decided; a distributed agreement belongs here.
        Raises :class:`_TooSmall` when ``failed <= min_batch``.
        """
        if failed <= self.min_batch:
            raise _TooSmall
        state = self.states.get(key)
        old = None if state is None else state.limit
        if state is not None and state.grow_from is not None and failed > state.grow_from:
            new = state.grow_from
            state.grow_from = None
            state.wait *= 2
            state.ceiling = failed
            state.clean = 0
            state.limit = new
            return old, new, "grow failed"
        found = self.model_size(key, eps, room)
        refine = False
        if found is not None and found[0] < failed:
            new, fitted = found
            refine = not fitted
        elif room is not None:
            if found is not None:  # the model said it fits: its points for this key are stale
                self.points = {p: c for p, c in self.points.items() if p[0] != key}
            new, refine = failed // PROBE_DIVISOR, True
        else:
            new = failed // 2
        new = max(min(new, failed - 1), self.min_batch)
        if state is None:
            state = self.states[key] = _KeyState(eps=eps, limit=new, wait=self.grow_after or 0)
        state.limit = new
        state.ceiling = failed if state.ceiling is None else min(state.ceiling, failed)
        state.refine = refine
        state.grow_from = None
        state.clean = 0
        return old, new, "oom"

    def after_piece(
        self, key: Hashable, eps: int, n: int, room: int | None
    ) -> tuple[int, int] | None:
        """A piece of ``n`` rows succeeded: raise a rough limit to the model's; ``(old, new)``."""
        state = self.states.get(key)
        if state is None:
            return None
        if state.grow_from is not None and n > state.grow_from:
            state.grow_from = None  # the grow worked
            if state.ceiling is not None and n >= state.ceiling:
                state.ceiling = None
        if not state.refine:
            return None
        found = self.model_size(key, eps, room)
        if found is None:
            return None
        size, fitted = found
        state.refine = not fitted
        cap = math.inf if state.ceiling is None else state.ceiling - 1
        new = int(min(max(size, state.limit), cap))
        if new <= state.limit:
            return None
        old, state.limit = state.limit, new
        return old, new

    def finish(self, key: Hashable, clean: bool) -> None:
        """A call ended; count clean calls towards the next grow."""
        state = self.states.get(key)
        if state is not None:
            state.clean = state.clean + 1 if clean else 0

    def maybe_grow(
        self, key: Hashable, eps: int, total: int, room: int | None
    ) -> tuple[int, int] | None:
        """Before a batch of ``total`` rows: try a larger piece if it is time; ``(old, new)``."""
        state = self.states.get(key)
        if (
            self.grow_after is None
            or state is None
            or state.grow_from is not None
            or state.limit >= total
            or state.clean < state.wait
        ):
            return None
        target = min(2 * state.limit, total)
        found = self.model_size(key, eps, room)
        if found is not None and found[1]:  # a rough model would never let it grow
            target = min(target, found[0])
        if target <= state.limit:
            state.clean = 0  # the model says there is no room: wait again
            return None
        state.grow_from, state.limit = state.limit, target
        state.clean = 0
        return state.grow_from, target


# --------------------------------------------------------------------------------------------
# The failure of one attempt, without its traceback.


@dataclass(frozen=True)
class _Failure:
    exc: BaseException  # traceback stripped from every link: holds no frame, so no tensor
    kind: str
    optimizer: str | None  # the class name of the optimizer whose step() was running, if any
    ours: bool  # that optimizer is the one given to the decorator


def _strip_tracebacks(exc: BaseException) -> None:
    """Drop the traceback of every link of the chain: frames (and their tensors) can then die."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < MAX_CHAIN_DEPTH:
        link = stack.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        stack.extend(x for x in (link.__cause__, link.__context__) if x is not None)


def _optimizer_in_traceback(exc: BaseException) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step`` was on the stack when ``exc`` was raised, if any."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                return owner
        tb = tb.tb_next
    return None


# --------------------------------------------------------------------------------------------
# Gradient accumulation across the pieces of one batch.


class _Patch:
    """Replace an attribute of an object for a while (instance attribute, restored exactly)."""

    def __init__(self, obj: object, name: str, replacement: Callable[..., Any]) -> None:
        self.obj, self.name = obj, name
        self.had = name in vars(obj)
        self.previous = vars(obj).get(name)
        setattr(obj, name, replacement)

    def undo(self) -> None:
        if self.had:
            setattr(self.obj, self.name, self.previous)
        else:
            delattr(self.obj, self.name)


class _Accumulation:
    """One optimizer step from the pieces of a batch (see the module documentation)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scaler: Any,
    ) -> None:
        self.params = params
        self.optimizer = optimizer
        self.scaler = scaler
        self.weight = 1.0
        self.last = False
        self.touched = 0  # gradient hooks that ran in the current piece
        self.finished: set[int] = set()  # parameters done in the last piece
        self.buffers: dict[int, torch.Tensor] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]
        self.patches = [_Patch(optimizer, "step", self._wrap(optimizer.step, refuse_closure=True))]
        if scaler is not None:
            self.patches += [
                _Patch(scaler, name, self._wrap(getattr(scaler, name), refuse_closure=False))
                for name in ("unscale_", "step", "update")
            ]

    def begin_piece(self, weight: float, last: bool) -> None:
        self.weight, self.last, self.touched = weight, last, 0
        self.finished.clear()

    @property
    def dirty(self) -> bool:
        """Whether the current piece changed any gradient (then the batch must start over)."""
        return self.touched > 0 or any(p.grad is not None for p in self.params)

    def _accumulated(self, p: torch.Tensor) -> None:
        """After a piece's gradient reached ``p.grad``: weight it in place, then move it to the
        buffer (early pieces) or add the buffer to it (last piece). No gradient is copied."""
        self.touched += 1
        grad = p.grad
        if grad is None:
            return
        if self.weight != 1.0:
            if id(p) in self.finished:
                raise AutobatchError(
                    "backward() ran twice for the same parameter in the last micro-batch; with "
                    "reduction='mean' autobatch cannot weight the second gradient. Call "
                    "backward() once per step, or use reduction='sum' or policy='shrink'"
                )
            grad.mul_(self.weight)
        buffer = self.buffers.pop(id(p), None)
        if self.last:
            self.finished.add(id(p))
            if buffer is not None:
                grad.add_(buffer)
            return
        p.grad = None
        self.buffers[id(p)] = grad if buffer is None else buffer.add_(grad)

    def merge(self) -> None:
        """Give parameters that got no gradient in the last piece their earlier pieces' sum."""
        for p in self.params:
            buffer = self.buffers.pop(id(p), None)
            if buffer is not None:
                p.grad = buffer if p.grad is None else p.grad.add_(buffer)

    def _wrap(self, real: Callable[..., Any], *, refuse_closure: bool) -> Callable[..., Any]:
        def only_in_last_piece(*args: Any, **kwargs: Any) -> Any:
            if refuse_closure and (args or kwargs.get("closure") is not None):
                raise AutobatchError(
                    "optimizer.step(closure) re-evaluates the loss, which cannot be split into "
                    "micro-batches; use policy='shrink' for closure-based optimizers such as LBFGS"
                )
            if not self.last:
                return None
            self.merge()
            return real(*args, **kwargs)

        return only_in_last_piece

    def restart(self) -> None:
        """Forget every piece: gradients to ``None``."""
        self.buffers.clear()
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        self.merge()
        for handle in self.handles:
            handle.remove()
        for patch in reversed(self.patches):
            patch.undo()


def _reset_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Drop the GradScaler's per-optimizer stage (after ``unscale_`` in a failed attempt).

    GradScaler has no public way to do this; ``update()`` does the same for every optimizer.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):
        states.pop(id(optimizer), None)


# --------------------------------------------------------------------------------------------
# Joining the results of the pieces.


class _CannotJoin(Exception):
    pass


def _join(values: list[Any], sizes: list[int], weights: list[float]) -> Any:
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            if not first.is_floating_point():  # counts add up
                return sum((v.detach() for v in values[1:]), values[0].detach())
            total = values[0].detach() * weights[0]
            for v, w in zip(values[1:], weights[1:], strict=True):
                total = total + v.detach() * w
            return total
        if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes, strict=True)):
            return torch.cat(values)
        raise _CannotJoin
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if all(isinstance(v, int) for v in values):
            return sum(values)
        return sum(w * v for v, w in zip(values, weights, strict=True))
    if isinstance(first, Mapping) and all(
        isinstance(v, Mapping) and list(v) == list(first) for v in values
    ):
        joined = {k: _join([v[k] for v in values], sizes, weights) for k in first}
        try:
            return cast(Any, type(first))(joined)
        except Exception:
            return joined
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) for v in values):
        if isinstance(first, list) and all(len(v) == n for v, n in zip(values, sizes, strict=True)):
            return [item for v in values for item in v]
        if all(len(v) == len(first) for v in values):
            items = [_join([v[i] for v in values], sizes, weights) for i in range(len(first))]
            if hasattr(first, "_make"):
                return first._make(items)
            return type(first)(items)
        raise _CannotJoin
    try:
        if all(bool(v == first) for v in values):
            return first
    except Exception:
        pass
    raise _CannotJoin


def _combine(pieces: list[tuple[int, Any]], total: int, reduction: Reduction) -> Any:
    if len(pieces) == 1:
        return pieces[0][1]
    sizes = [n for n, _ in pieces]
    weights = [n / total for n in sizes] if reduction == "mean" else [1.0] * len(sizes)
    values = [v for _, v in pieces]
    try:
        return _join(values, sizes, weights)
    except _CannotJoin:
        return values


# --------------------------------------------------------------------------------------------
# Agreement between ranks (torch.distributed).

#: How often a first ``optimizer.step()`` that ran out of memory is tried under a process group.
STEP_TRIES = 3
#: Attempts watched for collectives of the step's own; where none was seen, no gate after them.
GATE_ATTEMPTS = 4


class _PeerFailed(AutobatchError):
    """Another rank ran out of memory in this attempt; every rank stops it and recovers alike."""

    def __init__(self, codes: list[int]) -> None:
        self.ranks = [r for r, code in enumerate(codes) if code != _distributed.OK]
        super().__init__(f"rank {', '.join(map(str, self.ranks))} ran out of memory")


def _peer_error(codes: list[int], where: str) -> AutobatchError:
    failed = [r for r, code in enumerate(codes) if code == _distributed.FAILED]
    return AutobatchError(
        f"rank {', '.join(map(str, failed))} failed {where} with an error autobatch cannot "
        "recover from (see that rank's traceback); every rank stops here instead of waiting"
    )


_SHARDED: dict[type, bool] = {}


def _is_sharded(cls: type) -> bool:
    """Whether a module class is FSDP (the wrapper, or a module made by ``fully_shard``)."""
    found = _SHARDED.get(cls)
    if found is None:
        names = ("FullyShardedDataParallel", "FSDPModule")
        found = _SHARDED[cls] = any(c.__name__ in names for c in cls.__mro__)
    return found


class _Coordination:
    """Keeps the ranks of a process group in lockstep through an engine's attempts.

    Every attempt (one piece of a batch) ends with one vote on a side gloo group (OK, OOM or
    FAILED per rank), or earlier, at the first agreement point where some rank reports a
    failure: at the end of the backward that follows a ``DistributedDataParallel`` forward (and
    before that forward where DDP broadcasts buffers in it). The model's own collectives
    therefore never run while another rank has already left the attempt.

    DDP's reducer is kept out of backward (``require_backward_grad_sync`` is off during attempts,
    as ``no_sync()`` does). At the end of the backward of a batch's last piece, once every rank
    has voted that its backward finished, the gradients are averaged over the ranks exactly as
    DDP's default reduction does, so that code between ``backward()`` and ``optimizer.step()``
    (unscaling, clipping, GradScaler's inf check) sees the same gradients as under DDP. An OOM
    inside a rank's first ``optimizer.step()`` (state being created, no parameter changed) is
    retried on that rank alone with the same averaged gradients, so the update is the same as
    the others'; any other failure stops every rank with :class:`~autobatch.AutobatchError` at
    the attempt's last vote.
    """

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.active = False
        self.last = True  # the attempt's piece ends the batch (its backward is averaged)
        self.session: _Accumulation | None = None
        self.settled: list[int] | None = None  # the vote of this attempt that saw a failure
        self.modules: dict[int, DistributedDataParallel] = {}  # DDP modules run this attempt
        self.flags: list[tuple[DistributedDataParallel, bool]] = []  # forwards under way
        self.armed = False  # a DDP forward ran: average at the end of the next backward
        self.queued = False
        self.hooked: set[int] = set()  # DDP modules whose parameters carry our gradient hook
        self.patched: _Patch | None = None
        self.watched = 0  # attempts run with the collective gate
        self.collectives = False  # the step issues collectives of its own

    # Votes ------------------------------------------------------------------------------------

    def _vote(self, code: int) -> list[int]:
        codes, _ = _distributed.vote(code)
        if max(codes) != _distributed.OK:
            self.settled = codes
        return codes

    def checkpoint(self, missing: bool = False) -> bool:
        """An agreement point inside the step: go on only if no rank has failed. Returns whether
        ``missing`` holds on some rank."""
        if self.settled is not None:
            codes = self.settled
        else:
            codes, missing = _distributed.vote(_distributed.OK, missing)
            if max(codes) != _distributed.OK:
                self.settled = codes
        if max(codes) == _distributed.FAILED:
            raise _peer_error(codes, "during this step")
        if max(codes) != _distributed.OK:
            raise _PeerFailed(codes)
        return missing

    def finish(self, code: int) -> list[int]:
        """The attempt's verdict: every rank's code (one vote, unless one already saw a failure)."""
        return self.settled if self.settled is not None else self._vote(code)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return _distributed.agree_max([int(flag)])[0] > 0

    def piece(self, n: int, total: int) -> int:
        """The piece size every rank takes: the smallest proposed (batches must be equal)."""
        n, low, negated_high = _distributed.agree_min([n, total, -total])
        if low != -negated_high:
            raise AutobatchError(
                f"{self.engine.name}: the ranks' batches differ in size ({low} to {-negated_high} "
                "rows), so they cannot be split into the same number of micro-batches; give "
                "every rank batches of one size (DistributedSampler, drop_last=True)"
            )
        return n

    # One attempt ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attempt(self, *, last: bool, session: _Accumulation | None) -> Iterator[None]:
        """Run one attempt in lockstep with the other ranks; ``last``: its piece ends the batch."""
        optimizer = self.engine.optimizer
        if optimizer is not None and self.patched is None:
            real = optimizer.step
            self.patched = _Patch(optimizer, "step", functools.partial(self._step, real))
        self.settled = None
        self.active, self.last, self.session = True, last, session
        self.armed = self.queued = False
        hooks = [
            register_module_forward_pre_hook(self._before_forward),
            register_module_forward_hook(self._after_forward, always_call=True),
        ]
        gate = None
        if self.collectives or self.watched < GATE_ATTEMPTS:
            # (a DDP forward under way has its collectives agreed before it: see _before_forward)
            gate = _distributed.CollectiveGate(self.checkpoint, lambda: bool(self.flags))
            self.watched += 1
        try:
            with gate if gate is not None else contextlib.nullcontext():
                yield
        finally:
            if gate is not None and gate.seen:
                self.collectives = True
            for hook in hooks:
                hook.remove()
            self.active = self.armed = self.queued = False
            self.session = None
            while self.flags:
                module, flag = self.flags.pop()
                module.require_backward_grad_sync = flag
            self.modules.clear()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if _is_sharded(type(module)):
            self._refuse(
                f"{self.engine.name} runs an FSDP module: its forward and backward gather and "
                "scatter parameters with collectives that a rank which ran out of memory would "
                "never join, so autobatch cannot keep the ranks in step. Use "
                "retry_on_oom(sync_ranks=False) only where ranks are independent"
            )
        if not isinstance(module, DistributedDataParallel):
            return
        unsupported = [
            what for what, present in (
                ("static_graph=True", getattr(module, "static_graph", False)),
                ("a communication hook", getattr(module, "_comm_hooks", None)),
            ) if present
        ]
        if unsupported:
            self._refuse(
                f"{self.engine.name}: this DistributedDataParallel module has "
                f"{' and '.join(unsupported)}, which autobatch's gradient averaging would "
                "bypass; use retry_on_oom(sync_ranks=False), or drop that option"
            )
        self.modules[id(module)] = module
        wanted = module.require_backward_grad_sync  # False inside the user's own no_sync()
        self.flags.append((module, wanted))
        if id(module) not in self.hooked:
            self.hooked.add(id(module))
            for p in module.module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_ready)
        module.require_backward_grad_sync = False  # for this forward: autobatch averages later
        self.armed = self.armed or (self.last and wanted)  # where DDP would reduce, so do we
        if module.broadcast_buffers and any(True for _ in module.module.buffers()):
            self.checkpoint()  # DDP's forward begins with a collective (the buffers' broadcast)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, DistributedDataParallel) and self.flags:
            owner, flag = self.flags.pop()
            owner.require_backward_grad_sync = flag

    def _refuse(self, problem: str) -> None:
        if self.settled is None:
            self._vote(_distributed.FAILED)  # the others stop at their next vote
        raise AutobatchError(problem)

    def _gradient_ready(self, _: torch.Tensor) -> None:
        """A DDP parameter got its gradient: average them all once this backward has ended."""
        if self.active and self.armed and not self.queued:
            self.queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """End of the backward of a batch's last piece: agree, then average the gradients (after
        every such backward: averaging gradients that are already equal on every rank again
        changes nothing, and a second backward adds new ones)."""
        self.queued = False
        if self.session is not None:
            self.session.merge()  # the earlier pieces' sums, for parameters the last one missed
        averages = []  # staging buffers first: an OOM here is still an ordinary, agreed one
        for module in self.modules.values():
            ignored: set[str] = set(getattr(module, "parameters_to_ignore", ()))
            params = [
                p for name, p in module.module.named_parameters()
                if p.requires_grad and name not in ignored
            ]
            averages.append(_distributed.GradientAverage(params, module.process_group))
        present = [f for a in averages for f in a.present]
        if self.checkpoint(missing=not all(present)):  # every rank has finished its backward
            present = _distributed.agree_max(present)  # some gradient is None on some rank
        for average in averages:
            average.run(present[: len(average.params)])
            present = present[len(average.params) :]

    def _step(self, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The optimizer's step during attempts: a first step that ran out of memory is tried
        again on this rank (the gradients, averaged already, are the same on every rank)."""
        optimizer = self.engine.optimizer
        if not self.active or optimizer is None:
            return real(*args, **kwargs)
        error: BaseException | None = None
        for _ in range(STEP_TRIES):
            versions = sum(sum(map(_VERSION, g["params"])) for g in optimizer.param_groups)
            first = not optimizer.state
            try:
                return real(*args, **kwargs)
            except BaseException as exc:
                _strip_tracebacks(exc)
                unchanged = versions == sum(
                    sum(map(_VERSION, g["params"])) for g in optimizer.param_groups
                )
                error = exc
                retry = is_oom_error(exc) and not isinstance(exc, AutobatchError)
                if not (retry and first and unchanged):
                    break
            # Out of the except block: the failed first step is gone. The other ranks learn
            # nothing of this retry: the averaged gradients are the same, so is the update.
            self.engine.tally.ooms += 1
            optimizer.state.clear()  # every entry was made by the failed first step
            error = None
            free_memory(self.engine.device_of_optimizer())
        raise AutobatchError(
            f"{self.engine.name}: optimizer.step() failed on this rank"
            + ("" if error is None else f" ({type(error).__name__})")
            + " after the gradients were averaged, and could not be retried; the other ranks' "
            "steps may have gone on, so the ranks' parameters may now differ and every rank "
            "stops. Restore from a checkpoint"
        ) from error


# --------------------------------------------------------------------------------------------
# The engine.


def _rows(batch: Batch) -> int:
    """Rows of a batch for statistics only: a fast look at the first tensor, else batch_size."""
    first = batch
    while isinstance(first, (tuple, list)) and first and not hasattr(first, "_fields"):
        first = first[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    try:
        return batch_size(batch)
    except (TypeError, ValueError):
        return 0


def _batch_parameter(
    fn: Callable[..., Any], batch_arg: str | None
) -> tuple[int | None, str | None]:
    """Where the batch is in a call of ``fn``: (positional index, keyword name)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if batch_arg is not None:
        for index, param in enumerate(params):
            if param.name == batch_arg and param.kind in (
                *positional,
                inspect.Parameter.KEYWORD_ONLY,
            ):
                return (index if param.kind in positional else None), param.name
        names = ", ".join(p.name for p in params) or "none"
        raise ValueError(
            f"batch_arg={batch_arg!r} is not a parameter of {getattr(fn, '__qualname__', fn)!r} "
            f"(parameters: {names}); pass the name of the argument that holds the batch"
        )
    for index, param in enumerate(params):
        if param.kind in positional and param.name not in ("self", "cls"):
            return index, (None if param.kind == inspect.Parameter.POSITIONAL_ONLY else param.name)
        if param.kind == inspect.Parameter.VAR_POSITIONAL:
            return index, None
    if not params:
        return 0, None
    raise ValueError(
        f"{getattr(fn, '__qualname__', fn)!r} takes no positional argument to split; pass "
        "batch_arg= with the name of the argument that holds the batch"
    )


def _modules_of(fn: Callable[..., Any]) -> list[nn.Module]:
    """Modules the step function refers to by name (globals and closure), for the BatchNorm check."""
    try:
        names = inspect.getclosurevars(inspect.unwrap(fn))
    except (TypeError, ValueError):
        return []
    values = [*names.nonlocals.values(), *names.globals.values()]
    return [v for v in values if isinstance(v, nn.Module)]


class _Engine:
    """Runs one decorated step function; holds its learned sizes and statistics."""

    def __init__(self, fn: Callable[..., Any], options: RecoveryOptions) -> None:
        self.fn = fn
        self.options = options
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.policy: Policy = cast(Policy, options.policy)
        self.optimizer = options.optimizer
        self.index, self.keyword = _batch_parameter(fn, options.batch_arg)
        self.sizes = _Sizes(
            min_batch=options.min_batch, grow_after=options.grow_after, headroom=options.headroom
        )
        self.tally = _Tally()
        self.calls = 0
        self.warned_batchnorm = False
        self.coordination: _Coordination | None = None

    def coordinated(self) -> _Coordination | None:
        """The agreement with the other ranks, under a process group (unless ``sync_ranks=False``)."""
        if not (self.options.sync_ranks and _distributed.active()):
            return None
        if self.coordination is None:
            self.coordination = _Coordination(self)
        return self.coordination

    def device_of_optimizer(self) -> DeviceLike:
        """The device of the optimizer's first parameter (``None`` without one)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    return cast(torch.Tensor, p).device
        return None

    # Bookkeeping ------------------------------------------------------------------------------

    def _size_changed(
        self, old: int | None, new: int, reason: str, guard: oom_guard[Any] | None
    ) -> None:
        self.tally.change(SizeChange(self.calls, self.name, old, new, reason))
        if guard is not None:
            guard._size_changed(self, old, new, reason)
        logger.info(
            "%s: micro-batch size %s -> %d (%s) at call %d",
            self.name,
            "whole batch" if old is None else old,
            new,
            reason,
            self.calls,
        )

    def _locate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch:
        if self.keyword is not None and self.keyword in kwargs:
            return kwargs[self.keyword]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        raise TypeError(
            f"{self.name}() was called without its batch (argument "
            f"{self.keyword or self.index!r}); autobatch splits that argument on OOM"
        )

    def _with_batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], piece: Batch
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.keyword is not None and self.keyword in kwargs:
            return args, {**kwargs, self.keyword: piece}
        assert self.index is not None  # _locate found it positionally
        return (*args[: self.index], piece, *args[self.index + 1 :]), kwargs

    def _device(self, batch: Batch) -> DeviceLike:
        if self.options.device is not None:
            return self.options.device
        for t in tensors(batch):
            return t.device
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    return cast(torch.Tensor, p).device
        return None

    # The optimizer's bookkeeping for "was the update applied?" --------------------------------

    def _stamp(self) -> tuple[int, bool] | None:
        """The parameters' in-place modification count, and whether the optimizer has no state
        yet (its first step). Cheap: only the parameters' version counters are read."""
        opt = self.optimizer
        if opt is None:
            return None
        return sum(sum(map(_VERSION, g["params"])) for g in opt.param_groups), not opt.state

    def _check_optimizer(self, failure: _Failure, stamp: tuple[int, bool] | None) -> None:
        """Raise unless retrying is safe; after a failed first step, drop the state it made.

        Safe: the OOM came before ``optimizer.step()`` (no parameter changed), or inside the
        first step while the state was being created and before any parameter changed.
        """
        if failure.optimizer is not None and not failure.ours:
            raise AutobatchError(
                f"{self.name} ran out of memory inside {failure.optimizer}.step(), an optimizer "
                "autobatch was not given, so it cannot tell whether the update was partly "
                "applied; decorate with retry_on_oom(optimizer=...)"
            ) from failure.exc
        if stamp is None:
            return
        opt = self.optimizer
        assert opt is not None
        versions, first_step = stamp
        changed = sum(sum(map(_VERSION, g["params"])) for g in opt.param_groups) != versions
        if failure.optimizer is None:
            if changed:
                raise AutobatchError(
                    f"{self.name} ran out of memory after optimizer.step() had updated the "
                    "parameters; retrying would apply the update twice, so it is not retried. "
                    "Leave more memory free after the step, or move that work out of the step"
                ) from failure.exc
            return
        if changed or not first_step:
            raise AutobatchError(
                f"{self.name} ran out of memory inside {failure.optimizer}.step(), which updates "
                "its state and the parameters in place: the update may be partly applied, so it "
                "is not retried (autobatch retries an OOM inside the step only on the first step, "
                "while the state is being created). Restore from a checkpoint; leave more memory "
                "for the optimizer (a smaller model, foreach=False) to avoid it"
            ) from failure.exc
        opt.state.clear()  # every entry was made by the failed first step, some half-made

    # Running ----------------------------------------------------------------------------------

    def _capture(self, exc: BaseException) -> _Failure | None:
        """Called inside ``except``: the failure to recover from, or ``None`` to re-raise."""
        if isinstance(exc, _PeerFailed):
            return _Failure(exc=exc, kind=str(exc), optimizer=None, ours=False)
        if isinstance(exc, AutobatchError) or not is_oom_error(exc):
            return None
        owner = _optimizer_in_traceback(exc)
        failure = _Failure(
            exc=exc,
            kind=oom_kind(exc) or "oom",
            optimizer=None if owner is None else type(owner).__name__,
            ours=owner is not None and owner is self.optimizer,
        )
        _strip_tracebacks(exc)
        return failure

    def call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        failure: _Failure | None = None,
        stamp: tuple[int, bool] | None = None,
    ) -> Any:
        """Run a call on the slow path (``failure``: the whole batch already ran out of memory)."""
        batch = self._locate(args, kwargs)
        guard = _ACTIVE_GUARD.get()
        if guard is not None:
            guard._notice(self, batch)
        return self._run(args, kwargs, batch, failure, stamp, guard)

    def _finished(self, samples: int) -> None:
        self.calls += 1
        self.tally.samples += samples

    def _unsplittable(self, batch: Batch, failure: _Failure, reason: str) -> AutobatchError:
        return AutobatchError(
            f"{self.name} ran out of memory ({failure.kind}) on a batch it cannot split: {reason}. "
            f"The batch was {describe(batch)}; batches split along dimension 0 of their tensors "
            "and of per-sample lists (lists of str/int as long as the batch), and copy other "
            "values into every piece"
        )

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: Batch,
        failure: _Failure | None,
        stamp: tuple[int, bool] | None,
        guard: oom_guard[Any] | None,
    ) -> Any:
        """Run ``batch`` in pieces, recovering from OOM; ``failure`` is a first whole-batch OOM."""
        try:
            total = batch_size(batch)
        except (TypeError, ValueError) as error:
            reason = str(error)
        else:
            reason = ""
        if reason:
            if failure is None:  # nothing to split by: run it whole, once
                try:
                    result = self.fn(*args, **kwargs)
                except BaseException as exc:
                    failure = self._capture(exc)
                    if failure is None:
                        raise
                else:
                    self._finished(0)
                    return result
            self.tally.ooms += 1
            raise self._unsplittable(batch, failure, reason) from failure.exc
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = PeakKeeping(memory_for(self._device(batch)))  # resets the user never sees
        statistics = memory.has_statistics
        coord = self.coordinated()
        pieces: list[tuple[int, Any]] = []
        done = 0
        clean = True
        session: _Accumulation | None = None
        try:
            if failure is not None:  # the whole batch failed on the fast path
                clean = False
                session = self._recover(
                    failure, stamp, key, eps, total, total, memory, session, guard
                )
            else:
                if self.policy == "accumulate":
                    # The step zeroes them first thing; doing it here keeps the pieces' measured
                    # costs alike (none of them frees the last step's gradients).
                    for p in self._params():
                        p.grad = None
                grown = self.sizes.maybe_grow(key, eps, total, _room(memory))
                if grown is not None:
                    self._size_changed(*grown, "grow", guard)
            while done < total:
                n = self.sizes.piece(key, eps, total - done, _room(memory))
                if coord is not None and self.sizes.pressure:
                    n = coord.piece(n, total - done)
                if n < total:
                    self._warn_batchnorm()
                    if session is None and self.policy == "accumulate":
                        session = self._accumulation()
                if session is not None:
                    weight = n / total if self.options.reduction == "mean" else 1.0
                    session.begin_piece(weight, last=done + n == total)
                piece = batch if n == total else slice_batch(batch, done, done + n)
                piece_args, piece_kwargs = self._with_batch(args, kwargs, piece)
                del piece
                stamp = self._stamp()
                phases = _PhasePeaks(memory)  # peaks outside and inside optimizer.step
                baseline = 0
                if statistics:
                    memory.reset_peak()
                    baseline = memory.allocated_bytes()
                failure = None
                try:
                    with phases, (
                        contextlib.nullcontext() if coord is None
                        else coord.attempt(last=done + n == total or self.policy == "shrink",
                                           session=session)
                    ):
                        result = self.fn(*piece_args, **piece_kwargs)
                except BaseException as exc:
                    failure = self._capture(exc)
                    if failure is None:
                        if coord is not None:
                            coord.finish(_distributed.FAILED)
                        raise
                del piece_args, piece_kwargs
                if coord is not None:
                    codes = coord.finish(_distributed.OK if failure is None else _distributed.OOM)
                    if max(codes) == _distributed.FAILED:
                        raise _peer_error(codes, "in this step")
                    if failure is None and max(codes) != _distributed.OK:
                        failure = self._capture(_PeerFailed(codes))
                if failure is None:
                    if statistics:  # the step's own memory does not grow with the piece
                        self.sizes.record(key, eps, n, phases.outside - baseline)
                    pieces.append((n, result))
                    done += n
                    refined = self.sizes.after_piece(key, eps, n, _room(memory))
                    if refined is not None:
                        self._size_changed(*refined, "refine", guard)
                    continue
                clean = False
                lost = n
                dirty = session is not None and session.dirty
                if coord is not None:
                    dirty = coord.any(dirty)  # one rank's sum is spoilt: every rank starts over
                if dirty:
                    lost += done  # this piece's gradients reached the sum: the batch starts over
                    pieces.clear()
                    done = 0
                session = self._recover(
                    failure, stamp, key, eps, n, lost, memory, session, guard, restart=dirty
                )
        finally:
            if session is not None:
                session.close()
            memory.restore_peak()
        self.sizes.finish(key, clean)
        self._finished(total)
        self.tally.micro_batch_size = max(n for n, _ in pieces) if len(pieces) > 1 else None
        return _combine(pieces, total, self.options.reduction)

    def _recover(
        self,
        failure: _Failure,
        stamp: tuple[int, bool] | None,
        key: Hashable,
        eps: int,
        failed: int,
        lost: int,
        memory: DeviceMemory,
        session: _Accumulation | None,
        guard: oom_guard[Any] | None,
        *,
        restart: bool = False,
    ) -> _Accumulation | None:
        """After an OOM at ``failed`` rows: check the optimizer, clean up, free memory, and pick a
        smaller size. ``lost`` samples are redone; ``restart``: the batch starts over. Returns the
        accumulation to continue with. Under a process group every rank takes the same size."""
        self.tally.ooms += 1
        self.tally.samples_recomputed += lost
        if guard is not None:
            guard._oom(lost)
        coord = self.coordinated()
        problem: AutobatchError | None = None
        try:
            self._check_optimizer(failure, stamp)
        except AutobatchError as error:
            if coord is None:
                raise
            problem = error  # raised once the other ranks know
        if self.policy == "accumulate" and problem is None:
            if session is None:  # a whole-batch attempt: its gradients may be partly summed
                session = self._accumulation()
                session.restart()
            elif restart or session.dirty:
                session.restart()
        if self.options.scaler is not None and self.optimizer is not None:
            _reset_scaler(self.options.scaler, self.optimizer)
        free_memory(memory.device)
        try:
            too_small = problem is not None
            if problem is None:
                try:
                    old, new, reason = self.sizes.after_oom(key, eps, failed, _room(memory))
                except _TooSmall:
                    too_small = True
            if coord is not None:
                # One decision for every rank: -1 someone cannot go on, 0 too small, else the
                # smallest size any rank chose.
                agreed = coord.piece(-1 if problem else 0 if too_small else new, failed)
                if agreed < 0:
                    raise problem or AutobatchError(
                        f"{self.name}: another rank cannot recover from this step's failure "
                        f"({failure.kind}); see that rank's error. Every rank stops here"
                    ) from failure.exc
                too_small = agreed == 0
                if not too_small and agreed != new:
                    self.sizes.states[key].limit = new = agreed
            if too_small:
                raise _TooSmall
        except _TooSmall:
            needed: int | None = None
            found = self.sizes.model(key)
            if found is not None:
                needed = memory.allocated_bytes() + int(found[0].predict(failed * eps))
            raise BatchSizeError(
                f"{self.name} ran out of memory ({failure.kind}) at a micro-batch of {failed} "
                f"(min_batch={self.options.min_batch}) on {memory.name}"
                + ("" if needed is None else f": it needs about {format_bytes(needed)}")
                + f" of {format_bytes(memory.capacity_bytes())}. Lower min_batch if allowed, "
                "free memory held elsewhere, or use a smaller model, a lower precision or "
                "activation checkpointing",
                batch_size=failed,
                needed_bytes=needed,
                capacity_bytes=memory.capacity_bytes(),
            ) from failure.exc
        self._size_changed(old, new, reason, guard)
        return session

    def _params(self) -> list[torch.Tensor]:
        """Trainable parameters of the optimizer and of ``model=``, once each."""
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        groups = [] if self.optimizer is None else self.optimizer.param_groups
        extra = [] if self.options.model is None else list(self.options.model.parameters())
        for p in [p for g in groups for p in g["params"]] + extra:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        return params

    def _accumulation(self) -> _Accumulation:
        assert self.optimizer is not None  # RecoveryOptions requires it for "accumulate"
        return _Accumulation(self._params(), self.optimizer, self.options.scaler)

    def _warn_batchnorm(self) -> None:
        if self.warned_batchnorm:
            return
        self.warned_batchnorm = True
        models = [self.options.model] if self.options.model is not None else _modules_of(self.fn)
        for model in models:
            norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            if any(m.training for m in norms):
                warnings.warn(
                    f"{self.name} is running in micro-batches, and {type(model).__name__} has "
                    "BatchNorm layers in training mode: their statistics are computed per "
                    "micro-batch, so results differ slightly from whole batches (GroupNorm or "
                    "LayerNorm do not depend on the batch)",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                return

    # For the guard ----------------------------------------------------------------------------

    def guard_piece(self, batch: Batch, done: int, total: int) -> int:
        """The size of the next piece the guard should yield (``"shrink"`` only)."""
        if not self.sizes.pressure:
            return total - done
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = memory_for(self._device(batch))
        if done == 0:
            grown = self.sizes.maybe_grow(key, eps, total, _room(memory))
            if grown is not None:
                self._size_changed(*grown, "grow", _ACTIVE_GUARD.get())
        n = self.sizes.piece(key, eps, total - done, _room(memory))
        coord = self.coordinated()
        if coord is not None:
            n = coord.piece(n, total - done)
        if n < total:
            self._warn_batchnorm()
        return n


def _room(memory: DeviceMemory) -> int | None:
    """Bytes a piece may add: what is free on the device now (``None`` without statistics)."""
    if not memory.has_statistics:
        return None
    return memory.free_bytes()


# --------------------------------------------------------------------------------------------
# Front-end 1: the decorator.


class RetryingStep(Generic[P, R]):
    """A step function that recovers from out-of-memory errors; made by :func:`retry_on_oom`.

    Calls behave like the wrapped function's. ``stats`` says what happened; ``reset()`` forgets
    the learned sizes (for a new model or device).

    >>> step = retry_on_oom(lambda batch: batch.sum())
    >>> import torch
    >>> float(step(torch.ones(4))), step.stats.batches
    (4.0, 1)
    """

    def __init__(self, fn: Callable[P, R], options: RecoveryOptions) -> None:
        functools.update_wrapper(self, fn)
        self._engine = _Engine(fn, options)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        engine = self._engine
        if engine.sizes.states or engine.coordinated() is not None:
            # memory ran short before (pieces, measured), or every step is agreed by all ranks
            return cast(R, engine.call(args, kwargs))
        stamp = engine._stamp()  # the fast path: a try, and the parameters' version counters
        try:
            result = engine.fn(*args, **kwargs)
        except BaseException as exc:
            failure = engine._capture(exc)
            if failure is None:
                raise
        else:
            engine.calls += 1
            return cast(R, result)
        return cast(R, engine.call(args, kwargs, failure, stamp))

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., R]:
        if obj is None:
            return self
        return types.MethodType(self, obj)

    @property
    def options(self) -> RecoveryOptions:
        """The options this step was decorated with."""
        return self._engine.options

    @property
    def stats(self) -> RecoveryStats:
        """OOMs, size changes and the current micro-batch size of this step (``samples`` counts
        the calls that ran once memory had run short; the guard counts every sample)."""
        return self._engine.tally.snapshot(batches=self._engine.calls)

    def reset(self) -> None:
        """Forget the learned sizes and the memory model (statistics are kept)."""
        engine = self._engine
        engine.sizes = _Sizes(
            min_batch=engine.options.min_batch,
            grow_after=engine.options.grow_after,
            headroom=engine.options.headroom,
        )
        engine.tally.micro_batch_size = None

    def __repr__(self) -> str:
        return f"<retry_on_oom {self._engine.name} policy={self._engine.policy}>"


@overload
def retry_on_oom(fn: Callable[P, R], /) -> RetryingStep[P, R]: ...


@overload
def retry_on_oom(
    fn: None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    policy: Policy | None = None,
    reduction: Reduction = "mean",
    batch_arg: str | None = None,
    min_batch: int = 1,
    grow_after: int | None = None,
    scaler: Any = None,
    model: nn.Module | None = None,
    device: DeviceLike = None,
    headroom: float = 0.1,
    sync_ranks: bool = True,
) -> Callable[[Callable[P, R]], RetryingStep[P, R]]: ...


def retry_on_oom(
    fn: Callable[P, R] | None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    policy: Policy | None = None,
    reduction: Reduction = "mean",
    batch_arg: str | None = None,
    min_batch: int = 1,
    grow_after: int | None = None,
    scaler: Any = None,
    model: nn.Module | None = None,
    device: DeviceLike = None,
    headroom: float = 0.1,
    sync_ranks: bool = True,
) -> RetryingStep[P, R] | Callable[[Callable[P, R]], RetryingStep[P, R]]:
    """Make a step function survive CUDA out-of-memory by running its batch in smaller pieces.

    Usable bare (``@retry_on_oom``) or with options (``@retry_on_oom(optimizer=opt)``). Piece
    sizes are learned per decorated function and reused from the next call on, so an OOM costs one
    retry once, not every step. See the module documentation for the policies and what the call
    returns when the batch was split.

    >>> import torch
    >>> from autobatch.testing import SimulatedGPU
    >>> model = torch.nn.Linear(256, 256)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> @retry_on_oom(optimizer=opt)
    ... def train_step(x):
    ...     opt.zero_grad()
    ...     loss = model(x).square().mean()
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> with SimulatedGPU("2MiB", adopt=[model]):
    ...     _ = train_step(torch.randn(512, 256))
    >>> train_step.stats.ooms, train_step.stats.micro_batch_size is not None
    (1, True)

    Args:
        fn: the step function (bare form only).
        optimizer: the optimizer the step calls; enables ``"accumulate"`` and the check that an
            OOM did not leave a partly applied update.
        policy: ``"accumulate"`` (one optimizer step per batch; default with an optimizer) or
            ``"shrink"`` (one step per piece; default without).
        reduction: how the step's loss reduces over samples: ``"mean"`` weights each piece by its
            share of the batch, ``"sum"`` adds pieces.
        batch_arg: the name of the argument holding the batch; default the first positional one
            (``self``/``cls`` skipped).
        min_batch: the smallest piece allowed; an OOM at it raises :class:`BatchSizeError`.
        grow_after: after this many calls without OOM, try a piece twice as large (never past the
            batch); a failed try returns to the last good size and doubles the wait.
        scaler: the ``torch.amp.GradScaler`` the step uses, so that its ``unscale_``, ``step``
            and ``update`` run once per batch under ``"accumulate"``.
        model: the model, for the warning about BatchNorm in micro-batches and to weight
            gradients of parameters outside the optimizer (default: modules the step function
            refers to by name).
        device: where memory is measured; default the device of the batch's first tensor.
        headroom: the fraction of the memory model's largest size left unused.
        sync_ranks: under an initialised ``torch.distributed`` process group, keep every rank in
            lockstep: an OOM on one rank makes every rank retry the same batch with the same
            micro-batch size, and ``DistributedDataParallel`` gradients are averaged once per
            optimizer step after all ranks finished their backward (README, "Multiple GPUs").
            ``False`` for independent per-rank jobs.
    """
    options = RecoveryOptions(
        optimizer=optimizer,
        policy=policy,
        reduction=reduction,
        batch_arg=batch_arg,
        min_batch=min_batch,
        grow_after=grow_after,
        scaler=scaler,
        model=model,
        device=device,
        headroom=headroom,
        sync_ranks=sync_ranks,
    )

    def decorate(step: Callable[P, R]) -> RetryingStep[P, R]:
        if not callable(step):
            raise TypeError(
                f"retry_on_oom decorates a function, got {type(step).__name__}; pass options "
                "by name, e.g. @retry_on_oom(optimizer=opt)"
            )
        return RetryingStep(step, options)

    return decorate if fn is None else decorate(fn)


# --------------------------------------------------------------------------------------------
# Front-end 2: the guard around the loop.


class oom_guard(Generic[T]):  # used like a function: `with oom_guard(loader) as guard`
    """Iterate a loader so that a step decorated with :func:`retry_on_oom` adapts to memory.

    Any iterable of batches works (a DataLoader, a list, a generator). Inside
    ``with oom_guard(loader) as guard: for batch in guard:`` the decorated step finds the guard on
    its own (a context variable); the guard follows the step that receives the very object it
    handed out (a step called with a copy, e.g. the batch moved to the GPU, still recovers by
    itself, from its learned size). Under ``"shrink"`` the guard hands out pieces of the loader's
    batches at the step's learned size, in order (pieces never span two batches; the rest of a
    batch that was being processed keeps coming at the new size). Under ``"accumulate"`` it hands
    out whole batches and the step splits them at its learned size from the start.

    An OOM that escapes the loop body (an undecorated step) is not swallowed: the guard raises
    :class:`~autobatch.AutobatchError` from it, saying to decorate the step. A loop body cannot be
    replayed, so there is nothing else to do.

    >>> import torch
    >>> with oom_guard([torch.ones(4, 2), torch.ones(2, 2)]) as guard:
    ...     sizes = [len(batch) for batch in guard]
    >>> sizes, guard.stats.samples
    ([4, 2], 6)

    Args:
        loader: the batches.
    """

    def __init__(self, loader: Iterable[T]) -> None:
        self._loader = loader
        self._token: contextvars.Token[oom_guard[Any] | None] | None = None
        self._current: object = None
        self._engine: _Engine | None = None
        self._reporter: _Engine | None = None
        self._index = 0
        self._piece: int | None = None  # the largest piece of the latest batch, when re-chunked
        self._tally = _Tally()

    def __enter__(self) -> oom_guard[T]:
        if self._token is not None:
            raise RuntimeError("this oom_guard is already active; create a new one")
        self._token = _ACTIVE_GUARD.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._token is not None:
            _ACTIVE_GUARD.reset(self._token)
            self._token = None
        self._current = None
        if isinstance(exc, Exception) and not isinstance(exc, AutobatchError) and is_oom_error(exc):
            raise AutobatchError(
                f"out of memory ({oom_kind(exc)}) in the body of `with oom_guard(...)` at batch "
                f"{self._index}, outside a step decorated with @retry_on_oom. The guard cannot "
                "replay a loop body: put the step in a function and decorate it, e.g. "
                "@retry_on_oom(optimizer=opt) def train_step(batch): ..., then call "
                "train_step(batch) in the loop"
            ) from exc

    def __iter__(self) -> Iterator[T]:
        if self._token is None:
            raise RuntimeError(
                "iterate an oom_guard inside its with block: "
                "`with oom_guard(loader) as guard: for batch in guard: ...`"
            )
        tally = self._tally
        for batch in self._loader:
            engine = self._engine
            self._piece = None
            if engine is None or not engine.sizes.states or engine.policy != "shrink":
                self._current = batch  # whole batches: the fast path
                yield batch
                self._index += 1
                tally.batches += 1
                tally.samples += _rows(batch)
                continue
            try:
                total = batch_size(batch)
            except (TypeError, ValueError):
                self._current = batch
                yield batch  # the step reports why it cannot split, if it has to
                self._batch_done(0)
                continue
            done = 0
            while done < total:
                n = engine.guard_piece(batch, done, total)
                piece = batch if n == total else slice_batch(batch, done, done + n)
                if n < total:
                    self._piece = max(n, self._piece or 0)
                self._current = piece
                yield piece
                done += n
            self._batch_done(total)

    def _batch_done(self, samples: int) -> None:
        self._index += 1
        self._tally.batches += 1
        self._tally.samples += samples

    # Called by engines ------------------------------------------------------------------------

    def _notice(self, engine: _Engine, batch: object) -> None:
        if self._engine is None and batch is self._current:
            self._engine = engine

    def _oom(self, lost: int) -> None:
        self._tally.ooms += 1
        self._tally.samples_recomputed += lost

    def _size_changed(self, engine: _Engine, old: int | None, new: int, reason: str) -> None:
        self._reporter = engine
        self._tally.change(SizeChange(self._index, engine.name, old, new, reason))

    @property
    def stats(self) -> RecoveryStats:
        """OOMs and size changes of the decorated steps run in this guard, batches and samples
        handed out, and the current micro-batch size of the step that takes the guard's batches."""
        engine = self._engine or self._reporter
        micro = None if engine is None else engine.tally.micro_batch_size
        return self._tally.snapshot(micro_batch_size=self._piece or micro)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"<oom_guard batches={s.batches} samples={s.samples} ooms={s.ooms} "
            f"micro_batch_size={s.micro_batch_size}>"
        )
