"""``find_best_batch``: the batch size that trains fastest, which is not always the largest.

Past some size a device is saturated: a larger batch costs as much time per sample and only takes
memory (and changes the optimisation). This module times real steps at candidate sizes up to the
largest that fits (warm-up steps, the device synchronised around every timed step, several
repeats, the median) and picks the smallest size within a tolerance of the best samples/second.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autobatch._errors import BatchSizeError
from autobatch._log import get_logger
from autobatch._memory._backends import DeviceLike, DeviceMemory, free_memory, memory_for
from autobatch._records._result import SearchResult, ThroughputPoint, ThroughputResult
from autobatch._sizing._finder import search_batch_size
from autobatch._sizing._trial import failure_of, prepared
from autobatch._sizing._workload import (
    DEFAULT_HEADROOM,
    Batch,
    LossFn,
    OptimizerLike,
    Sample,
    StepFn,
    batch_factory,
    model_device,
    prime_optimizer,
)
from autobatch._validate import check_fraction, check_int, check_module

logger = get_logger("throughput")

#: Default tolerance: the chosen size is the smallest within 2% of the best samples/second.
DEFAULT_TOLERANCE = 0.02


def default_candidates(max_batch: int, *, min_batch: int = 1, multiple_of: int = 1) -> list[int]:
    """Powers of two from ``min_batch`` up to ``max_batch`` (rounded down to ``multiple_of``),
    and ``max_batch`` itself.

    >>> default_candidates(200)
    [1, 2, 4, 8, 16, 32, 64, 128, 200]
    >>> default_candidates(100, min_batch=4, multiple_of=8)
    [8, 16, 32, 64, 100]
    """
    sizes = {max_batch}
    power = 1
    while power < max_batch:
        size = power // multiple_of * multiple_of
        if size >= max(min_batch, 1):
            sizes.add(size)
        power *= 2
    return sorted(sizes)


def _check_sizes(candidates: Iterable[int]) -> list[int]:
    sizes = [check_int("each of candidates", size) for size in candidates]
    if not sizes:
        raise ValueError("candidates is empty; give at least one batch size to time")
    return sorted(set(sizes))


def _check(tolerance: float, repeats: int, warmup: int) -> None:
    check_fraction("tolerance", tolerance, example="0.02")
    check_int("repeats", repeats)
    check_int("warmup", warmup, minimum=0)


@dataclass(frozen=True)
class _Timer:
    """Times the step at one size: ``warmup`` steps, then ``repeats`` synchronised ones."""

    make_batch: Callable[[int], Batch]
    step: Callable[[Batch], Any]
    memory: DeviceMemory
    cleanup: Callable[[], None]
    repeats: int
    warmup: int

    def _run(self, size: int, times: list[float]) -> str | None:
        def run() -> None:
            batch = self.make_batch(size)
            for _ in range(self.warmup):
                self.step(batch)
            for _ in range(self.repeats):
                self.memory.synchronize()
                start = time.perf_counter()
                self.step(batch)
                self.memory.synchronize()
                times.append(time.perf_counter() - start)

        return failure_of(run)

    def __call__(self, size: int) -> ThroughputPoint:
        times: list[float] = []
        error = self._run(size, times)
        self.cleanup()
        if error is not None:  # out of the except block: the failed attempt's tensors are gone
            free_memory(self.memory.device)
            point = ThroughputPoint(size, None, None, error)
        else:
            median = statistics.median(times)
            point = ThroughputPoint(size, size / median if median > 0 else math.inf, median)
        logger.info("%s", point)
        return point


def find_best_batch(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike = None,
    *,
    max_batch: int | None = None,
    candidates: Sequence[int] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    repeats: int = 5,
    warmup: int = 2,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    train: bool = True,
    device: DeviceLike = None,
    min_batch: int = 1,
    multiple_of: int = 1,
    headroom: float = DEFAULT_HEADROOM,
    **search_options: Any,
) -> ThroughputResult:
    """The batch size with the best training throughput: the smallest within ``tolerance`` of
    the most samples per second, with the whole measured curve.

    Times real steps (warm-up, device synchronised around each timed step, median of
    ``repeats``) at each candidate size. Afterwards the model, optimizer and RNG streams are
    as before, like after :func:`~autobatch.find_max_batch`.

    >>> import torch
    >>> from autobatch.testing import SimulatedGPU
    >>> model = torch.nn.Linear(64, 10)
    >>> with SimulatedGPU("2MiB", adopt=[model]):
    ...     best = find_best_batch(model, torch.randn(1, 64), torch.optim.SGD, repeats=2)
    >>> best.batch_size <= best.max_batch_size
    True

    Args:
        model, sample, optimizer, loss_fn, step_fn, train, device: As for
            :func:`~autobatch.find_max_batch`.
        min_batch, multiple_of: The sizes allowed, in the search and the default candidates.
        headroom: As for :func:`~autobatch.find_max_batch`: the search's recommended size is
            the default ``max_batch``.
        max_batch: The largest size to consider. Default: the recommended size of a
            :func:`~autobatch.search_batch_size` run first (with ``search_options``).
        candidates: The sizes to time. Default: powers of two up to the maximum, and the maximum.
        tolerance: The chosen size is the smallest whose samples/second is at least ``1 -
            tolerance`` of the best.
        repeats, warmup: Timed steps per size (their median counts) and untimed steps before them.
        search_options: Passed to :func:`~autobatch.search_batch_size` (``scaler``,
            ``steps_per_trial``, ...); ``scaler`` is used by the timed steps too.

    Raises:
        BatchSizeError: No candidate size could run (all ran out of memory).
    """
    _check(tolerance, repeats, warmup)
    check_module("model", model)
    search: SearchResult | None = None
    if candidates is not None:
        sizes = _check_sizes(candidates)
        if max_batch is not None:
            sizes = [s for s in sizes if s <= max_batch]
            if not sizes:
                raise ValueError(f"no candidate is <= max_batch={max_batch}")
    else:
        if max_batch is None:
            search = search_batch_size(
                model, sample, optimizer, loss_fn=loss_fn, step_fn=step_fn, train=train,
                device=device, min_batch=min_batch, multiple_of=multiple_of, headroom=headroom,
                **search_options,
            )
            max_batch = search.batch_size
        elif isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        sizes = default_candidates(max_batch, min_batch=min_batch, multiple_of=multiple_of)
    target = model_device(model, device)
    memory = memory_for(target)
    points: list[ThroughputPoint] = []
    with prepared(
        model, optimizer, memory, train=train, loss_fn=loss_fn, step_fn=step_fn,
        scaler=search_options.get("scaler"),
    ) as work:
        timer = _Timer(
            batch_factory(sample, target), work.step, memory, work.drop_gradients,
            repeats=repeats, warmup=warmup,
        )
        if work.optimizer is not None:
            prime_optimizer(work.optimizer)
        for size in sizes:
            point = timer(size)
            points.append(point)
            if point.samples_per_s is None:
                break  # larger sizes need more memory still
    return _choose(points, tolerance, memory.name, train, repeats, warmup, search, sizes)


def _choose(
    points: list[ThroughputPoint],
    tolerance: float,
    device: str,
    train: bool,
    repeats: int,
    warmup: int,
    search: SearchResult | None,
    sizes: list[int],
) -> ThroughputResult:
    timed = [(p.size, p.samples_per_s) for p in points if p.samples_per_s is not None]
    if not timed:
        first = points[0]
        raise BatchSizeError(
            f"no candidate batch size could run on {device}: batch {first.size} failed "
            f"({first.error}) while timing. Give smaller candidates, or find what fits first "
            "with autobatch.find_max_batch",
            batch_size=first.size,
        )
    fastest, best = max(timed, key=lambda item: item[1])
    chosen, rate = next((s, r) for s, r in timed if r >= (1 - tolerance) * best)
    notes: list[str] = []
    skipped = [s for s in sizes if s > points[-1].size]
    if points[-1].samples_per_s is None:
        notes.append(
            f"batch {points[-1].size} ran out of memory while timing"
            + (f"; larger candidates {skipped} were skipped" if skipped else "")
        )
    result = ThroughputResult(
        batch_size=chosen,
        samples_per_s=rate,
        fastest_batch_size=fastest,
        best_samples_per_s=best,
        max_batch_size=max(sizes),
        tolerance=float(tolerance),
        points=tuple(points),
        device=device,
        train=train,
        repeats=repeats,
        warmup=warmup,
        search=search,
        notes=tuple(notes),
    )
    logger.info(
        "fastest batch %d (%.1f samples/s); chosen %d (%.1f samples/s, within %g)",
        fastest, best, chosen, rate, tolerance,
    )
    return result
