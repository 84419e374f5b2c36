"""The record of a search, :class:`SearchResult`, and its JSON form (what the cache stores); the
record of a search over lengths, :class:`LengthTable`; the record of a throughput curve,
:class:`ThroughputResult`.

Above trial measurement and below the front-ends: the finder makes one, the cache stores and
reads it back (checked field by field), the plots draw them (they know the records; the records
know nothing of plotting).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autobatch._errors import AutobatchError
from autobatch._search import LinearModel, Trial, Verdicts, trusted_curve
from autobatch._units import format_bytes
from autobatch._validate import check_int

#: What draws a record, ``draw(record, path)``: set by :mod:`autobatch._records._plot` when it is
#: imported (as ``import autobatch`` does), so that the records know nothing of plotting and
#: no import runs from here to there.
DRAW: list[Callable[[Any, str | None], Any]] = []


def _draw(record: Any, path: str | None) -> Any:
    if not DRAW:  # pragma: no cover - autobatch's own import loads the plotter
        raise RuntimeError("import autobatch (its plotter) before plotting a record")
    return DRAW[0](record, path)


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search_batch_size` found, and how.

    ``batch_size`` is the recommended size (the largest at most ``(1 - headroom)`` of
    ``max_batch_size`` that trained in a trial of its own; where a gap of the caching
    allocator's fit map leaves none from there down to ``1 - 1.5 * headroom`` of it, the
    smallest above that trained, in the band below the largest, as ``notes`` say;
    ``max_batch_size`` when ``headroom`` is 0); ``max_batch_size`` the
    exact largest size that fits (it passed a trial, the next size up failed or is the cap). ``trials`` lists
    every trial in order; ``capacity_bytes`` the memory the search could use (the device's
    total, less what other processes hold); ``memory_model`` is the fitted
    ``peak(n) = fixed + per_sample * n``
    when the device keeps statistics. ``optimizer_counted`` is False when no optimizer was given
    (forward and backward only). Under a caching allocator each trial also reports its reserved
    peak in its steady state; :attr:`peak_bytes`, :attr:`peak_reserved_bytes` and
    :attr:`fragmentation` give both peaks at ``batch_size``.
    """

    batch_size: int
    max_batch_size: int
    trials: tuple[Trial, ...]
    memory_model: LinearModel | None
    capacity_bytes: int
    device: str
    headroom: float
    train: bool
    optimizer_counted: bool
    smallest_failing: int | None = None
    notes: tuple[str, ...] = field(default=())

    def plot(self, path: str | None = None) -> Any:
        """Peak memory against batch size (the same as ``autobatch.plot(result, path)``).

        Needs matplotlib (``pip install torch-autobatch[plot]``). Saves to ``path`` when given;
        returns the matplotlib figure.
        """
        return _draw(self, path)

    @property
    def oom_trials(self) -> int:
        """How many trials failed."""
        return sum(not t.fits for t in self.trials)

    @property
    def peak_bytes(self) -> int | None:
        """The allocated peak (live tensors) measured at ``batch_size`` (``None``: unmeasured)."""
        trial = self._trial_at(self.batch_size)
        return None if trial is None else trial.peak_bytes

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The caching allocator's reserved peak measured at ``batch_size``, in the trial's
        steady state (``None`` where the device reports none): what really runs out."""
        trial = self._trial_at(self.batch_size)
        return None if trial is None else trial.reserved_bytes

    @property
    def fragmentation(self) -> float | None:
        """Reserved bytes per allocated byte at ``batch_size``'s peak (``None``: not both known)."""
        peak, reserved = self.peak_bytes, self.peak_reserved_bytes
        if not peak or reserved is None:
            return None
        return reserved / peak

    def _trial_at(self, size: int) -> Trial | None:
        fitting = [t for t in self.trials if t.fits and t.size == size]
        return fitting[-1] if fitting else None

    def fits(self, size: int) -> bool | None:
        """Whether a batch of ``size`` runs, as far as the search knows (``None``: unknown).

        A size a trial ran gets that trial's verdict. Without a caching allocator the peak
        grows with the batch, so every size up to ``max_batch_size`` fits and every size from
        ``smallest_failing`` up does not. Under one (CUDA's) fitting is not monotone: a size
        below the largest can need one more segment than the capacity leaves, and fail. The
        search's replay of the allocator (where the backend has one: the simulated GPU, and
        CUDA or ROCm under the settings the model covers) then says which sizes fit: below the
        trials it was worked out from only where it gives the smaller trials' peaks too (not
        for a step that takes another graph there, or pads its batch); without it, a size no
        trial ran is unknown. A record read back from the cache holds no replay.

        >>> from autobatch._search import Verdicts
        >>> replay = Verdicts(lambda n: None if 5 <= n <= 6 or n > 8 else (n, 2 * n))
        >>> trials = (Trial(4, True, 4, curve=replay), Trial(8, True, 8), Trial(9, False))
        >>> result = SearchResult(8, 8, trials, None, 100, "cuda:0", 0.0, True, True)
        >>> [result.fits(n) for n in (4, 5, 7, 9)]
        [True, False, True, False]
        """
        size = check_int("size", size)
        ran = [t for t in self.trials if t.size == size]
        if ran:
            return ran[-1].fits
        replay = self._replay
        if isinstance(replay, Verdicts) and (
            replay.floor is None or size >= replay.floor or self._replay_below_floor
        ):
            return replay.peak_at(size) is not None
        if self._caches:
            return None
        if self.smallest_failing is not None and size >= self.smallest_failing:
            return False
        return True if size <= self.max_batch_size else None

    @functools.cached_property
    def _replay(self) -> Callable[[int], int] | None:
        """The search's replay of the device's allocator, where it gave every trial right."""
        return trusted_curve(self.trials, self.capacity_bytes)

    @functools.cached_property
    def _replay_below_floor(self) -> bool:
        """Whether the replay also gives the peak of every trial below the sizes it was worked
        out from (the same graph there: an MLP's; not a model that pads its batch)."""
        replay = self._replay
        assert isinstance(replay, Verdicts)
        below = [t for t in self.trials if replay.floor is not None and t.size < replay.floor]
        return bool(below) and all(
            t.fits and t.peak_bytes is not None and replay.peak_at(t.size) == t.peak_bytes
            for t in below)

    @property
    def _caches(self) -> bool:
        """Whether a caching allocator stood between the trials and the device."""
        return any(t.reserved_bytes is not None for t in self.trials)

    @property
    def samples_processed(self) -> int:
        """Rows run through the model over all trials (a measure of search cost)."""
        return sum(t.size for t in self.trials)

    def __repr__(self) -> str:
        lines = [
            f"SearchResult(batch_size={self.batch_size}, max_batch_size={self.max_batch_size}, "
            f"device={self.device!r}, capacity={format_bytes(self.capacity_bytes)}, "
            f"headroom={self.headroom:g}, trials={len(self.trials)}, oom_trials={self.oom_trials})"
        ]
        lines += [f"  {trial}" for trial in self.trials]
        if self.peak_reserved_bytes is not None and self.peak_bytes is not None:
            lines.append(
                f"  at batch {self.batch_size}: {format_bytes(self.peak_bytes)} allocated, "
                f"{format_bytes(self.peak_reserved_bytes)} reserved "
                f"(fragmentation {self.fragmentation:.3f})"
            )
        if self.memory_model is not None:
            model = self.memory_model
            lines.append(
                f"  memory model: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)}"
                " per sample"
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = __repr__


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    """A JSON-ready dict of a :class:`~autobatch.SearchResult` (see :func:`result_from_dict`)."""
    model = result.memory_model
    return {
        "batch_size": result.batch_size,
        "max_batch_size": result.max_batch_size,
        "smallest_failing": result.smallest_failing,
        "device": result.device,
        "capacity_bytes": result.capacity_bytes,
        "headroom": result.headroom,
        "train": result.train,
        "optimizer_counted": result.optimizer_counted,
        "memory_model": None if model is None else {
            "fixed": model.fixed, "per_sample": model.per_sample
        },
        "trials": [
            {
                "size": t.size,
                "fits": t.fits,
                "peak_bytes": t.peak_bytes,
                "seconds": t.seconds,
                "error": t.error,
                "reserved_bytes": t.reserved_bytes,
                "steps": t.steps,
            }
            for t in result.trials
        ],
        "notes": list(result.notes),
    }


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``data[name]``, which must be of ``kind`` (a bool is no int here)."""
    if not isinstance(data, Mapping) or name not in data:
        raise ValueError(f"no {name!r}")
    value = data[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ValueError(f"{name!r} is {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{name!r} is {type(value).__name__}, not {kind}")
    return value


def _count(data: Mapping[str, Any], name: str, *, minimum: int = 1) -> int:
    value: int = _field(data, name, int)
    if value < minimum:
        raise ValueError(f"{name!r} is {value}, below {minimum}")
    return value


def _finite(data: Mapping[str, Any], name: str, *, low: float, high: float) -> float:
    value = float(_field(data, name, (int, float)))
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name!r} is {value!r}, not in [{low}, {high}]")
    return value


def result_from_dict(data: Mapping[str, Any]) -> SearchResult:
    """The :class:`~autobatch.SearchResult` that :func:`result_to_dict` wrote.

    Every field is checked (types, ranges, and that the recommended size is at most the
    largest, which a fitting trial ran): ``ValueError`` when ``data`` is not such a dict (a
    damaged or edited cache entry), never a result built from one.
    """
    try:
        trials = []
        for trial in _field(data, "trials", list):
            peak = _field(trial, "peak_bytes", (int, type(None)))
            if peak is not None and peak < 0:
                raise ValueError(f"a trial's peak is {peak}")
            error = _field(trial, "error", (str, type(None)))
            # (results stored before trials measured reserved memory have neither field)
            reserved = None
            if trial.get("reserved_bytes") is not None:
                reserved = _count(trial, "reserved_bytes", minimum=0)
            steps = _count(trial, "steps") if "steps" in trial else 1
            trials.append(
                Trial(
                    size=_count(trial, "size"),
                    fits=_field(trial, "fits", bool),
                    peak_bytes=peak,
                    seconds=_finite(trial, "seconds", low=0.0, high=math.inf),
                    error=error,
                    reserved_bytes=reserved,
                    steps=steps,
                )
            )
        batch_size = _count(data, "batch_size")
        largest = _count(data, "max_batch_size")
        failing = _field(data, "smallest_failing", (int, type(None)))
        if batch_size > largest:
            raise ValueError(f"batch_size {batch_size} is above max_batch_size {largest}")
        if not any(t.fits and t.size == largest for t in trials):
            raise ValueError(f"no fitting trial ran max_batch_size {largest}")
        if failing is not None and failing <= largest:
            raise ValueError(f"smallest_failing {failing} is not above {largest}")
        stored_model = _field(data, "memory_model", (dict, type(None)))
        model = None
        if stored_model is not None:
            model = LinearModel(
                fixed=_finite(stored_model, "fixed", low=-math.inf, high=math.inf),
                per_sample=_finite(stored_model, "per_sample", low=0.0, high=math.inf),
            )
        notes = _field(data, "notes", list)
        if not all(isinstance(note, str) for note in notes):
            raise ValueError("a note is not a string")
        return SearchResult(
            batch_size=batch_size,
            max_batch_size=largest,
            trials=tuple(trials),
            memory_model=model,
            capacity_bytes=_count(data, "capacity_bytes"),
            device=_field(data, "device", str),
            headroom=_finite(data, "headroom", low=0.0, high=0.999999),
            train=_field(data, "train", bool),
            optimizer_counted=_field(data, "optimizer_counted", bool),
            smallest_failing=failing,
            notes=tuple(notes),
        )
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as error:
        raise ValueError(f"not a stored search result: {error}") from None


@dataclass(frozen=True)
class LengthTrial:
    """One trial of :func:`~autobatch.search_batch_sizes`: the length it ran at, and the trial.

    >>> print(LengthTrial(512, Trial(16, fits=False, error="cuda_allocator")))
    length    512, batch     16: OOM (cuda_allocator), 0.00 s
    """

    length: int
    trial: Trial

    @property
    def size(self) -> int:
        """The batch size tried."""
        return self.trial.size

    @property
    def fits(self) -> bool:
        """Whether the trial ran to completion."""
        return self.trial.fits

    @property
    def peak_bytes(self) -> int | None:
        """Its measured peak (``None`` for a failure, or without memory statistics)."""
        return self.trial.peak_bytes

    def __str__(self) -> str:
        return f"length {self.length:>6}, {self.trial}"


@dataclass(frozen=True)
class LengthTable:
    """What :func:`~autobatch.search_batch_sizes` found: a batch size for every length.

    ``results[i]`` is the search at ``lengths[i]`` (ascending), exact like
    :func:`~autobatch.search_batch_size`'s. :meth:`batch_size` answers for any length up to
    the longest measured one, with the size measured at the next length up (memory grows with
    the length); :meth:`max_batch_size` only for a measured length; :meth:`fits` whether any
    size runs, as far as the search knows (under CUDA's caching allocator a smaller size can
    fail). Pass the table to :class:`~autobatch.data.MemoryAwareBatchSampler`, which asks both.

    >>> def measured(size: int) -> SearchResult:
    ...     return SearchResult(size, size, (Trial(size, True),), None, 2**30, "cuda:0", 0.0,
    ...                         True, True)
    >>> table = LengthTable((128, 512), (measured(64), measured(12)))
    >>> table.batch_size(100), table.batch_size(128), table.batch_size(129)
    (64, 64, 12)

    Args:
        lengths: the measured lengths, ascending.
        results: the search at each length, in the same order.
        notes: what applies to the whole table (the cache, say).
    """

    lengths: tuple[int, ...]
    results: tuple[SearchResult, ...]
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.results):
            raise ValueError(
                f"a LengthTable needs one result per length, got {len(self.lengths)} lengths "
                f"and {len(self.results)} results"
            )
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths must be distinct and ascending, got {self.lengths!r}")

    def _index(self, length: int) -> int:
        """The position of the shortest measured length at least ``length``."""
        if isinstance(length, bool) or not hasattr(length, "__index__"):
            raise TypeError(f"length must be an int, got {length!r} ({type(length).__name__})")
        length = length.__index__()
        if length < 0:
            raise ValueError(f"length must be at least 0, got {length}")
        longest = self.lengths[-1]
        if length > longest:
            raise AutobatchError(
                f"length {length} is above the longest measured length {longest}; search it "
                "too (add it to lengths), or truncate such samples"
            )
        return bisect.bisect_left(self.lengths, length)

    def batch_size(self, length: int) -> int:
        """The recommended batch size for samples of ``length`` (any length up to the longest
        measured): the one measured at the next length up, or at ``length`` itself.

        Raises:
            AutobatchError: ``length`` is above the longest measured length.
        """
        return self.results[self._index(length)].batch_size

    def fits(self, length: int, size: int) -> bool | None:
        """Whether a batch of ``size`` samples padded to ``length`` runs, as far as the search
        knows (``None``: unknown); see :meth:`SearchResult.fits`.

        At a measured length, the search's verdict. At a length between measured ones, a size
        within the next length up's largest runs when fitting grows with memory (no caching
        allocator); under a caching allocator it is unknown there: pad batches to
        :meth:`padded_length` to keep every size a measured one.

        Raises:
            AutobatchError: ``length`` is above the longest measured length.
        """
        index = self._index(length)
        result = self.results[index]
        if self.lengths[index] == length:
            return result.fits(size)
        size = check_int("size", size)
        if result._caches:
            return None
        return True if size <= result.max_batch_size else None

    def padded_length(self, length: int) -> int:
        """The measured length that answers for ``length``: the shortest at least ``length``.
        Padding a batch to it makes its size one the search measured.

        Raises:
            AutobatchError: ``length`` is above the longest measured length.
        """
        return self.lengths[self._index(length)]

    def max_batch_size(self, length: int) -> int:
        """The exact largest batch that fits at a measured ``length`` (it ran; one more did not,
        or is the cap).

        Raises:
            AutobatchError: ``length`` was not measured.
        """
        return self.result(length).max_batch_size

    def result(self, length: int) -> SearchResult:
        """The search at a measured ``length``.

        Raises:
            AutobatchError: ``length`` was not measured.
        """
        index = self._index(length)
        if self.lengths[index] != length:
            raise AutobatchError(
                f"length {length} was not measured (measured: {list(self.lengths)}); "
                f"batch_size({length}) gives the size measured at the next length up"
            )
        return self.results[index]

    @property
    def trials(self) -> tuple[LengthTrial, ...]:
        """Every trial, in the order they ran (the longest length first)."""
        return tuple(
            LengthTrial(length, trial)
            for length, result in reversed(list(zip(self.lengths, self.results, strict=True)))
            for trial in result.trials
        )

    @property
    def oom_trials(self) -> int:
        """How many trials failed, over all lengths."""
        return sum(result.oom_trials for result in self.results)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the table (see :meth:`from_dict`)."""
        return {
            "lengths": list(self.lengths),
            "results": [result_to_dict(result) for result in self.results],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LengthTable:
        """The table :meth:`to_dict` wrote; ``ValueError`` when ``data`` is not one."""
        try:
            lengths = tuple(_field(data, "lengths", list))
            results = tuple(result_from_dict(r) for r in _field(data, "results", list))
            notes = _field(data, "notes", list)
            if not all(isinstance(note, str) for note in notes):
                raise ValueError("a note is not a string")
            return cls(lengths, results, tuple(notes))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a stored length table: {error}") from None

    def __repr__(self) -> str:
        first = self.results[0]
        lines = [
            f"LengthTable(device={first.device!r}, capacity={format_bytes(first.capacity_bytes)}, "
            f"headroom={first.headroom:g}, lengths={len(self.lengths)}, "
            f"trials={sum(len(r.trials) for r in self.results)}, oom_trials={self.oom_trials})"
        ]
        lines += [
            f"  length {length:>6}: batch {result.batch_size:>6} (largest {result.max_batch_size}),"
            f" {len(result.trials)} trials"
            for length, result in zip(self.lengths, self.results, strict=True)
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = __repr__


@dataclass(frozen=True)
class ThroughputPoint:
    """One candidate size: its median step time and samples/second (None when it ran out of
    memory, with the kind of error)."""

    size: int
    samples_per_s: float | None
    seconds: float | None
    error: str | None = None

    def __str__(self) -> str:
        if self.samples_per_s is None or self.seconds is None:
            return f"batch {self.size:>6}: OOM ({self.error})"
        return (
            f"batch {self.size:>6}: {self.samples_per_s:,.1f} samples/s "
            f"(median step {self.seconds * 1e3:.2f} ms)"
        )


@dataclass(frozen=True)
class ThroughputResult:
    """What :func:`~autobatch.find_best_batch` measured.

    ``batch_size`` is the smallest size whose throughput is within ``tolerance`` of the best
    (``best_samples_per_s``, at ``fastest_batch_size``); ``points`` is the whole curve in size
    order; ``max_batch_size`` is the largest size considered; ``search`` the search that found
    it, when one ran.
    """

    batch_size: int
    samples_per_s: float
    fastest_batch_size: int
    best_samples_per_s: float
    max_batch_size: int
    tolerance: float
    points: tuple[ThroughputPoint, ...]
    device: str
    train: bool
    repeats: int
    warmup: int
    search: SearchResult | None = None
    notes: tuple[str, ...] = field(default=())

    def plot(self, path: str | None = None) -> Any:
        """Samples/second against batch size (the same as ``autobatch.plot(result, path)``).

        Needs matplotlib (``pip install 'torch-autobatch[plot]'``). Saves to ``path`` when
        given; returns the matplotlib figure.
        """
        return _draw(self, path)

    def __repr__(self) -> str:
        lines = [
            f"ThroughputResult(batch_size={self.batch_size}, "
            f"samples_per_s={self.samples_per_s:,.1f}, "
            f"fastest_batch_size={self.fastest_batch_size}, "
            f"best_samples_per_s={self.best_samples_per_s:,.1f}, "
            f"max_batch_size={self.max_batch_size}, tolerance={self.tolerance:g}, "
            f"device={self.device!r})"
        ]
        lines += [f"  {point}" for point in self.points]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = __repr__
