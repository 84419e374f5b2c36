from __future__ import annotations

import gc
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import autobatch
from autobatch._memory._accounting import round_allocation, storages
from autobatch._memory._backends import memory_for
from autobatch.testing import OOM_KINDS, SimulatedGPU, inject_oom
from autobatch.testing.models import WORKLOADS, MixtureOfExperts


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
    with SimulatedGPU("4GiB", allocator="exact", block_bytes=1) as gpu:  # raw bytes
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


@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_allocations_are_rounded_like_the_cuda_allocator(allocator: str) -> None:
    with SimulatedGPU("4MiB", allocator=allocator) as gpu:  # type: ignore[arg-type]
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


@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_in_place_resize_is_counted(allocator: str) -> None:
    with SimulatedGPU("4MiB", allocator=allocator) as gpu:  # type: ignore[arg-type]
        t = torch.empty(0)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64), out=t)
        assert gpu.allocated_bytes == 64 * 64 * 4


@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_a_storage_resized_in_place_counts_at_its_new_size(allocator: str) -> None:
    # FSDP2 frees its gathered parameters with untyped_storage().resize_(0) and gets them back
    # with resize_(n): no operator the dispatch mode sees
    original = torch.UntypedStorage.resize_
    with SimulatedGPU("8MiB", allocator=allocator) as gpu:  # type: ignore[arg-type]
        t = torch.empty(1024)  # 4 KiB
        base = gpu.allocated_bytes
        storage = t.untyped_storage()
        storage.resize_(0)
        assert gpu.allocated_bytes == base - 4096
        storage.resize_(8192)
        assert gpu.allocated_bytes == base + 4096
        peak = gpu.peak_bytes
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            storage.resize_(16 * 2**20)
        assert storage.nbytes() == 8192  # as on a GPU, it keeps its old size
        assert gpu.allocated_bytes == base + 4096
        assert gpu.peak_bytes == peak
        assert gpu.oom_count == 1
        untracked = torch.empty(0)
        with torch.utils._python_dispatch._disable_current_modes():
            untracked.untyped_storage().resize_(4096)  # outside the simulator's mode: not counted
        assert gpu.allocated_bytes == base + 4096
    assert torch.UntypedStorage.resize_ is original  # torch's own again
    storage.resize_(0)  # and nothing counts it any more


def test_oom_has_cuda_message_and_frees_rejected_outputs() -> None:
    with SimulatedGPU("1MiB", allocator="exact") as gpu:  # the caching model asks for segments
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
    # The exact model: a capacity between two allocated peaks fails the large step part-way
    # (the caching model may refuse its first 20 MiB segment, with nothing of the attempt alive).
    with SimulatedGPU("1GiB", allocator="exact") as gpu:
        gpu.adopt(model, opt, x, y)
        baseline = gpu.allocated_bytes
        gpu.reset_peak()
        _train_step(model, opt, x[:2], y[:2])
        small = gpu.peak_bytes
        gpu.reset_peak()
        _train_step(model, opt, x, y)
        large = gpu.peak_bytes
    assert small < large
    with SimulatedGPU((small + large) // 2, allocator="exact") as gpu:
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


def _expert_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 128, generator=generator), torch.randint(0, 10, (n,), generator=generator)


class _Phases:
    """A user's plain step of a mixture of experts, and the phase it ran out of memory in."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = MixtureOfExperts(width=32, hidden=128, experts=4)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.phase = ""

    def step(self, n: int, seed: int) -> None:
        x, y = _expert_rows(n, seed)
        self.opt.zero_grad(set_to_none=True)
        self.phase = "forward"
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.phase = "backward"
        loss.backward()
        self.phase = "optimizer"
        self.opt.step()
        self.phase = ""


@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_a_step_after_an_oom_in_the_backward_of_a_mixture_of_experts_runs(
    allocator: str, one_thread: None,
) -> None:
    # Experts run side by side in backward: when one runs out of memory, autograd's other ready
    # tasks (with the activations they hold) are left queued on the calling thread, where CPU
    # backward runs. On a GPU the device's autograd thread drops them before backward()
    # raises; the simulated GPU, which is the CPU underneath, must free them alike.
    user = _Phases()
    with SimulatedGPU("4MiB", allocator=allocator) as gpu:
        gpu.adopt(user.model, user.opt)
        user.step(200, 0)  # AdamW's state
        user.opt.zero_grad(set_to_none=True)
        baseline = gpu.allocated_bytes  # parameters and optimizer state
        fits, failed = 200, None
        for n in range(400, 2000, 20):
            try:
                user.step(n, n)
            except torch.OutOfMemoryError:
                failed = n
                break
            fits = n
        assert failed is not None, "no size ran out of memory"
        assert user.phase == "backward", f"the first OOM (batch {failed}) was in {user.phase}"
        user.opt.zero_grad(set_to_none=True)  # the gradients the half-done backward made
        assert gpu.allocated_bytes == baseline  # nothing of the failed step is left
        for seed in range(3):  # the size that fit just before fits again, step after step
            user.step(fits, seed)
            user.opt.zero_grad(set_to_none=True)
            assert gpu.allocated_bytes == baseline


def test_an_injected_oom_in_the_backward_of_a_mixture_of_experts_leaves_nothing(
    one_thread: None,
) -> None:
    user = _Phases()
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        gpu.adopt(user.model, user.opt)
        user.step(200, 0)
        user.opt.zero_grad(set_to_none=True)
        baseline = gpu.allocated_bytes
        # (after the router's gradient reaches the experts: several are then ready at once)
        with inject_oom(phase="backward", at_op=12) as fault, pytest.raises(torch.OutOfMemoryError):
            user.step(800, 1)
        assert fault.fired == 1
        user.opt.zero_grad(set_to_none=True)
        assert gpu.allocated_bytes == baseline
        user.step(800, 2)
        user.opt.zero_grad(set_to_none=True)
        assert gpu.allocated_bytes == baseline


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


@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_simulator_state_does_not_leak_between_runs(allocator: str) -> None:
    for _ in range(2):
        with SimulatedGPU("4MiB", allocator=allocator) as gpu:  # type: ignore[arg-type]
            t = torch.ones(100)
            assert gpu.allocated_bytes == 512
            del t
            gc.collect()
            assert gpu.allocated_bytes == 0


# -- the caching-allocator model --------------------------------------------------------------

MiB = 2**20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_caching_model_places_every_storage_in_a_cached_segment() -> None:
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        small = torch.empty(250)  # 1000 bytes: a 1 KiB block of a 2 MiB small-pool segment
        assert (gpu.allocated_bytes, gpu.reserved_bytes, gpu.segments) == (1024, 2 * MiB, (2 * MiB,))
        large = _bytes(3 * MiB)  # a 20 MiB large-pool segment
        view = large[1:]  # a view allocates nothing
        assert gpu.segments == (2 * MiB, 20 * MiB)
        assert gpu.allocated_bytes == 1024 + 3 * MiB
        del large, view
        assert gpu.allocated_bytes == 1024
        assert gpu.reserved_bytes == 22 * MiB  # the freed block stays cached
        again = _bytes(3 * MiB)  # and is used again: nothing new reserved
        assert gpu.reserved_bytes == 22 * MiB
        del again, small
        autobatch.free_memory()  # through the backend: every entirely free segment goes back
        assert gpu.reserved_bytes == 0
        assert gpu.segments == ()
        assert gpu.peak_reserved_bytes == 22 * MiB


def test_caching_oom_reports_the_segment_tried_and_the_reserved_but_unallocated_bytes() -> None:
    with SimulatedGPU("30MiB", allocator="caching") as gpu:
        keep = _bytes(5 * MiB)  # a 20 MiB segment, 15 MiB of it cached and free
        with pytest.raises(torch.OutOfMemoryError) as info:
            _bytes(17 * MiB)  # needs an 18 MiB segment: 20 + 18 > 30, even after the retry
        assert str(info.value).startswith(
            "CUDA out of memory. Tried to allocate 18.00 MiB. GPU 0 has a total capacity of "
            "30.00 MiB of which 10.00 MiB is free. Including non-PyTorch memory, this process "
            "has 20.00 MiB memory in use. Of the allocated memory 5.00 MiB is allocated by "
            "PyTorch, and 15.00 MiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
        assert autobatch.is_oom_error(info.value)
        assert (gpu.num_alloc_retries, gpu.oom_count) == (1, 1)
        assert gpu.allocated_bytes == 5 * MiB
        del keep
    with SimulatedGPU("21MiB", allocator="caching"):
        keep = _bytes(5 * MiB)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 MiB\. "):
            torch.empty(250)  # 1000 bytes need a whole 2 MiB small segment, and 20 + 2 > 21
        del keep


def _fragment_and_ask(gpu: SimulatedGPU) -> str:
    """Twelve 5 MiB tensors, all but the first and last freed, then one of 40 MiB."""
    blocks = [_bytes(5 * MiB) for _ in range(12)]
    kept = (blocks[0], blocks[-1])
    del blocks
    assert gpu.allocated_bytes == 10 * MiB
    message = "fits"
    try:
        big = _bytes(40 * MiB)
        del big
    except torch.OutOfMemoryError as error:
        message = str(error)
    del kept
    return message


@pytest.mark.parametrize(
    ("options", "fits"),
    [
        ({"allocator": "exact"}, True),
        ({"allocator": "caching"}, False),
        ({"allocator": "caching", "expandable_segments": True}, True),
    ],
)
def test_fragmentation_runs_out_with_most_of_the_device_unallocated(
    options: dict[str, object], fits: bool
) -> None:
    with SimulatedGPU("64MiB", **options) as gpu:  # type: ignore[arg-type]
        message = _fragment_and_ask(gpu)
    if fits:
        assert message == "fits"
    else:  # 10 MiB of 64 allocated: two 20 MiB segments with 15 MiB holes (the third,
        # entirely free, was released before the retry), and no room for a 40 MiB segment
        assert "Tried to allocate 40.00 MiB" in message
        assert "of which 24.00 MiB is free" in message
        assert "10.00 MiB is allocated by PyTorch, and 30.00 MiB is reserved" in message
        assert gpu.num_alloc_retries == 1


def test_an_operator_refused_midway_keeps_what_it_allocated_in_the_peak() -> None:
    x = torch.randn(3 * MiB)  # 12 MiB
    with SimulatedGPU("40MiB", allocator="caching") as gpu:
        gpu.adopt(x)  # one 12 MiB segment
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 24\.00 MiB"):
            torch.sort(x)  # values (12 MiB) are placed, then indices (24 MiB) are refused
        assert gpu.allocated_bytes == 12 * MiB  # the values were dropped with the error
        assert gpu.peak_bytes == 24 * MiB  # but they existed, as they would on a GPU
        assert gpu.reserved_bytes == 24 * MiB  # and their segment stays cached
    with SimulatedGPU("40MiB", allocator="exact") as gpu:  # it counts after the operator
        gpu.adopt(x)
        with pytest.raises(torch.OutOfMemoryError):
            torch.sort(x)
        assert gpu.peak_bytes == 12 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_caching_model_agrees_with_the_exact_one_on_allocated_bytes(name: str) -> None:
    work = WORKLOADS[name]
    model, (x, y) = work.model(), work.sample(32)
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt, x, y)
    seen = {}
    for label, options in {
        "exact": {"allocator": "exact"},
        "expandable": {"allocator": "caching", "expandable_segments": True},
        "caching": {"allocator": "caching"},
    }.items():
        with SimulatedGPU("4GiB", **options) as gpu:  # type: ignore[arg-type]
            gpu.adopt(model, opt, x, y)
            baseline = gpu.allocated_bytes
            gpu.reset_peak()
            _train_step(model, opt, x, y)
            seen[label] = (baseline, gpu.peak_bytes, gpu.allocated_bytes)
            assert gpu.reserved_bytes >= gpu.allocated_bytes
            assert gpu.peak_reserved_bytes >= gpu.peak_bytes
    # expandable segments split every block to its size: the same bytes, to the byte
    assert seen["expandable"] == seen["exact"]
    # otherwise a large block keeps a remainder of up to 1 MiB it could not split off
    large = sum(1 for s in storages([model, opt, x, y]) if s.nbytes() > MiB)
    for got, want in zip(seen["caching"], seen["exact"], strict=True):
        assert want <= got <= want + MiB * (large + 8)


def test_recovery_under_the_caching_model_returns_every_segment() -> None:
    work = WORKLOADS["mlp"]
    model, (x, y) = work.model(), work.sample(8192)  # activations of 8 MiB: several segments
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt, x[:2], y[:2])
    with SimulatedGPU("1GiB", allocator="caching") as gpu:
        gpu.adopt(model, opt, x, y)
        gpu.reset_peak()
        _train_step(model, opt, x, y)
        whole = gpu.peak_reserved_bytes
    with SimulatedGPU("1GiB", allocator="caching") as gpu:
        gpu.adopt(model, opt, x, y)
        resident, reserved = gpu.allocated_bytes, gpu.reserved_bytes
    with SimulatedGPU(reserved + (whole - reserved) // 2, allocator="caching") as gpu:
        gpu.adopt(model, opt, x, y)
        assert _oom_in_step(model, opt, x, y) > resident
        opt.zero_grad(set_to_none=True)
        assert gpu.allocated_bytes == resident
        assert gpu.reserved_bytes > reserved  # the failed step's segments are cached
        autobatch.free_memory()
        assert gpu.reserved_bytes == reserved  # the resident storages' segments only
        _train_step(model, opt, x[:2], y[:2])  # and a smaller batch runs
        assert gpu.allocated_bytes == resident


def test_free_bytes_bounds_what_fits_and_reserved_bytes_say_what_new_segments_get() -> None:
    with SimulatedGPU("64MiB", allocator="caching", used_elsewhere="4MiB") as gpu:
        blocks = [_bytes(5 * MiB) for _ in range(12)]  # 60 MiB: all that this process may use
        del blocks[1:-1]
        memory = memory_for("cpu")
        assert memory.free_bytes() == 64 * MiB - 4 * MiB - 10 * MiB
        with pytest.raises(torch.OutOfMemoryError):
            _bytes(memory.free_bytes() + 1)  # more live bytes than free_bytes: never fits
        with pytest.raises(torch.OutOfMemoryError):
            _bytes(40 * MiB)  # less can fail too: a request needs one block or one segment
        reserved = memory.reserved_bytes()
        assert reserved == 40 * MiB  # the entirely free segment was released for the retry
        room = gpu.capacity_bytes - gpu.used_elsewhere - reserved
        fits = _bytes(room)  # what a new segment can take does fit
        assert gpu.reserved_bytes == 60 * MiB
        del fits, blocks


def test_backend_reports_reserved_memory_and_cuda_statistics() -> None:
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        memory = memory_for("cpu")
        t = _bytes(3 * MiB)
        assert memory.reserved_bytes() == memory.peak_reserved_bytes() == 20 * MiB
        stats = memory.memory_stats()
        assert stats is not None
        assert stats["allocated_bytes.all.current"] == memory.allocated_bytes() == 3 * MiB
        assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
        assert stats["segment.all.current"] == 1
        assert stats["num_alloc_retries"] == stats["num_ooms"] == 0
        del t
        memory.empty_cache()
        assert (memory.reserved_bytes(), memory.peak_reserved_bytes()) == (0, 20 * MiB)
        memory.reset_peak()
        assert (memory.peak_reserved_bytes(), memory.peak_bytes()) == (0, 0)
        assert "reserved=0 bytes" in repr(gpu)
    with SimulatedGPU("64MiB", allocator="exact") as gpu:  # it reserves what it allocates
        memory = memory_for("cpu")
        t = _bytes(3 * MiB)
        assert memory.reserved_bytes() == memory.allocated_bytes() == 3 * MiB
        assert memory.memory_stats() == {
            "allocated_bytes.all.current": 3 * MiB,
            "allocated_bytes.all.peak": 3 * MiB,
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "reserved_bytes.all.current": 3 * MiB,
            "reserved_bytes.all.peak": 3 * MiB,
        }
        assert (gpu.segments, gpu.num_alloc_retries) == ((), 0)
        del t


def test_allocator_options_come_from_keywords_or_pytorch_cuda_alloc_conf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def block_for_19_mib(**options: object) -> int:
        with SimulatedGPU("1GiB", allocator="caching", **options) as gpu:  # type: ignore[arg-type]
            t = _bytes(19 * MiB)
            allocated = gpu.allocated_bytes
            del t
        return allocated

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert block_for_19_mib() == 20 * MiB  # a 1 MiB remainder is not split off
    assert block_for_19_mib(expandable_segments=True) == 19 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    assert block_for_19_mib() == 19 * MiB
    assert block_for_19_mib(expandable_segments=False) == 20 * MiB  # keywords win
    gpu = SimulatedGPU("1GiB", allocator="caching")
    assert gpu.memory_stats()["max_split_size"] == 64 * MiB
    gpu = SimulatedGPU("1GiB", allocator="caching", max_split_size_mb=32)
    assert gpu.memory_stats()["max_split_size"] == 32 * MiB
    SimulatedGPU("1GiB", allocator="exact")  # the exact model does not read the variable
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:[256:1,>:4],expandable_segments:True")
    with pytest.warns(UserWarning, match="roundup_power2_divisions"):
        assert block_for_19_mib() == 19 * MiB
    for bad, match in [
        ("max_split_size_mb:19", "at least 20"),
        ("max_split_size_mb:lots", "whole number"),
        ("expandable_segments:yes", "True or False"),
    ]:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", bad)
        with pytest.raises(ValueError, match=match):
            SimulatedGPU("1GiB", allocator="caching")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert block_for_19_mib() == 19 * MiB


def test_allocator_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="'exact' or 'caching'"):
        SimulatedGPU("1GiB", allocator="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allocator='caching'"):
        SimulatedGPU("1GiB", allocator="exact", expandable_segments=True)
    with pytest.raises(ValueError, match="block_bytes"):
        SimulatedGPU("1GiB", allocator="caching", block_bytes=1)
    with pytest.raises(ValueError, match="at least 20"):
        SimulatedGPU("1GiB", allocator="caching", max_split_size_mb=10)
    with pytest.raises(TypeError, match="whole number"):
        SimulatedGPU("1GiB", allocator="caching", max_split_size_mb=20.5)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("new"), st.integers(0, 3000)),
            st.tuples(st.just("new"), st.integers(3000, 24 * MiB)),
            st.tuples(st.just("drop"), st.integers(0, 100)),
        ),
        max_size=25,
    ),
    expandable=st.booleans(),
)
def test_real_tensors_allocate_what_the_exact_model_counts(
    ops: list[tuple[str, int]], expandable: bool
) -> None:
    def run(**options: object) -> list[tuple[int, int]]:
        seen = []
        with SimulatedGPU("1GiB", **options) as gpu:  # type: ignore[arg-type]
            live: list[torch.Tensor] = []
            for op, n in ops:
                if op == "new":
                    live.append(_bytes(n))
                elif live:
                    del live[n % len(live)]
                large = sum(1 for t in live if t.nbytes > MiB)
                seen.append((gpu.allocated_bytes, large))
                assert gpu.allocated_bytes <= gpu.reserved_bytes <= gpu.capacity_bytes
            del live
            gpu.empty_cache()
            assert gpu.reserved_bytes == 0
        return seen

    exact = run(allocator="exact")
    caching = run(allocator="caching", expandable_segments=expandable)
    for (want, large), (got, _) in zip(exact, caching, strict=True):
        if expandable:
            assert got == want
        else:  # a large block may keep an unsplit remainder of up to 1 MiB
            assert want <= got <= want + large * MiB


def test_a_capacity_changed_mid_run_reaches_the_caching_allocator() -> None:
    """Memory taken by another process while training: the caching model's allocator may
    reserve only up to the new capacity, and what it holds stays held."""
    with SimulatedGPU("64MiB") as gpu:
        held = torch.empty(10 << 20, dtype=torch.uint8)
        gpu.capacity_bytes = 30 << 20
        with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 30\.00 MiB"):
            torch.empty(25 << 20, dtype=torch.uint8)
        gpu.used_elsewhere = 0
        gpu.capacity_bytes = 64 << 20
        more = torch.empty(25 << 20, dtype=torch.uint8)
        assert gpu.reserved_bytes >= (35 << 20)
        gpu.used_elsewhere = 40 << 20
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(25 << 20, dtype=torch.uint8)
        del held, more
