"""The caching-allocator model's counters, as ``torch.cuda.memory_stats()`` names them.

Kept apart from :mod:`autobatch.testing._allocator` (the allocation policy): this module only
reads the model's pools and segments and reports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autobatch.testing._allocator import CachingAllocator

#: ``Stat`` fields of each counter, as ``torch.cuda.memory_stats()`` reports them.
_FIELDS = ("current", "peak", "allocated", "freed")


def memory_stats(allocator: CachingAllocator) -> dict[str, int]:
    """Every counter the model keeps, under ``torch.cuda.memory_stats()``'s key names.

    The counters are taken as they stand (the caller returns pending frees first), except
    ``max_split_size``, which the allocator adds.

    >>> from autobatch.testing._allocator import CachingAllocator
    >>> a = CachingAllocator(limit=64 << 20)
    >>> _ = a.malloc(1000)
    >>> stats = memory_stats(a)
    >>> stats["reserved_bytes.small_pool.current"], stats["allocation.all.current"]
    (2097152, 1)

    Args:
        allocator: The model to report on.
    """
    result: dict[str, int] = {}
    small, large = allocator._small, allocator._large
    groups = {
        "allocation": (allocator.allocation_stat, "allocation"),
        "segment": (allocator.segment_stat, "segment"),
        "allocated_bytes": (allocator.allocated_bytes_stat, "allocated_bytes"),
        "requested_bytes": (allocator.requested_bytes_stat, "requested_bytes"),
        "reserved_bytes": (allocator.reserved_bytes_stat, "reserved_bytes"),
        # one stream and no events: a block is active exactly while it is allocated
        "active": (allocator.allocation_stat, "allocation"),
        "active_bytes": (allocator.allocated_bytes_stat, "allocated_bytes"),
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
    for segment in allocator._segments.values():
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
    result["num_alloc_retries"] = allocator.num_alloc_retries
    result["num_ooms"] = allocator.num_ooms
    result["num_device_alloc"] = allocator.num_device_alloc
    result["num_device_free"] = allocator.num_device_free
    return result
