"""Checks of user options, one place for all: a wrong type is a ``TypeError``, a wrong value a
``ValueError``, and both name the option, the value and what is expected.

Pure Python (torch is imported only by :func:`check_module`), so the search engine can use it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "check_fraction",
    "check_int",
    "check_module",
    "check_search_options",
    "is_sample_factory",
]


def check_int(name: str, value: object, *, minimum: int | None = 1) -> int:
    """``value`` as an int of at least ``minimum`` (any int with ``minimum=None``).

    >>> check_int("min_batch", 4)
    4
    >>> check_int("warmup", -1, minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: warmup must be at least 0, got -1

    Args:
        name: the option's name, for the message.
        value: what the caller passed.
        minimum: the smallest value allowed.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_fraction(name: str, value: object, *, example: str = "0.05") -> float:
    """``value`` as a float in ``[0, 1)`` (a headroom, a tolerance).

    >>> check_fraction("headroom", 0.1)
    0.1

    Args:
        name: the option's name, for the message.
        value: what the caller passed.
        example: a sensible value, for the message.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a fraction in [0, 1), e.g. {example}; got {value!r} "
            f"({type(value).__name__})"
        )
    if not (math.isfinite(value) and 0 <= value < 1):
        raise ValueError(f"{name} must be a fraction in [0, 1), e.g. {example}; got {value!r}")
    return float(value)


def check_module(name: str, value: object) -> Any:
    """``value``, which must be a ``torch.nn.Module``.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
    """
    from torch import nn

    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def is_sample_factory(sample: object) -> bool:
    """Whether a ``sample`` argument is a function of a batch size (not a batch, not a module).

    >>> is_sample_factory(lambda n: n), is_sample_factory([1, 2])
    (True, False)
    """
    if not callable(sample):
        return False
    import torch

    return not isinstance(sample, (torch.Tensor, torch.nn.Module))


def check_search_options(
    min_batch: object,
    max_batch: object,
    multiple_of: object,
    headroom: object,
    steps_per_trial: object,
) -> None:
    """The options every search front-end shares (finder, planner, timer, CLI).

    Args:
        min_batch: the smallest size allowed (>= 1).
        max_batch: the largest size allowed (>= ``min_batch``), or ``None``.
        multiple_of: the grid step (>= 1).
        headroom: the fraction of memory to leave free, in ``[0, 1)``.
        steps_per_trial: steps run per trial (>= 1).
    """
    low = check_int("min_batch", min_batch)
    check_int("multiple_of", multiple_of)
    check_int("steps_per_trial", steps_per_trial)
    if max_batch is not None:
        check_int("max_batch", max_batch, minimum=low)
    check_fraction("headroom", headroom)
