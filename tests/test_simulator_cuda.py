"""Inside ``SimulatedGPU``, ``torch.cuda``'s memory calls answer for the simulated device, as a
training loop or another library makes them; outside, they are torch's own again."""

from __future__ import annotations

import torch
from torch import nn

import autobatch
from autobatch.testing import SimulatedGPU

_CALLS = ("empty_cache", "memory_allocated", "memory_reserved", "max_memory_allocated",
          "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info", "memory_stats")


def _train(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    opt.zero_grad()
    model(torch.randn(n, 64)).pow(2).mean().backward()
    opt.step()


def test_each_torch_cuda_memory_call_answers_for_the_simulated_device() -> None:
    own = {name: getattr(torch.cuda, name) for name in _CALLS}
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    with SimulatedGPU("64MiB", adopt=[model], used_elsewhere="4MiB") as gpu:
        _train(model, opt, 512)
        activations = torch.randn(1024, 256)
        assert torch.cuda.memory_allocated() == gpu.allocated_bytes > 0
        assert torch.cuda.memory_reserved(0) == gpu.reserved_bytes >= gpu.allocated_bytes
        assert torch.cuda.max_memory_allocated() == gpu.peak_bytes >= gpu.allocated_bytes
        assert torch.cuda.max_memory_reserved() == gpu.peak_reserved_bytes
        assert torch.cuda.memory_stats() == gpu.memory_stats()
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == gpu.allocated_bytes
        free, total = torch.cuda.mem_get_info()
        assert total == gpu.capacity_bytes
        assert free == gpu.capacity_bytes - gpu.used_elsewhere - gpu.reserved_bytes
        del activations
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        assert cached > 0  # (freed blocks stay cached, as on CUDA)
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < gpu.allocated_bytes + cached
        assert torch.cuda.memory_reserved() == gpu.reserved_bytes
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == gpu.allocated_bytes
        assert torch.cuda.mem_get_info()[0] > free  # (what empty_cache gave back)
    assert all(getattr(torch.cuda, name) is own[name] for name in _CALLS)
    assert all(getattr(torch.cuda.memory, name) is own[name] for name in _CALLS)


def test_torch_cuda_empty_cache_frees_as_much_as_autobatch_free_memory() -> None:
    reserved = []
    for free in (lambda: torch.cuda.empty_cache(), autobatch.free_memory):  # (looked up inside)
        with SimulatedGPU("32MiB") as gpu:
            x = torch.randn(2048, 1024)  # 8 MiB, then freed: cached
            del x
            assert gpu.reserved_bytes >= 8 * 2**20
            free()
            reserved.append(gpu.reserved_bytes)
    assert reserved[0] == reserved[1] == 0
