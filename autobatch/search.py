"""The search engine: the exact largest size that fits, asked of a probe in few trials.

Pure logic, no torch: every front-end (``find_max_batch``, the OOM guard, the planner-seeded search)
wraps its workload in a ``probe(size) -> Outcome`` and lets :func:`search` choose the sizes.

The engine keeps one bracket (largest size known to fit, smallest size known to fail) and asks a
policy object for the next size; the engine snaps that size onto the grid strictly inside the
bracket, so no policy can probe outside the grid, probe a size twice, or stop before the answer is
exact. Two policies ship: :class:`ModelGuided` (the default; it fits ``peak(n) = a + b*n`` to the
measured peaks and jumps to the predicted largest size) and :class:`Exponential` (double, then
bisect; used whenever there are no memory statistics).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Exponential",
    "LinearModel",
    "ModelGuided",
    "Outcome",
    "SearchOutcome",
    "SearchPolicy",
    "SearchState",
    "Trial",
    "fit_linear",
    "recommend",
    "search",
]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

#: The largest size ever probed when ``max_size`` is ``None``: a probe that never fails ends here.
UNBOUNDED_MAX_SIZE = 2**62

_MAX_FIT_POINTS = 8  # the fit uses the fitting trials at the largest sizes only


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Outcome:
    """What a probe reports about one trial.

    >>> Outcome(fits=True, peak_bytes=3_000_000)
    Outcome(fits=True, peak_bytes=3000000, error=None)

    Args:
        fits: whether the trial ran to completion.
        peak_bytes: the trial's measured peak memory (fitting trials); ``None`` when the device
            keeps no statistics.
        error: a short kind for a failure, e.g. ``"oom"`` or ``"size_limit"``.
    """

    fits: bool
    peak_bytes: int | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fits, bool):
            raise TypeError(f"Outcome.fits must be a bool, got {self.fits!r}")
        if self.peak_bytes is not None:
            _check_int("Outcome.peak_bytes", self.peak_bytes, minimum=0)
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"Outcome.error must be a str or None, got {self.error!r}")


@dataclass(frozen=True)
class Trial:
    """One probe as the search recorded it.

    >>> Trial(size=64, fits=False, error="oom")
    Trial(size=64, fits=False, peak_bytes=None, error='oom')

    Args:
        size: the size probed.
        fits: whether it fit.
        peak_bytes: its measured peak memory, if any.
        error: the probe's short failure kind, if any.
    """

    size: int
    fits: bool
    peak_bytes: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class LinearModel:
    """An affine memory model, ``peak(n) ~= fixed + per_sample * n``.

    >>> LinearModel(fixed=1000.0, per_sample=10.0).largest_within(1_095)
    9

    Args:
        fixed: bytes that do not depend on the size (weights, optimizer state, workspaces).
        per_sample: bytes added by each sample; must be positive.
    """

    fixed: float
    per_sample: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.fixed):
            raise ValueError(f"LinearModel.fixed must be finite, got {self.fixed!r}")
        if not (math.isfinite(self.per_sample) and self.per_sample > 0):
            raise ValueError(
                f"LinearModel.per_sample must be positive and finite, got {self.per_sample!r}"
            )

    def predict(self, n: int) -> float:
        """The predicted peak bytes at size ``n``.

        >>> LinearModel(fixed=1000.0, per_sample=10.0).predict(5)
        1050.0
        """
        return self.fixed + self.per_sample * n

    def largest_within(self, budget_bytes: float) -> int:
        """The largest ``n >= 0`` whose predicted peak is at most ``budget_bytes`` (0 if none).

        >>> LinearModel(fixed=100.0, per_sample=7.0).largest_within(150)
        7
        """
        room = (budget_bytes - self.fixed) / self.per_sample
        if not room >= 1:  # also catches NaN
            return 0
        n = int(min(room, float(2**63)))
        while n > 0 and self.predict(n) > budget_bytes:  # float rounding at the edge
            n -= 1
        while self.predict(n + 1) <= budget_bytes and n < 2**63:
            n += 1
        return n


@dataclass(frozen=True)
class _Fit:
    """A fitted model and what its uncertainty depends on."""

    model: LinearModel
    low: int  # smallest size used by the fit
    high: int  # largest size used by the fit
    residual: float  # worst absolute residual of the used points, bytes


def _least_squares(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    x_mean = sum(xs) / len(xs)
    y_mean = sum(ys) / len(ys)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    sxy = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys))
    slope = sxy / sxx
    return y_mean - slope * x_mean, slope


def _fit(points: Sequence[tuple[int, int]], tolerance_bytes: float) -> _Fit | None:
    peaks: dict[int, int] = {}
    for size, peak in points:
        peaks[size] = max(peak, peaks.get(size, peak))
    sizes = sorted(peaks)[-_MAX_FIT_POINTS:]
    while len(sizes) >= 2:
        ys = [float(peaks[x]) for x in sizes]
        fixed, per_sample = _least_squares(sizes, ys)
        worst = max(abs(y - (fixed + per_sample * x)) for x, y in zip(sizes, ys))
        if worst <= tolerance_bytes + 1e-9 * max(ys) or len(sizes) == 2:
            break
        sizes = sizes[1:]  # the start of a memory curve is the part that bends: drop it first
    if len(sizes) < 2 or not (math.isfinite(per_sample) and per_sample > 0):
        return None
    if not math.isfinite(fixed):
        return None
    return _Fit(LinearModel(fixed, per_sample), sizes[0], sizes[-1], worst)


def fit_linear(
    points: Sequence[tuple[int, int]], *, tolerance_bytes: float = 4096.0
) -> LinearModel | None:
    """Fit ``peak = fixed + per_sample * size`` to measured ``(size, peak_bytes)`` points, robustly.

    Only the points at the largest sizes are used; while a point disagrees with the
    least-squares line by more than ``tolerance_bytes``, the point at the smallest size is
    dropped (real curves are affine except at the start). Returns ``None`` with fewer than two
    distinct sizes or when the line does not grow.

    >>> fit_linear([(1, 5000), (2, 1200), (4, 1400), (8, 1800)])
    LinearModel(fixed=1000.0, per_sample=100.0)

    Args:
        points: ``(size, peak_bytes)`` pairs, any order; repeated sizes keep their largest peak.
        tolerance_bytes: how far a point may sit from the line (allocator rounding) and still count.
    """
    found = _fit(points, tolerance_bytes)
    return None if found is None else found.model


@dataclass(frozen=True)
class SearchOutcome:
    """The result of :func:`search`: the answer, the bracket's other side, and every trial.

    >>> search(lambda n: Outcome(fits=n <= 5), max_size=8, policy=Exponential()).largest_fit
    5

    Args:
        largest_fit: the exact largest fitting grid size; ``None`` if even the smallest failed.
        smallest_fail: the smallest failing size tried; ``None`` if ``max_size`` fit.
        trials: every probe in order.
        model: the final fitted memory model, if the probe reported peaks.
    """

    largest_fit: int | None
    smallest_fail: int | None
    trials: tuple[Trial, ...]
    model: LinearModel | None

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes tried, in order."""
        return tuple(trial.size for trial in self.trials)


@dataclass(frozen=True)
class SearchState:
    """What a policy sees when it chooses the next size: the grid, the bracket and the trials.

    >>> state = SearchState(trials=(), largest_fit=8, smallest_fail=32, min_size=4,
    ...                     max_size=None, multiple_of=4)
    >>> state.midpoint()
    20

    Args:
        trials: every probe so far, in order.
        largest_fit: the largest size known to fit (``None``: none yet).
        smallest_fail: the smallest size known to fail (``None``: none yet).
        min_size: the smallest grid size.
        max_size: the largest grid size (``None``: unbounded).
        multiple_of: the grid step.
        capacity_bytes: the memory budget, if known.
        start: the caller's first guess, if any.
        prior: an offline memory model, if any.
    """

    trials: tuple[Trial, ...]
    largest_fit: int | None
    smallest_fail: int | None
    min_size: int
    max_size: int | None
    multiple_of: int
    capacity_bytes: int | None = None
    start: int | None = None
    prior: LinearModel | None = None

    @property
    def points(self) -> list[tuple[int, int]]:
        """``(size, peak_bytes)`` of the fitting trials that reported a peak."""
        return [(t.size, t.peak_bytes) for t in self.trials if t.fits and t.peak_bytes is not None]

    def below(self) -> int:
        """The bracket's lower side: the largest fit, or one grid step under ``min_size``."""
        if self.largest_fit is not None:
            return self.largest_fit
        return self.min_size - self.multiple_of

    def above(self) -> int | None:
        """The bracket's upper side: the smallest fail, one step over ``max_size``, or ``None``."""
        if self.smallest_fail is not None:
            return self.smallest_fail
        if self.max_size is not None:
            return self.max_size + self.multiple_of
        return None

    def midpoint(self) -> int | None:
        """The grid size halfway inside the bracket (``None`` while it is unbounded above).

        Halfway is the arithmetic mean, or the geometric mean while the bracket spans more than a
        factor of 4, so that a far-off failure costs ``log2(log2(ratio))`` trials, not
        ``log2(ratio)``.
        """
        upper = self.above()
        if upper is None:
            return None
        step = self.multiple_of
        low, high = self.below() // step, upper // step
        if high > 4 * max(low, 1):
            return max(math.isqrt(max(low, 1) * high), low + 1) * step
        return (low + high) // 2 * step


class SearchPolicy(Protocol):
    """Chooses the next size to try; the engine snaps it onto the grid inside the bracket."""

    def next_size(self, state: SearchState) -> int:
        """The size to probe next (any int; the engine snaps and clamps it)."""
        ...


@dataclass(frozen=True)
class Exponential:
    """Grow by ``factor`` from the largest fit until something fails, then bisect.

    Needs no memory statistics. From ``min_size`` (or ``start``) with ``factor=2`` it takes at most
    ``2 * floor(log2(answer / first)) + 2`` trials.

    >>> search(lambda n: Outcome(fits=n <= 5), policy=Exponential()).sizes
    (1, 2, 4, 8, 6, 5)

    Args:
        factor: the growth factor before the first failure (an int >= 2, so sizes stay on the grid).
    """

    factor: int = 2

    def __post_init__(self) -> None:
        _check_int("Exponential.factor", self.factor, minimum=2)

    def next_size(self, state: SearchState) -> int:
        if not state.trials:
            return state.start if state.start is not None else state.min_size
        midpoint = state.midpoint()
        if state.smallest_fail is None and state.largest_fit is not None:
            return state.largest_fit * self.factor
        if midpoint is None:  # unreachable: a trial was made, so one side is known
            return state.min_size
        return midpoint


@dataclass(frozen=True)
class ModelGuided:
    """Fit ``peak(n) = a + b*n`` to the measured peaks and jump to the predicted largest fit.

    The first trial is at ``first_size`` (not 1: at size 1 a constant such as the optimizer step
    often sets the peak), the second where a proportional estimate says it surely fits, and then
    each trial goes to the size the refitted model predicts under ``capacity_bytes``; a
    prediction that is uncertain (long extrapolation, allocator rounding) lands safely below it.
    A prediction proven wrong is followed by steps that double away from it, never beyond the
    bracket's midpoint, so a wrong model costs a logarithmic number of trials. Without peak
    statistics or capacity, and after ``model_trials`` trials, it defers to ``fallback``.

    >>> probe = lambda n: Outcome(fits=1000 + 10 * n <= 2000, peak_bytes=1000 + 10 * n)
    >>> search(probe, capacity_bytes=2000).sizes
    (2, 3, 100, 101)

    Args:
        first_size: the first size tried when there is no ``start`` or ``prior``.
        granularity_bytes: how far a measured peak may be off (allocator rounding).
        max_growth: the most a model jump may multiply the largest fitting size (guards degenerate
            fits).
        model_trials: after this many trials, only ``fallback`` chooses.
        fallback: the policy used without statistics.
    """

    first_size: int = 2
    granularity_bytes: int = 512
    max_growth: int = 2**16
    model_trials: int = 8
    fallback: Exponential = Exponential()

    def __post_init__(self) -> None:
        _check_int("ModelGuided.first_size", self.first_size, minimum=1)
        _check_int("ModelGuided.granularity_bytes", self.granularity_bytes, minimum=0)
        _check_int("ModelGuided.max_growth", self.max_growth, minimum=2)
        _check_int("ModelGuided.model_trials", self.model_trials, minimum=0)

    def next_size(self, state: SearchState) -> int:
        capacity = state.capacity_bytes
        if capacity is None or len(state.trials) >= self.model_trials:
            return self.fallback.next_size(state)
        if not state.trials:
            if state.start is not None:
                return state.start
            if state.prior is not None:
                return state.prior.largest_within(capacity)
            return self.first_size
        points = state.points
        if not points:
            if state.largest_fit is None:  # only failures so far: get a measured point cheaply
                return self.first_size
            return self.fallback.next_size(state)
        fit = self._fit(state, points)
        if fit is None:
            if len({size for size, _ in points}) == 1:
                return self._second_size(state, points[-1], capacity)
            return self.fallback.next_size(state)
        return self._guided_size(state, fit, capacity)

    def _fit(self, state: SearchState, points: list[tuple[int, int]]) -> _Fit | None:
        if len({size for size, _ in points}) >= 2:
            return _fit(points, 8.0 * self.granularity_bytes)
        if state.prior is None:
            return None
        size, peak = max(points)
        anchored = LinearModel(peak - state.prior.per_sample * size, state.prior.per_sample)
        return _Fit(anchored, size, size, 0.0)

    def _second_size(self, state: SearchState, point: tuple[int, int], capacity: int) -> int:
        """With one measured point: where scaling its peak to capacity says the size surely fits."""
        size, peak = point
        step = state.multiple_of
        proportional = size * capacity // peak if peak > 0 else size * self.max_growth
        target = max(proportional // 2, 4 * size)
        target = min(target, size * self.max_growth)
        midpoint = state.midpoint()
        if state.smallest_fail is not None and midpoint is not None:
            target = min(target, midpoint)
        return target

    def _guided_size(self, state: SearchState, fit: _Fit, capacity: int) -> int:
        step = state.multiple_of
        low = state.below() // step  # grid indices from here on
        upper = state.above()
        high = None if upper is None else upper // step
        midpoint = state.midpoint()
        middle = None if midpoint is None else midpoint // step
        target = self._target(fit, capacity, state.below()) // step
        if state.largest_fit is not None:
            target = min(target, low * self.max_growth)
        if state.max_size is not None:
            target = min(target, state.max_size // step)
        if target <= low:  # the model says we are there: verify, doubling away from it
            index = low + max(1, low - target)
            return (index if middle is None else min(index, middle)) * step
        if state.smallest_fail is not None and high is not None and target >= high:
            assert middle is not None  # a failure bounds the bracket
            if target == high:  # off by one, as allocator rounding does: step down once
                return max(high - 1, middle) * step
            return middle * step  # proven wrong beyond that: bisect
        return target * step

    def _target(self, fit: _Fit, capacity: int, below: int) -> int:
        """The size to try: the predicted largest fit, or safely below it when that is uncertain.

        The measured peaks may each be off by ``granularity_bytes`` (or the fit's worst residual);
        extrapolating beyond the fitted sizes multiplies that. When the sizes that could be the
        answer are at most two, the larger is tried first (either result then needs one more
        trial); otherwise the trial lands below all of them, and at least an eighth of the way
        back towards the largest fit, so that it surely fits and lengthens the fit's baseline.
        """
        model = fit.model
        exact = (capacity - model.fixed) / model.per_sample
        if not math.isfinite(exact) or exact > UNBOUNDED_MAX_SIZE:
            return UNBOUNDED_MAX_SIZE
        error = max(float(self.granularity_bytes), fit.residual)
        if fit.high > fit.low:
            error *= 1 + 2 * max(0.0, exact - fit.high) / (fit.high - fit.low)
        spread = error / model.per_sample
        lowest, highest = math.floor(exact - spread), math.floor(exact + spread)
        if highest - lowest <= 1:
            return highest
        return min(lowest, math.floor(exact) - (math.floor(exact) - below) // 8)


class _Bracket:
    """The search's grid and bracket, in sizes."""

    def __init__(self, min_size: int, max_size: int | None, multiple_of: int) -> None:
        self.step = multiple_of
        self.first = -(-min_size // multiple_of) * multiple_of
        last = UNBOUNDED_MAX_SIZE if max_size is None else max_size
        self.last = last // multiple_of * multiple_of
        self.fit: int | None = None
        self.fail: int | None = None
        if self.first > self.last:
            raise ValueError(
                f"no size in [min_size={min_size}, max_size={max_size}] is a multiple of "
                f"multiple_of={multiple_of}; widen the range or change multiple_of"
            )

    @property
    def closed(self) -> bool:
        lower = self.first - self.step if self.fit is None else self.fit
        upper = self.last + self.step if self.fail is None else self.fail
        return upper - lower <= self.step

    def snap(self, size: int) -> int:
        """The grid size nearest below ``size``, moved strictly inside the bracket."""
        lower = self.first - self.step if self.fit is None else self.fit
        upper = self.last + self.step if self.fail is None else self.fail
        snapped = size // self.step * self.step
        return min(max(snapped, lower + self.step), upper - self.step)

    def record(self, size: int, fits: bool) -> None:
        if fits:
            self.fit = size
        else:
            self.fail = size


def search(
    probe: Callable[[int], Outcome],
    *,
    min_size: int = 1,
    max_size: int | None = None,
    multiple_of: int = 1,
    capacity_bytes: int | None = None,
    start: int | None = None,
    prior: LinearModel | None = None,
    policy: SearchPolicy | None = None,
) -> SearchOutcome:
    """Find the exact largest grid size for which ``probe`` reports a fit, in few trials.

    The grid is the multiples of ``multiple_of`` in ``[min_size, max_size]``; fitting is assumed
    monotone (if a size fits, every smaller one does). The answer is exact: it was probed and fit,
    and the next grid size up was probed and failed (or is beyond ``max_size``). No size is probed
    twice or off the grid, and the same probe gives the same sequence of sizes.

    Trials, with the default policy: with peak statistics on an affine curve (also one whose
    first sizes bend, with 512-byte rounding) typically 4-5; without statistics at most
    ``2*floor(log2(answer)) + 2`` from ``min_size=1``; for any monotone probe at most
    ``2*ceil(log2(R)) + 20``, where ``R`` is the number of grid sizes up to twice the answer
    (bounded by ``max_size``).

    >>> search(lambda n: Outcome(fits=n <= 37), policy=Exponential()).sizes
    (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)
    >>> probe = lambda n: Outcome(fits=5000 + 100 * n <= 9000, peak_bytes=5000 + 100 * n)
    >>> outcome = search(probe, capacity_bytes=9000)
    >>> outcome.largest_fit, outcome.sizes
    (40, (2, 3, 40, 41))

    Args:
        probe: runs one trial at a size and reports an :class:`Outcome`.
        min_size: the smallest size allowed (>= 1).
        max_size: the largest size allowed (e.g. the dataset length); ``None`` for no cap.
        multiple_of: only multiples of this are tried (e.g. 8 for tensor cores).
        capacity_bytes: the memory budget the peaks are compared with; ``None`` disables the model.
        start: a first guess (e.g. from a planner).
        prior: a memory model predicted offline; with ``capacity_bytes`` it picks the first size.
        policy: how sizes are chosen; default :class:`ModelGuided`, which falls back to
            :class:`Exponential` without statistics.
    """
    _check_int("min_size", min_size, minimum=1)
    _check_int("multiple_of", multiple_of, minimum=1)
    if max_size is not None:
        _check_int("max_size", max_size, minimum=1)
        if max_size < min_size:
            raise ValueError(f"max_size={max_size} is below min_size={min_size}; raise max_size")
    if capacity_bytes is not None:
        _check_int("capacity_bytes", capacity_bytes, minimum=1)
    if start is not None:
        _check_int("start", start, minimum=1)
    if prior is not None and not isinstance(prior, LinearModel):
        raise TypeError(f"prior must be a LinearModel or None, got {type(prior).__name__}")
    if not callable(probe):
        raise TypeError(f"probe must be callable, got {type(probe).__name__}")
    bracket = _Bracket(min_size, max_size, multiple_of)
    chooser: SearchPolicy = ModelGuided() if policy is None else policy
    trials: list[Trial] = []
    while not bracket.closed:
        state = SearchState(
            trials=tuple(trials),
            largest_fit=bracket.fit,
            smallest_fail=bracket.fail,
            min_size=bracket.first,
            max_size=None if max_size is None else bracket.last,
            multiple_of=multiple_of,
            capacity_bytes=capacity_bytes,
            start=start,
            prior=prior,
        )
        proposal = chooser.next_size(state)
        if isinstance(proposal, bool) or not isinstance(proposal, int):
            raise TypeError(f"policy {chooser!r} proposed {proposal!r}; it must return an int")
        size = bracket.snap(proposal)
        outcome = probe(size)
        if not isinstance(outcome, Outcome):
            raise TypeError(
                f"probe({size}) returned {type(outcome).__name__}; it must return an Outcome"
            )
        trials.append(Trial(size, outcome.fits, outcome.peak_bytes, outcome.error))
        bracket.record(size, outcome.fits)
        logger.info(
            "trial %d: size %d %s (peak %s bytes%s)",
            len(trials),
            size,
            "fits" if outcome.fits else "fails",
            outcome.peak_bytes,
            "" if outcome.error is None else f", {outcome.error}",
        )
    points = [(t.size, t.peak_bytes) for t in trials if t.fits and t.peak_bytes is not None]
    return SearchOutcome(bracket.fit, bracket.fail, tuple(trials), fit_linear(points))


def recommend(
    outcome: SearchOutcome,
    *,
    capacity_bytes: int | None = None,
    headroom: float = 0.0,
    multiple_of: int = 1,
    min_size: int = 1,
) -> int:
    """The largest grid size at most ``outcome.largest_fit`` that leaves ``headroom`` of memory free.

    With a fitted model and ``capacity_bytes``: the largest size whose predicted peak is at most
    ``(1 - headroom) * capacity_bytes``. Otherwise an approximation: ``(1 - headroom) *
    largest_fit`` rounded down. Either way on the grid, never below the smallest grid size and
    never above ``largest_fit``.

    >>> found = SearchOutcome(largest_fit=100, smallest_fail=101, trials=(), model=None)
    >>> recommend(found, headroom=0.1, multiple_of=8)
    88

    Args:
        outcome: a search result with a fitting size.
        capacity_bytes: the memory budget the model's peaks are compared with.
        headroom: the fraction of capacity to leave free, in ``[0, 1)``.
        multiple_of: the grid step.
        min_size: the smallest size allowed.
    """
    _check_int("multiple_of", multiple_of, minimum=1)
    _check_int("min_size", min_size, minimum=1)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    largest = outcome.largest_fit
    if largest is None:
        raise ValueError("outcome has no fitting size (largest_fit is None); nothing to recommend")
    smallest = -(-min_size // multiple_of) * multiple_of
    if outcome.model is not None and capacity_bytes is not None:
        size = outcome.model.largest_within((1 - headroom) * capacity_bytes)
    else:
        size = math.floor((1 - headroom) * largest)
    size = size // multiple_of * multiple_of
    return max(smallest, min(size, largest))
