"""The rules for operators that multiply or compare the batch's rows (see :mod:`._rows`):
matrix products (rows on one side stay, on both they pair, contracted they make a sum over
them), distances between rows, and attention."""

from __future__ import annotations

from autobatch._recovery._row_ops import AGG, FREE, Op, Rule


def matmul(lhs: int, rhs: int, batched: bool, bias: int | None = None) -> Rule:
    """``mm``/``bmm`` and their ``add`` forms: rows on the left stay rows, rows on the right
    become columns, rows on both pair them, rows contracted make an aggregate."""
    def rule(op: Op) -> None:
        ta, tb = op.tag_of(op.args[lhs]), op.tag_of(op.args[rhs])
        off = 1 if batched else 0
        rows = [(tag, side) for tag, side in ((ta, "a"), (tb, "b"))
                if tag is not None and tag.dim >= 0]
        if any(tag is not None and tag.dim == AGG for tag in (ta, tb)):
            op.put_all(FREE if rows else AGG, op.mixed() if rows else None)
            return
        out_dims: set[int] = set()
        contracted = False
        for tag, side in rows:
            d = tag.dim
            if batched and d == 0:
                out_dims.add(0)
            elif (side == "a" and d == off) or (side == "b" and d == off + 1):
                out_dims.add(d)
            else:
                contracted = True
        if len(out_dims) > 1:
            op.put_all(min(out_dims), op.taint(
                "a product of two tensors' rows with each other (a similarity matrix over "
                "the batch, as za @ zb.T)", "pairs"))
            return
        if contracted:
            other = op.args[rhs] if ta is not None and ta.dim >= 0 else op.args[lhs]
            if out_dims:
                op.put_all(FREE, op.taint("a product that contracts the batch's rows"))
            elif op.tag_of(other) is None and (other in op.watch.positions or any(
                    tag.order is not None for tag, _ in rows)):
                op.put_all(FREE, op.taint("the batch's rows weighted by their place (a rank "
                                          "after a sort, or positions), summed"))
            else:
                op.put_all(AGG, total=True)  # (a sum over rows of per-row products: X.T @ Y)
            return
        if not out_dims:
            op.put_all(FREE)
            return
        (dim,) = out_dims
        added = op.tag_of(op.args[bias]) if bias is not None else None
        op.put_all(dim, op.mixed() if added is not None and added.dim == AGG else None)
    return rule


def pairwise(op: Op) -> None:
    """Distances between two sets of rows (``torch.cdist``): rows of both pair them."""
    a = op.args[0]
    ta, tb = op.tag_of(a), op.tag_of(op.args[1])
    rank = a.dim()
    if ta is not None and tb is not None and ta.dim == rank - 2 and tb.dim == rank - 2:
        op.put_all(rank - 2, op.taint("distances between the batch's rows", "pairs"))
    elif ta is not None and 0 <= ta.dim <= rank - 2:
        op.put_all(ta.dim)
    elif tb is not None and tb.dim == rank - 2:
        op.put_all(rank - 1)
    elif tb is not None and 0 <= tb.dim < rank - 2:
        op.put_all(tb.dim)
    else:
        op.put_all(FREE, op.taint("distances over the batch's rows"))


def pdist(op: Op) -> None:  # (distances within one set of rows)
    op.put_all(FREE, op.taint("distances between the batch's rows", "pairs"))


def attention(op: Op) -> None:
    """Scaled dot-product attention: rows in the leading dimensions stay; rows as the
    queries' sequence stay per query; rows as the keys' or values' sequence are mixed."""
    q = op.args[0]
    rank = q.dim()
    dims: set[int] = set()
    for i, t in enumerate(op.args[:3]):
        tag = op.tag_of(t)
        if tag is None:
            continue
        if tag.dim < 0:
            op.put_all(FREE, op.mixed() if tag.dim == AGG else None)
            return
        if tag.dim >= rank - 2 and not (i == 0 and tag.dim == rank - 2):
            op.put_all(tag.dim if i == 0 else rank - 2,
                       op.taint("attention across the batch's rows", "pairs"))
            return
        dims.add(tag.dim)
    if len(dims) > 1:
        op.put_all(min(dims), op.taint("attention that pairs the batch's rows", "pairs"))
        return
    if dims:
        (dim,) = dims
        for out in op.outputs():
            if out.dim() > dim and out.shape[dim] == q.shape[dim]:
                op.put(out, dim)
