"""Tests for autobatch._batch: the structure of a batch, with no memory involved."""

from __future__ import annotations

import dataclasses
import doctest
import re
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autobatch._batch
from autobatch._batch import (
    ambiguous_paths,
    batch_size,
    concat_batches,
    describe,
    elements_per_sample,
    map_tensors,
    move_batch,
    per_batch,
    resize_batch,
    shape_key,
    slice_batch,
    split_batch,
    tensors,
)

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Record:
    inputs: Any
    meta: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenRecord:
    inputs: Any
    count: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", 1)


class Encoding(UserDict[str, Any]):
    """Shaped like Hugging Face's BatchEncoding: a UserDict with extra keyword arguments."""

    def __init__(self, data: dict[str, Any] | None = None, encoding: Any = None) -> None:
        super().__init__(data)
        self.encoding = encoding


class Tagged(dict[str, Any]):
    """A dict subclass whose constructor does not take a plain mapping."""

    def __init__(self, tag: str, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.tag = tag


class Names(list[str]):
    """A list subclass used as a per-sample list."""


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


# --- an oracle for equality that does not use the module under test ---------------------------


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a, b), path
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys()), path
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def storages(batch: Any) -> Iterator[int]:
    for t in tensors(batch):
        if t.untyped_storage().nbytes() > 0:
            yield t.untyped_storage().data_ptr()


# --- strategies ---------------------------------------------------------------------------------


@st.composite
def batched_tensor(draw: st.DrawFn, n: int) -> torch.Tensor:
    row_shape = draw(st.lists(st.integers(0, 3), max_size=2))
    dtype = draw(st.sampled_from(DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    transposed = bool(row_shape) and draw(st.booleans())
    shape = (row_shape[0], n, *row_shape[1:]) if transposed else (n, *row_shape)
    values = torch.randint(0, 100, shape, generator=generator)
    if dtype.is_floating_point or dtype.is_complex:
        values = values / 8
    values = values.to(dtype)
    return values.transpose(0, 1) if transposed else values


broadcast_values = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=3),
    st.none(),
    st.floats(allow_nan=False, width=32),
    st.integers(-5, 5).map(torch.tensor),
    st.lists(st.integers(1, 4), max_size=3).map(torch.Size),
)


@st.composite
def node(draw: st.DrawFn, n: int, depth: int) -> tuple[Any, bool]:
    """A random piece of a batch of ``n`` rows, and whether it holds a sized leaf."""
    kinds = ["tensor", "scalar"] + (["samples"] if n > 0 else [])
    if depth < 3:
        kinds += ["dict", "ordered", "encoding", "defaultdict", "list", "tuple", "pair", "record"]
    kind = draw(st.sampled_from(kinds))
    if kind == "tensor":
        return draw(batched_tensor(n)), True
    if kind == "scalar":
        return draw(broadcast_values), False
    if kind == "samples":
        item = st.one_of(st.text(max_size=4), st.integers(), st.none(), st.floats(allow_nan=False))
        items = draw(st.lists(item, min_size=n, max_size=n))
        return draw(st.sampled_from([list, tuple, Names]))(items), True
    if kind in ("pair", "record"):
        (a, sized_a), (b, sized_b) = draw(node(n, depth + 1)), draw(node(n, depth + 1))
        return (Pair(a, b) if kind == "pair" else Record(a, b)), sized_a or sized_b
    children = draw(st.lists(node(n, depth + 1), max_size=3))
    sized = any(s for _, s in children)
    values = [v for v, _ in children]
    if kind in ("list", "tuple"):
        structural = (torch.Tensor, Mapping, list, tuple, Record)
        if values and all(
            isinstance(v, torch.Size) or not isinstance(v, structural) for v in values
        ):
            values.append(draw(batched_tensor(n)))  # otherwise it would be a per-sample list
            sized = True
        return (list(values) if kind == "list" else tuple(values)), sized
    mapping = {f"k{i}": v for i, v in enumerate(values)}
    if kind == "ordered":
        return OrderedDict(mapping), sized
    if kind == "encoding":
        return Encoding(mapping), sized
    if kind == "defaultdict":
        return defaultdict(list, mapping), sized
    return mapping, sized


@st.composite
def batches(draw: st.DrawFn, min_size: int = 1) -> tuple[Any, int]:
    n = draw(st.integers(min_size, 9))
    value, sized = draw(node(n, 0))
    if not sized:
        value = {"anchor": draw(batched_tensor(n)), "rest": value}
    return value, n


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 10))
def test_split_then_concat_is_the_identity(case: tuple[Any, int], piece_size: int) -> None:
    batch, n = case
    assert batch_size(batch) == n
    pieces = split_batch(batch, piece_size)
    starts = list(range(0, n, piece_size))
    assert [batch_size(p) for p in pieces] == [min(piece_size, n - s) for s in starts]
    for start, piece in zip(starts, pieces, strict=True):
        assert shape_key(piece) == shape_key(batch)
        assert elements_per_sample(piece) == elements_per_sample(batch)
        for part, whole in zip(tensors(piece), tensors(batch), strict=True):
            if whole.dim() == 0:
                assert part is whole
            else:
                assert torch.equal(part, whole[start : start + piece_size])
    assert_same(concat_batches(pieces), batch)


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(1, 12))
def test_resize_cycles_real_rows_into_fresh_storage(case: tuple[Any, int], rows: int) -> None:
    sample, n = case
    resized = resize_batch(sample, rows)
    assert batch_size(resized) == rows
    expected = concat_batches([slice_batch(sample, i % n, i % n + 1) for i in range(rows)])
    assert_same(resized, expected)
    assert set(storages(resized)).isdisjoint(storages(sample))
    for t in tensors(resized):
        assert t.is_contiguous()
        assert not t.requires_grad
    assert shape_key(resized) == shape_key(sample)


@settings(max_examples=50, deadline=None)
@given(batches(), st.data())
def test_slices_are_views_and_cover_the_batch(case: tuple[Any, int], data: st.DataObject) -> None:
    batch, n = case
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    piece = slice_batch(batch, start, stop)
    for part, whole in zip(tensors(piece), tensors(batch), strict=True):
        if whole.dim() > 0:
            assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    if start > 0 and stop < n:
        head, tail = slice_batch(batch, 0, start), slice_batch(batch, stop, n)
        assert_same(concat_batches([head, piece, tail]), batch)


# --- batch size and its errors -----------------------------------------------------------------


def test_inconsistent_sizes_name_the_paths_and_shapes() -> None:
    batch = {"input": torch.zeros(8, 3), "labels": torch.zeros(6)}
    message = "batch dimension 0 differs: batch['input'] has shape (8, 3) but batch['labels'] has shape (6,)"
    with pytest.raises(ValueError, match=re.escape(message)):
        batch_size(batch)


def test_inconsistent_sizes_name_nested_paths_and_per_sample_lists() -> None:
    batch = Pair(torch.zeros(4), {"a": (torch.zeros(4, 2), {"b": torch.zeros(5)}), "ids": [1, 2]})
    message = (
        "batch dimension 0 differs: batch.first has shape (4,) "
        "but batch.second['a'][1]['b'] has shape (5,) and batch.second['ids'] has 2 items"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        batch_size(batch)


@pytest.mark.parametrize(
    "batch", [{}, [], (), {"epoch": 3}, torch.tensor(1.0), "text", None, {"x": [torch.tensor(1)]}]
)
def test_a_batch_without_a_sized_leaf_is_a_type_error(batch: Any) -> None:
    with pytest.raises(TypeError, match="at least one tensor with a batch dimension"):
        batch_size(batch)


def test_zero_dim_tensors_and_scalars_are_copied_into_every_piece() -> None:
    scale, size = torch.tensor(0.5), torch.Size([3, 4])
    batch = {"x": torch.arange(4), "scale": scale, "epoch": 7, "size": size, "flag": "train"}
    assert batch_size(batch) == 4
    for piece in split_batch(batch, 3):
        assert piece["scale"] is scale
        assert piece["size"] is size
        assert (piece["epoch"], piece["flag"]) == (7, "train")


def test_per_sample_lists_are_split_and_lists_of_tensors_are_structures() -> None:
    batch = {"names": ("a", "b", "c"), "views": [torch.zeros(3, 2), torch.ones(3)]}
    first, second = split_batch(batch, 2)
    assert first["names"] == ("a", "b")
    assert second["names"] == ("c",)
    assert [tuple(t.shape) for t in second["views"]] == [(1, 2), (1,)]


def test_a_per_sample_list_sliced_to_no_rows_concatenates_back() -> None:
    batch = {"x": torch.arange(3), "names": ["a", "b", "c"]}
    empty = slice_batch(batch, 1, 1)
    assert empty["names"] == []
    assert_same(concat_batches([empty, batch, empty]), batch)


def test_a_tuple_of_another_length_is_one_value_for_the_batch() -> None:
    batch = {"x": torch.zeros(4, 2), "size": (224, 448), "box": (0, 0, 9), "ids": [1, 2, 3, 4]}
    assert batch_size(batch) == 4
    pieces = split_batch(batch, 3)
    assert [p["size"] for p in pieces] == [(224, 448), (224, 448)]
    assert [p["box"] for p in pieces] == [(0, 0, 9), (0, 0, 9)]
    assert [p["ids"] for p in pieces] == [[1, 2, 3], [4]]
    assert_same(concat_batches(pieces), batch)
    assert resize_batch(batch, 6)["size"] == (224, 448)
    assert ambiguous_paths(batch) == []
    with pytest.raises(ValueError, match="differs"):  # a list is per-sample: its length must fit
        batch_size({"x": torch.zeros(4, 2), "names": ["a", "b"]})


def test_a_tuple_as_long_as_the_batch_is_split_and_reported_ambiguous() -> None:
    batch = {"x": torch.zeros(2, 3), "ids": (5, 9)}
    assert [p["ids"] for p in split_batch(batch, 1)] == [(5,), (9,)]
    assert ambiguous_paths(batch) == ["batch['ids']"]
    assert ambiguous_paths({"ids": (5, 9)}) == []  # nothing else sets the size: it is the size
    assert batch_size({"ids": (5, 9), "more": ("a", "b")}) == 2


def test_per_batch_marks_a_value_that_is_never_split() -> None:
    size = per_batch((224, 448))
    names = per_batch(["train", "val"])
    assert size == (224, 448)
    assert isinstance(size, tuple)
    assert names == ["train", "val"]
    assert isinstance(names, list)
    batch = {"x": torch.zeros(2, 3), "size": size, "splits": names}
    pieces = split_batch(batch, 1)
    assert [(p["size"], p["splits"]) for p in pieces] == [(size, names)] * 2
    assert ambiguous_paths(batch) == []
    assert per_batch(size) is size
    with pytest.raises(TypeError, match="list or a tuple"):
        per_batch(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at least one tensor"):
        batch_size({"size": size})


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), extra=st.integers(0, 4), piece=st.integers(1, 9))
def test_tuples_split_only_when_as_long_as_the_batch(rows: int, extra: int, piece: int) -> None:
    values = tuple(range(100, 100 + rows + extra))
    batch = {"x": torch.arange(rows), "t": values}
    pieces = split_batch(batch, piece)
    if extra:
        assert all(p["t"] == values for p in pieces)
    else:
        assert [v for p in pieces for v in p["t"]] == list(values)
    assert sum(batch_size(p) for p in pieces) == rows


def test_an_empty_batch_splits_into_no_pieces() -> None:
    assert split_batch({"x": torch.zeros(0, 3)}, 2) == []
    assert batch_size({"x": torch.zeros(0, 3)}) == 0


# --- argument errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("piece_size", [0, -1])
def test_piece_size_below_one_is_a_value_error(piece_size: int) -> None:
    with pytest.raises(ValueError, match=f"piece_size must be at least 1, got {piece_size}"):
        split_batch(torch.zeros(4), piece_size)


@pytest.mark.parametrize("piece_size", [2.0, True, "2"])
def test_piece_size_must_be_an_int(piece_size: Any) -> None:
    with pytest.raises(TypeError, match="piece_size must be an int"):
        split_batch(torch.zeros(4), piece_size)


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (3, 2), (0, 5)])
def test_slice_out_of_range_is_a_value_error(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match=r"0 <= start <= stop <= batch size \(4\)"):
        slice_batch(torch.zeros(4), start, stop)


def test_resize_needs_rows() -> None:
    with pytest.raises(ValueError, match="n must be at least 1, got 0"):
        resize_batch(torch.zeros(2), 0)
    with pytest.raises(ValueError, match="sample with 0 rows"):
        resize_batch(torch.zeros(0, 2), 3)


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        concat_batches([])
    with pytest.raises(ValueError, match=r"batch\['epoch'\].*equal in every batch"):
        concat_batches([{"x": torch.zeros(1), "epoch": 1}, {"x": torch.zeros(1), "epoch": 2}])
    with pytest.raises(ValueError, match=r"batch has keys \['x', 'y'\] in batch 0"):
        concat_batches([{"x": torch.zeros(1), "y": [1]}, {"x": torch.zeros(1), "z": [1]}])
    with pytest.raises(ValueError, match=r"batch\['y'\] is a batched tensor .* in batch 0"):
        concat_batches([{"y": torch.zeros(1)}, {"y": ["a"]}])
    with pytest.raises(ValueError, match=r"batch\['y'\] has 1 items in batch 0 but 2 in batch 1"):
        concat_batches([{"y": [torch.zeros(1)]}, {"y": [torch.zeros(1), torch.zeros(1)]}])
    with pytest.raises(ValueError, match=r"batch\['y'\] is a list or tuple .* in batch 0"):
        concat_batches([{"y": []}, {"y": torch.zeros(1)}])
    with pytest.raises(ValueError, match=r"cannot concatenate batch\['y'\]"):
        concat_batches([{"y": torch.zeros(1, 2)}, {"y": torch.zeros(1, 3)}])


# --- resize -------------------------------------------------------------------------------------


def test_resize_cycles_rows_in_order() -> None:
    sample = {"x": torch.tensor([[0, 0], [1, 1], [2, 2]]), "id": ["a", "b", "c"], "epoch": 4}
    resized = resize_batch(sample, 7)
    assert resized["x"][:, 0].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert resized["id"] == ["a", "b", "c", "a", "b", "c", "a"]
    assert resized["epoch"] == 4


def test_resize_keeps_dtype_and_layout_and_drops_grad() -> None:
    weights = torch.randn(2, 3, requires_grad=True)
    image = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    resized = resize_batch({"w": weights, "image": image, "t": torch.tensor(2.0)}, 5)
    assert resized["w"].dtype == torch.float32
    assert not resized["w"].requires_grad
    assert resized["image"].is_contiguous(memory_format=torch.channels_last)
    assert resized["t"].untyped_storage().data_ptr() != 0


# --- container reconstruction -------------------------------------------------------------------


def test_containers_keep_their_types() -> None:
    batch: dict[str, Any] = {
        "enc": Encoding({"ids": torch.zeros(4, 2)}, encoding="kept only in the original"),
        "dd": defaultdict(list, {"y": torch.zeros(4)}),
        "od": OrderedDict(z=torch.zeros(4)),
        "pair": Pair(torch.zeros(4), "tag"),
        "record": Record(torch.zeros(4)),
        "frozen": FrozenRecord(torch.zeros(4)),
        "names": Names(["a", "b", "c", "d"]),
    }
    piece = slice_batch(batch, 1, 3)
    for key, value in batch.items():
        assert type(piece[key]) is type(value), key
    assert piece["dd"].default_factory is list
    assert piece["frozen"].count == 1
    assert piece["names"] == ["b", "c"]


def test_a_mapping_whose_constructor_refuses_becomes_a_dict() -> None:
    batch = Tagged("t", {"x": torch.zeros(4)})
    piece = split_batch(batch, 2)[0]
    assert type(piece) is dict
    assert list(piece) == ["x"]


# --- tensors, moving, keys and text -------------------------------------------------------------


def test_tensors_and_map_tensors_reach_every_tensor_leaf() -> None:
    batch = {"x": torch.ones(2), "nested": [torch.ones(2, 1), {"s": torch.tensor(3)}], "id": [1, 2]}
    assert len(list(tensors(batch))) == 3
    doubled = map_tensors(lambda t: t * 2, batch)
    assert [t.sum().item() for t in tensors(doubled)] == [4, 4, 6]
    assert doubled["id"] == [1, 2]


def test_move_batch_moves_tensors_and_leaves_the_rest() -> None:
    batch = {"x": torch.ones(2, 3), "id": ["a", "b"], "epoch": 1, "s": torch.tensor(1.0)}
    moved = move_batch(batch, torch.device("meta"))
    assert {t.device.type for t in tensors(moved)} == {"meta"}
    assert moved["id"] is batch["id"]
    assert moved["epoch"] == 1


def test_elements_per_sample_and_shape_key() -> None:
    short = {"ids": torch.zeros(8, 64, dtype=torch.long), "mask": torch.zeros(8, 64), "y": [0] * 8}
    long = {"ids": torch.zeros(2, 128, dtype=torch.long), "mask": torch.zeros(2, 128), "y": [0] * 2}
    assert elements_per_sample(short) == 128
    assert elements_per_sample(long) == 256
    assert elements_per_sample({"y": [1, 2]}) == 0
    assert shape_key(short) != shape_key(long)
    assert shape_key(short) == shape_key(resize_batch(short, 3))
    assert shape_key({"ids": torch.zeros(8, 64)}) != shape_key({"ids": torch.zeros(8, 64).long()})
    assert len({shape_key(short), shape_key(long)}) == 2


def test_describe() -> None:
    batch = {
        "input_ids": torch.zeros(8, 128, dtype=torch.int64),
        "pair": Pair(torch.zeros(8), torch.tensor(1.5)),
        "rest": (torch.zeros(8, 2, dtype=torch.bool), ["a"] * 8, [1, "b"] * 4),
        "epoch": 3,
    }
    assert describe(batch) == (
        "dict(input_ids: (8, 128) int64, pair: Pair(first: (8,) float32, second: () float32), "
        "rest: tuple((8, 2) bool, list of 8 str, list of 8), epoch: 3)"
    )


def test_docstring_examples_run() -> None:
    result = doctest.testmod(autobatch._batch)
    assert result.attempted > 0
    assert result.failed == 0
