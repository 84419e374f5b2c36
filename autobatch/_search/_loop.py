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
    _highest_verdict,
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
    monotone (if a size fits, every smaller one does), except where the probe reports a caching
    allocator's replay (:class:`Verdicts`) that gives every trial's peak: sizes it says fit
    above a failure (an island above a gap of the fit map) are tried too, the largest first.
    The answer is exact: it was probed and fit, and the next grid size up was probed and
    failed, or that replay says it fails (``SearchOutcome.replayed``), or it is beyond
    ``max_size``. No size is probed twice or off the grid, and the same probe gives the same
    sequence of sizes.

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
    replayed: list[int] = []
    while True:
        island = _island_above(trials, bracket, capacity_bytes)
        if island is not None:  # (tried at once: the sizes below it no longer matter)
            if _probed(probe, island, trials).fits:  # (else the replay is no longer trusted)
                bracket.fit = island  # the bracket opens again above it
                bracket.fail = min(
                    (t.size for t in trials if not t.fits and t.size > island), default=None)
            continue
        if bracket.closed:
            break
        _narrow(bracket, trials, replayed, probe, chooser, capacity_bytes, max_size, start, prior)
    points = binding_points(trials, allocated_capacity(trials, capacity_bytes))
    return SearchOutcome(
        bracket.fit, bracket.fail, tuple(trials), fit_linear(points), tuple(replayed))


def _narrow(
    bracket: _Bracket, trials: list[Trial], replayed: list[int], probe: Callable[[int], Trial],
    chooser: SearchPolicy, capacity_bytes: int | None, max_size: int | None,
    start: int | None, prior: LinearModel | None,
) -> None:
    """One size the policy proposes inside the open bracket: a trial, or the replay's verdict
    (``replayed``) for the size right above the largest fit."""
    multiple_of = bracket.step
    if not bracket.closed:
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
        if _replay_fails(trials, size, bracket, allocated_capacity(trials, capacity_bytes)):
            bracket.record(size, False)  # (no trial: the replay that gave every peak says so)
            replayed.append(size)
            logger.debug("size %d fails in the allocator's replay: not run", size)
            return
        bracket.record(size, _probed(probe, size, trials).fits)


def _probed(probe: Callable[[int], Trial], size: int, trials: list[Trial]) -> Trial:
    """``probe(size)``, checked, appended to ``trials`` and logged."""
    trial = probe(size)
    if not isinstance(trial, Trial) or trial.size != size:
        raise TypeError(f"probe({size}) returned {trial!r}; it must return a Trial of size {size}")
    trials.append(trial)
    logger.debug(
        "trial %d: size %d %s (peak %s bytes%s)", len(trials), size,
        "fits" if trial.fits else "fails", trial.peak_bytes,
        "" if trial.error is None else f", {trial.error}",
    )
    return trial


def _island_above(trials: list[Trial], bracket: _Bracket, capacity_bytes: int | None) -> int | None:
    """A size above the bracket's failure that a caching allocator's trusted replay
    says fits (the largest such, not tried yet): an island of fitting sizes above a gap,
    where the caching allocator's fit map is not monotone; ``None`` where there is none."""
    if bracket.fit is None or bracket.fail is None:
        return None
    curve = trusted_curve(trials, allocated_capacity(trials, capacity_bytes))
    if not isinstance(curve, Verdicts) or curve.ceiling is None or (curve.floor or 0) > bracket.fit:
        return None
    top = min(curve.ceiling, bracket.last) // bracket.step * bracket.step
    island = _highest_verdict(curve, bracket.fail, top, bracket.step)
    if island is None or island <= bracket.fail or any(t.size == island for t in trials):
        return None
    return island


def _replay_fails(
    trials: Sequence[Trial], size: int, bracket: _Bracket, capacity_bytes: int | None
) -> bool:
    """Whether ``size``, the grid size right above the largest fit, is known to fail without
    a trial: a caching allocator's replay that gave every trial's peak exactly (and every
    failure) from its floor up says it runs out of memory there. The largest fit itself is
    always a trial's."""
    if bracket.fit is None or size != bracket.fit + bracket.step:
        return False
    curve = trusted_curve(trials, capacity_bytes)
    return isinstance(curve, Verdicts) and (curve.floor or 0) <= bracket.fit and (
        curve.peak_at(size) is None)


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
    headroom: float = 0.0,
    multiple_of: int = 1,
    min_size: int = 1,
    probe: Callable[[int], Trial] | None = None,
    max_probes: int = 4,
    capacity_bytes: int | None = None,
) -> int:
    """The recommended size: the largest grid size at most ``(1 - headroom)`` times
    ``outcome.largest_fit`` that trains.

    ``headroom`` is a share of the largest size that trains, the meaning it has everywhere in
    autobatch (the finder, the per-length tables, the planner, the guard's pieces): memory
    that grows with the batch grows with its rows, so a tenth fewer rows than the largest
    leave about a tenth of the batch's own memory unused, whatever the model's fixed state and
    the allocator's segments hold. (A share of the device cannot say that: under a caching
    allocator even one row may reserve most of it.) ``headroom=0`` is ``largest_fit`` itself.

    With a ``probe`` the size is proven: a size measured fitting is returned as it is, one not
    measured is probed, and one that fails (a fit map with gaps below the largest) is bisected
    downwards, between the largest size known to fit below it and it, with at most
    ``max_probes`` probes. Where the trials carry a caching allocator's replay that agrees with
    them (``capacity_bytes`` given, see :func:`trusted_curve`), the size probed is the one the
    replay says fits nearest the computed one: the largest down to ``1 - 1.5 * headroom``
    times the largest fit, else the smallest above it (an island of fitting sizes below the
    largest: a size there keeps most of the memory, where the sizes below the gap would
    not), else the largest below; a gap the replay sees costs no trial. Without one, the
    size is returned as computed. Always on the grid, never below the smallest grid size and
    never above ``largest_fit``.

    >>> found = SearchOutcome(largest_fit=100, smallest_fail=101, trials=(), model=None)
    >>> recommend(found, headroom=0.1, multiple_of=8)
    88

    Args:
        outcome: a search result with a fitting size.
        headroom: the share of the largest size left unused, in ``[0, 1)``.
        multiple_of: the grid step.
        min_size: the smallest size allowed.
        probe: the search's probe, to prove the size (e.g. ``find``'s trial runner); ``None``
            trusts the arithmetic.
        max_probes: the most sizes probed.
        capacity_bytes: the memory the trials' replay is judged against (``None``: no replay).
    """
    check_int("multiple_of", multiple_of, minimum=1)
    check_int("min_size", min_size, minimum=1)
    check_int("max_probes", max_probes, minimum=0)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    largest = outcome.largest_fit
    if largest is None:
        raise ValueError("outcome has no fitting size (largest_fit is None); nothing to recommend")
    step = multiple_of
    smallest = -(-min_size // step) * step
    top = largest // step * step
    if top < smallest:
        raise ValueError(
            f"largest_fit={largest} is below the smallest grid size {smallest} "
            f"(min_size={min_size}, multiple_of={multiple_of}); pass the search's own grid"
        )
    size = max(smallest, min(math.floor((1 - headroom) * largest) // step * step, top))
    if probe is None or headroom == 0:
        return size
    trials = list(outcome.trials)
    known: dict[int, bool] = {}
    for t in trials:
        known[t.size] = known.get(t.size, True) and t.fits  # (a size that ever failed, failed)
    low = max((n for n, fits in known.items() if fits and n <= size and n % step == 0),
              default=smallest - step)  # the largest known to fit (or below the grid)
    high = size + step  # the smallest known to fail above ``low``, as far as it matters
    replay = trusted_curve(trials, capacity_bytes)
    if isinstance(replay, Verdicts) and size not in known:
        floor = math.floor((1 - NEAR * headroom) * largest) // step * step
        size = _nearest_fit(replay, low, size, top - step, max(floor, low + step), step)
        high = size + step  # (the replay's gap above it is trusted: a fit there ends it)
    probes = 0
    while low < size < high:
        if size not in known:
            if probes == max_probes:
                break
            probes += 1
            known[size] = probe(size).fits
        if known[size] and high == size + step:
            return size  # the computed size trains (the common case)
        if known[size]:
            low = size
        else:
            high = size  # a gap below the largest: bisect between what fits and it
        size = max((low + high) // 2 // step * step, low + step)
    return max(low, smallest)


#: Where the fit map has a gap at the recommended size, a size the replay says fits is looked
#: for down to ``1 - NEAR * headroom`` times the largest, then above the recommended size.
NEAR = 1.5
#: The most sizes the replay is asked on each side (evenly spread over it).
_NEAR_SIZES = 64


def _nearest_fit(replay: Verdicts, low: int, size: int, top: int, floor: int, step: int) -> int:
    """The grid size nearest ``size`` that the replay says fits, where it says ``size`` does
    not (a gap in a caching allocator's fit map): the largest in ``[floor, size)``, else the
    smallest in ``(size, top]`` (an island of fitting sizes below the largest), else the
    largest in ``(low, floor)`` (bisected: the gaps are bands), else ``size``. Each side is
    asked at most :data:`_NEAR_SIZES` sizes, evenly spread."""
    if replay.peak_at(size) is not None:
        return size

    def spread(start: int, stop: int, direction: int) -> range:
        count = (stop - start) * direction // step + 1
        stride = max(1, -(-count // _NEAR_SIZES)) * step
        return range(start, stop + direction, direction * stride)

    for sizes in (spread(size - step, floor, -1), spread(size + step, top, 1)):
        found = next((n for n in sizes if replay.peak_at(n) is not None), None)
        if found is not None:
            return found
    return _replayed(replay, low, min(floor, size), step)


def _replayed(replay: Verdicts, low: int, size: int, step: int) -> int:
    """The largest grid size in ``(low, size]`` the replay says fits (bisected below a size it
    says fails: the gaps of a caching allocator's fit map are bands), else ``size``."""
    if replay.peak_at(size) is not None:
        return size
    high = size
    while high - low > step:
        middle = max((low + high) // 2 // step * step, low + step)
        low, high = (middle, high) if replay.peak_at(middle) is not None else (low, middle)
    return low if low >= step else size
