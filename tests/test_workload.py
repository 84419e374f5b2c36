"""The sample a search measures: a list of per-row examples (what ``[dataset[i] for i in ...]``
gives) is collated as ``torch.utils.data.default_collate`` collates it, or refused with the fix."""

from __future__ import annotations

import doctest
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

import autobatch._sizing._workload
from autobatch import find_max_batch, plan_max_batch, search_batch_size
from autobatch._sizing._workload import collated, is_row_list
from autobatch.testing import SimulatedGPU

CE = nn.functional.cross_entropy
Row = namedtuple("Row", ["image", "label"])


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b)
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_module_doctests() -> None:
    result = doctest.testmod(autobatch._sizing._workload)
    assert result.attempted > 0
    assert result.failed == 0


def test_rows_are_collated_as_default_collate_collates_them() -> None:
    dicts = [{"input_ids": torch.arange(6) + i, "label": i % 2, "id": f"row{i}"} for i in range(5)]
    tuples = [(torch.randn(3, 4, 4), i) for i in range(5)]
    named = [Row(torch.randn(2), torch.tensor(i)) for i in range(3)]
    for rows in (dicts, tuples, named):
        assert is_row_list(rows)
        _same(collated(rows), default_collate(rows))
    batch = collated(dicts)
    assert batch["input_ids"].shape == (5, 6)
    assert batch["label"].tolist() == [0, 1, 0, 1, 0]
    assert batch["id"] == [f"row{i}" for i in range(5)]  # strings stay a per-sample list


@pytest.mark.parametrize(
    "batch",
    [
        torch.zeros(4, 3),
        (torch.zeros(4, 3), torch.zeros(4)),  # (inputs, target)
        [torch.zeros(4, 3), torch.zeros(4)],  # a list of batched tensors
        ({"x": torch.zeros(4, 3)}, {"x": torch.zeros(4, 3)}),  # a batch of two parts: a tuple
        {"x": torch.zeros(4, 3), "names": ["a", "b", "c", "d"]},
        [{"x": torch.zeros(4, 3)}, {"y": torch.zeros(4, 3)}],  # dicts with other keys
        [(torch.zeros(4),), (torch.zeros(4), torch.zeros(4))],  # tuples of other lengths
        [],
    ],
)
def test_batches_are_not_rows(batch: Any) -> None:
    assert not is_row_list(batch)
    assert collated(batch) is batch


def test_python_lists_of_numbers_are_refused_with_the_fix() -> None:
    rows = [{"input_ids": [101, 7, 102], "label": 1}, {"input_ids": [101, 9, 102], "label": 0}]
    with pytest.raises(TypeError, match=r"row\['input_ids'\] is a Python list of numbers") as e:
        collated(rows)
    assert "dataset.with_format('torch')" in str(e.value)
    with pytest.raises(TypeError, match=r"row\[0\] is a Python list"):
        collated([([0.5, 1.5], 0), ([2.5, 3.5], 1)])


def test_rows_of_different_lengths_are_refused_with_the_fix() -> None:
    rows = [{"input_ids": torch.arange(n)} for n in (3, 5, 4)]
    with pytest.raises(TypeError, match="list of 3 per-row examples") as e:
        collated(rows)
    assert "padded to the longest row" in str(e.value)
    with pytest.raises(TypeError, match="cannot be collated"):
        collated([{"x": torch.zeros(2), "extra": None}] * 2)


# With real models -----------------------------------------------------------------------------


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def _fits(rows: list[Any], n: int, capacity: str, allocator: str = "caching") -> bool:
    """Two steps of a plain loop at ``n`` rows, with a fresh model and Adam in a fresh
    simulator, on the rows cycled and collated as a DataLoader would (on the host), each
    step's batch copied to the device."""
    torch.manual_seed(0)
    model = _Conv()
    optimizer = torch.optim.Adam(model.parameters())
    images, labels = default_collate([rows[i % len(rows)] for i in range(n)])
    try:
        with SimulatedGPU(capacity, allocator=allocator) as gpu:  # type: ignore[arg-type]
            gpu.adopt(model)
            for _ in range(2):
                x, y = images.clone(), labels.clone()  # .to(device)
                optimizer.zero_grad()
                CE(model(x), y).backward()
                optimizer.step()
                del x, y
    except torch.OutOfMemoryError:
        return False
    return True


def test_a_list_of_image_label_tuples_is_sized_as_its_batch() -> None:
    rows = [(torch.randn(3, 16, 16), i % 10) for i in range(4)]  # a torchvision-style dataset
    results = []
    for sample in (rows, default_collate(rows)):
        torch.manual_seed(0)
        model = _Conv()
        with SimulatedGPU("3MiB") as gpu:
            gpu.adopt(model)
            results.append(search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE,
                                             headroom=0, max_batch=4096))
    from_rows, from_batch = results
    assert [t.size for t in from_rows.trials] == [t.size for t in from_batch.trials]
    assert from_rows.max_batch_size == from_batch.max_batch_size
    largest = from_rows.max_batch_size
    assert _fits(rows, largest, "3MiB")
    assert not _fits(rows, largest + 1, "3MiB")


def test_a_function_returning_rows_is_collated_too() -> None:
    def rows(n: int) -> list[tuple[torch.Tensor, int]]:
        return [(torch.randn(3, 16, 16), i % 10) for i in range(n)]

    torch.manual_seed(0)
    model = _Conv()
    # Byte-exact: the function's rows are made on the simulated device (the CPU), where the
    # caching model's small pool fragments around them, unlike the loop's rows on the host.
    with SimulatedGPU("3MiB", allocator="exact") as gpu:
        gpu.adopt(model)
        size = find_max_batch(model, rows, torch.optim.Adam, loss_fn=CE, headroom=0,
                              max_batch=4096)
    assert _fits(rows(4), size, "3MiB", "exact")
    assert not _fits(rows(4), size + 1, "3MiB", "exact")


def test_the_planner_takes_rows_as_their_batch() -> None:
    rows = [(torch.randn(3, 16, 16), i % 10) for i in range(4)]
    plans = [plan_max_batch(_Conv(), sample, torch.optim.Adam, "3MiB", loss_fn=CE, headroom=0,
                            max_batch=4096, device="cpu")
             for sample in (rows, default_collate(rows))]
    assert plans[0].max_batch_size == plans[1].max_batch_size > 1


def test_rows_the_search_cannot_collate_are_refused_before_any_trial() -> None:
    model = nn.Linear(3, 2)
    rows = [{"x": [1.0, 2.0, 3.0]}, {"x": [4.0, 5.0, 6.0]}]
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(TypeError, match="Python list of numbers"):
            find_max_batch(model, rows, torch.optim.SGD, max_batch=64)
    with pytest.raises(TypeError, match="Python list of numbers"):
        plan_max_batch(model, rows, torch.optim.SGD, "4MiB", max_batch=64)


@pytest.mark.slow
def test_rows_of_a_hugging_face_dataset_are_sized_as_their_batch() -> None:
    pytest.importorskip("transformers")
    from _models import bert

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (8, 32), generator=g)
    rows = [  # what dataset.with_format("torch")[i] gives for a tokenized text dataset
        {"input_ids": ids[i], "attention_mask": torch.ones(32, dtype=torch.long),
         "labels": torch.tensor(i % 4)}
        for i in range(8)
    ]
    results = []
    for sample in (rows, default_collate(rows)):
        torch.manual_seed(0)
        model = bert(width=32)
        with SimulatedGPU("16MiB") as gpu:
            gpu.adopt(model)
            results.append(search_batch_size(model, sample, torch.optim.AdamW, headroom=0,
                                             max_batch=4096))
    from_rows, from_batch = results
    assert from_rows.max_batch_size == from_batch.max_batch_size > 1
    assert [t.size for t in from_rows.trials] == [t.size for t in from_batch.trials]
