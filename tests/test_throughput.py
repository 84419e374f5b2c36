from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from autobatch import BatchSizeError
from autobatch._records._result import ThroughputPoint
from autobatch._sizing._throughput import _choose, default_candidates, find_best_batch
from autobatch.testing import SimulatedGPU, SimulatedMemory


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10))


CE = nn.functional.cross_entropy


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 512), torch.randint(0, 10, (3,))


# --------------------------------------------------------------------------- candidates


def test_default_candidates() -> None:
    assert default_candidates(200) == [1, 2, 4, 8, 16, 32, 64, 128, 200]
    assert default_candidates(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert default_candidates(1) == [1]
    assert default_candidates(100, min_batch=4, multiple_of=8) == [8, 16, 32, 64, 100]
    assert default_candidates(50, min_batch=5) == [8, 16, 32, 50]


@given(
    st.integers(1, 10**6), st.integers(1, 64), st.sampled_from([1, 2, 3, 8, 16, 24, 64])
)
def test_candidates_properties(max_batch: int, min_batch: int, multiple_of: int) -> None:
    sizes = default_candidates(max_batch, min_batch=min_batch, multiple_of=multiple_of)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == max_batch
    assert all(s % multiple_of == 0 and s >= min_batch for s in sizes[:-1])
    assert len(sizes) <= max_batch.bit_length() + 1


# --------------------------------------------------------------------------- the choice


def _points(rates: dict[int, float | None]) -> list[ThroughputPoint]:
    return [
        ThroughputPoint(n, r, None if r is None else n / r, None if r is not None else "oom")
        for n, r in rates.items()
    ]


def _chosen(rates: dict[int, float | None], tolerance: float) -> Any:
    return _choose(_points(rates), tolerance, "cuda:0", True, 5, 2, None, list(rates))


def test_smallest_size_within_tolerance_of_the_best() -> None:
    rates: dict[int, float | None] = {8: 500.0, 16: 900.0, 32: 985.0, 64: 1000.0, 128: 990.0}
    assert _chosen(rates, 0.02).batch_size == 32
    assert _chosen(rates, 0.0).batch_size == 64
    assert _chosen(rates, 0.1).batch_size == 16
    result = _chosen(rates, 0.02)
    assert (result.fastest_batch_size, result.best_samples_per_s) == (64, 1000.0)
    assert result.samples_per_s == 985.0
    assert result.max_batch_size == 128


@given(st.lists(st.floats(1.0, 1e6), min_size=1, max_size=12), st.floats(0, 0.5))
def test_choice_properties(values: list[float], tolerance: float) -> None:
    rates: dict[int, float | None] = {2**i: v for i, v in enumerate(values)}
    result = _chosen(rates, tolerance)
    best = max(values)
    assert result.best_samples_per_s == best
    assert result.samples_per_s >= (1 - tolerance) * best
    assert all(r < (1 - tolerance) * best for n, r in rates.items() if n < result.batch_size)  # type: ignore[operator]
    assert result.batch_size <= result.fastest_batch_size


def test_nothing_timed_is_a_batch_size_error() -> None:
    with pytest.raises(BatchSizeError, match="no candidate batch size could run"):
        _chosen({64: None}, 0.02)


# --------------------------------------------------------------------------- real timing


class _Clock:
    """A clock that only the step moves: the timer reads it as ``time.perf_counter``, so the
    curve is exact whatever else runs on the machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_picks_where_the_curve_saturates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose time is flat up to 16 rows and linear after: 16 is the smallest size within
    the tolerance of the best samples/second (a saturated device)."""
    clock = _Clock()
    monkeypatch.setattr("autobatch._sizing._throughput.time", clock)

    def step(model: nn.Module, batch: Any) -> None:
        clock.now += 0.01 * max(1.0, len(batch[0]) / 16)

    with SimulatedGPU("8MiB"):
        result = find_best_batch(
            _model(), _sample(), candidates=[4, 8, 16, 32, 64], step_fn=step,
            repeats=3, warmup=0, tolerance=0.15,
        )
    assert [p.size for p in result.points] == [4, 8, 16, 32, 64]
    assert result.batch_size == 16
    assert result.fastest_batch_size >= 16
    assert result.points[0].samples_per_s is not None
    assert result.points[0].samples_per_s < 0.5 * result.best_samples_per_s
    assert result.search is None
    assert "ThroughputResult(batch_size=16" in repr(result)


def test_searches_first_without_a_maximum_and_leaves_no_trace() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    sample = _sample()
    torch.manual_seed(1)
    random.seed(1)
    rng, py_rng = torch.get_rng_state(), random.getstate()
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        before = gpu.allocated_bytes
        result = find_best_batch(model, sample, optimizer, loss_fn=CE, repeats=2, warmup=1)
        after = gpu.allocated_bytes
    assert result.search is not None
    assert result.max_batch_size == result.search.batch_size
    assert [p.size for p in result.points] == default_candidates(result.max_batch_size)
    assert all(p.samples_per_s is not None for p in result.points)
    assert 1 <= result.batch_size <= result.max_batch_size
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert optimizer.state == {}
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_rng
    assert after == before  # no memory left behind on the device


def test_device_is_synchronised_around_every_timed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(SimulatedMemory, "synchronize", lambda self: calls.append("sync"))

    def step(model: nn.Module, batch: Any) -> None:
        calls.append("step")

    with SimulatedGPU("8MiB"):
        find_best_batch(_model(), _sample(), candidates=[4], step_fn=step, repeats=3, warmup=2)
    assert calls == ["step", "step"] + ["sync", "step", "sync"] * 3


def test_a_candidate_that_runs_out_of_memory_ends_the_curve() -> None:
    model = _model()
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        result = find_best_batch(
            model, _sample(), torch.optim.SGD, loss_fn=CE, candidates=[16, 64, 10**6, 2 * 10**6],
            repeats=1, warmup=0,
        )
    assert [p.size for p in result.points] == [16, 64, 10**6]
    assert result.points[-1].samples_per_s is None
    assert result.points[-1].error == "cuda_allocator"
    assert result.batch_size in (16, 64)
    assert "2000000" in result.notes[0]
    assert "out of memory" in result.notes[0]
    assert all(p.grad is None for p in model.parameters())


def test_no_candidate_fits() -> None:
    model = _model()
    sample = _sample()
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(BatchSizeError, match="no candidate"):
            find_best_batch(model, sample, loss_fn=CE, candidates=[10**6], repeats=1)


def test_inference_mode_timing() -> None:
    model = _model()
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model)
        result = find_best_batch(model, _sample()[0], train=False, max_batch=64, repeats=1,
                                 warmup=0)
    assert not result.train
    assert [p.size for p in result.points][-1] == 64
    assert model.training  # the mode is put back


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tolerance": 1.5}, "tolerance"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"repeats": 0}, "repeats"),
        ({"warmup": -1}, "warmup"),
        ({"candidates": [0, 8]}, "candidates"),
        ({"candidates": []}, "candidates"),
        ({"candidates": [64], "max_batch": 8}, "max_batch"),
        ({"max_batch": 0}, "max_batch"),
    ],
)
def test_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_best_batch(_model(), _sample(), **options)
