"""What the command prints: progress lines, messages, JSON and the result."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import torch

from autobatch._records._result import LengthTable, SearchResult, ThroughputPoint
from autobatch._search import Trial
from autobatch._units import format_bytes
from autobatch.cli._parser import PROG

_PROGRESS_LOGGERS = ("autobatch.trial", "autobatch.throughput")


class _Progress(logging.Handler):
    """Prints the trial runner's and the timer's lines as they happen, numbered."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.trials = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            item = record.args[0] if isinstance(record.args, tuple) and record.args else None
            if isinstance(item, Trial):
                self.trials += 1
                print(f"  trial {self.trials:>2}  {item}", file=self.stream, flush=True)
            elif isinstance(item, ThroughputPoint):
                print(f"  timing    {item}", file=self.stream, flush=True)
            # other lines (the summaries) are left to the command, which prints its own
        except Exception:  # a broken stream must not stop the search
            self.handleError(record)


class _Messages(logging.Handler):
    """Every other autobatch log line: warnings (or everything with --verbose), one line each."""

    def __init__(self, stream: TextIO, level: int) -> None:
        super().__init__(level)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        if record.name in _PROGRESS_LOGGERS and record.levelno < logging.WARNING:
            return  # the progress handler's
        try:
            kind = "warning: " if record.levelno >= logging.WARNING else ""
            print(f"{PROG}: {kind}{record.getMessage()}", file=self.stream, flush=True)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _reporting(verbose: bool, progress_stream: TextIO, stream: TextIO) -> Iterator[None]:
    """Progress lines on ``progress_stream``, warnings (and with ``verbose`` the debug log) on
    ``stream``, for the duration of the command; logging and warnings are put back after."""
    root = logging.getLogger("autobatch")
    progress = _Progress(progress_stream)
    messages = _Messages(stream, logging.DEBUG if verbose else logging.WARNING)
    children = [logging.getLogger(name) for name in _PROGRESS_LOGGERS]
    saved_level = root.level
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.addHandler(messages)
    for child in children:
        child.addHandler(progress)

    def one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                         lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        print(f"{PROG}: warning: {message}", file=stream, flush=True)

    saved_warning = warnings.showwarning
    warnings.showwarning = one_line_warning
    try:
        yield
    finally:
        warnings.showwarning = saved_warning
        for child in children:
            child.removeHandler(progress)
        root.removeHandler(messages)
        root.setLevel(saved_level)


def _output(args: argparse.Namespace) -> TextIO:
    """Where text goes: stdout, or stderr when stdout carries the JSON result."""
    return sys.stderr if args.json else sys.stdout


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "_asdict"):
        return value._asdict()
    return repr(value)


def _emit_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2, default=_json_default))


def _search_lines(result: SearchResult, seconds: float, cached: str | None) -> list[str]:
    lines = []
    if cached is not None:
        lines.append(f"cached result from {cached} (--no-cache measures again):")
        lines += [f"  trial {i:>2}  {t}" for i, t in enumerate(result.trials, start=1)]
    lines.append(f"largest batch that fits: {result.max_batch_size}")
    if result.headroom:
        share = result.batch_size / result.max_batch_size
        lines.append(
            f"recommended batch size:  {result.batch_size} ({share:.0%} of the largest, headroom "
            f"{result.headroom:g}; proven by a trial)"
        )
    else:
        lines.append(f"recommended batch size:  {result.batch_size}")
    if result.memory_model is not None:
        model = result.memory_model
        lines.append(
            f"memory model: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)} "
            "per sample" if model.fixed >= 0 else  # (a line through two peaks may start below 0)
            f"memory model: {format_bytes(model.per_sample)} per sample (a fixed cost too small "
            "to tell apart)"
        )
    if not any(t.peak_bytes is not None for t in result.trials):
        lines.append("memory: no peaks measured (this device keeps no memory statistics)")
    when = "measured earlier" if cached is not None else f"in {seconds:.1f} s"
    lines.append(f"{len(result.trials)} trials ({result.oom_trials} out of memory) {when}")
    lines += [
        f"note: {note}" for note in result.notes
        if not note.startswith("from the cache")
    ]
    return lines




def _table_lines(table: LengthTable, seconds: float) -> list[str]:
    """``find --lengths``: one row per measured length, then the cost."""
    lines = [f"{'length':>8}  {'batch size':>10}  {'largest that fits':>17}  {'trials':>6}"]
    for length, result in zip(table.lengths, table.results, strict=True):
        lines.append(f"{length:>8}  {result.batch_size:>10}  {result.max_batch_size:>17}  "
                     f"{len(result.trials):>6}")
    cached = any(note.startswith("from the cache") for note in table.notes)
    when = "measured earlier (--no-cache measures again)" if cached else f"in {seconds:.1f} s"
    lines.append(f"{len(table.trials)} trials ({table.oom_trials} out of memory) {when}; a "
                 "length between two rows takes the longer row's size")
    return lines
