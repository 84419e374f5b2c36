"""Recover from out-of-memory errors during training: one engine, two ways in.

:func:`retry_on_oom` decorates a step function; :class:`oom_guard` wraps the loop's iterable. Both
are thin front-ends over :class:`_Engine`, which runs a step on pieces of its batch:

1. A step runs unchanged and unmeasured until its first out-of-memory error. The fast path
   (:class:`_Attempt`) costs a ``try``, the parameters' version counters, one fused copy of the
   module buffers known to change (BatchNorm statistics), and a context variable that the
   process-wide optimizer pre-step hook reads; the first call also watches which modules run.
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

* ``"accumulate"`` (default with ``optimizer=``): the pieces of one batch make exactly one step
  of each optimizer given (:class:`_Accumulation`). Each piece's gradients are weighted by its
  share of the batch (of its rows, of its items with ``items=``; ``reduction="sum"`` adds them),
  in place, and moved into private buffers at the end of each backward; at the end of the last
  piece's backward the buffers are added into ``.grad``. Code between ``backward()`` and
  ``optimizer.step()`` (clipping, logging) therefore sees no gradient in early pieces and the
  whole batch's gradient in the last one, for every parameter. ``optimizer.step()`` and the
  ``scaler=``'s ``unscale_``/``step``/``update`` do nothing in early pieces and run once in the
  last one, so GradScaler's inf check covers the whole batch once. The LR scheduler is not
  touched: call ``scheduler.step()`` outside the decorated step. Step functions must take one
  step per call and zero the gradients themselves; once memory has run short, autobatch sets the
  optimizers' gradients to ``None`` before each batch (and before it re-runs one), so that every
  piece is measured alike. Refused, with an :class:`~autobatch.AutobatchError`: closure-taking
  optimizers (LBFGS), an optimizer not given that steps in a piece, optimizers that interleave
  (a parameter gets a gradient after its optimizer stepped in the same piece), a parameter
  changed in place in an early piece (an EMA update), and steps that accumulate across calls.
* ``"shrink"`` (default without an optimizer, e.g. eval steps): each piece is its own call of the
  step, so a training step takes more, smaller optimizer steps: the effective batch size shrinks.

Returned values: when the batch ran whole, the step's own value. When it was split, pieces are
joined: ``None`` stays ``None``; floating scalars (0-d tensors, floats) are weighted by their share
of the batch (``"mean"``) or added (``"sum"``), integers are added, and 0-d tensors come back
detached; tensors whose dim 0 is the piece size are concatenated, lists as long as their piece are
joined; dicts, tuples and named tuples are joined item by item; equal values pass through. If the
pieces' results cannot be joined, the list of them is returned.

A failed attempt is undone where it can be and refused where it cannot (:meth:`_Engine.
_check_attempt`): module buffers are put back as they were (:meth:`_Attempt.rollback`); an OOM
before any optimizer step began and before any parameter changed is retried; one inside an
optimizer's first step, while it creates its state and before any parameter changed (Adam's
``exp_avg``, ``exp_avg_sq``), is retried after the half-made state is dropped. Any other failure
after a step began (seen by the step hook, since fused optimizers leave the version counters
alone) or after a parameter changed in place raises :class:`~autobatch.AutobatchError`: the
update may be partly applied, and autobatch neither retries it twice nor restores it (a copy of
every parameter and state per step would cost too much).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import operator
import sys
import types
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, cast, overload

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from autobatch import _distributed
from autobatch._backends import DeviceLike, DeviceMemory, free_memory, memory_for
from autobatch._batch import (
    Batch,
    ambiguous_paths,
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
from autobatch._trial import _PhasePeaks
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
#: How many batch shapes keep their own piece size (the least recently used is forgotten).
MAX_SHAPES = 256

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


#: How many of the latest size changes the statistics keep (the counters count all of them).
HISTORY = 64


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
        changes: size changes of every reason, all of them counted.
        history: the latest size changes (at most :data:`HISTORY`), oldest first.
    """

    ooms: int = 0
    shrinks: int = 0
    grows: int = 0
    failed_grows: int = 0
    batches: int = 0
    samples: int = 0
    samples_recomputed: int = 0
    micro_batch_size: int | None = None
    changes: int = 0
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
    changes: int = 0
    history: collections.deque[SizeChange] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=HISTORY)
    )

    def change(self, change: SizeChange) -> None:
        self.history.append(change)
        self.changes += 1
        self.shrinks += change.reason in ("oom", "grow failed")
        self.grows += change.reason == "grow"
        self.failed_grows += change.reason == "grow failed"

    def snapshot(self, **override: Any) -> RecoveryStats:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["history"] = tuple(self.history)
        return RecoveryStats(**{**fields, **override})


OptimizerOption = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
ItemsFn = Callable[[Any], Any]


@dataclass(frozen=True)
class RecoveryOptions:
    """Every option of :func:`retry_on_oom`, validated; see there for their meaning.

    >>> RecoveryOptions(min_batch=4).policy
    'shrink'
    """

    optimizer: OptimizerOption = None
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
    items: ItemsFn | None = None

    def __post_init__(self) -> None:
        optimizers = self.optimizers
        if self.policy is None:
            object.__setattr__(self, "policy", "accumulate" if optimizers else "shrink")
        if self.policy not in ("accumulate", "shrink"):
            raise ValueError(f"policy must be 'accumulate' or 'shrink', got {self.policy!r}")
        if self.policy == "accumulate" and not optimizers:
            raise ValueError(
                "policy='accumulate' needs the optimizer, so that the pieces of a batch make one "
                "step: pass retry_on_oom(optimizer=opt), or use policy='shrink'"
            )
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if self.items is not None and not callable(self.items):
            raise TypeError(
                f"items must be a function of a batch returning how many items its loss averages "
                f"over, e.g. items=lambda b: (b['labels'] != -100).sum(); got {self.items!r}"
            )
        if self.items is not None and self.reduction == "sum":
            raise ValueError(
                "items= weights pieces of a loss averaged over items; with reduction='sum' the "
                "pieces are added as they are: pass one of the two"
            )
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

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers the step calls, in the order given (empty without one)."""
        given = self.optimizer
        if given is None:
            return ()
        if isinstance(given, torch.optim.Optimizer):
            return (given,)
        if isinstance(given, (list, tuple)) and given:
            found = tuple(given)
            bad = [o for o in found if not isinstance(o, torch.optim.Optimizer)]
            if not bad and len({id(o) for o in found}) == len(found):
                return found
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or a non-empty list of distinct ones "
            f"(every optimizer the step calls), got {given!r}"
        )


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
    """The smallest allowed size failed, or no piece of at least ``min_batch`` rows can fit."""


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
            self.states[key] = self.states.pop(key)  # the most recently used shape goes last
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
        """The next piece of ``remaining`` rows: balanced pieces of at most the limit, none
        below ``min_batch``.

        Where the limit leaves no way to cut ``remaining`` rows into pieces of at least
        ``min_batch`` (5 rows, a limit of 2, ``min_batch=2``), the pieces are the fewest of at
        least ``min_batch`` rows (3 and 2), tried even though they pass the limit; raises
        :class:`_TooSmall` when a piece that large already ran out of memory.
        """
        limit = self.limit_for(key, eps, room)
        if limit is None or limit >= remaining:
            return remaining
        count = -(-remaining // limit)
        if remaining // count < self.min_batch:
            count = max(remaining // self.min_batch, 1)
            n = -(-remaining // count)
            state = self.states.get(key)
            ceiling = None if state is None else state.ceiling
            if ceiling is not None and n >= ceiling:
                raise _TooSmall(n)
            return n
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
            while len(self.states) > MAX_SHAPES:  # variable shapes: forget the least recent
                del self.states[next(iter(self.states))]
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
    inside: torch.optim.Optimizer | None  # the optimizer whose step() was running, if any


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
# One attempt of a step: what it changed, and undoing what can be undone.

_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "autobatch_attempt", default=None
)
_step_hook: RemovableHandle | None = None


def _see_optimizer_steps() -> None:
    """Install, once per process, the hook through which attempts see every optimizer step (a
    context-variable read per ``optimizer.step()`` when no attempt runs)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_optimizer_stepping)


def _optimizer_stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    attempt = _ATTEMPT.get()
    while attempt is not None:
        attempt.optimizer_stepping(optimizer)
        attempt = attempt.outer


class _Attempt:
    """One run of a step function (a whole batch or one piece), watched for what it changes.

    It records every ``optimizer.step()`` that begins (a global pre-hook), the version counters
    (in-place modification counts) of the parameters the step may touch, and the module buffers
    as they were: those known to change (BatchNorm statistics) are copied before it starts, and,
    while ``learn`` is on, those of every module the first time it runs (a global forward
    pre-hook, which also makes the modules known). :meth:`rollback` puts the buffers back after
    a failure. With ``split`` (a piece of a batch under ``"accumulate"``) an optimizer the
    engine was not given is refused before it steps.
    """

    __slots__ = (
        "_hook", "_param_ids", "_saved_owners", "_seen_ids", "_token", "engine", "fresh",
        "learn", "ours_stepped", "outer", "params", "saved", "seen", "session", "shadows",
        "split", "stepped", "versions",
    )

    def __init__(
        self,
        engine: _Engine,
        *,
        split: bool = False,
        learn: bool = False,
        session: _Accumulation | None = None,
    ) -> None:
        known = engine.known
        self.engine = engine
        self.split = split
        self.learn = learn
        self.session = session
        self.stepped: list[torch.optim.Optimizer] = []
        self.ours_stepped = False
        self.params = known.params
        self.versions = list(map(_VERSION, known.params))
        self.fresh = [not o.state for o in engine.optimizers]
        self.shadows = known.save_buffers() if known.mutable else None
        self.saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = []
        self.seen: list[nn.Module] = []
        self.outer: _Attempt | None = None
        self._token: contextvars.Token[_Attempt | None] | None = None
        self._hook: RemovableHandle | None = None

    def __enter__(self) -> _Attempt:
        self.outer = _ATTEMPT.get()
        self._token = _ATTEMPT.set(self)
        if self.learn:
            known = self.engine.known
            self._seen_ids: set[int] = set()
            self._saved_owners: set[int] = set()
            self._param_ids = set(known.param_ids)
            self.params = list(self.params)
            for module in known.modules:
                self._module_runs(module, ())
            if not known.compiled:  # a global hook would make dynamo compile once more
                self._hook = register_module_forward_pre_hook(self._module_runs)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ATTEMPT.reset(self._token)
            self._token = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> None:
        ours = any(optimizer is o for o in self.engine.optimizers)
        if not ours and self.split:
            raise AutobatchError(
                f"{self.engine.name} calls {type(optimizer).__name__}.step(), an optimizer "
                "autobatch was not given, while its batch runs in micro-batches: that optimizer "
                "would step once per micro-batch instead of once per batch. Pass every optimizer "
                "the step calls, retry_on_oom(optimizer=[opt_a, opt_b]); where one optimizer's "
                "step feeds the next part of the step (a GAN's discriminator, then its "
                "generator), decorate each part as its own function; or use policy='shrink'"
            )
        self.stepped.append(optimizer)
        self.ours_stepped = self.ours_stepped or ours

    def _module_runs(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or id(module) in self._seen_ids:
            return  # (inside a compiled module the hook is traced away: its caller was seen)
        self._seen_ids.add(id(module))
        self.seen.append(module)
        known = self.engine.known
        for owner in module.modules():  # the whole subtree: compiled code runs no hook inside
            if id(owner) in self._saved_owners:
                continue
            self._saved_owners.add(id(owner))
            for name, buffer in owner._buffers.items():
                if (
                    buffer is None
                    or id(buffer) in known.saved_ids
                    or name in owner._non_persistent_buffers_set  # masks, caches: not state
                ):
                    continue
                with torch.no_grad():
                    copy = buffer.detach().clone()
                self.saved.append((owner, name, buffer, copy, buffer._version))
        for p in module.parameters():
            if id(p) not in self._param_ids:  # watched from now on, like the known ones
                self._param_ids.add(id(p))
                self.params.append(p)
                self.versions.append(p._version)
        if self.session is not None:
            self.session.track(module.parameters())

    def changed(self) -> list[torch.Tensor]:
        """The parameters changed in place since the attempt began."""
        return [
            p for p, version in zip(self.params, self.versions, strict=True)
            if p._version != version
        ]

    def stepped_other(self) -> torch.optim.Optimizer | None:
        """An optimizer the engine was not given that began a step in this attempt."""
        for optimizer in self.stepped:
            if all(optimizer is not o for o in self.engine.optimizers):
                return optimizer
        return None

    def rollback(self) -> None:
        """Put every saved buffer back as it was when the attempt began (after a failure)."""
        with torch.no_grad():
            _Known.restore_buffers(self.shadows)
            for module, name, original, copy, _ in reversed(self.saved):
                if module._buffers.get(name) is not original:
                    module._buffers[name] = original
                original.copy_(copy)  # (kernels such as batch_norm's update without a version bump)

    def learned(self) -> None:
        """Tell the engine which modules ran and which of their buffers changed."""
        if not self.learn:
            return
        with torch.no_grad():
            mutable = [
                (module, name) for module, name, original, copy, version in self.saved
                if module._buffers.get(name) is not original or original._version != version
                or not torch.equal(original, copy)
            ]
        self.engine.known.learn(self.seen, mutable)


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is ``torch.compile``d."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


_Shadows = tuple[list[tuple[nn.Module, str]], list[torch.Tensor], list[torch.Tensor]]


class _Known:
    """What a step is known to touch: the optimizers' parameters, the modules it runs
    (``model=``, modules its code names, modules seen running) with their parameters, and the
    buffers that change when they run, copied before every attempt (one fused copy) so that a
    failed attempt can be undone."""

    def __init__(
        self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        self.modules: list[nn.Module] = []
        self.module_ids: set[int] = set()
        self.params: list[torch.Tensor] = []
        self.param_ids: set[int] = set()
        self.mutable: list[tuple[nn.Module, str]] = []
        self.buffers: list[torch.Tensor] = []
        self.shadows: list[torch.Tensor] = []
        self.saved_ids: set[int] = set()
        self.compiled = False
        for optimizer in optimizers:
            self._add_params(p for g in optimizer.param_groups for p in g["params"])
        self.learn(modules, [])

    def _add_params(self, params: Iterable[torch.Tensor]) -> None:
        added = [p for p in params if id(p) not in self.param_ids]
        if added:
            self.params = self.params + added  # a new list: attempts keep the one they began with
            self.param_ids.update(id(p) for p in added)

    def learn(self, modules: Iterable[nn.Module], mutable: list[tuple[nn.Module, str]]) -> None:
        for module in modules:
            if id(module) not in self.module_ids:
                self.module_ids.add(id(module))
                self.modules.append(module)
                self._add_params(module.parameters())
                self.compiled = self.compiled or _is_compiled(module)
        fresh = [entry for entry in mutable if all(
            entry[0] is not m or entry[1] != n for m, n in self.mutable)]
        if fresh:
            self.mutable = self.mutable + fresh
            self._rebuild()

    def _rebuild(self) -> None:
        self.mutable = [(m, n) for m, n in self.mutable if m._buffers.get(n) is not None]
        self.buffers = [cast(torch.Tensor, m._buffers[n]) for m, n in self.mutable]
        with torch.no_grad():
            self.shadows = [torch.empty_like(b) for b in self.buffers]
        self.saved_ids = {id(b) for b in self.buffers}

    def save_buffers(self) -> _Shadows | None:
        """Copy the buffers known to change into their shadows; ``None`` when there are none."""
        if not self.mutable:
            return None
        if any(m._buffers.get(n) is not b
               for (m, n), b in zip(self.mutable, self.buffers, strict=True)):
            self._rebuild()  # a module replaced a buffer: copy what it holds now
        with torch.no_grad():
            torch._foreach_copy_(self.shadows, self.buffers)
        return self.mutable, self.buffers, self.shadows

    @staticmethod
    def restore_buffers(saved: _Shadows | None) -> None:
        if saved is None:
            return
        mutable, buffers, shadows = saved
        for (module, name), original in zip(mutable, buffers, strict=True):
            if module._buffers.get(name) is not original:
                module._buffers[name] = original
        torch._foreach_copy_(buffers, shadows)


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


def _add(total: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
    """``total + more``, in place where both are dense."""
    if total.layout == torch.strided and more.layout == torch.strided:
        return total.add_(more)
    return total + more


class _Accumulation:
    """One optimizer step (per optimizer given) from the pieces of a batch.

    Every gradient that flows into a tracked parameter is weighted by the piece's share of the
    batch (in place once it reaches an empty ``.grad``; on its way in where ``.grad`` already
    holds one), so several ``backward()`` calls in one piece are weighted alike. At the end of each backward (an autograd callback) an early
    piece's gradients move to private buffers, leaving ``.grad`` empty (code between
    ``backward()`` and ``optimizer.step()`` then finds nothing to clip or log), and in the last
    piece the buffers are added into ``.grad``: from there on ``.grad`` holds the whole batch's
    gradient, also for parameters the last piece did not reach. The optimizers' ``step`` and
    the scaler's ``unscale_``/``step``/``update`` do nothing in early pieces and run once in the
    last. A parameter that receives a gradient after its optimizer stepped in the same piece
    means the step interleaves optimizers (a GAN): refused, since early pieces would see the
    parameters before their update.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizers: tuple[torch.optim.Optimizer, ...],
        scaler: Any,
    ) -> None:
        self.params: list[torch.Tensor] = []
        self.ids: set[int] = set()
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self.handles: list[RemovableHandle] = []
        self.weight = 1.0
        self.last = False
        self.queued = False
        self.contributed = False  # this piece's gradients reached the buffers, or .grad the sum
        self.moving = False
        self.stepped: set[int] = set()
        self.pending: set[int] = set()  # parameters whose fresh .grad is still to be weighted
        self.buffers: dict[int, torch.Tensor] = {}
        self.patches = [
            _Patch(o, "step", self._deferred(o.step, refuse_closure=True, marks=True))
            for o in optimizers
        ]
        if scaler is not None:
            self.patches += [
                _Patch(scaler, name, self._deferred(
                    getattr(scaler, name), refuse_closure=False, marks=name == "step"
                ))
                for name in ("unscale_", "step", "update")
            ]
        self.track(params)

    def track(self, params: Iterable[torch.Tensor]) -> None:
        """Weight and accumulate the gradients of ``params`` too (before their backward)."""
        for p in params:
            if p.requires_grad and id(p) not in self.ids:
                self.ids.add(id(p))
                self.params.append(p)
                self.handles += [
                    p.register_hook(functools.partial(self._incoming, p)),
                    p.register_post_accumulate_grad_hook(self._accumulated),
                ]

    def begin_piece(self, weight: float, last: bool) -> None:
        self.weight, self.last = weight, last
        self.queued = self.contributed = self.moving = False
        self.stepped.clear()
        self.pending.clear()

    @property
    def dirty(self) -> bool:
        """Whether the current piece changed the sum (then the batch must start over)."""
        return self.contributed or self.moving

    def _incoming(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Before a gradient reaches ``p.grad``. Where ``p.grad`` is empty the gradient is
        weighted in place once it is there (no copy); else (a second backward into the same
        ``.grad``) the incoming gradient is weighted on its way in."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        owner = self.owner.get(id(p))
        if owner is not None and id(owner) in self.stepped:
            raise AutobatchError(
                f"a parameter of {type(owner).__name__} received a gradient after "
                f"{type(owner).__name__}.step() in the same step: the step interleaves "
                "optimizers (as a GAN's discriminator, then generator, does). In micro-batches "
                "the early pieces would run before that update, so the batch cannot be split "
                "exactly: decorate each optimizer's part as its own function, or use "
                "policy='shrink'"
            )
        if self.weight == 1.0:
            return None
        if p.grad is None:
            self.pending.add(id(p))
            return None
        if self.weight == 0.0:  # a piece without items: its loss (0/0) adds nothing
            return torch.zeros_like(grad)
        return grad * self.weight

    def _accumulated(self, p: torch.Tensor) -> None:
        if id(p) in self.pending and p.grad is not None:
            self.pending.discard(id(p))
            if self.weight == 0.0:
                p.grad.zero_()
            else:
                p.grad.mul_(self.weight)

    def _backward_done(self) -> None:
        self.queued = False
        if self.last:
            self.merge()
        else:
            self.stash()

    def stash(self) -> None:
        """Move the piece's gradients into the buffers (early pieces)."""
        self.moving = True
        for p in self.params:
            grad = p.grad
            if grad is None:
                continue
            self.contributed = True
            buffer = self.buffers.get(id(p))
            self.buffers[id(p)] = grad if buffer is None else _add(buffer, grad)
            p.grad = None
        self.moving = False

    def merge(self) -> None:
        """Add the earlier pieces' sums into ``.grad`` (the last piece)."""
        if not self.buffers:
            return
        self.moving = True
        for p in self.params:
            buffer = self.buffers.pop(id(p), None)
            if buffer is not None:
                self.contributed = True
                p.grad = buffer if p.grad is None else _add(p.grad, buffer)
        self.moving = False

    def _deferred(
        self, real: Callable[..., Any], *, refuse_closure: bool, marks: bool
    ) -> Callable[..., Any]:
        def only_in_last_piece(*args: Any, **kwargs: Any) -> Any:
            if refuse_closure and (args or kwargs.get("closure") is not None):
                raise AutobatchError(
                    "optimizer.step(closure) re-evaluates the loss, which cannot be split into "
                    "micro-batches; use policy='shrink' for closure-based optimizers such as LBFGS"
                )
            if marks:
                owner = getattr(real, "__self__", None)
                if not isinstance(owner, torch.optim.Optimizer):
                    owner = args[0] if args else kwargs.get("optimizer")
                self.stepped.add(id(owner))
            if not self.last:
                return None
            self.merge()
            return real(*args, **kwargs)

        return only_in_last_piece

    def discard(self) -> None:
        """Forget the failed piece's gradients; the earlier pieces' sums stay."""
        for p in self.params:
            p.grad = None

    def restart(self) -> None:
        """Forget every piece: gradients to ``None``."""
        self.buffers.clear()
        self.discard()

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
            terms = [v.detach() * w for v, w in zip(values, weights, strict=True) if w]
            if not terms:  # every piece weighs nothing (a batch without items): its mean
                terms = [v.detach() / len(values) for v in values]
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            return total
        if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes, strict=True)):
            return torch.cat(values)
        raise _CannotJoin
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if all(isinstance(v, int) for v in values):
            return sum(values)
        return sum(w * v for v, w in zip(values, weights, strict=True) if w)
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


def _combine(pieces: list[tuple[int, Any, float]]) -> Any:
    """The pieces' results ``(rows, value, weight)`` joined into the batch's result."""
    if len(pieces) == 1:
        return pieces[0][1]
    sizes = [n for n, _, _ in pieces]
    values = [v for _, v, _ in pieces]
    weights = [w for _, _, w in pieces]
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
        self.patched: list[_Patch] | None = None
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
        if self.patched is None:
            self.patched = [
                _Patch(o, "step", functools.partial(self._step, o, o.step))
                for o in self.engine.optimizers
            ]
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

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        real: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """An optimizer's step during attempts: a first step that ran out of memory is tried
        again on this rank (the gradients, averaged already, are the same on every rank)."""
        if not self.active:
            return real(*args, **kwargs)
        error: BaseException | None = None
        for _ in range(STEP_TRIES):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            versions = list(map(_VERSION, params))
            first = not optimizer.state
            try:
                return real(*args, **kwargs)
            except BaseException as exc:
                _strip_tracebacks(exc)
                unchanged = versions == list(map(_VERSION, params))
                error = exc
                retry = is_oom_error(exc) and not isinstance(exc, AutobatchError)
                if not (retry and first and unchanged):
                    break
            # Out of the except block: the failed first step is gone. The other ranks learn
            # nothing of this retry: the averaged gradients are the same, so is the update.
            self.engine.tally.ooms += 1
            optimizer.state.clear()  # every entry was made by the failed first step
            error = None
            free_memory(params[0].device if params else None)
        raise AutobatchError(
            f"{self.engine.name}: {type(optimizer).__name__}.step() failed on this rank"
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


def _modules_of(fn: Callable[..., Any]) -> dict[str, nn.Module]:
    """Modules the step function refers to by name (globals and closure), by that name."""
    try:
        names = inspect.getclosurevars(inspect.unwrap(fn))
    except (TypeError, ValueError):
        return {}
    values = {**names.globals, **names.nonlocals}
    return {name: v for name, v in values.items() if isinstance(v, nn.Module)}


def _count_items(value: object, name: str) -> float:
    """The number ``items=`` returned for a batch, checked."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name}: items= must return a number of items (an int, a float or a one-element "
            f"tensor), got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: items= returned {value!r}; a count must be finite and >= 0")
    return float(value)


def _uses_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer runs its multi-tensor (foreach) kernels, which need temporaries."""
    for group in optimizer.param_groups:
        foreach = group.get("foreach")
        if foreach or (foreach is None and not group.get("fused") and any(
            cast(torch.Tensor, p).device.type != "cpu" for p in group["params"]
        )):
            return True
    return False


#: Split batches during which the engine watches which modules run (a global forward hook).
LEARN_SPLITS = 2


class _Engine:
    """Runs one decorated step function; holds its learned sizes and statistics."""

    def __init__(self, fn: Callable[..., Any], options: RecoveryOptions) -> None:
        self.fn = fn
        self.options = options
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.policy: Policy = cast(Policy, options.policy)
        self.optimizers = options.optimizers
        self.index, self.keyword = _batch_parameter(fn, options.batch_arg)
        self.sizes = _Sizes(
            min_batch=options.min_batch, grow_after=options.grow_after, headroom=options.headroom
        )
        self.tally = _Tally()
        self.calls = 0
        self.warned: set[str] = set()
        self.coordination: _Coordination | None = None
        self.named = _modules_of(fn)
        if options.model is not None:
            self.named = {"model": options.model, **self.named}
        self.known = _Known(self.named.values(), self.optimizers)
        self.optimized_ids = {  # the parameters the step's own optimizers update
            id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]
        }
        self.own_ids = self.optimized_ids | {  # and model='s: zeroed before a split batch
            id(p) for p in (options.model.parameters() if options.model is not None else ())
        }
        self.learn_splits = LEARN_SPLITS
        self.skips_steps = False  # a whole call ended without an optimizer step
        _see_optimizer_steps()

    def coordinated(self) -> _Coordination | None:
        """The agreement with the other ranks, under a process group (unless ``sync_ranks=False``)."""
        if not (self.options.sync_ranks and _distributed.active()):
            return None
        if self.coordination is None:
            self.coordination = _Coordination(self)
        return self.coordination

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
        for p in self.known.params:
            return p.device
        return None

    def _names(self) -> dict[int, str]:
        """Readable names of the parameters the step is known to touch, for messages."""
        names: dict[int, str] = {}
        for prefix, module in self.named.items():
            for name, p in module.named_parameters():
                names.setdefault(id(p), f"{prefix}.{name}")
        for module in self.known.modules:
            for name, p in module.named_parameters(recurse=False):
                names.setdefault(id(p), f"{type(module).__name__}.{name}")
        return names

    def _describe(self, params: list[torch.Tensor]) -> str:
        names = self._names()
        shown = [names.get(id(p), f"a {tuple(p.shape)} parameter") for p in params[:4]]
        more = "" if len(params) <= 4 else f" and {len(params) - 4} more"
        return ", ".join(shown) + more

    # Was anything applied that a retry would apply again? -------------------------------------

    def succeeded(self, attempt: _Attempt) -> None:
        """A whole call ran on the fast path: count it, learn from it."""
        self.calls += 1
        if attempt.learn:
            attempt.learned()
        if not attempt.ours_stepped:
            self._note_steps(attempt)

    def _note_steps(self, attempt: _Attempt) -> None:
        """Note a whole call that took no optimizer step (it accumulates across calls)."""
        if (
            not attempt.ours_stepped
            and self.policy == "accumulate"
            and self.options.scaler is None  # a scaler skips steps on overflow
        ):
            self.skips_steps = True

    def _check_attempt(self, failure: _Failure, attempt: _Attempt) -> None:
        """Raise unless retrying is safe; after a failed first step, drop the state it made.

        Safe: nothing was changed in place that autobatch cannot put back (no optimizer
        stepped, no parameter changed), or the OOM came inside an optimizer's first step while
        it created its state and before any parameter changed.
        """
        kind = failure.kind
        inside = failure.inside
        if inside is not None and all(inside is not o for o in self.optimizers):
            raise AutobatchError(
                f"{self.name} ran out of memory ({kind}) inside {type(inside).__name__}.step(), "
                "an optimizer autobatch was not given, so it cannot tell whether the update was "
                "partly applied; pass every optimizer the step calls: "
                "retry_on_oom(optimizer=...)"
            ) from failure.exc
        other = attempt.stepped_other()
        if other is not None:
            raise AutobatchError(
                f"{self.name} ran out of memory ({kind}) after {type(other).__name__}.step(), an "
                "optimizer autobatch was not given, had run in this step: retrying would step "
                "it twice. Pass every optimizer the step calls, "
                "retry_on_oom(optimizer=[opt_a, opt_b]); where one optimizer's step feeds the "
                "next part of the step (a GAN), decorate each part as its own function"
            ) from failure.exc
        changed = attempt.changed()
        foreign = [p for p in changed if id(p) not in self.optimized_ids]
        if foreign:
            raise AutobatchError(
                f"{self.name} ran out of memory ({kind}) after it had changed "
                f"{self._describe(foreign)} in place, outside the optimizer autobatch was given "
                "(an EMA update, say): retrying would change it again. Move that update out of "
                "the decorated step (after it returns), or pass that parameter's optimizer too"
            ) from failure.exc
        # Fused optimizers update without counting a modification: which steps began is known
        # from the step hook, not from the version counters alone.
        stepped = [o for o in attempt.stepped if any(o is mine for mine in self.optimizers)]
        finished = [o for o in stepped if o is not inside]
        if inside is None or finished:
            if changed or finished:
                raise AutobatchError(
                    f"{self.name} ran out of memory ({kind}) after "
                    + (f"{type(finished[0]).__name__}.step()" if finished else "optimizer.step()")
                    + " had updated the parameters; retrying would apply the update twice, so "
                    "it is not retried. Restore from a checkpoint, and leave more memory free "
                    "after the step, or move that work out of the step"
                ) from failure.exc
            return
        index = next(i for i, o in enumerate(self.optimizers) if o is inside)
        name = type(inside).__name__
        fused = any(g.get("fused") for g in inside.param_groups)
        unknown = fused and len(inside.param_groups) > 1  # an earlier group may be updated
        if attempt.fresh[index] and not changed and not unknown:
            inside.state.clear()  # every entry was made by the failed first step, some half-made
            return
        hint = "; foreach=False needs fewer temporaries" if _uses_foreach(inside) else ""
        if attempt.fresh[index]:
            what = (
                f"which had already changed {len(changed)} of its parameters in place "
                f"({self._describe(changed)}; weight decay is applied before the moments, say)"
                if changed else "whose fused kernels may already have updated an earlier "
                "parameter group (fused kernels leave no trace in the version counters)"
            )
            raise AutobatchError(
                f"{self.name} ran out of memory ({kind}) inside the first step of {name} (while "
                f"it created its state), {what}: the update is partly applied and cannot be "
                "undone, so it is not retried. Restore from a checkpoint. To avoid it, leave "
                "memory for the optimizer's state, which its first step creates: a smaller first "
                "batch, or autobatch.find_max_batch with this optimizer, which counts that "
                "state" + hint
            ) from failure.exc
        raise AutobatchError(
            f"{self.name} ran out of memory ({kind}) inside {name}.step(), which updates its "
            "state and the parameters in place: the update may be partly applied, so it is "
            "not retried (autobatch retries an OOM inside a step only on the first step, while "
            "the state is being created and before any parameter changed). Restore from a "
            "checkpoint, and leave more memory free for the optimizer's step" + hint
        ) from failure.exc

    # Running ----------------------------------------------------------------------------------

    def _capture(self, exc: BaseException) -> _Failure | None:
        """Called inside ``except``: the failure to recover from, or ``None`` to re-raise."""
        if isinstance(exc, _PeerFailed):
            return _Failure(exc=exc, kind=str(exc), inside=None)
        if isinstance(exc, AutobatchError) or not is_oom_error(exc):
            return None
        failure = _Failure(
            exc=exc, kind=oom_kind(exc) or "oom", inside=_optimizer_in_traceback(exc)
        )
        _strip_tracebacks(exc)
        return failure

    def call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        failure: _Failure | None = None,
        attempt: _Attempt | None = None,
    ) -> Any:
        """Run a call on the slow path (``failure``: the whole batch already ran out of memory,
        in ``attempt``)."""
        batch = self._locate(args, kwargs)
        guard = _ACTIVE_GUARD.get()
        if guard is not None:
            guard._notice(self, batch)
        return self._run(args, kwargs, batch, failure, attempt, guard)

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

    def _whole(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch, reason: str,
        failure: _Failure | None,
    ) -> Any:
        """A batch that cannot be split (nothing to split by, or no rows): run it whole, once."""
        if failure is None:
            attempt = _Attempt(self)
            try:
                with attempt:
                    result = self.fn(*args, **kwargs)
            except BaseException as exc:
                failure = self._capture(exc)
                if failure is None:
                    raise
            else:
                self._finished(0)
                attempt.learned()
                return result
        self.tally.ooms += 1
        raise self._unsplittable(batch, failure, reason) from failure.exc

    def _piece(
        self, key: Hashable, eps: int, remaining: int, memory: DeviceMemory,
        coord: _Coordination | None,
    ) -> int:
        """The size of the next piece, agreed with the other ranks."""
        try:
            n = self.sizes.piece(key, eps, remaining, _room(memory))
        except _TooSmall as small:
            raise BatchSizeError(
                f"{self.name}: {remaining} rows cannot be cut into micro-batches of at least "
                f"min_batch={self.options.min_batch} rows that fit on {memory.name} (a piece of "
                f"{small.args[0]} rows ran out of memory already); lower min_batch, or give "
                "batches whose size is a multiple of a size that fits",
                batch_size=int(small.args[0]),
                capacity_bytes=memory.capacity_bytes(),
            ) from None
        if coord is not None and self.sizes.pressure:
            n = coord.piece(n, remaining)
        return n

    def _weight(self, batch: Batch, piece: Batch, n: int, total: int, items: float | None) -> float:
        """A piece's share of the batch's loss: of its rows, or of its items (``items=``)."""
        if self.options.reduction == "sum":
            return 1.0
        if items is not None and items > 0:
            assert self.options.items is not None
            return _count_items(self.options.items(piece), self.name) / items
        return n / total

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: Batch,
        failure: _Failure | None,
        attempt: _Attempt | None,
        guard: oom_guard[Any] | None,
    ) -> Any:
        """Run ``batch`` in pieces, recovering from OOM; ``failure`` is a first whole-batch OOM."""
        try:
            total = batch_size(batch)
        except (TypeError, ValueError) as error:
            return self._whole(args, kwargs, batch, str(error), failure)
        if total == 0:
            return self._whole(args, kwargs, batch, "it has no rows", failure)
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = memory_for(self._device(batch))
        statistics = memory.has_statistics
        coord = self.coordinated()
        pieces: list[tuple[int, Any, float]] = []
        done = 0
        clean = True
        split = False
        items: float | None = None
        session: _Accumulation | None = None
        try:
            if failure is not None:  # the whole batch failed on the fast path
                assert attempt is not None
                clean = False
                session = self._recover(
                    failure, attempt, key, eps, total, total, memory, session, guard
                )
            else:
                if self.policy == "accumulate":
                    # The step zeroes them first thing; doing it here keeps the pieces' measured
                    # costs alike (none of them frees the last step's gradients).
                    for p in self.known.params:
                        if id(p) in self.own_ids:
                            p.grad = None
                grown = self.sizes.maybe_grow(key, eps, total, _room(memory))
                if grown is not None:
                    self._size_changed(*grown, "grow", guard)
            while done < total:
                n = self._piece(key, eps, total - done, memory, coord)
                if n < total and not split:
                    split = True
                    self._warn_tuples(batch)
                    if self.options.items is not None and self.options.reduction == "mean":
                        items = _count_items(self.options.items(batch), self.name)
                if n < total and session is None and self.policy == "accumulate":
                    session = self._accumulation()
                last = done + n == total
                piece = batch if n == total else slice_batch(batch, done, done + n)
                weight = self._weight(batch, piece, n, total, items)
                if session is not None:
                    session.begin_piece(weight, last)
                piece_args, piece_kwargs = self._with_batch(args, kwargs, piece)
                del piece
                attempt = _Attempt(
                    self, split=session is not None,
                    learn=self.calls == 0 or (n < total and self.learn_splits > 0),
                    session=session,
                )
                phases = _PhasePeaks(memory)  # peaks outside and inside optimizer.step
                baseline = 0
                if statistics:
                    memory.reset_peak()
                    baseline = memory.allocated_bytes()
                failure = None
                try:
                    with phases, attempt, (
                        contextlib.nullcontext() if coord is None
                        else coord.attempt(last=last or self.policy == "shrink", session=session)
                    ):
                        result = self.fn(*piece_args, **piece_kwargs)
                except BaseException as exc:
                    failure = self._capture(exc)
                    if failure is None:
                        if coord is not None:
                            coord.finish(_distributed.FAILED)
                        raise
                del piece_args, piece_kwargs
                attempt.learned()
                if n < total:
                    self._warn_batchnorm(attempt)
                if coord is not None:
                    codes = coord.finish(_distributed.OK if failure is None else _distributed.OOM)
                    if max(codes) == _distributed.FAILED:
                        raise _peer_error(codes, "in this step")
                    if failure is None and max(codes) != _distributed.OK:
                        failure = self._capture(_PeerFailed(codes))
                if failure is None:
                    if session is not None and not last:
                        changed = attempt.changed()
                        if changed:
                            raise self._changed_in_piece(changed, done, n, total)
                    if statistics:  # the step's own memory does not grow with the piece
                        self.sizes.record(key, eps, n, phases.outside - baseline)
                    pieces.append((n, result, weight))
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
                    failure, attempt, key, eps, n, lost, memory, session, guard, restart=dirty
                )
        finally:
            if session is not None:
                session.close()
        if split:
            self.learn_splits = max(self.learn_splits - 1, 0)
        elif attempt is not None:
            self._note_steps(attempt)
        self.sizes.finish(key, clean)
        self._finished(total)
        self.tally.micro_batch_size = max(n for n, _, _ in pieces) if len(pieces) > 1 else None
        return _combine(pieces)

    def _changed_in_piece(
        self, changed: list[torch.Tensor], done: int, n: int, total: int
    ) -> AutobatchError:
        return AutobatchError(
            f"{self.name} changed {self._describe(changed)} in place while running rows "
            f"{done}..{done + n} of a batch of {total} in micro-batches, outside the optimizer "
            "step autobatch defers to the last micro-batch (an EMA update, a second optimizer's "
            "own method, a manual edit): it would run once per micro-batch instead of once per "
            "batch, so the batch is not split (that change has happened once). Move that update "
            "out of the decorated step (after it returns), or use policy='shrink'"
        )

    def _recover(
        self,
        failure: _Failure,
        attempt: _Attempt,
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
        """After an OOM at ``failed`` rows: check what the attempt changed, undo its buffer
        updates, clean up, free memory, and pick a smaller size. ``lost`` samples are redone;
        ``restart``: the batch starts over. Returns the accumulation to continue with. Under a
        process group every rank takes the same size."""
        self.tally.ooms += 1
        self.tally.samples_recomputed += lost
        if guard is not None:
            guard._oom(lost)
        coord = self.coordinated()
        problem: AutobatchError | None = None
        try:
            self._check_attempt(failure, attempt)
            if self.skips_steps and self.policy == "accumulate":
                raise AutobatchError(
                    f"{self.name} ran out of memory ({failure.kind}), and earlier calls returned "
                    "without an optimizer step: it accumulates gradients across calls itself, "
                    "and splitting a batch would drop what it accumulated so far. Accumulate "
                    "through autobatch instead (one optimizer step per call; it splits each "
                    "batch into micro-batches as memory needs), or use policy='shrink'"
                ) from failure.exc
        except AutobatchError as error:
            if coord is None:
                raise
            problem = error  # raised once the other ranks know
        if problem is None:
            attempt.rollback()
        if self.policy == "accumulate" and problem is None:
            if session is None:  # a whole-batch attempt: its gradients may be partly summed
                session = self._accumulation()
                session.restart()
            elif restart or session.dirty:
                session.restart()
            else:
                session.discard()
        if self.options.scaler is not None:
            for optimizer in self.optimizers:
                _reset_scaler(self.options.scaler, optimizer)
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

    def _accumulation(self) -> _Accumulation:
        return _Accumulation(self.known.params, self.optimizers, self.options.scaler)

    def _warn_batchnorm(self, attempt: _Attempt) -> None:
        if "batchnorm" in self.warned:
            return
        modules = attempt.seen if attempt.learn else self.known.modules
        norms = list({
            id(m): m for top in modules for m in top.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
        }.values())
        if norms:
            self.warned.add("batchnorm")
            warnings.warn(
                f"{self.name} is running in micro-batches, and {len(norms)} BatchNorm layer(s) "
                f"in training mode ({type(norms[0]).__name__}, ...) run in it: their statistics "
                "are computed per micro-batch, so results differ slightly from whole batches "
                "(GroupNorm or LayerNorm do not depend on the batch)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _warn_tuples(self, batch: Batch) -> None:
        if "tuples" in self.warned:
            return
        paths = ambiguous_paths(batch)
        if paths:
            self.warned.add("tuples")
            warnings.warn(
                f"{self.name} splits {', '.join(paths)} (a tuple as long as the batch) as one "
                "value per sample. If it is one value for the whole batch (an image size, say), "
                "wrap it in autobatch.per_batch(...) where the batch is made; use a list for "
                "per-sample values to silence this",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

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
        n = self._piece(key, eps, total - done, memory, self.coordinated())
        if n < total:
            self._warn_tuples(batch)
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
        # The fast path: a try, the parameters' version counters, a copy of the buffers that
        # change (if any), and the modules watched on the first call.
        attempt = _Attempt(engine, learn=engine.calls == 0)
        try:
            with attempt:
                result = engine.fn(*args, **kwargs)
        except BaseException as exc:
            failure = engine._capture(exc)
            if failure is None:
                raise
        else:
            engine.succeeded(attempt)
            return cast(R, result)
        return cast(R, engine.call(args, kwargs, failure, attempt))

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
    optimizer: OptimizerOption = None,
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
    items: ItemsFn | None = None,
) -> Callable[[Callable[P, R]], RetryingStep[P, R]]: ...


def retry_on_oom(
    fn: Callable[P, R] | None = None,
    /,
    *,
    optimizer: OptimizerOption = None,
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
    items: ItemsFn | None = None,
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
        optimizer: the optimizer the step calls, or a list of every optimizer it calls (each
            stepped once per batch under ``"accumulate"``); enables ``"accumulate"`` and the
            check that an OOM did not leave a partly applied update.
        policy: ``"accumulate"`` (one optimizer step per batch; default with an optimizer) or
            ``"shrink"`` (one step per piece; default without).
        reduction: how the step's loss reduces over samples: ``"mean"`` weights each piece by its
            share of the batch, ``"sum"`` adds pieces.
        items: for a loss averaged over something other than rows (tokens): a function of a
            batch returning how many items its loss averages over, e.g. ``lambda b:
            (b["labels"] != -100).sum()``; each piece is then weighted by its share of the
            batch's items (``"mean"`` only).
        batch_arg: the name of the argument holding the batch; default the first positional one
            (``self``/``cls`` skipped).
        min_batch: the smallest piece allowed; an OOM at it raises :class:`BatchSizeError`.
        grow_after: after this many calls without OOM, try a piece twice as large (never past the
            batch); a failed try returns to the last good size and doubles the wait.
        scaler: the ``torch.amp.GradScaler`` the step uses, so that its ``unscale_``, ``step``
            and ``update`` run once per batch under ``"accumulate"``.
        model: a module the step runs, watched from the first call on (its buffers rolled
            back after a failed attempt, its parameters' gradients weighted); modules the step
            refers to by name, and modules seen running in the first calls, are watched too.
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
        items=items,
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
