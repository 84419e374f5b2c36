"""Watching the caching allocator between steps: thrashing, and memory cached but unusable.

A caching allocator that cannot place a request releases its whole cache and tries again
(``num_alloc_retries``). One such retry is harmless; a retry in step after step is thrashing:
every step frees the cache and rebuilds it (slow, and the OOM is near), so the engine shrinks
before it comes (Composer's automatic micro-batching watches the same count). An OOM with
much of the reserved memory unallocated is fragmentation, which
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` avoids: the engine says so, once.
"""

from __future__ import annotations

import logging
from typing import Any

from autobatch._log import get_logger
from autobatch._memory import _backends
from autobatch._memory._backends import DeviceMemory

logger = get_logger("recovery")

#: Consecutive steps in which the allocator released its cache and retried that count as
#: thrashing.
THRASH_STEPS = 3
#: Steps between two reads of the retry count while it stays still: CUDA's count is read from
#: ``memory_stats``, a dictionary of a hundred entries built on each read (tens of
#: microseconds, a few percent of a short step). Once it rises it is read after every step.
THRASH_EVERY = 8
#: At an OOM, a share of the reserved memory this large cached but unallocated is fragmentation.
FRAGMENTED_SHARE = 0.25

_hinted = False  # the expandable-segments hint is logged once per process


class _Watch:
    """The allocator's retry count after each step of one decorated function.

    The memory backend is looked up once per device (and again when a simulated GPU is entered
    or left): on the fast path a step costs a comparison, plus, where the device has a caching
    allocator, one read of the retry count every :data:`THRASH_EVERY` steps while it stays
    still and after every step once it rose.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._memory: DeviceMemory | None = None
        self._last: int | None = None
        self.streak = 0  # consecutive steps with new retries
        self._wait = 0  # steps before the next read

    def memory(self, device: Any) -> DeviceMemory | None:
        """The backend of ``device`` when it has a caching allocator, else ``None``."""
        overrides = _backends._overrides
        key = (device, len(overrides), id(overrides[-1]) if overrides else None)
        if key != self._key:
            self._key, self._last, self.streak = key, None, 0
            try:
                memory = _backends.memory_for(device)
            except ValueError:
                memory = None
            self._memory = memory if memory is not None and memory.caches else None
        return self._memory

    def step_done(self, device: Any) -> bool:
        """A step ended: whether the allocator has retried in each of the last
        :data:`THRASH_STEPS` reads of its count, one after each step once it rose (the count
        starts again after it says so)."""
        if self._wait:
            self._wait -= 1
            return False
        key = self._key  # (the common case without building a key: this runs on every step)
        if key is not None and key[1] == 0 and key[0] == device and not _backends._overrides:
            memory = self._memory
        else:
            memory = self.memory(device)
        if memory is None:
            return False
        retries = memory.alloc_retries()
        if retries is None:
            return False
        last, self._last = self._last, retries
        if last is None or retries <= last:
            self.streak = 0
            self._wait = 0 if last is None else THRASH_EVERY - 1
            return False
        self.streak += 1
        if self.streak < THRASH_STEPS:
            return False
        self.streak = 0
        return True

    def unallocated_share(self, device: Any) -> float | None:
        """The share of the reserved memory that is cached but not allocated, now (read at an
        OOM, while the failed attempt's tensors are still alive); ``None``: not known, or the
        cache held less than half the device (then a request larger than the room left ran
        out, not a fragmented cache)."""
        memory = self.memory(device)
        if memory is None:
            return None
        reserved = memory.reserved_bytes()
        if not reserved or 2 * reserved < memory.capacity_bytes():
            return None
        return max(reserved - memory.allocated_bytes(), 0) / reserved


def hint_fragmentation(name: str, share: float | None, kind: str) -> None:
    """Log, once per process, that an OOM came with ``share`` of the reserved memory
    unallocated (at least :data:`FRAGMENTED_SHARE`), and what avoids it."""
    global _hinted
    if _hinted or share is None or share < FRAGMENTED_SHARE:
        return
    _hinted = True
    logger.log(
        logging.WARNING,
        "%s ran out of memory (%s) with %.0f%% of the memory reserved by the caching allocator "
        "cached but unallocated: the cache is fragmented. It is emptied before the smaller "
        "micro-batches run; setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before "
        "the process starts avoids most of it",
        name, kind, 100 * share,
    )
