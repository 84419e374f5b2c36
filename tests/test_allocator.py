"""The caching-allocator model against hand-computed CUDA allocator behaviour (exact bytes), and
its invariants under random request sequences."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._blocks import (
    LARGE_BUFFER,
    SMALL_SIZE,
    AllocatorOutOfMemory,
    Block,
    allocation_size,
    round_size,
)

MiB = 1 << 20


def _layout(a: CachingAllocator) -> list[tuple[int, int, str]]:
    """(offset from the first block, size, state) of every mapped block, by address."""
    blocks = a.blocks()
    start = blocks[0][0] if blocks else 0
    return [(address - start, size, state) for address, size, state, _ in blocks]


# -- sizes, pools and segments ------------------------------------------------------------------


def test_requests_round_up_to_512_bytes() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]
    a = CachingAllocator(64 * MiB)
    blocks = [a.malloc(n) for n in (1, 512, 513)]
    assert [b.size for b in blocks] == [512, 512, 1024]
    assert a.allocated_bytes == 2048
    assert a.stats()["requested_bytes.all.current"] == 1026


def test_pool_and_segment_size_follow_the_request() -> None:
    # kSmallSize: a rounded request of up to 1 MiB comes from the small pool, in 2 MiB segments;
    # above it, under kMinLargeAlloc (10 MiB) a 20 MiB segment; from 10 MiB, the request
    # rounded up to kRoundLarge (2 MiB).
    assert allocation_size(round_size(SMALL_SIZE)) == 2 * MiB
    assert allocation_size(round_size(SMALL_SIZE + 1)) == 20 * MiB
    assert allocation_size(round_size(10 * MiB - 512)) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB
    for nbytes, segment in [
        (SMALL_SIZE, (2 * MiB, True)),
        (SMALL_SIZE + 1, (20 * MiB, False)),
        (10 * MiB - 512, (20 * MiB, False)),
        (10 * MiB, (10 * MiB, False)),
        (10 * MiB + 1, (12 * MiB, False)),
    ]:
        a = CachingAllocator(256 * MiB)
        a.malloc(nbytes)
        assert a.segments() == [segment], nbytes
        pool = "small_pool" if segment[1] else "large_pool"
        stats = a.stats()
        assert stats[f"reserved_bytes.{pool}.current"] == a.reserved_bytes == segment[0]
        assert stats["segment.all.current"] == stats[f"segment.{pool}.current"] == 1


def test_small_requests_share_a_small_segment_and_split_down_to_512_bytes() -> None:
    a = CachingAllocator(64 * MiB)
    first = a.malloc(SMALL_SIZE)  # half of a 2 MiB segment
    second = a.malloc(SMALL_SIZE - 512)  # leaves exactly 512 bytes: still split (>= 512)
    third = a.malloc(1)  # takes those 512 bytes
    assert a.segments() == [(2 * MiB, True)]
    assert (second.address - first.address, third.address - second.address) == (SMALL_SIZE, SMALL_SIZE - 512)
    assert a.allocated_bytes == a.reserved_bytes == 2 * MiB
    a.malloc(1)  # the segment is full: a second one
    assert a.segments() == [(2 * MiB, True), (2 * MiB, True)]


def test_large_blocks_split_only_when_more_than_1_mib_remains() -> None:
    a = CachingAllocator(64 * MiB)
    whole = a.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: not split, the block is 20 MiB
    assert whole.size == 20 * MiB
    assert a.allocated_bytes == 20 * MiB  # memory_allocated counts the whole block
    assert a.stats()["requested_bytes.all.current"] == 19 * MiB
    split = a.malloc(19 * MiB - 512)  # 1 MiB + 512 left: split
    assert split.size == 19 * MiB - 512
    assert a.allocated_bytes == 39 * MiB - 512
    assert _layout(a) == [
        (0, 20 * MiB, "allocated"),
        (20 * MiB, 19 * MiB - 512, "allocated"),
        (39 * MiB - 512, MiB + 512, "free"),
    ]


def test_requests_between_1_and_10_mib_pack_into_20_mib_segments() -> None:
    a = CachingAllocator(64 * MiB)
    blocks = [a.malloc(5 * MiB) for _ in range(4)]
    assert a.segments() == [(20 * MiB, False)]
    assert [b.address - blocks[0].address for b in blocks] == [0, 5 * MiB, 10 * MiB, 15 * MiB]
    a.malloc(5 * MiB)
    assert a.segments() == [(20 * MiB, False), (20 * MiB, False)]


# -- best fit, merging, caching -----------------------------------------------------------------


def test_best_fit_takes_the_smallest_free_block_then_the_lowest_address() -> None:
    a = CachingAllocator(64 * MiB)
    sizes = [2, 2, 4, 2, 3, 2, 2, 2]  # MiB, one 20 MiB segment (the last block takes 3 MiB)
    blocks = [a.malloc(n * MiB) for n in sizes]
    holes = {0: 2 * MiB, 2: 4 * MiB, 4: 3 * MiB, 6: 2 * MiB}  # index -> size, none adjacent
    for i in holes:
        a.free(blocks[i])
    offsets = {i: blocks[i].address - blocks[0].address for i in holes}
    got = a.malloc(2 * MiB + 512)  # fits the 3 MiB hole (not the 4 MiB): smallest that fits
    assert got.address - blocks[0].address == offsets[4]
    assert got.size == 3 * MiB  # 512 KiB less than a MiB left: not split
    twin = a.malloc(2 * MiB)  # two 2 MiB holes: the lower address
    assert twin.address - blocks[0].address == offsets[0]
    assert a.reserved_bytes == 20 * MiB


def test_freed_blocks_merge_with_free_neighbours() -> None:
    a = CachingAllocator(64 * MiB)
    x, y, z = (a.malloc(5 * MiB) for _ in range(3))
    a.free(x)
    a.free(z)  # merges with the free tail of the segment
    assert _layout(a) == [(0, 5 * MiB, "free"), (5 * MiB, 5 * MiB, "allocated"),
                          (10 * MiB, 10 * MiB, "free")]
    assert a.stats()["inactive_split_bytes.all.current"] == 15 * MiB
    a.free(y)  # joins both: the segment is one free block again
    assert _layout(a) == [(0, 20 * MiB, "free")]
    assert a.stats()["inactive_split_bytes.all.current"] == 0
    assert a.reserved_bytes == 20 * MiB
    assert a.allocated_bytes == 0


def test_a_segment_is_not_returned_while_any_block_in_it_is_allocated() -> None:
    a = CachingAllocator(64 * MiB)
    keep = a.malloc(2 * MiB)
    a.free(a.malloc(19 * MiB))  # too large for the 18 MiB left: its own, entirely free segment
    a.empty_cache()
    assert a.segments() == [(20 * MiB, False)]
    a.free(keep)
    a.empty_cache()
    assert a.segments() == []
    assert a.reserved_bytes == 0
    assert a.stats()["num_device_free"] == 2


# -- out of memory: release and retry -----------------------------------------------------------


def test_a_new_segment_that_does_not_fit_releases_the_free_cache_and_retries() -> None:
    a = CachingAllocator(30 * MiB)
    a.free(a.malloc(5 * MiB))  # a cached, entirely free 20 MiB segment
    block = a.malloc(24 * MiB)  # 20 + 24 > 30: release the cached segment, then 24 fits
    assert block.size == 24 * MiB
    assert a.segments() == [(24 * MiB, False)]
    assert a.num_alloc_retries == 1
    assert a.num_ooms == 0
    assert a.peak_reserved_bytes == 24 * MiB


def test_the_small_pool_retry_releases_large_segments_too() -> None:
    a = CachingAllocator(21 * MiB)
    a.free(a.malloc(5 * MiB))
    a.malloc(1000)  # a 2 MiB small segment: only after the 20 MiB one went back
    assert a.segments() == [(2 * MiB, True)]
    assert a.num_alloc_retries == 1


def test_out_of_memory_reports_the_segment_it_tried_and_the_state_after_release() -> None:
    a = CachingAllocator(30 * MiB)
    a.malloc(5 * MiB)  # a 20 MiB segment with 15 MiB free, which cannot be released
    a.free(a.malloc(2 * MiB))  # (freed blocks merge back into that 15 MiB)
    with pytest.raises(AllocatorOutOfMemory) as info:
        a.malloc(17 * MiB)
    oom = info.value
    assert (oom.size, oom.alloc_size) == (17 * MiB, 18 * MiB)
    assert (oom.allocated, oom.reserved, oom.free) == (5 * MiB, 20 * MiB, 10 * MiB)
    assert (a.num_alloc_retries, a.num_ooms) == (1, 1)
    assert a.allocated_bytes == 5 * MiB  # nothing half-done remains


def test_fragmentation_runs_out_with_most_of_the_device_unallocated() -> None:
    a = CachingAllocator(64 * MiB)
    blocks = [a.malloc(5 * MiB) for _ in range(12)]  # three 20 MiB segments
    for block in blocks[1:-1]:
        a.free(block)  # only the first and the last stay
    assert a.allocated_bytes == 10 * MiB
    assert a.reserved_bytes == 60 * MiB
    with pytest.raises(AllocatorOutOfMemory) as info:
        a.malloc(40 * MiB)
    # the middle segment was entirely free and went back; the two others hold 15 MiB holes
    assert (info.value.allocated, info.value.reserved) == (10 * MiB, 40 * MiB)
    assert a.num_alloc_retries == 1


def test_expandable_segments_avoid_that_fragmentation() -> None:
    a = CachingAllocator(64 * MiB, expandable_segments=True)
    blocks = [a.malloc(5 * MiB) for _ in range(12)]  # one segment, three 20 MiB pages
    assert a.segments() == [(60 * MiB, False)]
    for block in blocks[1:-1]:
        a.free(block)  # the holes are contiguous: one 50 MiB free block
    got = a.malloc(40 * MiB)
    assert got.address == blocks[1].address
    assert a.reserved_bytes == 60 * MiB
    assert a.num_alloc_retries == 0


# -- expandable segments ------------------------------------------------------------------------


def test_expandable_segments_grow_by_whole_pages() -> None:
    a = CachingAllocator(256 * MiB, expandable_segments=True)
    a.malloc(1000)
    assert a.segments() == [(2 * MiB, True)]  # kSmallBuffer pages in the small pool
    first = a.malloc(SMALL_SIZE + 1)
    assert a.reserved_bytes == 22 * MiB  # one kLargeBuffer page in the large pool
    second = a.malloc(25 * MiB)  # grows the free tail by one more page: it fits in 40 MiB
    assert second.address == first.address + SMALL_SIZE + 512
    assert sorted(a.segments()) == [(2 * MiB, True), (40 * MiB, False)]
    assert a.allocated_bytes == 1024 + SMALL_SIZE + 512 + 25 * MiB


def test_expandable_segments_split_any_remainder_of_512_bytes() -> None:
    a = CachingAllocator(64 * MiB, expandable_segments=True)
    block = a.malloc(19 * MiB)  # a 20 MiB page, 1 MiB left: split here (not without them)
    assert block.size == 19 * MiB
    assert a.allocated_bytes == 19 * MiB


def test_expandable_best_fit_keeps_the_growing_tail_for_last() -> None:
    a = CachingAllocator(64 * MiB, expandable_segments=True)
    first = a.malloc(2 * MiB)
    middle = a.malloc(12 * MiB)
    a.malloc(2 * MiB)  # the page's free tail is 4 MiB, and may grow
    a.free(middle)  # a 12 MiB hole
    got = a.malloc(3 * MiB)  # the tail would fit best by size; the hole is taken instead
    assert got.address == first.address + 2 * MiB


def test_expandable_release_unmaps_whole_free_pages_only() -> None:
    a = CachingAllocator(256 * MiB, expandable_segments=True)
    keep = a.malloc(SMALL_SIZE + 1)
    a.free(a.malloc(25 * MiB))  # 40 MiB mapped; free from 1 MiB + 512 to 40 MiB
    a.empty_cache()  # the second page is free as a whole, the first is not
    assert a.segments() == [(20 * MiB, False)]
    assert a.reserved_bytes == 20 * MiB
    a.free(keep)
    a.empty_cache()
    assert a.segments() == []
    assert a.reserved_bytes == 0


def test_expandable_refill_maps_the_unmapped_hole_first() -> None:
    a = CachingAllocator(256 * MiB, expandable_segments=True)
    pages = [a.malloc(20 * MiB) for _ in range(3)]  # three pages, exactly
    a.free(pages[1])
    a.empty_cache()  # the middle page is unmapped: two mapped ranges
    assert a.segments() == [(20 * MiB, False), (20 * MiB, False)]
    again = a.malloc(20 * MiB)  # the lowest address with room: the hole, not the end
    assert again.address == pages[1].address
    assert a.segments() == [(60 * MiB, False)]


# -- max_split_size -----------------------------------------------------------------------------


def test_max_split_size_keeps_large_blocks_whole_and_for_large_requests() -> None:
    a = CachingAllocator(128 * MiB, max_split_size=20 * MiB)
    a.free(a.malloc(40 * MiB))  # a cached 40 MiB block (oversize)
    big = a.malloc(30 * MiB)  # within max_non_split_rounding (20 MiB) of it: served, unsplit
    assert big.size == 40 * MiB
    assert a.segments() == [(40 * MiB, False)]
    a.free(big)
    small = a.malloc(5 * MiB)  # smaller than max_split_size: never cut from an oversize block
    assert small.size == 5 * MiB
    assert sorted(a.segments()) == [(20 * MiB, False), (40 * MiB, False)]
    far = a.malloc(20 * MiB)  # 40 >= 20 + 20: too much larger, a new segment
    assert far.size == 20 * MiB
    assert a.reserved_bytes == 80 * MiB
    assert a.stats()["max_split_size"] == 20 * MiB


def test_max_split_size_releases_oversize_blocks_before_a_retry() -> None:
    # release_available_cached_blocks: the smallest oversize block that covers
    # max(request, max_split_size) goes back, and the retry that follows is not counted
    a = CachingAllocator(64 * MiB, max_split_size=20 * MiB)
    a.free(a.malloc(24 * MiB))
    a.free(a.malloc(30 * MiB))
    a.malloc(12 * MiB)
    assert sorted(a.segments()) == [(12 * MiB, False), (30 * MiB, False)]
    assert a.num_alloc_retries == 0
    # no single one covers 40 MiB: the largest go back until 40 MiB did
    b = CachingAllocator(64 * MiB, max_split_size=20 * MiB)
    b.free(b.malloc(24 * MiB))
    b.free(b.malloc(30 * MiB))
    b.malloc(40 * MiB)
    assert b.segments() == [(40 * MiB, False)]
    assert b.num_alloc_retries == 0


def test_statistics_follow_cuda_key_names_and_reset_peaks() -> None:
    a = CachingAllocator(64 * MiB)
    x = a.malloc(5 * MiB)
    a.malloc(1000)
    a.free(x)
    stats = a.stats()
    assert stats["allocated_bytes.all.current"] == 1024
    assert stats["allocated_bytes.all.peak"] == 5 * MiB + 1024
    assert stats["allocated_bytes.large_pool.freed"] == 5 * MiB
    assert stats["reserved_bytes.all.current"] == stats["reserved_bytes.all.peak"] == 22 * MiB
    assert stats["allocation.all.current"] == 1
    assert stats["allocation.all.allocated"] == 2
    assert stats["segment.all.current"] == 2
    assert stats["max_split_size"] == -1  # "no limit", as torch reports it
    assert stats["num_device_alloc"] == 2
    assert stats["num_alloc_retries"] == 0
    a.reset_peak()
    assert a.stats()["allocated_bytes.all.peak"] == 1024
    assert a.peak_reserved_bytes == 22 * MiB


def test_a_free_arriving_in_the_middle_of_malloc_is_applied_before_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A storage's finalizer may run from the garbage collector while malloc is half done.
    a = CachingAllocator(64 * MiB)
    victim = a.malloc(5 * MiB)
    original = a._hand_out

    def hand_out_during_gc(block: Block, size: int, nbytes: int) -> Block:
        a.free(victim)
        return original(block, size, nbytes)

    monkeypatch.setattr(a, "_hand_out", hand_out_during_gc)
    got = a.malloc(3 * MiB)
    monkeypatch.setattr(a, "_hand_out", original)
    _check_invariants(a, {0: (got, 3 * MiB)})
    assert a.allocated_bytes == 3 * MiB
    assert a.malloc(5 * MiB).address == victim.address  # the freed block is back in the pool


def test_invalid_limit() -> None:
    with pytest.raises(ValueError, match="limit"):
        CachingAllocator(-1)


# -- properties ---------------------------------------------------------------------------------


def _check_invariants(a: CachingAllocator, live: dict[int, tuple[Block, int]]) -> None:
    blocks = a.blocks()
    # blocks never overlap, and the segments are exactly their blocks
    for (address, size, _, _), (following, _, _, _) in itertools.pairwise(blocks):
        assert address + size <= following
    assert sum(size for _, size, _, _ in blocks) == a.reserved_bytes
    assert sum(size for size, _ in a.segments()) == a.reserved_bytes
    # two free blocks are never neighbours in one segment (they merge)
    for segment in a._all_segments():
        states = [(b.allocated, b.mapped) for b in segment.blocks()]
        assert all(
            not (s == t and not s[0]) for s, t in itertools.pairwise(states)
        ), states
    free = [(address, size) for address, size, state, _ in blocks if state == "free"]
    assert sorted(free) == sorted(
        (b.address, b.size) for pool in (a._small, a._large) for b in pool.free.values()
    )
    allocated = sum(block.size for block, _ in live.values())
    assert a.allocated_bytes == allocated
    assert a.reserved_bytes >= a.allocated_bytes
    assert a.reserved_bytes <= a.limit
    assert a.peak_reserved_bytes >= a.reserved_bytes
    assert a.peak_allocated_bytes >= a.allocated_bytes
    stats = a.stats()
    for name in ("allocated_bytes", "reserved_bytes", "requested_bytes", "segment", "allocation"):
        assert stats[f"{name}.all.current"] == (
            stats[f"{name}.small_pool.current"] + stats[f"{name}.large_pool.current"]
        )
    assert stats["requested_bytes.all.current"] == sum(n for _, n in live.values())
    for block, nbytes in live.values():
        # a block is the rounded request, or a larger block handed out whole: a large-pool
        # remainder of at most 1 MiB, or an oversize block within max_non_split_rounding
        extra = block.size - round_size(nbytes)
        assert extra >= 0
        if a.expandable_segments or round_size(nbytes) <= SMALL_SIZE:
            assert extra == 0
        elif block.size < a.max_split_size:
            assert extra <= SMALL_SIZE
        else:
            assert extra < a.max_non_split_rounding


_SIZES = st.one_of(
    st.integers(1, 4096),
    st.integers(4096, SMALL_SIZE + 4096),
    st.integers(SMALL_SIZE, 12 * MiB),
    st.integers(12 * MiB, 48 * MiB),
)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), _SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    limit=st.integers(8 * MiB, 160 * MiB),
    expandable=st.booleans(),
    max_split=st.sampled_from([None, 20 * MiB, 32 * MiB]),
)
def test_random_requests_keep_every_invariant(
    ops: list[tuple[str, int]], limit: int, expandable: bool, max_split: int | None
) -> None:
    a = CachingAllocator(limit, expandable_segments=expandable, max_split_size=max_split)
    live: dict[int, tuple[Block, int]] = {}
    serial = 0
    for op, value in ops:
        if op == "malloc":
            before = a.allocated_bytes
            refused: AllocatorOutOfMemory | None = None
            try:
                live[serial] = (a.malloc(value), value)
                serial += 1
            except AllocatorOutOfMemory as oom:
                refused = oom
            if refused is not None:
                # refused only when the segment (or, expandable, the pages) it needs cannot fit
                # beside what stays reserved
                need = refused.alloc_size
                if expandable:
                    page = 2 * MiB if refused.size <= SMALL_SIZE else LARGE_BUFFER
                    need = max(need, -(-refused.size // page) * page)
                assert refused.reserved + need > limit
                assert a.allocated_bytes == before
        elif op == "free" and live:
            key = sorted(live)[value % len(live)]
            a.free(live.pop(key)[0])
        elif op == "empty_cache":
            a.empty_cache()
        _check_invariants(a, live)
    for block, _ in live.values():
        a.free(block)
    a.empty_cache()
    assert a.reserved_bytes == 0
    assert a.allocated_bytes == 0
    assert a.segments() == []
    _check_invariants(a, {})


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(_SIZES, min_size=1, max_size=30),
    order=st.randoms(use_true_random=False),
    expandable=st.booleans(),
)
def test_freeing_everything_merges_each_segment_back_into_one_free_block(
    sizes: list[int], order: object, expandable: bool
) -> None:
    a = CachingAllocator(1 << 40, expandable_segments=expandable)
    blocks = [a.malloc(n) for n in sizes]
    reserved = a.reserved_bytes
    order.shuffle(blocks)  # type: ignore[attr-defined]
    for block in blocks:
        a.free(block)
    assert a.reserved_bytes == reserved
    assert a.allocated_bytes == 0
    # every segment (every mapped range) is one free block, none is split
    assert [(size, "free") for size, _ in a.segments()] == [
        (size, state) for _, size, state, _ in a.blocks()
    ]
    assert a.stats()["inactive_split_bytes.all.current"] == 0


def test_a_request_larger_than_an_expandable_segment_is_refused() -> None:
    a = CachingAllocator(100 * MiB, expandable_segments=True, address_space=20 * MiB)
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(30 * MiB)
    assert a.allocated_bytes == 0


# -- from a memory snapshot ---------------------------------------------------------------------


def _current(a: CachingAllocator) -> dict[str, int]:
    """Every counter that describes the state (not its history)."""
    return {k: v for k, v in a.stats().items() if k.endswith(".current") or k == "max_split_size"}


def _shape(a: CachingAllocator) -> list[tuple[bool, list[tuple[int, str]]]]:
    """Each mapped range's pool and blocks (size, state), by address: the layout, without the
    addresses that new segments happen to get."""
    blocks = a.blocks()
    found = []
    for start, size, small in a._segment_ranges():
        found.append((small, [(s, state) for at, s, state, _ in blocks if start <= at < start + size]))
    return found


def _malloc(a: CachingAllocator, nbytes: int) -> Block | None:
    try:
        return a.malloc(nbytes)
    except AllocatorOutOfMemory:
        return None


def _build(ops: list[tuple[str, int]], a: CachingAllocator) -> list[Block]:
    """The state ``ops`` leave ``a`` in: its allocated blocks."""
    live: list[Block] = []
    for op, value in ops:
        if op == "malloc":
            block = _malloc(a, value)
            if block is not None:
                live.append(block)
        elif op == "free" and live:
            a.free(live.pop(value % len(live)))
        elif op == "empty_cache":
            a.empty_cache()
    return live


def test_a_snapshot_names_torchs_fields_and_reads_back_into_the_same_allocator() -> None:
    a = CachingAllocator(256 * MiB)
    kept = [a.malloc(n) for n in (1000, 3 * MiB, 5 * MiB, 30 * MiB)]
    a.free(kept[2])
    first, *_ = snapshot = a.snapshot(device=1)
    assert [s["segment_type"] for s in snapshot] == ["small", "large", "large"]
    assert first == {
        "device": 1, "address": kept[0].address, "total_size": 2 * MiB,
        "allocated_size": 1024, "active_size": 1024, "requested_size": 1000, "stream": 0,
        "segment_type": "small", "segment_pool_id": (0, 0), "is_expandable": False,
        "blocks": [
            {"address": kept[0].address, "size": 1024, "requested_size": 1000,
             "state": "active_allocated"},
            {"address": kept[0].address + 1024, "size": 2 * MiB - 1024, "requested_size": 0,
             "state": "inactive"},
        ],
    }
    b = CachingAllocator.from_snapshot(snapshot, 256 * MiB)
    assert b.blocks() == a.blocks()
    assert _current(b) == _current(a)
    assert b.snapshot(device=1) == snapshot
    assert b.peak_allocated_bytes == b.allocated_bytes  # a snapshot knows no history
    # blocks taken from a snapshot are freed, merged and reused like any other
    for block in b._all_segments()[1].blocks():
        if block.allocated:
            b.free(block)
    assert _layout(b)[2:4] == [(2 * MiB, 20 * MiB, "free"), (22 * MiB, 30 * MiB, "allocated")]
    assert b.malloc(20 * MiB).address == a.blocks()[2][0]
    assert CachingAllocator.from_snapshot([], 8 * MiB).blocks() == []


def test_an_expandable_snapshot_is_one_segment_per_mapped_range() -> None:
    a = CachingAllocator(1 << 40, expandable_segments=True, address_space=400 * MiB)
    blocks = [a.malloc(n) for n in (20 * MiB, 20 * MiB, 20 * MiB, 1000)]
    a.free(blocks[1])
    a.empty_cache()  # unmaps the 20 MiB page in the middle, which blocks[1] freed
    snapshot = a.snapshot()
    assert [(s["total_size"] // MiB, s["segment_type"]) for s in snapshot] == [
        (20, "large"), (20, "large"), (2, "small"),
    ]
    assert {s["is_expandable"] for s in snapshot} == {True}
    b = CachingAllocator.from_snapshot(snapshot, 1 << 40, expandable_segments=True, address_space=400 * MiB)
    assert b.blocks() == a.blocks()
    assert b.snapshot() == snapshot
    assert b.replay([(0, 15 * MiB), (1, 30 * MiB)]) == a.replay([(0, 15 * MiB), (1, 30 * MiB)])


def test_an_expandable_segment_starts_at_its_first_mapped_page() -> None:
    # The snapshot does not show unmapped pages before the first mapped one: the model's
    # segment starts there, so what needs that room is placed elsewhere (the layout is the
    # same, the counters too).
    a = CachingAllocator(1 << 40, expandable_segments=True, address_space=400 * MiB)
    head, tail = a.malloc(20 * MiB), a.malloc(20 * MiB)
    a.free(head)
    a.empty_cache()
    b = CachingAllocator.from_snapshot(a.snapshot(), 1 << 40, expandable_segments=True, address_space=400 * MiB)
    assert (b.blocks(), _current(b)) == (a.blocks(), _current(a))
    assert a.malloc(20 * MiB).address == head.address
    assert b.malloc(20 * MiB).address == tail.address + 20 * MiB


_STATE_OPS = st.lists(
    st.one_of(st.tuples(st.just("malloc"), _SIZES), st.tuples(st.just("free"), st.integers(0, 1000))),
    max_size=40,
)
_NEXT_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), _SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),  # a block of the continuation
        st.tuples(st.just("free_old"), st.integers(0, 1000)),  # a block of the snapshot
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    state=_STATE_OPS,
    empty=st.booleans(),
    following=_NEXT_OPS,
    limit=st.integers(8 * MiB, 160 * MiB),
    expandable=st.booleans(),
    max_split=st.sampled_from([None, 20 * MiB, 32 * MiB]),
)
def test_an_allocator_rebuilt_from_its_snapshot_goes_on_as_the_original(
    state: list[tuple[str, int]], empty: bool, following: list[tuple[str, int]], limit: int,
    expandable: bool, max_split: int | None,
) -> None:
    options: dict[str, Any] = {"expandable_segments": expandable, "max_split_size": max_split}
    # Under the limit, with the cache released along the way; expandable segments without
    # pressure, since a snapshot does not show the pages a release unmapped before the first
    # mapped one (see the test above).
    a = CachingAllocator(1 << 40 if expandable else limit, **options)
    old = _build(state + ([("empty_cache", 0)] if empty and not expandable else []), a)
    a.limit = limit = max(limit, a.reserved_bytes)
    b = CachingAllocator.from_snapshot(a.snapshot(), limit, address_space=a.address_space, **options)
    assert b.blocks() == a.blocks()
    assert _current(b) == _current(a)
    found = {block.address: block for s in b._all_segments() for block in s.blocks() if block.allocated}
    twins = [(block, found[block.address]) for block in old]
    _check_invariants(b, {i: (twin, block.requested) for i, (block, twin) in enumerate(twins)})
    # a replay (the search's use), then the same requests made for real on both
    events, serial, live = [], 0, []
    for op, value in following:
        if op == "malloc":
            events.append((serial, value))
            live.append(serial)
            serial += 1
        elif op == "free" and live:
            events.append((live.pop(value % len(live)), -1))
    assert b.replay(events) == a.replay(events)
    made: list[tuple[Block | None, Block | None]] = []
    for op, value in following:
        if op == "malloc":
            pair = (_malloc(a, value), _malloc(b, value))
            assert (pair[0] is None) == (pair[1] is None)
            made.append(pair)
        elif op in ("free", "free_old") and (made if op == "free" else twins):
            pool = made if op == "free" else twins
            x, y = pool.pop(value % len(pool))
            if x is not None and y is not None:
                a.free(x)
                b.free(y)
        assert _shape(b) == _shape(a)
        assert _current(b) == _current(a)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    state=_STATE_OPS,
    following=_NEXT_OPS,
    limit=st.integers(8 * MiB, 160 * MiB),
    expandable=st.booleans(),
    max_split=st.sampled_from([None, 20 * MiB, 32 * MiB]),
)
def test_a_copy_goes_on_as_the_original_and_leaves_it_as_it_was(
    state: list[tuple[str, int]], following: list[tuple[str, int]], limit: int,
    expandable: bool, max_split: int | None,
) -> None:
    """The replay's copy (a structural one, not the generic deep copy): it goes on exactly as
    an allocator that made the same requests itself, its blocks are its own (each old block's
    copy in the memo), and the original stays as it was."""
    options: dict[str, Any] = {"expandable_segments": expandable, "max_split_size": max_split}
    a = CachingAllocator(limit, **options)
    old = _build(state, a)
    before = (a.blocks(), a.stats(), _shape(a))
    memo: dict[int, object] = {}
    b = copy.deepcopy(a, memo)
    twins = [memo[id(block)] for block in old]
    assert all(isinstance(t, Block) and t is not block for block, t in zip(old, twins, strict=True))
    _check_invariants(b, {i: (t, block.requested)  # type: ignore[misc]
                          for i, (block, t) in enumerate(zip(old, twins, strict=True))})
    r = CachingAllocator(limit, **options)  # the same requests, made by an allocator itself
    pairs: list[tuple[Any, Any]] = list(zip(twins, _build(state, r), strict=True))
    made: list[tuple[Block | None, Block | None]] = []
    for op, value in following:
        if op == "malloc":
            pair = (_malloc(b, value), _malloc(r, value))
            assert (pair[0] is None) == (pair[1] is None)
            made.append(pair)
        elif op in ("free", "free_old") and (made if op == "free" else pairs):
            x, y = (made if op == "free" else pairs).pop(value % len(made if op == "free" else pairs))
            if x is not None and y is not None:
                b.free(x)
                r.free(y)
        assert (b.blocks(), b.stats(), _shape(b)) == (r.blocks(), r.stats(), _shape(r))
        assert (a.blocks(), a.stats(), _shape(a)) == before
