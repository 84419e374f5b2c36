"""A model of PyTorch's CUDA caching allocator, for the simulated GPU.

Pure Python, no torch: :class:`~autobatch.testing.SimulatedGPU` hands it the byte size of every
storage it sees and frees the block when the storage dies. The policy is the one of
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

import threading
from bisect import bisect_left, insort
from collections.abc import Iterator
from dataclasses import dataclass

from autobatch.testing._segments import memory_stats

#: ``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes (512 at least).
MIN_BLOCK_SIZE = 512
#: ``kSmallSize``: requests up to 1 MiB (after rounding) come from the small pool.
SMALL_SIZE = 1 << 20
#: ``kSmallBuffer``: the small pool's segments are 2 MiB; also its expandable page size.
SMALL_BUFFER = 2 << 20
#: ``kLargeBuffer``: large requests under ``MIN_LARGE_ALLOC`` get a 20 MiB segment; also the
#: large pool's expandable page size and the default ``max_non_split_rounding_mb``.
LARGE_BUFFER = 20 << 20
#: ``kMinLargeAlloc``: from 10 MiB on, a new segment is the request rounded to ``ROUND_LARGE``.
MIN_LARGE_ALLOC = 10 << 20
#: ``kRoundLarge``: large segments are multiples of 2 MiB.
ROUND_LARGE = 2 << 20
#: ``max_split_size`` when not configured (``std::numeric_limits<size_t>::max()`` in the source).
UNLIMITED = 1 << 63

_SHIFT = 64
_ADDRESS = (1 << _SHIFT) - 1


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out for a request of ``nbytes`` (``round_size``).

    >>> round_size(1), round_size(512), round_size(513), round_size(3 << 20)
    (512, 512, 1024, 3145728)
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """The size of the segment reserved for a rounded request of ``size`` (``get_allocation_size``).

    >>> [allocation_size(n) >> 20 for n in (512, 1 << 20, (1 << 20) + 512, 10 << 20, 11 << 20)]
    [2, 2, 20, 10, 12]
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class AllocatorOutOfMemory(Exception):
    """A request the allocator could not place even after releasing its cache.

    Carries what CUDA's out-of-memory message reports: the allocation it tried (a whole
    segment's size, ``alloc_size`` in the source, not the request), the bytes allocated and
    reserved, and the device memory left free, all taken after the cache was released.
    """

    def __init__(self, size: int, alloc_size: int, allocated: int, reserved: int, free: int):
        super().__init__(f"cannot allocate {size} bytes (a {alloc_size}-byte segment)")
        self.size = size
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.free = free


@dataclass(slots=True, eq=False, repr=False)
class Block:
    """A piece of a segment: allocated, free (cached) or, in an expandable segment, unmapped."""

    address: int
    size: int
    pool: _Pool
    segment: _Segment
    mapped: bool = True
    requested: int = 0  # the bytes asked for, while allocated
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block({self.address:#x}, {self.size}, {state})"

    def split(self, size: int) -> Block:
        """Keep the first ``size`` bytes; the rest becomes the next block of the segment (as
        mapped as this one), returned."""
        rest = Block(self.address + size, self.size - size, self.pool, self.segment, self.mapped)
        following = self.next
        rest.prev, rest.next = self, following
        if following is not None:
            following.prev = rest
        self.next = rest
        self.size = size
        return rest


class _Segment:
    """One ``cudaMalloc`` (or one expandable segment's address range) and its first block."""

    __slots__ = ("base", "expandable", "head", "pool", "size")

    def __init__(self, base: int, size: int, pool: _Pool, expandable: bool) -> None:
        self.base = base
        self.size = size
        self.pool = pool
        self.expandable = expandable
        self.head = Block(base, size, pool, self, mapped=not expandable)

    def blocks(self) -> Iterator[Block]:
        block: Block | None = self.head
        while block is not None:
            yield block
            block = block.next


class _Stat:
    """One of CUDA's ``Stat`` counters: current, peak, and the running totals added and taken."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


class _Pool:
    """The small or the large pool: its free blocks, best fit first, and its statistics."""

    __slots__ = (
        "allocated_bytes", "allocation", "expandable", "free", "keys", "name", "page",
        "requested_bytes", "reserved_bytes", "segment", "small",
    )

    def __init__(self, small: bool) -> None:
        self.small = small
        self.name = "small_pool" if small else "large_pool"
        # Expandable segments grow by whole pages: kSmallBuffer in the small pool, kLargeBuffer
        # in the large one (the ExpandableSegment constructed in find_expandable_block).
        self.page = SMALL_BUFFER if small else LARGE_BUFFER
        self.keys: list[int] = []  # free mapped blocks, sorted by (size, address)
        self.free: dict[int, Block] = {}
        self.expandable: list[_Segment] = []  # this pool's expandable segments, by address
        self.allocated_bytes = _Stat()
        self.requested_bytes = _Stat()
        self.reserved_bytes = _Stat()
        self.allocation = _Stat()
        self.segment = _Stat()

    def insert(self, block: Block) -> None:
        key = block.size << _SHIFT | block.address
        insort(self.keys, key)
        self.free[key] = block

    def remove(self, block: Block) -> None:
        key = block.size << _SHIFT | block.address
        del self.keys[bisect_left(self.keys, key)]
        del self.free[key]


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
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._segments: dict[int, _Segment] = {}  # the cudaMalloc'd segments, by base address
        self._next_address = 1 << 32  # addresses are virtual; new segments never overlap
        self._pending: list[Block] = []  # freed blocks not yet returned to their pool
        self._lock = threading.Lock()
        self.allocated_bytes_stat = _Stat()
        self.requested_bytes_stat = _Stat()
        self.reserved_bytes_stat = _Stat()
        self.allocation_stat = _Stat()
        self.segment_stat = _Stat()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

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

    def stats(self) -> dict[str, int]:
        """The counters of ``torch.cuda.memory_stats()`` that the model keeps, under its names
        (see :func:`autobatch.testing._segments.memory_stats`)."""
        self._flush()
        result = memory_stats(self)
        # size_t's maximum read as int64_t, as torch.cuda.memory_stats reports "no limit"
        result["max_split_size"] = -1 if self.max_split_size == UNLIMITED else self.max_split_size
        return dict(sorted(result.items()))

    # -- allocating ------------------------------------------------------------------------

    def _cached_block(self, pool: _Pool, size: int) -> Block | None:
        """The best-fitting free block of ``pool`` (``get_free_block``), taken out of it."""
        keys = pool.keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        if self.expandable_segments:
            # A block followed by unmapped space may grow into it, so for best fit it counts
            # as its size plus that space: the growing tail of a segment is the last resort.
            free = pool.free
            reach = _reach(free[keys[i]])
            while i + 1 < len(keys):
                following = _reach(free[keys[i + 1]])
                if following >= reach:
                    break
                i, reach = i + 1, following
        found = keys[i] >> _SHIFT
        if size < self.max_split_size <= found:
            return None  # an unsplittable block is not cut down for a smaller request
        if self.max_split_size <= size and found >= size + self.max_non_split_rounding:
            return None  # an oversize block serves only requests close to its size
        return pool.free.pop(keys.pop(i))

    def _new_block(self, pool: _Pool, size: int) -> Block:
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

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> Block | None:
        """A new segment of ``alloc_size`` (``alloc_block``), or ``None`` when it does not fit.

        Like the source under ``set_per_process_memory_fraction``, the check is that reserved
        memory plus ``alloc_size`` stays within the limit, with expandable segments too.
        """
        reserved = self.reserved_bytes_stat
        if reserved.current + alloc_size > self.limit:
            return None
        if self.expandable_segments:
            return self._expand(pool, size)
        segment = _Segment(self._next_address, alloc_size, pool, expandable=False)
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

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """Release oversize cached segments to make room (``release_available_cached_blocks``):
        the smallest one of at least ``max(size, max_split_size)`` bytes, else the largest ones
        until that many bytes went back. Only with ``max_split_size`` set; the source's
        ``release_block`` refuses expandable segments, and so does this model."""
        if self.max_split_size == UNLIMITED or self.expandable_segments:
            return False
        wanted = max(size, self.max_split_size)
        keys = pool.keys
        i = bisect_left(keys, wanted << _SHIFT)
        if i < len(keys):
            self._release_segment(pool.free[keys[i]])
            return True
        released = 0
        for key in reversed(list(keys)):
            if released >= wanted or key >> _SHIFT < self.max_split_size:
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

    def _expand(self, pool: _Pool, size: int) -> Block | None:
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

    def _expandable_room(self, pool: _Pool, size: int) -> Block:
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
        segment = _Segment(self._next_address, pages * pool.page, pool, expandable=True)
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

    def _all_segments(self) -> list[_Segment]:
        segments = [*self._segments.values(), *self._small.expandable, *self._large.expandable]
        return sorted(segments, key=lambda s: s.base)

    def _segment_ranges(self) -> list[tuple[int, int, bool]]:
        self._flush()
        ranges = []
        for segment in self._all_segments():
            start = size = 0
            for block in segment.blocks():
                if block.mapped:
                    if not size:
                        start = block.address
                    size += block.size
                elif size:
                    ranges.append((start, size, segment.pool.small))
                    size = 0
            if size:
                ranges.append((start, size, segment.pool.small))
        return ranges

    def _all_stats(self) -> list[_Stat]:
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


def _reach(block: Block) -> int:
    """A free block's size plus the unmapped space right after it, into which it can grow."""
    following = block.next
    if following is not None and not following.mapped:
        return block.size + following.size
    return block.size
