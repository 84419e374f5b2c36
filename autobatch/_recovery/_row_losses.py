"""How torch's loss operators move the batch's rows (see :mod:`._rows`): a cross-entropy's
mean over the targets it counts, and the losses with ``reduction=``."""

from __future__ import annotations

import torch

from autobatch._recovery._inspect import engine_work
from autobatch._recovery._row_ops import (
    AGG,
    FREE,
    ITEMS,
    ROWS,
    SELECTED,
    Op,
    note_selection,
    pointwise,
    selected,
)


def nll(op: Op) -> None:
    """Cross-entropy's last part: a mean over targets counts the targets it does not ignore
    (and weighs them by class); exact when every row holds the same count."""
    inp, target = op.args[0], op.args[1]
    ti, tt = op.tag_of(inp), op.tag_of(target)
    if (ti is not None and ti.dim != 0) or (tt is not None and tt.dim != 0):
        if ti is not None and ti.dim == 1 and inp.dim() == 2:
            op.put_all(FREE, op.taint("a cross-entropy over the batch's rows as classes", "pairs"))
        else:
            op.put_all(FREE, op.taint("a cross-entropy whose rows are not the batch's"))
        return
    if ti is not None and tt is not None and not op.orders_agree():
        op.put_all(FREE, op.paired())
        return
    reduced = op.arg("reduction", 1)
    outs = op.outputs()
    if reduced == 0:
        op.put(outs[0], 0)
    elif reduced == 2 or op.watch.items:
        if reduced == 1 and ti is not None:
            note_selection(op, inp, ti)
        per_row = target.numel() == op.watch.rows and (ti is None or ti.order is None) and (
            op.arg("weight") is None and not _ignores(target, op.arg("ignore_index", -100)))
        op.put(outs[0], AGG, total=reduced == 2, summed=target.numel(),
               basis=frozenset() if reduced != 1 else ROWS if per_row else ITEMS)
    elif any(tag is not None and selected(op, tag) for tag in (ti, tt)):
        op.put(outs[0], FREE, op.taint(SELECTED, "count"))
    elif (count := _even(target, op.arg("weight"), op.arg("ignore_index", -100),
                         op.watch.rows)) is not None:
        op.watch.even_used = True  # (the count is the batch's content: every piece checked)
        op.watch.counts.append(count)
        if op.arg("weight") is None and _batch_own(target, op.watch.storages):
            op.watch.ignored.add(int(op.arg("ignore_index", -100)))
        else:  # (class weights, or targets the step made: labels masked from a mask, say)
            op.watch.masked = True
        op.put(outs[0], AGG, total=False, basis=ROWS)
    else:
        op.put(outs[0], FREE, op.taint(
            "a mean over the targets it does not ignore (ignore_index or class weights), whose "
            "count differs from row to row", "count"))


def _ignores(target: torch.Tensor, ignore: int) -> bool:
    """Whether a class target holds the ignored label somewhere (so its mean is over items)."""
    if target.is_floating_point():
        return False
    with engine_work(), torch.no_grad():
        return bool((target == ignore).any())


def _batch_own(t: torch.Tensor, storages: set[int]) -> bool:
    """Whether ``t`` is one of the micro-batch's own tensors, or a view or copy of one."""
    return t.layout is torch.strided and t.untyped_storage().data_ptr() in storages


def _even(target: torch.Tensor, weight: torch.Tensor | None, ignore: int,
          rows: int) -> float | None:
    """What every row of the batch counts of its targets (weighted by class), where each
    counts the same; else ``None``."""
    if target.numel() == 0:
        return 0.0
    if target.numel() % rows:
        return None
    with engine_work(), torch.no_grad():
        counted = (target != ignore).double()
        if weight is not None:
            counted = counted * weight[target.clamp(0, weight.numel() - 1)].double()
        per_row = counted.reshape(rows, -1).sum(1)
        return float(per_row[0]) if bool((per_row == per_row[0]).all()) else None


#: losses whose input and target meet elementwise, broadcast against each other
_ELEMENTWISE_LOSSES = frozenset({
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "soft_margin_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "margin_ranking_loss",
    "hinge_embedding_loss",
})


def reduced_loss(op: Op) -> None:
    """A loss operator with ``reduction=``: elementwise, then a mean or sum over everything.
    An input and a target whose rows broadcast against each other (``(N,)`` against
    ``(N, 1)``: every row meets every other) pair the rows."""
    if op.arg("reduction", 1) == 0:
        pointwise(op)
        return
    rows = op.rows()
    if rows and op.aggregates():
        op.put_all(FREE, op.mixed())
        return
    if len(rows) > 1 and op.name in _ELEMENTWISE_LOSSES and (
        len({tag.dim - t.dim() for t, tag in rows}) > 1
    ):
        op.put_all(FREE, op.taint(
            "an input and a target whose rows broadcast against each other (shapes such as "
            "(N,) and (N, 1): every row meets every other row)", "broadcast"))
        return
    if len(rows) > 1 and not op.orders_agree():
        op.put_all(FREE, op.paired())
        return
    if op.arg("reduction", 1) == 1 and op.watch.items:
        if rows:
            note_selection(op, *rows[0])
    elif op.arg("reduction", 1) == 1 and any(selected(op, tag) for _, tag in rows):
        op.put_all(FREE, op.taint(SELECTED, "count"))
        return
    mean = op.arg("reduction", 1) == 1
    selection = any(tag.order is not None for _, tag in rows) and op.watch.items
    op.put_all(AGG if rows else FREE,
               None if rows else op.taint(f"{op.label} of a sum over the batch's rows"),
               total=not mean, summed=max((t.numel() for t, _ in rows), default=0),
               basis=(ITEMS if selection else ROWS) if mean else frozenset())
