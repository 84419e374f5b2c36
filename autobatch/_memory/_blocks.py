"""The pieces of the caching-allocator model (:mod:`autobatch._memory._allocator`): its
constants, rounding rules, blocks, segments, counters and pools, as the CUDA source names them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

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

SHIFT = 64
ADDRESS = (1 << SHIFT) - 1


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
    pool: Pool
    segment: Segment
    mapped: bool = True
    requested: int = 0  # the bytes asked for, while allocated
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block({self.address:#x}, {self.size}, {state})"

    def reach(self) -> int:
        """A free block's size plus the unmapped space right after it, into which it can grow."""
        following = self.next
        if following is not None and not following.mapped:
            return self.size + following.size
        return self.size

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


class Segment:
    """One ``cudaMalloc`` (or one expandable segment's address range) and its first block."""

    __slots__ = ("base", "expandable", "head", "pool", "size")

    def __init__(self, base: int, size: int, pool: Pool, expandable: bool) -> None:
        self.base = base
        self.size = size
        self.pool = pool
        self.expandable = expandable
        self.head = Block(base, size, pool, self, mapped=not expandable)

    def copy(self, pool: Pool, memo: dict[int, object]) -> Segment:
        """This segment in ``pool``, its blocks copied in order and linked alike (each old
        block's copy put in ``memo`` by the old one's id)."""
        clone = Segment.__new__(Segment)
        clone.base, clone.size, clone.pool, clone.expandable = (
            self.base, self.size, pool, self.expandable)
        block: Block | None = self.head
        prev: Block | None = None
        while block is not None:
            new = Block(block.address, block.size, pool, clone, block.mapped, block.requested,
                        block.allocated, prev)
            if prev is None:
                clone.head = new
            else:
                prev.next = new
            memo[id(block)] = new
            prev, block = new, block.next
        return clone

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """``(start, size)`` of each run of mapped blocks, by address."""
        ranges = []
        start = size = 0
        for block in self.blocks():
            if block.mapped:
                if not size:
                    start = block.address
                size += block.size
            elif size:
                ranges.append((start, size))
                size = 0
        if size:
            ranges.append((start, size))
        return ranges

    def blocks(self) -> Iterator[Block]:
        block: Block | None = self.head
        while block is not None:
            yield block
            block = block.next

    def carve(self, pieces: Iterable[tuple[int, bool, bool, int]]) -> None:
        """Cut the segment, whole until now, into blocks of ``pieces`` (``(size, mapped,
        allocated, requested bytes)`` in address order, covering it)."""
        block: Block | None = self.head
        for size, mapped, allocated, requested in pieces:
            assert block is not None, "the pieces cover more than the segment"
            if size < block.size:
                block.split(size)
            block.mapped, block.allocated, block.requested = mapped, allocated, requested
            block = block.next


class Stat:
    """One of CUDA's ``Stat`` counters: current, peak, and the running totals added and taken."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def copy(self) -> Stat:
        clone = Stat.__new__(Stat)
        clone.current, clone.peak, clone.allocated, clone.freed = (
            self.current, self.peak, self.allocated, self.freed)
        return clone

    def increase(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


class Pool:
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
        self.expandable: list[Segment] = []  # this pool's expandable segments, by address
        self.allocated_bytes = Stat()
        self.requested_bytes = Stat()
        self.reserved_bytes = Stat()
        self.allocation = Stat()
        self.segment = Stat()

    def copy(self) -> Pool:
        """The pool's settings, statistics and sorted keys (its free blocks and expandable
        segments are set by the allocator's copy, which copies the blocks)."""
        clone = Pool.__new__(Pool)
        clone.small, clone.name, clone.page = self.small, self.name, self.page
        clone.keys = list(self.keys)
        clone.free, clone.expandable = {}, []
        for name in ("allocated_bytes", "requested_bytes", "reserved_bytes", "allocation",
                     "segment"):
            setattr(clone, name, getattr(self, name).copy())
        return clone

    def insert(self, block: Block) -> None:
        key = block.size << SHIFT | block.address
        insort(self.keys, key)
        self.free[key] = block

    def remove(self, block: Block) -> None:
        key = block.size << SHIFT | block.address
        del self.keys[bisect_left(self.keys, key)]
        del self.free[key]
