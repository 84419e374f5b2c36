"""Plots of a search (peak memory against batch size) and of a throughput curve:
:func:`plot` takes the record and draws it (the records know nothing of plotting).

matplotlib is an optional extra (``pip install 'torch-autobatch[plot]'``), imported only here and
only when a plot is asked for. The figures are made without pyplot, so plotting never switches
the matplotlib backend of the caller's session and works on machines without a display.
Every figure is :data:`FIGSIZE` inches at :data:`DPI` dots per inch (800 x 500 pixels).
"""

from __future__ import annotations

import os
from typing import Any

from autobatch._records._result import DRAW, SearchResult, ThroughputResult
from autobatch._units import format_bytes

#: Figure size in inches, and resolution: saved PNGs are 800 x 500 pixels.
FIGSIZE = (8.0, 5.0)
DPI = 100

_FIT = "#1f77b4"
_FAIL = "#d62728"
_LINE = "#7f7f7f"
_PICK = "#2ca02c"


def plot(
    result: SearchResult | ThroughputResult, path: str | os.PathLike[str] | None = None
) -> Any:
    """Draw what a search or a throughput measurement found; returns the matplotlib figure.

    A :class:`~autobatch.SearchResult` is drawn as peak memory against batch size (trials,
    fitted line, capacity and headroom: :func:`plot_search`), a
    :class:`~autobatch.ThroughputResult` as samples/second against batch size (with the
    tolerance band and the chosen size: :func:`plot_throughput`). Needs matplotlib
    (``pip install 'torch-autobatch[plot]'``). Saves a PNG (or any format matplotlib knows by
    the file's extension) to ``path`` when given.

    >>> import torch, autobatch
    >>> from autobatch.testing import SimulatedGPU
    >>> model = torch.nn.Linear(256, 10)
    >>> with SimulatedGPU("4MiB", adopt=[model]):
    ...     result = autobatch.search_batch_size(model, torch.randn(1, 256), torch.optim.SGD)
    >>> figure = autobatch.plot(result)  # the figure only (matplotlib's)
    >>> figure = autobatch.plot(result, "search.png")  # doctest: +SKIP
    """
    if isinstance(result, SearchResult):
        return plot_search(result, path)
    if isinstance(result, ThroughputResult):
        return plot_throughput(result, path)
    raise TypeError(
        "plot takes what autobatch.search_batch_size or autobatch.find_best_batch returned "
        f"(a SearchResult or a ThroughputResult), got {type(result).__name__}"
    )


def _figure() -> Any:
    """A new matplotlib figure with one axes, or a clear ImportError without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: "
            "pip install 'torch-autobatch[plot]' (or pip install matplotlib)"
        ) from error
    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    figure.add_subplot()
    return figure


def _save(figure: Any, path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        figure.savefig(os.fspath(path), dpi=DPI)
    return figure


def _unit(capacity: int) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if capacity >= 4 * scale:
            return float(scale), name
    return 1.0, "bytes"


def plot_search(result: SearchResult, path: str | os.PathLike[str] | None = None) -> Any:
    """Peak memory against batch size for a :class:`~autobatch.SearchResult`; returns the figure.

    Fitting trials are points (numbered in the order they ran), failing trials are crosses on
    the capacity line, the fitted memory model is a line, and the capacity
    and the recommended size are marked. Without memory statistics (MPS, CPU) the trials are
    drawn by their order instead. Saves a PNG (or any format matplotlib knows by the file's
    extension) to ``path`` when given.

    Args:
        result: What :func:`~autobatch.search_batch_size` returned.
        path: Where to save the figure, or None.
    """
    figure = _figure()
    axes = figure.axes[0]
    trials = list(result.trials)
    measured = [t for t in trials if t.fits and t.peak_bytes is not None]
    failed = [t for t in trials if not t.fits]
    top = max([t.size for t in trials] + [result.batch_size, 1])
    if not measured:
        _plot_blind(axes, result)
        return _save(figure, path)
    scale, unit = _unit(result.capacity_bytes)
    capacity = result.capacity_bytes / scale
    axes.axhline(capacity, color=_FAIL, linewidth=1.2,
                 label=f"capacity {format_bytes(result.capacity_bytes)}")
    if result.memory_model is not None:
        model = result.memory_model
        xs = [0.0, top * 1.08]
        axes.plot(xs, [model.predict(int(x)) / scale for x in xs], color=_LINE, linestyle="--",
                  linewidth=1,
                  label=f"fit: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)}/sample")
    axes.scatter([t.size for t in measured], [(t.peak_bytes or 0) / scale for t in measured],
                 color=_FIT, zorder=3, label="trial fits (measured peak)")
    if failed:
        axes.scatter([t.size for t in failed], [capacity] * len(failed), marker="x", s=60,
                     color=_FAIL, zorder=3, linewidths=2, label="trial out of memory")
    for number, trial in enumerate(trials, start=1):
        y = capacity if not trial.fits else (trial.peak_bytes or 0) / scale
        offset = (5, -12) if trial.fits else (5, 5)  # fits below, failures above the line
        axes.annotate(f"#{number}", (trial.size, y), textcoords="offset points", xytext=offset,
                      fontsize=8, color="#444444")
    axes.axvline(result.batch_size, color=_PICK, linewidth=1.2,
                 label=f"recommended batch {result.batch_size}")
    axes.set_xlim(0, top * 1.08)
    axes.set_ylim(0, capacity * 1.1)
    axes.set_xlabel("batch size")
    axes.set_ylabel(f"peak memory ({unit})")
    axes.set_title(_title(result), fontsize=11)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    return _save(figure, path)


def _title(result: SearchResult) -> str:
    kind = "training" if result.train else "inference"
    return (
        f"{result.device}: largest {kind} batch {result.max_batch_size}, "
        f"recommended {result.batch_size} ({len(result.trials)} trials)"
    )


def _plot_blind(axes: Any, result: SearchResult) -> None:
    """Trials by order when the device measured no peaks."""
    for number, trial in enumerate(result.trials, start=1):
        axes.scatter([trial.size], [number], color=_FIT if trial.fits else _FAIL,
                     marker="o" if trial.fits else "x", zorder=3)
    axes.axvline(result.batch_size, color=_PICK, label=f"recommended batch {result.batch_size}")
    axes.set_xlabel("batch size")
    axes.set_ylabel("trial")
    axes.set_title(f"{_title(result)}\n(no memory statistics on this device)", fontsize=11)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)


def plot_throughput(
    result: ThroughputResult, path: str | os.PathLike[str] | None = None
) -> Any:
    """Samples per second against batch size for a :class:`~autobatch.ThroughputResult`;
    returns the figure.

    The measured curve (log-2 batch axis), the tolerance band below the best throughput, the
    fastest size and the chosen one (the smallest within the tolerance) are marked; sizes that
    ran out of memory are crosses on the axis. Saves to ``path`` when given.

    Args:
        result: What :func:`~autobatch.find_best_batch` returned.
        path: Where to save the figure, or None.
    """
    figure = _figure()
    axes = figure.axes[0]
    timed = [p for p in result.points if p.samples_per_s is not None]
    failed = [p for p in result.points if p.samples_per_s is None]
    axes.plot([p.size for p in timed], [p.samples_per_s for p in timed], marker="o",
              color=_FIT, zorder=3, label="measured (median of repeats)")
    if failed:
        axes.scatter([p.size for p in failed], [0] * len(failed), marker="x", s=60, color=_FAIL,
                     zorder=3, linewidths=2, label="out of memory")
    best = result.best_samples_per_s
    axes.axhspan(best * (1 - result.tolerance), best, color=_PICK, alpha=0.12,
                 label=f"within {result.tolerance:.0%} of the best")
    axes.axvline(result.batch_size, color=_PICK, linewidth=1.2,
                 label=f"chosen batch {result.batch_size}")
    if result.fastest_batch_size != result.batch_size:
        axes.axvline(result.fastest_batch_size, color=_LINE, linestyle="--", linewidth=1,
                     label=f"fastest batch {result.fastest_batch_size}")
    axes.set_xscale("log", base=2)
    sizes = [p.size for p in result.points]
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.minorticks_off()
    axes.set_ylim(bottom=0, top=best * 1.15)
    axes.set_xlabel("batch size")
    axes.set_ylabel("samples / second")
    axes.set_title(
        f"{result.device}: batch {result.batch_size} reaches "
        f"{result.samples_per_s:,.0f} samples/s (best {best:,.0f} at {result.fastest_batch_size})",
        fontsize=11,
    )
    axes.grid(alpha=0.3, which="both")
    axes.legend(loc="lower right", fontsize=8)
    return _save(figure, path)


DRAW[:] = [plot]  # the records' own .plot() draw through here
