"""The cached-embedding split: exact micro-batches for a loss over the whole batch's embeddings.

A contrastive loss (InfoNCE, CLIP, in-batch negatives, batch-hard triplets) compares every
row with every other, so it cannot be split by rows: :mod:`._rows` refuses that split. What
can be split is the *encoder*, which runs on each row apart. :func:`embed_in_pieces` computes
``loss(encode(batch))`` and its gradients in three passes (the method of Gao et al., 2021,
"GradCache"):

1. each chunk of rows is encoded without a graph, the random-number state saved before it;
2. the loss runs once on all the embeddings, and ``backward()`` gives the loss's gradient
   with respect to every embedding (and to the loss's own parameters: a temperature);
3. each chunk is encoded again with a graph, from the same random-number state, and
   back-propagates its slice of that gradient into the encoder.

The encoder's gradient is the sum of the chunks' parts, which is the unsplit gradient: the
update equals the unsplit step's. Memory holds one chunk's activations and the embeddings of
all rows, not every row's activations. What the method cannot keep exact is refused before
any gradient lands: BatchNorm in training mode inside the encoder (statistics per chunk), an
encoder that writes state that existed before it (running statistics, counters), and an
encoder whose second pass does not give the first pass's embeddings (randomness from a
generator autobatch cannot replay).

Under :func:`autobatch.retry_on_oom` and :func:`autobatch.oom_guard`, a step that calls it runs
whole until memory runs out; then, instead of cutting the batch into micro-batches, the engine
runs the whole batch again with the encoder in chunks of the size it chose (and smaller after
another OOM). ``chunk=`` fixes the chunk (for :func:`autobatch.find_max_batch`, which then
finds the largest batch whose embeddings and loss fit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autobatch import _distributed
from autobatch._batch import Batch, batch_size, concat_batches, map_tensors, slice_batch, tensors
from autobatch._errors import AutobatchError
from autobatch._memory._accounting import DispatchMode, op_facts, written_tensors
from autobatch._memory._backends import restore_rng_states, save_rng_states
from autobatch._recovery import _attempt, _ledger
from autobatch._recovery._inspect import _forward_module, _key, user_frame
from autobatch._recovery._row_ops import BATCH_NORMS, positions


class _Chunking(threading.local):
    rows: int | None = None


_CHUNKING = _Chunking()


@contextmanager
def chunked(rows: int) -> Iterator[None]:
    """Within: :func:`embed_in_pieces` encodes at most ``rows`` rows at a time (the engine's
    size after an out-of-memory error)."""
    outer, _CHUNKING.rows = _CHUNKING.rows, rows
    try:
        yield
    finally:
        _CHUNKING.rows = outer


def _mark() -> None:
    """Tell the engine running this step, if any, that the step embeds in pieces."""
    attempt = _attempt.current()
    if attempt is not None:
        attempt.engine.embeds = True
    ledger = _ledger.watching()
    if ledger is not None:
        ledger.host.embeds = True


def embed_in_pieces(
    encode: Callable[[Batch], Any],
    loss: Callable[[Any], torch.Tensor],
    batch: Batch,
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """``loss(encode(batch)).backward()``, exactly, with the encoder run on a few rows at a
    time when memory is short (module docs): the step's own loss, for losses that compare
    the batch's rows with each other.

    Example (CLIP):

    >>> import torch
    >>> from torch import nn
    >>> import autobatch
    >>> images, texts = nn.Linear(8, 4), nn.Linear(6, 4)
    >>> scale = nn.Parameter(torch.tensor(2.0))
    >>> def encode(rows):
    ...     return images(rows["image"]), texts(rows["text"])
    >>> def clip_loss(embeddings):
    ...     a, b = (nn.functional.normalize(e, dim=1) for e in embeddings)
    ...     logits = scale.exp() * a @ b.T
    ...     labels = torch.arange(len(a))
    ...     return (nn.functional.cross_entropy(logits, labels)
    ...             + nn.functional.cross_entropy(logits.T, labels)) / 2
    >>> batch = {"image": torch.randn(16, 8), "text": torch.randn(16, 6)}
    >>> loss = autobatch.embed_in_pieces(encode, clip_loss, batch, chunk=4)
    >>> images.weight.grad.shape, scale.grad is not None
    (torch.Size([4, 8]), True)

    Args:
        encode: Encodes rows of the batch (a slice of ``batch``, the same structure) into
            embeddings: a tensor, or a tuple, list or dict of tensors, rows first. It must
            treat rows apart (no BatchNorm in training mode, no state it writes).
        loss: The loss over all the batch's embeddings (a 0-d tensor).
        batch: The batch: a tensor or a nest of them, rows first.
        chunk: Encode at most this many rows at a time. Default: the whole batch, and under
            ``retry_on_oom`` or ``oom_guard`` the size they choose after an OOM.

    Returns:
        The loss, detached (its gradients are in ``.grad`` already).

    Raises:
        AutobatchError: the encoder cannot be run in chunks exactly (module docs).
    """
    _mark()
    n = batch_size(batch)
    limits = [c for c in (chunk, _CHUNKING.rows) if c is not None]
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    rows = min(limits) if limits else n
    if rows >= n:
        value = loss(encode(batch))
        value.backward()
        return value.detach()
    name = getattr(encode, "__qualname__", type(encode).__name__)
    if _distributed.active():
        raise AutobatchError(
            f"embed_in_pieces would encode {name}'s batch in chunks under a process group: "
            "each chunk's backward would reduce its gradients across the ranks on its own "
            "(DistributedDataParallel's reducer runs once per backward), which it cannot keep "
            "exact yet. Use a batch that fits whole on each rank"
        )
    parts = [slice_batch(batch, i, min(i + rows, n)) for i in range(0, n, rows)]
    states, cached = [], []
    with torch.no_grad(), _Forward(name):  # 1. the embeddings, without a graph
        for part in parts:
            states.append(save_rng_states())
            cached.append(encode(part))
    after = save_rng_states()
    joined = map_tensors(
        lambda t: t.detach().requires_grad_(t.is_floating_point()), concat_batches(cached)
    )
    value = loss(joined)  # 2. the loss on all of them: its gradient at each embedding
    value.backward()
    leaves = list(tensors(joined))
    start = 0
    for i, (part, state, first) in enumerate(zip(parts, states, cached, strict=True)):
        restore_rng_states(state)  # 3. each chunk again, back-propagating its slice
        again = list(tensors(encode(part)))
        size = batch_size(part)
        if not all(_same(a, b) for a, b in zip(again, tensors(first), strict=True)):
            raise AutobatchError(
                f"{name} gave other embeddings when chunk {i + 1} of {len(parts)} ran again "
                f"(at {user_frame()}), so embed_in_pieces cannot back-propagate the loss's "
                "gradient through it exactly: its randomness does not come from torch's "
                "generators (a torch.Generator of its own, numpy, random), or it depends on "
                "something that changed. Draw random numbers from torch's default generators "
                "(dropout does), or run the encoder in eval mode"
                + ("" if i == 0 else "; the gradients of the chunks before it were added")
            )
        pairs = [(t, leaf.grad[start:start + size]) for t, leaf in zip(again, leaves, strict=True)
                 if t.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        start += size
    restore_rng_states(after)
    return value.detach()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    eps = torch.finfo(a.dtype).eps
    return bool(torch.allclose(a.detach(), b, rtol=64 * eps, atol=64 * eps))


class _Forward(DispatchMode):
    """The encoder's first pass: refuses what the chunks cannot keep exact before any
    gradient lands (a batch norm in training mode; a write to a tensor that existed before
    the pass)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fresh: set[int] = set()

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        facts = op_facts(func)
        op = func.overloadpacket.__name__
        training = positions(func).get("training")
        if op in BATCH_NORMS and (training is None or args[training]):
            raise self._batch_norm()
        for t in written_tensors(facts, args, kwargs) if facts.writes else ():
            if _key(t) not in self.fresh:
                if isinstance(_forward_module(), nn.modules.batchnorm._BatchNorm):
                    raise self._batch_norm()  # (its count of batches, before its statistics)
                raise AutobatchError(
                    f"{self.name} changed a {tuple(t.shape)} tensor that existed before it "
                    f"(aten.{op}, at {user_frame()}): state an encoder writes in its forward "
                    "would be written once per chunk and again in the second pass, so "
                    "embed_in_pieces cannot keep the step exact. Keep the encoder free of "
                    "state it writes (counters, running statistics), or update it outside"
                )
        out = func(*args, **kwargs)
        if facts.fresh:
            self.fresh.update(_key(t) for t in tensors(out))
        return out

    def _batch_norm(self) -> AutobatchError:
        return AutobatchError(
            f"{self.name} runs a BatchNorm in training mode (at {user_frame()}); "
            "embed_in_pieces encodes the batch in chunks, and each chunk would be normalised "
            "by its own statistics, not the batch's. Put the encoder's BatchNorm layers in "
            "eval mode, or use LayerNorm or GroupNorm"
        )
