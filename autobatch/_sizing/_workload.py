"""The workload a search measures: the sample and its batches, the calling convention, the loss,
the step and the optimizer it steps, and compiled models. The bottom of the sizing side: it
measures nothing and decides no size.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autobatch import _batch
from autobatch._memory._backends import DeviceLike, resolve_device
from autobatch._validate import check_search_options, is_sample_factory

#: The share of the largest batch that trains the recommended batch leaves unused, by default
#: (the same meaning as the guard's ``headroom``: see :func:`autobatch.search.recommend`).
DEFAULT_HEADROOM = 0.1

Batch = Any
LossFn = Callable[..., torch.Tensor]
StepFn = Callable[[nn.Module, Batch], Any]
OptimizerLike = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
Sample = Batch | Callable[[int], Batch]


@dataclass(frozen=True)
class SearchSpec:
    """What one search measures and which sizes it may answer, checked on creation: the step
    (``loss_fn``, ``step_fn``, ``train``, ``steps_per_trial``, ``scaler``), the sizes allowed and
    the headroom. Everything that changes a search's answer but the model, the sample, the
    optimizer and the device (so, with them, a cached result's key).

    >>> spec = SearchSpec(None, None, True, 8, None, 8, DEFAULT_HEADROOM, 1, None)
    >>> spec.options()["multiple_of"]
    8
    """

    loss_fn: LossFn | None
    step_fn: StepFn | None
    train: bool
    min_batch: int
    max_batch: int | None
    multiple_of: int
    headroom: float
    steps_per_trial: int
    scaler: Any

    def __post_init__(self) -> None:
        check_search_options(
            self.min_batch, self.max_batch, self.multiple_of, self.headroom, self.steps_per_trial
        )

    def options(self) -> dict[str, Any]:
        """The fields by name, as keyword arguments (for a cache key)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def call_model(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    """Run the forward pass the way a training loop would; returns ``(output, target)``.

    A tensor batch is ``model(batch)``; a mapping is ``model(**batch)`` (Hugging Face style,
    labels inside); a 2-tuple or 2-list is ``(inputs, target)`` and runs ``model(inputs)``.
    """
    if isinstance(batch, torch.Tensor):
        return model(batch), None
    if isinstance(batch, Mapping):
        return model(**batch), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return model(batch[0]), batch[1]
    raise TypeError(
        f"cannot tell how to call the model on a batch of {_batch.describe(batch)}; a batch is a "
        "tensor, a dict of model keyword arguments, or an (inputs, target) pair. Pass "
        "step_fn=lambda model, batch: ... to run your own step"
    )


def loss_of(output: Any, target: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar to call ``backward`` on.

    ``loss_fn(output, target)`` (or ``loss_fn(output)`` without a target) when given; else a
    scalar output, an output's ``.loss`` or ``["loss"]`` (a model's own loss, e.g. a Hugging
    Face model given ``labels``); else a stand-in that costs at least what a training loss
    does: a cross-entropy over the last dimension of every floating-point output that needs a
    gradient (for a language model's logits that is the loss it trains with; it keeps the
    log-probabilities for backward, as a real classification loss does) plus a squared error
    against a target as large as it (a regression loss's), the mean of those with fewer than
    two dimensions. A plain mean would keep nothing, so a language model would
    look cheaper than it is. When ``loss_fn`` cannot take what the model returned (an object
    such as a ``ModelOutput``), the error says in one line what came back and what to pass.
    """
    if loss_fn is not None:
        try:
            return loss_fn(output) if target is None else loss_fn(output, target)
        except (TypeError, AttributeError) as error:
            if isinstance(output, torch.Tensor):
                raise
            problem = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
        raise TypeError(
            f"the model returned {_batch.describe(output)}, not a tensor, and "
            f"loss_fn={getattr(loss_fn, '__name__', type(loss_fn).__name__)} cannot take it "
            f"({problem}); pass a loss_fn that reads the field it needs (e.g. "
            "lambda output, target: cross_entropy(output.logits.flatten(0, -2), "
            "target.flatten())), or no loss_fn and labels the model computes its own loss from"
        )
    own = own_loss(output)
    if own is not None:
        return own
    parts = [
        _stand_in(t)
        for t in _batch.tensors(output)
        if t.is_floating_point() or t.is_complex()
        if t.requires_grad
    ]
    if not parts:
        raise TypeError(
            "the model's output has no tensor that needs a gradient, so there is nothing to "
            "back-propagate; pass loss_fn=, step_fn=, or train=False for inference"
        )
    return torch.stack(parts).sum()


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself: a scalar output, or an output's ``.loss`` /
    ``["loss"]`` (a Hugging Face model given ``labels``); ``None`` where there is none."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def _stand_in(output: torch.Tensor) -> torch.Tensor:
    """A loss over one output tensor that keeps at least as much for backward as the usual
    per-row training losses on it: a cross-entropy over its last dimension (which keeps the
    log-probabilities, as a classifier's or a language model's loss does) plus a squared error
    against a target as large as the output (which a regression loss holds, and a loss made
    in the step allocates)."""
    if output.is_complex():
        output = output.abs()
    if output.dim() < 2:
        return output.float().mean()
    scores = output.flatten(0, -2).float()
    targets = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    # (the squared error written out: its backward holds the difference and its own
    # temporaries, more than the fused mse_loss's)
    squared = (scores - torch.zeros_like(scores)).pow(2).mean()
    return torch.nn.functional.cross_entropy(scores, targets) + squared


def language_model_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss: each position predicts the next token.

    ``output`` is the logits ``(batch, length, vocabulary)`` or an object with ``.logits`` (a
    Hugging Face ``ModelOutput``); ``tokens`` the input ids, which are the labels.

    >>> logits, tokens = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    >>> float(language_model_loss(logits, tokens)) > 0
    True
    """
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tokens.dim() != 2:
        raise TypeError(
            f"a language-model loss needs logits (batch, length, vocabulary) and tokens (batch, "
            f"length); the model returned {_batch.describe(output)} for tokens "
            f"{tuple(tokens.shape)}"
        )
    predicted = logits[:, :-1].flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(predicted, tokens[:, 1:].flatten())


class TrainingStep:
    """The one step every front-end runs (finder, planner, throughput), as a training loop runs
    it: ``step(batch)``.

    ``step_fn(model, batch)`` when given; otherwise zero_grad (``set_to_none``, as torch does by
    default), forward, loss, backward and the optimizer step (through ``scaler`` when given), or
    a forward under ``torch.inference_mode()`` when ``train`` is False. Like a loop's ``loss =
    ...``, the step holds its loss (or what ``step_fn`` returned) until the next step's loss
    replaces it; :meth:`forget` lets it go.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        train: bool = True,
        scaler: Any = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.step_fn, self.train, self.scaler = loss_fn, step_fn, train, scaler
        self.loss: Any = None
        self.stood_in = False  # the loss was the stand-in (no loss_fn, no loss of the model's)

    def forget(self) -> None:
        """Let the last step's loss go (before a trial, and after the last)."""
        self.loss = None

    def __call__(self, batch: Batch) -> None:
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        if self.step_fn is not None:
            self.loss = self.step_fn(model, batch)
            return
        if not self.train:
            with torch.inference_mode():
                call_model(model, batch)
            return
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        output, target = call_model(model, batch)
        self.loss = loss = loss_of(output, target, self.loss_fn)
        if self.loss_fn is None and not self.stood_in:
            self.stood_in = own_loss(output) is None
        del output
        if scaler is not None:
            scaler.scale(loss).backward()
            if optimizer is not None:
                scaler.step(optimizer)
                scaler.update()
        else:
            loss.backward()
            if optimizer is not None:
                optimizer.step()


def check_default_step(optimizer: torch.optim.Optimizer | None, step_fn: Any, train: bool) -> None:
    """Refuse an optimizer whose ``step()`` the default step cannot call: one that needs a
    closure (LBFGS)."""
    if step_fn is None and train and optimizer is not None and _needs_closure(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs a closure that re-evaluates the loss, "
            "which the default step cannot give it: pass step_fn=, a function (model, batch) "
            "-> loss that calls optimizer.step(closure) as your training loop does"
        )


def check_initialized(model: nn.Module) -> None:
    """Refuse a model with lazy parameters not made yet (``nn.LazyLinear`` before its first
    forward): they have no shape to save, put back or count."""
    for name, param in model.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"the model's parameter {name!r} is not initialized yet (a lazy module, such "
                "as nn.LazyLinear, makes it at its first forward): run the model once on a "
                "sample (model(sample)), then search"
            )


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` takes a required argument (LBFGS's closure)."""
    try:
        signature = inspect.signature(optimizer.step)
    except (TypeError, ValueError):
        return False
    return any(p.default is inspect.Parameter.empty and p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for p in signature.parameters.values())


def make_optimizer(optimizer: OptimizerLike, model: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer instance as is, or a class/factory called on the model's parameters (a
    temporary optimizer that the caller throws away)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        made = optimizer(model.parameters())
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer={optimizer!r} returned {type(made).__name__}, not a torch.optim.Optimizer"
            )
        return made
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer, an optimizer class or factory, or None; "
        f"got {type(optimizer).__name__}"
    )


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) without a forward pass, so that every
    trial runs in the steady state of training, where that state is resident.

    One step on all-zero gradients creates the state; the step's effect on the parameters is
    undone later by the snapshot. Optimizers that need a closure (LBFGS) are left unprimed.
    """
    params = [
        p for group in optimizer.param_groups for p in group["params"]
        if p.requires_grad and p not in optimizer.state
    ]
    if not params:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    except TypeError as error:  # LBFGS and friends: step(closure) is required
        if "closure" not in str(error):
            raise
    finally:
        for p in params:
            p.grad = None


def _compiled_class() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule is compiled (``torch.compile(module)`` or
    ``module.compile()``)."""
    optimized = _compiled_class()
    return any(
        (optimized is not None and isinstance(module, optimized))
        or getattr(module, "_compiled_call_impl", None) is not None
        for module in model.modules()
    )


def without_compiled(model: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """``(eager, undo)``: ``model`` with every compiled part swapped for its eager original (the
    root itself too, when compiled), and the function that puts them back. Parameters are
    shared, not copied."""
    optimized = _compiled_class()
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    cleared: list[tuple[nn.Module, Any]] = []

    def undo() -> None:
        for module, name, child in reversed(swapped):
            module._modules[name] = child
        for module, impl in reversed(cleared):
            module._compiled_call_impl = impl

    root: Any = model
    while optimized is not None and isinstance(root, optimized):
        root = cast(Any, root)._orig_mod
    try:
        for module in list(root.modules()):
            if getattr(module, "_compiled_call_impl", None) is not None:
                cleared.append((module, module._compiled_call_impl))
                module._compiled_call_impl = None
            for name, child in list(module._modules.items()):
                original: Any = child
                while optimized is not None and isinstance(original, optimized):
                    original = cast(Any, original)._orig_mod
                if original is not child and child is not None:
                    swapped.append((module, name, child))
                    module._modules[name] = original
                    for inner in original.modules():
                        if getattr(inner, "_compiled_call_impl", None) is not None:
                            cleared.append((inner, inner._compiled_call_impl))
                            inner._compiled_call_impl = None
    except BaseException:
        undo()
        raise
    return root, undo


@contextlib.contextmanager
def eager_view(model: nn.Module) -> Iterator[nn.Module]:
    """The model with every compiled part swapped for its eager original, put back after.

    Compiled code cannot run under a ``TorchDispatchMode`` (a simulated GPU's accounting,
    per-operator recording, the planner's counting): torch's compiler then not only runs it
    eagerly, it marks the code to be skipped for good, so the user's compiled model would stay
    eager for the rest of the process. Trials under such a mode run this eager view instead;
    the compiled modules themselves never see the mode.
    """
    eager, undo = without_compiled(model)
    try:
        yield eager
    finally:
        undo()


def mark_batch_dynamic(batch: Batch) -> Batch:
    """Mark dimension 0 of every tensor of ``batch`` dynamic for ``torch.compile``, so a compiled
    model is not compiled again for each trial's size (sizes 0 and 1 stay specialised)."""
    dynamo = sys.modules.get("torch._dynamo")
    mark = getattr(dynamo, "maybe_mark_dynamic", None)
    if mark is None:
        return batch
    for tensor in _batch.tensors(batch):
        if tensor.dim() >= 1 and tensor.shape[0] >= 2:
            mark(tensor, 0)
    return batch


def model_device(model: nn.Module, device: DeviceLike) -> torch.device:
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "the model is on the meta device: it has no real weights, so no real step can run. "
            "Materialise it on the target device first (model.to_empty(device=...) and "
            "initialise), or use autobatch.plan_max_batch to predict without running"
        )
    if device is not None:
        wanted = resolve_device(device)
        if devices and wanted not in {resolve_device(d) for d in devices}:
            raise ValueError(
                f"device={device!r} but the model is on {sorted(map(str, devices))}; move the "
                "model to the device to search on (the search never moves your model)"
            )
        return wanted
    if len(devices) > 1:
        raise ValueError(
            f"the model spans devices {sorted(map(str, devices))}; pass device= to say whose "
            "memory to search on"
        )
    return resolve_device(devices.pop()) if devices else resolve_device(None)


def is_row_list(sample: object) -> bool:
    """Whether ``sample`` is a list of per-row examples rather than one batch: a non-empty list
    of mappings with the same keys, or of tuples of one type and length (what
    ``[dataset[i] for i in range(n)]`` gives). A batch made of several parts is a tuple of them,
    or a list of tensors."""
    if not isinstance(sample, list) or isinstance(sample, _batch.PerBatchList) or not sample:
        return False
    first = sample[0]
    if isinstance(first, Mapping):
        keys = set(first)
        return all(isinstance(row, Mapping) and set(row) == keys for row in sample)
    if isinstance(first, tuple) and not isinstance(first, _batch.PerBatchTuple):
        return all(type(row) is type(first) and len(row) == len(first) for row in sample)
    return False


def collated(sample: Batch, *, on_host: bool = False) -> Batch:
    """The sample as one batch: a list of per-row examples (see :func:`is_row_list`) collated
    as ``torch.utils.data.default_collate`` collates them; any other sample unchanged.

    ``on_host=True`` collates where no dispatch mode sees it, so that a simulated GPU does not
    count it: for a sample given once, which stays on the host while the batches cut from it
    go to the device (a batch that a function returned is the batch, and counts).

    >>> rows = [{"x": torch.zeros(3), "label": 1}, {"x": torch.ones(3), "label": 0}]
    >>> batch = collated(rows)
    >>> batch["x"].shape, batch["label"]
    (torch.Size([2, 3]), tensor([1, 0]))
    >>> collated([(torch.zeros(2), 7)] * 4)[0].shape
    torch.Size([4, 2])

    Raises:
        TypeError: the rows cannot be collated into the batch they stand for: a field is a
            Python list of numbers (``default_collate`` would make one tensor per position),
            or the rows' tensors differ in shape (they need padding), or a field is something
            ``default_collate`` does not take.
    """
    if not is_row_list(sample):
        return sample
    rows = f"sample is a list of {len(sample)} per-row examples ({_batch.describe(sample[0])} each)"
    for row in sample:
        field = _number_list(row, "row")
        if field is not None:
            raise TypeError(
                f"{rows}, and {field} is a Python list of numbers: collated the way "
                "torch.utils.data.default_collate does, it would become one tensor per position. "
                "Make the rows' fields tensors (a Hugging Face dataset: "
                "dataset.with_format('torch')), or pass one batch made by your data collator"
            )
    from torch.utils.data import default_collate

    try:
        with _disable_current_modes() if on_host else contextlib.nullcontext():
            return default_collate(sample)
    except (RuntimeError, TypeError) as error:
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TypeError(
            f"{rows} that cannot be collated into one batch ({why}). Rows whose tensors differ "
            "in shape need padding: pass one batch made by your data collator (padded to the "
            "longest row, the worst case), or a function n -> batch"
        ) from None


def _number_list(row: object, path: str) -> str | None:
    """The path of the first field of ``row`` that is a non-empty Python list of numbers."""
    if isinstance(row, Mapping):
        fields = [(f"{path}[{key!r}]", value) for key, value in row.items()]
    elif isinstance(row, (list, tuple)):
        fields = [(f"{path}[{i}]", value) for i, value in enumerate(row)]
    else:
        return None
    for where, value in fields:
        if (
            isinstance(value, (list, tuple)) and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            return where
        found = _number_list(value, where)
        if found is not None:
            return found
    return None


def batch_factory(sample: Sample, device: torch.device) -> Callable[[int], Batch]:
    """``n -> batch`` on ``device``: the sample's rows cycled to ``n`` (a list of per-row
    examples collated first), or the sample's own function called, its batch checked."""
    if is_sample_factory(sample):
        def from_callable(n: int) -> Batch:
            batch = collated(sample(n))
            got = _batch.batch_size(batch)
            if got != n:
                raise ValueError(f"sample({n}) returned a batch of {got} rows, expected {n}")
            return _batch.move_batch(batch, device)

        return from_callable
    sample = collated(sample, on_host=True)
    rows = _batch.batch_size(sample)  # validates shapes, names them when inconsistent
    if rows < 1:
        raise ValueError("sample has no rows; give at least one example along dimension 0")

    def from_rows(n: int) -> Batch:
        # As a loader does: the rows are put together in host memory (where nothing counts
        # against the device, a simulated one included), then copied to the device.
        with _disable_current_modes():
            rows = _batch.resize_batch(sample, n)
        return _batch.move_batch(rows, device, copy=True)

    return from_rows
