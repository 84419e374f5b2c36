"""Batches packed to memory for variable-length data: a batch sampler for ``DataLoader``.

:class:`MemoryAwareBatchSampler` groups samples of similar length and makes each batch as large
as its longest member allows, according to a table of batch sizes per length (what
:func:`autobatch.search_batch_sizes` measures, or any object with ``batch_size(length)``).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from torch.utils.data import Sampler

from autobatch._validate import check_int

__all__ = ["MemoryAwareBatchSampler", "SizeTable"]


class SizeTable(Protocol):
    """Anything that says how many samples of a given length fit in one batch. A table that
    also has ``fits(length, size) -> bool | None`` (as :class:`~autobatch.LengthTable` has)
    is asked of every smaller batch too."""

    def batch_size(self, length: int) -> int: ...


def _as_int(value: object) -> object:
    """An integer-like value (a numpy integer, say) as an ``int``; anything else unchanged."""
    if isinstance(value, int) or not hasattr(value, "__index__"):
        return value
    return operator.index(value)


class MemoryAwareBatchSampler(Sampler[list[int]]):
    """Batches of samples of similar length, each as large as its longest member allows.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler)``. Each epoch the indices are
    shuffled (``shuffle=True``, seeded by ``seed`` and the epoch), cut into buckets of
    ``bucket_size`` samples, sorted by length inside each bucket, and packed greedily: a batch
    takes the next samples while their count stays within ``table.batch_size(longest length)``
    (and ``max_batch``). The order of the batches is then shuffled. Every index comes exactly
    once per epoch; no batch holds more samples than the table allows for its longest member.

    The batches that close early (the last of a bucket, or the last before a longer length)
    are smaller than their length allows. Under CUDA's caching allocator a smaller batch is not
    always one that fits: a size can need one more memory segment than the device has left
    while a larger one packs into fewer. Where the table knows (``table.fits(length, size)``,
    as :class:`~autobatch.LengthTable` has from the search's replay of the allocator), such a
    batch is cut into the fewest batches the table does not rule out, largest first.

    Under data parallelism (``num_replicas`` ranks), the packing is done for all ranks at once
    (a batch of ``num_replicas`` times the size) and each such batch is dealt out, row by row,
    to the ranks: every rank gets the same number of batches, of the same size at each step
    (the last batch of a bucket is topped up with repeated samples, as ``DistributedSampler``
    does). Call :meth:`set_epoch` at the start of every epoch.

    >>> lengths = [5, 60, 7, 62, 6, 64, 8, 61]
    >>> sampler = MemoryAwareBatchSampler(lengths, lambda n: 4 if n <= 10 else 2, shuffle=False)
    >>> list(sampler)
    [[0, 4, 2, 6], [1, 7], [3, 5]]

    Args:
        lengths: the length of every sample of the dataset (tokens, frames, nodes, ...).
        table: ``table.batch_size(length)`` (or ``table(length)``): the batch size that fits
            for samples of that length, e.g. the result of :func:`autobatch.search_batch_sizes`.
        shuffle: shuffle the samples before bucketing, and the batches after.
        seed: the seed of the shuffling; the same on every rank.
        drop_last: drop each bucket's last batch when it is smaller than its length allows.
        max_batch: a cap on every batch's size, whatever the table allows.
        bucket_size: samples sorted together (default: about 64 full batches of the median
            length); larger groups lengths more tightly, smaller shuffles more.
        num_replicas: the number of data-parallel ranks (default 1).
        rank: this process's rank, in ``[0, num_replicas)``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | Any,
        table: SizeTable | Callable[[int], int],
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        max_batch: int | None = None,
        bucket_size: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if hasattr(lengths, "tolist"):  # a tensor or an array
            lengths = lengths.tolist()
        self.lengths = [check_int("every length", _as_int(n), minimum=0) for n in lengths]
        size_of = getattr(table, "batch_size", table)
        if not callable(size_of):
            raise TypeError(
                "table must have batch_size(length) (e.g. autobatch.search_batch_sizes(...)) or "
                f"be a function of a length, got {type(table).__name__}"
            )
        self._size_of: Callable[[int], int] = size_of
        fits = getattr(table, "fits", None)
        self._fits_of: Callable[[int, int], bool | None] | None = (
            fits if callable(fits) else None
        )
        self._verdicts: dict[tuple[int, int], bool] = {}
        self.shuffle = bool(shuffle)
        self.seed = check_int("seed", seed, minimum=-(2**63))
        self.drop_last = bool(drop_last)
        self.max_batch = None if max_batch is None else check_int("max_batch", max_batch, minimum=1)
        self.num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self._sizes: dict[int, int] = {}
        if bucket_size is None:
            median = sorted(self.lengths)[len(self.lengths) // 2] if self.lengths else 0
            bucket_size = 64 * self.num_replicas * (self._allowed(median) if self.lengths else 1)
        self.bucket_size = check_int("bucket_size", bucket_size, minimum=1)
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffling of ``epoch`` (call at the start of every epoch)."""
        self.epoch = check_int("epoch", epoch, minimum=0)

    def _allowed(self, length: int) -> int:
        """The batch size for one rank at ``length``, checked."""
        size = self._sizes.get(length)
        if size is None:
            size = self._size_of(length)
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(
                    f"the table's batch size for length {length} must be an int, got {size!r}"
                )
            if size < 1:
                raise ValueError(
                    f"a sample of length {length} does not fit in a batch of one (the table "
                    f"gives {size}); drop or truncate such samples"
                )
            if self.max_batch is not None:
                size = min(size, self.max_batch)
            self._sizes[length] = size
        return size

    def _packed(self) -> list[list[int]]:
        """The epoch's batches for all ranks together (each ``num_replicas`` times a rank's)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        replicas = self.num_replicas
        packed: list[list[int]] = []
        for start in range(0, len(order), self.bucket_size):
            bucket = sorted(order[start : start + self.bucket_size], key=self.lengths.__getitem__)
            current: list[int] = []
            for index in bucket:  # lengths only grow: the newest sample is the longest
                if current and len(current) + 1 > replicas * self._allowed(self.lengths[index]):
                    packed += self._fitting(current)
                    current = []
                current.append(index)
            if current:
                full = len(current) == replicas * self._allowed(self.lengths[current[-1]])
                if full or not self.drop_last:
                    packed += self._fitting(current)
        if self.shuffle:
            rng.shuffle(packed)
        self._cache = (self.epoch, packed)
        return packed

    def _runs(self, rows: list[int]) -> bool:
        """Whether the table does not rule out a batch of these rows (sorted by length) on
        each rank."""
        if self._fits_of is None:
            return True
        key = self.lengths[rows[-1]], -(-len(rows) // self.num_replicas)
        if key not in self._verdicts:
            self._verdicts[key] = self._fits_of(*key) is not False
        return self._verdicts[key]

    def _fitting(self, batch: list[int]) -> list[list[int]]:
        """``batch`` (sorted by length), or where the table knows its size not to fit, cut
        into the fewest batches it does not rule out, the largest first (a batch of one row
        per rank is always kept: the table's size for its length is at least that)."""
        pieces: list[list[int]] = []
        rest, step = batch, self.num_replicas
        while rest:
            take = len(rest)
            while take > step and not self._runs(rest[:take]):
                take = step * (-(-take // step) - 1)  # one row fewer on every rank
            pieces.append(rest[:take])
            rest = rest[take:]
        return pieces

    def _share(self, batch: list[int]) -> list[int]:
        """This rank's rows of a batch packed for every rank (topped up to equal shares)."""
        replicas = self.num_replicas
        if replicas == 1:
            return batch
        per_rank = -(-len(batch) // replicas)
        padded = batch + [batch[i % len(batch)] for i in range(per_rank * replicas - len(batch))]
        return padded[self.rank :: replicas]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._packed():
            yield self._share(batch)

    def __len__(self) -> int:
        return len(self._packed())

    def __repr__(self) -> str:
        return (
            f"MemoryAwareBatchSampler({len(self.lengths)} samples, {len(self)} batches, "
            f"shuffle={self.shuffle}, rank {self.rank} of {self.num_replicas})"
        )
