"""Reading and writing byte counts ("512MiB", "1.50 GiB")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str, *, name: str = "capacity") -> int:
    """Bytes from an int or a string with a unit (``KiB``/``MiB``/``GiB``/``TiB`` are powers of
    1024; ``KB``/``MB``/``GB``/``TB`` powers of 1000).

    >>> parse_bytes("512MiB"), parse_bytes("1.5 GB"), parse_bytes(4096)
    (536870912, 1500000000, 4096)
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string like '16GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; write e.g. '16GiB', '512MiB', '80GB' or bytes"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise TypeError(f"{name} must be a byte count or a string like '16GiB', got {value!r}")
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return result


def format_bytes(nbytes: float) -> str:
    """Bytes the way the CUDA caching allocator prints them in its messages.

    >>> format_bytes(20 * 2**20), format_bytes(100), format_bytes(3 * 2**30)
    ('20.00 MiB', '100 bytes', '3.00 GiB')
    """
    if abs(nbytes) < 2**10:
        return f"{int(nbytes)} bytes"
    if abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:.2f} KiB"
    if abs(nbytes) < 2**30:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"
