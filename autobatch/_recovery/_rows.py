"""The batch's own math: whether a split step's loss treats the batch's rows apart.

A split step is exact when its loss is a sum over the batch's rows, or a mean by their count:
each micro-batch's loss, weighted by its share, then adds up to the batch's. While a batch's
first micro-batch runs watched (under the ledger's dispatch mode), :class:`RowWatch` follows
the batch's row dimension through every operator of the forward, from the micro-batch's own
tensors on:

- a tensor either has the rows along one dimension (*rows*), is a sum or mean over them (an
  *aggregate*, linear in the rows), or does not depend on the batch;
- per-row work keeps the rows where they are (an activation, a linear layer, attention over
  tokens, a convolution over pixels, a reshape that merges the rows with other dimensions);
- an operator that mixes rows *taints* what it makes, and the taint flows on: a product or a
  distance that pairs two tensors' rows (``za @ zb.T``, ``torch.cdist``), a max, min, sort,
  top-k, softmax or cumulative op over the rows, a normalisation over them, an aggregate used
  non-linearly or with the rows (``x - x.mean(0)``, ``loss / mask.sum()``), a mean whose count
  depends on the batch's content (ignored labels, class weights), part of the rows.

When the micro-batch calls ``backward()`` on a tainted loss the step is refused, before any
optimizer step, naming the operator and the user's line that mixed the rows
(:meth:`RowWatch.check`). ``items=`` declares a count that depends on the batch's content;
the documented per-piece statistics (BatchNorm over the rows) are warned, not refused.
What runs compiled, outside torch's operators (``.item()`` values aside), or on tensors the
step builds from non-tensor data is not followed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autobatch._recovery._inspect import user_frame
from autobatch._recovery._row_losses import nll, reduced_loss
from autobatch._recovery._row_ops import (
    AGG,
    BATCH_NORMS,
    LINEAR,
    ONE,
    Op,
    Rule,
    Tag,
    Taint,
    along,
    embedding,
    fallback,
    first_input_at,
    flat,
    item,
    layer_norm,
    packed,
    pointwise,
    positions,
    reduction,
    single,
    within_packed,
)
from autobatch._recovery._row_products import attention, matmul, pairwise, pdist
from autobatch._recovery._row_shapes import (
    cat,
    ctc,
    gather_like,
    index,
    masked_select,
    moved,
    scatter_like,
    select,
    slice_,
    split,
    view,
)
from autobatch._recovery._rules import refusal

_FIXES = {
    "pairs": "a loss that compares rows with each other (in-batch negatives, InfoNCE/CLIP, "
             "pairwise distances, triplet mining) cannot be split by rows; write the step as "
             "an encoder over rows and a loss over all embeddings and use "
             "autobatch.embed_in_pieces (the cached-embedding split, exact), or a batch size "
             "that fits",
    "mixes": "compute the loss per row and end it in a mean or sum over the rows; a loss that "
             "needs the whole batch's embeddings can use autobatch.embed_in_pieces; otherwise "
             "use a batch size that fits, or policy='shrink' (which changes the math on "
             "purpose)",
    "broadcast": "where every row was not meant to meet every other (a shape mistake, "
                 "nearly always), give the input and the target the same shape (squeeze or "
                 "unsqueeze one: the unguarded step trains on that N x N loss too); where it "
                 "was, write the step as an encoder over rows and use autobatch.embed_in_pieces",
    "count": "declare the count, e.g. retry_on_oom(items=lambda batch: "
             "(batch['labels'] != -100).sum()), and autobatch weights each micro-batch by its "
             "items",
}


class _Weighed(threading.local):
    depth = 0


_WEIGHED = _Weighed()


@contextmanager
def counts_weighed() -> Iterator[None]:
    """Within: the caller weighs each micro-batch's loss itself, by its count of items (the
    ``Trainer`` integration does, for the heads it knows), as ``items=`` declares, or by its
    share of a mean (so the loss's kind, a sum or a mean, is not judged here)."""
    _WEIGHED.depth += 1
    try:
        yield
    finally:
        _WEIGHED.depth -= 1


class RowWatch:
    """The rows of one micro-batch, followed through its forward (module docs)."""

    def __init__(self, batch: Iterable[torch.Tensor], rows: int, *, items: bool,
                 reduction: str = "mean", uneven: bool = False) -> None:
        self.rows = rows
        self._items = items  # a data-dependent count was declared (items=)
        #: the micro-batch's share of the declared items is not its share of the rows
        self.uneven = uneven
        self.reduction = reduction  # how the micro-batches' losses are weighed
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.values: set[float] = set()  # .item() of tensors made from the batch
        self.picks: dict[int, Taint] = {}  # .item() of an index from all the rows (argmax)
        self.reads: list[tuple[float, bool]] = []  # .item() of sums (True) and means over rows
        #: tensors made from the rows' positions (arange, linspace: weights by place)
        self.positions: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.selections: list[torch.Tensor] = []  # under items=: the rows each mean picked
        #: a mean by a count of the batch's content was judged exact (each row counts the
        #: same here): the batch's later micro-batches are followed too, to check theirs
        self.even_used = False
        self.counts: list[float] = []  # what each row counted in each such mean
        self.ignored: set[int] = set()  # the ignore_index of each cross-entropy among them
        self.masked = False  # one of them a count other than a cross-entropy's on the batch's
        self.storages: set[int] = set()  # the micro-batch's own tensors' storages
        self.expected: set[float] | None = None  # what an earlier piece's rows counted
        for t in batch:
            if t.dim() > 0 and t.shape[0] == rows:
                self.tags[t] = Tag(0)
                if t.layout is torch.strided:
                    self.storages.add(t.untyped_storage().data_ptr())

    @property
    def items(self) -> bool:
        """Whether a count that depends on the batch's content is weighed per micro-batch."""
        return self._items or _WEIGHED.depth > 0

    # Operators ---------------------------------------------------------------------------------

    def see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """After an operator of the forward ran: tag what it made."""
        tags = self.tags
        tagged = [(t, tag) for t in flat(args, kwargs) if (tag := tags.get(t)) is not None]  # type: ignore[no-untyped-call]
        if not tagged:
            self._positions(func, args, kwargs, out)
            return
        op = Op(self, func, args, kwargs, out, tagged)
        if func in _COPIES and isinstance(out, torch.Tensor) and out.layout is torch.strided:
            source = args[0]  # (the batch moved to the device, or copied: still the batch's)
            if source.layout is torch.strided and (
                source.untyped_storage().data_ptr() in self.storages
            ):
                self.storages.add(out.untyped_storage().data_ptr())
        if within_packed(op):
            return
        if any(tag.dim == ONE for _, tag in op.tagged):
            single(op)
        else:
            rule_for(func)(op)

    def _positions(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   out: Any) -> None:
        """Note a tensor of the micro-batch's size made from positions (``torch.arange(n)``,
        ``linspace``), and what elementwise work on it alone makes (``0.9 ** arange``)."""
        if not isinstance(out, torch.Tensor) or out.dim() == 0:
            return
        name = func.overloadpacket.__name__
        if (name in _POSITIONS_MADE and out.dim() == 1 and len(out) == self.rows) or (
            any(t in self.positions for t in flat(args, kwargs))
            and (torch.Tag.pointwise in func.tags or name in _POSITIONS_KEPT)
        ):
            self.positions[out] = True

    def check(self, roots: Iterable[torch.Tensor], step: str) -> None:
        """``backward()`` of a micro-batch: refuse a loss whose rows were mixed, or averaged
        by a count whose rows count otherwise than an earlier micro-batch's did."""
        if self.expected is not None and any(c not in self.expected for c in self.counts):
            raise refusal(
                step, "averaged its loss over a count of the batch's content (targets not "
                f"ignored, a mask's sum) that each row counts {self.counts[0]:g} times in "
                f"this micro-batch and {min(self.expected):g} in the first",
                "the mean it divides by", "the loss then depends on how the batch is cut: "
                "the micro-batches' means, weighted by rows, are not the batch's mean",
                _FIXES["count"],
            )
        picks = self.selections
        if any(p.shape != picks[0].shape or not torch.equal(p, picks[0]) for p in picks[1:]):
            raise refusal(
                step, "averaged its loss over different picks of the batch's rows (two "
                "masks)", user_frame(),
                "items= declares one count, which cannot weigh means over different counts",
                "compute the loss as one mean over one mask, or as sums divided by the "
                "batch-wide counts with reduction='sum'",
            )
        for root in roots:
            tag = self.tags.get(root)  # type: ignore[no-untyped-call]
            if tag is not None and tag.taint is None and self.rows > 1 and (
                tag.dim == ONE or (tag.dim == AGG and tag.order is not None and not bool(
                    torch.equal(tag.order.sort().values, torch.arange(self.rows))))
            ):
                raise refusal(
                    step, "computed its loss from some of the batch's rows, taken one at a "
                    "time (x[0], the first of a sort, a loop over part of the rows)",
                    user_frame(), "a micro-batch would take its own first rows: the loss "
                    "then depends on how the batch is cut", _FIXES["mixes"],
                )
            if tag is not None and tag.taint is None and tag.dim == AGG and self._items and (
                self.uneven and "rows" in tag.basis and not _WEIGHED.depth
            ):
                raise refusal(
                    step, "averaged its loss, or part of it, over the batch's rows, while "
                    "items= weighs each micro-batch by its share of the items it declares, "
                    "which is not its share of the rows here", user_frame(),
                    "a mean over rows (a next-sentence or classification term beside a token "
                    "mean) would be weighed as a mean over items",
                    "declare items= for a loss that is one mean over those items only, or "
                    "compute the row term as a sum divided by the batch-wide count with "
                    "reduction='sum'",
                )
            if tag is not None and tag.taint is None and tag.dim == AGG and not _WEIGHED.depth:
                self._check_kind(tag, step)  # (unless the caller weighs each micro-batch)
            if tag is not None and tag.taint is not None:
                taint = tag.taint
                if taint.kind == "count" and self.items:
                    continue
                raise refusal(
                    step, f"computed its loss from {taint.what}", taint.where,
                    "the loss then depends on how the batch is cut: a micro-batch's loss, "
                    "weighted by its share, is not its part of the batch's loss, so the "
                    "micro-batches' gradients would not add up to the batch's",
                    _FIXES[taint.kind],
                )


    def _check_kind(self, tag: Tag, step: str) -> None:
        """Refuse a loss whose kind (a sum or a mean over the rows) is not the one the
        micro-batches are weighed for: a mean's by their share of the rows, a sum's by one."""
        if self.reduction == "mean" and tag.total:
            raise refusal(
                step, "computed its loss as a sum over the batch's rows (reduction='sum', or "
                "a sum divided by a fixed number), while each micro-batch's loss is weighed "
                "by its share of the rows, as a mean's", user_frame(),
                "the micro-batches' gradients would add up to the batch's divided by their "
                "number", "pass reduction='sum' (each micro-batch's loss then counts whole), "
                "or make the loss a mean over the rows",
            )
        if self.reduction == "sum" and tag.total is False:
            raise refusal(
                step, "computed its loss as a mean over the batch's rows, while "
                "reduction='sum' adds the micro-batches' losses whole", user_frame(),
                "the micro-batches' gradients would add up to the batch's times their number",
                "drop reduction='sum' (the default weighs each micro-batch by its share)",
            )
        if self.reduction == "sum" and tag.constant:
            raise refusal(
                step, "added a term without rows that learns (a penalty on the weights) to a "
                "sum over the batch's rows", user_frame(),
                "with reduction='sum' each micro-batch's loss counts whole, so that term "
                "would count once per micro-batch", "divide the term by the batch's number of "
                "micro-batches yourself, or make the loss a mean over the rows and drop "
                "reduction='sum'",
            )


# The operators' rules ----------------------------------------------------------------------

_LINEAR_REDUCTIONS = frozenset({"sum", "mean", "nansum"})
_REDUCTIONS = frozenset({
    "amax", "amin", "max", "min", "argmax", "argmin", "std", "var", "var_mean", "std_mean",
    "logsumexp", "linalg_vector_norm", "norm", "prod", "any", "all", "count_nonzero",
    "median", "nanmedian", "mode", "kthvalue", "aminmax", "nanmean", "frobenius_norm",
})
_ALONG = frozenset({
    "_softmax", "_log_softmax", "softmax", "log_softmax", "cumsum", "cumprod", "cummax",
    "cummin", "logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "_safe_softmax",
})
_BY_NAME: dict[str, Rule] = {
    **dict.fromkeys(
        ("view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "_reshape_copy"), view
    ),
    **dict.fromkeys(("expand", "permute", "transpose", "t", "unsqueeze", "squeeze"), moved),
    "select": select, "slice": slice_,
    **dict.fromkeys(("split", "split_with_sizes", "chunk", "unbind", "unsafe_split",
                     "unsafe_chunk", "unsafe_split_with_sizes"), split),
    "cat": cat, "stack": cat,
    "mm": matmul(0, 1, False), "bmm": matmul(0, 1, True),
    "addmm": matmul(1, 2, False, 0), "baddbmm": matmul(1, 2, True, 0),
    "_cdist_forward": pairwise, "_euclidean_dist": pairwise, "cdist": pairwise,
    "_pdist_forward": pdist, "pdist": pdist,
    **dict.fromkeys(BATCH_NORMS, first_input_at(0, 1, what="a batch normalisation")),
    "native_group_norm": first_input_at(0, what="a group normalisation"),
    "native_layer_norm": layer_norm, "_fused_rms_norm": layer_norm, "rms_norm": layer_norm,
    "nll_loss_forward": nll, "nll_loss2d_forward": nll,
    "index": index, "_unsafe_index": index, "masked_select": masked_select,
    "index_select": gather_like, "gather": gather_like,
    **dict.fromkeys(("scatter", "scatter_add", "scatter_reduce", "index_add", "index_put",
                     "index_copy", "_index_put_impl"), scatter_like),
    "embedding": embedding,
    "_local_scalar_dense": item,
    "_ctc_loss": ctc,
    "_pack_padded_sequence": packed, "_pad_packed_sequence": packed,
}


#: operators that make a tensor of positions, and those that keep one (views, copies)
_POSITIONS_MADE = frozenset({"arange", "linspace", "logspace"})
_POSITIONS_KEPT = frozenset({"_to_copy", "view", "reshape", "unsqueeze", "expand", "clone",
                             "flip", "contiguous", "alias", "detach", "lift_fresh"})

_RULES: dict[Any, Rule] = {}
_COPIES = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.clone.default})


def rule_for(func: Any) -> Rule:
    """The rule of an operator (found once, then looked up)."""
    rule = _RULES.get(func)
    if rule is None:
        rule = _RULES[func] = _find(func)
    return rule


def _find(func: Any) -> Rule:
    """The rule for an operator: by name, then by kind (attention, convolution, elementwise,
    reduction, along a dimension, a loss with ``reduction=``), else :func:`fallback`."""
    name = func.overloadpacket.__name__.rstrip("_")
    if name in _BY_NAME:
        return _BY_NAME[name]
    if name.startswith(("_scaled_dot_product", "scaled_dot_product", "_flash_attention",
                        "_efficient_attention")):
        return attention
    if "conv" in name and "backward" not in name:
        return first_input_at(0, what="a convolution")
    if torch.Tag.pointwise in func.tags:
        return pointwise
    if name in _LINEAR_REDUCTIONS:
        return reduction(True)
    if name in _REDUCTIONS or (torch.Tag.reduction in func.tags and name not in _ALONG):
        return reduction(False)
    if name in _ALONG:
        return along
    if "reduction" in positions(func):
        return reduced_loss
    if name in LINEAR or name in (
        "where", "masked_fill", "native_dropout", "bernoulli", "fill", "zero",
    ):
        return pointwise
    return fallback
