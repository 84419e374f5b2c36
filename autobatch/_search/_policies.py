"""Search policies: which size to try next, given the bracket and the trials."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from autobatch._search._model import (
    _SHARP_SPREAD,
    OUT_OF_MEMORY,
    REPLAY_TOLERANCE,
    UNBOUNDED_MAX_SIZE,
    LinearModel,
    Trial,
    Verdicts,
    _binding,
    _Fit,
    _fit,
    _largest_within,
    binding_points,
    trusted_curve,
)
from autobatch._validate import check_int

#: Guided trials after the first failure under a caching allocator, before bisecting.
_CACHING_GUIDED = 3
#: The most sizes a :class:`Verdicts` curve is asked, from its ceiling down, for the largest
#: that fits (evenly spread, then each size above the highest that fits up to the next one).
_MAX_VERDICTS = 256
#: Above the highest size asked that an ``approximate`` replay says fits, how many grid sizes
#: are asked one by one: drawn through sizes that depend on the data (the rows a router sends
#: each expert), its fit map alternates size by size, with islands narrower than the spread.
_APPROXIMATE_WINDOW = 32


def _highest_verdict(curve: Verdicts, low: int, top: int, step: int) -> int | None:
    """The largest grid size in ``(low, top]`` that ``curve`` says fits, islands above a gap
    included: sizes from ``top`` down, at most :data:`_MAX_VERDICTS` of them evenly spread,
    to the highest that fits, then the sizes above it one by one up to the next one asked
    (an island narrower than that spread, between two sizes asked, can be missed; an
    ``approximate`` curve's is looked for :data:`_APPROXIMATE_WINDOW` sizes up); ``None``
    where none asked fits."""
    stride = max(1, -(-(top - low) // step // _MAX_VERDICTS)) * step
    size = top
    while size > low and curve.peak_at(size) is None:
        size -= stride
    if size <= low:
        return None
    if curve.approximate:
        above = range(size + step, min(top, size + stride + _APPROXIMATE_WINDOW * step) + 1, step)
        return max((n for n in above if curve.peak_at(n) is not None), default=size)
    while size + step <= min(top, size + stride - step) and curve.peak_at(size + step) is not None:
        size += step
    return size

logger = logging.getLogger("autobatch.search")


@dataclass(frozen=True)
class SearchOutcome:
    """The result of :func:`search`: the answer, the bracket's other side, and every trial.

    >>> from autobatch._search import search
    >>> search(lambda n: Trial(n, fits=n <= 5), max_size=8, policy=Exponential()).largest_fit
    5

    Args:
        largest_fit: the exact largest fitting grid size; ``None`` if even the smallest failed.
        smallest_fail: the smallest failing size tried, or replayed; ``None`` if ``max_size``
            fit.
        trials: every probe in order.
        model: the final fitted memory model, if the probe reported peaks.
        replayed: sizes found failing in a caching allocator's replay, not run (the size
            above the largest fit, where the replay gave every trial's peak exactly).
    """

    largest_fit: int | None
    smallest_fail: int | None
    trials: tuple[Trial, ...]
    model: LinearModel | None
    replayed: tuple[int, ...] = ()

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
        """``(size, peak_bytes)`` of the fitting trials that reported a peak.

        When every such trial also reported the peaks of its parts (or phases), the points are
        those of the part that binds first at the capacity (see :func:`binding_points`).
        """
        return binding_points(self.trials, self.capacity_bytes)

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

    >>> from autobatch._search import search
    >>> search(lambda n: Trial(n, fits=n <= 5), policy=Exponential()).sizes
    (1, 2, 4, 8, 6, 5)

    Args:
        factor: the growth factor before the first failure (an int >= 2, so sizes stay on the grid).
    """

    factor: int = 2

    def __post_init__(self) -> None:
        check_int("Exponential.factor", self.factor, minimum=2)

    def next_size(self, state: SearchState) -> int:
        if not state.trials:
            return state.start if state.start is not None else state.min_size
        if state.smallest_fail is None and state.largest_fit is not None:
            return state.largest_fit * self.factor
        midpoint = state.midpoint()
        return state.min_size if midpoint is None else midpoint


def _replay_contradicted(trials: Sequence[Trial]) -> bool:
    """Whether a size that the latest caching allocator's replay said fits then failed: the
    trials it was worked out from ran another graph than that size (a branch taken above some
    rows), and a line through their peaks speaks for it no better, so the bracket is bisected
    until two trials of the new graph replay it again."""
    curve = next((t.curve for t in reversed(trials) if isinstance(t.curve, Verdicts)), None)
    return curve is not None and any(
        not t.fits and t.size >= (curve.floor or 0) and curve.peak_at(t.size) is not None
        for t in trials
    )


@dataclass(frozen=True)
class ModelGuided:
    """Fit ``peak(n) = a + b*n`` to the measured peaks and jump to the predicted largest fit.

    The first trial is at ``first_size`` (not 1: at size 1 a constant such as the optimizer step
    often sets the peak); the second where scaling that peak says it surely fits. From then on
    the model is refitted to the largest sizes (dropping small ones off the line) and each trial
    goes where it predicts the largest fit under ``capacity_bytes``: exactly there when the
    prediction is good to one size. When allocator rounding over a long extrapolation makes it
    uncertain: if the points are one part's (a straight line, see :func:`binding_points`), the
    cheapest size that surely fits and makes the next prediction sharp (every size tried below
    the answer costs its samples); else safely below the prediction, or a geometric step when
    the slope is mostly noise, or three quarters of the way when the curve bends (a constant
    sets the peak up to some size, so the line through the first point past the bend is too
    flat). A trial that fits where the model expected the last size steps up by a growing
    amount; a failure where it promised a fit steps down by one, then two, then bisects.
    Without peak statistics or capacity, and after ``model_trials`` trials, ``fallback``
    chooses, which bounds the trial count.

    >>> from autobatch._search import search
    >>> peak = lambda n: 3_000_000_000 + 5_000_000 * n  # bytes
    >>> probe = lambda n: Trial(n, fits=peak(n) <= 8_000_000_000, peak_bytes=peak(n))
    >>> search(probe, capacity_bytes=8_000_000_000, policy=ModelGuided()).sizes
    (2, 8, 1000, 1001)

    A bent curve, the maximum of two lines (a large constant, then a steep slope), told apart
    in ``parts``, is as quick as a straight one:

    >>> from autobatch._search import search
    >>> lines = [(3_200_000, 512), (2_000_000, 5_632)]  # bytes, bytes per sample
    >>> parts = lambda n: tuple(fixed + per_sample * n for fixed, per_sample in lines)
    >>> probe = lambda n: Trial(n, fits=max(parts(n)) <= 8_000_000, peak_bytes=max(parts(n)),
    ...                           parts=parts(n))
    >>> search(probe, capacity_bytes=8_000_000).sizes
    (2, 8, 360, 1065, 1066)

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
    model_trials: int = 12
    fallback: Exponential = Exponential()

    def __post_init__(self) -> None:
        check_int("ModelGuided.first_size", self.first_size, minimum=1)
        check_int("ModelGuided.granularity_bytes", self.granularity_bytes, minimum=0)
        check_int("ModelGuided.max_growth", self.max_growth, minimum=2)
        check_int("ModelGuided.model_trials", self.model_trials, minimum=0)

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
        curve = trusted_curve(state.trials, capacity) or trusted_curve(
            state.trials, capacity, tolerance=REPLAY_TOLERANCE)
        if any(not t.fits and t.error and "size_limit" in t.error for t in state.trials):
            return self.fallback.next_size(state)  # (a limit no memory curve places: bisected)
        if curve is not None:
            try:
                return self._curve_size(state, curve, capacity)
            except (ArithmeticError, ValueError):
                pass  # (its lines break down further out, a storage's bytes below 0: not used)
        if self._segment_bound(state) or _replay_contradicted(state.trials):
            return self.fallback.next_size(state)  # bisects the bracket
        points, straight = _binding(state.trials, capacity)
        if not points:
            if state.largest_fit is None:  # only failures so far: get a measured point cheaply
                return self.first_size
            return self.fallback.next_size(state)
        fit = self._fit(state, points, straight)
        if fit is None:
            if len({size for size, _ in points}) == 1:
                return self._second_size(state, points[-1], capacity)
            return self.fallback.next_size(state)
        return self._guided_size(state, fit, capacity)

    def _segment_bound(self, state: SearchState) -> bool:
        """Whether to stop aiming under a caching allocator: its verdict turns where a segment
        stops fitting, which no line through allocated peaks tells to the size, so after
        :data:`_CACHING_GUIDED` guided trials past the first failure the bracket is bisected."""
        if state.smallest_fail is None or not any(
            t.reserved_bytes is not None for t in state.trials
        ):
            return False
        first = next(i for i, t in enumerate(state.trials) if not t.fits)
        return len(state.trials) - 1 - first >= _CACHING_GUIDED

    def _curve_size(self, state: SearchState, curve: Callable[[int], int], capacity: int) -> int:
        """Where the probe's own curve puts the largest fit: there, or the size above the
        largest fit when that is it (to see the next one fail)."""
        step = state.multiple_of
        low = state.below()
        upper = state.above()
        cap = self._cap(state, UNBOUNDED_MAX_SIZE if upper is None else upper - step)
        if isinstance(curve, Verdicts):  # it knows which sizes fit: no capacity to compare with
            capacity = OUT_OF_MEMORY - 1
            if curve.ceiling is not None:  # the largest that fits, gaps below it or not
                size = _highest_verdict(curve, low, min(cap, curve.ceiling) // step * step, step)
                if size is not None:
                    return size
        best = _largest_within(curve, capacity, low, cap, step)
        return best if best > low else low + step

    def _fit(
        self, state: SearchState, points: list[tuple[int, int]], straight: bool = False
    ) -> _Fit | None:
        if len({size for size, _ in points}) >= 2:
            found = _fit(points, 8.0 * self.granularity_bytes)
            return None if found is None else replace(found, straight=straight)
        prior, capacity = state.prior, state.capacity_bytes
        if prior is None or capacity is None:
            return None
        promised = prior.largest_within(capacity)
        if any(not t.fits and t.size <= promised for t in state.trials):
            return None  # the prior said that size fits, and it did not: distrust it
        size, peak = max(points)
        anchored = LinearModel(peak - prior.per_sample * size, prior.per_sample)
        return _Fit(anchored, size, size, 0.0, count=1)

    def _second_size(self, state: SearchState, point: tuple[int, int], capacity: int) -> int:
        """With one measured point, where scaling its peak up to capacity says the size fits.

        That proportional estimate is safe (a fixed cost can only make the true answer larger).
        After the small first trial, half of it (but at least 4x the first size) is tried: cheap,
        and far enough for a good slope. After any other single point (a ``start``), the estimate
        itself, or the next size up when the point is already at capacity.
        """
        size, peak = point
        proportional = size * capacity // peak if peak > 0 else size * self.max_growth
        if size <= max(self.first_size, state.min_size):
            target = max(proportional // 2, 4 * size)
        else:
            target = max(proportional, size + state.multiple_of)
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
        exact, spread = self._predict(fit, capacity)
        optimistic = math.floor(exact + spread) // step
        sharp = optimistic - math.floor(exact - spread) // step <= 1 and not fit.bent
        if state.smallest_fail is not None and high is not None and optimistic >= high:
            assert middle is not None  # a failure bounds the bracket
            miss = optimistic - high + 1  # sizes the model promised that failed
            if sharp and miss <= 2:  # off by one or two, as allocator rounding does
                return max(high - miss, middle) * step
            return middle * step  # proven wrong beyond that: bisect
        target = self._cap(state, optimistic * step) // step
        if target <= low:  # the model says we are there: verify, growing the step if it misled
            index = low + max(1, low - target, 2 * self._misled_step(state, capacity))
            return (index if middle is None else min(index, middle)) * step
        if sharp:
            return target * step
        if fit.bent:  # the slope may be too small: land well short, past the bend
            return max(low + 1, low + 3 * (target - low) // 4) * step
        sharpening = self._sharpening_size(fit, exact) if fit.straight else None
        if sharpening is not None:  # on the grid, and where the model says it surely fits
            index = -(-sharpening // step)
            if low < index <= min(target, math.floor(exact - spread) // step):
                return index * step
        if spread * 4 > exact - fit.high:  # the slope is mostly noise: a geometric step
            return max(low + 1, math.isqrt(max(low, 1) * target)) * step
        # Land below every candidate, and at least an eighth of the way back: it surely fits
        # and lengthens the fit's baseline, so that the next prediction is sharp.
        center = min(math.floor(exact) // step, target)
        aim = min(math.floor(exact - spread) // step, center - (center - low) // 8)
        return max(low + 1, aim) * step

    def _sharpening_size(self, fit: _Fit, exact: float) -> int | None:
        """The smallest size that, if its peak lands on the line, makes the next prediction
        sharp (``None`` if no size does).

        Probing ``x`` stretches the fit's baseline to ``x``, so the next spread is
        ``error * (1 + 2 * (exact - x) / (x - fit.low)) / per_sample``: solved for the
        smallest ``x`` with a spread under :data:`_SHARP_SPREAD`, with the rounding error of
        any point if that is small enough, else with the smaller error of one more point on
        the line. Every size tried below the answer costs its samples, so the cheapest size
        that makes the next prediction sharp beats one just below the prediction.
        """
        for error in (
            max(float(self.granularity_bytes), fit.residual),
            self._error(replace(fit, count=fit.count + 1)),
        ):
            relative = error / fit.model.per_sample
            if relative < _SHARP_SPREAD:
                bound = (2 * relative * exact + (_SHARP_SPREAD - relative) * fit.low) / (
                    _SHARP_SPREAD + relative
                )
                return max(math.floor(bound) + 1, fit.low + 1)
        return None

    def _cap(self, state: SearchState, size: int) -> int:
        """``size`` limited to ``max_growth`` times the largest fit and to ``max_size``."""
        if state.largest_fit is not None:
            size = min(size, state.largest_fit * self.max_growth)
        return size if state.max_size is None else min(size, state.max_size)

    def _misled_step(self, state: SearchState, capacity: int) -> int:
        """The last step in grid steps if it fit where the model before it said it would fail."""
        last = state.trials[-1]
        earlier = [t.size for t in state.trials[:-1] if t.fits]
        if not last.fits or not earlier:
            return 0
        points, straight = _binding(state.trials[:-1], capacity)
        fit = self._fit(state, points, straight) if points else None
        if fit is None:
            return 0
        exact, spread = self._predict(fit, capacity)
        if math.floor(exact + spread) >= last.size:
            return 0
        return (last.size - max(earlier)) // state.multiple_of

    def _predict(self, fit: _Fit, capacity: int) -> tuple[float, float]:
        """Where the line meets capacity, and by how many sizes that may be off.

        Each measured peak may be off by ``granularity_bytes`` (or the fit's worst residual);
        extrapolating beyond the fitted sizes multiplies that.
        """
        model = fit.model
        exact = (capacity - model.fixed) / model.per_sample
        if not math.isfinite(exact) or exact > UNBOUNDED_MAX_SIZE:
            return float(UNBOUNDED_MAX_SIZE), 0.0
        error = self._error(fit)
        if fit.high > fit.low:
            error *= 1 + 2 * max(0.0, exact - fit.high) / (fit.high - fit.low)
        return exact, error / model.per_sample

    def _error(self, fit: _Fit) -> float:
        """How far a fitted point may be off its line: the allocator's rounding, or the fit's
        worst residual.

        Where a sample adds so few bytes that rounding alone keeps every prediction from being
        sharp, one part's points (a straight line, not a curve that may bend) that grow by a
        whole number of blocks per sample, three or more of them much closer to their line
        than rounding would put them, are taken to be rounded alike at every size: the error
        shrinks, to an eighth of the rounding at the least.
        """
        granularity = float(self.granularity_bytes)
        per_sample = fit.model.per_sample
        blocks = round(per_sample / granularity) if granularity else 0
        if (
            fit.straight
            and fit.count >= 3
            and granularity >= _SHARP_SPREAD * per_sample  # rounding is as large as a sample
            and blocks >= 1
            and abs(per_sample - blocks * granularity) <= 0.5  # whole blocks per sample
        ):
            granularity = min(granularity, max(granularity / 8, 4 * fit.residual))
        return max(granularity, fit.residual)


@dataclass(frozen=True)
class Predicted:
    """Trust a predicted size: probe ``start``, then let the trial settle it.

    After a failure the size below is tried, so a prediction one size too high is proven
    exact in two trials; if that fails too, 3 (or 3%) then 7 (or 7%) below the prediction,
    then the geometric middle of what is left, until one fits. After the first fit, with a ``prior`` and a
    measured peak: the size where the line from the prior's fixed bytes through that peak
    meets the capacity (the size above, when that is the one that fit); if that fits and
    nothing failed yet, the size above it.
    The prior's fixed bytes (weights, optimizer state) are taken as right and its slope as a
    guess, so a prediction that was low by a few sizes costs one more trial. From then on (or
    without a ``start``), ``fallback`` chooses.

    Under a caching allocator (``caching=True``) no line of allocated bytes meets the capacity
    where the segments run out: a prediction that fit is proven by the size above it, and one
    that failed goes to ``fallback`` at once (whose replay of the allocator needs two sizes
    that fit, not a walk down from the prediction).

    >>> from autobatch._search import search
    >>> search(lambda n: Trial(n, fits=n <= 41), start=42, policy=Predicted()).sizes
    (42, 41)
    >>> search(lambda n: Trial(n, fits=n <= 30), start=42, policy=Predicted()).sizes
    (42, 41, 39, 35, 5, 13, 24, 29, 32, 30, 31)
    >>> peak = lambda n: 1_000_000 + 10_000 * n  # bytes
    >>> probe = lambda n: Trial(n, fits=peak(n) <= 2_000_000, peak_bytes=peak(n))
    >>> guess = LinearModel(1_000_000, 11_000)  # the slope 10% off
    >>> search(probe, capacity_bytes=2_000_000, start=90, prior=guess, policy=Predicted()).sizes
    (90, 100, 101)

    Args:
        fallback: the policy after the first two trials, or after a failure below them.
    """

    fallback: ModelGuided = ModelGuided()
    caching: bool = False

    def next_size(self, state: SearchState) -> int:
        if state.start is None or not state.trials:
            return self.fallback.next_size(state)
        step = state.multiple_of
        if self.caching:
            if len(state.trials) == 1 and state.trials[0].fits:
                return state.trials[0].size + step
            return self.fallback.next_size(state)
        if state.largest_fit is None:  # every trial failed: the prediction was high
            misses = len(state.trials)
            if misses > 3:  # by far: halve the bracket, geometrically
                midpoint = state.midpoint()
                assert midpoint is not None  # a failure bounds the bracket
                return midpoint
            first = state.trials[0].size
            return first - max((1 << misses) - 1, first * ((1 << misses) - 1) // 100) * step
        prior, capacity = state.prior, state.capacity_bytes
        if prior is None or capacity is None:
            return self.fallback.next_size(state)
        fits = [t for t in state.trials if t.fits]
        last = state.trials[-1]
        if len(fits) == 1 and last.fits and (last.peak_bytes or 0) > prior.fixed:
            # the first fit: where the line from the fixed bytes through its peak ends
            assert last.peak_bytes is not None
            secant = LinearModel(prior.fixed, (last.peak_bytes - prior.fixed) / last.size)
            return max(secant.largest_within(capacity), last.size + step)
        if len(fits) == 2 and last.fits and state.smallest_fail is None:
            return last.size + step  # the line's size fit: does the next one?
        return self.fallback.next_size(state)


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


def extrapolate(
    trials: Sequence[Trial], capacity_bytes: int, *, granularity_bytes: int = 512
) -> tuple[int, LinearModel | None]:
    """The largest size that the trials' parts (their lines, see :func:`binding_points`) put
    surely within ``capacity_bytes``, and the line of the part that binds there: for sizes no
    probe can run (a plan from small real steps). Surely: the pessimistic end of the spread
    that :class:`ModelGuided` allows each measured peak (``granularity_bytes``, or the fit's
    residual) over the extrapolation, so that rounding never makes the size too large.
    ``(UNBOUNDED_MAX_SIZE, None)`` when no part grows with the size.

    >>> parts = lambda n: (1_000_000 + 4_096 * n, 3_000_000 + 1_024 * n)
    >>> trials = [Trial(n, True, max(parts(n)), parts=parts(n)) for n in (2, 8, 32)]
    >>> extrapolate(trials, 9_000_000)[0]  # the first part's line reaches it at 1953.1
    1936

    Args:
        trials: fitting trials with measured peaks (and parts or phases).
        capacity_bytes: the budget the peaks must stay within.
        granularity_bytes: how far a measured peak may be off (allocator rounding).
    """
    check_int("capacity_bytes", capacity_bytes, minimum=1)
    points, straight = _binding(trials, capacity_bytes)
    if len({size for size, _ in points}) < 2:
        raise ValueError("extrapolate needs fitting trials at two sizes or more, with peaks")
    found = _fit(points, 8.0 * granularity_bytes)
    if found is None:
        return UNBOUNDED_MAX_SIZE, None
    policy = ModelGuided(granularity_bytes=granularity_bytes)
    exact, spread = policy._predict(replace(found, straight=straight), capacity_bytes)
    return max(0, min(math.floor(exact - spread), UNBOUNDED_MAX_SIZE)), found.model
