"""What torch's caching allocator says of itself, in the terms of the allocator model
(:mod:`autobatch._memory._allocator`): its memory snapshot, read and written, and its settings string.

Pure Python, no torch. The snapshot is the list ``torch.cuda.memory_snapshot()`` returns, built
by ``_cuda_memorySnapshot`` (``torch/csrc/cuda/Module.cpp``) from
``DeviceCachingAllocator::snapshot`` (``c10/cuda/CUDACachingAllocator.cpp``): one dict per
segment, by address, each with its blocks in address order; an expandable segment is reported
as one segment per contiguous range of mapped pages. The settings are the ``key:value`` items,
separated by commas, that ``PYTORCH_ALLOC_CONF`` takes, parsed as ``c10/core/AllocatorConfig.cpp``
parses them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autobatch._memory._blocks import LARGE_BUFFER, MIN_BLOCK_SIZE, SMALL_BUFFER

#: A block's state in a snapshot, and whether the model counts it allocated. A block freed
#: while another stream still uses it is ``active_pending_free`` (the name torch's docstring
#: gives, ``active_awaiting_free``, is taken too): it returns to its pool only once that
#: stream's events complete, so the model keeps it allocated.
BLOCK_STATES = {
    "active_allocated": True,
    "active_pending_free": True,
    "active_awaiting_free": True,
    "inactive": False,
}

#: Settings that do not change where blocks go: the host (pinned) allocator's, the lock held
#: around ``cudaMalloc``, CUDA graphs' reuse of freed blocks, and the per-process memory fraction
#: (which the backend reads from torch itself, as the model's limit).
NEUTRAL_SETTINGS = frozenset({
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
})


class NotModelled(ValueError):
    """A snapshot or a setting of torch's allocator that the allocator model cannot represent."""


#: One piece of a segment: ``(size, mapped, allocated, requested bytes)``.
Piece = tuple[int, bool, bool, int]


@dataclass(frozen=True)
class SegmentRecord:
    """A segment as a snapshot describes it: where it starts, its size, its pool, and its blocks
    in address order. An expandable segment spans its whole address space, the unmapped pages
    included (pieces that are not ``mapped``)."""

    base: int
    size: int
    small: bool
    expandable: bool
    pieces: tuple[Piece, ...]


def read_snapshot(
    segments: Iterable[Mapping[str, Any]],
    *,
    expandable_segments: bool,
    address_space: int,
    device: int | None = None,
    stream: int = 0,
) -> list[SegmentRecord]:
    """The segments of ``device`` (every device's when ``None``) that a snapshot describes, by
    address; raises :class:`NotModelled` for what the model cannot represent.

    >>> snapshot = [{"address": 4096 << 20, "total_size": 2 << 20, "segment_type": "small",
    ...              "blocks": [{"size": 512, "state": "active_allocated", "requested_size": 8},
    ...                         {"size": (2 << 20) - 512, "state": "inactive"}]}]
    >>> [r.pieces for r in read_snapshot(snapshot, expandable_segments=False, address_space=0)]
    [((512, True, True, 8), (2096640, True, False, 0))]

    Refused: a segment of a private pool (a CUDA graph's or a ``torch.cuda.MemPool``'s), one on
    another stream than ``stream`` that holds a free block (its blocks serve that stream only)
    or is expandable, a segment whose expandability is not ``expandable_segments`` (the model
    has one setting for all), a block in an unknown state, blocks that do not tile their
    segment, and an expandable segment whose mapped ranges do not fit one address space.

    Args:
        segments: ``torch.cuda.memory_snapshot()``'s list (or the model's own snapshot).
        expandable_segments: Whether the allocator makes expandable segments.
        address_space: Bytes of address space an expandable segment spans (9/8 of the device's
            memory on CUDA).
        device: The device whose segments to read.
        stream: The stream the model allocates on (``cuda_stream`` of the current stream).
    """
    fixed: list[SegmentRecord] = []
    ranges: dict[bool, list[tuple[int, int, list[Piece]]]] = {True: [], False: []}
    for segment in segments:
        if device is not None and segment.get("device", device) != device:
            continue
        address, total = int(segment["address"]), int(segment["total_size"])
        where = f"the segment at {address:#x}"
        pool_id = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool_id != (0, 0):
            raise NotModelled(f"{where} belongs to the private pool {pool_id}")
        expandable = bool(segment.get("is_expandable", False))
        if expandable != expandable_segments:
            raise NotModelled(
                f"{where} is {'' if expandable else 'not '}expandable, but the allocator's "
                f"expandable_segments setting is {expandable_segments}"
            )
        pieces = _pieces(segment["blocks"], address, total, where)
        if segment.get("stream", stream) != stream and (
            expandable or not all(allocated for _, _, allocated, _ in pieces)
        ):
            raise NotModelled(f"{where} is on another stream and holds free blocks")
        kind = segment.get("segment_type")  # (else a 2 MiB cudaMalloc is the small pool's)
        small = kind == "small" if kind is not None else not expandable and total <= SMALL_BUFFER
        if expandable:
            ranges[small].append((address, total, pieces))
        else:
            fixed.append(SegmentRecord(address, total, small, False, tuple(pieces)))
    grown = [_expandable(small, found, address_space) for small, found in ranges.items() if found]
    return sorted(fixed + grown, key=lambda record: record.base)


def _pieces(blocks: Iterable[Mapping[str, Any]], address: int, total: int, where: str) -> list[Piece]:
    """A segment's blocks as pieces, checked to tile it (a block's address, where the snapshot
    gives none, follows from the sizes before it)."""
    pieces: list[Piece] = []
    end = address
    for block in blocks:
        size, state = int(block["size"]), block.get("state")
        if int(block.get("address", end)) != end or size <= 0 or size % MIN_BLOCK_SIZE:
            raise NotModelled(f"the blocks of {where} do not tile it")
        if state not in BLOCK_STATES:
            raise NotModelled(f"{where} has a block in the unknown state {state!r}")
        allocated = BLOCK_STATES[state]
        pieces.append((size, True, allocated, int(block.get("requested_size", size)) if allocated else 0))
        end += size
    if total <= 0 or end != address + total:
        raise NotModelled(f"the blocks of {where} do not tile it")
    return pieces


def _expandable(
    small: bool, ranges: list[tuple[int, int, list[Piece]]], address_space: int
) -> SegmentRecord:
    """One pool's expandable segment from its mapped ranges: it starts at the lowest of them
    (the snapshot does not tell whether unmapped pages come first) and spans ``address_space``
    rounded up to whole pages, as ``ExpandableSegment`` reserves it."""
    page = SMALL_BUFFER if small else LARGE_BUFFER
    ranges = sorted(ranges, key=lambda found: found[0])
    base, size = ranges[0][0], -(-address_space // page) * page
    pieces: list[Piece] = []
    end = base
    for address, total, found in ranges:
        if (address - base) % page or total % page or address + total > base + size:
            raise NotModelled(f"the mapped range at {address:#x} is not whole pages of one segment")
        if address > end:
            pieces.append((address - end, False, False, 0))
        pieces += found
        end = address + total
    if end < base + size:
        pieces.append((base + size - end, False, False, 0))
    return SegmentRecord(base, size, small, True, tuple(pieces))


def write_snapshot(records: Iterable[SegmentRecord], device: int = 0) -> list[dict[str, Any]]:
    """Segments as ``torch.cuda.memory_snapshot()`` reports them (the fields
    :func:`read_snapshot` reads, and the sizes torch adds up): an expandable segment as one
    segment per range of mapped pieces; on stream 0 and in the default pool. A free block's
    ``requested_size`` is 0 (torch keeps the last request's there)."""
    found: list[dict[str, Any]] = []
    for record in records:
        address = record.base
        run: list[dict[str, Any]] = []
        for size, mapped, allocated, requested in (*record.pieces, (0, False, False, 0)):
            if mapped:
                state = "active_allocated" if allocated else "inactive"
                run.append({"address": address, "size": size,
                            "requested_size": requested if allocated else 0, "state": state})
            elif run:
                found.append(_segment(run, record, device))
                run = []
            address += size
    return sorted(found, key=lambda segment: segment["address"])


def _segment(blocks: list[dict[str, Any]], record: SegmentRecord, device: int) -> dict[str, Any]:
    allocated = [b for b in blocks if b["state"] == "active_allocated"]
    return {
        "device": device,
        "address": blocks[0]["address"],
        "total_size": sum(b["size"] for b in blocks),
        "allocated_size": sum(b["size"] for b in allocated),
        "active_size": sum(b["size"] for b in allocated),
        "requested_size": sum(b["requested_size"] for b in allocated),
        "stream": 0,
        "segment_type": "small" if record.small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": record.expandable,
        "blocks": blocks,
    }


def parse_settings(text: str, name: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The allocator options a settings string sets: the modelled ones as the model's keyword
    arguments, and every other item as ``(key, value)``.

    >>> parse_settings("expandable_segments:True,max_split_size_mb:64,backend:native", "conf")
    ({'expandable_segments': True, 'max_split_size': 67108864}, [('backend', 'native')])

    Modelled: ``expandable_segments:True|False``, ``max_split_size_mb:N`` and
    ``max_non_split_rounding_mb:N`` (in bytes, as ``max_split_size`` and
    ``max_non_split_rounding``; N >= 20, as torch requires). Raises ``ValueError`` naming
    ``name`` (where the string came from) for a malformed modelled option.
    """
    options: dict[str, Any] = {}
    others: list[tuple[str, str]] = []
    for item in _split_items(text):
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(
                    f"{name}: expandable_segments must be True or False, got {value!r}"
                )
            options["expandable_segments"] = value == "True"
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            if not value.isdigit():
                raise ValueError(f"{name}: {key} must be a whole number of MiB, got {value!r}")
            target = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"
            options[target] = split_size_bytes(int(value), f"{name}: {key}")
        else:
            others.append((key, value))
    return options, others


def changes_placement(key: str, value: str) -> bool:
    """Whether a setting the model leaves out changes where blocks go: every one but the
    neutral ones (:data:`NEUTRAL_SETTINGS`, the pinned allocator's ``pinned_*``) and
    ``backend:native``; an unknown one is taken to change it.

    >>> changes_placement("roundup_power2_divisions", "4"), changes_placement("pinned_num_register_threads", "8")
    (True, False)
    """
    if key == "backend":
        return value != "native"
    return not (key in NEUTRAL_SETTINGS or key.startswith("pinned_"))


def modelled_settings(text: str, name: str = "the allocator settings") -> dict[str, Any]:
    """The model's keyword arguments for a settings string (see :func:`parse_settings`);
    raises :class:`NotModelled` when it sets anything else that changes where blocks go.

    >>> modelled_settings("expandable_segments:True,pinned_use_cuda_host_register:True")
    {'expandable_segments': True}
    """
    options, others = parse_settings(text, name)
    left_out = [f"{key}:{value}" for key, value in others if changes_placement(key, value)]
    if left_out:
        raise NotModelled(f"{name} set {', '.join(left_out)}, which the model leaves out")
    return options


def split_size_bytes(megabytes: int, name: str) -> int:
    """``max_split_size_mb``-style sizes in bytes; torch refuses fewer than ``kLargeBuffer``
    (20 MiB) there (``parseMaxSplitSize`` in ``c10/core/AllocatorConfig.cpp``)."""
    if isinstance(megabytes, bool) or not isinstance(megabytes, int):
        raise TypeError(f"{name} must be a whole number of MiB, got {megabytes!r}")
    if megabytes < LARGE_BUFFER >> 20:
        raise ValueError(f"{name}={megabytes} is too small: torch requires at least 20 (MiB)")
    return megabytes << 20


def _split_items(text: str) -> list[str]:
    """``key:value`` items separated by commas (commas inside ``[...]`` lists included)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def allocator_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The caching allocator's options set in ``PYTORCH_CUDA_ALLOC_CONF`` (else
    ``PYTORCH_ALLOC_CONF``), as torch reads them (the simulated GPU and the planner alike).

    >>> allocator_config({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64"})
    {'expandable_segments': True, 'max_split_size': 67108864}

    Args:
        environ: The environment (``os.environ``).

    Recognised: ``expandable_segments:True|False``, ``max_split_size_mb:N`` and
    ``max_non_split_rounding_mb:N`` (N >= 20, as ``c10/core/AllocatorConfig.cpp`` requires; see
    :func:`~autobatch._memory._snapshot.parse_settings`). Options that change allocation but are not
    modelled warn; the rest are ignored.
    """
    name = "PYTORCH_CUDA_ALLOC_CONF"
    text = environ.get(name)
    if text is None:
        name, text = "PYTORCH_ALLOC_CONF", environ.get("PYTORCH_ALLOC_CONF")
    options, others = parse_settings(text or "", name)
    for key, value in others:
        if changes_placement(key, value):
            warnings.warn(
                f"{name} sets {key}:{value}, which the caching allocator's model does not "
                "model; it is ignored",
                stacklevel=4,
            )
    return options
