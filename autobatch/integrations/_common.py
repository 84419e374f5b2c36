"""What both integrations need: random streams left as they were, attributes replaced for a
while, the first rows of a dataset as a sample, and the share of a batch each piece holds."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from autobatch._batch import batch_size


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Put Python's, NumPy's and torch's random streams (CPU, and CUDA where initialised) back
    as they were on exit: building a sample may draw from them (a shuffling sampler, random
    augmentations), and training must draw the same numbers as without autobatch."""
    python = random.getstate()
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def first_rows(dataset: Any, collate: Callable[[list[Any]], Any], rows: int) -> Any:
    """The first ``rows`` examples of a map-style dataset (or the first ones an iterable
    dataset yields), collated into one batch: a sample for the search, drawn without a sampler
    (no shuffling, no worker processes)."""
    return collate(first_examples(dataset, rows))


def first_examples(dataset: Any, rows: int) -> list[Any]:
    """The first ``rows`` examples of a dataset, as :func:`first_rows` takes them, uncollated."""
    rows = max(int(rows), 1)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        examples = []
        for example in dataset:
            examples.append(example)
            if len(examples) == rows:
                break
    else:
        examples = [dataset[i] for i in range(min(len(dataset), rows))]
    if not examples:
        raise ValueError("the training dataset is empty: there is nothing to find a batch size for")
    return examples


def longest_rows(lengths: Sequence[int], rows: int) -> list[int]:
    """The indices of the ``rows`` longest examples (the first of equal ones), longest first.

    >>> longest_rows([3, 9, 1, 9, 4], 3)
    [1, 3, 4]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return order[: max(int(rows), 1)]


def dataset_length(dataset: Any) -> int | None:
    """``len(dataset)`` where it has one (a cap for the search), else ``None``."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def shares(counts: Sequence[float], rows: Sequence[int], reduction: str) -> list[float]:
    """Each piece's share of the batch's loss, as the recovery engine weights its gradients:
    ``"sum"`` adds the pieces, ``"mean"`` weights them by their items (``counts``; by their rows
    where the batch has no items)."""
    if reduction == "sum":
        return [1.0] * len(rows)
    total = float(sum(counts))
    if total > 0:
        return [c / total for c in counts]
    whole = sum(rows)
    return [n / whole for n in rows]


def rows_of(batch: Any) -> int:
    """The number of rows of a batch (dimension 0 of its tensors, or per-sample lists)."""
    return batch_size(batch)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """The optimizer's step, through the gradient scaler when there is one."""
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
