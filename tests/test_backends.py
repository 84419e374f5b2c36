"""The memory backends' reserved-memory surface, and its safety on a CPU-only build of torch."""

from __future__ import annotations

import logging

import pytest
import torch

import autobatch
from autobatch._memory._backends import (
    CpuMemory,
    CudaMemory,
    MpsMemory,
    XpuMemory,
    _allocator_settings,
    memory_for,
)
from autobatch._memory._snapshot import NotModelled, modelled_settings
from autobatch.testing import SimulatedGPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the calls on a CPU-only build")
def test_cuda_statistics_do_not_raise_on_a_cpu_only_build() -> None:
    memory = CudaMemory(torch.device("cuda", 0))  # constructed directly: no device exists
    assert memory.reserved_bytes() == 0
    assert memory.peak_reserved_bytes() == 0
    assert memory.memory_stats() == {}


@pytest.mark.skipif(
    bool(getattr(torch, "xpu", None)) and torch.xpu.is_available(),
    reason="checks the calls on a build without an XPU",
)
def test_xpu_statistics_are_absent_or_empty_without_a_device() -> None:
    memory = XpuMemory(torch.device("xpu", 0))
    assert memory.reserved_bytes() in (None, 0)
    assert memory.peak_reserved_bytes() in (None, 0)
    assert memory.memory_stats() in (None, {})


def test_backends_without_a_caching_allocator_report_none() -> None:
    for memory in (CpuMemory(torch.device("cpu")), MpsMemory(torch.device("mps"))):
        assert memory.reserved_bytes() is None
        assert memory.peak_reserved_bytes() is None
        assert memory.memory_stats() is None


def test_free_memory_without_a_device_empties_a_simulated_gpus_cache() -> None:
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        t = torch.empty(3 * 2**20, dtype=torch.uint8)
        del t
        assert gpu.reserved_bytes == 20 * 2**20  # cached
        autobatch.free_memory()
        assert gpu.reserved_bytes == 0
        assert memory_for("cpu").memory_stats()["num_device_free"] == 1  # type: ignore[index]


def test_free_memory_drops_what_a_failed_cpu_backward_left_queued_in_autograd() -> None:
    import weakref

    from torch import nn

    from autobatch.testing.models import MixtureOfExperts

    model = MixtureOfExperts(width=16, hidden=32, experts=4)
    outputs: list[weakref.ref[torch.UntypedStorage]] = []
    for expert in model.experts:  # each expert's activations, saved for its backward
        expert[1].register_forward_hook(
            lambda m, args, out: outputs.append(weakref.ref(out.untyped_storage()))
        )

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("a bug in a gradient hook")

    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    handle = model.experts[-1][2].weight.register_hook(fail)  # the first expert backward runs
    with pytest.raises(RuntimeError, match="a bug in a gradient hook"):
        nn.functional.cross_entropy(model(x), y).backward()
    handle.remove()
    # torch on the CPU keeps the experts that were ready beside the failed one queued on this
    # thread, with their activations, although nothing refers to them any more
    assert any(ref() is not None for ref in outputs)
    autobatch.free_memory("cpu")
    assert all(ref() is None for ref in outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the calls on a CPU-only build")
def test_no_copy_of_the_cuda_allocator_where_none_can_be_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = CudaMemory(torch.device("cuda", 0))  # constructed directly: no device exists
    with caplog.at_level(logging.DEBUG, logger="autobatch.backends"):
        assert memory.allocation_model() is None  # the search's fallback: more trials
    assert "no copy of the caching allocator of cuda:0" in caplog.text


def test_the_allocator_settings_are_the_ones_torch_runs_with() -> None:
    # Set at run time (as expandable segments are switched), not only in the environment.
    set_settings = torch._C._accelerator_setAllocatorSettings
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        set_settings("expandable_segments:True,max_split_size_mb:64,pinned_use_background_threads:True")
        assert modelled_settings(*_allocator_settings()) == {
            "expandable_segments": True, "max_split_size": 64 * 2**20,
        }
        set_settings("roundup_power2_divisions:4")
        with pytest.raises(NotModelled, match="roundup_power2_divisions:4"):
            modelled_settings(*_allocator_settings())
    finally:
        set_settings("expandable_segments:False")  # (a new string keeps this one setting)
        set_settings(before)
    assert _allocator_settings()[0] == before
