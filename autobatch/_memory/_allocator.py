"""A model of PyTorch's CUDA caching allocator: the simulated GPU's allocator, and the copy of a
real device's allocator that the search replays storages through.

Pure Python, no torch: :class:`~autobatch.testing.SimulatedGPU` hands it the byte size of every
storage it sees and frees the block when the storage dies; a real device's backend builds one
from ``torch.cuda.memory_snapshot()`` (:meth:`CachingAllocator.from_snapshot`). The policy is the one of
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``); option parsing follows
``c10/core/AllocatorConfig.cpp``. Constants keep the source's names in comments; every rule
below cites the function it models. Not modelled: streams (one stream, so no cross-stream
events), CUDA graphs and private pools, ``garbage_collection_threshold``,
``roundup_power2_divisions`` and the CUDA context's own memory.

Data structures: each pool keeps its free, mapped blocks as a sorted list of integer keys
``size << 64 | address`` (best fit is one ``bisect``: the smallest block that is large enough,
the lowest address among equals, as the source's ``BlockComparatorSize`` orders them) and a
dict from key to block. Blocks of a segment form a doubly linked list in address order, so
splitting and merging touch only neighbours.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any

from autobatch._memory._blocks import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SHIFT,
    SMALL_SIZE,
    UNLIMITED,
    AllocatorOutOfMemory,
    Block,
    Pool,
    Segment,
    Stat,
    allocation_size,
    round_size,
)
from autobatch._memory._snapshot import (
    SegmentRecord,
    read_snapshot,
    write_snapshot,
)

#: The fields of each of CUDA's ``Stat`` counters, as ``torch.cuda.memory_stats()`` reports them.
_FIELDS = ("current", "peak", "allocated", "freed")


class CachingAllocator:
    """PyTorch's CUDA caching allocator on one device and one stream, as a deterministic model.

    >>> a = CachingAllocator(limit=64 << 20)
    >>> x = a.malloc(1000)                          # small pool: one 2 MiB segment
    >>> a.allocated_bytes, a.reserved_bytes, a.segments()
    (1024, 2097152, [(2097152, True)])
    >>> a.free(x); a.empty_cache(); a.reserved_bytes
    0

    Args:
        limit: Bytes the allocator may reserve in all (the device's memory less what other processes
            hold, or a per-process cap as set by ``torch.cuda.set_per_process_memory_fraction``).
        expandable_segments: One segment per pool that grows by whole pages
            (``expandable_segments:True``).
        max_split_size: Blocks of this size or more are never split (``max_split_size_mb``, in
            bytes).
        max_non_split_rounding: How much larger than a request (itself ``>= max_split_size``) an
            unsplittable cached block may be and still serve it (``max_non_split_rounding_mb``, in
            bytes).
        address_space: Bytes of address space an expandable segment spans (the source takes 9/8 of
            the device's memory); defaults to 9/8 of ``limit``.
    """

    def __init__(
        self,
        limit: int,
        *,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        max_non_split_rounding: int = LARGE_BUFFER,
        address_space: int | None = None,
    ) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 bytes, got {limit!r}")
        self.limit = limit
        self.expandable_segments = expandable_segments
        self.max_split_size = UNLIMITED if max_split_size is None else max_split_size
        self.max_non_split_rounding = max_non_split_rounding
        self.address_space = limit + limit // 8 if address_space is None else address_space
        self._small = Pool(small=True)
        self._large = Pool(small=False)
        self._segments: dict[int, Segment] = {}  # the cudaMalloc'd segments, by base address
        self._next_address = 1 << 32  # addresses are virtual; new segments never overlap
        self._pending: list[Block] = []  # freed blocks not yet returned to their pool
        self._lock = threading.Lock()
        self.allocated_bytes_stat = Stat()
        self.requested_bytes_stat = Stat()
        self.reserved_bytes_stat = Stat()
        self.allocation_stat = Stat()
        self.segment_stat = Stat()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    @classmethod
    def from_snapshot(
        cls,
        segments: Iterable[Mapping[str, Any]],
        limit: int,
        *,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        max_non_split_rounding: int = LARGE_BUFFER,
        address_space: int | None = None,
        device: int | None = None,
        stream: int = 0,
    ) -> CachingAllocator:
        """The allocator a memory snapshot describes (``torch.cuda.memory_snapshot()``'s list,
        or :meth:`snapshot`'s): its segments, their blocks, allocated or free, in their pools,
        and the counters that follow (each peak at its current value).

        >>> a = CachingAllocator(limit=64 << 20)
        >>> x, y = a.malloc(3 << 20), a.malloc(1000)
        >>> a.free(x)
        >>> b = CachingAllocator.from_snapshot(a.snapshot(), 64 << 20)
        >>> b.blocks() == a.blocks(), (b.allocated_bytes, b.reserved_bytes) == (1024, 22 << 20)
        (True, True)

        Raises :class:`~autobatch._memory._snapshot.NotModelled` (a ``ValueError``) for what the model
        cannot represent (see :func:`~autobatch._memory._snapshot.read_snapshot`). Of an expandable
        segment the snapshot shows the mapped pages only: the model's starts at the first of
        them. New segments go above every segment there is, where a device may place them
        anywhere (which only decides between cached blocks of one size).

        Args:
            segments: The snapshot.
            limit: Bytes the allocator may reserve in all, what it holds already included.
            expandable_segments, max_split_size, max_non_split_rounding, address_space: As for
                the constructor; the setting the snapshot's allocator runs with.
            device: The device whose segments to take (every device's when ``None``).
            stream: The stream allocations are made on; other streams' segments may only hold
                allocated blocks.
        """
        model = cls(
            limit, expandable_segments=expandable_segments, max_split_size=max_split_size,
            max_non_split_rounding=max_non_split_rounding, address_space=address_space,
        )
        records = read_snapshot(
            segments, expandable_segments=expandable_segments,
            address_space=model.address_space, device=device, stream=stream,
        )
        for record in records:
            model._adopt(record)
        model._next_address = max([model._next_address, *(r.base + r.size for r in records)])
        return model

    def _adopt(self, record: SegmentRecord) -> None:
        """Take a segment of a snapshot in, and count it (as ``alloc_block`` or ``map_block``
        and ``alloc_found_block`` would have)."""
        pool = self._small if record.small else self._large
        segment = Segment(record.base, record.size, pool, expandable=record.expandable)
        segment.carve(record.pieces)
        if record.expandable:
            pool.expandable.append(segment)
        else:
            self._segments[segment.base] = segment
            self.segment_stat.increase(1)
            pool.segment.increase(1)
        for block in segment.blocks():
            if not block.mapped:
                continue
            self.reserved_bytes_stat.increase(block.size)
            pool.reserved_bytes.increase(block.size)
            if not block.allocated:
                pool.insert(block)
                continue
            for total, stat, amount in (
                (self.allocated_bytes_stat, pool.allocated_bytes, block.size),
                (self.requested_bytes_stat, pool.requested_bytes, block.requested),
                (self.allocation_stat, pool.allocation, 1),
            ):
                total.increase(amount)
                stat.increase(amount)

    # -- the public surface ----------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks (``torch.cuda.memory_allocated``).

        A block is the request rounded up to 512 bytes, or larger: a large-pool block whose
        remainder is 1 MiB or less is handed out whole, and an unsplittable cached block
        (``max_split_size``) serves requests up to ``max_non_split_rounding`` smaller; the
        source counts the whole block (``alloc_found_block`` adds ``block->size``).
        """
        self._flush()
        return self.allocated_bytes_stat.current

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device: every segment, or every mapped page."""
        return self.reserved_bytes_stat.current

    @property
    def peak_reserved_bytes(self) -> int:
        """Highest :attr:`reserved_bytes` since creation or the last :meth:`reset_peak`."""
        return self.reserved_bytes_stat.peak

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest :attr:`allocated_bytes` since creation or the last :meth:`reset_peak`."""
        self._flush()
        return self.allocated_bytes_stat.peak

    def malloc(self, nbytes: int) -> Block:
        """Allocate a block for ``nbytes`` (``DeviceCachingAllocator::malloc``).

        Raises :class:`AllocatorOutOfMemory` when no cached block fits and no new segment can
        be reserved, even after the cache was released.
        """
        with self._lock:
            if self._pending:
                self._return_pending()
            size = round_size(nbytes)
            pool = self._small if size <= SMALL_SIZE else self._large
            block = self._cached_block(pool, size)
            if block is None:
                block = self._new_block(pool, size)
            return self._hand_out(block, size, nbytes)

    def free(self, block: Block) -> None:
        """Give an allocated block back (``DeviceCachingAllocator::free``).

        Safe to call from a garbage-collection callback in the middle of :meth:`malloc`: the
        block joins its pool (merging with free neighbours) before the next request or read.
        """
        self._pending.append(block)  # list.append is atomic; the pools are touched under the lock

    def empty_cache(self) -> None:
        """Release every cached segment that is entirely free, and unmap the free pages of
        expandable segments (``torch.cuda.empty_cache``, ``release_cached_blocks``)."""
        with self._lock:
            if self._pending:
                self._return_pending()
            self._release_cached()

    def reset_peak(self) -> None:
        """Make every current value its peak (``torch.cuda.reset_peak_memory_stats``)."""
        with self._lock:
            if self._pending:
                self._return_pending()
            for stat in self._all_stats():
                stat.peak = stat.current

    def segments(self) -> list[tuple[int, bool]]:
        """``(size, small pool)`` of every segment, by address; an expandable segment counts
        one segment per contiguous mapped range, as ``torch.cuda.memory_snapshot`` does."""
        return [(size, small) for _, size, small in self._segment_ranges()]

    def blocks(self) -> list[tuple[int, int, str, bool]]:
        """``(address, size, state, small pool)`` of every mapped block, by address; ``state``
        is ``"allocated"`` or ``"free"``."""
        self._flush()
        found = []
        for segment in self._all_segments():
            for block in segment.blocks():
                if block.mapped:
                    state = "allocated" if block.allocated else "free"
                    found.append((block.address, block.size, state, block.pool.small))
        return sorted(found)

    def snapshot(self, device: int = 0) -> list[dict[str, Any]]:
        """The segments and blocks as ``torch.cuda.memory_snapshot()`` reports a device's (see
        :func:`~autobatch._memory._snapshot.write_snapshot`)."""
        self._flush()
        return write_snapshot(
            (
                SegmentRecord(segment.base, segment.size, segment.pool.small, segment.expandable,
                              tuple((b.size, b.mapped, b.allocated, b.requested)
                                    for b in segment.blocks()))
                for segment in self._all_segments()
            ),
            device,
        )

    def stats(self) -> dict[str, int]:
        """The counters of ``torch.cuda.memory_stats()`` that the model keeps, under its names
        (see :meth:`_counters`)."""
        self._flush()
        result = self._counters()
        # size_t's maximum read as int64_t, as torch.cuda.memory_stats reports "no limit"
        result["max_split_size"] = -1 if self.max_split_size == UNLIMITED else self.max_split_size
        return dict(sorted(result.items()))

    def _counters(self) -> dict[str, int]:
        """Every counter the model keeps, under ``torch.cuda.memory_stats()``'s key names, as
        they stand (the caller returns pending frees first)."""
        result: dict[str, int] = {}
        small, large = self._small, self._large
        groups = {
            "allocation": (self.allocation_stat, "allocation"),
            "segment": (self.segment_stat, "segment"),
            "allocated_bytes": (self.allocated_bytes_stat, "allocated_bytes"),
            "requested_bytes": (self.requested_bytes_stat, "requested_bytes"),
            "reserved_bytes": (self.reserved_bytes_stat, "reserved_bytes"),
            # one stream and no events: a block is active exactly while it is allocated
            "active": (self.allocation_stat, "allocation"),
            "active_bytes": (self.allocated_bytes_stat, "allocated_bytes"),
        }
        for name, (total, attribute) in groups.items():
            for pool_name, stat in (
                ("all", total),
                ("small_pool", getattr(small, attribute)),
                ("large_pool", getattr(large, attribute)),
            ):
                for field in _FIELDS:
                    result[f"{name}.{pool_name}.{field}"] = getattr(stat, field)
        # Free blocks that cannot be released because their segment is partly in use (kept only
        # for cudaMalloc'd segments, as the source leaves expandable ones out).
        split = {"all": [0, 0], "small_pool": [0, 0], "large_pool": [0, 0]}
        for segment in self._segments.values():
            if segment.head.next is None:
                continue
            for block in segment.blocks():
                if not block.allocated:
                    for pool_name in ("all", block.pool.name):
                        split[pool_name][0] += 1
                        split[pool_name][1] += block.size
        for pool_name, (count, nbytes) in split.items():
            result[f"inactive_split.{pool_name}.current"] = count
            result[f"inactive_split_bytes.{pool_name}.current"] = nbytes
        result["num_alloc_retries"] = self.num_alloc_retries
        result["num_ooms"] = self.num_ooms
        result["num_device_alloc"] = self.num_device_alloc
        result["num_device_free"] = self.num_device_free
        return result

    def replay(self, events: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
        """On a copy of this allocator as it is now: storages allocated and freed in order,
        ``(serial, nbytes)`` with ``nbytes = -1`` for a storage's death. Returns the copy's
        allocated and reserved peaks, or ``None`` when it ran out of memory (this allocator
        is left as it was).

        >>> a = CachingAllocator(limit=24 << 20)  # 3 MiB: a 20 MiB segment; 1000: a 2 MiB one
        >>> a.replay([(0, 3 << 20), (0, -1), (1, 1000)]), a.replay([(0, 3 << 20), (1, 18 << 20)])
        ((3145728, 23068672), None)
        """
        model = copy.deepcopy(self)
        model.reset_peak()
        live: dict[int, Block] = {}
        for serial, nbytes in events:
            if nbytes < 0:
                block = live.pop(serial, None)
                if block is not None:
                    model.free(block)
            elif nbytes:  # (torch asks no allocator for an empty storage)
                try:
                    live[serial] = model.malloc(nbytes)
                except AllocatorOutOfMemory:
                    return None
        return model.peak_allocated_bytes, model.peak_reserved_bytes

    def __deepcopy__(self, memo: dict[int, object]) -> CachingAllocator:
        """A structural copy (the replay makes one per size it asks, hundreds in a search; the
        generic deep copy took most of their time): segments' blocks rebuilt and linked alike,
        pools, pending blocks, counters; each old block's copy in ``memo``."""
        clone = CachingAllocator.__new__(CachingAllocator)
        memo[id(self)] = clone
        with self._lock:
            clone.__dict__.update(
                {k: v.copy() if isinstance(v, Stat) else v for k, v in self.__dict__.items()})
            clone._lock = threading.Lock()
            small, large = clone._small, clone._large = self._small.copy(), self._large.copy()
            pools = {id(self._small): small, id(self._large): large}
            clone._segments = {
                b: s.copy(pools[id(s.pool)], memo) for b, s in self._segments.items()}
            for old, pool in ((self._small, small), (self._large, large)):
                pool.expandable = [s.copy(pool, memo) for s in old.expandable]
                pool.free = {k: memo[id(b)] for k, b in old.free.items()}  # type: ignore[misc]
            clone._pending = [memo[id(b)] for b in self._pending]  # type: ignore[misc]
        return clone

    # -- allocating ------------------------------------------------------------------------

    def _cached_block(self, pool: Pool, size: int) -> Block | None:
        """The best-fitting free block of ``pool`` (``get_free_block``), taken out of it."""
        keys = pool.keys
        i = bisect_left(keys, size << SHIFT)
        if i == len(keys):
            return None
        if self.expandable_segments:
            # A block followed by unmapped space may grow into it, so for best fit it counts
            # as its size plus that space: the growing tail of a segment is the last resort.
            free = pool.free
            reach = free[keys[i]].reach()
            while i + 1 < len(keys):
                following = free[keys[i + 1]].reach()
                if following >= reach:
                    break
                i, reach = i + 1, following
        found = keys[i] >> SHIFT
        if size < self.max_split_size <= found:
            return None  # an unsplittable block is not cut down for a smaller request
        if self.max_split_size <= size and found >= size + self.max_non_split_rounding:
            return None  # an oversize block serves only requests close to its size
        return pool.free.pop(keys.pop(i))

    def _new_block(self, pool: Pool, size: int) -> Block:
        """A block from a new segment (or new pages), releasing cache and retrying as the
        source's ``malloc`` does; raises :class:`AllocatorOutOfMemory` when even that fails."""
        alloc_size = allocation_size(size)
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available(pool, size):
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            # release_cached_blocks, then alloc_block(isRetry=true): that call counts the
            # retry (num_alloc_retries) whether or not it then succeeds.
            self._release_cached()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.num_ooms += 1
            raise AllocatorOutOfMemory(
                size,
                alloc_size,
                self.allocated_bytes_stat.current,
                self.reserved_bytes_stat.current,
                max(self.limit - self.reserved_bytes_stat.current, 0),
            )
        return block

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int) -> Block | None:
        """A new segment of ``alloc_size`` (``alloc_block``), or ``None`` when it does not fit.

        Like the source under ``set_per_process_memory_fraction``, the check is that reserved
        memory plus ``alloc_size`` stays within the limit, with expandable segments too.
        """
        reserved = self.reserved_bytes_stat
        if reserved.current + alloc_size > self.limit:
            return None
        if self.expandable_segments:
            return self._expand(pool, size)
        segment = Segment(self._next_address, alloc_size, pool, expandable=False)
        self._next_address += alloc_size
        self._segments[segment.base] = segment
        reserved.increase(alloc_size)
        pool.reserved_bytes.increase(alloc_size)
        self.segment_stat.increase(1)
        pool.segment.increase(1)
        self.num_device_alloc += 1
        return segment.head

    def _hand_out(self, block: Block, size: int, nbytes: int) -> Block:
        """Mark ``block`` allocated, splitting off what it does not need (``alloc_found_block``
        with ``should_split``)."""
        pool = block.pool
        remaining = block.size - size
        if pool.small or self.expandable_segments:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = size < self.max_split_size and remaining > SMALL_SIZE
        if split:
            pool.insert(block.split(size))
        block.allocated = True
        block.requested = nbytes
        size = block.size
        self.allocated_bytes_stat.increase(size)
        pool.allocated_bytes.increase(size)
        self.requested_bytes_stat.increase(nbytes)
        pool.requested_bytes.increase(nbytes)
        self.allocation_stat.increase(1)
        pool.allocation.increase(1)
        return block

    # -- freeing ---------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._pending:
            with self._lock:
                self._return_pending()

    def _return_pending(self) -> None:
        pending = self._pending
        while pending:
            self._free_block(pending.pop())

    def _free_block(self, block: Block) -> None:
        """Return an allocated block to its pool, merged with free neighbours (``free_block``)."""
        pool = block.pool
        size = block.size
        block.allocated = False
        self.allocated_bytes_stat.decrease(size)
        pool.allocated_bytes.decrease(size)
        self.requested_bytes_stat.decrease(block.requested)
        pool.requested_bytes.decrease(block.requested)
        self.allocation_stat.decrease(1)
        pool.allocation.decrease(1)
        pool.insert(self._merge(block))

    def _merge(self, block: Block) -> Block:
        """``block`` (not in a free list) merged with its free neighbours of the same state
        (``try_merge_blocks``); the lower block absorbs the higher, so a segment's first block
        stays its head. The neighbours leave their free lists; returns the merged block."""
        prev, following = block.prev, block.next
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            if prev.mapped:
                prev.pool.remove(prev)
            prev.size += block.size
            prev.next = following
            if following is not None:
                following.prev = prev
            block = prev
        if following is not None and not following.allocated and following.mapped == block.mapped:
            if following.mapped:
                following.pool.remove(following)
            block.size += following.size
            block.next = following.next
            if following.next is not None:
                following.next.prev = block
        return block

    # -- releasing the cache ---------------------------------------------------------------

    def _release_cached(self) -> None:
        """Every free block that is a whole segment goes back to the device; in expandable
        segments every free page is unmapped (``release_cached_blocks``/``release_blocks``,
        large pool first)."""
        for pool in (self._large, self._small):
            if self.expandable_segments:
                for block in [pool.free[key] for key in pool.keys]:
                    self._unmap(block)
            else:
                for block in [pool.free[key] for key in pool.keys]:
                    if block.prev is None and block.next is None:
                        self._release_segment(block)

    def _release_available(self, pool: Pool, size: int) -> bool:
        """Release oversize cached segments to make room (``release_available_cached_blocks``):
        the smallest one of at least ``max(size, max_split_size)`` bytes, else the largest ones
        until that many bytes went back. Only with ``max_split_size`` set; the source's
        ``release_block`` refuses expandable segments, and so does this model."""
        if self.max_split_size == UNLIMITED or self.expandable_segments:
            return False
        wanted = max(size, self.max_split_size)
        keys = pool.keys
        i = bisect_left(keys, wanted << SHIFT)
        if i < len(keys):
            self._release_segment(pool.free[keys[i]])
            return True
        released = 0
        for key in reversed(list(keys)):
            if released >= wanted or key >> SHIFT < self.max_split_size:
                break
            block = pool.free[key]
            if block.prev is None and block.next is None:  # oversize blocks are never split
                released += block.size
                self._release_segment(block)
        return released >= wanted

    def _release_segment(self, block: Block) -> None:
        """``cudaFree`` of a whole, free segment (``release_block``)."""
        pool = block.pool
        pool.remove(block)
        del self._segments[block.address]
        self.reserved_bytes_stat.decrease(block.size)
        pool.reserved_bytes.decrease(block.size)
        self.segment_stat.decrease(1)
        pool.segment.decrease(1)
        self.num_device_free += 1

    # -- expandable segments ---------------------------------------------------------------

    def _expand(self, pool: Pool, size: int) -> Block | None:
        """A free block of at least ``size`` bytes made by mapping pages
        (``try_allocate_expandable_block``), or ``None`` when the pages do not fit."""
        candidate = self._expandable_room(pool, size)
        if not candidate.mapped:
            mapped = self._map(candidate, min(candidate.size, size))
            if mapped is None:
                return None
            candidate = mapped
        while candidate.size < size:
            following = candidate.next
            if following is None or following.mapped:
                return None  # a request larger than a whole segment's address space
            mapped = self._map(following, min(size - candidate.size, following.size))
            if mapped is None:
                return None
            candidate = mapped
        pool.remove(candidate)
        return candidate

    def _expandable_room(self, pool: Pool, size: int) -> Block:
        """The lowest-addressed run of free and unmapped blocks with ``size`` bytes, starting
        at an unmapped block or the free block just before one (``find_expandable_block``); a
        new segment's address range when no segment has room."""
        for segment in pool.expandable:
            for block in segment.blocks():
                if block.mapped:
                    continue
                start = block
                if block.prev is not None and not block.prev.allocated:
                    start = block.prev
                room = 0
                run: Block | None = start
                while run is not None and room < size and not run.allocated:
                    room += run.size
                    run = run.next
                if room >= size:
                    return start
        pages = -(-self.address_space // pool.page)
        segment = Segment(self._next_address, pages * pool.page, pool, expandable=True)
        self._next_address += segment.size
        pool.expandable.append(segment)
        return segment.head

    def _map(self, block: Block, nbytes: int) -> Block | None:
        """Back the first ``nbytes`` of an unmapped block with whole pages and merge them with
        free neighbours (``map_block``); ``None`` when the pages do not fit on the device."""
        pool = block.pool
        mapped = -(-nbytes // pool.page) * pool.page
        if self.reserved_bytes_stat.current + mapped > self.limit:
            return None  # cuMemCreate fails: the device has no room for the pages
        if mapped < block.size:
            block.split(mapped)  # the rest stays unmapped
        block.mapped = True
        block = self._merge(block)
        pool.insert(block)
        self.reserved_bytes_stat.increase(mapped)
        pool.reserved_bytes.increase(mapped)
        self.num_device_alloc += 1
        return block

    def _unmap(self, block: Block) -> None:
        """Unmap the whole pages inside a free block (``unmap_block``); a segment left with no
        mapped page is given back (``release_expandable_segment``)."""
        pool, segment = block.pool, block.segment
        page, base = pool.page, segment.base
        start = base + -(-(block.address - base) // page) * page
        end = base + (block.address + block.size - base) // page * page
        if start >= end:
            return
        pool.remove(block)
        block_end = block.address + block.size
        if start > block.address:  # a free mapped piece stays before the hole
            hole = Block(start, end - start, pool, segment, mapped=False)
            hole.prev, hole.next = block, block.next
            if block.next is not None:
                block.next.prev = hole
            block.next = hole
            block.size = start - block.address
            pool.insert(block)
        else:
            hole = block
            hole.mapped = False
            hole.size = end - start
        if end < block_end:  # and one after it
            after = Block(end, block_end - end, pool, segment)
            after.prev, after.next = hole, hole.next
            if hole.next is not None:
                hole.next.prev = after
            hole.next = after
            pool.insert(after)
        self._merge(hole)
        self.reserved_bytes_stat.decrease(end - start)
        pool.reserved_bytes.decrease(end - start)
        self.num_device_free += 1
        head = segment.head
        if not head.mapped and head.next is None:
            pool.expandable.remove(segment)

    # -- inspection ------------------------------------------------------------------------

    def _all_segments(self) -> list[Segment]:
        segments = [*self._segments.values(), *self._small.expandable, *self._large.expandable]
        return sorted(segments, key=lambda s: s.base)

    def _segment_ranges(self) -> list[tuple[int, int, bool]]:
        self._flush()
        return [(start, size, segment.pool.small) for segment in self._all_segments()
                for start, size in segment.mapped_ranges()]

    def _all_stats(self) -> list[Stat]:
        stats = [self.allocated_bytes_stat, self.requested_bytes_stat, self.reserved_bytes_stat,
                 self.allocation_stat, self.segment_stat]
        for pool in (self._small, self._large):
            stats += [pool.allocated_bytes, pool.requested_bytes, pool.reserved_bytes,
                      pool.allocation, pool.segment]
        return stats

    def __repr__(self) -> str:
        return (
            f"CachingAllocator(allocated={self.allocated_bytes}, reserved={self.reserved_bytes}, "
            f"segments={len(self._segment_ranges())})"
        )
