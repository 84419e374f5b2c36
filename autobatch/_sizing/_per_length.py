"""``search_batch_sizes``: the largest batch at each sequence length, exact, in few trials.

A thin front-end over the finder's search (:func:`~autobatch.search_batch_size`): the longest
length is searched as usual; every shorter one starts from the size that the memory lines
measured so far predict there (:func:`~autobatch._search.predict_line`), which the engine then
proves with the size next to it (:class:`~autobatch._search.Predicted`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import random
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, ParamSpec

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autobatch import _batch, _distributed
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger
from autobatch._memory._backends import (
    DeviceMemory,
    memory_for,
    restore_rng_states,
    save_rng_states,
)
from autobatch._records._cache import cached_table, open_cache, search_key, table_key
from autobatch._records._progress import watching
from autobatch._records._result import LengthTable, SearchResult
from autobatch._search import LinearModel, Predicted, SearchPolicy, predict_line
from autobatch._sizing._finder import _measured_search, search_batch_size
from autobatch._sizing._state import modules_referenced
from autobatch._sizing._trial import TrialRunner, prepared
from autobatch._sizing._workload import (
    OptimizerLike,
    Sample,
    SearchSpec,
    batch_factory,
    model_device,
)
from autobatch._validate import check_module, is_sample_factory

logger = get_logger("lengths")


class _LengthsError(AutobatchError, ValueError):
    """A ``lengths`` that cannot be searched (empty, a length below 1, one given twice)."""


class _SampleForError(AutobatchError, TypeError):
    """A ``sample_for`` that is not a function of a length."""


P = ParamSpec("P")
Lengths = Iterable[int]


def _options_of(
    search: Callable[Concatenate[nn.Module, Sample, P], SearchResult],
) -> Callable[
    [Callable[..., LengthTable]],
    Callable[Concatenate[nn.Module, Callable[[int], Sample], Lengths, P], LengthTable],
]:
    """Give the search over lengths every option of ``search``, written once there (for
    ``help()``, ``inspect`` and type checkers): the model, then ``sample_for`` and ``lengths``
    where ``search`` takes a sample, then the rest."""

    def apply(front: Callable[..., LengthTable]) -> Any:
        options = inspect.signature(search)
        own = inspect.signature(front).parameters
        model, _sample, *rest = options.parameters.values()
        front.__signature__ = options.replace(  # type: ignore[attr-defined]
            parameters=[model, own["sample_for"], own["lengths"], *rest],
            return_annotation=inspect.signature(front).return_annotation,
        )
        return front

    return apply


@_options_of(search_batch_size)
def search_batch_sizes(
    model: nn.Module,
    sample_for: Callable[[int], Sample],
    lengths: Lengths,
    optimizer: OptimizerLike = None,
    **options: Any,
) -> LengthTable:
    """The largest batch that fits, and the recommended one, at each of several sequence
    lengths, with real steps; a table that gives a batch size for any length up to the longest.

    Each length is searched as :func:`~autobatch.search_batch_size` searches one, and its
    answer is as exact (the largest size ran, the next size up ran out of memory or is
    ``max_batch``). The longest length goes first, with the usual search. Every shorter one
    starts from a prediction: the memory lines of the lengths measured so far (a step's peak
    is affine in the batch at a fixed length, and its bytes per sample a polynomial of degree
    at most 2 in the length), drawn through the nearest of them; a trial at the predicted size
    and one at the size next to it prove it. With ``headroom=0`` five lengths take about
    ``2 * 5 + 3`` trials; with headroom each length has one more, proving the recommended
    size. Under a caching allocator without expandable segments the recommended sizes then run
    together, each length after every other, and are lowered while that runs out of memory
    (``table.notes`` says so; batches of other lengths cut the cached blocks a length's own
    trials never saw). Afterwards the model, optimizer, RNG streams and device memory are
    exactly as before.

    ``table.batch_size(length)`` is the recommended size measured at the shortest measured
    length at least ``length`` (memory grows with the length, so it fits), and an
    :class:`AutobatchError` above the longest; ``table.max_batch_size(length)`` the exact
    largest at a measured length. Give the table to
    :class:`~autobatch.data.MemoryAwareBatchSampler`.

    >>> import torch
    >>> from autobatch.testing import SimulatedGPU
    >>> from autobatch.testing.models import transformer
    >>> model = transformer(d_model=16, layers=1)
    >>> def tokens(length):
    ...     return torch.randint(0, 1000, (2, length)), torch.randint(0, 10, (2,))
    >>> with SimulatedGPU("8MiB", adopt=[model]):
    ...     table = search_batch_sizes(model, tokens, [8, 16, 32], torch.optim.SGD, headroom=0)
    >>> table.max_batch_size(8) > table.batch_size(20) == table.max_batch_size(32)
    True

    Args:
        model: The module to train, already on its device.
        sample_for: ``sample_for(length)``: a sample at that length, as ``sample`` in
            :func:`~autobatch.search_batch_size` (a few rows, or a callable ``n -> batch``).
            Called once per length (and once more per length for the cache key), with the
            random number generators saved and put back.
        lengths: The lengths to measure: positive ints, each once, in any order. Include the
            longest your data holds.
        optimizer, loss_fn, step_fn, train, device, min_batch, max_batch, multiple_of,
            headroom, steps_per_trial, scaler, sync_ranks, on_trial, progress: As for
            :func:`~autobatch.search_batch_size`, at every length (``on_trial`` and
            ``progress`` see every length's trials, longest length first).
        start, prior, plan: As for :func:`~autobatch.search_batch_size`, for the longest length
            (the others start from the prediction).
        cache: As for :func:`~autobatch.search_batch_size`: the key holds every length and the
            per-row shapes and dtypes of each length's sample.

    Raises:
        AutobatchError: ``lengths`` is empty, holds a length below 1 or one twice, or
            ``sample_for`` is not callable (these are also ``ValueError`` and ``TypeError``).
        BatchSizeError: Even ``min_batch`` does not fit at some length, or the lengths
            together run out of memory after every size was lowered 8 times.
    """
    measured = _check_lengths(lengths)
    if not callable(sample_for) or isinstance(sample_for, nn.Module):
        raise _SampleForError(
            "sample_for must be a function of a length that returns a sample at that length, "
            f"e.g. lambda length: torch.randint(0, vocab, (2, length)); got "
            f"{type(sample_for).__name__}"
        )
    call = inspect.signature(search_batch_sizes).bind(
        model, sample_for, lengths, optimizer, **options
    )
    call.apply_defaults()
    given = call.arguments
    spec = SearchSpec(**{name: given[name] for name in SearchSpec.__dataclass_fields__})
    check_module("model", model)
    target = model_device(model, given["device"])
    memory = memory_for(target)
    store = open_cache(given["cache"])
    sync_ranks = given["sync_ranks"]

    def measure() -> LengthTable:
        results: dict[int, SearchResult] = {}
        lines: dict[int, LinearModel] = {}
        samples: dict[int, Sample] = {}
        for length in sorted(measured, reverse=True):
            seeded = _seed(results, lines, length)
            policy: SearchPolicy | None = None
            if seeded is None:  # the longest, or no statistics to predict from
                first = not results
                begin = given["start"] if first else _known_to_fit(results)
                line = given["prior"] if first else None
            else:
                begin, line, policy = seeded[0], seeded[1], Predicted(caching=memory.caches)
            samples[length] = _sample_at(sample_for, length)
            result = _measured_search(
                model, samples[length], optimizer, target, memory, spec, start=begin,
                prior=line, plan=given["plan"] and not results, sync_ranks=sync_ranks,
                policy=policy, on_trial=each_trial,
            )
            if seeded is not None:
                note = f"started from batch {seeded[0]}, predicted from the lengths measured before"
                result = dataclasses.replace(result, notes=(*result.notes, note))
            fixed = _fixed_bytes(results[max(results)] if results else result)
            results[length] = result
            learned = _line_of(result, fixed, sync=sync_ranks and _distributed.active())
            if learned is not None:
                lines[length] = learned
        results, notes = _proven_together(
            model, samples, results, optimizer, target, memory, spec, sync=sync_ranks
        )
        ordered = tuple(sorted(results))
        table = LengthTable(ordered, tuple(results[n] for n in ordered), notes)
        logger.info(
            "searched %d lengths in %d trials (%d out of memory)",
            len(ordered), len(table.trials), table.oom_trials,
        )
        return table

    def key() -> str:
        return table_key({
            length: search_key(
                model, _sample_at(sample_for, length), optimizer, memory, **spec.options()
            )
            for length in measured
        })

    with watching(given["on_trial"], given["progress"]) as each_trial:
        if store is None or (sync_ranks and _distributed.active()):
            return measure()
        return cached_table(store, key, measure)[0]


def _check_lengths(lengths: Iterable[int]) -> tuple[int, ...]:
    """The lengths as ints, checked: at least one, each at least 1, none twice."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise _LengthsError(
            f"lengths must be a list of sequence lengths, e.g. [128, 512, 2048]; got {lengths!r}"
        )
    if hasattr(lengths, "tolist"):  # a tensor or an array
        lengths = lengths.tolist()
    checked: list[int] = []
    for value in lengths:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise _LengthsError(
                f"every length must be an int, got {value!r} ({type(value).__name__})"
            )
        length = operator.index(value)
        if length < 1:
            raise _LengthsError(f"every length must be at least 1, got {length}")
        if length in checked:
            raise _LengthsError(f"length {length} is given twice; give each length once")
        checked.append(length)
    if not checked:
        raise _LengthsError(
            "lengths is empty; give the sequence lengths to measure, e.g. [128, 512, 2048]"
        )
    return tuple(checked)


def _sample_at(sample_for: Callable[[int], Sample], length: int) -> Sample:
    """``sample_for(length)`` in host memory, with the random number generators saved and put
    back. Its rows are copied to the host (out of any simulated device): a loader's batches
    come from there, and a sample held on the device while the trials run is memory the
    user's own loop does not hold (it made each length one row low where the peak meets the
    capacity to the byte)."""
    rng = save_rng_states(host=True)
    try:
        sample = sample_for(length)
    finally:
        restore_rng_states(rng)
    if is_sample_factory(sample):
        return sample
    with _disable_current_modes():
        return _batch.move_batch(sample, torch.device("cpu"), copy=True)


def _seed(
    results: dict[int, SearchResult], lines: dict[int, LinearModel], length: int
) -> tuple[int, LinearModel] | None:
    """The predicted largest size at ``length`` and its line, from the lines measured so far;
    ``None`` without any (the first length, or a device without memory statistics)."""
    if not lines:
        return None
    line = predict_line(lines, length)
    if line is None:
        return None
    capacity = next(iter(results.values())).capacity_bytes
    # Under a caching allocator the allocated peak meets the capacity less its segments' gaps:
    # the ceiling is the allocated peak the length measured last reached at its largest fit.
    last = results[min(results)]
    reached = max(
        (t.peak_bytes for t in last.trials
         if t.fits and t.size == last.max_batch_size and t.peak_bytes is not None
         and t.reserved_bytes is not None),
        default=None,
    )
    if reached is not None:
        capacity = min(capacity, reached)
    # a quarter of a sample over where the line meets the capacity: a prediction that lands
    # on the largest fit or one above it is proven in two trials, a low one in three, a
    # higher one in more
    size = line.largest_within(capacity + line.per_sample / 4)
    return max(size, 1), line


def _fixed_bytes(longest: SearchResult) -> float:
    """The fixed bytes every length's line shares: those of the longest length's line."""
    return 0.0 if longest.memory_model is None else longest.memory_model.fixed


def _line_of(result: SearchResult, fixed: float, *, sync: bool) -> LinearModel | None:
    """The line through the peak at the largest size that fit, with the shared ``fixed``
    bytes (``None`` without a measured peak).

    Whatever else grows with the length (a mask, a workspace) leaves the shared fixed bytes a
    little off at other lengths; the line through the peak measured next to the capacity
    takes that into its slope, and is right where it matters, at the capacity. The longest
    length's line is the search's own fit (through that peak, on a straight part). With
    ``sync``, the peak is the largest over the ranks (each rank's record holds its own), so
    that every rank predicts the same next size.
    """
    point = next(
        (t for t in result.trials if t.fits and t.size == result.max_batch_size), None
    )
    peak = -1 if point is None or point.peak_bytes is None else point.peak_bytes
    if sync:
        peak = _distributed.all_max([peak])[0]
    if peak < 0:
        return None
    per_sample = (peak - fixed) / result.max_batch_size
    return LinearModel(fixed, per_sample) if per_sample > 0 else None


def _known_to_fit(results: dict[int, SearchResult]) -> int:
    """The largest size that fit at the shortest length measured so far: it fits at any
    shorter one."""
    return results[min(results)].max_batch_size



#: The most sizes :func:`_proven_together` lowers, per length, before it gives up.
MAX_LOWERINGS = 8


def _proven_together(
    model: nn.Module,
    samples: dict[int, Sample],
    results: dict[int, SearchResult],
    optimizer: OptimizerLike,
    target: torch.device,
    memory: DeviceMemory,
    spec: SearchSpec,
    *,
    sync: bool,
) -> tuple[dict[int, SearchResult], tuple[str, ...]]:
    """The recommended sizes proven as a sampler runs them, one length after another, and
    lowered where that runs out of memory.

    Each length's size was proven by steps at that length alone. Under a caching allocator the
    blocks a step at one length leaves cached are cut differently by a step at another, and
    the gradients and optimizer state kept between steps land where the first steps put them:
    a size that trains alone can run out of memory among other lengths. So the user's loop
    runs, from the state the user has, one step at each length in turn after every other one
    (each ordered pair of lengths once: ``k * k + 1`` steps for ``k`` lengths), once starting
    from each length, since the first step decides where the optimizer's state lies. When a
    step runs out, every length's size is lowered by half the headroom (one grid step at least:
    lowering only the length that failed moved the failures to another) and every start runs
    again, until all of them run through. Every other step is a batch closed early, as a
    sampler's last batch of a length is (a random share of the size, one row at the least),
    the steps at full size alternating from one start to the next.
    Returns the results, lowered where needed, and the table's note.

    This is a proof of the common case, not of every order: a long run can still meet a layout
    of the cache that no run of ``k * k + 1`` steps showed (on a 48 MiB device, where one 20 MiB
    segment is most of it, it does). Nothing is proven where nothing needs it:
    ``headroom=0`` asks for the largest sizes, each exact alone; with expandable segments free
    pages go back to the device wherever they lie, and lengths run together as they do alone
    (0 OOMs in ``bench_longrun``); without a caching allocator, the bytes a step needs do not
    depend on the steps before it.
    """
    if spec.headroom == 0 or len(results) < 2 or not (memory.has_statistics and memory.caches):
        return results, ()
    allocator = memory.allocation_model()
    if allocator is not None and allocator.expandable_segments:
        return results, ()
    sizes = {length: result.batch_size for length, result in results.items()}
    starts = sorted(sizes, reverse=True)
    circuit = _every_pair(starts)
    makes = {length: batch_factory(samples[length], target) for length in sizes}
    lowered = 0
    runs = 0
    agree = sync and _distributed.active()
    with prepared(
        model, optimizer, memory, train=spec.train, loss_fn=spec.loss_fn, step_fn=spec.step_fn,
        scaler=spec.scaler,
    ) as work:
        order: list[tuple[int, int]] = []  # (length, share of its size, in 1/8s)
        made = [0]

        def next_batch(_size: int) -> Any:
            length, eighths = order[made[0]]
            made[0] += 1
            return makes[length](max(sizes[length] * eighths // 8, 1))

        runner = TrialRunner(
            next_batch, work.step, work.memory, steps_per_trial=len(circuit) + 1,
            cleanup=work.start_over if work.optimizer is not None else work.drop_gradients,
            per_operator=False, adaptive=False,
        )
        probe = _distributed.trials_in_lockstep(
            runner, model, sync=sync, modules=modules_referenced(spec.loss_fn, spec.step_fn)
        )
        shares = random.Random(0)
        start = 0
        while start < len(starts):
            # every other step a batch its length's sampler closes early (a share of its size),
            # the others from one start to the next
            order[:] = [
                (length, 8 if (i + start) % 2 == 0 else shares.randint(0, 7))
                for i, length in enumerate([starts[start], *circuit])
            ]
            made[0] = 0
            runs += 1
            record = probe(len(order))
            failed = len(order) if record.fits else made[0] - 1
            if agree:
                failed = _distributed.all_min([failed])[0]
            if failed == len(order):
                start += 1
                continue
            lowered += 1
            smaller = {n: _lower(size, spec) for n, size in sizes.items()}
            if lowered > MAX_LOWERINGS or None in smaller.values():
                length = order[failed][0]
                raise BatchSizeError(
                    f"at length {length}, batch {sizes[length]} trains alone but runs out of "
                    "memory among batches of the other lengths, and lowering every length's "
                    f"size {lowered - 1} times did not prove out (min_batch={spec.min_batch}): "
                    "the cached blocks other lengths leave do not fit it. Set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or train under "
                    "autobatch.oom_guard with retry_on_oom",
                    batch_size=sizes[length],
                )
            sizes = {n: size for n, size in smaller.items() if size is not None}
            start = 0  # (every start again, at the lower sizes)
    steps = runs * (len(circuit) + 1)
    logger.info("proved the sizes among each other in %d runs (%d steps)", runs, steps)
    proven = dict(results)
    table_note = (
        f"the recommended sizes ran together, each length after every other, in {runs} runs "
        f"({steps} steps): under a caching allocator without expandable segments the lengths cut "
        "each other's cached blocks, and a long run can still meet a layout those runs did not; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids it, autobatch.oom_guard with "
        "retry_on_oom recovers from it"
    )
    for length, result in results.items():
        if sizes[length] != result.batch_size:
            note = (
                f"batch {result.batch_size} trains alone at this length but ran out of memory "
                f"among batches of the other lengths: recommended {sizes[length]}, proven in "
                f"{runs} runs of the lengths in turn ({steps} steps)"
            )
            proven[length] = dataclasses.replace(
                result, batch_size=sizes[length], notes=(*result.notes, note)
            )
    return proven, (table_note,)


def _every_pair(lengths: list[int]) -> list[int]:
    """The lengths in an order in which every ordered pair of them (each with itself too)
    follows the first one once: ``k * k`` steps after it for ``k`` lengths (an Eulerian
    circuit of the complete graph with loops, Hierholzer's algorithm).

    >>> _every_pair([2, 1])
    [1, 1, 2, 2]
    """
    unused = {a: list(range(len(lengths))) for a in range(len(lengths))}
    stack, circuit = [0], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return [lengths[i] for i in reversed(circuit)][1:]


def _lower(size: int, spec: SearchSpec) -> int | None:
    """``size`` less half the headroom's share of it (a grid step at least), on the grid;
    ``None`` below ``min_batch``."""
    step = spec.multiple_of
    smaller = min(math.floor(size * (1 - spec.headroom / 2)) // step * step, size - step)
    return smaller if smaller >= max(spec.min_batch, 1) else None
