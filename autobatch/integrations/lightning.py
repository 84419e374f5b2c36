"""Lightning: the batch size found before training, and training batches that survive OOM.

>>> import lightning.pytorch as pl
>>> from autobatch.integrations.lightning import AutobatchCallback
>>> trainer = pl.Trainer(callbacks=[AutobatchCallback()], logger=False)  # doctest: +SKIP
>>> AutobatchCallback(headroom=0.1)
AutobatchCallback(find=True, guard=True, batch_arg='batch_size', headroom=0.1)

:class:`AutobatchCallback` does two things (each can be turned off):

- ``find``: at the start of ``fit`` (where Lightning's own ``BatchSizeFinder`` works), the
  largest batch that fits is searched with :func:`autobatch.search_batch_size`, running the
  LightningModule's own ``training_step``, its ``backward``, the optimizer it configured and the
  precision plugin's autocast and GradScaler; the recommended size (``headroom`` of the largest
  size left unused) is set where Lightning's finder sets it (``model.<batch_arg>``,
  ``model.hparams.<batch_arg>`` or the datamodule's), so the train dataloader is built with it.
  Weights, optimizer state, gradients, random streams and the trainer's counters are left as
  they were (``self.log`` is silenced during the trials).
- ``guard``: the module's ``training_step`` is replaced, for the duration of ``fit``, by one that
  runs the batch and its backward itself through :func:`autobatch.retry_on_oom` (a function
  that only computes gradients: ``policy="accumulate"`` with ``model=``). On an OOM the batch is
  re-run in micro-batches whose gradients are weighted and summed, so after the step ``.grad``
  holds the whole batch's gradient; Lightning then runs its backward on a loss without a graph
  (nothing to add), clips, unscales and steps once, as for the unsplit batch. The loss it
  returns and every value logged with ``self.log`` are the whole batch's (the micro-batches'
  values joined as their ``reduce_fx`` joins steps), logged once per batch. The recovery
  engine's ledger puts the torchmetrics metrics the module holds back as they were after an
  attempt that ran out of memory, and after a batch that starts over, so each row updates them
  once (a metric object logged per step shows its last micro-batch's value; its epoch value is
  the whole epoch's).

Supported: automatic optimization on one device (the ``"auto"`` single-device strategy), with
the precisions ``32-true``, ``64-true``, ``16-true``, ``bf16-true``, ``bf16-mixed`` and
``16-mixed`` (GradScaler), gradient clipping and ``accumulate_grad_batches``. Refused with an
:class:`~autobatch.AutobatchError` when ``fit`` starts: multi-process and sharding strategies
(DDP, FSDP, DeepSpeed: a rank that splits its batch would run collectives the others do not),
other precision plugins, and manual optimization (its ``training_step`` steps optimizers itself
through Lightning's wrappers, which count steps and run hooks; decorate the function that
computes your gradients with ``retry_on_oom(policy="accumulate", model=self)`` instead, see the
README). ``docs/exactness_matrix.md`` lists each feature tested against the unguarded fit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from autobatch import AutobatchError, RecoveryStats, SearchResult, retry_on_oom, search_batch_size
from autobatch._log import get_logger, named_after
from autobatch._recovery._patches import Patch
from autobatch._recovery._results import _combine
from autobatch._sizing._workload import DEFAULT_HEADROOM
from autobatch.integrations import _common

try:  # the unified package first, the standalone one where it is the only one installed
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import (
        DoublePrecision,
        HalfPrecision,
        MixedPrecision,
        Precision,
    )
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError:  # pragma: no cover - exercised only without the unified package
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import (
        DoublePrecision,
        HalfPrecision,
        MixedPrecision,
        Precision,
    )
    from pytorch_lightning.strategies import ParallelStrategy
    from pytorch_lightning.utilities.parsing import lightning_hasattr, lightning_setattr
    from pytorch_lightning.utilities.rank_zero import rank_zero_only
    from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature

__all__ = ["AutobatchCallback"]

logger = get_logger("integrations.lightning")


@rank_zero_only  # type: ignore[untyped-decorator]
def _announce(message: str, *args: Any) -> None:
    """What the callback chose, on Lightning's global rank 0 only (as its own rank-zero
    messages): a WARNING of the ``autobatch`` logger, shown with no logging set up."""
    logger.warning(message, *args)

#: The precision plugins whose backward is a plain ``module.backward(loss)`` (with GradScaler's
#: ``scale`` first under ``16-mixed``): the guard can run that backward per micro-batch itself.
_PRECISIONS = (Precision, DoublePrecision, HalfPrecision, MixedPrecision)

_REDUCE_ADD = ("sum", torch.sum)
_REDUCE_MEAN = ("mean", "avg", torch.mean)
_REDUCE_MAX = ("max", torch.max)
_REDUCE_MIN = ("min", torch.min)


class AutobatchCallback(pl.Callback):  # type: ignore[misc]
    """Find the batch size before training, and recover training batches from OOM.

    ``Trainer(callbacks=[AutobatchCallback()])``: see the module documentation for what each
    part does and what is supported. After ``fit``, ``result`` holds the search's record
    (:class:`autobatch.SearchResult`), ``batch_size`` the size set, and ``stats`` the recovery
    statistics (:class:`autobatch.RecoveryStats`). Both are logged as metrics through the
    trainer's loggers: ``autobatch/batch_size`` and ``autobatch/max_batch_size`` once, and
    ``autobatch/ooms`` and ``autobatch/micro_batch_size`` after each batch that recovered.
    The size set, and each recovered OOM (naming the module's ``training_step``), are also
    WARNINGs of the ``autobatch`` logger, shown once on Lightning's global rank 0 with no
    logging set up (``docs/logging.md``).

    Args:
        find: search the batch size at the start of ``fit`` and set it.
        guard: recover training batches from out-of-memory errors.
        batch_arg: the attribute holding the batch size, as for Lightning's finder: on the
            LightningModule, its ``hparams``, or the datamodule.
        headroom: the share of the largest size that fits the size set leaves unused (0: the
            largest size that fits).
        sample: a batch (or a function ``n -> batch``) to search with; default the first rows of
            the train dataloader's dataset, collated by its ``collate_fn`` and moved to the
            device by the module's transfer hooks. Pass the worst case where batches differ
            (the longest sequences).
        items: for a loss averaged over something other than rows (tokens): a function of a
            batch returning how many items its loss averages over (as for ``retry_on_oom``);
            micro-batches and their logged means are weighted by their items.
        reduction: ``"mean"`` (the loss is a mean over the batch) or ``"sum"`` (a sum: the
            micro-batches add).
        min_batch: the smallest micro-batch the guard may run (and the smallest size searched).
        **search_options: passed to :func:`autobatch.search_batch_size` (``max_batch``,
            ``multiple_of``, ``steps_per_trial``, ``plan``, ``cache``, ...); ``max_batch``
            defaults to the length of the training dataset.
    """

    def __init__(
        self,
        find: bool = True,
        guard: bool = True,
        batch_arg: str = "batch_size",
        headroom: float = DEFAULT_HEADROOM,
        *,
        sample: Any = None,
        items: Callable[[Any], Any] | None = None,
        reduction: str = "mean",
        min_batch: int = 1,
        **search_options: Any,
    ) -> None:
        super().__init__()
        for name, value in (("find", find), ("guard", guard)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if not isinstance(batch_arg, str) or not batch_arg:
            raise TypeError(f"batch_arg must be an attribute name (str), got {batch_arg!r}")
        if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not (
            0 <= headroom < 1
        ):
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if items is not None and not callable(items):
            raise TypeError(f"items must be a function of a batch, got {items!r}")
        for reserved in ("step_fn", "loss_fn", "train", "scaler", "headroom", "min_batch"):
            if reserved in search_options:
                raise TypeError(
                    f"AutobatchCallback sets {reserved}= itself (the module's own step); "
                    "remove it from the options"
                )
        self.find = find
        self.guard = guard
        self.batch_arg = batch_arg
        self.headroom = float(headroom)
        self.sample = sample
        self.items = items
        self.reduction = reduction
        self.min_batch = min_batch
        self.search_options = search_options
        self.result: SearchResult | None = None
        self.batch_size: int | None = None
        self._guard: _Guard | None = None
        self._stats = RecoveryStats()

    @property
    def stats(self) -> RecoveryStats:
        """What the guard did: OOMs recovered, micro-batch sizes (empty before ``fit``)."""
        return self._guard.stats if self._guard is not None else self._stats

    def __repr__(self) -> str:
        return (
            f"AutobatchCallback(find={self.find}, guard={self.guard}, "
            f"batch_arg={self.batch_arg!r}, headroom={self.headroom:g})"
        )

    # Lightning's hooks ----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if stage != "fit" or not (self.find or self.guard):
            return
        _check_supported(trainer, pl_module)
        if self.find:
            if not lightning_hasattr(pl_module, self.batch_arg):
                raise AutobatchError(
                    f"AutobatchCallback(find=True) sets the batch size it finds in "
                    f"{self.batch_arg!r}, which is neither an attribute of the LightningModule, "
                    "of its hparams, nor of the datamodule; add it there and build the train "
                    "dataloader with it (as for Lightning's BatchSizeFinder), pass "
                    "batch_arg= with its name, or find=False"
                )
            source = getattr(trainer.fit_loop, "_data_source", None)
            if source is not None and not source.is_module():
                raise AutobatchError(
                    "AutobatchCallback(find=True) cannot change the batch size of dataloaders "
                    "passed to fit() directly; return them from train_dataloader() of the "
                    "LightningModule or a LightningDataModule, or pass find=False"
                )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.find:
            self._find(trainer, pl_module)
        if self.guard:
            self._remove_guard()
            self._guard = _Guard(self, trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        self._remove_guard()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove_guard()

    def _remove_guard(self) -> None:
        if self._guard is not None:
            self._stats = self._guard.stats
            self._guard.remove()
            self._guard = None

    # Finding ----------------------------------------------------------------------------------

    def _find(self, trainer: Any, module: Any) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = None  # Lightning's stand-in when configure_optimizers returns none
        options = dict(self.search_options)
        with _common.preserved_rng(), _silenced_log(module):
            sample, length = (
                (self.sample, None) if self.sample is not None else _sample(trainer, module)
            )
            if length is not None:
                options.setdefault("max_batch", max(length, self.min_batch))
            step = _trial_step(trainer, module, optimizer)
            self.result = search_batch_size(
                module,
                sample,
                optimizer,
                step_fn=step,
                scaler=_scaler(trainer),
                headroom=self.headroom,
                min_batch=self.min_batch,
                **options,
            )
        self.batch_size = self.result.batch_size
        lightning_setattr(module, self.batch_arg, self.batch_size)
        loop = trainer.fit_loop
        if getattr(loop, "_combined_loader", None) is not None:
            loop._combined_loader = None  # built already: rebuilt with the new size
        _announce(
            "AutobatchCallback set the batch size to %d in %r (the largest that fits is %d; "
            "%d trials on %s)", self.batch_size, self.batch_arg, self.result.max_batch_size,
            len(self.result.trials), self.result.device,
        )
        _log_metrics(trainer, {
            "autobatch/batch_size": float(self.batch_size),
            "autobatch/max_batch_size": float(self.result.max_batch_size),
        })


def _check_supported(trainer: Any, module: Any) -> None:
    """Refuse what the callback cannot make exact, before anything runs."""
    strategy = trainer.strategy
    if isinstance(strategy, ParallelStrategy) or trainer.world_size > 1:
        raise AutobatchError(
            f"AutobatchCallback supports one device; the {type(strategy).__name__} runs "
            "collectives in every step, which a rank that splits its batch (or searches alone) "
            "would not join. Use the single-device strategy, or autobatch.retry_on_oom on your "
            "own step under torchrun (README, 'Multiple GPUs')"
        )
    if not module.automatic_optimization:
        raise AutobatchError(
            "AutobatchCallback supports automatic optimization only: under manual "
            "optimization training_step steps the optimizers itself through Lightning's "
            "wrappers, which count steps and run hooks that a trial or a micro-batch would "
            "repeat. Decorate the function that computes your gradients instead, "
            "retry_on_oom(policy='accumulate', model=self), and step after it (README, "
            "'Lightning')"
        )
    plugin = trainer.precision_plugin
    if type(plugin) not in _PRECISIONS:
        raise AutobatchError(
            f"AutobatchCallback does not support the {type(plugin).__name__} precision plugin "
            "(supported: 32-true, 64-true, 16-true, bf16-true, 16-mixed, bf16-mixed): its "
            "backward may do more than module.backward(loss), which the guard runs per "
            "micro-batch"
        )
    if strategy.handles_gradient_accumulation:
        raise AutobatchError(
            f"{type(strategy).__name__} accumulates gradients itself; AutobatchCallback "
            "cannot split its batches"
        )


def _scaler(trainer: Any) -> torch.amp.GradScaler | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _takes_batch_idx(module: Any) -> bool:
    return bool(is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2))


def _sample(trainer: Any, module: Any) -> tuple[Any, int | None]:
    """The first rows of the train dataloader's dataset as one batch on the device, and the
    dataset's length (a cap for the search)."""
    source = trainer.fit_loop._data_source
    loader = source.dataloader()
    if isinstance(loader, (Mapping, list, tuple)):
        raise AutobatchError(
            "AutobatchCallback(find=True) needs one train dataloader to take a sample from; "
            "pass sample= (a batch) for several"
        )
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    rows = getattr(loader, "batch_size", None)
    if dataset is not None and collate is not None and rows is not None:
        batch = _common.first_rows(dataset, collate, rows)
    else:  # no automatic batching (a sampler of whole batches): the loader's first batch
        batch = next(iter(loader))
    batch = trainer.strategy.batch_to_device(batch)
    return batch, (_common.dataset_length(dataset) if dataset is not None else None)


@contextlib.contextmanager
def _silenced_log(module: Any) -> Iterator[None]:
    """``self.log`` does nothing inside (trials are not training steps)."""
    patch = Patch(module, "log", _ignore)
    try:
        yield
    finally:
        patch.undo()


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, a mapping with ``"loss"``, or
    None), as Lightning's automatic optimization reads it."""
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
    raise AutobatchError(
        "training_step must return a loss tensor, a mapping with a 'loss' tensor, or None "
        f"under automatic optimization; got {type(output).__name__}"
    )


def _autocast_off(module: Any) -> contextlib.AbstractContextManager[Any]:
    """Backward outside autocast (the guard runs it inside the precision plugin's step
    context, where Lightning's own backward would run after it)."""
    device = module.device.type if isinstance(module.device, torch.device) else "cpu"
    return torch.autocast(device_type=device, enabled=False)


def _backward(trainer: Any, module: Any, loss: torch.Tensor) -> None:
    """What Lightning's automatic optimization does with a step's loss up to ``.grad``: divide
    by ``accumulate_grad_batches``, scale (GradScaler, ``16-mixed``), ``module.backward``."""
    loss = loss / trainer.accumulate_grad_batches
    scaler = _scaler(trainer)
    if scaler is not None:
        loss = scaler.scale(loss)
    with _autocast_off(module):
        module.backward(loss)


def _clip(trainer: Any, module: Any, optimizer: torch.optim.Optimizer) -> None:
    """Gradient clipping as configured on the trainer (its memory counts in a trial)."""
    value = trainer.gradient_clip_val
    if not value:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if trainer.gradient_clip_algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    else:
        torch.nn.utils.clip_grad_norm_(params, value)


def _trial_step(
    trainer: Any, module: Any, optimizer: torch.optim.Optimizer | None
) -> Callable[[Any, Any], None]:
    """One training step as Lightning runs it, without its hooks: zero_grad, ``training_step``
    in the precision plugin's context, backward, unscale and clip, optimizer step."""
    plugin = trainer.precision_plugin
    scaler = _scaler(trainer)
    with_index = _takes_batch_idx(module)

    def step(model: Any, batch: Any) -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            module.zero_grad(set_to_none=True)
        with plugin.train_step_context():
            output = module.training_step(batch, 0) if with_index else module.training_step(batch)
        loss = _loss_of(output)
        del output
        if loss is None or optimizer is None:
            return
        _backward(trainer, module, loss)
        del loss
        if scaler is not None:
            scaler.unscale_(optimizer)
        _clip(trainer, module, optimizer)
        _common.optimizer_step(optimizer, scaler)

    return step


def _log_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    for each in trainer.loggers:
        each.log_metrics(metrics, step=trainer.global_step)


# The guard ------------------------------------------------------------------------------------


class _Piece:
    """What one micro-batch of a training step left: its rows and items, what ``training_step``
    returned (detached), and what it logged. Compared by identity, so the engine hands the
    pieces back as a list rather than joining them."""

    __slots__ = ("count", "logged", "output", "rows")

    def __init__(self, rows: int, count: float, output: Any, logged: list[_Logged]) -> None:
        self.rows, self.count, self.output, self.logged = rows, count, output, logged


class _Logged:
    __slots__ = ("args", "kwargs", "name", "value")

    def __init__(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.name, self.value, self.args, self.kwargs = name, value, args, kwargs


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _Guard:
    """The module's ``training_step`` replaced, while ``fit`` runs, by one that recovers from
    OOM (see the module documentation)."""

    def __init__(self, callback: AutobatchCallback, trainer: Any, module: Any) -> None:
        self.callback = callback
        self.trainer = trainer
        self.module = module
        self.original = module.training_step
        self.reduction = callback.reduction
        self.items = callback.items
        self.skip_zero: Patch | None = None

        def piece(batch: Any, *args: Any, **kwargs: Any) -> _Piece:
            return self._piece(batch, *args, **kwargs)

        self.step = retry_on_oom(
            policy="accumulate",
            model=module,
            reduction="sum" if self.reduction == "sum" else "mean",
            items=self.items if self.reduction == "mean" else None,
            min_batch=callback.min_batch,
            device=module.device,
        )(named_after(piece, self.original))  # messages name the module's training_step

        @functools.wraps(self.original)  # Lightning reads the signature (is batch_idx taken?)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._guarded(*args, **kwargs)

        self.patch = Patch(module, "training_step", training_step)

    @property
    def stats(self) -> RecoveryStats:
        return self.step.stats

    def remove(self) -> None:
        self.patch.undo()
        if self.skip_zero is not None:
            self.skip_zero.undo()

    def _guarded(self, *args: Any, **kwargs: Any) -> Any:
        trainer, module = self.trainer, self.module
        if self.skip_zero is not None:  # Lightning did not zero after the last batch: stop
            self.skip_zero.undo()
            self.skip_zero = None
        if trainer.fit_loop._skip_backward or not trainer.training:
            return self.original(*args, **kwargs)  # no backward to run (SWA's extra pass)
        batch_idx = args[1] if len(args) > 1 else trainer.fit_loop.epoch_loop.batch_idx
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # Lightning zeroes the gradients after training_step and before its backward; the
            # guard's backward runs inside training_step, so zero them first, the same way.
            optimizer = trainer.optimizers[0]
            module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            self.skip_zero = Patch(module, "optimizer_zero_grad", self._zeroed)
        ooms = self.step.stats.ooms
        result: Any = self.step(*args, **kwargs)
        pieces = result if isinstance(result, list) else [result]
        if not all(isinstance(p, _Piece) for p in pieces):  # pragma: no cover - defensive
            raise AutobatchError("the guarded training_step lost track of its micro-batches")
        output = self._join(pieces)
        stats = self.step.stats
        if stats.ooms > ooms:
            _log_metrics(trainer, {
                "autobatch/ooms": float(stats.ooms),
                "autobatch/micro_batch_size": float(
                    stats.micro_batch_size or _common.rows_of(args[0])
                ),
            })
        return output

    def _zeroed(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's zero_grad right after the guarded step: done already, before it."""
        if self.skip_zero is not None:
            self.skip_zero.undo()
            self.skip_zero = None

    def _piece(self, batch: Any, *args: Any, **kwargs: Any) -> _Piece:
        """One micro-batch (or the whole batch): training_step, its logs recorded, and its
        backward as Lightning would run it."""
        logged: list[_Logged] = []

        def record(name: str, value: Any, *rest: Any, **options: Any) -> None:
            logged.append(_Logged(name, _detached(value), rest, options))

        patch = Patch(self.module, "log", record)
        try:
            output = self.original(batch, *args, **kwargs)
        finally:
            patch.undo()
        loss = _loss_of(output)
        if loss is not None:
            _backward(self.trainer, self.module, loss)
        del loss
        rows = _common.rows_of(batch)
        count = float(rows)
        if self.items is not None and self.reduction == "mean":
            counted = self.items(batch)
            count = float(counted.item() if isinstance(counted, torch.Tensor) else counted)
        return _Piece(rows, count, _detached(output), logged)

    # Joining the pieces -----------------------------------------------------------------------

    def _join(self, pieces: list[_Piece]) -> Any:
        counts, rows = [p.count for p in pieces], [p.rows for p in pieces]
        weights = _common.shares(counts, rows, self.reduction)
        self._replay_logs(pieces, weights)
        outputs = [p.output for p in pieces]
        if all(o is None for o in outputs):
            return None
        if any(o is None for o in outputs):
            raise AutobatchError(
                "training_step returned None for some micro-batches of a batch and a loss for "
                "others: the batch cannot be both skipped and trained"
            )
        losses = [_loss_of(o) for o in outputs]
        total = _weighted([loss for loss in losses if loss is not None], weights)
        loss = total.detach().requires_grad_(True)  # Lightning's backward adds nothing
        first = outputs[0]
        if isinstance(first, torch.Tensor):
            return loss
        extras: dict[str, Any] = {}
        for key in first:
            if key == "loss":
                continue
            values = [o[key] for o in outputs]
            extras[key] = values[0] if len(pieces) == 1 else _combine(
                [(p.rows, v, w) for p, v, w in zip(pieces, values, weights, strict=True)]
            )
        return {"loss": loss, **extras}

    def _replay_logs(self, pieces: list[_Piece], weights: list[float]) -> None:
        """Log what the pieces logged, once: as it was for a batch that ran whole, else each
        name's values joined as its ``reduce_fx`` joins steps (a weighted mean, a sum, a max
        or a min), with ``batch_size=`` summed where given."""
        log = self.module.log
        if len(pieces) == 1:
            for entry in pieces[0].logged:
                log(entry.name, entry.value, *entry.args, **entry.kwargs)
            return
        names: dict[str, list[tuple[float, _Logged]]] = {}
        for piece, weight in zip(pieces, weights, strict=True):
            for entry in piece.logged:
                names.setdefault(entry.name, []).append((weight, entry))
        for name, entries in names.items():
            last = entries[-1][1]
            kwargs = dict(last.kwargs)
            if "batch_size" in kwargs and kwargs["batch_size"] is not None:
                kwargs["batch_size"] = sum(int(e.kwargs.get("batch_size") or 0) for _, e in entries)
            values = [e.value for _, e in entries]
            if not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
                log(name, last.value, *last.args, **kwargs)  # a Metric object: it accumulates
                continue
            reduce_fx = kwargs.get("reduce_fx", "mean")
            log(name, _reduce(name, reduce_fx, values, [w for w, _ in entries]), *last.args,
                **kwargs)


def _weighted(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = values[0].detach() * weights[0]
    for value, weight in zip(values[1:], weights[1:], strict=True):
        total = total + value.detach() * weight
    return total


def _reduce(name: str, reduce_fx: Any, values: list[Any], weights: list[float]) -> Any:
    tensors = [torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor)
               else v.detach() for v in values]
    if reduce_fx in _REDUCE_MEAN:
        scale = sum(weights)
        return _weighted(tensors, [w / scale for w in weights]) if scale > 0 else tensors[-1]
    if reduce_fx in _REDUCE_ADD:
        return _weighted(tensors, [1.0] * len(tensors))
    if reduce_fx in _REDUCE_MAX:
        return functools.reduce(torch.maximum, tensors)
    if reduce_fx in _REDUCE_MIN:
        return functools.reduce(torch.minimum, tensors)
    raise AutobatchError(
        f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}) ran once per micro-batch of a batch "
        "split after an OOM; autobatch joins the values of 'mean', 'sum', 'max' and 'min' "
        "only. Log this value outside training_step, or with one of those"
    )

