"""How much one micro-batch of a Hugging Face ``Trainer``'s batch weighs in the batch's loss.

The ``Trainer`` hands every batch of an accumulation window the window's count of labelled items
(``num_items_in_batch``). A loss that divides by that count (transformers' own causal and masked
language model losses, its label smoother, a ``compute_loss_func`` that uses it) is a sum over
the batch's items divided by a number all micro-batches share: their losses simply add. A loss
that does not (the classification heads, T5 and BART, which take a plain mean) is a mean over
the micro-batch itself, and weighs by the micro-batch's share of what that mean averages over.

Which of the two a loss is, is not read from a flag (transformers 5 sets
``model_accepts_loss_kwargs`` for any ``forward`` with ``**kwargs``): while a micro-batch runs,
``trainer.compute_loss`` gets a ``num_items_in_batch`` that follows its value (:class:`Watched`):
what is computed from it is watched too, so the loss that comes back tells whether it was
computed from the count. Moving the count or asking for its shape (as tracing it for
``torch.compile`` does) is not using it. The loss is then scaled by the micro-batch's share
before the ``Trainer`` runs its backward:

- computed from the count: the share is 1, the micro-batches add;
- the count unused: the micro-batch's share of the labels the mean averages over, where that is
  known: transformers' label smoother, and the model's own loss for the heads in
  :data:`MEAN_HEADS` (labels that are not ``-100``, ``labels[..., 1:]`` for causal language
  models, rows without labels);
- anything else (a loss of one's own that ignores the count, a count whose value left as a
  Python number, ``.item()``, so that the loss may or may not be divided by it) is refused with
  an :class:`~autobatch.AutobatchError` that says what to declare (``reduction=``,
  ``items=``), since a sum, a mean over rows and a mean over tokens weigh differently.

A loss computed from the count that also adds a term of its own that does not depend on the
batch (a weight penalty) counts that term once per micro-batch.

>>> reads = Reads()
>>> count = watched(torch.tensor(12), reads)
>>> _ = count.to("cpu"), count.shape  # moved and looked at: not used
>>> reads.used
False
>>> loss = torch.tensor(6.0) / count
>>> reads.used, reads.computed_from(loss), reads.computed_from(torch.tensor(6.0))
(True, True, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autobatch import AutobatchError
from autobatch._log import user_name
from autobatch._recovery._patches import Patch
from autobatch._recovery._rows import counts_weighed
from autobatch.integrations import _common

__all__ = [
    "MEAN_HEADS", "Reads", "Watched", "Weighing", "item_counter", "trainer_counter", "watched",
]

IGNORE_INDEX = -100

#: Heads whose own loss, where it does not use ``num_items_in_batch``, is a mean over their
#: labels that are not ``-100`` (token heads), or over rows (one label per row; no labels):
#: ``CrossEntropyLoss``, ``MSELoss`` and ``BCEWithLogitsLoss`` with their default reduction,
#: or transformers' standard loss functions. Matched on the end of the model's class name.
MEAN_HEADS = (
    "ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration",
    "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
    "ForMultipleChoice", "ForImageClassification", "ForAudioClassification",
    "ForVideoClassification",
)

_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")

#: Operations that move ``num_items_in_batch`` or give a view or copy of it: what they return
#: is the count still, not a use of it. Of the others, those that return tensors have used its
#: value (what they return is watched in turn), and of those that return something else only
#: these have (the rest read what it is: its shape, device, strides, its attributes).
_MOVES = frozenset({
    torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.detach,
    torch.Tensor.clone, torch.Tensor.contiguous, torch.Tensor.view, torch.Tensor.reshape,
})
_VALUE_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__,
    torch.Tensor.__complex__, torch.Tensor.__array__, torch.equal, torch.allclose,
    torch.is_nonzero,
})


class Reads:
    """What became of a watched count: whether its value was used, and what was computed
    from it."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = False

    def computed_from(self, value: Any) -> bool:
        """Whether ``value`` is a tensor computed from this count."""
        return isinstance(value, Watched) and value.reads is self and value.derived


class Watched(torch.Tensor):
    """``num_items_in_batch`` for one micro-batch, or a tensor computed from it: an ordinary
    tensor to every operation, which notes in :class:`Reads` what became of the count (see the
    module documentation)."""

    reads: Reads
    derived: bool

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        found = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Watched)]
        with torch._C.DisableTorchFunctionSubclass():
            args, kwargs = pytree.tree_map_only(Watched, _plain, (args, kwargs))
            result = func(*args, **kwargs)
        if not found or getattr(func, "__name__", None) == "__get__":
            return result  # (an attribute: its shape, its base, its gradient)
        reads = found[0].reads
        if func in _MOVES and isinstance(result, torch.Tensor):
            return watched(result, reads, derived=any(t.derived for t in found))
        tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if tensors or func in _VALUE_READS:
            reads.used = True
        if not tensors:
            return result
        return pytree.tree_map_only(
            torch.Tensor, lambda t: watched(t, reads, derived=True), result
        )


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor (the same data and autograd history)."""
    if not isinstance(tensor, Watched):
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def watched(count: torch.Tensor, reads: Reads, *, derived: bool = False) -> Watched:
    """``count`` (shared, not copied) noting in ``reads`` when its value is used; ``derived``:
    a tensor computed from the count."""
    with torch._C.DisableTorchFunctionSubclass():
        result = count.as_subclass(Watched)
    result.reads, result.derived = reads, derived
    return result


def item_counter(shift: bool) -> Callable[[Any], Any]:
    """How many items a batch's mean loss averages over: its labels that are not ``-100``
    (``shift_labels`` where the batch has them, else ``labels[..., 1:]`` when ``shift``), or its
    rows when it has no labels."""

    def count(batch: Any) -> Any:
        labels = None
        if hasattr(batch, "keys"):
            if "shift_labels" in batch:
                labels = batch["shift_labels"]
            elif "labels" in batch:
                labels = batch["labels"]
                if shift and isinstance(labels, torch.Tensor):
                    labels = labels[..., 1:]
        if not isinstance(labels, torch.Tensor):
            return _common.rows_of(batch)
        return (labels != IGNORE_INDEX).sum()

    return count


def trainer_counter(trainer: Any) -> Callable[[Any], Any]:
    """The items the ``Trainer`` itself counts for ``num_items_in_batch``."""
    return item_counter(bool(getattr(trainer, "_loss_shifts_labels", False)))


def _unwrapped(trainer: Any) -> Any:
    model = trainer.accelerator.unwrap_model(trainer.model)
    try:
        from transformers.trainer_utils import unwrap_peft_model
    except ImportError:  # pragma: no cover - older transformers
        return model
    return unwrap_peft_model(model)


def _standard_losses() -> dict[str, Any]:
    from transformers.loss import loss_utils

    names = ("ForCausalLMLoss", "ForMaskedLMLoss", "ForSequenceClassificationLoss",
             "ForTokenClassification", "ForQuestionAnsweringLoss")
    return {name: getattr(loss_utils, name) for name in names if hasattr(loss_utils, name)}


def _model_counter(model: Any) -> Callable[[Any], Any] | None:
    """What the model's own loss averages over, where it is a head of :data:`MEAN_HEADS` whose
    loss function is transformers' standard one (or its own ``CrossEntropyLoss``); else
    ``None``."""
    name = type(model).__name__
    if not name.endswith(MEAN_HEADS):
        return None
    standard = _standard_losses()
    own = vars(model).get("_loss_function")  # set by hand: a loss of one's own
    if own is not None and all(own is not f for f in standard.values()):
        return None
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover - older transformers
        mapping: dict[str, Any] = {}
    else:
        mapping = LOSS_MAPPING
    loss_type = getattr(model, "loss_type", None)
    function = mapping.get(loss_type) if loss_type is not None else None
    if loss_type is not None and all(function is not f for f in standard.values()):
        return None  # a model-specific loss (detection, CTC, speech): not a plain mean
    if name.endswith("ForQuestionAnswering"):
        return _answer_rows
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    causal = name.endswith(_CAUSAL_HEADS) or (
        function is not None and function is standard.get("ForCausalLMLoss")
    )
    return item_counter(causal and not encoder_decoder)


def _answer_rows(batch: Any) -> Any:
    """What a question-answering head's loss averages over: its rows, where every start and
    end position lies in the sequence. transformers ignores a position past the sequence (it
    becomes the loss's ``ignore_index``), and averages the start's and the end's losses each
    over its own count: no share of rows or items weighs that, so it is refused."""
    rows = _common.rows_of(batch)
    if not hasattr(batch, "keys"):
        return rows
    inputs = next((batch[k] for k in ("input_ids", "inputs_embeds", "attention_mask")
                   if isinstance(batch.get(k), torch.Tensor)), None)
    if inputs is None or inputs.dim() < 2:
        return rows
    length = inputs.shape[1]
    for key in ("start_positions", "end_positions"):
        positions = batch.get(key)
        if isinstance(positions, torch.Tensor) and bool((positions >= length).any()):
            raise AutobatchError(
                f"a batch's {key} point past its sequence ({length} tokens): the model's "
                "question-answering loss ignores those rows, and averages its start and end "
                "losses each over its own count of the rows it keeps, which no share of a "
                "split batch's rows can weigh, so a split would train on another loss. Point "
                "unanswerable questions at a position inside the sequence (the [CLS] token, 0, "
                "as transformers' examples do), or use autobatch_trainer(trainer, guard=False) "
                "with a batch size that fits"
            )
    return rows


def _smoother_counter(model: Any) -> Callable[[Any], Any]:
    """What the ``Trainer``'s label smoother averages over without ``num_items_in_batch``: the
    labels that are not ``-100``, shifted where it shifts them (causal language models)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - older transformers
        return item_counter(False)
    return item_counter(model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class Weighing:
    """The micro-batches of one trainer's batches, each scaled by its share of the batch's loss
    inside ``compute_loss`` (see the module documentation)."""

    def __init__(self, trainer: Any, step_name: str) -> None:
        self.step_name = step_name
        self.trainer = trainer
        self.own_loss: Any = None  # a compute_loss set on the trainer itself

    @contextlib.contextmanager
    def piece(self, piece: Any, whole: Any) -> Iterator[None]:
        """While ``piece`` (rows of the batch ``whole``) runs through ``training_step``: its
        ``compute_loss`` watched and scaled; refused if it never ran."""
        trainer = self.trainer
        model = _unwrapped(trainer)
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            raise AutobatchError(
                f"{type(model).__name__} adds its router's load-balancing loss "
                "(output_router_logits=True), a function of the whole batch's routing that "
                "micro-batches cannot reproduce, so a batch split after an OOM would train on "
                "another loss. Set output_router_logits=False, or use "
                "autobatch_trainer(trainer, guard=False) with a batch size that fits"
            )
        real = trainer.compute_loss
        self.own_loss = vars(trainer).get("compute_loss")
        calls = [0]

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            reads = Reads()
            count = kwargs.get("num_items_in_batch")
            if isinstance(count, torch.Tensor):
                kwargs["num_items_in_batch"] = watched(count, reads)
            result = real(*args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            if reads.computed_from(loss):
                share = 1.0  # divided by the window's count: the micro-batches add
            elif reads.used:
                raise self._unknown(
                    f"{self._source()} used the value of num_items_in_batch, but returned a "
                    "loss not computed from it as a tensor (through .item(), int(), a "
                    "comparison, or not at all)"
                )
            else:
                share = self.share(piece, whole, count)
            loss = _scaled(_plain(loss), share)
            return (loss, *result[1:]) if isinstance(result, tuple) else loss

        patch = Patch(trainer, "compute_loss", compute_loss)
        try:
            with counts_weighed():  # (each piece's loss is weighed here, by its items)
                yield
        finally:
            patch.undo()
        if not calls[0]:
            raise self._unknown(
                f"{self.step_name} computed a micro-batch's loss without calling "
                "compute_loss, where autobatch_trainer weighs it"
            )

    def share(self, piece: Any, whole: Any, count: Any) -> float:
        """The share of ``piece`` in a loss that did not use ``num_items_in_batch``."""
        model = _unwrapped(self.trainer)
        if count is not None and not isinstance(count, torch.Tensor):
            raise self._unknown(
                f"num_items_in_batch is a {type(count).__name__}, not a tensor, so autobatch "
                "cannot see whether the loss divides by it"
            )
        counter = self._counter(model, piece)
        items, total = float(_number(counter(piece))), float(_number(counter(whole)))
        if total > 0:
            return items / total
        return _common.rows_of(piece) / _common.rows_of(whole)  # (its mean is 0/0 anyway)

    def _source(self) -> str:
        """What computes the loss: the trainer's ``compute_loss`` of one's own, its
        ``compute_loss_func``, its label smoother, or the model."""
        trainer = self.trainer
        from transformers import Trainer

        if self.own_loss is not None:
            return f"{user_name(self.own_loss)} (the trainer's compute_loss)"
        if type(trainer).compute_loss is not Trainer.compute_loss:
            return f"{type(trainer).__qualname__}.compute_loss"
        function = getattr(trainer, "compute_loss_func", None)
        if function is not None:
            return f"compute_loss_func {user_name(function)}"
        if getattr(trainer, "label_smoother", None) is not None:
            return "the Trainer's label smoother"
        return f"the loss of {type(_unwrapped(trainer)).__name__} (the model's own)"

    def _counter(self, model: Any, piece: Any) -> Callable[[Any], Any]:
        trainer = self.trainer
        from transformers import Trainer

        if self.own_loss is not None or type(trainer).compute_loss is not Trainer.compute_loss or (
            getattr(trainer, "compute_loss_func", None) is not None
        ):
            raise self._unknown(f"{self._source()} returned a loss that does not use "
                                "num_items_in_batch")
        if getattr(trainer, "label_smoother", None) is not None and "labels" in piece:
            return _smoother_counter(model)
        counter = _model_counter(model)
        if counter is None:
            raise self._unknown(
                f"{self._source()} does not use num_items_in_batch, and is not that of a "
                "transformers head autobatch knows"
            )
        return counter

    def _unknown(self, what: str) -> AutobatchError:
        return AutobatchError(
            f"{what}: autobatch cannot tell whether it is a mean over tokens, a mean over "
            "rows or a sum, which weigh a micro-batch differently, so a batch split after an "
            "OOM could train on another loss. Declare it: autobatch_trainer(trainer, "
            "reduction='mean') for a mean over the labels that are not -100 (with "
            "items=lambda batch: ... to count something else, e.g. rows), or "
            "reduction='sum' for a loss that adds up"
        )


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _scaled(loss: Any, share: float) -> Any:
    """``loss`` times ``share``; a micro-batch without items (``share`` 0, its mean 0/0) adds
    nothing: a zero its backward leaves every gradient alone with."""
    if share == 1.0 or not isinstance(loss, torch.Tensor):
        return loss if share == 1.0 else loss * share
    if share == 0.0:
        return torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
    return loss * share
