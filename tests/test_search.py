"""Tests for autobatch.search: the pure search engine and its policies."""

from __future__ import annotations

import doctest
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import autobatch.search
from autobatch._search._model import (
    Verdicts,
)
from autobatch._search._policies import _highest_verdict, _replay_contradicted
from autobatch.search import (
    UNBOUNDED_MAX_SIZE,
    Exponential,
    LinearModel,
    ModelGuided,
    SearchOutcome,
    SearchState,
    Trial,
    binding_points,
    fit_linear,
    recommend,
    search,
    trusted_curve,
)

GIB = 2**30
MIB = 2**20


def rounded(value: float, granularity: int) -> int:
    """``value`` rounded up to the allocator's block size, as a measured peak would be."""
    return -(-math.ceil(value) // granularity) * granularity


@dataclass
class Oracle:
    """A monotone probe that counts its calls: fits while ``fits(n)``, reports ``peak(n)`` (and
    ``parts(n)``)."""

    fits: Callable[[int], bool]
    peak: Callable[[int], int] | None = None
    parts: Callable[[int], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> Trial:
        self.calls.append(n)
        if not self.fits(n):
            return Trial(n, fits=False, error="oom")
        return Trial(
            n,
            fits=True,
            peak_bytes=None if self.peak is None else self.peak(n),
            parts=() if self.parts is None or self.peak is None else self.parts(n),
        )


def threshold(limit: int) -> Oracle:
    return Oracle(lambda n: n <= limit)


def memory_oracle(peak: Callable[[int], int], capacity: int, *, stats: bool = True) -> Oracle:
    return Oracle(lambda n: peak(n) <= capacity, peak if stats else None)


def expected_answer(fits: Callable[[int], bool], first: int, last: int, step: int) -> int | None:
    """The exact answer by brute force over grid indices (doubling, then bisection)."""
    if not fits(first):
        return None
    low, high = first // step, last // step + 1
    probe_index = low
    while probe_index < high and fits(probe_index * step):
        low, probe_index = probe_index, probe_index * 2
    high = min(high, probe_index)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * step):
            low = middle
        else:
            high = middle
    return low * step


def grid_count(answer: int | None, first: int, last: int, step: int) -> int:
    """R in the documented bound: grid sizes from the first up to twice the answer."""
    if answer is None:
        return 1
    top = min(last, 2 * answer + step)
    return (top - first) // step + 1


def trial_bound(answer: int | None, first: int, last: int, step: int) -> int:
    """The documented bound for any monotone probe: ``2*ceil(log2(R)) + 20``."""
    return 2 * math.ceil(math.log2(grid_count(answer, first, last, step))) + 20


def check_exact(outcome: SearchOutcome, oracle: Oracle, first: int, last: int, step: int) -> None:
    """The answer is exact, every probe was on the grid, none repeated, and trials are honest."""
    sizes = [trial.size for trial in outcome.trials]
    assert sizes == oracle.calls
    assert len(set(sizes)) == len(sizes)
    assert all(first <= size <= last and size % step == 0 for size in sizes)
    assert all(trial.fits == oracle.fits(trial.size) for trial in outcome.trials)
    assert outcome.largest_fit == expected_answer(oracle.fits, first, last, step)
    if outcome.largest_fit is None:
        assert first in sizes
    else:
        assert outcome.largest_fit in sizes
        above = outcome.largest_fit + step
        assert above > last or (above in sizes and outcome.smallest_fail == above)
    if outcome.smallest_fail is None:
        assert outcome.largest_fit == last
    else:
        assert outcome.smallest_fail == min(t.size for t in outcome.trials if not t.fits)


# --- exact sequences (they pin the algorithm) -------------------------------------------------


def test_exponential_doubles_then_bisects() -> None:
    outcome = search(threshold(37), policy=Exponential())
    assert outcome.sizes == (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)
    assert (outcome.largest_fit, outcome.smallest_fail) == (37, 38)


def test_default_without_capacity_is_exponential_from_min_size() -> None:
    assert search(threshold(37)).sizes == (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)


def test_model_guided_on_an_affine_curve_takes_four_trials() -> None:
    peak = lambda n: 3_000 * MIB + 5 * MIB * n  # noqa: E731
    outcome = search(memory_oracle(peak, 8_000 * MIB), capacity_bytes=8_000 * MIB)
    assert outcome.sizes == (2, 8, 1000, 1001)
    assert outcome.model == LinearModel(fixed=3_000 * MIB, per_sample=5 * MIB)


def test_model_guided_ignores_a_bent_start() -> None:
    # At size 1 a constant (the optimizer step) sets the peak; the search never asks for it.
    peak = lambda n: max(2 * GIB + 30 * MIB * n, 2 * GIB + 45 * MIB)  # noqa: E731
    outcome = search(memory_oracle(peak, 10 * GIB), capacity_bytes=10 * GIB)
    assert outcome.sizes == (2, 8, 273, 274)


def test_a_long_flat_start_costs_a_few_more_trials() -> None:
    # A small MLP trained with Adam: the optimizer step sets the peak up to ~230 samples.
    peak = lambda n: rounded(max(3_207_168 + 512 * n, 2_024_836 + 5_638 * n), 512)  # noqa: E731
    outcome = search(memory_oracle(peak, 6 * MIB), capacity_bytes=6 * MIB)
    assert outcome.sizes == (2, 8, 253, 2804, 842, 547, 703, 756, 757)


@pytest.mark.parametrize(
    ("workspace_mib", "sizes"),
    [(2, (2, 8, 300, 299)), (5, (2, 8, 300, 299, 297, 298))],
)
def test_a_prediction_one_or_two_too_many_steps_down(
    workspace_mib: int, sizes: tuple[int, ...]
) -> None:
    # A workspace that appears only at larger sizes makes the line promise a size or two too many.
    peak = lambda n: GIB + 3 * MIB * n + (workspace_mib * MIB if n > 64 else 0)  # noqa: E731
    capacity = GIB + 3 * MIB * 300
    outcome = search(memory_oracle(peak, capacity), capacity_bytes=capacity)
    assert outcome.sizes == sizes


def test_good_start_takes_two_trials() -> None:
    peak = lambda n: 2 * GIB + 7 * MIB * n  # noqa: E731
    capacity = 2 * GIB + 7 * MIB * 777
    outcome = search(memory_oracle(peak, capacity), capacity_bytes=capacity, start=777)
    assert outcome.sizes == (777, 778)


def test_good_prior_takes_two_trials() -> None:
    peak = lambda n: 2 * GIB + 7 * MIB * n  # noqa: E731
    capacity = 2 * GIB + 7 * MIB * 777 + MIB
    prior = LinearModel(fixed=2 * GIB, per_sample=7 * MIB)
    outcome = search(memory_oracle(peak, capacity), capacity_bytes=capacity, prior=prior)
    assert outcome.sizes == (777, 778)


def test_wrong_prior_is_distrusted_after_it_fails() -> None:
    peak = lambda n: 2 * GIB + 7 * MIB * n  # noqa: E731
    capacity = 2 * GIB + 7 * MIB * 500
    prior = LinearModel(fixed=1 * GIB, per_sample=7 * MIB)  # promises 646
    outcome = search(memory_oracle(peak, capacity), capacity_bytes=capacity, prior=prior)
    assert outcome.sizes == (646, 2, 8, 500, 501)


def test_without_statistics_the_model_falls_back_to_doubling() -> None:
    oracle = Oracle(lambda n: n <= 37)  # reports no peaks
    assert search(oracle, capacity_bytes=GIB).sizes == (2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)


def test_even_the_smallest_size_fails() -> None:
    oracle = Oracle(lambda n: False)
    outcome = search(oracle, min_size=4, multiple_of=4, capacity_bytes=GIB)
    assert outcome.largest_fit is None
    assert outcome.smallest_fail == 4
    assert outcome.trials == (Trial(size=4, fits=False, peak_bytes=None, error="oom"),)


def test_non_memory_failure_at_min_size_is_reported_as_such() -> None:
    outcome = search(lambda n: Trial(n, fits=False, error="size_limit"))
    assert outcome.largest_fit is None
    assert outcome.trials == (Trial(size=1, fits=False, error="size_limit"),)


def test_max_size_that_fits_ends_the_search() -> None:
    outcome = search(Oracle(lambda n: True), max_size=100)
    assert outcome.sizes == (1, 2, 4, 8, 16, 32, 64, 100)
    assert (outcome.largest_fit, outcome.smallest_fail) == (100, None)


def test_a_probe_that_never_fails_stops_at_the_unbounded_cap() -> None:
    outcome = search(Oracle(lambda n: True))
    assert outcome.largest_fit == UNBOUNDED_MAX_SIZE
    assert len(outcome.trials) == 63


def test_a_single_grid_size() -> None:
    assert search(threshold(10), min_size=5, max_size=7, multiple_of=6).sizes == (6,)


def test_policy_proposals_are_snapped_into_the_bracket() -> None:
    class Wild:
        def __init__(self) -> None:
            self.proposals = iter([10**9, -5, 7, 7, 7, 7, 7, 7])

        def next_size(self, state: SearchState) -> int:
            return next(self.proposals)

    oracle = threshold(20)
    outcome = search(oracle, max_size=40, multiple_of=4, policy=Wild())
    check_exact(outcome, oracle, 4, 40, 4)
    assert outcome.sizes == (40, 4, 8, 12, 16, 20, 24)


# --- argument checking ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"min_size": 0}, ValueError, "min_size"),
        ({"min_size": 2.0}, TypeError, "min_size"),
        ({"multiple_of": 0}, ValueError, "multiple_of"),
        ({"multiple_of": True}, TypeError, "multiple_of"),
        ({"max_size": 0}, ValueError, "max_size"),
        ({"min_size": 10, "max_size": 9}, ValueError, "max_size"),
        ({"min_size": 5, "max_size": 7, "multiple_of": 8}, ValueError, "multiple_of"),
        ({"capacity_bytes": 0}, ValueError, "capacity_bytes"),
        ({"capacity_bytes": 1.5}, TypeError, "capacity_bytes"),
        ({"start": 0}, ValueError, "start"),
        ({"prior": (1.0, 2.0)}, TypeError, "prior"),
    ],
)
def test_bad_arguments_name_the_parameter(
    kwargs: dict[str, object], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        search(threshold(5), **kwargs)  # type: ignore[arg-type]


def test_probe_must_return_an_outcome() -> None:
    with pytest.raises(TypeError, match="Trial"):
        search(lambda n: True)  # type: ignore[arg-type,return-value]


def test_policy_must_return_an_int() -> None:
    class Bad:
        def next_size(self, state: SearchState) -> int:
            return 3.5  # type: ignore[return-value]

    with pytest.raises(TypeError, match="int"):
        search(threshold(5), policy=Bad())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"fits": 1}, TypeError),
        ({"fits": True, "peak_bytes": -1}, ValueError),
        ({"fits": True, "peak_bytes": 1.5}, TypeError),
        ({"fits": False, "error": 3}, TypeError),
    ],
)
def test_trial_is_checked(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        Trial(4, **kwargs)  # type: ignore[arg-type]


def test_policies_check_their_options() -> None:
    with pytest.raises(ValueError, match="factor"):
        Exponential(factor=1)
    with pytest.raises(ValueError, match="first_size"):
        ModelGuided(first_size=0)


# --- the memory model -------------------------------------------------------------------------


def test_linear_model_largest_within() -> None:
    model = LinearModel(fixed=0.5, per_sample=0.25)
    assert model.largest_within(1.25) == 3
    assert model.largest_within(1.2499999) == 2
    assert model.largest_within(0.25) == 0
    with pytest.raises(ValueError, match="per_sample"):
        LinearModel(fixed=0.0, per_sample=0.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        model.largest_within(math.inf)


@given(
    fixed=st.floats(-1e12, 1e12),
    per_sample=st.floats(1e-9, 1e12),
    budget=st.floats(0, 1e13),
)
def test_linear_model_largest_within_is_exact(
    fixed: float, per_sample: float, budget: float
) -> None:
    n = LinearModel(fixed, per_sample).largest_within(budget)

    def exact(k: int) -> Fraction:
        return Fraction(fixed) + Fraction(per_sample) * k

    assert n >= 0
    assert n == 0 or exact(n) <= Fraction(budget)
    assert exact(n + 1) > Fraction(budget)


def test_fit_linear_drops_the_bent_start_and_disagreeing_points() -> None:
    points = [
        (1, 9 * GIB),
        (2, 2 * GIB + 2 * MIB),
        (8, 2 * GIB + 8 * MIB),
        (64, 2 * GIB + 64 * MIB),
    ]
    model = fit_linear(points)
    assert model is not None
    assert model.fixed == pytest.approx(2 * GIB)
    assert model.per_sample == pytest.approx(MIB)


def test_fit_linear_needs_two_sizes_and_a_growing_line() -> None:
    assert fit_linear([]) is None
    assert fit_linear([(4, 100), (4, 200)]) is None
    assert fit_linear([(4, 200), (8, 100)]) is None
    assert fit_linear([(4, 100), (4, 300), (8, 500)]) == LinearModel(fixed=100.0, per_sample=50.0)


@given(
    fixed=st.integers(0, 2**40),
    per_sample=st.integers(1, 2**30),
    sizes=st.lists(st.integers(1, 10**6), min_size=2, max_size=12, unique=True),
)
def test_fit_linear_recovers_any_affine_curve(
    fixed: int, per_sample: int, sizes: list[int]
) -> None:
    model = fit_linear([(n, fixed + per_sample * n) for n in sizes])
    assert model is not None
    assert model.per_sample == pytest.approx(per_sample, rel=1e-6)
    top = max(sizes)
    assert model.predict(top) == pytest.approx(fixed + per_sample * top, rel=1e-9)


# --- properties for any monotone probe --------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A probe and the arguments of one search."""

    oracle: Oracle
    min_size: int
    max_size: int | None
    multiple_of: int
    capacity_bytes: int | None
    start: int | None
    prior: LinearModel | None

    def run(self, oracle: Oracle | None = None) -> SearchOutcome:
        return search(
            self.oracle if oracle is None else oracle,
            min_size=self.min_size,
            max_size=self.max_size,
            multiple_of=self.multiple_of,
            capacity_bytes=self.capacity_bytes,
            start=self.start,
            prior=self.prior,
        )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A monotone probe of any shape, a grid, and the search's hints."""
    kind = draw(st.sampled_from(["threshold", "affine", "quadratic", "sqrt", "steps", "unrelated"]))
    answer = draw(st.integers(0, 10**6))
    fixed = draw(st.integers(0, 16 * GIB))
    slope = draw(st.integers(1, 64 * MIB))
    knee = draw(st.sampled_from([0.0, 1.5, 3.0, 40.0]))
    granularity = draw(st.sampled_from([1, 512, 2 * MIB]))
    block = draw(st.integers(1, 500))
    curves: dict[str, Callable[[int], float]] = {
        "threshold": lambda n: fixed + slope * n,
        "unrelated": lambda n: fixed + slope * n,
        "affine": lambda n: fixed + slope * max(float(n), knee),
        "quadratic": lambda n: fixed + slope * n * n / 64,
        "sqrt": lambda n: fixed + slope * 64 * math.sqrt(n),
        "steps": lambda n: fixed + slope * block * math.ceil(n / block),
    }
    curve = curves[kind]

    def peak(n: int) -> int:
        return rounded(curve(n), granularity)

    stats = draw(st.booleans())
    if kind in ("threshold", "unrelated"):
        # The probe fails past `answer` whatever the peaks say (e.g. a size limit).
        capacity = draw(st.integers(1, 2**50))
        oracle = Oracle(lambda n: n <= answer, peak if stats else None)
    else:
        capacity = peak(answer) if answer else max(1, peak(1) - 1)
        oracle = memory_oracle(peak, capacity, stats=stats)
    if draw(st.booleans()):  # also told as parts: the curve itself, and a constant beside it
        oracle.parts = lambda n: (rounded(fixed, granularity), peak(n))
    min_size = draw(st.sampled_from([1, 1, 7, 100]))
    prior = st.builds(LinearModel, st.floats(0, 2**40), st.floats(1e-3, 2**30))
    return Scenario(
        oracle=oracle,
        min_size=min_size,
        max_size=draw(st.one_of(st.none(), st.integers(min_size, 2 * 10**6))),
        multiple_of=draw(st.sampled_from([1, 1, 2, 3, 8, 64])),
        capacity_bytes=draw(st.one_of(st.none(), st.just(capacity))),
        start=draw(st.one_of(st.none(), st.integers(1, 10**7))),
        prior=draw(st.one_of(st.none(), prior)),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_any_monotone_probe_gets_the_exact_answer(scenario: Scenario) -> None:
    step = scenario.multiple_of
    first = -(-scenario.min_size // step) * step
    last = (scenario.max_size or UNBOUNDED_MAX_SIZE) // step * step
    if first > last:
        with pytest.raises(ValueError, match="multiple_of"):
            scenario.run()
        return
    outcome = scenario.run()
    check_exact(outcome, scenario.oracle, first, last, step)
    assert len(outcome.trials) <= trial_bound(outcome.largest_fit, first, last, step)
    again = scenario.run(Oracle(scenario.oracle.fits, scenario.oracle.peak, scenario.oracle.parts))
    assert again.sizes == outcome.sizes


@settings(max_examples=200, deadline=None)
@given(
    answer=st.integers(1, 10**9),
    capacity=st.one_of(st.none(), st.just(GIB)),
)
def test_without_statistics_trials_stay_within_2_log2_plus_2(
    answer: int, capacity: int | None
) -> None:
    outcome = search(threshold(answer), capacity_bytes=capacity)
    assert outcome.largest_fit == answer
    assert len(outcome.trials) <= 2 * math.floor(math.log2(answer)) + 2


def test_without_statistics_small_answers_within_2_log2_plus_2() -> None:
    for answer in range(1, 300):
        for capacity in (None, GIB):
            outcome = search(threshold(answer), capacity_bytes=capacity)
            assert outcome.largest_fit == answer
            assert len(outcome.trials) <= 2 * math.floor(math.log2(answer)) + 2


# --- performance targets on realistic curves ----------------------------------------------------


def realistic_curve(rng: random.Random, target: int) -> tuple[Callable[[int], int], int, int]:
    """peak = a + b*n from size 2 on, a constant at size 1, blocks of 512 bytes; answer ~target."""
    capacity = int(rng.uniform(1, 80) * GIB)
    fixed = rng.uniform(0.05, 0.6) * capacity
    per_sample = (capacity - fixed) / (target + rng.uniform(0.02, 0.98))
    at_one = fixed + per_sample * rng.uniform(1.0, 2.0)  # the optimizer step's constant

    def peak(n: int) -> int:
        return rounded(max(fixed + per_sample * n, at_one), 512)

    answer = expected_answer(lambda n: peak(n) <= capacity, 1, UNBOUNDED_MAX_SIZE, 1)
    assert answer is not None
    return peak, capacity, answer


@pytest.mark.parametrize("target", [37, 100, 1000, 4097, 20000])
def test_targets_with_statistics(target: int) -> None:
    rng = random.Random(target)
    trials, failures = [], []
    for _ in range(150):
        peak, capacity, answer = realistic_curve(rng, target)
        oracle = memory_oracle(peak, capacity)
        outcome = search(oracle, capacity_bytes=capacity)
        check_exact(outcome, oracle, 1, UNBOUNDED_MAX_SIZE, 1)
        assert sum(outcome.sizes) <= 3 * answer, outcome.sizes
        trials.append(len(outcome.trials))
        failures.append(sum(not trial.fits for trial in outcome.trials))
    assert statistics.median(trials) <= 5
    assert max(trials) <= 8
    assert statistics.median(failures) <= 2


def test_flat_starts_of_any_length() -> None:
    rng = random.Random(7)
    trials = []
    for _ in range(200):
        capacity = int(rng.uniform(0.01, 80) * GIB)
        target = int(math.exp(rng.uniform(math.log(20), math.log(30000))))
        fixed = rng.uniform(0.05, 0.6) * capacity
        per_sample = (capacity - fixed) / (target + rng.random())
        knee, flat = rng.uniform(1, 0.6 * target), per_sample * rng.uniform(0, 0.2)
        start = fixed + (per_sample - flat) * knee

        def peak(
            n: int, a: float = fixed, b: float = per_sample, c: float = start, s: float = flat
        ) -> int:
            return rounded(max(c + s * n, a + b * n), 512)  # flat start, then affine

        oracle = memory_oracle(peak, capacity)
        outcome = search(oracle, capacity_bytes=capacity)
        check_exact(outcome, oracle, 1, UNBOUNDED_MAX_SIZE, 1)
        trials.append(len(outcome.trials))
    assert statistics.median(trials) <= 10
    assert max(trials) <= 14


@pytest.mark.parametrize("target", [37, 100, 1000, 4097, 20000])
def test_targets_without_statistics(target: int) -> None:
    rng = random.Random(target)
    for _ in range(20):
        peak, capacity, answer = realistic_curve(rng, target)
        oracle = memory_oracle(peak, capacity, stats=False)
        outcome = search(oracle, capacity_bytes=capacity)
        check_exact(outcome, oracle, 1, UNBOUNDED_MAX_SIZE, 1)
        assert len(outcome.trials) <= 2 * math.log2(answer) + 2


@pytest.mark.parametrize("target", [37, 1000, 20000])
def test_exact_prior_or_start_takes_two_trials(target: int) -> None:
    rng = random.Random(target)
    for _ in range(30):
        capacity = int(rng.uniform(4, 80) * GIB)
        prior = LinearModel(0.3 * capacity, 0.7 * capacity / (target + 0.5))

        def peak(n: int, model: LinearModel = prior) -> int:
            return math.ceil(model.predict(n))

        oracle = memory_oracle(peak, capacity)
        from_prior = search(oracle, capacity_bytes=capacity, prior=prior)
        from_start = search(oracle, capacity_bytes=capacity, start=target)
        assert from_prior.sizes == from_start.sizes == (target, target + 1)


# --- recommend ----------------------------------------------------------------------------------


def test_recommend_is_a_share_of_the_largest_size() -> None:
    model = LinearModel(fixed=2 * GIB, per_sample=10 * MIB)  # (a model changes nothing)
    found = SearchOutcome(largest_fit=614, smallest_fail=615, trials=(), model=model)
    assert recommend(found, headroom=0.1, multiple_of=8) == 552  # 0.9 * 614 = 552.6
    assert recommend(found) == 614


def test_recommend_without_a_model_scales_the_answer() -> None:
    found = SearchOutcome(largest_fit=100, smallest_fail=101, trials=(), model=None)
    assert recommend(found, headroom=0.1) == 90
    assert recommend(found, headroom=0.1, multiple_of=8) == 88
    assert recommend(found, headroom=0.99, multiple_of=8, min_size=10) == 16


def test_recommend_proves_its_size_with_one_probe_and_none_for_a_size_known() -> None:
    found = SearchOutcome(100, 101, (Trial(100, True), Trial(40, True)), None)
    asked: list[int] = []

    def probe(n: int) -> Trial:
        asked.append(n)
        return Trial(n, fits=n <= 100)

    assert recommend(found, headroom=0.1, probe=probe) == 90
    assert asked == [90]
    asked.clear()
    assert recommend(found, headroom=0.6, probe=probe) == 40
    assert asked == []  # (40 trained already)


def test_recommend_bisects_below_a_gap_and_a_trusted_replay_finds_the_nearest_fit() -> None:
    """Under a caching allocator the fit map can have gaps: 60 to 94 fail where 95 to 100
    train. The computed size (90) fails. Without a replay the largest size below the gap is
    bisected. A replay that agrees with the trials names the fitting size nearest 90: none
    down to 85 (1 - 1.5 * headroom), so the smallest above it, 95, in the band below the
    largest (59 would leave two fifths of the rows unused); one trial proves it. Without that
    band, the largest below the gap."""

    def fits(n: int) -> bool:
        return n < 60 or 95 <= n <= 100

    def peaks(n: int) -> tuple[int, int] | None:
        return (n * 1000, n * 1000) if fits(n) else None

    asked: list[int] = []

    def probe(n: int) -> Trial:
        asked.append(n)
        return Trial(n, fits=fits(n), peak_bytes=n * 1000 if fits(n) else None)

    plain = SearchOutcome(100, 101, (Trial(10, True, 10_000), Trial(100, True, 100_000)), None)
    assert recommend(plain, headroom=0.1, probe=probe, max_probes=8) == 59
    assert asked[0] == 90
    assert len(asked) <= 8
    asked.clear()
    replay = Verdicts(peaks)
    replayed = SearchOutcome(100, 101, (
        Trial(10, True, 10_000), Trial(100, True, 100_000, curve=replay),
    ), None)
    assert recommend(replayed, headroom=0.1, probe=probe, capacity_bytes=10**6) == 95
    assert asked == [95]
    asked.clear()
    banded = Verdicts(lambda n: (n * 1000, n * 1000) if n < 60 or n == 100 else None)
    alone = SearchOutcome(100, 101, (
        Trial(10, True, 10_000), Trial(100, True, 100_000, curve=banded),
    ), None)
    assert recommend(alone, headroom=0.1, probe=probe, capacity_bytes=10**6) == 59
    assert asked == [59]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 400)), max_size=3),
    st.sampled_from([0.05, 0.1, 0.2, 0.5]),
    st.sampled_from([1, 8]),
    st.booleans(),
)
def test_recommend_returns_a_size_that_trained_within_its_share(
    largest: int, gaps: list[tuple[int, int]], headroom: float, multiple_of: int, replayed: bool
) -> None:
    """Any fit map (a largest size that trains, gaps of failing sizes below it), with or
    without a replay: the size is on the grid, below the largest, a size that trained (probed
    or among the trials) unless it is the smallest grid size, found in at most
    ``max_probes`` probes, none at a size already known; at most ``(1 - headroom)`` of the
    largest unless a replay found none that fits from there down to ``1 - 1.5 * headroom``
    of it; on a map without gaps it is the computed size itself."""
    assume(largest >= multiple_of)
    failing = {n for start, width in gaps for n in range(start, min(start + width, largest))}

    def fits(n: int) -> bool:
        return n <= largest and n not in failing

    trials = [Trial(largest, True, largest * 10)]
    if replayed:
        curve = Verdicts(lambda n: (n * 10, n * 10) if fits(n) else None)
        trials = [Trial(largest, True, largest * 10, curve=curve)]
    found = SearchOutcome(largest, largest + 1, tuple(trials), None)
    asked: list[int] = []

    def probe(n: int) -> Trial:
        assert n not in asked
        assert n != largest
        asked.append(n)
        return Trial(n, fits(n), n * 10 if fits(n) else None)

    size = recommend(found, headroom=headroom, multiple_of=multiple_of, probe=probe,
                     capacity_bytes=largest * 10 if replayed else None)
    computed = max(multiple_of, int((1 - headroom) * largest) // multiple_of * multiple_of)
    assert size % multiple_of == 0
    assert size < largest or size == multiple_of
    near = math.floor((1 - 1.5 * headroom) * largest) // multiple_of * multiple_of
    if size > computed:  # (an island above a gap, found by the replay)
        assert replayed
        below = range(max(near, multiple_of), computed + 1, multiple_of)
        if len(below) <= 64:  # (each size asked; over more, evenly spread ones)
            assert not any(fits(n) for n in below)
    assert fits(size) or size == multiple_of
    assert len(asked) <= 4
    if not failing:
        assert size == computed
        assert len(asked) <= 1


def test_recommend_checks_its_arguments() -> None:
    found = SearchOutcome(largest_fit=None, smallest_fail=1, trials=(), model=None)
    with pytest.raises(ValueError, match="largest_fit"):
        recommend(found)
    with pytest.raises(ValueError, match="headroom"):
        recommend(SearchOutcome(10, 11, (), None), headroom=1.0)
    with pytest.raises(ValueError, match="grid"):
        recommend(SearchOutcome(10, 11, (), None), min_size=16)


# --- logging --------------------------------------------------------------------------------------


def test_one_debug_line_per_trial(caplog: pytest.LogCaptureFixture) -> None:
    # (the front-ends' trial runner writes the INFO line; the engine's is for debugging)
    with caplog.at_level(logging.DEBUG, logger="autobatch.search"):
        outcome = search(threshold(5), max_size=8)
    lines = [r.getMessage() for r in caplog.records if r.name == "autobatch.search"]
    assert len(lines) == len(outcome.trials)
    assert lines[0].startswith("trial 1: size 1 fits")


def test_docstring_examples_run() -> None:
    from autobatch._search import _loop, _model, _policies

    results = [
        doctest.testmod(module) for module in (autobatch.search, _model, _policies, _loop)
    ]
    assert sum(r.attempted for r in results) > 10
    assert sum(r.failed for r in results) == 0


# --- phases: the optimizer step's constant does not bend the line ----------------------------------


@pytest.mark.parametrize("target", [37, 100, 1000, 4097, 20000])
def test_phase_peaks_straighten_a_kinked_curve(target: int) -> None:
    """peak(n) = max(forward/backward line, a flat optimizer-step line): a curve that is flat up
    to hundreds of samples. Told the phases apart, the search is as quick as on a straight line."""
    per_sample, fixed = 5_632, 2_000_000
    optimizer_peak = fixed + 1_200_000  # the step binds below ~235 samples

    def phases(n: int) -> tuple[int, int]:
        return fixed + per_sample * n, optimizer_peak + 512 * n

    capacity = max(phases(target)) + (max(phases(target + 1)) - max(phases(target))) // 2

    def probe(n: int) -> Trial:
        backward, step = phases(n)
        peak = max(backward, step)
        if peak > capacity:
            return Trial(n, fits=False, error="oom")
        return Trial(n, fits=True, peak_bytes=peak, parts=(backward, step))

    phased = search(probe, capacity_bytes=capacity)
    assert phased.largest_fit == target
    # Past the bend the backward line binds: as quick as a straight line. Before it the step's
    # line binds, whose slope (one 512-byte input row) is the allocator's rounding: slower.
    assert len(phased.trials) <= (5 if target > 235 else 8)
    assert sum(not t.fits for t in phased.trials) <= 2
    assert phased.model is not None
    assert phased.model.per_sample == pytest.approx(per_sample if target > 235 else 512)


# --- parts: one peak per operator, a convex curve made of straight lines --------------------------


@st.composite
def operator_curves(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int]:
    """The lines of a step's operators (``peak = fixed + per_sample * n`` each): some that grow
    with the batch (activations, their gradients), some nearly flat with a large constant (the
    optimizer's update); and the size at which the steepest-binding one meets the capacity."""
    growing = draw(
        st.lists(st.tuples(st.integers(0, 4 * GIB), st.integers(4096, 64 * MIB)), min_size=1, max_size=30)
    )
    flat = draw(st.lists(st.tuples(st.integers(0, 8 * GIB), st.integers(0, 512)), max_size=10))
    lines = draw(st.permutations(growing + flat))
    return lines, draw(st.integers(37, 20000))


@settings(max_examples=300, deadline=None)
@given(curve=operator_curves())
def test_a_convex_curve_told_by_its_parts_is_solved_in_five_trials(
    curve: tuple[list[tuple[int, int]], int],
) -> None:
    """The step's peak is the maximum of its operators' lines: convex, bending wherever a
    steeper operator takes over. Told each operator's peak (rounded as an allocator does), the
    search needs two small trials for the whole curve, one more to make the prediction sharp,
    and the answer and the size above it: five trials and at most three times the answer's
    samples in all. Where a nearly flat line (a slope under the allocator's 512-byte rounding
    can only be told over hundreds of rows) meets the capacity too, within a sixteenth of the
    answer, one trial more."""
    lines, target = curve

    def parts(n: int) -> tuple[int, ...]:
        return tuple(rounded(fixed + per_sample * n, 512) for fixed, per_sample in lines)

    capacity = max(parts(target))
    binding = max(lines, key=lambda line: line[0] + line[1] * target)
    assume(binding[1] >= 4096)  # a flat line binds up to some size; past it, a growing one
    calls: list[int] = []

    def probe(n: int) -> Trial:
        calls.append(n)
        measured = parts(n)
        if max(measured) > capacity:
            return Trial(n, fits=False, error="oom")
        return Trial(n, fits=True, peak_bytes=max(measured), parts=measured)

    outcome = search(probe, capacity_bytes=capacity)
    answer = expected_answer(lambda n: max(parts(n)) <= capacity, 1, UNBOUNDED_MAX_SIZE, 1)
    assert answer is not None
    assert answer >= target
    assert outcome.largest_fit == answer
    tie = any(per_sample < 4096 and fixed + per_sample * (answer + answer // 16) > capacity
              for fixed, per_sample in lines)
    assert len(outcome.trials) <= (6 if tie else 5), outcome.sizes
    assert sum(outcome.sizes) <= 3 * answer, outcome.sizes


def test_parts_that_do_not_line_up_fall_back_to_the_phases_then_the_whole() -> None:
    """An operator that runs only at some sizes: the parts' positions no longer match."""
    trials = [
        Trial(2, True, 1000, parts=(600, 1000, 10), phases=(1000, 900)),
        Trial(8, True, 1600, parts=(1100, 1600), phases=(1100, 1600)),
    ]
    assert binding_points(trials, capacity_bytes=10_000) == [(2, 900), (8, 1600)]
    without_phases = [Trial(t.size, t.fits, t.peak_bytes, parts=t.parts) for t in trials]
    assert binding_points(without_phases, capacity_bytes=10_000) == [(2, 1000), (8, 1600)]


@settings(max_examples=100, deadline=None)
@given(
    lines=st.lists(
        st.tuples(st.integers(0, 2**34), st.integers(0, 2**24)), min_size=1, max_size=40
    ),
    sizes=st.lists(st.integers(1, 10**5), min_size=2, max_size=10, unique=True),
)
def test_the_binding_part_is_the_one_whose_own_fit_reaches_the_capacity_first(
    lines: list[tuple[int, int]], sizes: list[int]
) -> None:
    """The fast (float) choice among many parts agrees with fitting each part exactly."""
    trials = [
        Trial(n, True, 0, parts=tuple(rounded(a + b * n, 512) for a, b in lines)) for n in sizes
    ]
    trials = [Trial(t.size, True, max(t.parts), parts=t.parts) for t in trials]
    capacity = 2**40
    reaches = []
    for index in range(len(lines)):
        model = fit_linear([(t.size, t.parts[index]) for t in trials])
        if model is not None:
            reaches.append((capacity - model.fixed) / model.per_sample)
    chosen = binding_points(trials, capacity)
    if not reaches:
        assert chosen == [(t.size, t.peak_bytes) for t in trials]
        return
    model = fit_linear(chosen)
    assert model is not None
    assert (capacity - model.fixed) / model.per_sample == pytest.approx(min(reaches), rel=1e-6)


def test_thousands_of_parts_are_cheap() -> None:
    rng = random.Random(0)
    lines = [(rng.randint(0, 2**33), rng.choice([0, 512, rng.randint(0, 2**22)])) for _ in range(5000)]
    trials = [
        Trial(n, True, 0, parts=tuple(rounded(a + b * n, 512) for a, b in lines))
        for n in (2, 8, 300, 1000)
    ]
    trials = [Trial(t.size, True, max(t.parts), parts=t.parts) for t in trials]
    started = time.perf_counter()
    points = binding_points(trials, 2**40)
    assert time.perf_counter() - started < 1.0  # ~20 ms: each distinct series, in floats
    assert [size for size, _ in points] == [2, 8, 300, 1000]


# --- a probe's own curve ----------------------------------------------------------------------


def _staircase(storages: list[tuple[int, int]], capacity: int, honest: bool = True) -> Callable[[int], Trial]:
    """A step whose peak is the sum of its storages, each rounded up to 512 bytes, that reports
    its exact curve (or, ``honest=False``, one that is off by a block beyond size 50)."""

    def peak(n: int) -> int:
        return 100_000 + sum(rounded(a * n + b, 512) for a, b in storages)

    def told(n: int) -> int:
        return peak(n) - (512 if not honest and n > 50 else 0)

    def probe(n: int) -> Trial:
        return Trial(n, fits=peak(n) <= capacity, peak_bytes=peak(n), curve=told)

    return probe


@pytest.mark.parametrize("target", [37, 1000, 20_000, 300_000])
def test_a_probes_exact_curve_ends_the_search_in_four_trials(target: int) -> None:
    storages = [(64, 0), (128, 16), (16, 8), (8, 0), (128, 0)]  # 344 bytes per sample
    per = lambda n: 100_000 + sum(rounded(a * n + b, 512) for a, b in storages)  # noqa: E731
    capacity = (per(target) + per(target + 1)) // 2
    outcome = search(_staircase(storages, capacity), capacity_bytes=capacity)
    assert outcome.largest_fit is not None
    assert per(outcome.largest_fit) <= capacity < per(outcome.largest_fit + 1)
    assert len(outcome.trials) <= 4, outcome.sizes


def test_a_curve_that_misses_a_measured_peak_is_not_trusted() -> None:
    storages = [(64, 0), (128, 16), (16, 8)]
    per = lambda n: 100_000 + sum(rounded(a * n + b, 512) for a, b in storages)  # noqa: E731
    capacity = (per(1000) + per(1001)) // 2
    outcome = search(_staircase(storages, capacity, honest=False), capacity_bytes=capacity)
    assert outcome.largest_fit is not None
    assert per(outcome.largest_fit) <= capacity < per(outcome.largest_fit + 1)  # still exact
    assert trusted_curve(outcome.trials, capacity) is None


def test_a_replay_answers_for_the_trials_from_its_floor_up() -> None:
    """A caching allocator's replay worked out from trials at 100 and 200 is trusted although
    a trial at 8 (a model that takes another branch below 64 rows) does not match it; without
    the floor, that trial makes it untrusted, and a failure above the floor that it says fits
    still does."""
    def peaks(n: int) -> tuple[int, int] | None:
        return (1000 * n, 1000 * n) if n <= 300 else None

    small = Trial(8, True, 999)  # (another graph: not on the replay's line)
    above = [Trial(100, True, 100_000), Trial(200, True, 200_000)]
    floored = Verdicts(peaks, ceiling=400, floor=100)
    assert trusted_curve([small, *above[:1], replace(above[1], curve=floored)], 10**9) is floored
    plain = Verdicts(peaks, ceiling=400)
    assert trusted_curve([small, *above[:1], replace(above[1], curve=plain)], 10**9) is None
    wrong = [*above[:1], replace(above[1], curve=floored), Trial(250, False)]
    assert trusted_curve(wrong, 10**9) is None


def test_after_a_replay_said_a_failing_size_fits_the_bracket_is_bisected() -> None:
    """A model that takes another branch above 64 rows: the replay from trials at 2 and 8
    said 4096 fits, and it failed. A line through the same two trials' peaks speaks for the
    large sizes no better (it aimed at 1121, which failed too), so the next size bisects the
    bracket; a replay that no failure contradicts still guides."""
    def light(n: int) -> tuple[int, int] | None:  # (the branch below 64 rows, extended)
        return (2_980_000 + 10_000 * n, 4_000_000 + 10_000 * n) if n <= 5000 else None

    replay = Verdicts(light, ceiling=5000, floor=2)
    trials = [Trial(2, True, 3_000_000), Trial(8, True, 3_060_000, curve=replay),
              Trial(4096, False)]
    state = SearchState(trials=tuple(trials), largest_fit=8, smallest_fail=4096, min_size=1,
                        max_size=None, multiple_of=1, capacity_bytes=24 * MIB)
    assert _replay_contradicted(trials)
    assert ModelGuided().next_size(state) == Exponential().next_size(state) == 181  # (not 1942)
    assert not _replay_contradicted(trials[:2])


def test_a_replay_drawn_through_storages_that_are_no_line_only_aims() -> None:
    """A replay drawn through storages whose bytes are not a line in the size (the rows a
    router sends each expert) gives both its trials' peaks, yet never stands for a trial: it is
    not trusted as exact (no size is skipped on its word, no island is taken from it), and it
    is taken as a guide, which every size it proposes is tried against."""
    def peaks(n: int) -> tuple[int, int] | None:
        return (1000 * n, 1000 * n) if n <= 300 else None

    guess = Verdicts(peaks, ceiling=400, floor=100, approximate=True)
    trials = [Trial(100, True, 100_000), Trial(200, True, 200_000, curve=guess)]
    assert trusted_curve(trials, 10**9) is None
    assert trusted_curve(trials, 10**9, tolerance=0.01) is guess
    exact = Verdicts(peaks, ceiling=400, floor=100)
    assert trusted_curve([trials[0], replace(trials[1], curve=exact)], 10**9) is exact


def test_an_approximate_replay_aims_at_its_highest_island_however_narrow() -> None:
    """An approximate replay's fit map alternates size by size (a mixture of experts: the
    rows each expert gets change with every size), so the largest size it says fits can sit
    alone between sizes asked on the way down (here 648, between 647 and 650, where the sizes
    asked are 3 apart): it is found, and tried, rather than the top of the band below it (640)
    and then the island in a trial more."""
    fits = {*range(600, 641), 643, 648}

    def peaks(n: int) -> tuple[int, int] | None:
        return (1000 * n, 1000 * n) if n in fits or n < 600 else None

    guess = Verdicts(peaks, ceiling=696, floor=8, approximate=True)
    assert _highest_verdict(guess, 72, 659, 1) == 648
    exact = Verdicts(peaks, ceiling=696, floor=8)
    assert _highest_verdict(exact, 72, 659, 1) == 640  # (an exact one's islands are bands)
    trials = [Trial(8, True, 8000), Trial(660, False), Trial(72, True, 72_000, curve=guess)]
    state = SearchState(trials=tuple(trials), largest_fit=72, smallest_fail=660, min_size=1,
                        max_size=None, multiple_of=1, capacity_bytes=10**9)
    assert ModelGuided().next_size(state) == 648
