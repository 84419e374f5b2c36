"""The exceptions autobatch raises."""

from __future__ import annotations


class AutobatchError(RuntimeError):
    """Root of every error autobatch raises on purpose."""


class BatchSizeError(AutobatchError):
    """Even the smallest allowed batch does not fit on the device.

    ``needed_bytes`` is the best estimate of what the smallest batch needs (``None`` when the
    device keeps no statistics); ``capacity_bytes`` is the device's total memory.
    """

    def __init__(
        self,
        message: str,
        *,
        batch_size: int,
        needed_bytes: int | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
