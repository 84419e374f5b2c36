"""``plan_max_batch``: the search on planned peaks, on ``meta`` or from a few real CPU steps."""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger, user_stacklevel
from autobatch._memory._accounting import CUDA_BLOCK_BYTES
from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._backends import (
    CpuMemory,
    caching_allocator,
    restore_rng_states,
    save_rng_states,
)
from autobatch._memory._measure import StorageTrial, _replayed_curve
from autobatch._search import (
    UNBOUNDED_MAX_SIZE,
    LinearModel,
    SearchOutcome,
    Trial,
    Verdicts,
    extrapolate,
    fit_linear,
    recommend,
    search,
)
from autobatch._sizing._planner._meta import _MetaSetup, _StepError
from autobatch._sizing._planner._plans import Plan
from autobatch._sizing._workload import (
    DEFAULT_HEADROOM,
    LossFn,
    OptimizerLike,
    Sample,
    SearchSpec,
    StepFn,
    check_initialized,
    collated,
)
from autobatch._units import format_bytes, parse_bytes
from autobatch._validate import check_module

logger = get_logger("planner")


#: What a refusal under the caching allocator adds to the bytes it names.
_SEGMENTS = (
    "; the caching allocator reserves them in segments, 2 MiB at least for small tensors and "
    "20 MiB for large ones, and those did not fit"
)


def _byte_option(value: int | float | str, name: str) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0
    return parse_bytes(value, name=name)


@dataclass(frozen=True)
class _Request:
    """What a plan is asked for, checked: the step, the sizes allowed and the memory."""

    model: nn.Module
    sample: Sample
    optimizer: OptimizerLike
    spec: SearchSpec  # one step per size, no scaler
    device_type: str
    block_bytes: int
    capacity_bytes: int
    overhead_bytes: int
    started: float
    expandable_segments: bool | None  # the caching allocator's (None: as set in this process)
    caching: bool = True  # placed as CUDA's caching allocator places blocks

    def allocator(self) -> CachingAllocator:
        """An empty model of the target's caching allocator."""
        return caching_allocator(
            self.capacity_bytes, self.overhead_bytes,
            expandable_segments=self.expandable_segments,
        )


def plan_max_batch(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike = None,
    capacity: int | float | str = "80GiB",
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    train: bool = True,
    min_batch: int = 1,
    max_batch: int | None = None,
    multiple_of: int = 1,
    headroom: float = DEFAULT_HEADROOM,
    overhead: int | float | str = 0,
    block_bytes: int = CUDA_BLOCK_BYTES,
    device: str | torch.device = "cuda",
    allocator: Literal["caching", "exact"] = "caching",
    expandable_segments: bool | None = None,
) -> Plan:
    """Predict the largest batch that fits a device of ``capacity`` bytes, without that device.

    Runs the training step of :func:`~autobatch.find_max_batch` (same ``sample``, ``loss_fn``,
    ``step_fn`` and ``train`` conventions) on a ``meta`` copy of the model and optimizer: no
    real compute, no real memory, and the model is not touched. Every storage the step creates
    is placed by a model of CUDA's caching allocator (``allocator="caching"``, the default):
    the copies first, then a user's own loop from a fresh optimizer, five steps or more while
    the reserved memory grows, each batch copied in while the last one is still held, exactly
    as :class:`~autobatch.testing.SimulatedGPU` places them. A size fits when no request finds
    its segment; the storages' events, each a line in the batch size, are replayed through the
    allocator's model at the sizes in between, so that a size that fits above one that fails
    is found too. ``allocator="exact"`` counts allocated bytes only (each storage rounded up to
    ``block_bytes``), as the simulator's ``allocator="exact"`` does.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
    ...                             torch.nn.Linear(2048, 10))
    >>> plan = plan_max_batch(model, torch.randn(1, 512), torch.optim.Adam, capacity="24GiB")
    >>> plan.max_batch_size > 100_000, plan.batch_size < plan.max_batch_size
    (True, True)
    >>> next(model.parameters()).device.type  # the real model stays where it was
    'cpu'

    What the plan cannot see: kernels that choose their memory on the device. Attention
    (``scaled_dot_product_attention``) planned for the CPU runs the kernel the CPU chooses (its
    fused flash kernel, or the math path), as on :class:`~autobatch.testing.SimulatedGPU`; for
    a GPU it is planned with the math path, and the GPU's fused kernels (flash,
    memory-efficient, cuDNN) need less: with attention the plan is an upper bound there.
    cuBLAS/cuDNN workspaces and the CUDA context are not storages: they belong in
    ``overhead`` (no allowance per device is built in: none has been measured yet). A
    ``step_fn`` or ``loss_fn`` must only use the model it is given (and module losses, which
    are copied); a GradScaler is not planned.

    Args:
        model: The module to plan for, on any device (``meta`` too); it is copied to ``meta``
            without reading its data.
        sample: One or a few examples, as for :func:`~autobatch.find_max_batch`; a callable ``n ->
            batch`` is called once, as ``sample(1)``, and its row repeated (its rows' shapes must
            not depend on ``n``).
        optimizer: An optimizer (copied with its state), an optimizer class or factory, or None.
        capacity: The device's memory, as bytes or a string with a unit (``"24GiB"``, ``"80GB"``).
        loss_fn, step_fn, train: As for :func:`~autobatch.find_max_batch`.
        min_batch, max_batch, multiple_of: The sizes allowed.
        headroom: The share of the largest size the recommended ``batch_size`` leaves unused.
        overhead: Bytes the device holds besides the step's tensors (CUDA context, often 300-600 MiB
            and not in ``torch.cuda.memory_allocated``; cuBLAS/cuDNN workspaces; other processes):
            the peak may use ``capacity - overhead``.
        block_bytes: The rounding of ``allocator="exact"``: 512 as the CUDA caching allocator,
            1 for raw bytes.
        device: The device planned for (``"cuda"``, ``"cuda:1"``, a ``torch.device``; only its
            type counts: no such device is needed). Tensors the step keeps on the host (Adam's
            ``step`` counters) count only when it is ``"cpu"``, and optimizers left to choose run
            the implementation torch picks there (``foreach`` on ``"cuda"``); ``"cpu"`` plans what
            :class:`~autobatch.testing.SimulatedGPU` measures.
        allocator: ``"caching"`` (CUDA's caching allocator: segments, block pools, its
            settings) or ``"exact"`` (allocated bytes only).
        expandable_segments: The caching allocator's setting; ``None`` reads it from
            ``PYTORCH_CUDA_ALLOC_CONF`` in this process, as torch would on the device.

    Raises:
        BatchSizeError: Even ``min_batch`` does not fit (with the planned bytes and the capacity).
        AutobatchError: The step uses a tensor from outside the copies (a ``step_fn`` or ``loss_fn``
            that reaches for the real model), or fails on the CPU copy too.

    Warns:
        UserWarning: The step cannot run on ``meta`` (``.item()``, e.g. on a Hugging Face
            attention mask, data-dependent shapes, ops without a meta kernel): the message names
            the module and the operator, and the plan comes from small real steps on a CPU copy
            (``method="steps"``), as it always does for recurrent layers.
    """
    spec = SearchSpec(loss_fn, step_fn, train, min_batch, max_batch, multiple_of, headroom, 1, None)
    check_module("model", model)
    check_initialized(model)
    sample = collated(sample, on_host=True)  # a list of per-row examples: one batch
    try:
        device_type = torch.device(device).type
    except (TypeError, RuntimeError):
        raise ValueError(
            f"device must be a device such as 'cuda' or 'cuda:1', got {device!r}") from None
    capacity_bytes = parse_bytes(capacity)
    overhead_bytes = _byte_option(overhead, "overhead")
    budget = capacity_bytes - overhead_bytes
    if allocator not in ("caching", "exact"):
        raise ValueError(f"allocator must be 'caching' or 'exact', got {allocator!r}")
    if allocator == "caching" and block_bytes != CUDA_BLOCK_BYTES:
        raise ValueError(
            f"block_bytes={block_bytes!r} applies to allocator='exact' only; the caching "
            "allocator rounds as CUDA's does (512 bytes)"
        )
    if allocator == "exact" and expandable_segments is not None:
        raise ValueError("expandable_segments applies to allocator='caching' only")
    if budget <= 0:
        raise ValueError(
            f"overhead={overhead!r} ({format_bytes(overhead_bytes)}) leaves nothing of "
            f"capacity={capacity!r} ({format_bytes(capacity_bytes)}); lower the overhead"
        )
    request = _Request(
        model, sample, optimizer, spec, device_type, block_bytes, capacity_bytes, overhead_bytes,
        started=time.perf_counter(), expandable_segments=expandable_segments,
        caching=allocator == "caching",
    )
    recurrent = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if recurrent:  # their kernels on the CPU or GPU keep workspaces a meta run does not see
        why = (
            f"recurrent layers ({', '.join(recurrent)}) keep workspaces that their meta kernels "
            "do not allocate"
        )
    else:
        try:
            return _plan_on_meta(request)
        except _StepError as error:
            if "more than 1 value per channel" in str(error):  # (BatchNorm, training, 1 row)
                raise AutobatchError(
                    f"{str(error).split(' (ValueError')[0]}: a normalisation over the batch "
                    "needs at least 2 rows when training; pass min_batch=2"
                ) from None
            why = str(error).split(". The planner runs shapes")[0]
            warnings.warn(
                f"{why}. Planning from two or three small real steps on a CPU copy instead, "
                "extrapolated per operator (seconds, and as exact as the simulator where the "
                "step's operators do not change with the size)",
                stacklevel=user_stacklevel(),
            )
    return _plan_from_steps(request, why)


def _plan_on_meta(r: _Request) -> Plan:
    """The plan from steps on the meta device, at the sizes the search engine asks for."""
    budget = r.capacity_bytes - r.overhead_bytes
    with _disable_current_modes():  # a simulator or fake mode around us must not see the copies
        setup = _MetaSetup(
            r.model,
            r.sample,
            r.optimizer,
            loss_fn=r.spec.loss_fn,
            step_fn=r.spec.step_fn,
            train=r.spec.train,
            device_type=r.device_type,
            block_bytes=r.block_bytes,
        )
        peaks: dict[int, int] = {}  # planned peaks (under caching: of the sizes that fit)
        place = _Placing(setup, r)

        def probe(n: int) -> Trial:
            if r.caching:
                trial = place(n)
                if trial.fits and trial.reserved_bytes is not None:
                    peaks[n] = trial.reserved_bytes
            else:
                peaks[n] = peak = setup.peak(n)
                trial = Trial(n, peak <= budget, peak)
            logger.info(
                "planned batch %d: %s", n,
                f"fits, peak {format_bytes(peaks[n])}" if trial.fits else "does not fit",
            )
            return trial

        outcome = search(
            probe,
            min_size=r.spec.min_batch,
            max_size=r.spec.max_batch,
            multiple_of=r.spec.multiple_of,
            capacity_bytes=budget,
        )
        first = -(-r.spec.min_batch // r.spec.multiple_of) * r.spec.multiple_of
        largest = outcome.largest_fit
        if largest is None:
            needed = setup.peak(first) + r.overhead_bytes
            raise BatchSizeError(
                f"even the smallest batch ({r.spec.min_batch}) does not fit: the plan needs "
                f"{format_bytes(needed)} at batch {first} (overhead "
                f"{format_bytes(r.overhead_bytes)} included{_SEGMENTS if r.caching else ''}) of "
                f"{format_bytes(r.capacity_bytes)}. Reduce the model or the input size, use mixed "
                "precision, gradient checkpointing or a sharded optimizer, or a larger device",
                batch_size=r.spec.min_batch,
                needed_bytes=needed,
                capacity_bytes=r.capacity_bytes,
            )
        half = max(first, largest // 2 // r.spec.multiple_of * r.spec.multiple_of)
        top = largest if largest > half else outcome.smallest_fail
        memory_model = None
        if top is not None:  # the tensors' bytes (what a prior for the finder predicts)
            memory_model = fit_linear([(n, setup.peak(n)) for n in (half, top)])
        breakdown = setup.breakdown(largest)
        if r.caching:
            breakdown = dataclasses.replace(
                breakdown, cached=max(peaks[largest] - breakdown.peak, 0)
            )
        batch_size = recommend(  # (planned, as a search proves it)
            outcome,
            headroom=r.spec.headroom,
            multiple_of=r.spec.multiple_of,
            min_size=r.spec.min_batch,
            probe=probe,
        )
    extra = [_placement_note(r)]
    fast = sorted({type(m).__name__ for m in r.model.modules()
                   if isinstance(m, (nn.TransformerEncoderLayer, nn.MultiheadAttention))})
    if fast and not r.spec.train:
        extra.append(
            f"inference through {', '.join(fast)}: on a device torch runs them on its fused "
            "fast path, which a meta run cannot take; the plan is for the slower path, which "
            "holds more, so the batch planned is a lower bound there"
        )
    if setup.mode.attention and r.device_type != "cpu":  # (the CPU chose the math path too)
        extra.append(
            "attention planned with the math path; fused attention kernels (flash, "
            "memory-efficient) on the device need less, so the plan is an upper bound there"
        )
    return _planned(
        [*setup.notes], extra, train=r.spec.train, counts_optimizer=setup.optimizer is not None
        or r.spec.step_fn is not None, started=r.started, how="",
        batch_size=batch_size, max_batch_size=largest, memory_model=memory_model,
        points=tuple(sorted(peaks.items())), capacity_bytes=r.capacity_bytes,
        overhead_bytes=r.overhead_bytes, breakdown=breakdown, headroom=float(r.spec.headroom),
        device_type=r.device_type,
    )


def _placement_note(r: _Request) -> str:
    """How the plan placed the step's storages."""
    if not r.caching:
        return f"exact accounting: every storage rounded up to {r.block_bytes} bytes, no segments"
    setting = "with" if r.allocator().expandable_segments else "without"
    return (
        f"placed by a model of CUDA's caching allocator ({setting} expandable segments), over "
        "a user's fresh loop of 5 or more steps; the peaks are reserved bytes. Not in it: the "
        "CUDA context and cuBLAS/cuDNN workspaces (pass them as overhead=)"
    )


def _planned(
    notes: list[str], extra: list[str], *, train: bool, counts_optimizer: bool, started: float,
    how: str, **fields: Any,
) -> Plan:
    """The plan from its fields, with the notes every plan shares between ``notes`` and
    ``extra``, logged."""
    if train and not counts_optimizer:
        notes.append("no optimizer given: forward and backward only, optimizer state not counted")
    if not train:
        notes.append("inference: forward only under torch.inference_mode(), model in eval mode")
    plan = Plan(notes=(*notes, *extra), seconds=time.perf_counter() - started, **fields)
    logger.info(
        "planned largest batch %d%s, recommended %d, in %.2f s",
        plan.max_batch_size, how, plan.batch_size, plan.seconds,
    )
    return plan



#: The real steps of a plan from steps stay below this much host memory each.
_HOST_STEP_BYTES = 256 * 2**20


def _extrapolated(
    measure: Any, trials: list[Trial], budget: int, first: int, last: int | None, step: int,
    block_bytes: int,
) -> tuple[int, LinearModel | None]:
    """The largest size within ``budget`` from steps too large to run here: two small real
    steps, then up to two more halfway to the answer while a step stays cheap on this host,
    every operator's peak extrapolated on its own line (the more cautious of the lines through
    all the points and through the last two)."""
    small = max(first, -(-2 // step) * step)
    for n in (small, 4 * small):
        if last is None or n <= last:
            measure(n)
    if len(trials) < 2:
        measure(first)
        return (first if trials[0].fits else 0), None
    largest, line = extrapolate(trials, budget, granularity_bytes=block_bytes)
    for _ in range(2):
        if line is None:
            break
        affordable = line.largest_within(line.predict(0) + _HOST_STEP_BYTES)
        farther = min(largest // 2, affordable, UNBOUNDED_MAX_SIZE) // step * step
        if last is not None:
            farther = min(farther, last)
        if farther < 2 * max(t.size for t in trials):
            break
        measure(farther)
        largest, line = extrapolate(trials, budget, granularity_bytes=block_bytes)
    if len(trials) > 2:
        recent, _ = extrapolate(trials[-2:], budget, granularity_bytes=block_bytes)
        largest = min(largest, recent)
    return largest, line


class _Placing:
    """A probe: a user's fresh loop at a size placed on the caching allocator's model (see
    :meth:`_MetaSetup.fresh_loop`), and where two loops that fit line up, the replay of their
    storages at every size as the trial's curve (islands above a failing size found, the
    size above the largest known to fail without a loop of its own)."""

    def __init__(self, setup: _MetaSetup, r: _Request) -> None:
        self.setup, self.r = setup, r
        self.placed: list[StorageTrial] = []  # the fitting loops' storages

    def __call__(self, n: int) -> Trial:
        trial, events = self.setup.fresh_loop(n, self.r.allocator())
        if not trial.fits or not trial.peak_bytes:
            return trial
        record = StorageTrial(n, 0, events, trial.peak_bytes)
        curve = next(
            (c for other in reversed(self.placed)
             if (c := _replayed_curve(other, record, self.r.allocator())) is not None),
            None,
        )
        self.placed.append(record)
        return trial if curve is None else dataclasses.replace(trial, curve=curve)


def _replayed_largest(setup: _MetaSetup, r: _Request, first: int, last: int | None) -> int | None:
    """The largest size a caching allocator's replay of two small fresh loops' storages
    (real CPU steps, each storage a line in the size) says fits, searched as trials would be;
    ``None`` where the loops do not line up."""
    place = _Placing(setup, r)
    small = max(first, 2)
    curve = [place(n) for n in (small, 4 * small)][-1].curve
    if not isinstance(curve, Verdicts):
        return None

    def replayed(n: int) -> Trial:
        peak = curve.peak_at(n)
        return Trial(n, peak is not None, peak)

    outcome = search(replayed, min_size=first, max_size=last, multiple_of=r.spec.multiple_of)
    return outcome.largest_fit or 0


def _plan_from_steps(r: _Request, why: str) -> Plan:
    """The plan from two or three small real steps on CPU copies of the model and optimizer,
    counted with the same accounting, each operator's peak extrapolated on its own line."""
    budget = r.capacity_bytes - r.overhead_bytes
    step = r.spec.multiple_of
    first = -(-r.spec.min_batch // step) * step
    last = None if r.spec.max_batch is None else r.spec.max_batch // step * step
    weights = sum(t.numel() * t.element_size() for t in [*r.model.parameters(), *r.model.buffers()])
    host = CpuMemory(torch.device("cpu")).free_bytes()
    if 4 * weights > host // 2:  # the copy, its gradients and an optimizer's two moments
        raise AutobatchError(
            f"plan_max_batch cannot plan this step from real steps on a CPU copy ({why}): the "
            f"copy with its gradients and optimizer state needs about "
            f"{format_bytes(4 * weights)}, more than half of the {format_bytes(host)} of host "
            "memory free; use autobatch.find_max_batch on the device instead"
        )
    with _disable_current_modes():
        rng = save_rng_states(host=True)
        try:
            setup = _MetaSetup(
                r.model, r.sample, r.optimizer, loss_fn=r.spec.loss_fn, step_fn=r.spec.step_fn,
                train=r.spec.train, device_type=r.device_type, block_bytes=r.block_bytes, real=True,
            )
            trials: list[Trial] = []

            def measure(n: int) -> Trial:
                began = time.perf_counter()
                outcome = setup.parts(n)
                peak = outcome.peak_bytes or 0
                trial = Trial(n, peak <= budget, peak, parts=outcome.parts)
                trials.append(trial)
                logger.info(
                    "measured batch %d on a CPU copy: peak %s, %.2f s", n, format_bytes(peak),
                    time.perf_counter() - began,
                )
                return trial

            place = _Placing(setup, r)

            def placed(n: int) -> Trial:
                trial = place(n)
                trials.append(trial)
                logger.info("placed batch %d on a CPU copy: %s", n,
                            "fits" if trial.fits else "does not fit")
                return trial

            placement: str | None = _placement_note(r)
            if budget <= _HOST_STEP_BYTES:  # every step fits on this host: measure them all
                exact = search(placed if r.caching else measure, min_size=r.spec.min_batch,
                               max_size=r.spec.max_batch, multiple_of=step, capacity_bytes=budget)
                largest = 0 if exact.largest_fit is None else exact.largest_fit
                line = exact.model
                reach = "sizes measured up to the answer and the one above it"
            else:
                largest, line = _extrapolated(measure, trials, budget, first, last, step,
                                              r.block_bytes)
                reach = (
                    f"sizes above {max(t.size for t in trials)} extrapolated, each operator's "
                    "peak on its own line (a kernel whose memory changes in steps may make it "
                    "a little optimistic)"
                )
                if r.caching:
                    replayed = _replayed_largest(setup, r, first, last)
                    if replayed is None:
                        reach += "; the caching allocator's segments are not placed at those sizes"
                        placement = None
                    else:
                        largest = min(largest, replayed)
                        reach += (
                            "; two small fresh loops' storages, each a line in the size, "
                            "replayed through the caching allocator's model at those sizes"
                        )
            fitting = [t for t in trials if t.fits] or trials
            biggest = max(t.size for t in fitting)
            breakdown_at = setup.breakdown(biggest)
            if r.caching and not any(t.fits for t in trials):  # (the bytes the message gives)
                trials.append(Trial(first, False, setup.peak(first)))
        finally:
            restore_rng_states(rng)
    # allocated peaks; a size the caching allocator's model refused has none
    peaks = {t.size: t.peak_bytes or 0 for t in trials if t.peak_bytes is not None}
    points = peaks if not r.caching else {
        t.size: t.reserved_bytes for t in trials if t.fits and t.reserved_bytes is not None
    }
    largest = max(largest, 0) // step * step
    if last is not None:
        largest = min(largest, last)
    if largest < first:
        needed = peaks.get(first, min(peaks.values())) + r.overhead_bytes
        raise BatchSizeError(
            f"even the smallest batch ({r.spec.min_batch}) does not fit: measured on a CPU copy, "
            f"the step needs about {format_bytes(needed)} (overhead "
            f"{format_bytes(r.overhead_bytes)} included{_SEGMENTS if r.caching else ''}) of "
            f"{format_bytes(r.capacity_bytes)}. Reduce "
            "the model or the input size, use mixed precision, gradient checkpointing or a "
            "sharded optimizer, or a larger device",
            batch_size=r.spec.min_batch,
            needed_bytes=needed,
            capacity_bytes=r.capacity_bytes,
        )
    predicted = peaks.get(largest, int(line.predict(largest)) if line is not None else peaks[biggest])
    outcome = SearchOutcome(largest, largest + step, tuple(t for t in trials if t.fits), line)
    batch_size = recommend(
        outcome, headroom=r.spec.headroom, multiple_of=step, min_size=r.spec.min_batch
    )
    scale = largest / biggest
    fixed = (
        breakdown_at.parameters + breakdown_at.buffers + breakdown_at.gradients
        + breakdown_at.optimizer_state
    )
    batch_bytes = round(breakdown_at.batch * scale)
    breakdown = dataclasses.replace(
        breakdown_at, batch=batch_bytes, activations=max(predicted - fixed - batch_bytes, 0)
    )
    if largest in points:
        breakdown = dataclasses.replace(breakdown, cached=max(points[largest] - breakdown.peak, 0))
    notes = [
        f"planned from {len(trials)} real steps on a CPU copy (batches "
        f"{', '.join(str(t.size) for t in trials)}; {reach}): {why}",
        *setup.notes,
    ]
    extra = [] if placement is None else [placement]
    if r.device_type != "cpu":
        extra.append(
            f"measured with the CPU's kernels: on {r.device_type} some kernels (cuDNN recurrent "
            "layers, fused attention) keep other workspaces; check with find_max_batch there"
        )
    return _planned(
        notes, extra, train=r.spec.train, counts_optimizer=setup.optimizer is not None
        or r.spec.step_fn is not None, started=r.started, how=" from real steps",
        batch_size=batch_size, max_batch_size=largest, memory_model=line,
        points=tuple(sorted(points.items())), capacity_bytes=r.capacity_bytes,
        overhead_bytes=r.overhead_bytes, breakdown=breakdown, headroom=float(r.spec.headroom),
        device_type=r.device_type, method="steps",
    )
