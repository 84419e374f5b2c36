"""Reading torch's memory snapshot and allocator settings into the allocator model: what is
refused, and a simulated GPU's snapshot read back into an allocator that replays storages as
a copy of the simulator's own does."""

from __future__ import annotations

import contextlib
import copy
import doctest
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autobatch._memory import _snapshot
from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._snapshot import (
    NotModelled,
    changes_placement,
    modelled_settings,
    read_snapshot,
)
from autobatch.testing import SimulatedGPU

MiB = 1 << 20


def test_doctests() -> None:
    assert doctest.testmod(_snapshot).failed == 0


def _segment(**fields: Any) -> dict[str, Any]:
    """One 2 MiB small segment with an allocated and a free block, as torch reports it."""
    segment: dict[str, Any] = {
        "device": 0, "address": 1 << 40, "total_size": 2 * MiB, "stream": 0,
        "segment_type": "small", "segment_pool_id": (0, 0), "is_expandable": False,
        "blocks": [
            {"address": 1 << 40, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
            {"address": (1 << 40) + 1024, "size": 2 * MiB - 1024, "requested_size": 0,
             "state": "inactive"},
        ],
    }
    segment.update(fields)
    return segment


def _read(*segments: dict[str, Any], **options: Any) -> list[Any]:
    return read_snapshot(segments, **{"expandable_segments": False, "address_space": 0, **options})


def test_what_the_model_cannot_represent_is_refused() -> None:
    assert len(_read(_segment())) == 1
    pending = _segment()
    pending["blocks"][0]["state"] = "active_pending_free"  # freed, another stream still uses it
    ((_, (first, _)),) = ((r.base, r.pieces) for r in _read(pending))
    assert first == (1024, True, True, 1000)  # counted allocated, as torch does until it is free
    unknown = _segment()
    unknown["blocks"][1]["state"] = "reserved"
    gap = _segment()
    gap["blocks"][1]["address"] += 512
    short = _segment(total_size=4 * MiB)
    for segment, match in [
        (_segment(segment_pool_id=(1, 0)), "private pool"),  # a CUDA graph's
        (_segment(stream=7), "another stream"),
        (_segment(is_expandable=True), "is expandable"),
        (unknown, "unknown state 'reserved'"),
        (gap, "do not tile"),
        (short, "do not tile"),
    ]:
        with pytest.raises(NotModelled, match=match):
            _read(segment)
    # another stream's segment is kept while it holds no free block (it serves no request)
    full = _segment(stream=7)
    full["blocks"] = [dict(full["blocks"][0], size=2 * MiB, requested_size=2 * MiB)]
    assert [r.pieces for r in _read(full)] == [((2 * MiB, True, True, 2 * MiB),)]
    # other devices' segments are left out; blocks without addresses follow from the sizes
    bare = _segment(device=1)
    for block in bare["blocks"]:
        del block["address"]
    assert _read(bare, device=0) == []
    assert _read(bare, device=1) == _read(_segment(), device=0)


def test_expandable_ranges_become_one_segment_per_pool() -> None:
    page = 20 * MiB
    ranges = [
        {"address": (1 << 40) + offset, "total_size": page, "segment_type": "large",
         "is_expandable": True, "blocks": [{"size": page, "state": state, "requested_size": page}]}
        for offset, state in ((0, "active_allocated"), (2 * page, "inactive"))
    ]
    (record,) = _read(*ranges, expandable_segments=True, address_space=5 * page)
    assert (record.base, record.size, record.expandable) == (1 << 40, 5 * page, True)
    assert record.pieces == (
        (page, True, True, page), (page, False, False, 0), (page, True, False, 0),
        (2 * page, False, False, 0),
    )
    ranges[1]["address"] += MiB
    with pytest.raises(NotModelled, match="whole pages"):
        _read(*ranges, expandable_segments=True, address_space=5 * page)


def test_settings_the_model_leaves_out_are_refused_and_neutral_ones_pass() -> None:
    assert modelled_settings("") == {}
    assert modelled_settings(
        "expandable_segments:False, max_split_size_mb:64,max_non_split_rounding_mb:40,"
        "backend:native,pinned_use_background_threads:True,release_lock_on_cudamalloc:True,"
        "per_process_memory_fraction:0.5,pinned_num_register_threads:8"
    ) == {"expandable_segments": False, "max_split_size": 64 * MiB, "max_non_split_rounding": 40 * MiB}
    for text in (
        "roundup_power2_divisions:[256:1,>:4]",
        "garbage_collection_threshold:0.6",
        "backend:cudaMallocAsync",
        "large_segment_size_mb:64",  # unknown to the model: taken to change placement
    ):
        with pytest.raises(NotModelled, match=text.split(":")[0]):
            modelled_settings(text)
    with pytest.raises(ValueError, match="at least 20"):
        modelled_settings("max_split_size_mb:8")
    assert not changes_placement("backend", "native")


# -- a simulated GPU's snapshot -----------------------------------------------------------------


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


_SIZES = st.one_of(
    st.integers(1, 4096), st.integers(4096, 2 * MiB), st.integers(2 * MiB, 12 * MiB),
    st.integers(12 * MiB, 40 * MiB),
)
_OPS = st.lists(st.one_of(st.tuples(st.just("new"), _SIZES), st.tuples(st.just("drop"), st.integers(0, 100))),
                max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=_OPS, following=_OPS, expandable=st.booleans())
def test_a_simulated_gpus_snapshot_replays_as_a_copy_of_its_allocator(
    state: list[tuple[str, int]], following: list[tuple[str, int]], expandable: bool
) -> None:
    # The simulator's memory_snapshot() is torch's format; read back as a real device's backend
    # reads a GPU's, it gives an allocator that replays any continuation as the deep copy the
    # simulator hands the search does (expandable segments grown without pressure: a snapshot
    # does not show the pages a release unmapped before the first mapped one).
    capacity = (4 << 30) if expandable else 160 * MiB
    with SimulatedGPU(capacity, expandable_segments=expandable) as gpu:
        live: list[torch.Tensor] = []
        for op, n in state:
            if op == "new":
                with contextlib.suppress(torch.OutOfMemoryError):  # (that request fails)
                    live.append(_bytes(n))
            elif live:
                del live[n % len(live)]
        snapshot = gpu.memory_snapshot()
        original = gpu.allocator_copy()
    assert original is not None
    limit = max(96 * MiB, original.reserved_bytes)
    original.limit = limit
    rebuilt = CachingAllocator.from_snapshot(
        snapshot, limit, expandable_segments=expandable, address_space=original.address_space,
        device=0,
    )
    assert rebuilt.blocks() == original.blocks()
    assert rebuilt.segments() == original.segments()
    events, serial, made = [], 0, []
    for op, n in following:
        if op == "new":
            events.append((serial, n))
            made.append(serial)
            serial += 1
        elif made:
            events.append((made.pop(n % len(made)), -1))
    assert rebuilt.replay(events) == copy.deepcopy(original).replay(events)


def test_the_exact_model_has_no_snapshot() -> None:
    with SimulatedGPU("64MiB", allocator="exact") as gpu:
        t = _bytes(1000)
        assert gpu.memory_snapshot() == []
        del t
    with SimulatedGPU("64MiB", device_index=3) as gpu:
        t = _bytes(1000)
        ((segment),) = gpu.memory_snapshot()
        assert (segment["device"], segment["allocated_size"], segment["requested_size"]) == (3, 1024, 1000)
        del t
