"""search_batch_sizes: exact at every measured length, safe at every other one, in few trials;
and the pure pieces under it (predict_line, the Predicted policy)."""

from __future__ import annotations

import copy
import doctest
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import fits_two_steps
from _ranks import run_ranks
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

import autobatch
from autobatch import AutobatchError, LengthTable, search_batch_size, search_batch_sizes
from autobatch._search import LinearModel, Predicted, Trial, predict_line, search
from autobatch._sizing._per_length import _every_pair
from autobatch.data import MemoryAwareBatchSampler
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import gru, tokens, transformer

CE = nn.functional.cross_entropy
LENGTHS = (8, 16, 24, 32, 48)
#: model factory and capacity: the largest batch from about 12 (transformer at 48) to 113
CASES = {
    "transformer": (lambda: transformer(d_model=32, layers=1), "4MiB"),
    "gru": (gru, "3MiB"),
}


def _sample_for(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(2, length)


@dataclass
class Searched:
    model: nn.Module
    table: LengthTable
    capacity: int
    before: dict[str, Any]
    after: dict[str, Any]
    memory_before: int
    memory_after: int


def _everything(model: nn.Module) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        and a["grads"] == b["grads"]  # all None, before and after
        and a["training"] == b["training"]
        and torch.equal(a["rng"], b["rng"])
        and a["py_rng"] == b["py_rng"]
    )


@pytest.fixture(scope="module")
def searched() -> dict[str, Searched]:
    found = {}
    for name, (make, capacity) in CASES.items():
        torch.manual_seed(0)
        model = make()
        before = _everything(model)
        with SimulatedGPU(capacity, allocator="exact") as gpu:
            gpu.adopt(model)
            memory_before = gpu.allocated_bytes
            table = search_batch_sizes(
                model, _sample_for, LENGTHS, torch.optim.Adam, loss_fn=CE, headroom=0
            )
            memory_after = gpu.allocated_bytes
        found[name] = Searched(model, table, gpu.capacity_bytes, before, _everything(model),
                               memory_before, memory_after)
    return found


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    CE(model(x), y).backward()
    opt.step()


def _fits(model: nn.Module, length: int, n: int, capacity: int) -> bool:
    """Do two real training steps at batch ``n`` of ``length`` fit on a fresh simulator (the
    sample made there, as the search makes it)?"""
    return fits_two_steps(model, torch.optim.Adam, lambda: _sample_for(length), n, capacity, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_measured_length_is_exact(searched: dict[str, Searched], name: str) -> None:
    case = searched[name]
    sizes = [case.table.max_batch_size(length) for length in LENGTHS]
    assert sizes == sorted(sizes, reverse=True)  # memory grows with the length
    for length, best in zip(LENGTHS, sizes, strict=True):
        assert case.table.batch_size(length) == best  # headroom=0
        assert _fits(case.model, length, best, case.capacity), (length, best)
        assert not _fits(case.model, length, best + 1, case.capacity), (length, best)
        tried = [t.size for t in case.table.trials if t.length == length]
        assert best in tried  # proven, not predicted
        assert best + 1 in tried
        assert len(tried) == len(set(tried))


@pytest.mark.parametrize("name", sorted(CASES))
def test_five_lengths_take_at_most_thirteen_trials(searched: dict[str, Searched], name: str) -> None:
    table = searched[name].table
    assert len(table.trials) <= 2 * len(LENGTHS) + 3, table
    assert table.trials[0].length == max(LENGTHS)  # the longest first
    assert sum(len(r.trials) for r in table.results) == len(table.trials)
    assert table.oom_trials == sum(not t.fits for t in table.trials)


@pytest.mark.parametrize("name", sorted(CASES))
def test_unmeasured_lengths_get_a_size_that_fits(searched: dict[str, Searched], name: str) -> None:
    case = searched[name]
    others = [n for n in range(1, max(LENGTHS)) if n not in LENGTHS]
    chosen = random.Random(0).sample(others, 20)
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    opt = torch.optim.Adam(case.model.parameters())
    try:
        with SimulatedGPU(case.capacity, allocator="exact") as gpu:
            gpu.adopt(case.model)
            for index, length in enumerate(sorted(chosen, reverse=True)):
                size = case.table.batch_size(length)
                above = min(n for n in LENGTHS if n >= length)
                assert size == case.table.max_batch_size(above)
                x, y = _sample_for(length)
                rows = torch.arange(size) % 2
                xb, yb = x[rows], y[rows]
                for _ in range(2 if index == 0 else 1):  # steady state: Adam's moments exist
                    _train_step(case.model, opt, xb, yb)  # an OOM here fails the test
                del x, y, xb, yb
    finally:
        case.model.zero_grad(set_to_none=True)
        case.model.load_state_dict(state)


def test_lengths_above_the_longest_or_unmeasured_are_refused(searched: dict[str, Searched]) -> None:
    table = searched["transformer"].table
    with pytest.raises(AutobatchError, match="length 49 is above the longest measured length 48"):
        table.batch_size(49)
    with pytest.raises(AutobatchError, match="length 20 was not measured"):
        table.max_batch_size(20)
    with pytest.raises(ValueError, match="length"):
        table.batch_size(-1)
    assert table.batch_size(0) == table.batch_size(1) == table.batch_size(8)
    assert table.result(48).max_batch_size == table.max_batch_size(48)


def test_fits_at_measured_lengths_and_between_them_without_a_caching_allocator(
    searched: dict[str, Searched],
) -> None:
    """Under the exact allocator fitting grows with memory: a measured length's verdicts are
    its largest size and the one above, and a shorter length gets at least as much."""
    table = searched["gru"].table
    for length in LENGTHS:
        best = table.max_batch_size(length)
        assert [table.fits(length, n) for n in (1, best, best + 1)] == [True, True, False]
        assert table.padded_length(length) == length
    between = LENGTHS[1] - 1
    above = table.max_batch_size(LENGTHS[1])
    assert table.padded_length(between) == LENGTHS[1]
    assert table.fits(between, above) is True
    assert table.fits(between, 10 * above) is None  # more might fit there: not measured
    with pytest.raises(AutobatchError, match="above the longest"):
        table.fits(max(LENGTHS) + 1, 1)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="size"):
            table.fits(LENGTHS[0], bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="size"):
            table.fits(between, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_and_memory_are_as_before(searched: dict[str, Searched], name: str) -> None:
    case = searched[name]
    assert _same(case.before, case.after)
    assert case.memory_after == case.memory_before


def test_an_optimizer_with_state_and_gradients_is_put_back() -> None:
    torch.manual_seed(0)
    model = transformer(d_model=16, layers=1)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    x, y = _sample_for(8)
    _train_step(model, opt, x, y)
    CE(model(x), y).backward()  # gradients left behind too
    before = {**_everything(model), "opt": copy.deepcopy(opt.state_dict())}
    kept = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with SimulatedGPU("1MiB", allocator="exact") as gpu:
        gpu.adopt(model, opt)
        memory_before = gpu.allocated_bytes
        table = search_batch_sizes(model, _sample_for, [8, 16], opt, loss_fn=CE, headroom=0)
        assert gpu.allocated_bytes == memory_before
    after = opt.state_dict()
    assert table.oom_trials >= 1
    assert all(torch.equal(a, b) for a, b in zip(before["params"], _everything(model)["params"], strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(kept, model.parameters(), strict=True))
    assert torch.equal(before["rng"], torch.get_rng_state())
    assert before["opt"]["param_groups"] == after["param_groups"]
    for index, state in before["opt"]["state"].items():
        assert all(torch.equal(v, after["state"][index][k]) for k, v in state.items())


def test_json_round_trip_and_repr(searched: dict[str, Searched]) -> None:
    table = searched["gru"].table
    again = LengthTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again == table
    assert again.batch_size(20) == table.batch_size(20)
    assert "length     48" in repr(table)
    with pytest.raises(ValueError, match="length table"):
        LengthTable.from_dict({"lengths": [8], "results": []})


def test_a_training_run_over_long_tailed_lengths_never_runs_out_of_memory(
    searched: dict[str, Searched],
) -> None:
    """The sampler packs each batch to what its longest member allows; padding to that member,
    one epoch of real steps fits every time, with several times the tokens per step of a
    fixed batch sized for the longest sequence."""
    case = searched["transformer"]
    generator = torch.Generator().manual_seed(0)
    lengths = [min(48, 4 + int(x)) for x in torch.empty(300).exponential_(0.1, generator=generator)]
    data = [(torch.randint(0, 1000, (n,), generator=generator), i % 10) for i, n in enumerate(lengths)]

    def pad(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = nn.utils.rnn.pad_sequence([row for row, _ in batch], batch_first=True)
        return rows, torch.tensor([label for _, label in batch])

    sampler = MemoryAwareBatchSampler(lengths, case.table, seed=0)
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    opt = torch.optim.Adam(case.model.parameters())
    steps = 0
    try:
        with SimulatedGPU(case.capacity, allocator="exact") as gpu:
            gpu.adopt(case.model)
            for x, y in DataLoader(data, batch_sampler=sampler, collate_fn=pad):
                _train_step(case.model, opt, x, y)  # an OOM here fails the test
                steps += 1
                del x, y
            assert gpu.oom_count == 0
    finally:
        case.model.zero_grad(set_to_none=True)
        case.model.load_state_dict(state)
    assert steps == len(sampler)
    fixed_steps = -(-len(lengths) // case.table.batch_size(max(lengths)))
    assert fixed_steps > 2 * steps  # the same samples in fewer than half the steps


def test_cache_hit_on_the_same_lengths_and_miss_on_others(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformer(d_model=16, layers=1)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
    options: dict[str, Any] = {"loss_fn": CE, "headroom": 0, "cache": tmp_path}
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        first = search_batch_sizes(model, _sample_for, [4, 8], torch.optim.SGD, **options)
        ran = len(calls)
        again = search_batch_sizes(model, _sample_for, [8, 4], torch.optim.SGD, **options)
        assert len(calls) == ran  # no trial ran: the stored table was used
        other = search_batch_sizes(model, _sample_for, [4, 6], torch.optim.SGD, **options)
        assert len(calls) > ran  # other lengths, another table
        ran = len(calls)
        wider = search_batch_sizes(model, lambda n: tokens(2, 2 * n), [2, 4], torch.optim.SGD,
                                   **options)
        assert len(calls) > ran  # other sample shapes at the same lengths
    assert again.results == first.results
    assert again.lengths == first.lengths
    assert any("from the cache" in note for note in again.notes)
    assert not any("from the cache" in note for note in other.notes + wider.notes)
    assert other.max_batch_size(4) == first.max_batch_size(4)
    assert wider.max_batch_size(4) == first.max_batch_size(8)  # its samples are 8 long


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([], "empty"),
        ([8, 0], "at least 1"),
        ([-4], "at least 1"),
        ([8, 16, 8], "twice"),
        ([8.0], "int"),
        ("128", "list"),
        (128, "list"),
    ],
)
def test_bad_lengths_are_refused(lengths: Any, match: str) -> None:
    with pytest.raises(AutobatchError, match=match) as caught:
        search_batch_sizes(nn.Linear(4, 2), _sample_for, lengths)
    assert isinstance(caught.value, ValueError)


def test_a_sample_for_that_is_not_a_function_is_refused() -> None:
    with pytest.raises(AutobatchError, match="sample_for") as caught:
        search_batch_sizes(nn.Linear(4, 2), torch.zeros(2, 4), [8])  # type: ignore[arg-type]
    assert isinstance(caught.value, TypeError)
    with pytest.raises(ValueError, match="headroom"):  # the search's own options, as checked there
        search_batch_sizes(nn.Linear(4, 2), _sample_for, [8], headroom=1.5)


def test_options_are_those_of_search_batch_size() -> None:
    """One list of options: the search over lengths shows and checks exactly the finder's."""
    import inspect

    own = inspect.signature(search_batch_sizes).parameters
    finder = inspect.signature(autobatch.search_batch_size).parameters
    assert list(own)[:3] == ["model", "sample_for", "lengths"]
    assert list(own)[3:] == list(finder)[2:]
    assert all(own[name] == finder[name] for name in list(finder)[2:])
    with pytest.raises(TypeError, match="headroomx"):
        search_batch_sizes(nn.Linear(4, 2), _sample_for, [8], headroomx=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="sample"):
        search_batch_sizes(nn.Linear(4, 2), _sample_for, [8], sample=torch.zeros(2, 4))  # type: ignore[call-arg]


def test_docstring_examples_run() -> None:
    import autobatch._records._result
    import autobatch._search._length_lines
    import autobatch._sizing._per_length

    for module in (autobatch._sizing._per_length, autobatch._records._result, autobatch._search._length_lines):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_public_surface() -> None:
    assert "search_batch_sizes" in autobatch.__all__
    assert "LengthTable" in autobatch.__all__
    assert autobatch.__all__ == sorted(autobatch.__all__)


# The pure pieces: the line at an unmeasured length, and the policy that proves a prediction.


def _quadratic(length: int) -> LinearModel:
    """A transformer's line: per sample, linear and quadratic parts in the length."""
    return LinearModel(2_000_000, 13_344 * length + 96 * length**2)


def test_predict_line_is_exact_for_parts_linear_and_quadratic_in_the_length() -> None:
    lines = {n: _quadratic(n) for n in (512, 384)}
    for length in (64, 256, 300, 1024):
        predicted = predict_line(lines, length)
        assert predicted is not None
        assert predicted.per_sample == pytest.approx(_quadratic(length).per_sample, rel=1e-12)
        assert predicted.fixed == 2_000_000
    assert predict_line(lines, 512) == lines[512]


def test_predict_line_from_one_length_is_in_proportion() -> None:
    predicted = predict_line({100: LinearModel(500.0, 1000.0)}, 50)
    assert predicted == LinearModel(500.0, 500.0)


def test_predict_line_averages_rounding_over_every_measured_length() -> None:
    """Each slope off by up to a sample's rounding, alternately: the fit stays within it."""
    true = lambda n: 3_000.0 * n + 900.0  # noqa: E731  (an affine part, as a GRU's)
    lines = {n: LinearModel(0.0, true(n) * (1 + (-1) ** (n // 8) * 0.004)) for n in (16, 24, 32, 48)}
    predicted = predict_line(lines, 8)
    assert predicted is not None
    assert predicted.per_sample == pytest.approx(true(8), rel=0.02)


def test_predict_line_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        predict_line({}, 8)
    with pytest.raises(ValueError, match="length"):
        predict_line({8: LinearModel(0.0, 1.0)}, 0)


def _linear_probe(fixed: int, per_sample: int, capacity: int) -> Any:
    def probe(n: int) -> Trial:
        peak = fixed + per_sample * n
        return Trial(n, fits=peak <= capacity, peak_bytes=peak if peak <= capacity else None)

    return probe


@pytest.mark.parametrize(
    ("start", "sizes"),
    [
        (100, (100, 101)),  # right: two trials
        (101, (101, 100)),  # one too high: two trials
        (80, (80, 100, 101)),  # low: the line from the fixed bytes through its peak
        (103, (103, 102, 100, 101)),  # high: down, then the line through the first fit
    ],
)
def test_predicted_policy_proves_a_prediction(start: int, sizes: tuple[int, ...]) -> None:
    probe = _linear_probe(1_000_000, 10_000, 2_000_000)
    guess = LinearModel(1_000_000, 12_000)  # its slope 20% off: only the fixed bytes are used
    outcome = search(probe, capacity_bytes=2_000_000, start=start, prior=guess,
                     policy=Predicted())
    assert outcome.largest_fit == 100
    assert outcome.sizes == sizes


@pytest.mark.parametrize("start", [1, 2, 7, 50, 99, 100, 101, 150, 400])
@pytest.mark.parametrize("multiple_of", [1, 4])
def test_predicted_policy_is_exact_from_any_start(start: int, multiple_of: int) -> None:
    probe = _linear_probe(1_000_000, 10_000, 2_000_000)
    outcome = search(probe, capacity_bytes=2_000_000, start=start, multiple_of=multiple_of,
                     prior=LinearModel(900_000, 9_000), policy=Predicted())
    assert outcome.largest_fit == 100 // multiple_of * multiple_of
    assert len(outcome.sizes) <= 12
    without = search(lambda n: Trial(n, n <= 100), start=start, multiple_of=multiple_of,
                     policy=Predicted())
    assert without.largest_fit == outcome.largest_fit


def _table_on_rank(rank: int, headroom: float = 0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = transformer(d_model=16, layers=1)
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        held = torch.zeros(64 * 1024 * rank)  # rank 1 holds 256 KiB more: its peaks differ
        table = search_batch_sizes(model, _sample_for, [8, 16, 32], torch.optim.SGD,
                                   loss_fn=CE, headroom=headroom)
        del held
    return {
        "sizes": [table.max_batch_size(n) for n in (8, 16, 32)],
        "recommended": [table.batch_size(n) for n in (8, 16, 32)],
        "notes": list(table.notes),
        "trials": [(t.length, t.size) for t in table.trials],  # (each rank's own verdicts)
        "params": [p.detach().double().sum().item() for p in model.parameters()],
    }


@pytest.mark.slow
def test_ranks_agree_on_every_length(tmp_path: Path) -> None:
    """Two gloo ranks, one holding more memory (so its peaks differ): the same table (the
    fuller rank's), the same trials in lockstep, parameters untouched."""
    results = run_ranks(_table_on_rank, 2, tmp_path)
    assert results[0]["sizes"] == results[1]["sizes"]
    assert results[0]["trials"] == results[1]["trials"]
    torch.manual_seed(0)
    alone = transformer(d_model=16, layers=1)
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(alone)
        held = torch.zeros(64 * 1024)
        fuller = search_batch_sizes(alone, _sample_for, [8, 16, 32], torch.optim.SGD,
                                    loss_fn=CE, headroom=0)
        del held
    assert results[0]["sizes"] == [fuller.max_batch_size(n) for n in (8, 16, 32)]
    for rank in results:
        assert rank["params"] == [p.detach().double().sum().item() for p in alone.parameters()]


@pytest.mark.slow
def test_ranks_prove_the_recommended_sizes_together_in_lockstep(tmp_path: Path) -> None:
    """With headroom, the recommended sizes run together on every rank in lockstep (the
    caching simulator has no expandable segments): the same sizes and notes on both ranks,
    parameters untouched."""
    results = run_ranks(_table_on_rank, 2, tmp_path, 0.1)
    assert results[0]["recommended"] == results[1]["recommended"]
    assert results[0]["notes"] == results[1]["notes"]
    assert "ran together" in results[0]["notes"][0]
    assert results[0]["params"] == results[1]["params"]


def test_23_12_at_zero_slack_each_length_is_the_single_searchs_size() -> None:
    """A GRU whose peak at B* = 392 meets the capacity to the byte: the table's size at that
    length is 392, as a single search's with the same sample function. The sample made for a
    length lies in host memory while its trials run (on the device it was one row low)."""
    torch.manual_seed(0)
    template = gru()
    length = 16

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens(n, length)

    model = copy.deepcopy(template)
    with SimulatedGPU(2**40, allocator="exact", adopt=[model]):
        peak = search_batch_size(model, batch, torch.optim.Adam, loss_fn=CE, start=392,
                                 max_batch=392).trials[0].peak_bytes
    assert peak is not None
    found = {}
    for how in ("single", "table"):
        model = copy.deepcopy(template)
        with SimulatedGPU(peak, allocator="exact", adopt=[model]):
            if how == "single":
                found[how] = search_batch_size(model, batch, torch.optim.Adam, loss_fn=CE,
                                               headroom=0).max_batch_size
            else:
                found[how] = search_batch_sizes(
                    model, lambda n: tokens(2, n), [length, 2 * length], torch.optim.Adam,
                    loss_fn=CE, headroom=0,
                ).max_batch_size(length)
    assert found == {"single": 392, "table": 392}


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=7, unique=True))
def test_the_lengths_in_turn_follow_every_length_by_every_other_once(lengths: list[int]) -> None:
    turn = [lengths[0], *_every_pair(lengths)]
    pairs = list(itertools.pairwise(turn))
    assert sorted(pairs) == sorted((a, b) for a in lengths for b in lengths)


class _Fragmenting(nn.Module):
    """A transformer whose step at the longest length runs out of memory (as a caching
    allocator does when the shorter batches before it cut its cached blocks) when it comes
    right after a step at the shortest length with more than ``rows`` rows: a size that trains
    alone but not among the other lengths."""

    def __init__(self, shortest: int, longest: int, rows: int) -> None:
        super().__init__()
        self.net = transformer(d_model=16, layers=1)
        self.shortest, self.longest, self.rows = shortest, longest, rows
        self.last: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length, last = x.shape[1], self.last
        self.last = length
        if length == self.longest and last == self.shortest and len(x) > self.rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return self.net(x)


@pytest.mark.parametrize("expandable", [False, True])
def test_sizes_that_run_out_among_other_lengths_are_lowered_until_they_run_together(
    expandable: bool,
) -> None:
    """Each length is searched alone; then, under a caching allocator without expandable
    segments, the sizes run together, every length after every other and from every first
    length, and every size is lowered while that runs out. The table and the lowered length
    say so, and the model, RNG and memory are as before. With expandable segments (free pages
    go back wherever they lie) the sizes stand as found alone."""
    torch.manual_seed(0)
    model = _Fragmenting(8, 32, rows=20)
    before = _everything(model)
    with SimulatedGPU("4MiB", expandable_segments=expandable) as gpu:
        gpu.adopt(model)
        memory_before = gpu.allocated_bytes
        table = search_batch_sizes(model, _sample_for, [8, 16, 32], torch.optim.Adam, loss_fn=CE)
        memory_after = gpu.allocated_bytes
    alone = [r.max_batch_size * 9 // 10 for r in table.results]
    sizes = [table.batch_size(n) for n in (8, 16, 32)]
    assert alone[2] > 20  # (the case needs a size above the rows that run together)
    assert _same(before, _everything(model))
    assert memory_before == memory_after
    if expandable:
        assert sizes == alone
        assert not table.notes
        return
    assert sizes[2] <= 20 < alone[2]  # lowered until it runs after the shortest length
    assert all(s < a for s, a in zip(sizes, alone, strict=True))  # every length, together
    assert "ran together" in table.notes[0]
    assert "expandable_segments" in table.notes[0]
    assert any("among batches of the other lengths" in n for n in table.results[2].notes)
