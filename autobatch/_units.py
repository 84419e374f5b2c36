"""Reading and writing byte counts ("512MiB", "1.50 GiB")."""

from __future__ import annotations

import math
import re
from fractions import Fraction

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
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-z]*)\s*$", re.IGNORECASE)
#: Exponents beyond this are no size (and would make an enormous exact number).
_MAX_EXPONENT = 30
#: No device has more memory than a 64-bit address space.
_MAX_BYTES = 2**64


def parse_bytes(value: int | float | str, *, name: str = "capacity") -> int:
    """Bytes from an int or a string with a unit (``KiB``/``MiB``/``GiB``/``TiB`` are powers of
    1024; ``KB``/``MB``/``GB``/``TB`` powers of 1000).

    Computed exactly (an int of any size stays that int; ``"1.5GiB"`` is no float product), and
    anything that is not a finite positive size (``nan``, ``inf``, ``"1e999"``) is a
    ``ValueError`` naming ``name``.

    >>> parse_bytes("512MiB"), parse_bytes("1.5 GB"), parse_bytes(4096), parse_bytes(2**60 + 1)
    (536870912, 1500000000, 4096, 1152921504606846977)

    Args:
        value: A byte count (int, or a float holding a whole number of bytes) or a string such as
            ``"16GiB"``, ``"80GB"``, ``"1.5e9"``.
        name: The parameter's name, for messages.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string like '16GiB', got {value!r}")
    if isinstance(value, int):
        number, unit = Fraction(value), ""
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{name}={value!r} is not a size; give a finite number of bytes or e.g. '16GiB'"
            )
        number, unit = Fraction(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(3).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; write e.g. '16GiB', '512MiB', '80GB' or bytes"
            )
        mantissa, exponent = match.group(1), int(match.group(2) or 0)
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(
                f"{name}={value!r} is not a size a device can have; write e.g. '16GiB' or '80GB'"
            )
        number, unit = Fraction(mantissa) * Fraction(10) ** exponent, match.group(3).lower()
    else:
        raise TypeError(f"{name} must be a byte count or a string like '16GiB', got {value!r}")
    result = math.floor(number * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if result > _MAX_BYTES:
        raise ValueError(
            f"{name}={value!r} is {result:.3g} bytes, more than any device has "
            f"(at most 2**64); write e.g. '16GiB' or '80GB'"
        )
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
