"""What the planner answers: the plan and its breakdown of the peak."""

from __future__ import annotations

from dataclasses import dataclass, field

from autobatch._search import LinearModel
from autobatch._units import format_bytes


@dataclass(frozen=True)
class PlanBreakdown:
    """Where the planned peak goes, at the planned largest batch; the parts add up to ``peak``.

    >>> PlanBreakdown(parameters=4096, buffers=0, gradients=4096, optimizer_state=8192,
    ...               batch=512, activations=1024).peak
    17920

    Args:
        parameters: the parameters.
        buffers: the buffers (e.g. BatchNorm running statistics).
        gradients: the gradients alive at the peak (all of them only when the peak is in the
            optimizer step).
        optimizer_state: the optimizer's state (e.g. Adam's two moments).
        batch: the input batch.
        activations: everything else alive at the peak: activations saved for backward,
            autograd's buffers and temporaries.
        cached: what the caching allocator reserves beyond them: the unused parts of its
            segments at the reserved peak (0 on exact accounting).
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    batch: int
    activations: int
    cached: int = 0

    @property
    def peak(self) -> int:
        """The planned peak bytes, the sum of the parts."""
        return (
            self.parameters + self.buffers + self.gradients + self.optimizer_state + self.batch
            + self.activations + self.cached
        )

    def __str__(self) -> str:
        parts = ", ".join(
            f"{name.replace('_', ' ')} {format_bytes(getattr(self, name))}"
            for name in ("parameters", "buffers", "gradients", "optimizer_state", "batch",
                         "activations", "cached")
            if name != "cached" or self.cached
        )
        return f"peak {format_bytes(self.peak)} = {parts}"


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_max_batch` predicts for a device of ``capacity_bytes``.

    ``max_batch_size`` is the largest size that fits the capacity less ``overhead_bytes``
    (exact for the planner's accounting: that size was planned and fit, the next one was
    planned and did not, or the caching allocator's replay of the planned storages says it
    fails); ``batch_size`` is ``(1 - headroom)`` of it, on the grid. ``points`` are every
    ``(size, planned peak bytes)`` computed: reserved bytes (the caching allocator's segments)
    of the sizes that fit on the default ``allocator="caching"``, allocated bytes of every
    size on exact accounting; ``memory_model`` is the line through the points
    at about half the largest size and at the largest size (``None`` when memory does not grow).
    ``breakdown`` splits the peak at ``max_batch_size``; ``seconds`` is the planning time.
    ``method`` is ``"meta"`` (the step run on the meta device at the sizes planned) or
    ``"steps"`` (small real steps on a CPU copy, extrapolated per operator: for steps that
    cannot run on ``meta``, such as attention masks read with ``.item()``, and recurrent layers).
    """

    batch_size: int
    max_batch_size: int
    memory_model: LinearModel | None
    points: tuple[tuple[int, int], ...]
    capacity_bytes: int
    overhead_bytes: int
    breakdown: PlanBreakdown
    seconds: float
    headroom: float
    device_type: str
    notes: tuple[str, ...] = field(default=())
    method: str = "meta"

    def __repr__(self) -> str:
        lines = [
            f"Plan(batch_size={self.batch_size}, max_batch_size={self.max_batch_size}, "
            f"capacity={format_bytes(self.capacity_bytes)}, "
            f"overhead={format_bytes(self.overhead_bytes)}, headroom={self.headroom:g}, "
            f"device_type={self.device_type!r}, seconds={self.seconds:.2f})"
        ]
        if self.memory_model is not None:
            lines.append(
                f"  memory model: {format_bytes(self.memory_model.fixed)} + "
                f"{format_bytes(self.memory_model.per_sample)} per sample"
            )
        lines.append(f"  at batch {self.max_batch_size}: {self.breakdown}")
        lines += [f"  planned batch {n:>6}: peak {format_bytes(peak)}" for n, peak in self.points]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = __repr__


