"""The recovery engine under CUDA's caching allocator (the simulated one): thrashing detected and
shrunk before an OOM, no oscillation after a grow that fragments memory, and the fragmentation
hint at an OOM, logged once."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from autobatch._recovery import _thrash, oom_guard, retry_on_oom
from autobatch._recovery._thrash import THRASH_STEPS
from autobatch.testing import SimulatedGPU
from autobatch.testing._simulator import SimulatedMemory

MiB = 1 << 20


def _fragmenting(batch: torch.Tensor) -> int:
    """A step whose memory comes from both pools by turns: one 1 MiB small-pool block per row
    (2 MiB segments, two blocks each), then one large block of 2 MiB per row. In 48 MiB, above
    10 rows the cached segments of one pool keep the other's new segment out, so the allocator
    releases its cache and retries in every step, without running out."""
    rows = len(batch)
    small = [torch.empty(MiB, dtype=torch.uint8) for _ in range(rows)]
    del small
    large = torch.empty(2 * rows * MiB, dtype=torch.uint8)
    del large
    return rows


def test_retries_in_step_after_step_shrink_the_batch_before_it_runs_out() -> None:
    step = retry_on_oom(policy="shrink")(_fragmenting)
    with SimulatedGPU("48MiB", allocator="caching") as gpu:
        retries = []
        done = []
        for _ in range(10):
            done.append(step(torch.zeros(20, 1)))
            retries.append(gpu.num_alloc_retries)
    stats = step.stats
    assert stats.ooms == 0
    # the first call's count is the baseline; the change is recorded after the third call
    # that retried (SizeChange.step counts the calls done)
    assert [(c.step, c.old, c.new, c.reason) for c in stats.history] == [
        (THRASH_STEPS + 1, None, 10, "thrashing")
    ]
    assert stats.shrinks == 1
    assert done == [20] * 10  # every row of every batch, in pieces after the shrink
    grew = [b - a for a, b in itertools.pairwise(retries)]
    assert all(grew[:THRASH_STEPS])  # it thrashed until the watch saw enough steps
    # one more retry as pieces of 10 move in (the 40 MiB segment released), then never again
    assert not any(grew[THRASH_STEPS + 1 :])


def test_a_still_retry_count_is_read_every_few_steps_then_after_every_step_once_it_rises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA's retry count comes from ``memory_stats`` (a dictionary built per read, tens of
    microseconds): a step that never retries reads it once every ``THRASH_EVERY`` steps; once it
    rises, after every step, so thrashing is still met within a few steps of its start."""
    reads = []
    real = SimulatedMemory.alloc_retries

    def counted(self: SimulatedMemory) -> int:
        reads.append(1)
        return real(self)

    monkeypatch.setattr(SimulatedMemory, "alloc_retries", counted)
    with SimulatedGPU("48MiB", allocator="caching"):
        step = retry_on_oom(policy="shrink")(_fragmenting)
        calls = 8 * _thrash.THRASH_EVERY
        for _ in range(calls):
            step(torch.zeros(10, 1))  # no retry
        assert len(reads) <= calls // _thrash.THRASH_EVERY + 2
        assert step.stats.changes == 0
        for _ in range(_thrash.THRASH_EVERY + THRASH_STEPS):
            step(torch.zeros(20, 1))  # a retry in every step
    assert [c.reason for c in step.stats.history] == ["thrashing"]


def test_no_thrashing_no_change_and_no_watch_without_a_caching_allocator() -> None:
    step = retry_on_oom(policy="shrink")(_fragmenting)
    with SimulatedGPU("48MiB", allocator="caching"):
        for _ in range(6):
            step(torch.zeros(10, 1))  # both pools fit side by side: no retry
    with SimulatedGPU("48MiB", allocator="exact"):  # the exact model keeps no cache
        for _ in range(6):
            step(torch.zeros(20, 1))
    assert step.stats.changes == 0


def test_after_a_grow_that_thrashes_it_does_not_grow_back_for_a_long_while() -> None:
    """Growing from 10 to 20 rows brings the thrashing back: the size goes back to 10, and the
    next grow waits twice as long each time (no oscillation between the two sizes)."""
    step = retry_on_oom(policy="shrink", grow_after=2)(_fragmenting)
    batches = [torch.zeros(20, 1) for _ in range(80)]
    with SimulatedGPU("48MiB", allocator="caching"), oom_guard(batches) as guard:
        for batch in guard:
            step(batch)
    history = [(c.reason, c.old, c.new) for c in step.stats.history]
    assert history[0] == ("thrashing", None, 10)
    grows = [i for i, (reason, _, _) in enumerate(history) if reason == "grow"]
    assert all(history[i + 1] == ("thrashing", 20, 10) for i in grows if i + 1 < len(history))
    starts = [c.step for c in step.stats.history if c.reason == "grow"]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 80 calls: grows after 2, 4, 8, 16, 32 clean calls (each thrashing for a few), never
    # one every few calls
    assert len(starts) <= 5
    assert all(b > a for a, b in itertools.pairwise(gaps))
    assert step.stats.ooms == 0


def _pinning(batch: torch.Tensor) -> int:
    """Two 20 MiB segments, each left with 18 MiB free beside a 2 MiB block still in use, then
    one block of a MiB per row: above 18 rows it needs a third segment, which 48 MiB cannot
    hold, while most of the reserved memory is cached but unallocated."""
    fillers = [torch.empty(9 * MiB, dtype=torch.uint8) for _ in range(4)]  # two per segment
    pins = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(2)]  # the rest of each
    del fillers
    whole = torch.empty(len(batch) * MiB, dtype=torch.uint8)
    del whole, pins
    return len(batch)


def test_an_oom_in_a_fragmented_cache_empties_it_and_hints_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_thrash, "_hinted", False)
    first = retry_on_oom(policy="shrink")(_pinning)
    second = retry_on_oom(policy="shrink")(_pinning)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        for step in (first, second):
            with SimulatedGPU("48MiB", allocator="caching"):
                assert step(torch.zeros(20, 1)) == 20
    hints = [r for r in caplog.records if "expandable_segments:True" in r.getMessage()]
    assert first.stats.ooms == second.stats.ooms == 1
    assert len(hints) == 1  # once per process, however many OOMs
    assert hints[0].levelno == logging.WARNING
    assert "cached but unallocated" in hints[0].getMessage()


def test_no_hint_when_the_oom_is_not_fragmentation(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_thrash, "_hinted", False)

    @retry_on_oom(policy="shrink")
    def step(batch: torch.Tensor) -> int:
        whole = torch.empty(len(batch) * MiB, dtype=torch.uint8)  # one segment, in full use
        del whole
        return len(batch)

    with caplog.at_level(logging.WARNING, logger="autobatch"), SimulatedGPU(
        "48MiB", allocator="caching"
    ):
        step(torch.zeros(60, 1))
    assert step.stats.ooms == 1
    assert not [r for r in caplog.records if "expandable_segments" in r.getMessage()]
