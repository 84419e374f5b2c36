"""``find_max_batch`` and ``search_batch_size``: the largest batch that really fits."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
from torch import nn

from autobatch import _distributed
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger
from autobatch._memory._backends import DeviceLike, DeviceMemory, memory_for
from autobatch._memory._measure import per_operator_possible
from autobatch._oom import oom_kind
from autobatch._records._cache import CacheOption, cached_search, open_cache, search_key
from autobatch._records._progress import OnTrial, watching
from autobatch._records._result import SearchResult
from autobatch._search import LinearModel, SearchPolicy, Trial, Verdicts, recommend, search
from autobatch._sizing._state import modules_referenced
from autobatch._sizing._trial import TrialRunner, prepared
from autobatch._sizing._workload import (
    DEFAULT_HEADROOM,
    Batch,
    LossFn,
    OptimizerLike,
    Sample,
    SearchSpec,
    StepFn,
    batch_factory,
    mark_batch_dynamic,
    model_device,
    prime_optimizer,
)
from autobatch._units import format_bytes
from autobatch._validate import check_module

logger = get_logger("finder")

P = ParamSpec("P")

def search_batch_size(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike = None,
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    train: bool = True,
    device: DeviceLike = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    multiple_of: int = 1,
    headroom: float = DEFAULT_HEADROOM,
    steps_per_trial: int = 1,
    scaler: Any = None,
    start: int | None = None,
    prior: LinearModel | None = None,
    plan: bool = False,
    sync_ranks: bool = True,
    cache: CacheOption = False,
    on_trial: OnTrial | None = None,
    progress: bool = False,
) -> SearchResult:
    """Search for the largest batch that fits and the recommended one, with real steps; returns
    the full record: ``batch_size`` (recommended, as :func:`find_max_batch` returns) and
    ``max_batch_size`` (the exact largest that fits).

    Runs zero_grad, forward, loss, backward and optimizer step at the sizes a memory-model-guided
    search chooses, catches out-of-memory errors, frees memory and goes on: the largest size that
    fits is exact (it ran, the next size up ran out of memory or is ``max_batch``), and the
    recommended size, ``(1 - headroom)`` of it (or, where the caching allocator's fit map has a
    gap there, the size nearest it that trains: ``result.notes`` says so), trained in a trial
    of its own. Afterwards the
    model, optimizer, RNG streams and device memory are exactly as before.

    ``start`` (a first size to try) and ``prior`` (a predicted memory model, e.g. a plan's)
    seed the search so a good guess costs two or three trials; ``plan=True`` gets both from
    :func:`autobatch.plan_max_batch` first (seconds on the meta device, no real memory).

    Under an initialised torch.distributed process group every rank runs the same trials in
    lockstep and each verdict is agreed (a size fits only if it fits on every rank; the
    capacity is the smallest rank's), so all ranks return the same result. ``sync_ranks=False``
    searches each rank on its own.

    ``cache=True`` (or a directory) reuses a result stored for exactly this setup — model
    architecture, sample shapes and dtypes, device and its memory, torch version, optimizer,
    autocast dtype, train or inference, search options — and stores new ones. It is off by
    default (the CLI turns it on): a cached answer cannot see what other processes hold now.
    Under torch.distributed the cache is not used, so that every rank runs the same trials.

    ``on_trial`` is called with each :class:`~autobatch.search.Trial` as it ends (this rank's
    own verdict, before the ranks agree); ``progress=True`` shows each trial as it ends (a
    ``tqdm`` bar on a terminal when ``tqdm`` is installed, plain lines on stderr otherwise),
    unless logging shows them already (``autobatch.trial`` at INFO). A cached answer runs one
    trial, at its largest size, before it is returned (the key cannot see a global or a
    ``self`` attribute the step reads): where that runs out of memory, the search runs again.

    Args:
        model: The module to train, already on its device.
        sample: One or a few examples: a tensor, a (nested) tuple/list/dict of tensors sharing
            dimension 0, or a callable ``n -> batch`` (for the worst case, e.g. the longest
            sequence). A list of per-row examples (dicts or tuples, as ``[dataset[i] for i in
            range(8)]`` gives) is collated as ``torch.utils.data.default_collate`` does, or
            refused with a ``TypeError`` where that would not be the batch (Python lists of
            numbers, rows of different lengths). Batches of ``n`` are built by cycling the
            sample's rows and moved to the model's device.
        optimizer: An optimizer (its state is created and restored), an optimizer class or factory
            (a temporary one is used), or None (forward and backward only).
        loss_fn: ``loss_fn(output, target)`` for ``(inputs, target)`` samples, ``loss_fn(output)``
            otherwise. Default: a scalar output, ``output.loss`` / ``output["loss"]`` (a Hugging
            Face model given ``labels``), else a stand-in that keeps what the usual training
            losses keep: a cross-entropy over the last dimension of each floating-point output
            plus a squared error (``notes`` says it was used).
        step_fn: ``step_fn(model, batch)``: your whole step (AMP and GradScaler, clipping, several
            forwards), run instead of the default one.
        train: False searches the inference batch: forward only under ``torch.inference_mode()``.
        device: The device whose memory to search (default: the model's).
        min_batch, max_batch, multiple_of: The sizes allowed (e.g. ``max_batch=len(dataset)``,
            ``multiple_of=8`` for tensor cores).
        headroom: The share of the largest size that fits the recommended size leaves unused
            (0.1: a tenth fewer rows, so about a tenth of the batch's own memory stays free,
            whatever the model's fixed state and the allocator's segments hold); one more
            trial proves it trains. 0 returns the exact largest size that fits. The guard's
            ``headroom`` means the same.
        steps_per_trial: Steps run at each size (several catch memory that grows over steps).
        scaler: A ``torch.amp.GradScaler``: used by the default step, and restored afterwards.
        start, prior, plan, sync_ranks, cache, on_trial, progress: See above.

    Raises:
        BatchSizeError: Even ``min_batch`` does not fit (with the capacity, and the bytes needed
            where the trials measured a line to predict them from).
    """
    spec = SearchSpec(
        loss_fn, step_fn, train, min_batch, max_batch, multiple_of, headroom, steps_per_trial,
        scaler,
    )
    check_module("model", model)
    if spec.train and optimizer is None and spec.step_fn is None:  # once per search
        logger.warning(
            "a training search without an optimizer runs forward and backward only: the "
            "optimizer's state (AdamW's is twice the parameters) is not counted, and training "
            "with one at the size found may run out of memory. Pass optimizer= (an optimizer "
            "or its class)"
        )
    target = model_device(model, device)
    memory = memory_for(target)
    store = open_cache(cache)

    with watching(on_trial, progress) as each_trial:

        def measured() -> SearchResult:
            return _measured_search(
                model, sample, optimizer, target, memory, spec, start=start, prior=prior,
                plan=plan, sync_ranks=sync_ranks, on_trial=each_trial,
            )

        def confirmed(hit: SearchResult) -> bool:
            """Whether a cached answer's largest and recommended sizes train now, in a trial
            each (the key cannot see everything that sets a step's memory: a global it reads,
            say; and a fit map with gaps lets the largest train where a smaller size does
            not)."""
            for size in dict.fromkeys((hit.max_batch_size, hit.batch_size)):
                once = dataclasses.replace(spec, min_batch=size, max_batch=size, headroom=0.0)
                try:
                    _measured_search(model, sample, optimizer, target, memory, once,
                                     start=None, prior=None, plan=False, sync_ranks=sync_ranks,
                                     on_trial=each_trial)
                except BatchSizeError:
                    return False
            return True

        if store is None or (sync_ranks and _distributed.active()):
            return measured()
        key = lambda: search_key(model, sample, optimizer, memory, **spec.options())  # noqa: E731
        return cached_search(store, key, measured, confirmed)[0]


def _measured_search(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike,
    target: torch.device,
    memory: DeviceMemory,
    spec: SearchSpec,
    *,
    start: int | None,
    prior: LinearModel | None,
    plan: bool,
    sync_ranks: bool,
    on_trial: OnTrial | None = None,
    policy: SearchPolicy | None = None,
) -> SearchResult:
    """The search itself, with real trials (the cache, if any, wraps it); ``policy`` chooses
    the sizes (default: the engine's)."""
    make_batch = batch_factory(sample, target)
    notes: list[str] = []
    if spec.train and optimizer is None and spec.step_fn is None:
        notes.append("no optimizer given: forward and backward only, optimizer state not counted")
    if not spec.train:
        notes.append("inference: forward only under torch.inference_mode(), model in eval mode")
    elif not model.training:
        notes.append("the model was in eval mode: measured in train mode (as training runs "
                     "it, dropout included), then put back in eval mode")
    sync = sync_ranks and (_distributed.active() or _distributed.lone_replica(
        [model, *modules_referenced(spec.loss_fn, spec.step_fn)]
    ))
    capacity = memory.capacity_bytes()
    budget = capacity
    if memory.has_statistics:  # other processes, or a per-process cap, may leave us less
        budget = min(capacity, memory.allocated_bytes() + memory.free_bytes())
    if sync:  # (every rank the same numbers: the tightest rank's)
        capacity, budget = _distributed.all_min([capacity, budget])
    if budget < capacity:
        notes.append(
            f"{format_bytes(capacity - budget)} of the {format_bytes(capacity)} device is not "
            f"available to this process; searching within {format_bytes(budget)}"
        )
    if plan and start is None and prior is None:
        from autobatch._sizing._planner import (
            plan_max_batch,  # lazy: the planner imports this module
        )

        try:
            planned = plan_max_batch(
                model, sample, optimizer if spec.train else None, budget,
                loss_fn=spec.loss_fn, step_fn=spec.step_fn, train=spec.train,
                min_batch=spec.min_batch, max_batch=spec.max_batch, multiple_of=spec.multiple_of,
                device=target.type,
            )
        except AutobatchError as error:  # cannot plan, or nothing fits: real trials decide
            notes.append(f"plan skipped: {str(error).splitlines()[0]}")
        else:
            start, prior = planned.max_batch_size, planned.memory_model
            notes.append(f"seeded by a plan: batch {start} in {planned.seconds:.2f} s")
    with prepared(
        model, optimizer, memory, train=spec.train, loss_fn=spec.loss_fn, step_fn=spec.step_fn,
        scaler=spec.scaler,
    ) as work:
        counted = work.optimizer is not None or spec.step_fn is not None
        if not memory.has_statistics and spec.max_batch is None and target.type == "cpu":
            raise ValueError(
                "searching host memory needs max_batch=: the CPU's allocator keeps no statistics, "
                "so the search would double the batch until it fails, which on a machine with swap "
                "means swapping, or the kernel's OOM killer, long before a Python error. Pass "
                "max_batch= (e.g. len(dataset)), or test under autobatch.testing.SimulatedGPU"
            )
        if work.measured_eager:
            notes.append(
                "compiled model measured eagerly: under the simulated GPU's accounting (a "
                "dispatch mode) compiled code cannot run; the model stays compiled"
            )
        elif work.compiled:  # the compiled graph runs: one graph for every trial's size
            make_batch = _dynamic_batches(make_batch)
        # Where the allocator caches, where a tensor lies matters as much as its bytes: a trial
        # replays the user's loop from the state the user has, the optimizer's state made by
        # a real first step (after the first backward, in what its activations left). Where
        # only bytes count, state made up front is the same number of bytes, and one step less.
        replay = work.optimizer is not None and memory.has_statistics and memory.caches
        runner = TrialRunner(
            make_batch, work.step, work.memory, steps_per_trial=spec.steps_per_trial,
            cleanup=work.start_over if replay else work.drop_gradients,
            per_operator=per_operator_possible(work.model),
            on_trial=None if sync else on_trial,  # (under sync: the trials every rank agreed)
            adaptive=not sync,  # ranks in lockstep run the same steps: one more, always
        )
        probe = _distributed.trials_in_lockstep(  # (DDP, FSDP2)
            runner, model, sync=sync, modules=modules_referenced(spec.loss_fn, spec.step_fn)
        )
        if work.optimizer is not None and not replay:
            _prime(work.optimizer, model, spec.min_batch, capacity, memory.name, sync)
        records: list[Trial] = runner.records
        if sync:
            records = []
            probe = _agreeing(probe, records, on_trial)
        outcome = search(
            probe,
            min_size=spec.min_batch,
            max_size=spec.max_batch,
            multiple_of=spec.multiple_of,
            capacity_bytes=budget if memory.has_statistics else None,
            start=start,
            prior=prior,
            policy=policy,
        )
        if outcome.largest_fit is None:
            raise _nothing_fits(records, spec.min_batch, budget, memory.name, outcome.model)
        notes += [
            f"batch {n} was not run: the caching allocator's replay, which gave every trial's "
            f"peak exactly, runs out of memory there" for n in outcome.replayed
        ]
        if any(isinstance(t.curve, Verdicts) and t.curve.approximate for t in outcome.trials):
            notes.append(
                "the step's tensors are not a line in the batch size (sizes that are not whole "
                "bytes per row: shapes that depend on the data or the weights, such as the rows "
                "a router sends each expert, or a kernel's workspace): every size was decided "
                "by a trial on the sample's rows, and other rows, or weights further into "
                "training, may need more; the recommended size leaves room for that"
            )
        failing = min((t for t in outcome.trials if not t.fits), key=lambda t: t.size,
                      default=None)
        if failing is not None and failing.error and "size_limit" in failing.error:
            notes.append(
                f"batch {failing.size} failed with an error that depends on the batch size but "
                f"is not out of memory ({failing.error}): the largest size is set by that "
                "limit, not by the device's memory"
            )
        below = sorted(t.size for t in outcome.trials if not t.fits and t.size < outcome.largest_fit)
        if below:
            notes.append(
                f"the fit map has gaps: batch {', '.join(map(str, below))} ran out of memory "
                f"below the largest, {outcome.largest_fit} (the caching allocator's segments); "
                "result.fits(n) tells which sizes train"
            )
            logger.warning("%s", notes[-1])
        if work.step.stood_in:
            notes.append(
                "no loss_fn, and the model computes no loss of its own: sized with a stand-in "
                "loss (a cross-entropy over each output's last dimension plus a squared error, "
                "which keeps what the usual per-row losses keep); pass loss_fn= to size your own"
            )
        # The recommended size is proven by a trial of its own (one more, below the largest),
        # which no later size is aimed from: its operators' peaks are not measured.
        runner.per_operator = False
        recommended = recommend(
            outcome,
            headroom=spec.headroom,
            multiple_of=spec.multiple_of,
            min_size=spec.min_batch,
            probe=probe,
            capacity_bytes=budget if memory.has_statistics else None,
        )
    step = spec.multiple_of
    computed = math.floor((1 - spec.headroom) * outcome.largest_fit) // step * step
    if recommended != computed:  # (recommend() proved its size by a trial)
        where = "the largest below it" if recommended < computed else (
            "the nearest above it, in a band of sizes that train below the largest")
        notes.append(
            f"batch {computed} ({1 - spec.headroom:.0%} of {outcome.largest_fit}) runs out of "
            f"memory where {outcome.largest_fit} trains: the caching allocator's fit map has a "
            f"gap there; recommended {recommended} ({recommended / outcome.largest_fit:.0%}), "
            f"{where} that trained"
        )
    result = SearchResult(
        batch_size=recommended,
        max_batch_size=outcome.largest_fit,
        trials=tuple(records),
        memory_model=outcome.model,
        capacity_bytes=budget,
        device=memory.name,
        headroom=float(spec.headroom),
        train=spec.train,
        optimizer_counted=counted,
        smallest_failing=outcome.smallest_fail,
        notes=tuple(notes),
    )
    logger.info(
        "largest batch that fits: %d; recommended %d (headroom %g) after %d trials",
        result.max_batch_size, result.batch_size, spec.headroom, len(result.trials),
    )
    return result


def _dynamic_batches(make_batch: Callable[[int], Batch]) -> Callable[[int], Batch]:
    """``make_batch`` with dimension 0 marked dynamic for ``torch.compile``."""

    def make(n: int) -> Batch:
        return mark_batch_dynamic(make_batch(n))

    return make


def _agreeing(
    runner: Callable[[int], Trial], records: list[Trial], on_trial: OnTrial | None
) -> Callable[[int], Trial]:
    """The runner's probe, with every trial agreed by all ranks (one gather on the side group
    per trial) and appended to ``records`` (and shown to ``on_trial``): the same record on
    every rank.

    It fits if it fit on every rank; its peaks and time are the largest of the ranks'; a
    failure names the first rank that ran out of memory itself (``"cuda_allocator (rank 1)"``).
    Parts (and phases) are kept only when every rank measured as many, element-wise maximal;
    its steps are the most any rank ran. A rank whose trial raises a non-OOM error still takes
    part in the gather (so no rank waits forever), then re-raises; the other ranks raise an
    :class:`AutobatchError` naming it.
    """

    def probe(size: int) -> Trial:
        try:
            mine = runner(size)
        except Exception:
            _distributed.gather(None)
            raise
        everyone: list[Trial | None] = _distributed.gather(dataclasses.replace(mine, curve=None))
        crashed = [r for r, t in enumerate(everyone) if t is None]
        if crashed:
            raise AutobatchError(
                f"rank {', '.join(map(str, crashed))} failed with an error that is not "
                f"out-of-memory during the trial at batch {size}; see that rank's traceback"
            )
        trials = [t for t in everyone if t is not None]
        if any(t.size != size for t in trials):  # (a bug: the ranks left lockstep)
            raise AutobatchError(
                f"the ranks tried different batch sizes ({', '.join(str(t.size) for t in trials)}"
                "); every rank must search the same setup (model, sample, options)"
            )
        agreed = _agreed(mine, trials)
        records.append(agreed)
        if on_trial is not None:
            on_trial(agreed)
        return agreed

    return probe


def _agreed(mine: Trial, trials: list[Trial]) -> Trial:
    """One trial from every rank's record of it (see :func:`_agreeing`)."""
    seconds = max(t.seconds for t in trials)
    steps = max(t.steps for t in trials)
    failed = [(r, t) for r, t in enumerate(trials) if not t.fits]
    if failed:
        own = [(r, t) for r, t in failed if t.error != _distributed.PEER]
        r, first = (own or failed)[0]
        error = f"{first.error} (rank {r})" if first.error else f"out of memory (rank {r})"
        return dataclasses.replace(
            mine, fits=False, peak_bytes=None, seconds=seconds, error=error, parts=(),
            phases=(), curve=None, reserved_bytes=None, steps=steps,
        )

    def largest(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return max(known) if known and len(known) == len(values) else None

    def combined(vectors: list[tuple[int, ...]]) -> tuple[int, ...]:
        if len({len(v) for v in vectors}) != 1:
            return ()
        return tuple(max(column) for column in zip(*vectors, strict=True))

    return dataclasses.replace(
        mine, fits=True, peak_bytes=largest([t.peak_bytes for t in trials]), seconds=seconds,
        error=None, parts=combined([t.parts for t in trials]),
        phases=combined([t.phases for t in trials]), curve=None,
        reserved_bytes=largest([t.reserved_bytes for t in trials]), steps=steps,
    )


def _prime(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    min_batch: int,
    capacity: int,
    device: str,
    sync: bool,
) -> None:
    """Create optimizer state before the search; an OOM here means nothing can fit."""
    failed: str | None = None
    try:
        prime_optimizer(optimizer)
    except Exception as error:
        failed = oom_kind(error)
        if failed is None:
            if sync:
                _distributed.failed_ranks(True)
            raise
    if sync:
        ranks = _distributed.failed_ranks(failed is not None)
        if ranks and failed is None:
            failed = f"on rank {ranks[0]}"
    if failed is None:
        return
    model.zero_grad(set_to_none=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    raise BatchSizeError(
        f"the model and its optimizer state do not fit on {device} ({failed} while creating "
        f"the optimizer state): parameters alone take {format_bytes(params)} of "
        f"{format_bytes(capacity)}. Even batch {min_batch} cannot fit; use a smaller model, "
        "mixed precision, a sharded optimizer or a larger device",
        batch_size=min_batch,
        needed_bytes=None,
        capacity_bytes=capacity,
    )


def _nothing_fits(
    records: list[Trial],
    min_batch: int,
    capacity: int,
    device: str,
    model: LinearModel | None,
) -> BatchSizeError:
    smallest = min(records, key=lambda r: r.size) if records else None
    needed = None
    if model is not None:
        needed = math.ceil(model.predict(min_batch))
    why = f" ({smallest.error})" if smallest is not None and smallest.error else ""
    need = f"needs about {format_bytes(needed)} of " if needed else "does not fit in "
    return BatchSizeError(
        f"even the smallest batch ({min_batch}) does not fit on {device}{why}: it {need}"
        f"{format_bytes(capacity)}. Reduce the model or the input size, use mixed precision "
        "or gradient checkpointing, or free memory held elsewhere",
        batch_size=min_batch,
        needed_bytes=needed,
        capacity_bytes=capacity,
    )


def _with_options_of(search: Callable[P, SearchResult]) -> Callable[[Callable[..., int]], Callable[P, int]]:
    """Give a front-end that forwards everything to ``search`` its signature (for ``help()``,
    ``inspect`` and type checkers), returning an ``int``."""

    def apply(front: Callable[..., int]) -> Callable[P, int]:
        signature = inspect.signature(search)
        front.__signature__ = signature.replace(return_annotation="int")  # type: ignore[attr-defined]
        return front

    return apply


@_with_options_of(search_batch_size)
def find_max_batch(*args: Any, **kwargs: Any) -> int:
    """The recommended batch size: the largest size that fits with real training steps, less
    ``headroom`` of its rows (a tenth by default), proven by a trial of its own; ``headroom=0``
    returns the exact largest batch that fits.

    Takes exactly the arguments of :func:`search_batch_size` and returns its
    ``result.batch_size``; see it for every option.

    >>> import torch
    >>> from autobatch.testing import SimulatedGPU
    >>> model = torch.nn.Linear(256, 10)
    >>> with SimulatedGPU("4MiB", adopt=[model]):
    ...     n = find_max_batch(model, torch.randn(1, 256), torch.optim.SGD, headroom=0)
    >>> n > 100
    True

    Raises:
        BatchSizeError: Even ``min_batch`` does not fit (with the capacity, and the bytes needed
            where the trials measured a line to predict them from).
    """
    return search_batch_size(*args, **kwargs).batch_size
