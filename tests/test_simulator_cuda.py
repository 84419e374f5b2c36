"""Inside ``SimulatedGPU``, ``torch.cuda``'s memory calls answer for the simulated device, as a
training loop or another library makes them; outside, they are torch's own again."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import fresh_loop_fits
from torch import nn

import autobatch
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import mlp

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


@pytest.mark.parametrize("expandable", [False, True])
def test_accelerates_finder_lands_where_a_fresh_loop_says(expandable: bool) -> None:
    """Accelerate's ``find_executable_batch_size`` (times 0.9 after each OOM, its
    own clean-up in between) run inside the simulator, with the training function building
    its model and AdamW as Accelerate's docs ask, lands on the first size of its sequence that
    a user's own fresh loop trains: the failed tries leave nothing that moves it."""
    memory = pytest.importorskip("accelerate.utils.memory")
    template = mlp(width=256)
    capacity = "6MiB"

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(n)
        return torch.randn(n, 128, generator=generator), torch.randint(0, 10, (n,), generator=generator)

    sizes = [2048]  # Accelerate's sizes, their batches made in host memory as a loader's are
    while sizes[-1] > 1:
        sizes.append(int(sizes[-1] * 0.9))
    host = {n: sample(n) for n in sizes}
    tried: list[int] = []
    with SimulatedGPU(capacity, expandable_segments=expandable) as gpu:

        @memory.find_executable_batch_size(starting_batch_size=sizes[0])
        def train(batch_size: int) -> int:
            tried.append(batch_size)
            model = copy.deepcopy(template)
            gpu.adopt(model)
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(5):
                x, y = (t.clone() for t in host[batch_size])  # .to(device)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            return batch_size

        landed = train()
    truth = next(
        n for n in tried
        if fresh_loop_fits(template, sample, n, capacity, expandable_segments=expandable)
    )
    assert len(tried) > 3  # (it ran out of memory on the way)
    assert landed == truth == tried[-1]
