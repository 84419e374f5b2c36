"""A simulated GPU: CPU tensors, GPU memory accounting, and CUDA's out-of-memory error."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autobatch._memory import _backends
from autobatch._memory._accounting import (
    CUDA_BLOCK_BYTES,
    AllocatorCount,
    CountingMode,
    StorageCount,
    storages,
)
from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._backends import BackwardLeftovers, in_backward
from autobatch._memory._blocks import AllocatorOutOfMemory
from autobatch._units import format_bytes, parse_bytes

_active_lock = threading.Lock()
_active: list[SimulatedGPU] = []


def current_simulator() -> SimulatedGPU | None:
    """The innermost active :class:`SimulatedGPU`, if any."""
    return _active[-1] if _active else None


class SimulatedGPU:
    """A GPU of a chosen size, simulated on the CPU, for honest out-of-memory tests.

    Every tensor storage created while the context is active is counted (once per storage,
    rounded to the CUDA allocator's 512-byte blocks) until it dies: forward outputs, autograd's
    backward buffers, gradients and optimizer state alike. When memory runs out, the operator's
    outputs are dropped and a real ``torch.OutOfMemoryError`` with the CUDA caching allocator's
    message is raised, so any code that handles CUDA OOMs handles it. While active,
    autobatch's memory backend for the CPU reports the simulator's numbers.

    Two models of the device's allocator. ``"caching"`` (the default: CUDA's behaviour) models
    PyTorch's CUDA caching allocator (:mod:`autobatch._memory._allocator`): every storage is a
    block in a 2 MiB small-pool or a large-pool segment, freed blocks stay cached in their
    segments, and memory runs out when a new segment does not fit next to those already
    reserved, after the entirely free ones were released, as on a GPU whose process is capped
    with ``torch.cuda.set_per_process_memory_fraction``. Allocated bytes are the blocks'
    sizes there, as ``torch.cuda.memory_allocated`` reports them: the same as the exact
    model's, except that a large block whose remainder is too small to split (1 MiB or less)
    counts whole. ``"exact"`` counts allocated bytes: memory runs out when live storages would
    exceed the capacity (for byte-exact tests; no GPU has that allocator).

    >>> import torch
    >>> model = torch.nn.Linear(1024, 1024)
    >>> with SimulatedGPU("64MiB") as gpu:
    ...     _ = gpu.adopt(model)  # count what existed before entering
    ...     loss = model(torch.randn(32, 1024)).sum()
    ...     loss.backward()
    >>> gpu.peak_bytes > gpu.capacity_bytes // 64, gpu.peak_reserved_bytes >= gpu.peak_bytes
    (True, True)

    Args:
        capacity: Total memory, as bytes or a string with a unit (``"512MiB"``, ``"16GiB"``,
            ``"80GB"``).
        allocator: ``"caching"`` (CUDA's caching allocator: reserved segments, fragmentation,
            release and retry; the default) or ``"exact"`` (allocated bytes).
        expandable_segments: Caching model only: one segment per pool that grows by whole pages (2
            MiB small, 20 MiB large). ``None`` reads ``expandable_segments:True`` from
            ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), as torch does.
        max_split_size_mb: Caching model only: cached blocks of this many MiB or more are never
            split (at least 20, as torch requires). ``None`` reads ``max_split_size_mb:N`` from the
            same variable.
        block_bytes: Allocation rounding of the exact model; 512 matches
            ``torch.cuda.memory_allocated``, 1 counts raw bytes. The caching model always rounds as
            the allocator does (512).
        device_index: The GPU number printed in the out-of-memory message.
        adopt: Modules, optimizers or tensors to count from the start (see :meth:`adopt`).
        used_elsewhere: Memory held by other processes on the same GPU: the capacity stays the
            device's total, but only the rest can be allocated (as with a shared card).

    Tensors created on other threads than the one that entered are not counted, except
    autograd's backward, which torch runs with the entering thread's modes. A storage resized
    in place (``untyped_storage().resize_()``, as FSDP2 frees and re-allocates its gathered
    parameters) is counted at its new size. The caching model sees the storages an operator
    returns, in order, not the workspaces a CUDA kernel may take inside it. When a backward
    raises (out of memory or not), the autograd work it left ready, with the activations that
    work holds, is freed at the next operator or look at the simulator's numbers, as a GPU's
    autograd thread frees it before ``backward()`` raises (torch keeps it on the CPU until the
    thread's next backward).
    """

    def __init__(
        self,
        capacity: int | float | str,
        *,
        allocator: Literal["exact", "caching"] = "caching",
        expandable_segments: bool | None = None,
        max_split_size_mb: int | None = None,
        block_bytes: int = CUDA_BLOCK_BYTES,
        device_index: int = 0,
        adopt: tuple[Any, ...] | list[Any] = (),
        used_elsewhere: int | str = 0,
    ) -> None:
        self._allocator: CachingAllocator | None = None  # (made below, from these two)
        self._cuda_own: list[tuple[Any, str, Any]] = []  # torch.cuda's calls, while active
        self._capacity_bytes = parse_bytes(capacity)
        self._used_elsewhere = (
            parse_bytes(used_elsewhere, name="used_elsewhere") if used_elsewhere else 0
        )
        if self.used_elsewhere >= self.capacity_bytes:
            raise ValueError("used_elsewhere must be less than the capacity")
        self.device_index = device_index
        self.oom_count = 0
        if allocator == "caching":
            if block_bytes != CUDA_BLOCK_BYTES:
                raise ValueError(
                    f"block_bytes={block_bytes!r} applies to allocator='exact' only; the caching "
                    "model rounds as CUDA's allocator does (512 bytes)"
                )
            self._allocator = _backends.caching_allocator(
                self.capacity_bytes, self.used_elsewhere,
                expandable_segments=expandable_segments, max_split_size_mb=max_split_size_mb,
            )
            self.counted: StorageCount = AllocatorCount(self._allocator, self._refused)
            self._mode = _DeviceMode(self.counted)
        elif allocator == "exact":
            if expandable_segments is not None or max_split_size_mb is not None:
                raise ValueError(
                    "expandable_segments and max_split_size_mb apply to allocator='caching' "
                    "only; pass allocator='caching'"
                )
            self.counted = StorageCount(block_bytes)
            self._mode = _DeviceMode(self.counted, self._check)
        else:
            raise ValueError(f"allocator must be 'exact' or 'caching', got {allocator!r}")
        self.allocator = allocator
        self._entered = False
        if adopt:
            self.adopt(*adopt)

    @property
    def capacity_bytes(self) -> int:
        """The device's memory. It may be changed while the device is in use (memory taken or
        given back by another process): the caching model's allocator may then reserve up to
        the new capacity less ``used_elsewhere``; what it already holds stays held."""
        return self._capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self._capacity_bytes = value
        self._limit_changed()

    @property
    def used_elsewhere(self) -> int:
        """Memory other processes hold on the device (it may be changed too)."""
        return self._used_elsewhere

    @used_elsewhere.setter
    def used_elsewhere(self, value: int) -> None:
        self._used_elsewhere = value
        self._limit_changed()

    def _limit_changed(self) -> None:
        if self._allocator is not None:
            self._allocator.limit = max(self._capacity_bytes - self._used_elsewhere, 0)

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by live counted storages."""
        self._mode.settle()
        return self.counted.allocated_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`allocated_bytes` since creation or the last :meth:`reset_peak`."""
        return self.counted.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes the allocator holds from the device: its segments, in use or cached
        (``torch.cuda.memory_reserved``); the exact model reserves what is allocated."""
        self._mode.settle()
        if self._allocator is None:
            return self.counted.allocated_bytes
        return self._allocator.reserved_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        """Highest :attr:`reserved_bytes` since creation or the last :meth:`reset_peak`
        (``torch.cuda.max_memory_reserved``)."""
        if self._allocator is None:
            return self.counted.peak_bytes
        return self._allocator.peak_reserved_bytes

    @property
    def num_alloc_retries(self) -> int:
        """How often the allocator released its cache and retried a segment that did not fit
        (``num_alloc_retries``; always 0 in the exact model)."""
        return 0 if self._allocator is None else self._allocator.num_alloc_retries

    @property
    def segments(self) -> tuple[int, ...]:
        """The size of every reserved segment, by address (an expandable segment: each mapped
        range); empty in the exact model, which has none."""
        self._mode.settle()
        if self._allocator is None:
            return ()
        return tuple(size for size, _ in self._allocator.segments())

    @property
    def free_bytes(self) -> int:
        """Capacity held neither by live storages nor by other processes.

        The most that new allocations can still get: memory no segment holds plus the cached,
        free blocks. A piece of work whose live bytes exceed it cannot fit. Under the caching
        model one that needs less may still fail, because a request must fit in one cached
        block or in a new segment: ``capacity_bytes - used_elsewhere - reserved_bytes`` is
        what new segments can take. The same number as ``torch.cuda.mem_get_info``'s free
        memory plus ``memory_reserved - memory_allocated`` on a GPU.
        """
        return max(self.capacity_bytes - self.used_elsewhere - self.allocated_bytes, 0)

    def memory_stats(self) -> dict[str, int]:
        """The allocator's counters under ``torch.cuda.memory_stats()``'s key names.

        The caching model keeps ``allocation``, ``segment``, ``active``, ``allocated_bytes``,
        ``requested_bytes``, ``reserved_bytes`` and ``active_bytes`` (each ``.{all,small_pool,large_pool}.
        {current,peak,allocated,freed}``), ``inactive_split[_bytes].*.current``,
        ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free`` and
        ``max_split_size``; the exact model the ``all`` current and peak of allocated and
        reserved bytes (equal), ``num_alloc_retries`` (0) and ``num_ooms``.
        """
        self._mode.settle()
        if self._allocator is not None:
            return self._allocator.stats()
        allocated, peak = self.counted.allocated_bytes, self.counted.peak_bytes
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": self.oom_count,
            "reserved_bytes.all.current": allocated,
            "reserved_bytes.all.peak": peak,
        }

    def empty_cache(self) -> None:
        """Give every cached segment that is entirely free back to the device, as
        ``torch.cuda.empty_cache()`` does (nothing is cached in the exact model)."""
        self._mode.settle()
        if self._allocator is not None:
            self._allocator.empty_cache()

    def allocator_copy(self) -> CachingAllocator | None:
        """A copy of the caching model as it is now (``None`` in the exact model), whose
        :meth:`~autobatch._memory._allocator.CachingAllocator.replay` tells what storages
        allocated from here would do."""
        self._mode.settle()
        return None if self._allocator is None else copy.deepcopy(self._allocator)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """The caching model's segments and their blocks as ``torch.cuda.memory_snapshot()``
        reports a GPU's (empty in the exact model, which has none).

        Each segment has ``device``, ``address``, ``total_size``, ``allocated_size``,
        ``active_size``, ``requested_size``, ``stream`` (0), ``segment_type``,
        ``segment_pool_id`` ((0, 0)), ``is_expandable`` and ``blocks`` (each with ``address``,
        ``size``, ``requested_size`` and ``state``); an expandable segment is one segment per
        range of mapped pages. :meth:`~autobatch._memory._allocator.CachingAllocator.from_snapshot`
        reads it back as a real device's backend reads a GPU's.
        """
        self._mode.settle()
        return [] if self._allocator is None else self._allocator.snapshot(self.device_index)

    def reset_peak(self) -> None:
        """Start new peak measurements (allocated and reserved) from the current values."""
        self.counted.reset_peak()

    def adopt(self, *objects: Any) -> int:
        """Count tensors that existed before the simulator did; returns the bytes added.

        Takes modules (parameters, gradients, buffers), optimizers (their state), GradScalers,
        tensors and containers of them. Adopting twice counts once. Adopting more than the
        capacity raises the same out-of-memory error as an operator would.
        """
        added = sum(self.counted.add(storage) for storage in storages(objects))
        if self._allocator is None and self.allocated_bytes + self.used_elsewhere > self.capacity_bytes:
            raise self._error(added)
        return added

    def _check(self, added: int) -> BaseException | None:
        if self.counted.allocated_bytes + self.used_elsewhere <= self.capacity_bytes:
            return None
        self.oom_count += 1
        return self._error(added)

    def _error(self, added: int) -> torch.OutOfMemoryError:
        allocated = self.allocated_bytes - added
        in_use = allocated + self.used_elsewhere
        free = max(self.capacity_bytes - in_use, 0)
        return _out_of_memory(
            added, self.device_index, self.capacity_bytes, free, allocated, allocated
        )

    def _refused(self, oom: AllocatorOutOfMemory) -> torch.OutOfMemoryError:
        """The caching model's refusal as CUDA reports it: the segment it tried to reserve,
        the device's free memory, and allocated and reserved bytes after the cache release."""
        self.oom_count += 1
        return _out_of_memory(
            oom.alloc_size, self.device_index, self.capacity_bytes, oom.free, oom.allocated,
            oom.reserved,
        )

    def __enter__(self) -> SimulatedGPU:
        with _active_lock:
            if self._entered:
                raise RuntimeError("this SimulatedGPU is already active; create a new one")
            if _active:
                raise RuntimeError("a SimulatedGPU is already active; simulators do not nest")
            self._entered = True
            _active.append(self)
            _backends._overrides.append(self._memory_for)
            torch.UntypedStorage.resize_ = _resize_counted  # type: ignore[method-assign,assignment]
            self._cuda_own = _answer_cuda_calls(self)
        self._mode.start()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.settle()
        self._mode.__exit__(*exc)
        with _active_lock:
            _active.remove(self)
            _backends._overrides.remove(self._memory_for)
            _restore_cuda_calls(self._cuda_own)
            self._entered = False
            if not _active:  # torch's own method again
                if _OWN_RESIZE is None:
                    del torch.UntypedStorage.resize_  # (inherited from the C base)
                else:
                    torch.UntypedStorage.resize_ = _OWN_RESIZE  # type: ignore[method-assign]

    def _resized(self, storage: torch.UntypedStorage, old: int) -> None:
        """Count a storage resized in place, where this simulator counts (its mode is active
        on this thread); a growth that does not fit is undone and raises CUDA's error."""
        if self._mode not in _get_current_dispatch_mode_stack():
            return
        if storage not in self.counted and not storage.nbytes():
            return  # (a storage this simulator never counted, freed)
        error: BaseException | None = None
        peak = self.counted.peak_bytes
        try:
            added = self.counted.add(storage)
        except torch.OutOfMemoryError as refused:  # the allocator model found no room
            error = refused.with_traceback(None)
        else:
            if added > 0 and self._allocator is None:
                error = self._check(added)
        if error is not None:  # as on a GPU, the storage keeps its old size
            _RESIZE(storage, old)
            if self._allocator is None:
                self.counted.add(storage)
                self.counted.peak_bytes = peak
            raise error

    def _memory_for(self, device: torch.device) -> _backends.DeviceMemory | None:
        return SimulatedMemory(device, self) if device.type == "cpu" else None

    def __repr__(self) -> str:
        reserved = ""
        if self._allocator is not None:
            reserved = (
                f", reserved={format_bytes(self.reserved_bytes)}, "
                f"peak_reserved={format_bytes(self.peak_reserved_bytes)}"
            )
        return (
            f"SimulatedGPU(capacity={format_bytes(self.capacity_bytes)}, "
            f"allocator={self.allocator!r}, allocated={format_bytes(self.allocated_bytes)}, "
            f"peak={format_bytes(self.peak_bytes)}{reserved})"
        )


_OWN_RESIZE = vars(torch.UntypedStorage).get("resize_")  # (None: inherited, as in torch 2.13)
_RESIZE = _OWN_RESIZE or vars(torch._C.StorageBase)["resize_"]


def _resize_counted(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while a simulator is active: the storage is counted at its
    new size (FSDP2 frees its gathered parameters with ``resize_(0)``)."""
    old = storage.nbytes()
    result = _RESIZE(storage, size)
    gpu = current_simulator()
    if gpu is not None and storage.nbytes() != old:
        gpu._resized(storage, old)
    return result


def _out_of_memory(
    tried: int, device: int, capacity: int, free: int, allocated: int, reserved: int
) -> torch.OutOfMemoryError:
    """CUDA's out-of-memory error, worded as ``DeviceCachingAllocator::malloc`` words it (the
    process's memory in use is what it reserved: the CUDA context is not modelled)."""
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_bytes(tried)}. "
        f"GPU {device} has a total capacity of {format_bytes(capacity)} "
        f"of which {format_bytes(free)} is free. Including non-PyTorch memory, this process "
        f"has {format_bytes(reserved)} memory in use. Of the allocated memory "
        f"{format_bytes(allocated)} is allocated by PyTorch, and "
        f"{format_bytes(reserved - allocated)} is reserved by PyTorch but unallocated. If "
        "reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


class _DeviceMode(CountingMode):
    """The simulator's counting mode, which also frees what a backward that raised left
    behind, as a GPU does before ``backward()`` raises.

    The simulated device is the CPU, whose backward runs on the calling thread and keeps the
    nodes left ready by a failed backward queued there, with their tensors
    (:class:`~autobatch._memory._backends.BackwardLeftovers`); a GPU's autograd thread drops them at
    once. Once an operator has run inside a backward, the first operator outside one (or the
    first look at the simulator's numbers, on the thread that entered it) releases them: a
    backward of one multiplication, which does nothing after a backward that finished.
    """

    def __init__(
        self, counted: StorageCount, check: Callable[[int], BaseException | None] | None = None
    ) -> None:
        super().__init__(counted, check)
        self.leftovers: BackwardLeftovers | None = None
        self.thread = 0
        self.backward_ran = False

    def start(self) -> None:
        """Called on the entering thread, where autograd records (before the mode is on)."""
        self.leftovers, self.thread = BackwardLeftovers(), threading.get_ident()
        self.backward_ran = False

    def settle(self) -> None:
        """Release what the last backward left, unless a backward still runs."""
        if (
            self.backward_ran
            and self.leftovers is not None
            and threading.get_ident() == self.thread
            and not in_backward()
        ):
            self.backward_ran = False
            self.leftovers.release()

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if in_backward():
            self.backward_ran = True
        elif self.backward_ran:
            self.settle()
        return super().dispatch(func, args, kwargs)


#: ``torch.cuda``'s memory calls, as the simulator answers them (for its device, any index)
_CUDA_CALLS: dict[str, Callable[[SimulatedGPU], Callable[..., Any]]] = {
    "empty_cache": lambda gpu: lambda: gpu.empty_cache(),
    "memory_allocated": lambda gpu: lambda device=None: gpu.allocated_bytes,
    "memory_reserved": lambda gpu: lambda device=None: gpu.reserved_bytes,
    "max_memory_allocated": lambda gpu: lambda device=None: gpu.peak_bytes,
    "max_memory_reserved": lambda gpu: lambda device=None: gpu.peak_reserved_bytes,
    "reset_peak_memory_stats": lambda gpu: lambda device=None: gpu.reset_peak(),
    "mem_get_info": lambda gpu: lambda device=None: (
        max(gpu.capacity_bytes - gpu.used_elsewhere - gpu.reserved_bytes, 0), gpu.capacity_bytes),
    "memory_stats": lambda gpu: lambda device=None: gpu.memory_stats(),
}


def _answer_cuda_calls(gpu: SimulatedGPU) -> list[tuple[Any, str, Any]]:
    """While ``gpu`` is active, ``torch.cuda``'s memory calls (as a training loop or another
    library makes them: ``torch.cuda.empty_cache()``) answer for it; what they were."""
    own = []
    for module in (torch.cuda, torch.cuda.memory):
        for name, make in _CUDA_CALLS.items():
            own.append((module, name, getattr(module, name)))
            setattr(module, name, make(gpu))
    return own


def _restore_cuda_calls(own: list[tuple[Any, str, Any]]) -> None:
    for module, name, function in own:
        setattr(module, name, function)


class SimulatedMemory(_backends.DeviceMemory):
    """The memory backend of the CPU while a :class:`SimulatedGPU` is active."""

    has_statistics = True
    device_types = ("cpu",)

    def __init__(self, device: torch.device, gpu: SimulatedGPU) -> None:
        super().__init__(device)
        self.gpu = gpu

    def capacity_bytes(self) -> int:
        return self.gpu.capacity_bytes

    def uncounted_bytes(self, objects: Iterable[Any]) -> int:
        counted = self.gpu.counted
        return sum(
            counted.size_of(storage)
            for storage in storages(list(objects))
            if storage.device.type == self.device.type and storage not in counted
        )

    def allocated_bytes(self) -> int:
        return self.gpu.allocated_bytes

    def peak_bytes(self) -> int:
        return self.gpu.peak_bytes

    def reset_peak(self) -> None:
        self.gpu.reset_peak()

    def free_bytes(self) -> int:
        return self.gpu.free_bytes

    @property
    def caches(self) -> bool:
        return self.gpu.allocator == "caching"

    def reserved_bytes(self) -> int:
        return self.gpu.reserved_bytes

    def peak_reserved_bytes(self) -> int:
        return self.gpu.peak_reserved_bytes

    def memory_stats(self) -> dict[str, int]:
        return self.gpu.memory_stats()

    def alloc_retries(self) -> int:
        return self.gpu.num_alloc_retries

    def empty_cache(self) -> None:
        self.gpu.empty_cache()

    def allocation_model(self) -> CachingAllocator | None:
        return self.gpu.allocator_copy()

    @property
    def name(self) -> str:
        return f"simulated GPU {self.gpu.device_index} ({format_bytes(self.gpu.capacity_bytes)})"
