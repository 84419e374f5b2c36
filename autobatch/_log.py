"""The package's loggers: children of ``autobatch``, silent on every rank but 0."""

from __future__ import annotations

import inspect
import logging


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
