"""How torch's operators move the batch's rows (see :mod:`._rows`): the tags, one operator's
call as the rules see it, and the rules of arithmetic (elementwise, reductions, products,
attention, normalisations, losses). The rules of shapes are in :mod:`._row_shapes`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autobatch._recovery._inspect import engine_work, user_frame

AGG = -1  #: a sum or mean over the rows
FREE = -2  #: no rows left, but made from them (tainted)
ONE = -3  #: one row of the batch (``x[i]``, a loop over the rows): ``order`` holds its row
PACKED = -4  #: a packed sequence's data and what an RNN makes of it (``order``: the rows packed)


@dataclass(frozen=True)
class Taint:
    """Where the rows were first mixed: ``what`` the operator did, ``where`` the user's line,
    and the ``kind`` of mixing (``"pairs"``, ``"broadcast"``, ``"mixes"`` or ``"count"``)."""

    what: str
    where: str
    kind: str


@dataclass(frozen=True)
class Tag:
    """Where a tensor holds the batch's rows: ``dim`` (or :data:`AGG`, :data:`FREE`)."""

    dim: int
    taint: Taint | None = None
    segments: tuple[int, ...] | None = None  # rows concatenated along dim, their sizes
    #: how many consecutive indices of ``dim`` one row spans (a reshape merged the rows with
    #: the dimensions after them: ``(rows, heads) -> rows * heads`` spans ``heads``)
    inner: int = 1
    #: which of the batch's rows each index of ``dim`` holds, where an index reordered or
    #: selected them (``None``: the batch's own order)
    order: torch.Tensor | None = None
    #: an aggregate that counts the same for every row (``mask.sum()`` with no row masked
    #: more than another): how much each row counts (dividing by it is a mean by rows)
    even: float | None = None
    #: an aggregate's kind: a sum over the rows (``True``, times a constant: ``l.sum() / 16``),
    #: a mean over them (``False``), or not known (``None``)
    total: bool | None = None
    #: a term without rows that learns (a penalty on the weights) was added to the aggregate
    constant: bool = False
    #: a sum's count: how many of the batch's elements each of its elements adds up (dividing
    #: by it, ``l.sum() / l.numel()``, makes a mean); 0 where not known
    summed: int = 0
    #: what the means in an aggregate divide by: the rows (``"rows"``, or a count in
    #: proportion to them) or the items ``items=`` counts (``"items"``: tokens kept)
    basis: frozenset[str] = frozenset()


class Watch(Protocol):
    """What a rule needs of the watch: the tags, the ``.item()`` values, the rows, items."""

    tags: WeakIdKeyDictionary
    values: set[float]
    picks: dict[int, Taint]  # ``.item()`` of an index computed from all the rows (an argmax)
    reads: list[tuple[float, bool]]  # ``.item()`` of sums (``True``) and means over the rows
    positions: WeakIdKeyDictionary  # tensors made from positions (arange, linspace) of the rows
    selections: list[torch.Tensor]  # under items=: the rows each mean of the loss picked
    rows: int
    even_used: bool  # a count that depends on the batch's content was found even per row
    counts: list[float]  # what each row counted there
    ignored: set[int]  # the ignore_index of each cross-entropy whose count that was
    masked: bool  # a count other than a cross-entropy's (a mask's sum): always checked
    storages: set[int]  # the storages of the micro-batch's own tensors

    @property
    def items(self) -> bool: ...


def flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments (in lists too)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


class Op:
    """One operator's call, for a rule: its arguments by name, what it made, and tagging."""

    __slots__ = ("args", "func", "kwargs", "name", "out", "tagged", "watch")

    def __init__(self, watch: Watch, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any, tagged: list[tuple[torch.Tensor, Tag]]) -> None:
        self.watch, self.func, self.args, self.kwargs = watch, func, args, kwargs
        self.out, self.tagged = out, tagged
        self.name: str = func.overloadpacket.__name__.rstrip("_")

    @property
    def label(self) -> str:
        return self.name.lstrip("_")

    def arg(self, name: str, default: Any = None) -> Any:
        index = positions(self.func).get(name)
        if index is not None and index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def tag_of(self, t: Any) -> Tag | None:
        return self.watch.tags.get(t) if isinstance(t, torch.Tensor) else None  # type: ignore[no-untyped-call]

    @property
    def inherited(self) -> Taint | None:
        return next((tag.taint for _, tag in self.tagged if tag.taint is not None), None)

    def outputs(self) -> list[torch.Tensor]:
        out = self.out
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, (list, tuple)):
            return [t for t in out if isinstance(t, torch.Tensor)]
        return []

    def taint(self, what: str, kind: str = "mixes") -> Taint:
        """The taint of what this operator made: the first mixing upstream, or this one
        (a count, which ``items=`` may declare, hides no later mixing)."""
        inherited = self.inherited
        if inherited is not None and (inherited.kind != "count" or kind == "count"):
            return inherited
        return Taint(f"{what} (aten.{self.label})", user_frame(), kind)

    def put(self, t: torch.Tensor, dim: int, taint: Taint | None = None,
            segments: tuple[int, ...] | None = None, inner: int | None = None,
            order: torch.Tensor | bool | None = True, even: float | None = None,
            total: bool | None = None, constant: bool = False, summed: int = 0,
            basis: frozenset[str] | None = None) -> None:
        """Tag ``t``; ``inner`` and ``order`` by default those of the first input with rows
        (a dimension carried over whole; ``order=None``: the batch's own order); an
        aggregate's ``basis`` by default every aggregate input's."""
        taint = taint or self.inherited
        if dim >= t.dim():
            dim = FREE
        if dim == FREE and taint is None:
            self.watch.tags.pop(t, None)  # type: ignore[no-untyped-call]
            return
        rows = self.rows()
        if inner is None:
            inner = rows[0][1].inner if rows and dim >= 0 else 1
        aggregate = dim == AGG
        # (an aggregate made from one aggregate alone, a view or a copy of it, keeps its record:
        # einsum's Gram matrix summed over the rows stays a sum through the views after its bmm)
        sole = self.tagged[0][1] if aggregate and len(self.tagged) == 1 and (
            self.tagged[0][1].dim == AGG) else None
        if order is True:
            order = rows[0][1].order if rows and dim >= 0 else None
            if sole is not None:
                order = sole.order  # (the rows a sum one row at a time added)
        kept = order if isinstance(order, torch.Tensor) else None
        if sole is not None and total is None and not constant:
            total, constant, summed = sole.total, sole.constant, sole.summed
        if basis is None:
            basis = frozenset().union(*(tag.basis for _, tag in self.tagged if tag.dim == AGG))
        self.watch.tags[t] = Tag(dim, taint, segments, inner, kept, even if aggregate else None,
                                 total if aggregate else None, constant and aggregate,
                                 summed if aggregate and total else 0,
                                 basis if aggregate else frozenset())

    def put_all(self, dim: int, taint: Taint | None = None,
                segments: tuple[int, ...] | None = None, inner: int | None = None,
                order: torch.Tensor | bool | None = True, even: float | None = None,
                total: bool | None = None, constant: bool = False, summed: int = 0,
                basis: frozenset[str] | None = None) -> None:
        for t in self.outputs():
            self.put(t, dim, taint, segments, inner, order, even, total, constant, summed,
                     basis)

    def summing(self, t: torch.Tensor) -> int:
        """How many elements of ``t`` each element of this operator's output adds up."""
        outs = self.outputs()
        return t.numel() // max(outs[0].numel(), 1) if outs else 0

    def kind(self) -> tuple[bool | None, bool]:
        """The kind of the aggregates among the inputs, as a linear operator leaves it
        (``(total, constant)`` of :class:`Tag`): the one kind they share (else not known), and
        whether a term without rows that learns joins them (``loss + penalty``)."""
        kinds = {tag.total for _, tag in self.tagged if tag.dim == AGG}
        total = kinds.pop() if len(kinds) == 1 else None
        constant = any(tag.constant for _, tag in self.tagged if tag.dim == AGG) or (
            self.name in ("add", "sub", "rsub") and any(
                t.requires_grad for t in flat(self.args, self.kwargs) if self.tag_of(t) is None))
        return total, constant

    def orders_agree(self) -> bool:
        """Whether every input with rows holds them in one order (else a row meets another)."""
        rows = self.rows()
        first = rows[0][1].order if rows else None
        if all(tag.order is first for _, tag in rows):
            return True
        with engine_work(), torch.no_grad():
            base = _ids(rows[0][0], rows[0][1])
            return all(torch.equal(_ids(t, tag), base) for t, tag in rows[1:])

    def paired(self) -> Taint:
        return self.taint("the batch's rows paired with other rows of the batch (reordered "
                          "by an index, flipped or rolled)", "pairs")

    def rows(self) -> list[tuple[torch.Tensor, Tag]]:
        return [(t, tag) for t, tag in self.tagged if tag.dim >= 0]

    def aggregates(self) -> bool:
        return any(tag.dim == AGG for _, tag in self.tagged)

    def mixed(self) -> Taint:
        return self.taint("a sum or mean over the batch's rows combined with the rows "
                          "themselves (a normalisation over the batch)")


def _ids(t: torch.Tensor, tag: Tag) -> torch.Tensor:
    """The rows each index of ``tag.dim`` holds (in the batch's own order: 0, 1, ...)."""
    if tag.order is not None:
        return tag.order
    return torch.arange(t.shape[tag.dim] // tag.inner, device=t.device)


ROWS, ITEMS = frozenset({"rows"}), frozenset({"items"})
SELECTED = ("a mean over the rows a mask or an index made from the batch selected, whose count "
            "depends on the batch's content")


def _a(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def selected(op: Op, tag: Tag) -> bool:
    """Whether ``tag`` holds the batch's rows unevenly (picked by a mask or by an index made
    from the batch: some rows, or some more often than others), so that a mean over it counts
    the batch's content. Where every row is held equally often (two masked tokens per row),
    the mean is one by rows here, and every later micro-batch is followed to check its own."""
    order, rows = tag.order, op.watch.rows
    if order is None:
        return False
    with engine_work(), torch.no_grad():
        counts = torch.bincount(order.reshape(-1), minlength=rows)
        if counts.numel() != rows or not bool((counts == counts[0]).all()) or int(counts[0]) == 0:
            return True
    if int(counts[0]) != 1:
        op.watch.even_used = op.watch.masked = True  # (checked again in the later pieces)
        op.watch.counts.append(float(counts[0]))
    return False


def note_selection(op: Op, t: torch.Tensor, tag: Tag) -> None:
    """Under ``items=``: the rows a mean of the loss averages, where a mask or an index picked
    them (one count is declared: two means over different picks cannot both be weighed)."""
    if tag.order is not None and t.requires_grad:
        op.watch.selections.append(tag.order)


def ids(t: torch.Tensor, tag: Tag) -> torch.Tensor:
    """:func:`_ids`, for the rules of shapes (in the engine's own work)."""
    with engine_work(), torch.no_grad():
        return _ids(t, tag)


_POSITIONS: dict[Any, dict[str, int]] = {}


def positions(func: Any) -> dict[str, int]:
    """An operator's positional arguments by name."""
    found = _POSITIONS.get(func)
    if found is None:
        found = _POSITIONS[func] = {
            a.name: i for i, a in enumerate(func._schema.arguments) if not a.kwarg_only
        }
    return found


def norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def keep_segments(tag: Tag, src: torch.Tensor, out: torch.Tensor, dim: int) -> tuple[int, ...] | None:
    if tag.segments is None or dim < 0 or dim >= out.dim() or tag.dim >= src.dim():
        return None
    return tag.segments if out.shape[dim] == src.shape[tag.dim] else None


# Rules ---------------------------------------------------------------------------------------

Rule = Callable[[Op], None]

#: torch's batch normalisations (their ``training`` flag, where they take one, says whether
#: they normalise by the batch's statistics)
BATCH_NORMS = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update",
    "_batch_norm_with_update_functional", "batch_norm",
})

#: operators that are linear in a tensor argument (an aggregate stays one through them)
LINEAR = frozenset({
    "add", "sub", "rsub", "neg", "mul", "div", "true_divide", "clone", "_to_copy", "detach",
    "alias", "copy", "positive", "lift_fresh", "lift_fresh_copy", "contiguous", "view",
    "_unsafe_view", "reshape", "_reshape_alias", "expand", "permute", "transpose", "t",
    "unsqueeze", "squeeze", "select", "slice", "sum", "mean", "nansum", "zeros_like",
    "empty_like", "ones_like", "full_like", "cat", "stack", "split", "chunk", "unbind",
})
_PRODUCTS = frozenset({"mul", "div", "true_divide"})
#: guards of a count (``mask.sum().clamp(min=1)``): a count still, where ``items=`` declares it
_GUARDS = frozenset({"clamp", "clamp_min", "clamp_max", "maximum", "minimum", "max", "min"})


def pointwise(op: Op) -> None:
    """Elementwise, with broadcasting: the rows of every input must meet in one dimension;
    an aggregate stays one through linear operators only, and never meets the rows."""
    outs = op.outputs()
    if not outs:
        return
    rank = outs[0].dim()
    rows = op.rows()
    watch = op.watch
    if op.name in ("div", "true_divide") and watch.values and not watch.items and not rows and (
        len(op.args) > 1 and isinstance(op.args[1], (int, float))
        and float(op.args[1]) in watch.values
    ):
        op.put_all(FREE, op.taint("a division by a count read from the batch with .item()",
                                  "count"))
        return
    if rows and op.aggregates():
        op.put_all(rows[0][1].dim + rank - rows[0][0].dim(), op.mixed())
        return
    if not rows:
        _aggregate(op)
        return
    dims = {tag.dim + rank - t.dim() for t, tag in rows}
    if len(dims) > 1:
        op.put_all(min(dims), op.taint("two tensors' rows paired with each other "
                                       "(a pairwise difference or product over the batch)",
                                       "pairs"))
        return
    if len(rows) > 1 and not op.orders_agree():
        op.put_all(dims.pop(), op.paired())
        return
    (dim,) = dims
    t, tag = rows[0]
    if _by_place(op, dim, rank):
        op.put_all(dim, op.taint("the batch's rows weighted by their place after a sort or a "
                                 "selection (a rank)"))
        return
    for out in outs:
        op.put(out, dim, segments=keep_segments(tag, t, out, dim))


def _by_place(op: Op, dim: int, rank: int) -> bool:
    """Whether a tensor without rows varies along the rows' dimension ``dim`` of the output
    where it weighs them by place: made from positions (``torch.linspace(0, 1, n)``,
    ``0.9 ** torch.arange(n)``), or meeting rows in another order than the batch's
    (``sorted * weights``)."""
    ordered = any(tag.order is not None for _, tag in op.rows())
    for other in flat(op.args, op.kwargs):
        if op.tag_of(other) is not None or not (ordered or other in op.watch.positions):
            continue
        at = dim - (rank - other.dim())
        if at >= 0 and other.shape[at] > 1:
            with engine_work(), torch.no_grad():
                first = other.narrow(at, 0, 1)
                if not bool((other == first).all()):
                    return True
    return False


def _aggregate(op: Op) -> None:
    """An elementwise operator on aggregates (and tensors without rows). A division by a
    count that every row adds to alike (``mask.sum()``, no row masked more than another) is
    a mean by the row count; any other count of the batch's content needs ``items=``."""
    aggregates = [t for t, tag in op.tagged if tag.dim == AGG]
    watch = op.watch
    if not aggregates:
        op.put_all(FREE)
        return
    evens = {tag.even for _, tag in op.tagged if tag.dim == AGG}
    even = evens.pop() if len(evens) == 1 and len(op.tagged) == 1 else None
    if op.name not in LINEAR:
        if op.name in _GUARDS and (watch.items or even is not None) and not any(
            t.requires_grad for t in aggregates
        ):
            op.put_all(AGG, even=even)  # (a count, guarded: declared, or even per row)
            return
        counts = op.name in _GUARDS and not any(t.requires_grad for t in aggregates)
        op.put_all(FREE, op.taint(f"{op.label} of a sum or mean over the batch's rows",
                                  "count" if counts else "mixes"))
        return
    divisor = op.args[1] if len(op.args) > 1 and op.name != "mul" else None
    if op.name in _PRODUCTS and (len(aggregates) > 1 or (
        divisor is not None and op.args[0] is not aggregates[0]
    )):
        kind = "count" if op.name != "mul" else "mixes"
        divided = op.tag_of(divisor)
        mean = False if (numerator := op.tag_of(op.args[0])) is not None and (
            numerator.total) else None  # (a sum divided by its count)
        if kind == "count" and not watch.items and divided is not None and (
            divided.even is not None and numerator is not None
        ):
            watch.even_used = watch.masked = True  # (a mean by rows here: checked again)
            watch.counts.append(divided.even)
            op.put_all(AGG, total=mean)
            return
        if kind == "count" and watch.items:
            op.put_all(AGG, total=mean, basis=ITEMS)
            return
        op.put_all(FREE, op.taint(
            "a division by a count or sum computed from the batch" if kind == "count"
            else "a product of two sums over the batch's rows", kind))
        return
    total, constant = op.kind()
    summed = next((tag.summed for _, tag in op.tagged if tag.dim == AGG), 0)
    basis = None
    if total and _by_the_count(op, (watch.rows, summed)):
        total = False  # (``l.sum() / len(x)``, ``l.sum() / l.numel()``: a mean)
        basis = ROWS
    op.put_all(AGG, even=even if op.name not in _PRODUCTS else None, total=total,
               constant=constant, summed=summed, basis=basis)


def _by_the_count(op: Op, counts: tuple[int, ...]) -> bool:
    """Whether ``op`` divides by one of ``counts`` (``/ len(x)``, ``/ float(len(x))``,
    ``/ torch.tensor(len(x))``, ``* (1 / len(x))``)."""
    if op.name not in ("div", "true_divide", "mul") or len(op.args) < 2:
        return False
    value = op.args[1]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or op.tag_of(value) is not None or value.is_complex():
            return False
        with engine_work(), torch.no_grad():
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        return False
    divisor = value if op.name != "mul" else 1 / value
    return any(count > 0 and abs(divisor - count) <= 1e-9 * count for count in counts)


def reduction(linear: bool) -> Rule:
    """A reduction over some dimensions: over the rows' a sum or mean makes an aggregate,
    anything else (max, norm, logsumexp, std) mixes them."""
    def rule(op: Op) -> None:
        t, tag = op.tagged[0]
        if tag.dim < 0:
            if tag.dim == AGG and linear:
                summed = tag.summed * (op.summing(t) if op.name != "mean" else 1)
                op.put_all(AGG, total=tag.total, constant=tag.constant, summed=summed)
            else:
                op.put_all(FREE, op.taint(f"{op.label} of a sum or mean over the batch's rows")
                           if tag.dim == AGG else None)
            return
        dim = op.arg("dim")
        rank = t.dim()
        if dim is None or dim == []:
            reduced = set(range(rank))
        elif isinstance(dim, int):
            reduced = {norm(dim, rank)}
        else:
            reduced = {norm(d, rank) for d in dim}
        if tag.dim in reduced:
            if linear and op.name == "mean" and not op.watch.items and selected(op, tag):
                op.put_all(FREE, op.taint(SELECTED, "count"))
                return
            if linear and op.name == "mean" and op.watch.items:
                note_selection(op, t, tag)
            if linear:
                even = None if t.requires_grad else _even_rows(t, tag, op.watch.rows)
                op.put_all(AGG, even=even, total=op.name != "mean", summed=op.summing(t),
                           basis=(ITEMS if tag.order is not None and op.watch.items else ROWS)
                           if op.name == "mean" else frozenset())
            else:
                op.put_all(FREE, op.taint(f"{_a(op.label)} over the batch's rows"))
            return
        keep = bool(op.arg("keepdim", False))
        op.put_all(tag.dim if keep else tag.dim - sum(1 for d in reduced if d < tag.dim))
    return rule


def along(op: Op) -> None:
    """An operator along one dimension that keeps its shape (softmax, cumsum, sort, top-k)."""
    t, tag = op.tagged[0]
    if tag.dim < 0:
        op.put_all(FREE, op.taint(f"{op.label} of a sum or mean over the batch's rows")
                   if tag.dim == AGG else None)
        return
    dims = op.arg("dim", op.arg("dims", -1))
    dims = [dims] if isinstance(dims, int) else list(dims) or list(range(t.dim()))
    if tag.dim not in {norm(d, t.dim()) for d in dims}:
        op.put_all(tag.dim)
        return
    order = _permuted(op, t, tag, len(dims))
    if order is None:
        op.put_all(tag.dim, op.taint(f"{_a(op.label)} across the batch's rows"))
        return
    op.put_all(tag.dim, order=order)  # (the same rows, in another order)


def _permuted(op: Op, t: torch.Tensor, tag: Tag, dims: int) -> torch.Tensor | None:
    """The rows' order after a flip, a roll or a sort along them (of a tensor with no other
    dimension: each column of a matrix would be sorted apart), else ``None``."""
    if tag.inner != 1:
        return None
    with engine_work(), torch.no_grad():
        base = _ids(t, tag)
        if op.name == "flip" and dims == 1:
            return base.flip(0)
        if op.name == "roll" and dims == 1:
            return base.roll(op.arg("shifts")[0], 0)
        if op.name in ("sort", "argsort") and t.dim() == 1:
            out = op.out
            indices = out if isinstance(out, torch.Tensor) else out[1]
            return base[indices]
    return None


def first_input_at(*allowed: int, what: str) -> Rule:
    """Convolutions and normalisations over the dimensions after the first: rows must be in
    ``allowed`` (N; or channels, for an instance norm's reshape into a batch norm). A batch
    norm over the rows is the documented warning (statistics per micro-batch), not this."""
    def rule(op: Op) -> None:
        tag = op.tag_of(op.args[0])
        if tag is None:
            op.put_all(FREE)
            return
        if tag.dim < 0:
            op.put_all(FREE, op.mixed() if tag.dim == AGG else None)
            return
        if tag.dim in allowed or op.arg("training", True) is False:
            op.put(op.outputs()[0], tag.dim)
            return
        op.put_all(tag.dim, op.taint(f"{what} across the batch's rows"))
    return rule


def layer_norm(op: Op) -> None:
    t = op.args[0]
    tag = op.tag_of(t)
    if tag is None or tag.dim < 0:
        op.put_all(FREE, op.mixed() if tag is not None and tag.dim == AGG else None)
        return
    if tag.dim >= t.dim() - len(op.arg("normalized_shape")):
        op.put_all(tag.dim, op.taint("a normalisation across the batch's rows"))
        return
    op.put(op.outputs()[0], tag.dim)


def _even_rows(t: torch.Tensor, tag: Tag, rows: int) -> float | None:
    """What every row adds to a sum of ``t`` (a mask or a count, no gradient), where each
    adds the same; else ``None``."""
    size = t.shape[tag.dim]
    if t.numel() == 0 or t.is_complex() or size % (rows * tag.inner):
        return None
    outer = size // (rows * tag.inner)  # (rows merged inside other dimensions: [T * B])
    with engine_work(), torch.no_grad():
        blocks = t.movedim(tag.dim, 0).reshape(outer, rows, tag.inner, -1).double()
        per_row = blocks.sum((0, 2, 3))
        return float(per_row[0]) if bool((per_row == per_row[0]).all()) else None


def embedding(op: Op) -> None:
    tag = op.tag_of(op.args[1])
    if tag is not None and tag.dim >= 0:
        op.put_all(tag.dim)
    else:
        op.put_all(FREE, op.mixed() if tag is not None and tag.dim == AGG else None)


def item(op: Op) -> None:
    """``.item()`` of a sum over the rows (a count, perhaps): remembered, to see a division
    by it."""
    tag = op.tagged[0][1]
    if tag.dim == AGG and isinstance(op.out, (int, float)) and not isinstance(op.out, bool):
        op.watch.values.add(float(op.out))
        if tag.total is not None and tag.taint is None:  # (what a Python number may add up)
            op.watch.reads.append((float(op.out), tag.total))
    elif tag.taint is not None and type(op.out) is int:  # (``l[l.argmax()]``: an index)
        op.watch.picks[op.out] = tag.taint


def fallback(op: Op) -> None:
    """Any other operator: its outputs keep the rows where a dimension of theirs has the
    rows' place and size; one that loses them is taken to mix them."""
    rows = op.rows()
    if op.aggregates():
        op.put_all(FREE, op.mixed() if rows else op.taint(
            f"{op.label} of a sum or mean over the batch's rows"))
        return
    if not rows:
        op.put_all(FREE)
        return
    if len(rows) > 1 and not op.orders_agree():
        op.put_all(FREE, op.paired())
        return
    t, tag = rows[0]
    size = t.shape[tag.dim]
    for out in op.outputs():
        if out.dim() > tag.dim and out.shape[tag.dim] == size:
            op.put(out, tag.dim)
            continue
        same = [k for k, s in enumerate(out.shape) if s == size] or [
            k for k, s in enumerate(out.shape) if s == op.watch.rows]
        if len(same) == 1:
            op.put(out, same[0])
        else:
            op.put(out, FREE, op.taint(f"aten.{op.label}, which autobatch cannot follow along "
                                       "the batch's rows"))


def packed(op: Op) -> None:
    """``pack_padded_sequence``: the data holds the rows' tokens (rows merged), in the order
    of the rows packed; ``pad_packed_sequence`` gives them back as rows in that order."""
    t = op.args[0]
    tag = op.tag_of(t)
    outs = op.outputs()
    if tag is None or not outs or tag.dim != (
        PACKED if op.name == "_pad_packed_sequence" else 0
    ):
        fallback(op)
        return
    if op.name == "_pack_padded_sequence":
        op.put(outs[0], PACKED, order=tag.order)
        return
    first = bool(op.arg("batch_first", False))
    op.put(outs[0], 0 if first else 1, inner=1, order=tag.order)
    if len(outs) > 1:
        op.put(outs[1], 0, inner=1, order=tag.order)


def within_packed(op: Op) -> bool:
    """An operator on a packed sequence (an RNN's steps over it): what it makes stays packed,
    followed as a whole; met with rows, it is taken as not holding rows. Whether handled."""
    packs = [tag for _, tag in op.tagged if tag.dim == PACKED]
    if not packs or op.name == "_pad_packed_sequence":
        return False
    rest = [(t, tag) for t, tag in op.tagged if tag.dim != PACKED]
    if not rest:
        op.put_all(PACKED, order=packs[0].order)
        written = op.args[0] if op.args and op.out is op.args[0] else None
        base = getattr(written, "_base", None)  # (copied into a view of an output: pad)
        if base is not None and op.tag_of(base) is None:
            op.put(base, PACKED, order=packs[0].order)
        return True
    order, index = packs[0].order, op.arg("index")
    if op.name == "index_select" and order is not None and isinstance(index, torch.Tensor) and (
        op.args[0].shape[norm(op.arg("dim"), op.args[0].dim())] == order.numel()
    ):  # (the rows put back in the batch's order: pad_packed_sequence, an RNN's state)
        with engine_work(), torch.no_grad():
            op.put_all(norm(op.arg("dim"), op.args[0].dim()), inner=1, order=order[index])
        return True
    op.tagged = rest
    return False


_ADDS = frozenset({"add", "sub", "rsub"})


def single(op: Op) -> None:
    """An operator on one row of the batch (``x[i]``, a loop over the rows): work on that row
    alone keeps it one row; rows stacked are rows again (in that order); rows added make a sum
    over rows; anything else that meets another row mixes them."""
    rows = [(t, tag) for t, tag in op.tagged if tag.dim == ONE]
    others = [tag for _, tag in op.tagged if tag.dim != ONE]
    first = rows[0][1].order
    with engine_work(), torch.no_grad():
        same = all(tag.order is first or (
            tag.order is not None and first is not None and torch.equal(tag.order, first)
        ) for _, tag in rows)
    if same and not others:
        op.put_all(ONE, order=first)
        return
    if op.name in ("stack", "cat") and not others:
        with engine_work(), torch.no_grad():
            order = torch.cat([tag.order for _, tag in rows if tag.order is not None])
        outs = op.outputs()
        dim = norm(op.arg("dim", 0), outs[0].dim()) if outs else 0
        op.put_all(dim, inner=1, order=order if op.name == "stack" else None)
        return
    if op.name in _ADDS and all(tag.dim == AGG and tag.order is not None for tag in others):
        with engine_work(), torch.no_grad():  # (a sum over rows, one at a time: which)
            summed = torch.cat([tag.order for _, tag in op.tagged if tag.order is not None])
        op.put_all(AGG, order=summed)
        return
    op.put_all(FREE, op.taint("one row of the batch combined with other rows (x[i] with x, "
                              "or with another row)", "pairs"))
