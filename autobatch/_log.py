"""The package's loggers: children of ``autobatch``, silent on every rank but 0."""

from __future__ import annotations

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
