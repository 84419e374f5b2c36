"""The batch's own math: a loss that couples the batch's rows is refused at the first split,
with the state unchanged, naming the operator and the user's line; per-row losses are never
refused; contrastive losses split exactly through ``embed_in_pieces`` (the cached-embedding
split), alone, under ``retry_on_oom`` and under ``SimulatedGPU``."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import autobatch
from autobatch import AutobatchError, embed_in_pieces, retry_on_oom
from autobatch.testing import SimulatedGPU, inject_oom

pytestmark = pytest.mark.usefixtures("float64")

Loss = Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def _model(seed: int = 0, out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, out))


def _data(call: int = 0, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + call)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _info_nce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, _ = batch
    za, zb = F.normalize(model(x), dim=1), F.normalize(model(x.flip(1)), dim=1)
    return F.cross_entropy(za @ zb.T / 0.1, torch.arange(len(x)))


def _max_over_rows(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none").max()


def _batch_hard_triplet(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    z = model(x)
    d = torch.cdist(z, z)
    same = y[:, None] == y[None, :]
    hardest_pos = (d * same).max(1).values
    hardest_neg = (d + 1e3 * same).min(1).values
    return (hardest_pos - hardest_neg + 1.0).clamp(min=0).mean()


def _token_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    mask = (y > 0).to(x.dtype)
    return (F.cross_entropy(model(x), y, reduction="none") * mask).sum() / mask.sum()


def _target_broadcast(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The classic shape mistake: an output of (N,) against a target of (N, 1) broadcasts to
    N x N, every row against every other (torch warns, and trains on it)."""
    x, y = batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return F.mse_loss(model(x)[:, 0], y.to(x.dtype)[:, None])


COUPLED: dict[str, tuple[Loss, str, str]] = {  # loss, the operator named, the fix named
    "InfoNCE": (_info_nce, "aten.mm", "embed_in_pieces"),
    "max over rows": (_max_over_rows, "aten.max", "mean or sum over the rows"),
    "batch-hard triplet": (_batch_hard_triplet, "aten.cdist_forward", "embed_in_pieces"),
    "token mean without items=": (_token_mean, "aten.div", "items="),
    "a target broadcast against the input": (_target_broadcast, "aten.mse_loss", "same shape"),
}


def _trainer(loss: Loss) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[Any], Any]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(batch: Any) -> torch.Tensor:
        opt.zero_grad()
        value = loss(model, batch)
        value.backward()
        opt.step()
        return value.detach()

    return model, opt, step


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]


@pytest.mark.parametrize("at_call", [0, 2])  # the first call split, or a later one
@pytest.mark.parametrize("name", list(COUPLED))
def test_a_loss_coupling_rows_is_refused_at_the_first_split_with_the_state_unchanged(
    name: str, at_call: int
) -> None:
    loss, op, fix = COUPLED[name]
    model, opt, plain = _trainer(loss)
    step = retry_on_oom(optimizer=opt)(plain)
    for call in range(at_call):
        step(_data(call))
    before = _state(model, opt)
    with inject_oom(batch_over=4), pytest.raises(AutobatchError) as refused:
        step(_data(at_call))
    message = str(refused.value)
    assert op in message
    assert fix in message
    assert "test_row_coupling.py" in message  # the user's line that mixed the rows
    after = _state(model, opt)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_token_mean_is_exact_with_items() -> None:
    reference, _, ref_step = _trainer(_token_mean)
    model, opt, plain = _trainer(_token_mean)
    step = retry_on_oom(optimizer=opt, items=lambda b: sum(v > 0 for v in b[1].tolist()))(plain)
    for call in range(3):
        batch = _data(call)
        ref_step(batch)
        with inject_oom(batch_over=3):
            step(batch)
    assert step.stats.ooms >= 1
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _tokens(n: int, padded_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 6 features and 5 token labels; rows from ``padded_from`` on have 2 labels
    ignored (-100)."""
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 4, (n, 5), generator=g)
    if padded_from is not None:
        y[padded_from:, 3:] = -100
    return x, y


def _token_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(out=20)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _token_loss(kind: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    x, y = batch
    logits = model(x).view(len(x), 5, 4).flatten(0, 1)
    if kind == "ignore_index":
        return F.cross_entropy(logits, y.flatten())
    if kind == "label smoothing":
        return F.cross_entropy(logits, y.flatten(), label_smoothing=0.1)
    mask = (y.flatten() != -100).to(x.dtype)
    return (F.cross_entropy(logits, y.flatten().clamp(min=0), reduction="none") * mask).sum() / (
        mask.sum().clamp(min=1))


@pytest.mark.parametrize("kind", ["ignore_index", "label smoothing", "masked"])
def test_a_mean_by_a_count_the_same_for_every_row_is_exact(kind: str) -> None:
    """Every row counts as many labels (none ignored, or the same number ignored in each):
    the mean is by the row count, so the split is exact and nothing is refused."""
    for padded_from in (None, 0):
        (reference, _), (model, _) = _token_model(), _token_model()
        _step_both(functools.partial(_token_loss, kind), reference, model,
                   _tokens(8, padded_from), batch_over=4)
        _close(_params(model), _params(reference))


def test_labels_masked_inside_the_step_are_followed_to_the_last_micro_batch() -> None:
    """The batch holds no -100; the step masks its labels from a mask the batch holds, the
    first micro-batch's rows all unmasked, the last one's half masked: refused, not split."""
    x, y = _tokens(8, None)
    keep = torch.ones(8, 5, dtype=torch.bool)
    keep[4:, 3:] = False
    model, opt = _token_model()
    before = _params(model)

    @retry_on_oom(optimizer=opt)
    def step(b: Any) -> None:
        opt.zero_grad()
        x, y, keep = b
        labels = y.masked_fill(~keep, -100)
        _token_loss("ignore_index", model, (x, labels)).backward()
        opt.step()

    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match="items="):
        step((x, y, keep))
    _close(_params(model), before)


@pytest.mark.parametrize("kind", ["ignore_index", "label smoothing", "masked"])
def test_a_count_even_in_the_first_micro_batch_but_not_the_last_is_refused(kind: str) -> None:
    """The first micro-batch's rows all count 5 labels, the last one's 3: judged on the first
    alone the split would be silently wrong; the last micro-batch is followed too, and the
    step is refused there, before the optimizer steps."""
    batch = _tokens(8, padded_from=4)
    model, opt = _token_model()
    before = _params(model)

    @retry_on_oom(optimizer=opt)
    def step(b: Any) -> None:
        opt.zero_grad()
        _token_loss(kind, model, b).backward()
        opt.step()

    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match="items="):
        step(batch)
    _close(_params(model), before)


# The cached-embedding split -------------------------------------------------------------------


class _Clip(nn.Module):
    """Two encoders (an image MLP; a text encoder over tokens, mean-pooled) and a learned
    temperature."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.image = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.Linear(width, 8))
        self.embed = nn.Embedding(40, width)
        self.text = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
        self.project = nn.Linear(width, 8)
        self.log_scale = nn.Parameter(torch.tensor(2.0))

    def encode(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(rows["image"]), self.project(self.text(self.embed(rows["text"])).mean(1))

    def loss(self, embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = (F.normalize(e, dim=1) for e in embeddings)
        logits = self.log_scale.exp() * a @ b.T
        labels = torch.arange(len(a))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _pairs(n: int, seed: int = 0, tokens: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(n, 12, generator=g),
            "text": torch.randint(0, 40, (n, tokens), generator=g)}


def _triplet_model(seed: int = 0) -> tuple[nn.Module, Callable[..., Any], Callable[..., Any]]:
    model = _model(seed, out=5)

    def encode(rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model(rows[0])

    def loss_of(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def loss(z: torch.Tensor) -> torch.Tensor:
            return _batch_hard_triplet(nn.Identity(), (z, labels))
        return loss

    return model, encode, loss_of


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def _step_both(loss: Callable[[nn.Module, Any], torch.Tensor], reference: nn.Module,
               model: nn.Module, batch: Any, *, batch_over: int, seed: int | None = None,
               **options: Any) -> Any:
    """One SGD step of ``loss`` on ``batch``: plain on ``reference``, and on ``model`` under
    ``retry_on_oom(**options)`` with an OOM above ``batch_over`` rows; the guarded step."""
    guarded = None
    for m in (reference, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(b: Any, m: nn.Module = m, opt: torch.optim.Optimizer = opt) -> None:
            if seed is not None:
                torch.manual_seed(seed)
            opt.zero_grad()
            loss(m, b).backward()
            opt.step()

        if m is reference:
            step(batch)
            continue
        guarded = retry_on_oom(optimizer=opt, **options)(step)
        with inject_oom(batch_over=batch_over):
            guarded(batch)
    return guarded


@pytest.mark.parametrize("pieces", [2, 3, 7])
def test_the_cached_embedding_split_of_info_nce_equals_the_unsplit_step(pieces: int) -> None:
    reference, model = _Clip(), _Clip()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chunk = -(-21 // pieces)  # 21 rows in 2, 3 and 7 micro-batches
    for call in range(3):
        batch = _pairs(21, call)
        ref_opt.zero_grad()
        ref_loss = reference.loss(reference.encode(batch))
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss = embed_in_pieces(model.encode, model.loss, batch, chunk=chunk)
        assert model.log_scale.grad is not None  # (the loss's own parameter)
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    _close(_params(model), _params(reference))


@pytest.mark.parametrize("pieces", [2, 3, 7])
def test_the_cached_embedding_split_of_a_batch_hard_triplet_equals_the_unsplit_step(
    pieces: int,
) -> None:
    reference, ref_encode, ref_loss_of = _triplet_model()
    model, encode, loss_of = _triplet_model()
    batch = _data(0, n=21)
    chunk = -(-21 // pieces)
    ref_loss_of(batch[1])(ref_encode(batch)).backward()
    embed_in_pieces(encode, loss_of(batch[1]), batch, chunk=chunk)
    _close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_a_guarded_clip_step_trains_four_times_the_largest_naive_batch_exactly() -> None:
    """Under SimulatedGPU: the naive step fits a batch of n, the guarded cached-embedding step
    trains 4n, and its parameters equal the unsplit step's on an unbounded device."""
    capacity, width, tokens = "24MiB", 256, 32

    def naive_fits(n: int) -> bool:
        model = _Clip(width=width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            with SimulatedGPU(capacity):
                for _ in range(2):
                    opt.zero_grad()
                    model.loss(model.encode(_pairs(n, tokens=tokens))).backward()
                    opt.step()
        except torch.OutOfMemoryError:
            return False
        return True

    largest = max(n for n in (8, 16, 32, 64, 128, 256) if naive_fits(n))
    assert largest <= 64, largest  # (the capacity binds)
    assert not naive_fits(2 * largest)
    n = 4 * largest
    reference, model = _Clip(width=width), _Clip(width=width)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @retry_on_oom(optimizer=opt)
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad()
        loss = embed_in_pieces(model.encode, model.loss, batch)
        opt.step()
        return loss

    for call in range(2):
        batch = _pairs(n, call, tokens=tokens)
        ref_opt.zero_grad()
        reference.loss(reference.encode(batch)).backward()
        ref_opt.step()
        with SimulatedGPU(capacity):
            step(batch)
    assert step.stats.ooms >= 1
    _close(_params(model), _params(reference))


def test_oom_guard_runs_a_cached_embedding_step_in_chunks_exactly() -> None:
    reference, model = _Clip(width=256), _Clip(width=256)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @retry_on_oom(optimizer=opt)
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad()
        loss = embed_in_pieces(model.encode, model.loss, batch)
        opt.step()
        return loss

    loader = [_pairs(128, seed, tokens=32) for seed in range(3)]
    for batch in loader:
        ref_opt.zero_grad()
        reference.loss(reference.encode(batch)).backward()
        ref_opt.step()
    with SimulatedGPU("24MiB"), autobatch.oom_guard(loader) as guard:
        for batch in guard:
            step(batch)
    assert guard.stats.ooms >= 1
    assert guard.stats.samples == 3 * 128
    _close(_params(model), _params(reference))


def test_a_grad_scaler_scales_the_loss_over_all_embeddings_exactly() -> None:
    reference, model = _Clip(), _Clip()

    def run(m: _Clip, guarded: bool) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            opt.zero_grad()
            loss = embed_in_pieces(m.encode, lambda e: scaler.scale(m.loss(e)), batch)
            scaler.step(opt)
            scaler.update()
            return loss

        run_step = retry_on_oom(optimizer=opt)(step) if guarded else step
        for call in range(3):
            with inject_oom(batch_over=6) if guarded else contextlib.nullcontext():
                run_step(_pairs(12, call))
        return run_step

    run(reference, False)
    assert run(model, True).stats.ooms == 3
    _close(_params(model), _params(reference))


def test_a_naive_split_of_the_clip_step_is_refused() -> None:
    model = _Clip()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)

    @retry_on_oom(optimizer=opt)
    def step(batch: dict[str, torch.Tensor]) -> None:
        opt.zero_grad()
        model.loss(model.encode(batch)).backward()
        opt.step()

    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match="embed_in_pieces"):
        step(_pairs(8))
    _close(_params(model), before)


class _Noisy(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(12, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros(()))
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        z = self.linear(rows["image"])
        if self.kind == "batch norm":
            return self.norm(z)
        if self.kind == "state":
            self.calls += 1
            return z
        noise = torch.rand(z.shape, generator=self.generator)  # not torch's default generator
        return z * (noise > 0.2)


@pytest.mark.parametrize(("kind", "match"), [
    ("batch norm", "BatchNorm in training mode"),
    ("state", "existed before it"),
    ("own generator", "other embeddings"),
])
def test_what_the_cached_embedding_split_cannot_keep_exact_is_refused_before_gradients_land(
    kind: str, match: str
) -> None:
    encoder = _Noisy(kind)
    with pytest.raises(AutobatchError, match=match):
        embed_in_pieces(encoder, lambda z: (z @ z.T).logsumexp(1).mean(), _pairs(8), chunk=4)
    assert all(p.grad is None for p in encoder.parameters())
    assert float(encoder.calls) == 0


def test_dropout_from_torch_s_generators_is_replayed() -> None:
    torch.manual_seed(3)
    encoder = nn.Sequential(nn.Linear(12, 8), nn.Dropout(0.3))
    batch = _pairs(12)
    embed_in_pieces(lambda rows: encoder(rows["image"]), lambda z: (z @ z.T).logsumexp(1).mean(),
                    batch, chunk=5)
    assert encoder[0].weight.grad is not None


def test_find_max_batch_sizes_a_cached_embedding_step_by_its_loss() -> None:
    """With ``chunk=`` fixed, the largest batch is set by all embeddings and the loss over
    them, not by one encoder pass: larger than the naive step's."""
    def finder(chunk: int | None) -> int:
        model = _Clip(width=64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
            opt.zero_grad()
            embed_in_pieces(model.encode, model.loss, batch, chunk=chunk)
            opt.step()

        with SimulatedGPU("8MiB"):
            return autobatch.find_max_batch(
                model, _pairs(1, tokens=32), step_fn=step, max_batch=1024, headroom=0.0
            )

    assert finder(32) > 4 * finder(None)  # (measured: 362 and 64)


# Per-row steps that move rows around --------------------------------------------------------


class _Packed(nn.Module):
    """A GRU over padded rows of different lengths, packed unsorted (sorted, then put back)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, hidden = self.gru(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(hidden[-1] + padded.sum(1))


def _rows_moved(kind: str, model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, y, lengths = batch
    if kind == "packed, unsorted":
        return F.cross_entropy(model(tokens, lengths), y)
    if kind == "shuffled together":
        perm = torch.randperm(len(y))
        return F.cross_entropy(model.head(model.embed(tokens[perm]).mean(1)), y[perm])
    if kind == "a loop over the rows":
        losses = [F.cross_entropy(model.head(model.embed(tokens[i]).mean(0)), y[i])
                  for i in range(len(y))]
        return sum(losses) / len(losses)  # type: ignore[return-value]
    if kind == "stacked per-row losses":
        rows = [F.cross_entropy(model.head(model.embed(t).mean(0)), c)
                for t, c in zip(tokens.unbind(0), y.unbind(0), strict=True)]
        return torch.stack(rows).mean()
    assert kind == "selected by a mask"
    keep = y > 0
    return F.cross_entropy(model.head(model.embed(tokens)[keep].mean(1)), y[keep],
                           reduction="sum") / len(y)


@pytest.mark.parametrize("kind", ["packed, unsorted", "shuffled together",
                                  "a loop over the rows", "stacked per-row losses",
                                  "selected by a mask"])
def test_rows_reordered_selected_or_looped_over_are_not_refused(kind: str) -> None:
    g = torch.Generator().manual_seed(4)
    n = 8
    batch = (torch.randint(0, 20, (n, 6), generator=g), torch.randint(0, 3, (n,), generator=g),
             torch.randint(1, 7, (n,), generator=g))
    torch.manual_seed(0)
    reference = _Packed()
    model = copy.deepcopy(reference)
    # (seed: the same shuffle whole or split; per micro-batch it shuffles other rows)
    _step_both(functools.partial(_rows_moved, kind), reference, model, batch, batch_over=4,
               seed=7)
    if kind != "shuffled together":  # (a shuffle per micro-batch: other rows, same math)
        _close(_params(model), _params(reference))


# Properties -----------------------------------------------------------------------------------

_PER_ROW = ["linear", "conv over positions", "attention over tokens", "embedding", "layer norm",
            "softmax over features", "max over tokens", "top-k over features",
            "normalize per row", "gather per row"]
_ENDS = ["mean", "sum", "mixed", "per-row weights"]


class _RowModel(nn.Module):
    """Tokens (n, 5) -> embeddings (n, 5, 8) -> blocks that treat rows apart -> (n, 3)."""

    def __init__(self, blocks: list[str]) -> None:
        super().__init__()
        self.blocks = blocks
        self.embed = nn.Embedding(20, 8)
        self.linear = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = _block(self, block, h, tokens)
        return self.head(h.mean(1))


def _block(m: _RowModel, block: str, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    if block == "linear":
        return torch.tanh(m.linear(h))
    if block == "conv over positions":
        return m.conv(h.transpose(1, 2)).transpose(1, 2)
    if block == "attention over tokens":
        return h + m.attention(h, h, h, need_weights=False)[0]
    if block == "embedding":
        return h + m.embed(tokens.flip(1))
    if block == "layer norm":
        return m.norm(h)
    if block == "softmax over features":
        return h.softmax(-1) * 3
    if block == "max over tokens":
        return h + h.max(1, keepdim=True).values
    if block == "top-k over features":
        return h + h.topk(2, dim=-1).values.sum(-1, keepdim=True)
    if block == "normalize per row":
        return F.normalize(h, dim=-1)
    assert block == "gather per row"
    picked = h.gather(2, (tokens % 8)[..., None])
    return h * picked


def _end(end: str, out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(out, y, reduction="none")
    if end == "mean":
        return ce.mean()
    if end == "sum":
        return ce.sum()
    if end == "mixed":
        return F.cross_entropy(out, y) + 0.1 * out.pow(2).sum(1).mean() + 0.01 * out.abs().mean()
    return (ce * w).sum() / len(y)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(blocks=st.lists(st.sampled_from(_PER_ROW), min_size=1, max_size=4),
       end=st.sampled_from(_ENDS), n=st.integers(5, 9))
def test_per_row_models_are_never_refused_and_split_exactly(
    blocks: list[str], end: str, n: int
) -> None:
    g = torch.Generator().manual_seed(n)
    batch = (torch.randint(0, 20, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g),
             torch.rand(n, generator=g))
    torch.manual_seed(0)
    reference = _RowModel(blocks)
    model = copy.deepcopy(reference)
    guarded = _step_both(lambda m, b: _end(end, m(b[0]), b[1], b[2]), reference, model, batch,
                         batch_over=max(n // 3, 1), reduction="sum" if end == "sum" else "mean")
    assert guarded.stats.ooms >= 1
    _close(_params(model), _params(reference))


_MIXING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "similarity matrix": lambda z, y: F.cross_entropy(z @ z.T, torch.arange(len(z))),
    "pairwise distances": lambda z, y: torch.cdist(z, z).mean(),
    "centering over the batch": lambda z, y: (z - z.mean(0)).pow(2).mean(),
    "norm over the batch": lambda z, y: (z / z.norm(dim=0)).sum(1).mean(),
    "softmax over the batch": lambda z, y: (z.softmax(0) * torch.arange(len(z))[:, None]).sum(),
    "cumsum over the batch": lambda z, y: z.cumsum(0).pow(2).mean(),
    "max over the batch": lambda z, y: z.max(0).values.sum(),
    "sort over the batch": lambda z, y: (z.sort(0).values[:1]).sum(),
    "top-k over the batch": lambda z, y: z.topk(2, dim=0).values.sum(),
    "shuffled negatives": lambda z, y: (z * z[torch.randperm(len(z))]).sum(1).mean(),
    "rolled negatives": lambda z, y: (z * z.roll(1, 0)).sum(1).mean(),
    "halves paired": lambda z, y: (z[: len(z) // 2] * z[len(z) // 2: 2 * (len(z) // 2)]).mean(),
    "variance over the batch": lambda z, y: z.var(0).sum(),
    "logsumexp over the batch": lambda z, y: z.logsumexp(0).sum(),
    "layer norm across the batch": lambda z, y: F.layer_norm(z.T, (len(z),)).pow(3).mean(),
    "hardest example": lambda z, y: F.cross_entropy(z, y % 3, reduction="none").topk(2).values.mean(),
    "data-dependent count": lambda z, y: (z.sum(1) * (y > 0)).sum() / (y > 0).sum(),
    "first rows as anchors": lambda z, y: (z * z[:1]).sum(1).mean(),
    "one row against the rest": lambda z, y: (z - z[0]).abs().mean(),
    "flipped pairs": lambda z, y: (z * z.flip(0)).sum(1).mean(),
    "a loop pairing neighbours": lambda z, y: sum((z[i] * z[i + 1]).sum() for i in range(2)),
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(blocks=st.lists(st.sampled_from(_PER_ROW), min_size=0, max_size=2),
       mixing=st.sampled_from(sorted(_MIXING)), n=st.integers(6, 9))
def test_row_mixing_operators_are_never_split_silently(
    blocks: list[str], mixing: str, n: int
) -> None:
    torch.manual_seed(0)
    model = _RowModel(blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(n)
    batch = (torch.randint(0, 20, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g))
    before = _params(model)

    @retry_on_oom(optimizer=opt)
    def step(b: Any) -> None:
        opt.zero_grad()
        _MIXING[mixing](model(b[0]), b[1]).backward()
        opt.step()

    with inject_oom(batch_over=n // 2), pytest.raises(AutobatchError, match="micro-batches"):
        step(batch)
    _close(_params(model), before)
