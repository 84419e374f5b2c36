"""Device memory backends: one class per kind of device, found through one registry.

Everything else in autobatch asks :func:`memory_for` about memory and never calls ``torch.cuda``
(or ``torch.mps``, ``torch.xpu``) itself. Every call that a CPU-only build of torch refuses is
guarded here (``torch.cuda.mem_get_info`` and ``synchronize`` raise ``AssertionError`` there, and
``reset_peak_memory_stats`` raises ``AttributeError``).

Allocated bytes are what live tensors hold; reserved bytes what the device's caching allocator
holds from the device (live tensors plus its cache). A caching allocator runs out when a new
segment does not fit beside what it reserved, so backends that know it report reserved bytes
and the allocator's statistics too (:meth:`DeviceMemory.memory_stats`).
"""

from __future__ import annotations

import gc
import os
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._log import get_logger
from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._blocks import LARGE_BUFFER
from autobatch._memory._snapshot import (
    NotModelled,
    allocator_config,
    modelled_settings,
    split_size_bytes,
)

logger = get_logger("backends")

DeviceLike = torch.device | str | int | None


def caching_allocator(
    capacity: int,
    used_elsewhere: int = 0,
    *,
    expandable_segments: bool | None = None,
    max_split_size_mb: int | None = None,
) -> CachingAllocator:
    """An empty model of CUDA's caching allocator for a device of ``capacity`` bytes,
    ``used_elsewhere`` of them taken by others, with the settings of
    ``PYTORCH_CUDA_ALLOC_CONF`` in this process unless given here: what the simulated GPU
    runs on, and what the planner places a step's storages on.

    >>> a = caching_allocator(1 << 30, 1 << 20, expandable_segments=True)
    >>> a.limit, a.expandable_segments
    (1072693248, True)
    """
    config = allocator_config(os.environ)
    if expandable_segments is None:
        expandable_segments = bool(config.get("expandable_segments", False))
    if max_split_size_mb is not None:
        config["max_split_size"] = split_size_bytes(max_split_size_mb, "max_split_size_mb")
    return CachingAllocator(
        capacity - used_elsewhere,
        expandable_segments=expandable_segments,
        max_split_size=config.get("max_split_size"),
        max_non_split_rounding=config.get("max_non_split_rounding", LARGE_BUFFER),
        # an expandable segment spans 9/8 of the device's memory (ExpandableSegment)
        address_space=capacity + capacity // 8,
    )


class AllocationModel(Protocol):
    """A caching allocator's state, copied: what would happen to storages allocated from it."""

    #: The bytes it may reserve in all.
    limit: int
    #: One segment per pool that grows by pages (``expandable_segments:True``).
    expandable_segments: bool

    def replay(self, events: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
        """Allocate and free storages in order (``(serial, nbytes)``, ``-1`` for a death) on a
        copy; its allocated and reserved peaks, or ``None`` when it ran out of memory."""
        ...

    def blocks(self) -> list[tuple[int, int, str, bool]]:
        """Every block, by address (the layout, to tell two states apart)."""
        ...


class DeviceMemory(ABC):
    """The memory of one device, as autobatch sees it.

    ``has_statistics`` is True when the backend can measure the peak of a step (CUDA, ROCm,
    XPU, the simulated GPU); searches then fit a memory model instead of bisecting blindly.
    """

    has_statistics: ClassVar[bool] = False
    #: The device types this backend serves.
    device_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def available(cls) -> bool:
        """Whether this build of torch and this machine have such a device."""
        return True

    @abstractmethod
    def capacity_bytes(self) -> int:
        """The device's real total memory (not what this process's allocator holds)."""

    def allocated_bytes(self) -> int:
        """Bytes held by live tensors (0 where the backend cannot tell)."""
        return 0

    def peak_bytes(self) -> int:
        """Highest :meth:`allocated_bytes` since the last :meth:`reset_peak` (0 if unknown)."""
        return 0

    def reset_peak(self) -> None:
        """Start a new peak measurement."""

    def free_bytes(self) -> int:
        """Bytes that new allocations can still get: device memory no one holds plus this
        process's cached, free blocks.

        An upper bound: work whose live bytes exceed it cannot fit. With a caching allocator,
        work that needs less may still run out (fragmentation: a request must fit in one cached
        block or in a new segment); what new segments can take is the capacity less the
        reserved bytes (:meth:`reserved_bytes`) and other processes' memory.
        """
        return max(self.capacity_bytes() - self.allocated_bytes(), 0)

    @property
    def caches(self) -> bool:
        """Whether a caching allocator stands between tensors and the device, and reports what
        it holds (:meth:`reserved_bytes`, :meth:`memory_stats`): memory then runs out when its
        segments do, which fragmentation can make happen before live tensors fill the device."""
        return False

    def reserved_bytes(self) -> int | None:
        """Bytes the caching allocator holds from the device, cached blocks included (``None``
        where the backend cannot tell)."""
        return None

    def peak_reserved_bytes(self) -> int | None:
        """Highest :meth:`reserved_bytes` since the last :meth:`reset_peak` (``None``: unknown)."""
        return None

    def memory_stats(self) -> dict[str, int] | None:
        """The caching allocator's statistics under ``torch.cuda.memory_stats()``'s key names
        (``"reserved_bytes.all.current"``, ``"num_alloc_retries"``, ...); ``None`` where the
        backend keeps none."""
        return None

    def alloc_retries(self) -> int | None:
        """How often the caching allocator released its cache and retried an allocation
        (``num_alloc_retries``), read as cheaply as the backend allows; ``None`` where the
        backend keeps no such count. A count that rises step after step is thrashing: every
        step frees the cache and rebuilds it, slowly, and an OOM is near."""
        return None

    def allocation_model(self) -> AllocationModel | None:
        """A model of the caching allocator as it is now, which replays storages exactly as
        the device would place them (see :class:`AllocationModel`); ``None`` where the backend
        has none."""
        return None

    def uncounted_bytes(self, objects: Iterable[Any]) -> int:
        """Bytes of the tensors held by ``objects`` (modules, optimizers) on this device that
        the backend's accounting leaves out (a simulated GPU entered after they were made and
        not told of them); 0 where every allocation counts, as on a real device."""
        return 0

    def synchronize(self) -> None:
        """Wait for queued work, so that failures and timings belong to the right step."""

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device."""

    @property
    def name(self) -> str:
        """A human name for messages and cache keys."""
        return str(self.device)

    @classmethod
    def rng_states(cls) -> Any:
        """The random-number generator states of every device of this kind (None: none kept)."""
        return None

    @classmethod
    def set_rng_states(cls, states: Any) -> None:
        """Put back what :meth:`rng_states` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class CudaMemory(DeviceMemory):
    """NVIDIA CUDA and AMD ROCm (torch exposes HIP devices as ``cuda``)."""

    has_statistics = True
    device_types = ("cuda",)

    @classmethod
    def available(cls) -> bool:
        return torch.cuda.is_available()

    def capacity_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def free_bytes(self) -> int:
        # What this process can still get: all it may reserve, less what live tensors hold.
        return max(self._reservable() - torch.cuda.memory_allocated(self.device), 0)

    def _reservable(self) -> int:
        """What the caching allocator may hold in all: what it reserved (cached blocks
        included) plus the driver's free memory (other processes' use already taken off),
        within any per-process cap set with ``torch.cuda.set_per_process_memory_fraction``."""
        free, total = torch.cuda.mem_get_info(self.device)
        limit = free + torch.cuda.memory_reserved(self.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            limit = min(limit, int(fraction(self.device) * total))
        return int(limit)

    @property
    def caches(self) -> bool:
        return True

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak_reserved_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def memory_stats(self) -> dict[str, int]:
        return dict(torch.cuda.memory_stats(self.device))

    def alloc_retries(self) -> int:
        # The flat dict is built from the nested one: read the nested one, once.
        stats = torch.cuda.memory.memory_stats_as_nested_dict(self.device)
        return int(stats.get("num_alloc_retries", 0))

    def allocation_model(self) -> AllocationModel | None:
        """A copy of the device's caching allocator, built from ``torch.cuda.memory_snapshot()``
        (see :meth:`~autobatch._memory._allocator.CachingAllocator.from_snapshot`), where torch runs
        its native allocator with settings the model covers: ``expandable_segments``,
        ``max_split_size_mb`` and ``max_non_split_rounding_mb`` (the pinned allocator's and the
        other neutral ones aside). ``None`` under any other setting that changes where blocks
        go (``roundup_power2_divisions``, ``garbage_collection_threshold``,
        ``backend:cudaMallocAsync``), with a private pool (a CUDA graph's) or another stream's
        free blocks, or when anything cannot be read: a search then runs more trials instead.

        Its limit is what the allocator may reserve in all (what :meth:`free_bytes` counts
        from too): what it reserved plus the driver's free memory, within the per-process
        memory fraction.
        """
        try:
            return self._allocator_copy()
        except Exception as error:  # whatever cannot be read or modelled: no model
            logger.debug("no copy of the caching allocator of %s: %s", self.device, error)
            return None

    def _allocator_copy(self) -> CachingAllocator:
        backend = torch.cuda.memory.get_allocator_backend()
        if backend != "native":
            raise NotModelled(f"the allocator backend is {backend!r}, not the native one")
        options = modelled_settings(*_allocator_settings())
        # max_split_size as the allocator runs with it, whichever setting set it last
        split = torch.cuda.memory_stats(self.device).get("max_split_size")
        if split is not None:
            options["max_split_size"] = None if split < 0 else int(split)  # (-1: no limit)
        capacity = self.capacity_bytes()  # an expandable segment spans 9/8 of it
        index = self.device.index
        return CachingAllocator.from_snapshot(
            _memory_snapshot(),
            self._reservable(),
            address_space=capacity + capacity // 8,
            device=torch.cuda.current_device() if index is None else index,
            stream=int(torch.cuda.current_stream(self.device).cuda_stream),
            **options,
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    @classmethod
    def rng_states(cls) -> Any:
        return torch.cuda.get_rng_state_all()

    @classmethod
    def set_rng_states(cls, states: Any) -> None:
        torch.cuda.set_rng_state_all(states)

    @property
    def name(self) -> str:
        runtime = "ROCm" if torch.version.hip else "CUDA"
        return f"{torch.cuda.get_device_name(self.device)} ({runtime}, {self.device})"


def _allocator_settings() -> tuple[str, str]:
    """The CUDA caching allocator's settings string, and what to call it: the last one torch
    parsed (from the environment at start, or set later, as ``expandable_segments`` is at run
    time), where this torch tells it; else the environment variable it reads."""
    last = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if last is not None:
        return str(last()), "the allocator settings"
    names = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
    if torch.version.hip:
        names.insert(1, "PYTORCH_HIP_ALLOC_CONF")
    name = next((name for name in names if name in os.environ), names[0])
    return os.environ.get(name, ""), name


def _memory_snapshot() -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot()``, without the allocation history where torch can leave
    it out."""
    snapshot: Callable[..., Iterable[dict[str, Any]]] = torch.cuda.memory_snapshot  # (untyped)
    try:
        return list(snapshot(include_traces=False))
    except TypeError:  # (a torch whose snapshot takes no such argument)
        return list(snapshot())


class XpuMemory(DeviceMemory):
    """Intel GPUs through ``torch.xpu``."""

    has_statistics = True
    device_types = ("xpu",)

    @classmethod
    def available(cls) -> bool:
        xpu = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available())

    def capacity_bytes(self) -> int:
        return int(torch.xpu.get_device_properties(self.device).total_memory)

    def allocated_bytes(self) -> int:
        return int(torch.xpu.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        return int(torch.xpu.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.xpu.reset_peak_memory_stats(self.device)

    def free_bytes(self) -> int:
        if hasattr(torch.xpu, "mem_get_info"):
            return int(torch.xpu.mem_get_info(self.device)[0])
        return super().free_bytes()

    # torch.xpu has a caching allocator with CUDA's statistics since torch 2.5; older builds
    # lack these functions, and the backend then reports nothing.
    @property
    def caches(self) -> bool:
        return hasattr(torch.xpu, "max_memory_reserved")

    def reserved_bytes(self) -> int | None:
        reserved = getattr(torch.xpu, "memory_reserved", None)
        return None if reserved is None else int(reserved(self.device))

    def peak_reserved_bytes(self) -> int | None:
        peak = getattr(torch.xpu, "max_memory_reserved", None)
        return None if peak is None else int(peak(self.device))

    def memory_stats(self) -> dict[str, int] | None:
        stats = getattr(torch.xpu, "memory_stats", None)
        return None if stats is None else dict(stats(self.device))

    def alloc_retries(self) -> int | None:
        stats = self.memory_stats()
        return None if stats is None else int(stats.get("num_alloc_retries", 0))

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.xpu.empty_cache()

    @classmethod
    def rng_states(cls) -> Any:
        return torch.xpu.get_rng_state_all()

    @classmethod
    def set_rng_states(cls, states: Any) -> None:
        torch.xpu.set_rng_state_all(states)


class MpsMemory(DeviceMemory):
    """Apple GPUs. MPS keeps no peak statistics, so searches bisect there."""

    device_types = ("mps",)

    @classmethod
    def available(cls) -> bool:
        return bool(torch.backends.mps.is_available())

    def capacity_bytes(self) -> int:
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        if recommended is not None:
            return int(recommended())
        return _system_memory()[0]

    def allocated_bytes(self) -> int:
        return int(torch.mps.current_allocated_memory())

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    @classmethod
    def rng_states(cls) -> Any:
        return torch.mps.get_rng_state()

    @classmethod
    def set_rng_states(cls, states: Any) -> None:
        torch.mps.set_rng_state(states)


class CpuMemory(DeviceMemory):
    """Host memory. Capacity and free bytes come from the OS (and the cgroup limit, if lower)."""

    device_types = ("cpu",)

    @classmethod
    def rng_states(cls) -> Any:
        return torch.get_rng_state()

    @classmethod
    def set_rng_states(cls, states: Any) -> None:
        torch.set_rng_state(states)

    def capacity_bytes(self) -> int:
        return _system_memory()[0]

    def free_bytes(self) -> int:
        return _system_memory()[1]

    def empty_cache(self) -> None:
        """Nothing is cached, but a backward that raised on this thread may have left tensors
        queued in autograd (see :class:`BackwardLeftovers`): they go."""
        BackwardLeftovers().release()


_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread: one of its nodes, or the final
    callbacks after them."""
    if _GRAPH_TASK_ID is not None:
        return _GRAPH_TASK_ID() != -1
    return torch._C._current_autograd_node() is not None


class BackwardLeftovers:
    """What autograd keeps on this thread of a backward that raised, and its release.

    torch runs the backward of CPU tensors on the thread that called it: that thread pops the
    graph's ready nodes from its own queue (thread-local, ``local_ready_queue`` in
    ``torch/csrc/autograd/engine.cpp``) until the graph is done. When a node raises, the loop
    ends at once and the nodes that were ready beside it stay queued, each with its saved
    tensors and the gradients sent to it, until a later backward on the thread pops them (a
    task of a graph that has ended comes first there, ``NodeTask::getReentrantDepth``). A
    graph whose branches run side by side (a mixture of experts, several heads) can leave most
    of its activations behind. A GPU's nodes run on that device's autograd thread instead,
    which goes on popping and drops them before ``backward()`` raises.

    :meth:`release` runs the backward of one multiplication, built here, which pops them first.
    Make it where autograd records a graph: inside a dispatch mode's handler it does not, and
    :meth:`release` then does nothing.
    """

    def __init__(self) -> None:
        with torch.enable_grad(), torch.inference_mode(False), _disable_current_modes():
            self._leaf = torch.zeros((), requires_grad=True)
            self._root = self._leaf * 1.0

    def release(self) -> None:
        """Drop what a backward that raised left queued on the calling thread; nothing while a
        backward runs on it (its queue then holds that backward's own work)."""
        if self._root.grad_fn is None or in_backward():
            return
        with _disable_current_modes():
            torch.autograd.grad(self._root, self._leaf, retain_graph=True)


def _system_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, honouring a cgroup v2/v1 limit."""
    total = available = 0
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        total = info.get("MemTotal", 0)
        available = info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        pass
    if not total and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            available = total
        except (ValueError, OSError):
            pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            limit = int(text)
            available = min(available, limit)
            total = limit
    return total, available


#: Backends tried in order; the simulated GPU registers a provider that takes precedence.
BACKENDS: list[type[DeviceMemory]] = [CudaMemory, XpuMemory, MpsMemory, CpuMemory]

#: Providers consulted before :data:`BACKENDS` (the simulated GPU installs one while active).
_overrides: list[Callable[[torch.device], DeviceMemory | None]] = []


def resolve_device(device: DeviceLike = None) -> torch.device:
    """A concrete ``torch.device``: the given one with an index, else the best available.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device is None:
        for backend in BACKENDS:
            if backend.available():
                return resolve_device(backend.device_types[0])
        return torch.device("cpu")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    index: int | None = device.index
    if index is None and device.type in ("cuda", "xpu"):
        module: Any = getattr(torch, device.type)
        if module.is_available():
            device = torch.device(device.type, module.current_device())
    return device


def memory_for(device: DeviceLike = None) -> DeviceMemory:
    """The memory backend for ``device`` (the best available device when ``None``).

    While a :class:`~autobatch.testing.SimulatedGPU` is active, the CPU reports its numbers.

    >>> memory_for("cpu").capacity_bytes() > 0
    True
    """
    resolved = resolve_device(device)
    for provider in reversed(_overrides):
        memory = provider(resolved)
        if memory is not None:
            return memory
    for backend in BACKENDS:
        if resolved.type in backend.device_types:
            if not backend.available():
                raise ValueError(
                    f"device {resolved} is not available in this build of torch "
                    f"({torch.__version__}); pass device='cpu' or a device that exists"
                )
            return backend(resolved)
    raise ValueError(
        f"device type {resolved.type!r} has no memory backend; supported: "
        + ", ".join(t for b in BACKENDS for t in b.device_types)
    )


def free_memory(device: DeviceLike = None) -> None:
    """Collect garbage and give cached device memory back, on ``device`` or every device.

    Call it after leaving the ``except`` block of an out-of-memory error: inside it, the
    exception's traceback still holds every tensor of the failed attempt.

    >>> free_memory()  # safe on a CPU-only build of torch
    """
    gc.collect()
    if device is not None:
        targets = [memory_for(device)]
    else:  # through memory_for, so that a simulated GPU empties its cache too
        targets = [memory_for(b.device_types[0]) for b in BACKENDS if b.available()]
    for memory in targets:
        memory.synchronize()
        memory.empty_cache()


#: The backends whose devices this process has, found once (a check costs microseconds, and
#: the random streams are saved on every call of a decorated step).
_AVAILABLE: list[tuple[type[DeviceMemory], ...]] = []


def save_rng_states(*, host: bool = False) -> dict[str, Any]:
    """The random-number generator states of the CPU and every available device; with
    ``host``, also Python's ``random`` and NumPy's global stream (where NumPy is imported):
    tens of microseconds more, so only where a step is known to draw from them."""
    if not _AVAILABLE:
        _AVAILABLE.append(tuple(b for b in BACKENDS if b.available()))
    states: dict[str, Any] = {b.__name__: b.rng_states() for b in _AVAILABLE[0]}
    if host:
        states["random"] = random.getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            states["numpy"] = numpy.random.get_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`save_rng_states` returned."""
    for backend in BACKENDS:
        if backend.__name__ in states:
            backend.set_rng_states(states[backend.__name__])
    if "random" in states:
        random.setstate(states["random"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])


def host_rng_moved(states: dict[str, Any]) -> bool:
    """Whether Python's or NumPy's stream moved since ``save_rng_states(host=True)``."""
    if "random" in states and random.getstate() != states["random"]:
        return True
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return False
    if "numpy" not in states:
        return True  # (imported since: a step that draws from it, perhaps)
    now, then = numpy.random.get_state(), states["numpy"]
    return bool(now[2] != then[2] or now[3:] != then[3:] or (now[1] != then[1]).any())
