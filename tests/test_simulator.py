from __future__ import annotations

import gc
import re

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import autobatch
from autobatch._accounting import round_allocation
from autobatch._backends import memory_for
from autobatch.testing import OOM_KINDS, SimulatedGPU, inject_oom
from autobatch.testing.models import WORKLOADS


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _profiler_peak(prof: profile) -> int:
    """Largest running sum of the CPU allocator's allocation events, as the profiler saw them."""

    def walk(nodes):  # type: ignore[no-untyped-def]
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
              if n.tag == _EventType.Allocation]
    events.sort(key=lambda n: n.start_time_ns)
    total = peak = 0
    for event in events:
        total += event.extra_fields.alloc_size
        peak = max(peak, total)
    return peak


def _state_bytes(*objects: object, block: int = 512) -> int:
    seen: dict[int, int] = {}
    for obj in objects:
        tensors: list[torch.Tensor] = []
        if isinstance(obj, nn.Module):
            tensors += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [v for s in obj.state.values() for v in s.values() if torch.is_tensor(v)]
        else:
            assert isinstance(obj, torch.Tensor)
            tensors.append(obj)
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = round_allocation(t.untyped_storage().nbytes(), block)
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_peak_agrees_with_profiler(name: str) -> None:
    work = WORKLOADS[name]
    model, (x, y) = work.model(), work.sample(32)
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt, x, y)  # Adam's state exists: steady state
    with SimulatedGPU("4GiB", block_bytes=1) as gpu:
        gpu.adopt(model, opt, x, y)
        baseline = gpu.allocated_bytes
        gpu.reset_peak()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _train_step(model, opt, x, y)
    expected = baseline + _profiler_peak(prof)
    assert gpu.peak_bytes > 2 * baseline or name == "mlp"  # the step really allocated
    assert abs(gpu.peak_bytes - expected) <= 0.001 * expected, (gpu.peak_bytes, expected)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_live_bytes_after_step_are_parameters_plus_optimizer_state(name: str) -> None:
    work = WORKLOADS[name]
    model, (x, y) = work.model(), work.sample(16)
    opt = torch.optim.Adam(model.parameters())
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(model, x, y)
        assert gpu.allocated_bytes == _state_bytes(model, x, y)
        _train_step(model, opt, x, y)  # the first step creates Adam's state inside the simulator
        assert gpu.allocated_bytes == _state_bytes(model, opt, x, y)
        assert gpu.allocated_bytes > _state_bytes(model, x, y)


def test_allocations_are_rounded_like_the_cuda_allocator() -> None:
    with SimulatedGPU("1MiB") as gpu:
        a = torch.empty(1, dtype=torch.uint8)
        assert gpu.allocated_bytes == 512
        b = torch.empty(513, dtype=torch.uint8)
        assert gpu.allocated_bytes == 512 + 1024
        view = b[1:]  # a view is not an allocation
        assert gpu.allocated_bytes == 1536
        del b
        assert gpu.allocated_bytes == 1536  # the view keeps the storage alive
        del view, a
        assert gpu.allocated_bytes == 0
        assert gpu.peak_bytes == 1536


def test_in_place_resize_is_counted() -> None:
    with SimulatedGPU("1MiB") as gpu:
        t = torch.empty(0)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64), out=t)
        assert gpu.allocated_bytes == 64 * 64 * 4


def test_oom_has_cuda_message_and_frees_rejected_outputs() -> None:
    with SimulatedGPU("1MiB") as gpu:
        keep = torch.ones(1024, 128)  # 512 KiB
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.ones(1024, 256)  # 1 MiB more
        message = str(info.value)
        assert re.match(
            r"CUDA out of memory\. Tried to allocate 1\.00 MiB\. GPU 0 has a total capacity of "
            r"1\.00 MiB of which 512\.00 KiB is free\.",
            message,
        )
        assert autobatch.is_oom_error(info.value)
        assert gpu.allocated_bytes == 512 * 1024  # the rejected tensor is gone
        assert gpu.peak_bytes == 512 * 1024  # and never counted in the peak
        assert gpu.oom_count == 1
        del keep


def _oom_in_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> int:
    """Runs a step that OOMs; returns the bytes still alive inside the except block."""
    try:
        _train_step(model, opt, x, y)
    except torch.OutOfMemoryError:
        return memory_for("cpu").allocated_bytes()
    raise AssertionError("the step did not run out of memory")


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_recovery_after_leaving_except_returns_exactly_to_baseline(name: str) -> None:
    work = WORKLOADS[name]
    model, (x, y) = work.model(), work.sample({"mlp": 2048}.get(name, 64))
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt, x[:2], y[:2])
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, opt, x, y)
        baseline = gpu.allocated_bytes
        gpu.reset_peak()
        _train_step(model, opt, x[:2], y[:2])
        small = gpu.peak_bytes
        gpu.reset_peak()
        _train_step(model, opt, x, y)
        large = gpu.peak_bytes
    assert small < large
    with SimulatedGPU((small + large) // 2) as gpu:
        gpu.adopt(model, opt, x, y)
        inside_except = _oom_in_step(model, opt, x, y)
        # Inside the except block the traceback still held the failed attempt's activations...
        assert inside_except > baseline
        # ...once it is left (and the gradients a half-done backward accumulated are dropped),
        # every byte is back.
        opt.zero_grad(set_to_none=True)
        assert gpu.allocated_bytes == baseline  # without a garbage collection: no cycles
        autobatch.free_memory()
        assert gpu.allocated_bytes == baseline
        # and a smaller batch now runs in the same process
        _train_step(model, opt, x[:2], y[:2])
        assert gpu.allocated_bytes == baseline


def test_backend_registry_reports_the_simulator() -> None:
    outside = memory_for("cpu")
    assert not outside.has_statistics
    with SimulatedGPU("3GiB") as gpu:
        memory = memory_for("cpu")
        assert memory.has_statistics
        assert memory.capacity_bytes() == 3 * 2**30
        t = torch.empty(1000)
        assert memory.allocated_bytes() == 4096 == gpu.allocated_bytes
        memory.reset_peak()
        assert memory.peak_bytes() == 4096
        assert memory.free_bytes() == 3 * 2**30 - 4096
        del t
    assert type(memory_for("cpu")) is type(outside)


def test_simulators_do_not_nest_and_parse_capacities() -> None:
    assert SimulatedGPU("1.5GiB").capacity_bytes == 3 * 2**29
    assert SimulatedGPU("80GB").capacity_bytes == 80 * 10**9
    assert SimulatedGPU(4096).capacity_bytes == 4096
    with pytest.raises(ValueError, match="capacity"):
        SimulatedGPU("lots")
    with SimulatedGPU("1MiB"), pytest.raises(RuntimeError, match="do not nest"), SimulatedGPU("1MiB"):
        pass


def test_adopting_more_than_capacity_is_an_oom() -> None:
    big = torch.empty(1024, 1024)
    with SimulatedGPU("1MiB") as gpu, pytest.raises(torch.OutOfMemoryError):
        gpu.adopt(big)


# -- inject_oom -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(OOM_KINDS))
def test_every_injected_kind_is_classified_as_oom(kind: str) -> None:
    with inject_oom(kind) as fault, pytest.raises(Exception) as info:  # noqa: PT011
        torch.ones(3) + 1
    assert fault.fired == 1
    assert autobatch.is_oom_error(info.value)


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_inject_in_each_phase(phase: str) -> None:
    model = WORKLOADS["mlp"].model()
    opt = torch.optim.Adam(model.parameters())
    x, y = WORKLOADS["mlp"].sample(8)
    before = [p.detach().clone() for p in model.parameters()]
    reached: list[str] = []
    with inject_oom("cuda", phase=phase) as fault:
        try:
            loss = nn.functional.cross_entropy(model(x), y)
            reached.append("forward")
            loss.backward()
            reached.append("backward")
            opt.step()
            reached.append("optimizer")
        except torch.OutOfMemoryError:
            pass
        # fires once, then the same step passes
        _train_step(model, opt, x, y)
    assert fault.fired == 1
    phases = ["forward", "backward", "optimizer"]
    assert reached == phases[: phases.index(phase)]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_inject_at_nth_op_and_repeatedly() -> None:
    with inject_oom("cpu", at_op=3) as fault:
        a = torch.ones(2)
        b = a + 1
        with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
            b * 2
        b * 2  # the 4th op passes
    assert fault.fired == 1
    with inject_oom("cuda", times=None) as fault:
        for _ in range(3):
            with pytest.raises(torch.OutOfMemoryError):
                torch.ones(2)
    assert fault.fired == 3


def test_inject_batch_over_ignores_model_state() -> None:
    model = nn.Sequential(nn.Linear(4, 512), nn.ReLU(), nn.Linear(512, 2))  # dim 0 of weights: 512
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with inject_oom("cuda", batch_over=16, times=None) as fault:
        for n in (1, 8, 16):
            x = torch.randn(n, 4)
            model(x).sum().backward()
            opt.step()
            model(x).sum().backward()  # gradients accumulate into existing .grad
        assert fault.fired == 0
        with pytest.raises(torch.OutOfMemoryError):
            model(torch.randn(17, 4))
    assert fault.fired == 1


def test_inject_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kind"):
        inject_oom("tpu")
    with pytest.raises(ValueError, match="phase"):
        inject_oom(phase="loss")
    with pytest.raises(ValueError, match="at_op"):
        inject_oom(at_op=0)


def test_simulator_state_does_not_leak_between_runs() -> None:
    for _ in range(2):
        with SimulatedGPU("1MiB") as gpu:
            t = torch.ones(100)
            assert gpu.allocated_bytes == 512
            del t
            gc.collect()
            assert gpu.allocated_bytes == 0
