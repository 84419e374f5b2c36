"""The package's loggers, and how its messages name things.

Every logger is a child of ``autobatch``, with no handler of the package's own: a user who
configured nothing sees WARNING and above once, through Python's last-resort handler, and
``logging.getLogger("autobatch")`` is the one switch. Under torch.distributed only rank 0 logs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _RankZero(logging.Filter):
    """Under torch.distributed, only rank 0 logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        from autobatch._distributed import rank

        return rank() == 0


def get_logger(name: str) -> logging.Logger:
    """``autobatch.<name>`` with the rank-0 filter."""
    logger = logging.getLogger(f"autobatch.{name}")
    if not any(isinstance(f, _RankZero) for f in logger.filters):
        logger.addFilter(_RankZero())
    return logger


def shown(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` from ``logger`` reaches a handler that someone configured
    (the last-resort handler, which shows WARNING and above when there is none, does not
    count): then it need not be shown another way too."""
    if not logger.isEnabledFor(level):
        return False
    node: logging.Logger | None = logger
    while node is not None:
        if any(level >= handler.level for handler in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def user_name(fn: object) -> str:
    """How messages and histories name a user's function: ``module.qualname``.

    >>> def train_step(batch): ...
    >>> user_name(train_step).rsplit(".", 1)[-1]
    'train_step'
    >>> user_name(functools.partial(len))
    'builtins.len'

    A ``functools.partial`` is named by its function, a bound method by its class and name, and
    another callable object by its class.
    """
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__qualname__", None)
    if not isinstance(name, str):
        target = type(target)
        name = target.__qualname__
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) and module else name


def named_after(wrapper: F, fn: object) -> F:
    """``wrapper`` named as ``fn`` (its module, qualified name and name), so that
    :func:`user_name` shows the user's function rather than the wrapper an integration runs.
    Unlike ``functools.wraps``, the wrapper keeps its own signature."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    for attribute in ("__module__", "__qualname__", "__name__"):
        value = getattr(target, attribute, None)
        if isinstance(value, str):
            setattr(wrapper, attribute, value)
    return wrapper


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside autobatch (and
    the ``contextlib`` frames of its context managers)."""
    frame = inspect.currentframe()
    frame = None if frame is None else frame.f_back  # the function that calls warnings.warn
    level = 1
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("autobatch.")
        or frame.f_globals.get("__name__") == "contextlib"  # autobatch's own context managers
    ):
        frame = frame.f_back
        level += 1
    return level
