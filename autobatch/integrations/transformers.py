"""Hugging Face ``Trainer``: the batch size found before training, and training steps that
survive OOM.

>>> from autobatch.integrations.transformers import autobatch_trainer, recovery_stats
>>> trainer = autobatch_trainer(Trainer(model=model, args=args, train_dataset=data))  # doctest: +SKIP
>>> trainer.train()                                                              # doctest: +SKIP
>>> recovery_stats(object()).ooms  # a trainer without a guard: nothing recovered
0

:func:`autobatch_trainer` prepares a ``Trainer`` (and returns it):

- ``find``: :func:`autobatch.search_batch_size` runs the trainer's own ``training_step`` (its
  ``compute_loss``, the accelerator's mixed precision and GradScaler, activation (gradient)
  checkpointing where ``args`` turn it on), clipping and its optimizer (created with
  ``create_optimizer()`` when the trainer has none yet, and dropped again, so that ``train()``
  creates it as before), on the training dataset's longest rows collated by the trainer's data
  collator, where their lengths cost nothing more than the ``Trainer``'s own length grouping
  (a length column, a list of rows in memory, ``train_sampling_strategy="group_by_length"``);
  else on its first rows, with a WARNING when those differ in length. The recommended
  size is set as ``args.per_device_train_batch_size``, and said once, as a WARNING of the
  ``autobatch`` logger on the main process (shown with no logging set up). Weights, optimizer
  state, gradients and random streams are left as they were. ``search_result(trainer)``
  returns the record.
- ``guard``: ``trainer.training_step`` (which computes the loss and its gradients; the
  ``Trainer`` clips and steps outside it, after ``gradient_accumulation_steps`` calls) is
  replaced by one that recovers from OOM through :func:`autobatch.retry_on_oom` (a function that
  only computes gradients: ``policy="accumulate"`` with ``model=``): on an OOM the batch runs in
  micro-batches whose gradients add up to the batch's. How much each micro-batch weighs is
  found from what the loss computes, not from a flag: a loss that divides by the count the
  ``Trainer`` passes (``num_items_in_batch``, the accumulation window's labelled items) adds up
  over micro-batches; one that does not is a mean per batch, and each micro-batch is weighted by
  its share of what the mean averages over, where that is known (transformers' label smoother,
  and the model's own loss for the heads of ``_trainer_loss.MEAN_HEADS``: labels that are not
  ``-100``, shifted by one for causal language models, or rows). Any other loss that ignores the
  count (a model, ``compute_loss_func`` or ``compute_loss`` of one's own) is refused at the
  first split, unless ``reduction=`` (and ``items=``) says how it reduces.
  ``recovery_stats(trainer)`` says what happened; each recovered OOM is a WARNING naming the
  trainer's ``training_step``.

Refused with an :class:`~autobatch.AutobatchError`: several processes or devices (DDP,
DataParallel, FSDP, DeepSpeed, SageMaker model parallelism, context or sequence parallelism),
and optimizers that step inside backward (LOMO, AdaLomo, the layer-wise GaLore variants); at
the first split, a router's load-balancing loss (``output_router_logits=True``), a function of
the whole batch's routing.
With ``gradient_accumulation_steps > 1``, an OOM in the backward of a batch after earlier
batches of the window added their gradients is recovered exactly too: the window's gradients
are kept apart until a backward completes. ``docs/exactness_matrix.md`` lists each head and
feature tested against the unguarded ``Trainer``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autobatch import AutobatchError, RecoveryStats, SearchResult, retry_on_oom, search_batch_size
from autobatch._log import get_logger, named_after, user_name
from autobatch._recovery import RetryingStep
from autobatch._recovery._patches import Patch
from autobatch._sizing._workload import DEFAULT_HEADROOM
from autobatch.integrations import _common, _trainer_loss

__all__ = ["autobatch_trainer", "recovery_stats", "search_result"]

logger = get_logger("integrations.transformers")

_RESULTS: weakref.WeakKeyDictionary[Any, SearchResult] = weakref.WeakKeyDictionary()

#: Optimizers that update parameters inside backward (or per layer as gradients arrive): a
#: micro-batch would apply its update alone.
_STEPS_IN_BACKWARD = ("lomo", "adalomo", "layerwise")


def autobatch_trainer(
    trainer: Any,
    *,
    find: bool = True,
    guard: bool = True,
    headroom: float = DEFAULT_HEADROOM,
    sample: Any = None,
    min_batch: int = 1,
    reduction: str | None = None,
    items: Callable[[Any], Any] | None = None,
    **search_options: Any,
) -> Any:
    """Prepare a Hugging Face ``Trainer``: find its batch size, and make its training steps
    recover from OOM; returns the same trainer.

    See the module documentation for what each part does and what is refused.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass), before ``train()``.
        find: search the per-device training batch size with the trainer's own step and set
            ``args.per_device_train_batch_size`` to the recommended size.
        guard: recover from out-of-memory errors inside ``training_step``.
        headroom: the share of the largest size that fits the size set leaves unused (0: the
            largest size that fits).
        sample: a batch (or a function ``n -> batch``) to search with; default the longest
            rows of ``train_dataset`` where their lengths are at hand (else its first rows)
            collated by the trainer's collator. Pass the worst case where batches differ in
            another way.
        min_batch: the smallest micro-batch the guard may run (and the smallest size searched).
        reduction: how the loss reduces over a batch, for a loss autobatch cannot tell by
            itself (one that does not use ``num_items_in_batch`` and is not a mean it knows,
            see the module documentation): ``"mean"`` (micro-batches weighted by their share
            of the labels that are not ``-100``, as the ``Trainer`` counts them, or of
            ``items``) or ``"sum"`` (micro-batches added). Default: found out per micro-batch.
        items: with ``reduction="mean"``, a function of a batch returning how many items its
            loss averages over (e.g. ``lambda b: len(b["input_ids"])`` for a mean over rows).
        **search_options: passed to :func:`autobatch.search_batch_size` (``max_batch``,
            ``multiple_of``, ``steps_per_trial``, ``plan``, ``cache``, ...); ``max_batch``
            defaults to the length of the training dataset.
    """
    for name, value in (("find", find), ("guard", guard)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if reduction not in (None, "mean", "sum"):
        raise ValueError(f"reduction must be None, 'mean' or 'sum', got {reduction!r}")
    if items is not None and not callable(items):
        raise TypeError(f"items must be a function of a batch, got {items!r}")
    if items is not None and reduction != "mean":
        raise ValueError(
            "items= counts what a mean loss averages over: pass it with reduction='mean'"
        )
    for reserved in ("step_fn", "loss_fn", "train", "scaler", "headroom", "min_batch"):
        if reserved in search_options:
            raise TypeError(
                f"autobatch_trainer sets {reserved}= itself (the trainer's own step); remove it"
            )
    if not (callable(getattr(trainer, "training_step", None)) and hasattr(trainer, "args")):
        raise TypeError(f"autobatch_trainer takes a transformers.Trainer, got {trainer!r}")
    _check_supported(trainer)
    original = trainer.training_step
    if isinstance(original, GuardedTrainingStep):
        original = original.original  # prepared twice: search and guard the trainer's own step
    if find:
        result = _find(trainer, original, headroom, sample, min_batch, search_options)
        _RESULTS[trainer] = result
        trainer.args.per_device_train_batch_size = result.batch_size
        trainer._train_batch_size = trainer.args.train_batch_size  # what train() builds with
        if trainer.is_world_process_zero():  # as the Trainer's own messages
            logger.warning(  # shown with no logging set up
                "autobatch_trainer set per_device_train_batch_size to %d (the largest that fits "
                "is %d; %d trials on %s)", result.batch_size, result.max_batch_size,
                len(result.trials), result.device,
            )
    if guard:
        Patch(trainer, "training_step",
                      GuardedTrainingStep(trainer, original, min_batch, reduction, items))
    return trainer


def search_result(trainer: Any) -> SearchResult | None:
    """The record of the search ``autobatch_trainer(trainer, find=True)`` ran, else ``None``."""
    return _RESULTS.get(trainer)


def recovery_stats(trainer: Any) -> RecoveryStats:
    """What the guard of ``trainer`` did (empty statistics without one)."""
    step = getattr(trainer, "training_step", None)
    return step.stats if isinstance(step, GuardedTrainingStep) else RecoveryStats()


def _check_supported(trainer: Any) -> None:
    args = trainer.args
    reasons = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        reasons.append("DeepSpeed")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        reasons.append("FSDP")
    if getattr(args, "world_size", 1) > 1:
        reasons.append(f"{args.world_size} processes")
    if getattr(args, "n_gpu", 1) > 1:
        reasons.append(f"DataParallel over {args.n_gpu} GPUs")
    if getattr(trainer, "is_model_parallel", False):
        reasons.append("a model spread over several devices")
    parallel = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if parallel is not None and any(
        getattr(parallel, flag, False) for flag in ("cp_enabled", "sp_enabled", "tp_enabled")
    ):
        reasons.append("context, sequence or tensor parallelism")
    if reasons:
        raise AutobatchError(
            f"autobatch_trainer supports one process on one device; this trainer uses "
            f"{', '.join(reasons)}, whose collectives a rank that splits its batch (or "
            "searches alone) would not join. Use autobatch.retry_on_oom on your own step "
            "under torchrun (README, 'Multiple GPUs'), or train on one device"
        )
    optim = str(getattr(args.optim, "value", args.optim)).lower()
    if any(name in optim for name in _STEPS_IN_BACKWARD):
        raise AutobatchError(
            f"optim={args.optim!r} updates the parameters inside backward, so a micro-batch "
            "would apply its own update: autobatch_trainer cannot split its batches or search "
            "with it. Use another optimizer"
        )


# Finding ------------------------------------------------------------------------------------


def _sample(trainer: Any) -> tuple[Any, int | None]:
    """A batch of the training dataset's longest rows where their lengths can be had cheaply
    (:func:`_row_lengths`), else of its first rows, collated as the trainer's dataloader does
    (unused columns removed); and the dataset's length."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise AutobatchError(
            "autobatch_trainer(find=True) needs trainer.train_dataset to take a sample from; "
            "pass sample= (a batch), or find=False"
        )
    lengths = _row_lengths(trainer, dataset)  # (before the length column is removed)
    collate = trainer.data_collator
    if hasattr(dataset, "column_names") and hasattr(trainer, "_remove_unused_columns"):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    elif hasattr(trainer, "_get_collator_with_removed_columns"):
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    rows = trainer.args.per_device_train_batch_size
    size = _common.dataset_length(dataset)
    if lengths is not None and len(lengths) == size:
        chosen = _common.longest_rows(lengths, rows)
        logger.info(
            "autobatch_trainer searches with the %d longest rows of train_dataset (%d long; "
            "its first rows are at most %d)", len(chosen), lengths[chosen[0]],
            max(lengths[:rows]),
        )
        return collate([dataset[i] for i in chosen]), size
    examples = _common.first_examples(dataset, rows)
    seen = [n for n in (_length(e, _input_name(trainer)) for e in examples) if n is not None]
    if len(set(seen)) > 1 and trainer.is_world_process_zero():
        logger.warning(
            "autobatch_trainer searched with the first %d rows of train_dataset, whose lengths "
            "differ (%d to %d), and could not find its longest rows cheaply: longer rows may "
            "not fit at the size it finds. Give the lengths (a %r column, or "
            "train_sampling_strategy='group_by_length'), or pass sample= (a batch of the "
            "longest rows)", len(examples), min(seen), max(seen), trainer.args.length_column_name,
        )
    return collate(examples), size


def _input_name(trainer: Any) -> str:
    """The input whose length is a row's length, as the ``Trainer``'s length grouping reads it."""
    processing = getattr(trainer, "processing_class", None)
    names = getattr(processing, "model_input_names", None)
    return str(names[0]) if names else "input_ids"


def _length(example: Any, name: str) -> int | None:
    value = example.get(name) if isinstance(example, Mapping) else None
    try:
        return None if value is None else len(value)
    except TypeError:  # a number, a 0-d tensor
        return None


def _row_lengths(trainer: Any, dataset: Any) -> list[int] | None:
    """Each row's length where it costs no more than the ``Trainer`` pays itself: a length
    column (``args.length_column_name``), an in-memory list of rows, or the lengths the
    ``Trainer``'s length-grouped sampling reads anyway; else ``None``."""
    args = trainer.args
    column = getattr(args, "length_column_name", "length")
    if column in (getattr(dataset, "column_names", None) or ()):
        return [int(n) for n in dataset[column]]
    grouped = getattr(args, "train_sampling_strategy", None) in ("group_by_length",
                                                                 "batch_rebalance")
    if not (isinstance(dataset, (list, tuple)) or (grouped and _common.dataset_length(dataset))):
        return None
    name = _input_name(trainer)
    lengths = [_length(dataset[i], name) for i in range(len(dataset))]
    return None if any(n is None for n in lengths) else [int(n) for n in lengths if n is not None]


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer (Accelerate wraps it once ``train()`` ran)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


@contextlib.contextmanager
def _mixed_precision(trainer: Any, model: nn.Module) -> Iterator[None]:
    """The model's forward under the accelerator's autocast, outputs in float32, as
    ``accelerator.prepare`` makes it for training (nothing to do once prepared, or without
    mixed precision)."""
    accelerator = trainer.accelerator
    if not getattr(accelerator, "native_amp", False) or hasattr(model, "_original_forward"):
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    patch = Patch(model, "forward", convert_outputs_to_fp32(autocast_forward))
    try:
        yield
    finally:
        patch.undo()


@contextlib.contextmanager
def _checkpointing(trainer: Any, model: nn.Module) -> Iterator[None]:
    """Activation checkpointing on, as ``train()`` turns it on where ``args`` ask for it (and off
    again afterwards, unless it was on already)."""
    args = trainer.args
    enable = getattr(model, "activation_checkpointing_enable", None)
    if not getattr(args, "activation_checkpointing", False) or enable is None or getattr(
        model, "is_activation_checkpointing", False
    ):
        yield
        return
    options = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    every_n_layers = options.pop("every_n_layers", 1)
    offload = options.pop("offload", False)
    enable(activation_checkpointing_kwargs=options or None, every_n_layers=every_n_layers,
           offload=offload)
    try:
        yield
    finally:
        model.activation_checkpointing_disable()  # type: ignore[operator]


def _trial_step(
    trainer: Any, original: Callable[..., Any], optimizer: torch.optim.Optimizer
) -> Callable[[nn.Module, Any], None]:
    """One optimizer step as ``Trainer`` takes it: zero_grad, its ``training_step`` (loss
    normalised by the batch's items where it does so), unscale and clip, step."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    norm = trainer.args.max_grad_norm

    def step(model: nn.Module, batch: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        items = trainer._get_num_items_in_batch([batch], trainer.args.device)
        original(model, batch, items)
        if norm is not None and norm > 0:
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), norm)
        _common.optimizer_step(optimizer, scaler)

    return step


def _find(
    trainer: Any,
    original: Callable[..., Any],
    headroom: float,
    sample: Any,
    min_batch: int,
    options: dict[str, Any],
) -> SearchResult:
    model = trainer.model
    created = trainer.optimizer is None
    # one batch a step
    accumulation = Patch(trainer, "current_gradient_accumulation_steps", 1)
    try:
        with _common.preserved_rng():
            if created:
                trainer.create_optimizer()
            optimizer = _raw(trainer.optimizer)
            length = None
            if sample is None:
                sample, length = _sample(trainer)
            if length is not None:
                options = {"max_batch": max(length, min_batch), **options}
            with _mixed_precision(trainer, model), _checkpointing(trainer, model):
                return search_batch_size(
                    model,
                    sample,
                    optimizer,
                    step_fn=_trial_step(trainer, original, optimizer),
                    scaler=getattr(trainer.accelerator, "scaler", None),
                    headroom=headroom,
                    min_batch=min_batch,
                    **options,
                )
    finally:
        accumulation.undo()
        if created:
            trainer.optimizer = None  # train() creates it, as it would have


# The guard ------------------------------------------------------------------------------------


class GuardedTrainingStep:
    """``trainer.training_step`` made to recover from OOM (installed by
    :func:`autobatch_trainer`); ``original`` is the trainer's own, ``stats`` what happened."""

    def __init__(
        self,
        trainer: Any,
        original: Callable[..., Any],
        min_batch: int,
        reduction: str | None = None,
        items: Callable[[Any], Any] | None = None,
    ) -> None:
        self._trainer = weakref.ref(trainer)
        self.original = original
        self.min_batch = min_batch
        self.reduction = reduction
        self._whole: Any = None
        self._weighing = _trainer_loss.Weighing(trainer, user_name(original))
        self._retrying = self._retrying_step(trainer, reduction, items)

    @property
    def stats(self) -> RecoveryStats:
        """OOMs recovered and micro-batch sizes."""
        return self._retrying.stats

    def __repr__(self) -> str:
        return f"<autobatch guarded training_step of {self.original!r}>"

    def __call__(
        self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        self._whole = inputs
        try:
            result: torch.Tensor = self._retrying(model, inputs, num_items_in_batch)
        finally:
            self._whole = None
        return result

    def _retrying_step(
        self, trainer: Any, reduction: str | None, items: Callable[[Any], Any] | None
    ) -> RetryingStep[..., Any]:
        """The trainer's step through :func:`autobatch.retry_on_oom`: weighted by the engine
        where ``reduction`` was declared, else by :class:`~._trainer_loss.Weighing`, inside
        ``compute_loss`` (pieces that simply add for the engine)."""
        original = self.original

        def training_step(model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
            whole = self._whole
            if reduction is not None or whole is None or inputs is whole:
                return original(model, inputs, num_items_in_batch)
            with self._weighing.piece(inputs, whole):
                return original(model, inputs, num_items_in_batch)

        if reduction == "mean" and items is None:
            items = _trainer_loss.trainer_counter(trainer)
        return retry_on_oom(
            policy="accumulate",
            model=trainer.model,
            reduction="mean" if reduction == "mean" else "sum",
            items=items if reduction == "mean" else None,
            batch_arg="inputs",
            min_batch=self.min_batch,
            device=trainer.args.device,
        )(named_after(training_step, original))  # messages name the trainer's own step
