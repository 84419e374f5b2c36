"""autobatch: the largest batch that fits, and training that survives running out of memory."""

from __future__ import annotations

from autobatch._backends import free_memory
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._oom import is_oom_error, is_size_limit_error

__version__ = "0.1.0"

__all__ = [
    "AutobatchError",
    "BatchSizeError",
    "free_memory",
    "is_oom_error",
    "is_size_limit_error",
]
