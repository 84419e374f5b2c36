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
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Protocol

__all__ = [
    "UNBOUNDED_MAX_SIZE",
    "Exponential",
    "LinearModel",
    "ModelGuided",
    "Outcome",
    "SearchOutcome",
    "SearchPolicy",
    "SearchState",
    "Trial",
    "binding_points",
    "extrapolate",
    "fit_linear",
    "recommend",
    "search",
    "trusted_curve",
]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

#: The largest size ever probed when ``max_size`` is ``None``: a probe that never fails ends here.
UNBOUNDED_MAX_SIZE = 2**62

_MAX_FIT_POINTS = 8  # the fit uses the fitting trials at the largest sizes only
_FIT_TOLERANCE_BYTES = 4096.0  # how far fit_linear lets a point sit from its line by default
_SHARP_SPREAD = 0.45  # a spread (in sizes) under 1/2 leaves at most two candidates: sharp


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
    Outcome(fits=True, peak_bytes=3000000, error=None, parts=(), phases=())

    Args:
        fits: whether the trial ran to completion.
        peak_bytes: the trial's measured peak memory (fitting trials); ``None`` when the device
            keeps no statistics.
        error: a short kind for a failure, e.g. ``"oom"`` or ``"size_limit"``.
        parts: the peaks of the step's parts in order (e.g. one per operator it ran), whose
            maximum is ``peak_bytes``. Each part is fitted on its own: the step's curve is the
            maximum of their lines, which bends where another part starts to set the peak.
        phases: coarser parts (e.g. forward and backward, then the optimizer step), used when
            the trials' ``parts`` do not line up (a different number of them at another size).
        curve: the probe's own prediction of the peak at any size, when it can make one (e.g.
            from every storage's size and the allocator's rounding, which a line through the
            peaks cannot follow where a sample adds less than a block). The search uses it
            while it gives every measured peak exactly and every failed size above capacity.
    """

    fits: bool
    peak_bytes: int | None = None
    error: str | None = None
    parts: tuple[int, ...] = ()
    phases: tuple[int, ...] = ()
    curve: Callable[[int], int] | None = field(default=None, compare=False, repr=False)

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
    Trial(size=64, fits=False, peak_bytes=None, error='oom', parts=(), phases=())

    Args:
        size: the size probed.
        fits: whether it fit.
        peak_bytes: its measured peak memory, if any.
        error: the probe's short failure kind, if any.
        parts: the peaks of the step's parts, if the probe measured them.
        phases: the peaks of the step's phases, if the probe measured them.
        curve: the probe's prediction of the peak at any size, if it made one.
    """

    size: int
    fits: bool
    peak_bytes: int | None = None
    error: str | None = None
    parts: tuple[int, ...] = ()
    phases: tuple[int, ...] = ()
    curve: Callable[[int], int] | None = field(default=None, compare=False, repr=False)


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

        Computed exactly (no float rounding at the edge).

        >>> LinearModel(fixed=100.0, per_sample=7.0).largest_within(150)
        7
        """
        if not math.isfinite(budget_bytes):
            raise ValueError(f"budget_bytes must be finite, got {budget_bytes!r}")
        room = (Fraction(budget_bytes) - Fraction(self.fixed)) / Fraction(self.per_sample)
        return max(0, math.floor(room))


@dataclass(frozen=True)
class _Fit:
    """A fitted model and what its uncertainty depends on."""

    model: LinearModel
    low: int  # smallest size used by the fit
    high: int  # largest size used by the fit
    residual: float  # worst absolute residual of the used points, bytes
    bent: bool = False  # the line's smallest point may lie before a bend in the curve
    count: int = 2  # how many sizes the fit used
    straight: bool = False  # the points are one part's (affine by construction), not a whole step's


def _least_squares(xs: Sequence[int], ys: Sequence[int]) -> tuple[float, float]:
    """``(fixed, per_sample)`` of the least-squares line, computed exactly then rounded."""
    count = len(xs)
    x_sum, y_sum = sum(xs), sum(ys)
    sxx = count * sum(x * x for x in xs) - x_sum * x_sum
    sxy = count * sum(x * y for x, y in zip(xs, ys, strict=True)) - x_sum * y_sum
    slope = Fraction(sxy) / sxx
    return float((y_sum - slope * x_sum) / count), float(slope)


def _fit(points: Sequence[tuple[int, int]], tolerance_bytes: float) -> _Fit | None:
    peaks: dict[int, int] = {}
    for size, peak in points:
        peaks[size] = max(peak, peaks.get(size, peak))
    candidates = sorted(peaks)[-_MAX_FIT_POINTS:]
    if len(candidates) < 2:
        return None
    sizes = candidates
    while True:
        ys = [peaks[x] for x in sizes]
        fixed, per_sample = _least_squares(sizes, ys)
        worst = max(abs(y - (fixed + per_sample * x)) for x, y in zip(sizes, ys, strict=True))
        agrees = worst <= tolerance_bytes + 1e-9 * max(ys)
        if (agrees and per_sample > 0) or len(sizes) == 2:
            break
        sizes = sizes[1:]  # the start of a memory curve is the part that bends: drop it first
    if not (per_sample > 0 and math.isfinite(per_sample) and math.isfinite(fixed)):
        return None
    dropped = candidates[: len(candidates) - len(sizes)]
    # Two points left after dropping: the smaller may still belong to the flat start (a constant
    # such as the optimizer step sets the peak there), unless it is off the dropped points' line.
    bent = len(sizes) == 2 and bool(dropped)
    if bent and len(dropped) >= 2:
        (x1, x2), x = dropped[-2:], sizes[0]
        start_slope = (peaks[x2] - peaks[x1]) / (x2 - x1)
        reach = 1 + 2 * (x - x2) / (x2 - x1)  # how much extrapolation widens the tolerance
        bent = abs(peaks[x] - peaks[x2] - start_slope * (x - x2)) <= tolerance_bytes * reach
    return _Fit(LinearModel(fixed, per_sample), sizes[0], sizes[-1], worst, bent, len(sizes))


def fit_linear(
    points: Sequence[tuple[int, int]], *, tolerance_bytes: float = _FIT_TOLERANCE_BYTES
) -> LinearModel | None:
    """Fit ``peak = fixed + per_sample * size`` to measured ``(size, peak_bytes)`` points, robustly.

    Only the points at the largest sizes are used; while a point disagrees with the
    least-squares line by more than ``tolerance_bytes``, the point at the smallest size is
    dropped (real curves are affine except at the start). Returns ``None`` with fewer than two
    distinct sizes or when the line does not grow.

    >>> fit_linear([(1, 5_000_000), (2, 1_200_000), (4, 1_400_000), (8, 1_800_000)])
    LinearModel(fixed=1000000.0, per_sample=100000.0)

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
        if state.smallest_fail is None and state.largest_fit is not None:
            return state.largest_fit * self.factor
        midpoint = state.midpoint()
        return state.min_size if midpoint is None else midpoint


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

    >>> peak = lambda n: 3_000_000_000 + 5_000_000 * n  # bytes
    >>> probe = lambda n: Outcome(fits=peak(n) <= 8_000_000_000, peak_bytes=peak(n))
    >>> search(probe, capacity_bytes=8_000_000_000, policy=ModelGuided()).sizes
    (2, 8, 1000, 1001)

    A bent curve, the maximum of two lines (a large constant, then a steep slope), told apart
    in ``parts``, is as quick as a straight one:

    >>> lines = [(3_200_000, 512), (2_000_000, 5_632)]  # bytes, bytes per sample
    >>> parts = lambda n: tuple(fixed + per_sample * n for fixed, per_sample in lines)
    >>> probe = lambda n: Outcome(fits=max(parts(n)) <= 8_000_000, peak_bytes=max(parts(n)),
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
        curve = trusted_curve(state.trials, capacity)
        if curve is not None:
            return self._curve_size(state, curve, capacity)
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

    def _curve_size(self, state: SearchState, curve: Callable[[int], int], capacity: int) -> int:
        """Where the probe's own curve puts the largest fit: there, or the size above the
        largest fit when that is it (to see the next one fail)."""
        step = state.multiple_of
        low = state.below()
        upper = state.above()
        cap = self._cap(state, UNBOUNDED_MAX_SIZE if upper is None else upper - step)
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


def trusted_curve(
    trials: Sequence[Trial], capacity_bytes: int | None
) -> Callable[[int], int] | None:
    """The latest curve a probe reported (see :class:`Outcome`), if it gives every fitting
    trial's peak exactly and puts every failed size above ``capacity_bytes``; else ``None``.

    >>> line = lambda n: 1000 + 512 * n
    >>> trials = [Trial(2, True, line(2)), Trial(8, True, line(8), curve=line)]
    >>> trusted_curve(trials, 10_000) is line, trusted_curve([*trials, Trial(17, False)], 10_000)
    (True, None)
    """
    if capacity_bytes is None:
        return None
    curve = next((t.curve for t in reversed(trials) if t.curve is not None), None)
    if curve is None:
        return None
    try:
        for trial in trials:
            if trial.fits and trial.peak_bytes is not None and curve(trial.size) != trial.peak_bytes:
                return None
            if not trial.fits and trial.error is not None and "size_limit" in trial.error:
                continue  # not a matter of memory: the curve cannot say
            if not trial.fits and curve(trial.size) <= capacity_bytes:
                return None
    except (ArithmeticError, ValueError):
        return None
    return curve


def _largest_within(
    curve: Callable[[int], int], capacity: int, low: int, high: int, step: int
) -> int:
    """The largest grid size in ``(low, high]`` whose ``curve`` is within ``capacity`` (``low``
    when none is): galloping up from ``low``, then bisecting (the curve grows with the size)."""
    lo, hi = low, None
    gap = step
    while lo + gap <= high:
        if curve(lo + gap) <= capacity:
            lo, gap = lo + gap, gap * 2
        else:
            hi = lo + gap
            break
    if hi is None:
        hi = min(lo + gap, high + step)
    while hi - lo > step:
        middle = (lo + hi) // (2 * step) * step
        middle = min(max(middle, lo + step), hi - step)
        if curve(middle) <= capacity:
            lo = middle
        else:
            hi = middle
    return lo


def binding_points(trials: Sequence[Trial], capacity_bytes: int | None) -> list[tuple[int, int]]:
    """``(size, peak)`` points of the fitting trials: of the part whose own line reaches
    ``capacity_bytes`` first when the trials measured their parts, else of the whole step.

    The step's peak is the maximum of its parts' peaks (one per operator, or per phase), each
    affine in the size; their maximum is a convex curve that bends wherever another part takes
    over, e.g. where the optimizer step's large constant stops setting the peak, or where a
    steeper operator of the backward pass overtakes a flatter one. Fitting each part alone
    keeps every line straight. The trials' ``parts`` are used when every fitting trial has as
    many, else their ``phases``, else the whole peaks.

    >>> trials = [Trial(2, True, 900, parts=(500, 900)), Trial(8, True, 1100, parts=(1100, 906))]
    >>> binding_points(trials, capacity_bytes=5000)
    [(2, 500), (8, 1100)]
    """
    return _binding(trials, capacity_bytes)[0]


def _binding(
    trials: Sequence[Trial], capacity_bytes: int | None
) -> tuple[list[tuple[int, int]], bool]:
    """:func:`binding_points`, and whether they are of the trials' ``parts``: the finest split,
    whose lines are straight (each operator's peak is affine in the size), while a phase's or
    the whole step's curve may still bend."""
    fitting = [t for t in trials if t.fits and t.peak_bytes is not None]
    whole = [(t.size, t.peak_bytes) for t in fitting if t.peak_bytes is not None]
    if capacity_bytes is None or len({t.size for t in fitting}) < 2:
        return whole, False
    for vectors, straight in (
        ([t.parts for t in fitting], True),
        ([t.phases for t in fitting], False),
    ):
        points = _binding_part(fitting, vectors, capacity_bytes)
        if points is not None:
            return points, straight
    return whole, False


def _binding_part(
    fitting: Sequence[Trial], vectors: Sequence[tuple[int, ...]], capacity_bytes: int
) -> list[tuple[int, int]] | None:
    """The points of the part that reaches the capacity first; ``None`` when the parts do not
    line up across the trials or none of them grows."""
    count = len(vectors[0])
    if count == 0 or any(len(vector) != count for vector in vectors):
        return None
    sizes = [t.size for t in fitting]
    best: tuple[float, tuple[int, ...]] | None = None
    # Thousands of parts (one per operator), most of them alike: each distinct series once.
    for series in dict.fromkeys(zip(*vectors, strict=True)):
        reach = _reach(sizes, series, capacity_bytes)
        if reach is not None and (best is None or reach < best[0]):
            best = (reach, series)
    if best is None:  # no part grows with the size: none ever binds
        return None
    return list(zip(sizes, best[1], strict=True))


def _reach(sizes: Sequence[int], peaks: Sequence[int], capacity_bytes: int) -> float | None:
    """Where :func:`fit_linear`'s line through ``(size, peak)`` meets the capacity, in floats
    (fast enough for thousands of parts); ``None`` when the line does not grow."""
    by_size: dict[int, int] = {}
    for size, peak in zip(sizes, peaks, strict=True):
        by_size[size] = max(peak, by_size.get(size, peak))
    xs = sorted(by_size)[-_MAX_FIT_POINTS:]
    ys = [by_size[x] for x in xs]
    if min(ys) == max(ys):  # flat: this part never binds
        return None
    tolerance = _FIT_TOLERANCE_BYTES + 1e-9 * max(ys)
    while True:
        fixed, per_sample = _float_least_squares(xs, ys)
        if len(xs) == 2:
            break
        worst = max(abs(y - fixed - per_sample * x) for x, y in zip(xs, ys, strict=True))
        if worst <= tolerance and per_sample > 0:
            break
        xs, ys = xs[1:], ys[1:]  # as _fit does: drop the smallest size first
    if not per_sample > 0:
        return None
    return (capacity_bytes - fixed) / per_sample


def _float_least_squares(xs: Sequence[int], ys: Sequence[int]) -> tuple[float, float]:
    """``(fixed, per_sample)`` of the least-squares line, in floats, centred (no cancellation)."""
    count = len(xs)
    x_mean, y_mean = sum(xs) / count, sum(ys) / count
    sxx = sum((x - x_mean) ** 2 for x in xs)
    sxy = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True))
    per_sample = sxy / sxx
    return y_mean - per_sample * x_mean, per_sample


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
    _check_int("capacity_bytes", capacity_bytes, minimum=1)
    points, straight = _binding(trials, capacity_bytes)
    if len({size for size, _ in points}) < 2:
        raise ValueError("extrapolate needs fitting trials at two sizes or more, with peaks")
    found = _fit(points, 8.0 * granularity_bytes)
    if found is None:
        return UNBOUNDED_MAX_SIZE, None
    policy = ModelGuided(granularity_bytes=granularity_bytes)
    exact, spread = policy._predict(replace(found, straight=straight), capacity_bytes)
    return max(0, min(math.floor(exact - spread), UNBOUNDED_MAX_SIZE)), found.model


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

    Trials, with the default policy: with a probe's own exact curve (see :class:`Outcome`)
    4, one of them failing, however little a sample adds; with peak statistics on an affine
    curve (also one whose first size bends, with 512-byte rounding) 4 or 5, one of them
    failing; also 4 or 5 on a bent curve whose straight parts the probe reports (each
    operator's peak, see :class:`Outcome`), with at most three times the answer's samples in
    all when each part grows by several 512-byte blocks per sample; without parts, about 9
    when a constant (the optimizer step) sets the peak up to hundreds of samples; with an exact
    ``start`` or ``prior``, 2; without statistics at most ``2*floor(log2(answer)) + 2`` from
    ``min_size=1``. For any monotone probe, any ``start`` and any ``prior``: at most
    ``2*ceil(log2(R)) + 20``, where ``R`` is the number of grid sizes from ``min_size`` up to
    twice the answer (or ``max_size`` if smaller): the guided trials are capped (12), then
    doubling and bisection cost ``2*ceil(log2(R)) + 2``, after at most 6 geometric bisections
    of a far-off failure.

    >>> search(lambda n: Outcome(fits=n <= 37), policy=Exponential()).sizes
    (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)
    >>> peak = lambda n: 2_000_000_000 + 40_000_000 * n  # bytes
    >>> probe = lambda n: Outcome(fits=peak(n) <= 16_000_000_000, peak_bytes=peak(n))
    >>> outcome = search(probe, capacity_bytes=16_000_000_000)
    >>> outcome.largest_fit, outcome.sizes
    (350, (2, 8, 350, 351))

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
        trials.append(
            Trial(
                size, outcome.fits, outcome.peak_bytes, outcome.error, outcome.parts,
                outcome.phases, outcome.curve,
            )
        )
        bracket.record(size, outcome.fits)
        logger.debug(
            "trial %d: size %d %s (peak %s bytes%s)",
            len(trials),
            size,
            "fits" if outcome.fits else "fails",
            outcome.peak_bytes,
            "" if outcome.error is None else f", {outcome.error}",
        )
    points = binding_points(trials, capacity_bytes)
    return SearchOutcome(bracket.fit, bracket.fail, tuple(trials), fit_linear(points))


def recommend(
    outcome: SearchOutcome,
    *,
    capacity_bytes: int | None = None,
    headroom: float = 0.0,
    multiple_of: int = 1,
    min_size: int = 1,
    probe: Callable[[int], Outcome] | None = None,
    reserved_bytes: int = 0,
    max_probes: int = 6,
) -> int:
    """The largest grid size at most ``outcome.largest_fit`` that leaves ``headroom`` of memory free.

    ``headroom=0`` is ``largest_fit`` itself (on the grid). Otherwise, with measured peaks and
    ``capacity_bytes``, the target is a peak of at most ``(1 - headroom) * capacity_bytes -
    reserved_bytes``: the size is predicted by the line of the part (see :func:`binding_points`)
    that reaches that target first, which on a bent curve need not be the part that binds at
    the capacity. With a ``probe`` the prediction is checked: a size whose peak was not
    measured is probed, and one whose peak is above the target is refitted below, so the size
    returned has a measured peak within the target (the smallest grid size when none has; the
    caller can tell from the trials). Without peaks: ``(1 - headroom) * largest_fit`` rounded
    down (or ``outcome.model``'s prediction, when there is one). Always on the grid, never below
    the smallest grid size and never above ``largest_fit``.

    >>> found = SearchOutcome(largest_fit=100, smallest_fail=101, trials=(), model=None)
    >>> recommend(found, headroom=0.1, multiple_of=8)
    88

    Args:
        outcome: a search result with a fitting size.
        capacity_bytes: the memory budget the peaks are compared with.
        headroom: the fraction of capacity to leave free, in ``[0, 1)``.
        multiple_of: the grid step.
        min_size: the smallest size allowed.
        probe: the search's probe, to measure sizes the prediction proposes (e.g. ``find``'s
            trial runner); ``None`` trusts the prediction.
        reserved_bytes: bytes the peaks do not include but the capacity must hold (a plan's
            overhead).
        max_probes: the most sizes probed.
    """
    _check_int("multiple_of", multiple_of, minimum=1)
    _check_int("min_size", min_size, minimum=1)
    _check_int("reserved_bytes", reserved_bytes, minimum=0)
    _check_int("max_probes", max_probes, minimum=0)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    largest = outcome.largest_fit
    if largest is None:
        raise ValueError("outcome has no fitting size (largest_fit is None); nothing to recommend")
    smallest = -(-min_size // multiple_of) * multiple_of
    top = largest // multiple_of * multiple_of
    if top < smallest:
        raise ValueError(
            f"largest_fit={largest} is below the smallest grid size {smallest} "
            f"(min_size={min_size}, multiple_of={multiple_of}); pass the search's own grid"
        )
    if headroom == 0:
        return top  # the exact largest size that fits: it was probed and it fit
    trials = list(outcome.trials)
    measured = any(t.fits and t.peak_bytes is not None for t in trials)
    if capacity_bytes is None or not measured:
        if outcome.model is not None and capacity_bytes is not None:
            size = outcome.model.largest_within((1 - headroom) * capacity_bytes - reserved_bytes)
        else:
            size = math.floor((1 - headroom) * largest)
        return max(smallest, min(size // multiple_of * multiple_of, top))
    target = math.floor((1 - headroom) * capacity_bytes) - reserved_bytes
    return _Settling(trials, target, smallest, top, multiple_of).run(probe, max_probes)


class _Settling:
    """:func:`recommend`'s measured search: the largest grid size whose peak is within a target,
    between the sizes measured within it and those measured above it."""

    def __init__(
        self, trials: list[Trial], target: int, smallest: int, top: int, step: int
    ) -> None:
        self.trials = trials
        self.target = target
        self.smallest, self.top, self.step = smallest, top, step

    def bounds(self) -> tuple[int | None, int]:
        """(largest grid size measured within the target, smallest size known above it)."""
        within: int | None = None
        above = self.top + self.step
        for t in self.trials:
            over = not t.fits or (t.peak_bytes is not None and t.peak_bytes > self.target)
            if over:
                above = min(above, t.size)
            elif t.peak_bytes is not None and t.size % self.step == 0 and t.size <= self.top:
                within = t.size if within is None else max(within, t.size)
        return within, above

    def predict(self) -> int | None:
        """The largest size the parts' lines put within the target (``None``: no line)."""
        points = binding_points(self.trials, max(self.target, 1))
        model = fit_linear(points)
        if model is None:
            return None
        return model.largest_within(self.target)

    def run(self, probe: Callable[[int], Outcome] | None, max_probes: int) -> int:
        misses = 0
        for _ in range(max_probes + 1):
            within, above = self.bounds()
            lower = self.smallest - self.step if within is None else within
            if above - lower <= self.step:
                break
            predicted = self.predict()
            # the lines misled twice (or there are none): bisect
            guess = (lower + above) // 2 if predicted is None or misses >= 2 else predicted
            size = min(max(guess // self.step * self.step, lower + self.step), above - self.step)
            if probe is None:
                return size
            if within is not None and size <= within:
                break
            outcome = probe(size)
            self.trials.append(
                Trial(size, outcome.fits, outcome.peak_bytes, outcome.error, outcome.parts,
                      outcome.phases, outcome.curve)
            )
            if not outcome.fits or (outcome.peak_bytes or 0) > self.target:
                misses += 1
            else:  # within the target (or unmeasured: trusted); the lines aimed at the largest
                return size
        within, _ = self.bounds()
        return self.smallest if within is None else within
