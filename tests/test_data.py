"""The memory-aware batch sampler: every sample once, no batch larger than its length allows."""

from __future__ import annotations

import doctest
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import autobatch.data
from autobatch.data import MemoryAwareBatchSampler


def _table(length: int) -> int:
    """A memory budget of 512 tokens per batch, quadratic in the length past 32."""
    cost = length if length <= 32 else length * length // 32
    return max(1, 512 // max(cost, 1))


lengths_st = st.lists(st.integers(1, 128), min_size=1, max_size=300)
FAST = settings(max_examples=80, deadline=None)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 5), bucket=st.integers(1, 400),
       shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_every_index_once_and_no_batch_above_its_size(
    lengths: list[int], seed: int, bucket: int, shuffle: bool, epoch: int
) -> None:
    sampler = MemoryAwareBatchSampler(lengths, _table, shuffle=shuffle, seed=seed,
                                      bucket_size=bucket)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert len(sampler) == len(batches)
    for batch in batches:
        assert 1 <= len(batch) <= _table(max(lengths[i] for i in batch))


@FAST
@given(lengths=lengths_st, bucket=st.integers(1, 400))
def test_batches_group_lengths_within_a_bucket(lengths: list[int], bucket: int) -> None:
    sampler = MemoryAwareBatchSampler(lengths, _table, shuffle=False, bucket_size=bucket)
    position = 0
    for batch in sampler:  # unshuffled: the buckets' sorted runs, in order
        assert position // bucket == (position + len(batch) - 1) // bucket  # one bucket each
        in_bucket = sorted(range(position // bucket * bucket,
                                 min(len(lengths), (position // bucket + 1) * bucket)),
                           key=lengths.__getitem__)
        assert [lengths[i] for i in batch] == sorted(lengths[i] for i in batch)
        assert set(batch) <= set(in_bucket)
        position += len(batch)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 3), replicas=st.integers(1, 4),
       drop_last=st.booleans())
def test_every_rank_gets_as_many_batches_of_the_same_sizes(
    lengths: list[int], seed: int, replicas: int, drop_last: bool
) -> None:
    ranks = [
        list(MemoryAwareBatchSampler(lengths, _table, seed=seed, num_replicas=replicas, rank=r,
                                     drop_last=drop_last))
        for r in range(replicas)
    ]
    assert len({len(r) for r in ranks}) == 1
    for step in zip(*ranks, strict=True):
        assert len({len(b) for b in step}) == 1  # one size per step: the guard can split alike
        for batch in step:
            assert len(batch) <= _table(max(lengths[i] for i in batch))
    seen = Counter(i for r in ranks for b in r for i in b)
    if not drop_last:
        assert set(seen) == set(range(len(lengths)))
    assert max(seen.values(), default=0) <= replicas  # top-ups repeat samples of a short batch


def test_drop_last_drops_only_each_buckets_unfilled_last_batch() -> None:
    lengths = [10] * 37 + [100] * 9 + [10] * 60
    kept = MemoryAwareBatchSampler(lengths, _table, shuffle=False, bucket_size=46)
    dropped = MemoryAwareBatchSampler(lengths, _table, shuffle=False, bucket_size=46,
                                      drop_last=True)
    everything = list(kept)
    # bucket 1: 37 short rows (cut where the long ones start: kept), 9 long ones (full, 1 each);
    # buckets 2 and 3: 46 and 14 short rows, where 51 fit: unfilled last batches, dropped
    assert [len(b) for b in everything] == [37] + [1] * 9 + [46, 14]
    assert list(dropped) == everything[:-2]


def test_a_seed_is_deterministic_and_an_epoch_reshuffles() -> None:
    lengths = [int(x) for x in torch.randint(1, 100, (500,), generator=torch.Generator().manual_seed(0))]
    a = MemoryAwareBatchSampler(lengths, _table, seed=3)
    b = MemoryAwareBatchSampler(lengths, _table, seed=3)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert sorted(i for batch in a for i in batch) == list(range(500))


def test_works_as_a_dataloader_batch_sampler_with_max_batch() -> None:
    lengths = [3, 4, 5, 6, 7, 8, 9, 10]
    data = [torch.full((n,), float(i)) for i, n in enumerate(lengths)]

    def pad(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)

    sampler = MemoryAwareBatchSampler(lengths, lambda n: 100, max_batch=3, seed=1)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=pad)
    shapes = [tuple(b.shape) for b in loader]
    assert sum(s[0] for s in shapes) == 8
    assert max(s[0] for s in shapes) <= 3


class _GappedTable:
    """A table whose sizes fit up to ``largest`` except a gap (CUDA's caching allocator: a size
    can need one more segment than a larger one), and which says so."""

    def __init__(self, largest: int, gap: range) -> None:
        self.largest, self.gap, self.asked = largest, gap, 0

    def batch_size(self, length: int) -> int:
        return self.largest

    def fits(self, length: int, size: int) -> bool | None:
        self.asked += 1
        return size <= self.largest and size not in self.gap


@FAST
@given(count=st.integers(1, 400), largest=st.integers(2, 60), start=st.integers(1, 60),
       width=st.integers(0, 30), replicas=st.integers(1, 3), bucket=st.integers(1, 500))
def test_batches_the_table_knows_not_to_fit_are_cut_into_ones_it_does_not_rule_out(
    count: int, largest: int, start: int, width: int, replicas: int, bucket: int
) -> None:
    """Every batch (per rank) is one the table does not rule out; every index still comes,
    and the ranks still get equal batches; a batch is cut only where it must be."""
    table = _GappedTable(largest, range(start, start + width))
    lengths = [7] * count
    ranks = [
        list(MemoryAwareBatchSampler(lengths, table, seed=1, bucket_size=bucket,
                                     num_replicas=replicas, rank=r))
        for r in range(replicas)
    ]
    for step in zip(*ranks, strict=True):
        assert len({len(b) for b in step}) == 1
        assert len(step[0]) == 1 or table.fits(7, len(step[0]))
    seen = {i for r in ranks for b in r for i in b}
    assert seen == set(range(count))
    uncut = MemoryAwareBatchSampler(lengths, lambda n: largest, seed=1, bucket_size=bucket,
                                    num_replicas=replicas)
    cut = MemoryAwareBatchSampler(lengths, table, seed=1, bucket_size=bucket,
                                  num_replicas=replicas)
    if all(table.fits(7, -(-len(b) // replicas)) for b in uncut._packed()):
        assert cut._packed() == uncut._packed()


def test_a_batch_in_a_gap_is_cut_into_the_largest_that_fits_and_the_rest() -> None:
    table = _GappedTable(40, range(20, 36))
    batches = list(MemoryAwareBatchSampler([5] * 70, table, shuffle=False))
    assert [len(b) for b in batches] == [40, 19, 11]  # 30 is in the gap: 19 and 11
    asked = table.asked
    list(MemoryAwareBatchSampler([5] * 70, table, shuffle=False))
    assert table.asked == asked + 14  # 40; 30, 29, ..., 20; 19; 11: each size asked once


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="table"):
        MemoryAwareBatchSampler([1, 2], 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        MemoryAwareBatchSampler([1, 2], _table, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="max_batch"):
        MemoryAwareBatchSampler([1, 2], _table, max_batch=0)
    with pytest.raises(ValueError, match="does not fit"):
        list(MemoryAwareBatchSampler([1, 2], lambda n: 0))
    with pytest.raises(TypeError, match="length"):
        MemoryAwareBatchSampler([1.5, 2], _table)  # type: ignore[list-item]


def test_docstring_examples_run() -> None:
    assert doctest.testmod(autobatch.data).failed == 0
