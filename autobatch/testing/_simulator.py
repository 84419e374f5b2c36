"""A simulated GPU: CPU tensors, GPU memory accounting, and CUDA's out-of-memory error."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import torch

from autobatch import _backends
from autobatch._accounting import CUDA_BLOCK_BYTES, CountingMode, StorageLedger, storages
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
    backward buffers, gradients and optimizer state alike. When an operator would take the total
    past ``capacity``, its outputs are dropped and a real ``torch.OutOfMemoryError`` with the CUDA
    caching allocator's message is raised, so any code that handles CUDA OOMs handles it.
    While active, autobatch's memory backend for the CPU reports the simulator's numbers.

    >>> import torch
    >>> model = torch.nn.Linear(1024, 1024)
    >>> with SimulatedGPU("64MiB") as gpu:
    ...     _ = gpu.adopt(model)  # count what existed before entering
    ...     loss = model(torch.randn(32, 1024)).sum()
    ...     loss.backward()
    >>> gpu.peak_bytes > gpu.capacity_bytes // 64
    True

    Parameters
    ----------
    capacity:
        Total memory, as bytes or a string with a unit (``"512MiB"``, ``"16GiB"``, ``"80GB"``).
    block_bytes:
        Allocation rounding; 512 matches ``torch.cuda.memory_allocated``, 1 counts raw bytes.
    device_index:
        The GPU number printed in the out-of-memory message.
    adopt:
        Modules, optimizers or tensors to count from the start (see :meth:`adopt`).
    used_elsewhere:
        Memory held by other processes on the same GPU: the capacity stays the device's total,
        but only the rest can be allocated (as with a shared card).

    Only allocated bytes are modelled: the caching allocator's reserved-but-unused segments
    (fragmentation) are not, so a real GPU may fail a little earlier than the simulator.
    Tensors created on other threads than the one that entered are not counted, except
    autograd's backward, which torch runs with the entering thread's modes.
    """

    def __init__(
        self,
        capacity: int | float | str,
        *,
        block_bytes: int = CUDA_BLOCK_BYTES,
        device_index: int = 0,
        adopt: tuple[Any, ...] | list[Any] = (),
        used_elsewhere: int | str = 0,
    ) -> None:
        self.capacity_bytes = parse_bytes(capacity)
        self.used_elsewhere = parse_bytes(used_elsewhere, name="used_elsewhere") if used_elsewhere else 0
        if self.used_elsewhere >= self.capacity_bytes:
            raise ValueError("used_elsewhere must be less than the capacity")
        self.device_index = device_index
        self.ledger = StorageLedger(block_bytes)
        self.oom_count = 0
        self._mode = CountingMode(self.ledger, self._check)
        self._entered = False
        if adopt:
            self.adopt(*adopt)

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by live counted storages."""
        return self.ledger.allocated_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`allocated_bytes` since creation or the last :meth:`reset_peak`."""
        return self.ledger.peak_bytes

    @property
    def free_bytes(self) -> int:
        """Capacity held neither by counted storages nor by other processes."""
        return max(self.capacity_bytes - self.used_elsewhere - self.allocated_bytes, 0)

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current live bytes."""
        self.ledger.reset_peak()

    def adopt(self, *objects: Any) -> int:
        """Count tensors that existed before the simulator did; returns the bytes added.

        Takes modules (parameters, gradients, buffers), optimizers (their state), GradScalers,
        tensors and containers of them. Adopting twice counts once. Adopting more than the
        capacity raises the same out-of-memory error as an operator would.
        """
        added = sum(self.ledger.add(storage) for storage in storages(objects))
        if self.allocated_bytes + self.used_elsewhere > self.capacity_bytes:
            raise self._error(added)
        return added

    def _check(self, added: int) -> BaseException | None:
        if self.ledger.allocated_bytes + self.used_elsewhere <= self.capacity_bytes:
            return None
        self.oom_count += 1
        return self._error(added)

    def _error(self, added: int) -> torch.OutOfMemoryError:
        allocated = self.allocated_bytes - added
        in_use = allocated + self.used_elsewhere
        free = max(self.capacity_bytes - in_use, 0)
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(added)}. "
            f"GPU {self.device_index} has a total capacity of {format_bytes(self.capacity_bytes)} "
            f"of which {format_bytes(free)} is free. Including non-PyTorch memory, this process "
            f"has {format_bytes(allocated)} memory in use. Of the allocated memory "
            f"{format_bytes(allocated)} is allocated by PyTorch, and 0 bytes is reserved by PyTorch "
            "but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
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
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)
        with _active_lock:
            _active.remove(self)
            _backends._overrides.remove(self._memory_for)
            self._entered = False

    def _memory_for(self, device: torch.device) -> _backends.DeviceMemory | None:
        return SimulatedMemory(device, self) if device.type == "cpu" else None

    def __repr__(self) -> str:
        return (
            f"SimulatedGPU(capacity={format_bytes(self.capacity_bytes)}, "
            f"allocated={format_bytes(self.allocated_bytes)}, "
            f"peak={format_bytes(self.peak_bytes)})"
        )


class SimulatedMemory(_backends.DeviceMemory):
    """The memory backend of the CPU while a :class:`SimulatedGPU` is active."""

    has_statistics = True
    device_types = ("cpu",)

    def __init__(self, device: torch.device, gpu: SimulatedGPU) -> None:
        super().__init__(device)
        self.gpu = gpu

    def capacity_bytes(self) -> int:
        return self.gpu.capacity_bytes

    def allocated_bytes(self) -> int:
        return self.gpu.allocated_bytes

    def peak_bytes(self) -> int:
        return self.gpu.peak_bytes

    def reset_peak(self) -> None:
        self.gpu.reset_peak()

    def free_bytes(self) -> int:
        return self.gpu.free_bytes

    @property
    def name(self) -> str:
        return f"simulated GPU {self.gpu.device_index} ({format_bytes(self.gpu.capacity_bytes)})"
