"""The search engine: the bracket, the loop over a probe, and the recommended size."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from autobatch._search._model import (
    LinearModel,
    Trial,
    Verdicts,
    binding_points,
    fit_linear,
    trusted_curve,
)
from autobatch._search._policies import (
    ModelGuided,
    SearchOutcome,
    SearchPolicy,
    SearchState,
    _Bracket,
)
from autobatch._validate import check_int

logger = logging.getLogger("autobatch.search")


def search(
    probe: Callable[[int], Trial],
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

    Trials, with the default policy: with a probe's own exact curve (see :class:`Trial`)
    4, one of them failing, however little a sample adds; with peak statistics on an affine
    curve (also one whose first size bends, with 512-byte rounding) 4 or 5, one of them
    failing; also 4 or 5 on a bent curve whose straight parts the probe reports (each
    operator's peak, see :class:`Trial`), with at most three times the answer's samples in
    all when each part grows by several 512-byte blocks per sample; without parts, about 9
    when a constant (the optimizer step) sets the peak up to hundreds of samples; with an exact
    ``start`` or ``prior``, 2; without statistics at most ``2*floor(log2(answer)) + 2`` from
    ``min_size=1``. For any monotone probe, any ``start`` and any ``prior``: at most
    ``2*ceil(log2(R)) + 20``, where ``R`` is the number of grid sizes from ``min_size`` up to
    twice the answer (or ``max_size`` if smaller): the guided trials are capped (12), then
    doubling and bisection cost ``2*ceil(log2(R)) + 2``, after at most 6 geometric bisections
    of a far-off failure.

    >>> from autobatch._search import Exponential
    >>> search(lambda n: Trial(n, fits=n <= 37), policy=Exponential()).sizes
    (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)
    >>> peak = lambda n: 2_000_000_000 + 40_000_000 * n  # bytes
    >>> probe = lambda n: Trial(n, fits=peak(n) <= 16_000_000_000, peak_bytes=peak(n))
    >>> outcome = search(probe, capacity_bytes=16_000_000_000)
    >>> outcome.largest_fit, outcome.sizes
    (350, (2, 8, 350, 351))

    Args:
        probe: runs one trial at a size and reports a :class:`Trial`.
        min_size: the smallest size allowed (>= 1).
        max_size: the largest size allowed (e.g. the dataset length); ``None`` for no cap.
        multiple_of: only multiples of this are tried (e.g. 8 for tensor cores).
        capacity_bytes: the memory budget the peaks are compared with; ``None`` disables the model.
        start: a first guess (e.g. from a planner).
        prior: a memory model predicted offline; with ``capacity_bytes`` it picks the first size.
        policy: how sizes are chosen; default :class:`ModelGuided`, which falls back to
            :class:`Exponential` without statistics.
    """
    check_int("min_size", min_size, minimum=1)
    check_int("multiple_of", multiple_of, minimum=1)
    if max_size is not None:
        check_int("max_size", max_size, minimum=1)
        if max_size < min_size:
            raise ValueError(f"max_size={max_size} is below min_size={min_size}; raise max_size")
    if capacity_bytes is not None:
        check_int("capacity_bytes", capacity_bytes, minimum=1)
    if start is not None:
        check_int("start", start, minimum=1)
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
            capacity_bytes=allocated_capacity(trials, capacity_bytes),
            start=start,
            prior=prior,
        )
        proposal = chooser.next_size(state)
        if isinstance(proposal, bool) or not isinstance(proposal, int):
            raise TypeError(f"policy {chooser!r} proposed {proposal!r}; it must return an int")
        size = bracket.snap(proposal)
        trial = probe(size)
        if not isinstance(trial, Trial) or trial.size != size:
            raise TypeError(
                f"probe({size}) returned {trial!r}; it must return a Trial of size {size}"
            )
        trials.append(trial)
        bracket.record(size, trial.fits)
        logger.debug(
            "trial %d: size %d %s (peak %s bytes%s)",
            len(trials),
            size,
            "fits" if trial.fits else "fails",
            trial.peak_bytes,
            "" if trial.error is None else f", {trial.error}",
        )
    points = binding_points(trials, allocated_capacity(trials, capacity_bytes))
    return SearchOutcome(bracket.fit, bracket.fail, tuple(trials), fit_linear(points))


def fragmentation(trials: Sequence[Trial], size: int | None = None) -> float:
    """Reserved bytes per allocated byte at the peak (1.0 when no trial reports both): of the
    fitting trial at ``size`` when given and measured, else of the largest fitting trial.

    A caching allocator holds more than its live tensors (cached blocks, segments cut to fit
    earlier requests), and it runs out when its segments do: at this ratio, live tensors run
    out at the capacity divided by it.

    >>> fragmentation([Trial(8, True, 800, reserved_bytes=1000), Trial(16, True, 1500)])
    1.25
    """
    measured = [
        t for t in trials
        if t.fits and t.peak_bytes and t.reserved_bytes is not None and t.reserved_bytes > 0
    ]
    if not measured:
        return 1.0
    at = [t for t in measured if t.size == size]
    chosen = at[-1] if at else max(measured, key=lambda t: t.size)
    return max((chosen.reserved_bytes or 0) / (chosen.peak_bytes or 1), 1.0)


def allocated_capacity(trials: Sequence[Trial], capacity_bytes: int | None) -> int | None:
    """The capacity as the trials' allocated peaks see it: ``capacity_bytes`` divided by the
    :func:`fragmentation` the largest fitting trial measured (itself without one).

    >>> allocated_capacity([Trial(8, True, 800, reserved_bytes=1000)], 10_000)
    8000
    """
    if capacity_bytes is None:
        return None
    return max(math.floor(capacity_bytes / fragmentation(trials)), 1)


def recommend(
    outcome: SearchOutcome,
    *,
    capacity_bytes: int | None = None,
    headroom: float = 0.0,
    multiple_of: int = 1,
    min_size: int = 1,
    probe: Callable[[int], Trial] | None = None,
    reserved_bytes: int = 0,
    max_probes: int = 6,
    prior: LinearModel | None = None,
) -> int:
    """The largest grid size at most ``outcome.largest_fit`` that leaves ``headroom`` of memory free.

    ``headroom=0`` is ``largest_fit`` itself (on the grid). Otherwise, with measured peaks and
    ``capacity_bytes``, the target is a peak of at most ``(1 - headroom) * capacity_bytes -
    reserved_bytes``; where trials report the caching allocator's reserved peak
    (``Trial.reserved_bytes``), that peak is held to the target, not the allocated one, so the
    headroom comes on top of the fragmentation measured (and the lines of allocated peaks aim
    at the target divided by it, see :func:`fragmentation`): the size is predicted by the line of the part (see :func:`binding_points`)
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
        prior: a memory model predicted before the search (see :func:`search`): its slope,
            through the largest measured peak, predicts the size when the trials measured
            one size only (a ``start`` proven in two trials).
    """
    check_int("multiple_of", multiple_of, minimum=1)
    check_int("min_size", min_size, minimum=1)
    check_int("reserved_bytes", reserved_bytes, minimum=0)
    check_int("max_probes", max_probes, minimum=0)
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
    return _Settling(trials, target, smallest, top, multiple_of, prior).run(probe, max_probes)


class _Settling:
    """:func:`recommend`'s measured search: the largest grid size whose peak is within a target,
    between the sizes measured within it and those measured above it."""

    def __init__(
        self, trials: list[Trial], target: int, smallest: int, top: int, step: int,
        prior: LinearModel | None = None,
    ) -> None:
        self.trials = trials
        self.target = target
        self.smallest, self.top, self.step = smallest, top, step
        self.prior = prior

    def bounds(self) -> tuple[int | None, int]:
        """(largest grid size measured within the target, smallest size known above it)."""
        within: int | None = None
        above = self.top + self.step
        for t in self.trials:
            held = t.peak_bytes if t.reserved_bytes is None else t.reserved_bytes
            over = not t.fits or (held is not None and held > self.target)
            if over:
                above = min(above, t.size)
            elif t.peak_bytes is not None and t.size % self.step == 0 and t.size <= self.top:
                within = t.size if within is None else max(within, t.size)
        return within, above

    def predict(self) -> int | None:
        """The largest size the parts' lines put within the target (``None``: no line)."""
        # The lines are of allocated peaks; the target is of reserved memory, where a caching
        # allocator reports it: they meet at the target less the fragmentation measured.
        target = max(math.floor(self.target / fragmentation(self.trials)), 1)
        points = binding_points(self.trials, target)
        model = fit_linear(points)
        if model is None and self.prior is not None and len({n for n, _ in points}) == 1:
            size, peak = max(points)  # one size measured: the prior's slope through its peak
            model = LinearModel(peak - self.prior.per_sample * size, self.prior.per_sample)
        if model is None:
            return None
        return model.largest_within(target)

    def replayed(self) -> int | None:
        """The largest grid size whose reserved peak is within the target in the caching
        allocator's replay (a trusted :class:`Verdicts` curve: segments and pools, which the
        lines of allocated peaks do not see); ``None`` without one."""
        curve = trusted_curve(self.trials, self.target)
        if not isinstance(curve, Verdicts):
            return None

        def within(n: int) -> bool:
            try:
                reserved = curve.reserved_at(n)
            except (ArithmeticError, ValueError):
                return False
            return reserved is not None and reserved <= self.target

        low, high = self.smallest - self.step, self.top + self.step  # within, above
        while high - low > self.step:  # (reserved memory grows with the size)
            middle = max((low + high) // 2 // self.step * self.step, low + self.step)
            low, high = (middle, high) if within(middle) else (low, middle)
        return low if low >= self.smallest else None

    def run(self, probe: Callable[[int], Trial] | None, max_probes: int) -> int:
        misses = 0
        replayed = self.replayed()
        for probes in range(max_probes + 1):  # (each pass that goes on probed once)
            within, above = self.bounds()
            lower = self.smallest - self.step if within is None else within
            if above - lower <= self.step:
                break
            predicted = replayed if replayed is not None and misses == 0 else self.predict()
            # the lines misled twice (or there are none): bisect
            bisecting = predicted is None or misses >= 2
            guess = (lower + above) // 2 if predicted is None or bisecting else predicted
            size = min(max(guess // self.step * self.step, lower + self.step), above - self.step)
            if probe is None:
                return size
            if (within is not None and size <= within) or probes == max_probes:
                break
            trial = probe(size)
            self.trials.append(trial)
            held = trial.peak_bytes if trial.reserved_bytes is None else trial.reserved_bytes
            if not trial.fits or (held or 0) > self.target:
                misses += 1
            elif not bisecting or trial.peak_bytes is None:
                return size  # within the target (or unmeasured: trusted); the lines aimed at the largest
            # (a bisection's size within the target raises the lower bound: the search goes on)
        within, _ = self.bounds()
        return self.smallest if within is None else within
