"""The trial record and memory models fitted to trials: pure, no torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from autobatch._units import format_bytes
from autobatch._validate import check_int

#: The largest size ever probed when ``max_size`` is ``None``: a probe that never fails ends here.
UNBOUNDED_MAX_SIZE = 2**62

_MAX_FIT_POINTS = 8  # the fit uses the fitting trials at the largest sizes only
_FIT_TOLERANCE_BYTES = 4096.0  # how far fit_linear lets a point sit from its line by default
_SHARP_SPREAD = 0.45  # a spread (in sizes) under 1/2 leaves at most two candidates: sharp


@dataclass(frozen=True)
class Trial:
    """One trial at one size: the record every part of autobatch shares.

    A probe returns one for the size it was asked (:func:`search` keeps it as it is); the
    finder's results list them.

    >>> Trial(64, fits=False, error="oom")
    Trial(size=64, fits=False, peak_bytes=None, seconds=0.0, error='oom')
    >>> print(Trial(64, True, 3 * 2**20, 0.25))
    batch     64: fits, peak 3.00 MiB, 0.25 s

    Args:
        size: the size tried.
        fits: whether the trial ran to completion.
        peak_bytes: its measured peak memory (fitting trials); ``None`` when the device keeps no
            statistics.
        seconds: how long it took (0 when not timed).
        error: a short kind for a failure, e.g. ``"cuda_allocator"`` or
            ``"size_limit:int32_index"``.
        parts: the peaks of the step's parts in order (e.g. one per operator it ran), whose
            maximum is ``peak_bytes``. Each part is fitted on its own: the step's curve is the
            maximum of their lines, which bends where another part starts to set the peak.
        phases: coarser parts (e.g. forward and backward, then the optimizer step), used when
            the trials' ``parts`` do not line up (a different number of them at another size).
        curve: the probe's own prediction of the peak at any size, when it can make one (e.g.
            from every storage's size and the allocator's rounding, which a line through the
            peaks cannot follow where a sample adds less than a block). The search uses it
            while it gives every measured peak exactly and every failed size above capacity.
        reserved_bytes: the peak of the memory the device's caching allocator held (its segments,
            in use or cached), when it reports one: what really runs out. ``peak_bytes`` is the
            peak of live tensors; the ratio of the two is the fragmentation the trial measured.
        steps: how many steps the trial ran: more than asked when the reserved memory still
            grew from one step to the next (it stops at a steady state, or a cap).
    """

    size: int
    fits: bool
    peak_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    # measurement detail: neither compared nor shown (nor stored by the cache)
    parts: tuple[int, ...] = field(default=(), compare=False, repr=False)
    phases: tuple[int, ...] = field(default=(), compare=False, repr=False)
    curve: Callable[[int], int] | None = field(default=None, compare=False, repr=False)
    reserved_bytes: int | None = field(default=None, repr=False)
    steps: int = field(default=1, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_int("Trial.size", self.size, minimum=1)
        check_int("Trial.steps", self.steps, minimum=1)
        if self.reserved_bytes is not None:
            check_int("Trial.reserved_bytes", self.reserved_bytes, minimum=0)
        if not isinstance(self.fits, bool):
            raise TypeError(f"Trial.fits must be a bool, got {self.fits!r}")
        if self.peak_bytes is not None:
            check_int("Trial.peak_bytes", self.peak_bytes, minimum=0)
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"Trial.error must be a str or None, got {self.error!r}")

    def __str__(self) -> str:
        verdict = "fits" if self.fits else f"OOM ({self.error})"
        peak = "" if self.peak_bytes is None else f", peak {format_bytes(self.peak_bytes)}"
        if self.reserved_bytes is not None:
            peak += f" (reserved {format_bytes(self.reserved_bytes)}, {self.steps} steps)"
        return f"batch {self.size:>6}: {verdict}{peak}, {self.seconds:.2f} s"


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


#: What a :class:`Verdicts` curve gives at a size that does not fit, whatever the capacity.
OUT_OF_MEMORY = 1 << 62


class Verdicts:
    """A probe's curve that knows which sizes fit, not only their peaks (a caching
    allocator's replay: there a size fails where a segment runs out, which no peak tells):
    the peak at a size that fits, :data:`OUT_OF_MEMORY` at one that does not. Each size is
    worked out once. Fitting need not be monotone there (a size fails where its tensors just
    pass a pool's threshold, and a larger one fits): the largest that fits is looked for below
    its ``ceiling``, above which nothing can. ``peaks(n)`` gives the allocated and reserved
    peaks at ``n``, or ``None`` where ``n`` does not fit. Curves that are one function (the
    same storages replayed through the same allocator, from later trials) may share what is
    worked out: ``known``, a dict from size to ``peaks(size)``, read and filled by each.

    >>> curve = Verdicts(lambda n: (100 * n, 128 * n) if n <= 7 else None)
    >>> curve(7), curve(8) == OUT_OF_MEMORY, curve.peak_at(8), curve.reserved_at(7)
    (700, True, None, 896)
    """

    def __init__(
        self, peaks: Callable[[int], tuple[int, int] | None], ceiling: int | None = None,
        floor: int | None = None, known: dict[int, tuple[int, int] | None] | None = None,
        approximate: bool = False,
    ) -> None:
        self._peaks = peaks
        #: Worked out from storages whose bytes are not a line in the size (shapes that
        #: depend on the data): it aims the search, and never stands for a trial.
        self.approximate = approximate
        self._known: dict[int, tuple[int, int] | None] = {} if known is None else known
        #: No size above this fits (``None``: unknown).
        self.ceiling = ceiling
        #: The smallest size whose trial it was worked out from: a smaller one may run another
        #: graph (a branch taken above some rows), which it does not speak for (``None``: any).
        self.floor = floor

    def _at(self, n: int) -> tuple[int, int] | None:
        if n not in self._known:
            self._known[n] = self._peaks(n)
        return self._known[n]

    def peak_at(self, n: int) -> int | None:
        """The allocated peak at ``n``, or ``None`` when ``n`` does not fit."""
        found = self._at(n)
        return None if found is None else found[0]

    def reserved_at(self, n: int) -> int | None:
        """The reserved peak at ``n`` (the allocator's segments), or ``None`` when ``n`` does
        not fit."""
        found = self._at(n)
        return None if found is None else found[1]

    def __call__(self, n: int) -> int:
        peak = self.peak_at(n)
        return OUT_OF_MEMORY if peak is None else peak


#: How far a caching allocator's replay may put the measured peaks and still guide the search
#: (``trusted_curve(..., tolerance=REPLAY_TOLERANCE)``).
REPLAY_TOLERANCE = 0.01


def trusted_curve(
    trials: Sequence[Trial], capacity_bytes: int | None, *, tolerance: float = 0.0
) -> Callable[[int], int] | None:
    """The latest curve a probe reported (see :class:`Trial`), if it gives every fitting
    trial's peak exactly and puts every failed size above ``capacity_bytes``; else ``None``.
    A caching allocator's replay answers for the trials from its ``floor`` up only (the
    sizes of the two trials it was worked out from: a smaller size may take another branch
    of the model, another graph).

    With a ``tolerance`` (a share of each peak), a caching allocator's replay (a
    :class:`Verdicts` curve only) whose peaks are that close is taken too: not exact (a storage
    that is not quite a line in the size, an LSTM's, is off by a few blocks), but where it says
    sizes stop fitting it is the best guide there is, and every size it proposes is still tried.
    A replay drawn through storages that are no line at all (``approximate``: the rows a router
    sends each expert) is taken only so.

    >>> line = lambda n: 1000 + 512 * n
    >>> trials = [Trial(2, True, line(2)), Trial(8, True, line(8), curve=line)]
    >>> trusted_curve(trials, 10_000) is line, trusted_curve([*trials, Trial(17, False)], 10_000)
    (True, None)
    """
    if capacity_bytes is None:
        return None
    curve = next((t.curve for t in reversed(trials) if t.curve is not None), None)
    if curve is None or (tolerance and not isinstance(curve, Verdicts)):
        return None
    if not tolerance and isinstance(curve, Verdicts) and curve.approximate:
        return None  # (its verdicts are a guess: every size it proposes is tried)
    floor = curve.floor if isinstance(curve, Verdicts) else None
    try:
        for trial in trials:
            if floor is not None and trial.size < floor:
                continue  # (another graph, maybe: checked by its own trials above the floor)
            if trial.fits and trial.peak_bytes is not None and (
                abs(curve(trial.size) - trial.peak_bytes) > tolerance * trial.peak_bytes
            ):
                return None
            if not trial.fits and trial.error is not None and "size_limit" in trial.error:
                continue  # not a matter of memory: the curve cannot say
            if not trial.fits and (
                curve.peak_at(trial.size) is not None if isinstance(curve, Verdicts)
                else curve(trial.size) <= capacity_bytes
            ):
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
