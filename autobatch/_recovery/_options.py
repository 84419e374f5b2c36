"""The options of :func:`~autobatch.retry_on_oom`, validated in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from autobatch._memory._backends import DeviceLike
from autobatch._validate import check_fraction, check_int, check_module

Policy = Literal["accumulate", "shrink"]
Reduction = Literal["mean", "sum"]


OptimizerOption = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
SchedulerOption = Any  # an LR scheduler, or a sequence of them
AdditiveOption = torch.Tensor | nn.Module | Sequence[torch.Tensor | nn.Module] | None
ItemsFn = Callable[[Any], Any]


@dataclass(frozen=True)
class RecoveryOptions:
    """Every option of :func:`retry_on_oom`, validated; see there for their meaning.

    >>> RecoveryOptions(min_batch=4).policy
    'shrink'
    """

    optimizer: OptimizerOption = None
    policy: Policy | None = None
    reduction: Reduction = "mean"
    batch_arg: str | None = None
    min_batch: int = 1
    grow_after: int | None = None
    scaler: Any = None
    model: nn.Module | None = None
    device: DeviceLike = None
    headroom: float = 0.1
    sync_ranks: bool = True
    items: ItemsFn | None = None
    scheduler: SchedulerOption = None
    additive: AdditiveOption = None
    #: whether ``policy`` was given (a bare decorator's "shrink" is not a choice the user made)
    policy_given: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        optimizers = self.optimizers
        _ = self.schedulers, self.additive_tensors  # checked here
        object.__setattr__(self, "policy_given", self.policy is not None)
        if self.policy is None:
            object.__setattr__(self, "policy", "accumulate" if optimizers else "shrink")
        if self.policy not in ("accumulate", "shrink"):
            raise ValueError(f"policy must be 'accumulate' or 'shrink', got {self.policy!r}")
        if self.policy == "accumulate" and not optimizers and self.model is None:
            raise ValueError(
                "policy='accumulate' needs the optimizer, so that the pieces of a batch make one "
                "step (retry_on_oom(optimizer=opt)), or, for a function that only computes "
                "gradients and leaves the step to its caller, the model whose gradients add up "
                "(retry_on_oom(policy='accumulate', model=model)); else use policy='shrink'"
            )
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if self.items is not None and not callable(self.items):
            raise TypeError(
                f"items must be a function of a batch returning how many items its loss averages "
                f"over, e.g. items=lambda b: (b['labels'] != -100).sum(); got {self.items!r}"
            )
        if self.items is not None and self.reduction == "sum":
            raise ValueError(
                "items= weights pieces of a loss averaged over items; with reduction='sum' the "
                "pieces are added as they are: pass one of the two"
            )
        if self.batch_arg is not None and not isinstance(self.batch_arg, str):
            raise TypeError(f"batch_arg must be a parameter name (str), got {self.batch_arg!r}")
        check_int("min_batch", self.min_batch)
        if self.grow_after is not None:
            check_int("grow_after", self.grow_after)
        if self.scaler is not None and not all(
            callable(getattr(self.scaler, name, None))
            for name in ("scale", "step", "update", "unscale_")
        ):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler, got {type(self.scaler).__name__}"
            )
        if self.model is not None:
            check_module("model", self.model)
        check_fraction("headroom", self.headroom, example="0.1")

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers the step calls, in the order given (empty without one)."""
        given = self.optimizer
        if given is None:
            return ()
        if isinstance(given, torch.optim.Optimizer):
            return (given,)
        if isinstance(given, (list, tuple)) and given:
            found = tuple(given)
            bad = [o for o in found if not isinstance(o, torch.optim.Optimizer)]
            if not bad and len({id(o) for o in found}) == len(found):
                return found
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or a non-empty list of distinct ones "
            f"(every optimizer the step calls), got {given!r}"
        )

    @property
    def schedulers(self) -> tuple[Any, ...]:
        """The LR schedulers the step steps, each once per batch (empty without one)."""
        given = self.scheduler
        if given is None:
            return ()
        found = tuple(given) if isinstance(given, (list, tuple)) else (given,)
        bad = [s for s in found if not callable(getattr(s, "step", None))
               or not hasattr(s, "optimizer")]
        if bad or not found:
            raise TypeError(
                "scheduler must be an LR scheduler (torch.optim.lr_scheduler) or a list of them, "
                f"each stepped once per batch; got {given!r}"
            )
        return found

    @property
    def additive_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors declared additive per micro-batch (a module stands for its buffers)."""
        given = self.additive
        if given is None:
            return ()
        items = list(given) if isinstance(given, (list, tuple)) else [given]
        found: list[torch.Tensor] = []
        for item in items:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, nn.Module):
                found.extend(item.buffers())
            else:
                raise TypeError(
                    "additive must be tensors (or modules, for their buffers) that the step adds "
                    f"to once per row, such as a running sum of losses; got {item!r}"
                )
        return tuple(found)
