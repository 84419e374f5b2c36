"""Measuring a step's memory through the backend registry: the peak of every operator it
dispatches (and of its phases), every storage it creates and frees, and peak counters reset in a
way the user never sees. Knows nothing of sizes or searches.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autobatch._memory._accounting import LIFT_FRESH, DispatchMode, op_facts
from autobatch._memory._backends import AllocationModel, DeviceMemory
from autobatch._oom import failure_kind
from autobatch._search import Verdicts


class PeakKeeping(DeviceMemory):
    """A device's memory whose peak counter autobatch may reset, as the user never sees.

    Measuring a trial (or a micro-batch) means resetting the device's peak statistic
    (``torch.cuda.reset_peak_memory_stats``), which would wipe the peak the user logs with
    ``max_memory_allocated()``. Every reset through this wrapper first reads the peak it ends,
    and :meth:`restore_peak` puts back the peak the device really reached since the user's own
    last reset: the highest of those readings, reached again by a transient allocation of the
    difference (which the device's allocator rounds as it does any allocation) when the counter
    is lower. Not under a caching allocator: there the transient allocation would reserve a
    segment of its own, or make the allocator release its cache and retry (thrashing the very
    cache the steps run in), so the counter is left as the last measurement put it. Everything
    else is the wrapped backend's.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        super().__init__(memory.device)
        self.inner = memory
        self.has_statistics = memory.has_statistics  # type: ignore[misc]
        self.highest = memory.peak_bytes() if memory.has_statistics else 0
        # (under a caching allocator restore_peak puts nothing back: no reading to keep)
        self._keeps = memory.has_statistics and not memory.caches

    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes()

    def allocated_bytes(self) -> int:
        return self.inner.allocated_bytes()

    def peak_bytes(self) -> int:
        return self.inner.peak_bytes()

    def reset_peak(self) -> None:
        if self._keeps:
            self.highest = max(self.highest, self.inner.peak_bytes())
        self.inner.reset_peak()

    def free_bytes(self) -> int:
        return self.inner.free_bytes()

    @property
    def caches(self) -> bool:
        return self.inner.caches

    def reserved_bytes(self) -> int | None:
        return self.inner.reserved_bytes()

    def peak_reserved_bytes(self) -> int | None:
        return self.inner.peak_reserved_bytes()

    def memory_stats(self) -> dict[str, int] | None:
        return self.inner.memory_stats()

    def alloc_retries(self) -> int | None:
        return self.inner.alloc_retries()

    def allocation_model(self) -> AllocationModel | None:
        return self.inner.allocation_model()

    def uncounted_bytes(self, objects: Iterable[Any]) -> int:
        return self.inner.uncounted_bytes(objects)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    @property
    def name(self) -> str:
        return self.inner.name

    def restore_peak(self) -> None:
        """Raise the device's peak counter back to the highest peak seen (see the class)."""
        if not self.has_statistics or self.inner.caches:
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
    (forward, backward) and inside it. Only :class:`~autobatch._memory._backends.DeviceMemory` is
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
        #: The peak of the caching allocator's reserved memory over every segment (``None``:
        #: the backend has no caching allocator, or reports none).
        self.reserved: int | None = None
        self._caches = self.statistics and memory.caches

    def close_segment(self, restart: bool = True) -> None:
        """Ends the current segment: its peak becomes a part, and (``restart``) a new
        measurement starts."""
        memory = self.memory
        peak = memory.peak_bytes()
        if self._caches:
            reserved = memory.peak_reserved_bytes()
            if reserved is not None and (self.reserved is None or reserved > self.reserved):
                self.reserved = reserved
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


class _OperatorMode(DispatchMode):
    """Closes a segment of :class:`_StepPeaks` as each operator starts."""

    def __init__(self, peaks: _StepPeaks) -> None:
        super().__init__()
        self.close = peaks.close_segment
        self.storages = peaks.storages

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.close()
        out = func(*args, **kwargs)
        if self.storages is not None:
            self.storages.born(out, func, (args, kwargs))
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

    def born(self, out: Any, func: Any, inputs: Any) -> None:
        """Record the new storages among the outputs of the operator ``func`` (a view of an
        input, or of a storage made before the trial, is none). Only an operator whose schema
        lets a result alias an argument can return an input's storage (lift_fresh's input is
        itself new: ``torch.tensor(data)``): the inputs are looked at for the others only."""
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
                        fresh = func is LIFT_FRESH or op_facts(func).fresh
                        views = set() if fresh else _storage_keys(inputs)
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


#: A storage's bytes as a line in the size through two trials': ``(rise, run, bytes, size)``,
#: the bytes at ``size`` and their rise over ``run`` more rows; rounded up between them.
Line = tuple[int, int, int, int]


def _lines(
    first: tuple[int, list[tuple[int, int, int]]], second: tuple[int, list[tuple[int, int, int]]],
    *, approximate: bool = False,
) -> dict[int, Line] | None:
    """Each storage's bytes as a line in the size, ``serial -> line``, from two trials' events
    (``(size, events)``, alike but for sizes); ``None`` when one is not a line in whole bytes
    per row, unless ``approximate`` (shapes that depend on the data, such as the rows a router
    sends each expert): then the line through both, rounded up."""
    (n1, events1), (n2, events2) = first, second
    if n1 == n2 or len(events1) != len(events2):
        return None
    lines: dict[int, Line] = {}
    for (_, serial, a), (_, _, b) in zip(events1, events2, strict=True):
        if a < 0:
            continue
        if (b - a) % (n2 - n1) and not approximate:
            return None  # not affine in the size
        lines[serial] = (b - a, n2 - n1, a, n1)
    return lines


def _exact(lines: dict[int, Line]) -> bool:
    """Whether every line gives whole bytes per row (not one drawn through data-dependent
    sizes)."""
    return all(rise % run == 0 for rise, run, _, _ in lines.values())


def _canonical(line: Line) -> tuple[int, ...]:
    """A line as one value whichever two sizes drew it: ``(slope, offset)`` where whole."""
    rise, run, at, start = line
    return line if rise % run else (rise // run, at - rise // run * start)


def _sizes(lines: dict[int, Line], n: int) -> Callable[[int], int]:
    def size(serial: int) -> int:
        rise, run, at, start = lines[serial]
        raw = at - (-rise * (n - start) // run)
        if raw < 0:
            raise ValueError(f"a storage would have {raw} bytes at size {n}")
        return raw

    return size


def _running_peak(
    lines: dict[int, Line], order: list[tuple[int, bool]], base: int, block: int
) -> Callable[[int], int]:
    """The highest total of live storages, each rounded up to ``block``, over ``order``
    (``(serial, died)``) at any size, from ``base`` bytes resident."""

    def peak(n: int) -> int:
        size = _sizes(lines, n)
        live: dict[int, int] = {}
        total = highest = base
        for serial, died in order:
            if died:
                total -= live.pop(serial, 0)
            else:
                rounded = -(-size(serial) // block) * block
                live[serial] = rounded
                total += rounded
                highest = max(highest, total)
        return highest

    return peak


@dataclass(frozen=True)
class StorageTrial:
    """The storages of one fitting trial: its size, the bytes allocated as its step began,
    its storage events in order (``(segment, serial, bytes)``, negative bytes: freed), and
    its measured peak."""

    size: int
    base: int
    events: list[tuple[int, int, int]]
    peak: int


def _curve(first: StorageTrial, second: StorageTrial, block: int) -> Callable[[int], int] | None:
    """The peak at any size from two trials' storage events (alike but for sizes): each
    storage's bytes are a line through its two sizes (``None`` when one is not), every
    storage is rounded up to ``block``, and the peak is the highest the running total
    reaches. ``None`` unless it gives both trials' measured peaks exactly."""
    n1, base1, events1, peak1 = first.size, first.base, first.events, first.peak
    n2, base2, events2, peak2 = second.size, second.base, second.events, second.peak
    if base1 != base2:
        return None
    lines = _lines((n1, events1), (n2, events2))
    if lines is None:
        return None
    peak = _running_peak(lines, [(serial, nbytes < 0) for _, serial, nbytes in events1], base1, block)
    if peak(n1) != peak1 or peak(n2) != peak2:
        return None
    return peak


#: What replays worked out, by what they replay (see :func:`_replayed_curve`): size -> peaks.
Replays = dict[Any, dict[int, tuple[int, int] | None]]


def _replayed_curve(
    first: StorageTrial, second: StorageTrial, model: AllocationModel,
    replays: Replays | None = None,
) -> Verdicts | None:
    """Which sizes fit, and their peaks, from two trials' storage events (alike but for
    sizes) replayed through a copy of the caching allocator as
    it was when both began (``model``): each storage's bytes are a line in the size, and the
    copy places them as the device does, segments and block pools included. Its ceiling is
    the largest size whose storages, packed without a gap, stay within the allocator's limit:
    no larger size can fit. ``None`` unless the replay gives both trials' measured peaks
    exactly.

    ``replays`` keeps each size's replay for later curves that replay the same thing: the
    same lines, in the same order, through an allocator with the same limit and the same
    blocks (a later trial's, whose layout the search compared already). New segments go above
    every block there is, wherever the copy's next address lies, so the same blocks place the
    same storages alike: one function, each size replayed once."""
    n1, base, events1, peak1 = first.size, first.base, first.events, first.peak
    n2, events2, peak2 = second.size, second.events, second.peak
    lines = _lines((n1, events1), (n2, events2), approximate=True)
    if lines is None:
        return None
    exact = _exact(lines)
    order = [(serial, nbytes < 0) for _, serial, nbytes in events1]
    known = None
    if replays is not None:
        key = (tuple(sorted((k, _canonical(line)) for k, line in lines.items())), tuple(order),
               model.limit,
               model.expandable_segments, tuple(model.blocks()))
        known = replays.setdefault(key, {})

    def replay(n: int) -> tuple[int, int] | None:
        size = _sizes(lines, n)
        return model.replay((serial, -1 if died else size(serial)) for serial, died in order)

    packed = _running_peak(lines, order, base, 512)  # (no block is smaller than its request)
    try:  # (a line that goes below 0 bytes further out is no line: ValueError)
        high = max(n1, n2)
        if packed(high) > model.limit:
            return None  # (a trial that fit cannot be over the limit: the events miss some)
        while packed(2 * high) <= model.limit and high < 2**40:
            high *= 2
        low, high = high, 2 * high  # packed(low) within the limit, packed(high) over it
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if packed(middle) <= model.limit else (low, middle)
        curve = Verdicts(replay, ceiling=low, floor=min(n1, n2), known=known,
                         approximate=not exact)
        if curve.peak_at(n1) != peak1 or curve.peak_at(n2) != peak2:
            return None
    except ValueError:
        return None
    return curve


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
