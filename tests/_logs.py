"""What a user sees of autobatch's logging, for the tests that check it."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def nothing_configured() -> Iterator[io.StringIO]:
    """As in a script that set up no logging: no handler on the root logger, so Python's
    last-resort handler (WARNING and above, on stderr) shows records; here into a buffer."""
    root = logging.getLogger()
    handlers, level, last = root.handlers[:], root.level, logging.lastResort
    stream = io.StringIO()
    resort = logging.StreamHandler(stream)
    resort.setLevel(logging.WARNING)
    root.handlers, logging.lastResort = [], resort
    root.setLevel(logging.WARNING)
    try:
        yield stream
    finally:
        root.handlers, logging.lastResort = handlers, last
        root.setLevel(level)


@contextlib.contextmanager
def logging_set_up() -> Iterator[list[logging.LogRecord]]:
    """As in a script that set up logging: a handler on the root logger, ``autobatch`` at
    INFO; every record it handles."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root, top = logging.getLogger(), logging.getLogger("autobatch")
    root.addHandler(handler)
    top.setLevel(logging.INFO)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        top.setLevel(logging.NOTSET)
