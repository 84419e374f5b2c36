"""Front-end 1: the decorator, :func:`retry_on_oom`."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

from torch import nn

from autobatch._memory._backends import DeviceLike
from autobatch._recovery._engine import _Engine
from autobatch._recovery._options import (
    AdditiveOption,
    ItemsFn,
    OptimizerOption,
    Policy,
    RecoveryOptions,
    Reduction,
    SchedulerOption,
)
from autobatch._recovery._records import RecoveryStats
from autobatch._recovery._sizes import _Sizes

P = ParamSpec("P")
R = TypeVar("R")


class RetryingStep(Generic[P, R]):
    """A step function that recovers from out-of-memory errors; made by :func:`retry_on_oom`.

    Calls behave like the wrapped function's. ``stats`` says what happened; ``reset()`` forgets
    the learned sizes (for a new model or device).

    >>> step = retry_on_oom(lambda batch: batch.sum())
    >>> import torch
    >>> float(step(torch.ones(4))), step.stats.batches
    (4.0, 1)
    """

    def __init__(self, fn: Callable[P, R], options: RecoveryOptions) -> None:
        functools.update_wrapper(self, fn)
        self._engine = _Engine(fn, options)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._engine.run(args, kwargs)  # type: ignore[no-any-return]

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., R]:
        if obj is None:
            return self
        return types.MethodType(self, obj)

    @property
    def options(self) -> RecoveryOptions:
        """The options this step was decorated with."""
        return self._engine.options

    @property
    def stats(self) -> RecoveryStats:
        """OOMs, size changes, the current micro-batch size, and the batches and samples of
        every call of this step."""
        return self._engine.tally.snapshot(batches=self._engine.calls)

    def reset(self) -> None:
        """Forget the learned sizes and the memory model (statistics are kept)."""
        engine = self._engine
        engine.sizes = _Sizes(
            min_batch=engine.options.min_batch,
            grow_after=engine.options.grow_after,
            headroom=engine.options.headroom,
        )
        engine.tally.micro_batch_size = None

    def __repr__(self) -> str:
        return f"<retry_on_oom {self._engine.name} policy={self._engine.policy}>"


@overload
def retry_on_oom(fn: Callable[P, R], /) -> RetryingStep[P, R]: ...


@overload
def retry_on_oom(
    fn: None = None,
    /,
    *,
    optimizer: OptimizerOption = None,
    policy: Policy | None = None,
    reduction: Reduction = "mean",
    batch_arg: str | None = None,
    min_batch: int = 1,
    grow_after: int | None = None,
    scaler: Any = None,
    model: nn.Module | None = None,
    device: DeviceLike = None,
    headroom: float = 0.1,
    sync_ranks: bool = True,
    items: ItemsFn | None = None,
    scheduler: SchedulerOption = None,
    additive: AdditiveOption = None,
) -> Callable[[Callable[P, R]], RetryingStep[P, R]]: ...


def retry_on_oom(
    fn: Callable[P, R] | None = None,
    /,
    *,
    optimizer: OptimizerOption = None,
    policy: Policy | None = None,
    reduction: Reduction = "mean",
    batch_arg: str | None = None,
    min_batch: int = 1,
    grow_after: int | None = None,
    scaler: Any = None,
    model: nn.Module | None = None,
    device: DeviceLike = None,
    headroom: float = 0.1,
    sync_ranks: bool = True,
    items: ItemsFn | None = None,
    scheduler: SchedulerOption = None,
    additive: AdditiveOption = None,
) -> RetryingStep[P, R] | Callable[[Callable[P, R]], RetryingStep[P, R]]:
    """Make a step function survive CUDA out-of-memory by running its batch in smaller pieces.

    Usable bare (``@retry_on_oom``) or with options (``@retry_on_oom(optimizer=opt)``). Piece
    sizes are learned per decorated function and reused from the next call on, so an OOM costs one
    retry once, not every step. See the module documentation for the policies and what the call
    returns when the batch was split.

    >>> import torch
    >>> from autobatch.testing import SimulatedGPU
    >>> model = torch.nn.Linear(256, 256)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> @retry_on_oom(optimizer=opt)
    ... def train_step(x):
    ...     opt.zero_grad()
    ...     loss = model(x).square().mean()
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> with SimulatedGPU("2MiB", adopt=[model]):
    ...     _ = train_step(torch.randn(512, 256))
    >>> train_step.stats.ooms, train_step.stats.micro_batch_size is not None
    (1, True)

    Args:
        fn: the step function (bare form only).
        optimizer: the optimizer the step calls, or a list of every optimizer it calls (each
            stepped once per batch under ``"accumulate"``); enables ``"accumulate"`` and the
            check that an OOM did not leave a partly applied update.
        policy: ``"accumulate"`` (one optimizer step per batch; default with an optimizer) or
            ``"shrink"`` (one step per piece; default without). ``"accumulate"`` with
            ``model=`` and no optimizer: the function only computes gradients (its caller
            steps), and ``.grad`` ends as after an unsplit call.
        reduction: how the step's loss reduces over samples: ``"mean"`` weights each piece by its
            share of the batch, ``"sum"`` adds pieces.
        items: for a loss averaged over something other than rows (tokens): a function of a
            batch returning how many items its loss averages over, e.g. ``lambda b:
            (b["labels"] != -100).sum()``; each piece is then weighted by its share of the
            batch's items (``"mean"`` only).
        batch_arg: the name of the argument holding the batch; default the first positional one
            (``self``/``cls`` skipped).
        min_batch: the smallest piece allowed; an OOM at it raises :class:`BatchSizeError`.
        grow_after: after this many calls without OOM, try a piece twice as large (never past the
            batch); a failed try returns to the last good size and doubles the wait.
        scaler: not needed: every ``torch.amp.GradScaler`` a split step uses has its
            ``unscale_``, ``step`` and ``update`` run once per batch, in the last micro-batch.
            (Giving it makes its state reset after a failed attempt even where none split.)
        scheduler: the LR scheduler(s) the step steps, each stepped once per batch (in the
            last micro-batch) when the batch is split. Any other scheduler stepped in a split
            step is refused before it steps.
        additive: tensors (or modules, for their buffers) the step adds to once per row, such
            as a running sum of the loss times the rows: a split step may add to them in every
            micro-batch (a failed one is undone). Anything else the step writes in place
            outside its module's forward and its optimizer step is refused in a split step.
        model: a module the step runs, watched from the first call on (its buffers rolled
            back after a failed attempt, its parameters' gradients weighted); modules the step
            refers to by name, and modules seen running in the first calls, are watched too.
        device: where memory is measured; default the device of the batch's first tensor.
        headroom: the fraction of the memory model's largest size left unused.
        sync_ranks: under an initialised ``torch.distributed`` process group, keep every rank in
            lockstep: an OOM on one rank makes every rank retry the same batch with the same
            micro-batch size, and ``DistributedDataParallel`` gradients are averaged once per
            optimizer step after all ranks finished their backward (README, "Multiple GPUs").
            ``False`` for independent per-rank jobs.
    """
    options = RecoveryOptions(
        optimizer=optimizer,
        policy=policy,
        reduction=reduction,
        batch_arg=batch_arg,
        min_batch=min_batch,
        grow_after=grow_after,
        scaler=scaler,
        model=model,
        device=device,
        headroom=headroom,
        sync_ranks=sync_ranks,
        items=items,
        scheduler=scheduler,
        additive=additive,
    )

    def decorate(step: Callable[P, R]) -> RetryingStep[P, R]:
        if not callable(step):
            raise TypeError(
                f"retry_on_oom decorates a function, got {type(step).__name__}; pass options "
                "by name, e.g. @retry_on_oom(optimizer=opt)"
            )
        return RetryingStep(step, options)

    return decorate if fn is None else decorate(fn)
