"""Watching a search: each trial shown as it ends, on a progress bar or as plain lines."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from autobatch._log import get_logger, shown
from autobatch._search import Trial

OnTrial = Callable[[Trial], None]

#: Where the trial runner logs each trial, at INFO.
TRIAL_LOG = get_logger("trial")


class TrialProgress:
    """Shows each trial of a search on one line: size, fits or OOM, peak, seconds.

    A ``tqdm`` bar counting the trials (the latest trial as its postfix) when ``tqdm`` is
    installed and the stream is a terminal; otherwise one plain line per trial, so logs and
    notebooks without a terminal keep every trial.

    Args:
        stream: Where to write (default ``sys.stderr``).
        bar: Use ``tqdm``: ``None`` decides from the stream and whether it is installed.
    """

    def __init__(self, stream: TextIO | None = None, *, bar: bool | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.trials = 0
        self._bar: Any = None
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        if bar:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(desc="autobatch search", unit="trial", file=self.stream)

    def __call__(self, trial: Trial) -> None:
        self.trials += 1
        if self._bar is not None:
            self._bar.set_postfix_str(str(trial), refresh=False)
            self._bar.update(1)
        else:
            print(f"autobatch: trial {self.trials:>2}  {trial}", file=self.stream, flush=True)

    def close(self) -> None:
        """End the display (the bar stays on screen with its last trial)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def watching(on_trial: OnTrial | None, progress: bool) -> Iterator[OnTrial | None]:
    """The callback a trial runner calls: the user's ``on_trial`` and, with ``progress``, a
    :class:`TrialProgress` (closed when the block ends); ``None`` when neither is asked.

    Where logging already shows each trial (``autobatch.trial`` at INFO reaches a handler that
    was configured), ``progress`` adds nothing, so that no trial is shown twice."""
    if on_trial is not None and not callable(on_trial):
        raise TypeError(f"on_trial must be a callable taking a Trial, got {on_trial!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    display = TrialProgress() if progress and not shown(TRIAL_LOG, logging.INFO) else None
    callbacks = [f for f in (display, on_trial) if f is not None]

    def each(trial: Trial) -> None:
        for callback in callbacks:
            callback(trial)

    try:
        yield each if callbacks else None
    finally:
        if display is not None:
            display.close()
