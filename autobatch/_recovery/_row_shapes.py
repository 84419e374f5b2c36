"""How torch's shape operators move the batch's rows (see :mod:`._rows`): reshapes, moved
and removed dimensions, slices, splits, joins and indexing."""

from __future__ import annotations

from typing import Any

import torch

from autobatch._recovery._inspect import engine_work
from autobatch._recovery._row_ops import (
    AGG,
    FREE,
    ONE,
    Op,
    Tag,
    fallback,
    ids,
    keep_segments,
    norm,
)


def view(op: Op) -> None:
    """A reshape keeps the elements' order: a row starts every ``span`` elements of it (the
    rows' ``inner`` times the sizes after their dimension), and lands in the output
    dimension whose own span that falls in."""
    t, tag = op.tagged[0]
    out = op.out
    if tag.dim < 0 or not isinstance(out, torch.Tensor):
        op.put_all(tag.dim)
        return
    span = tag.inner
    for size in t.shape[tag.dim + 1:]:
        span *= size
    one_row = t.shape[tag.dim] == tag.inner  # (a piece of one row: a dimension of one)
    suffix = 1
    for k in reversed(range(out.dim())):
        size = out.shape[k]
        if one_row:
            if suffix == span and size == 1:
                op.put(out, k, inner=1)
                return
        elif suffix <= span < suffix * size and span % suffix == 0:
            op.put(out, k, segments=keep_segments(tag, t, out, k), inner=span // suffix)
            return
        suffix *= size
    op.put(out, FREE)


def moved(op: Op) -> None:
    """Dimensions moved, added or removed: the rows follow."""
    t, tag = op.tagged[0]
    if tag.dim < 0:
        op.put_all(tag.dim)
        return
    out = op.outputs()[0]
    d, rank, name = tag.dim, t.dim(), op.name
    if name == "expand":
        new = d + out.dim() - rank
    elif name == "permute":
        new = [norm(x, rank) for x in op.arg("dims")].index(d)
    elif name in ("transpose", "t"):
        a, b = (0, 1) if name == "t" else (norm(op.arg("dim0"), rank), norm(op.arg("dim1"), rank))
        new = b if d == a else a if d == b else d
    elif name == "unsqueeze":
        new = d + (norm(op.arg("dim"), out.dim()) <= d)
    else:  # squeeze
        dim = op.arg("dim")
        candidates = range(rank) if dim is None else [dim] if isinstance(dim, int) else dim
        removed = {norm(x, rank) for x in candidates if t.shape[norm(x, rank)] == 1}
        new = FREE if d in removed else d - sum(1 for x in removed if x < d)
    op.put(out, new, segments=keep_segments(tag, t, out, new))


def select(op: Op) -> None:
    """One index of a dimension: of the rows' own, one row (a loop over the rows)."""
    t, tag = op.tagged[0]
    if tag.dim < 0:
        op.put_all(tag.dim)
        return
    dim = norm(op.arg("dim"), t.dim())
    if dim == tag.dim:
        picked = op.watch.picks.get(op.arg("index"))  # (an index from all the rows: argmax)
        op.put_all(ONE, picked, order=_row(t, tag, op.arg("index")))
        return
    op.put_all(tag.dim - (dim < tag.dim))


def _row(t: torch.Tensor, tag: Tag, i: int) -> torch.Tensor:
    """Which of the batch's rows index ``i`` of the rows' dimension holds (of rows merged
    with the dimensions after them, the row it is part of)."""
    i = i + t.shape[tag.dim] if i < 0 else i
    row = i // tag.inner
    return ids(t, tag)[row : row + 1]


def slice_(op: Op) -> None:
    """A slice: of the rows' own dimension, all of it is the rows; part of it is cut
    (pairs made from halves of the batch differ from a micro-batch's halves)."""
    t, tag = op.tagged[0]
    if tag.dim < 0:
        op.put_all(tag.dim)
        return
    dim = norm(op.arg("dim", 0), t.dim())
    end = op.arg("end")
    fixed = isinstance(end, int) and t.shape[dim] < end < 2**62  # (``o[:12]`` of 8 rows)
    if dim != tag.dim or (op.outputs()[0].shape[dim] == t.shape[dim] and not fixed):
        op.put_all(tag.dim, segments=tag.segments)
        return
    op.put_all(dim, op.taint("part of the batch's rows (a slice of them)", "pairs"))


def split(op: Op) -> None:
    """A split: along the rows, kept only where it takes apart what a concatenation of rows
    joined; ``unbind`` along the rows is a loop over them."""
    t, tag = op.tagged[0]
    if tag.dim < 0:
        op.put_all(tag.dim)
        return
    dim = norm(op.arg("dim", 0), t.dim())
    if op.name == "unbind":
        if dim != tag.dim:
            op.put_all(tag.dim - (dim < tag.dim))
            return
        for i, out in enumerate(op.outputs()):  # (a loop over the rows: one row each)
            op.put(out, ONE, order=_row(t, tag, i))
        return
    if dim != tag.dim:
        op.put_all(tag.dim)
        return
    sizes = tuple(o.shape[dim] for o in op.outputs())
    if tag.segments is not None and sizes == tag.segments:
        op.put_all(dim)  # (the parts concatenated along the rows, taken apart again)
        return
    op.put_all(dim, op.taint("the batch's rows cut into parts", "pairs"))


def cat(op: Op) -> None:
    """``cat``/``stack``: rows of every input must sit in one dimension; joined along it, the
    parts are remembered (a later split into them is exact)."""
    tensors = [t for t in op.args[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        return
    stack = op.name == "stack"
    dim = norm(op.arg("dim", 0), tensors[0].dim() + stack)
    rows = op.rows()
    if op.aggregates() and rows:
        op.put_all(rows[0][1].dim, op.mixed())
        return
    if not rows:
        op.put_all(AGG if op.aggregates() else FREE)
        return
    dims = {tag.dim for _, tag in rows}
    if len(dims) > 1:
        op.put_all(min(dims), op.taint("tensors with their rows in different dimensions joined"))
        return
    (d,) = dims
    if stack:
        op.put_all(d + (dim <= d))
    elif dim == d and len(rows) == len(tensors):
        op.put_all(d, segments=tuple(t.shape[d] for t in tensors))
    else:
        op.put_all(d)


def gather_like(op: Op) -> None:
    """``gather``/``index_select`` along a dimension: rows picked along the rows' own
    dimension by an index not made from the batch are reordered (refused); otherwise the
    rows of the input or of the index are the output's."""
    t, index = op.args[0], op.arg("index")
    tt, ti = op.tag_of(t), op.tag_of(index)
    dim = norm(op.arg("dim"), t.dim())
    if any(tag is not None and tag.dim < 0 for tag in (tt, ti)):
        op.put_all(FREE, op.mixed() if op.aggregates() else None)
        return
    if tt is not None and tt.dim == dim:
        order = _picked(t, tt, index, made=ti is not None) if op.name == "index_select" else None
        if order is None:
            op.put_all(dim, op.taint("the batch's rows picked or reordered by an index",
                                     "pairs"))
        else:
            op.put_all(dim, order=order)
        return
    if tt is not None:
        op.put_all(tt.dim)
    elif ti is not None:
        op.put_all(ti.dim if op.name == "gather" else dim)


def _picked(t: torch.Tensor, tag: Tag, index: Any, *, made: bool) -> torch.Tensor | None:
    """The rows' order after indexing the rows' dimension with ``index``: any index made from
    the batch (a selection by content, a sort) or a permutation of all the rows; ``None``
    for any other (rows picked by position depend on how the batch is cut)."""
    if not isinstance(index, torch.Tensor):
        return None
    masks = index.dtype in (torch.bool, torch.uint8)
    if tag.inner != 1 and not (masks and index.dim() == 1):
        return None
    with engine_work(), torch.no_grad():
        base = ids(t, tag).repeat_interleave(tag.inner)  # (each index's row, rows merged)
        if masks:
            shape = (-1, *[1] * (index.dim() - 1))
            return base.reshape(shape).expand(index.shape)[index.bool()]
        flat = index.reshape(-1)
        if index.is_floating_point() or (index.dim() > 1 and flat.numel() != max(index.shape)):
            return None
        size = t.shape[tag.dim]
        if not made and not (flat.numel() == size and bool(
            (flat.sort().values == torch.arange(size, device=flat.device)).all()
        )):
            return None
        return base[flat]


def masked_select(op: Op) -> None:
    """``x.masked_select(mask)``: the elements a mask keeps, in order, each of its row (the
    targets of every row, concatenated, as CTC losses take them); a mean over them counts the
    batch's content, which :func:`._row_ops.selected` sees."""
    rows = op.rows()
    if not rows or op.aggregates() or not op.outputs() or not op.orders_agree():
        fallback(op)
        return
    shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
        *(a.shape for a in op.args[:2] if isinstance(a, torch.Tensor)))
    t, tag = rows[0]
    if tag.inner != 1 or tag.dim + len(shape) - t.dim() != 0:
        fallback(op)
        return
    with engine_work(), torch.no_grad():
        base = ids(t, tag).reshape(-1, *[1] * (len(shape) - 1)).expand(shape)
        order = base[op.args[1].expand(shape).bool()]
    op.put_all(0, inner=1, order=order)


def _identity(index: Any, size: int) -> bool:
    """Whether ``index`` names each index of a dimension of ``size`` once, in order."""
    if not isinstance(index, torch.Tensor) or index.is_floating_point() or index.numel() != size:
        return False
    with engine_work(), torch.no_grad():
        return bool((index.reshape(-1) == torch.arange(size, device=index.device)).all())


def index(op: Op) -> None:
    """``x[i, j]``: rows not indexed keep their place; rows indexed by a mask or by an index
    made from the batch are selected (kept); by any other index, reordered (refused)."""
    t, indices = op.args[0], list(op.args[1])
    tt = op.tag_of(t)
    outs = op.outputs()
    if tt is None or tt.dim < 0 or not outs:
        dims = [tag.dim for i in indices if (tag := op.tag_of(i)) is not None and tag.dim >= 0]
        op.put_all(dims[0] if dims else FREE)
        return
    cover = []  # (first dimension, how many, the index) of each index
    start = 0
    for i in indices:
        width = i.dim() if i is not None and i.dtype in (torch.bool, torch.uint8) else 1
        cover.append((start, width, i))
        start += width
    used = [k for k, (_, _, i) in enumerate(cover) if i is not None]
    if not used:
        op.put_all(tt.dim)
        return
    adjacent = used == list(range(used[0], used[-1] + 1))
    first = cover[used[0]][0] if adjacent else 0
    spanned = sum(cover[k][1] for k in used)
    width = outs[0].dim() - (t.dim() - spanned)  # the broadcast indices' dimensions
    d = tt.dim
    hit = next((i for s, w, i in cover if s <= d < s + w and i is not None), None)
    if hit is not None:
        masks = hit.dtype in (torch.bool, torch.uint8)
        if tt.inner != 1 and not masks and _identity(hit, t.shape[d]):
            # (every index of rows merged with other dimensions, in order: a mask built for
            # (rows x choices) sequences, ``padding_mask[batch_idx, kv_idx]``)
            long = [k for k, size in enumerate(hit.shape) if size == t.shape[d]]
            op.put_all(first + width - hit.dim() + (long[0] if long else 0))
            return
        order = _picked(t, tt, hit, made=op.tag_of(hit) is not None)
        if order is None:
            op.put_all(first, op.taint("the batch's rows picked or reordered by an index",
                                       "pairs"))
            return
        if hit.dim() == 0:  # (``l[l.argsort()[-1]]``: one row)
            op.put_all(ONE, order=order)
            return
        if not masks:  # (where its rows broadcast to)
            long = [k for k, size in enumerate(hit.shape) if size == order.numel()]
            first += width - hit.dim() + (long[0] if long else 0)
        op.put_all(first, inner=1, order=order)
        return
    before = sum(cover[k][1] for k in used if cover[k][0] < d)
    if adjacent and d < first:
        op.put_all(d)
    elif adjacent:
        op.put_all(d - spanned + width)
    else:
        op.put_all(width + d - before)


def scatter_like(op: Op) -> None:
    """``scatter_add``/``index_add``/``index_put``: rows added into a table along their own
    dimension make an aggregate (per-class sums); written there without adding, they are
    reordered; a table with rows elsewhere keeps them."""
    t = op.args[0]
    tt = op.tag_of(t)
    if tt is not None and tt.dim >= 0:
        op.put_all(tt.dim)
        return
    rows = op.rows()
    if not rows:
        op.put_all(AGG if op.aggregates() else FREE)
        return
    adds = op.name in ("scatter_add", "index_add") or bool(op.arg("accumulate", False)) or (
        op.arg("reduce") in ("sum", "mean"))
    dim = op.arg("dim")
    src_dim = rows[0][1].dim
    if dim is not None and norm(dim, t.dim()) != src_dim:
        op.put_all(src_dim)
        return
    op.put_all(AGG if adds else FREE, None if adds else op.taint(
        "the batch's rows written into a table by index", "pairs"))


def ctc(op: Op) -> None:
    """CTC's log-probabilities (time, rows, classes): a loss per row."""
    tag = op.tag_of(op.args[0])
    outs = op.outputs()
    if tag is not None and tag.dim == 1 and outs:
        op.put(outs[0], 0, inner=1)
    else:
        fallback(op)
