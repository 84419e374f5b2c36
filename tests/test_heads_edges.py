"""Hugging Face heads at the edges of what a split keeps exact: multiple choice with the
attention mask every tokenizer returns (exact: the mask indexes every row of rows x choices in
order), question answering under the ``Trainer`` with positions past the sequence (refused:
transformers leaves those rows out of the start's and the end's means, each with its own
count), and a counter on a LightningModule's ``self`` under the callback."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # in the test extra
from transformers import Trainer, TrainingArguments  # noqa: E402

from autobatch import AutobatchError, retry_on_oom  # noqa: E402
from autobatch.integrations.transformers import autobatch_trainer  # noqa: E402
from autobatch.testing import OOM_KINDS, check_split, inject_oom  # noqa: E402

ROWS, SEQ, VOCAB = 8, 6, 40


def _config(**options: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **options)


def _choices() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(ROWS, 2, SEQ, dtype=torch.long)
    mask[:, :, 4:] = torch.randint(0, 2, (ROWS, 2, 2), generator=g)  # (padding)
    return {"input_ids": torch.randint(3, VOCAB, (ROWS, 2, SEQ), generator=g),
            "attention_mask": mask, "labels": torch.randint(0, 2, (ROWS,), generator=g)}


@pytest.mark.usefixtures("float64")
def test_multiple_choice_with_an_attention_mask_splits_exactly() -> None:
    torch.manual_seed(0)
    reference = transformers.BertForMultipleChoice(_config()).double()
    model = copy.deepcopy(reference)
    batch = _choices()

    def make(net: nn.Module) -> Any:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(batch: dict[str, torch.Tensor]) -> None:
            opt.zero_grad()
            net(**batch).loss.backward()
            opt.step()
        return opt, step

    _, plain = make(reference)
    opt, step = make(model)
    assert check_split(step, batch, optimizer=opt)
    plain(batch)
    guarded = retry_on_oom(optimizer=opt)(step)
    with inject_oom(batch_over=ROWS // 2):
        guarded(batch)
    assert guarded.stats.ooms == 1
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class _Oom:
    """CUDA's OOM before the model's forward whenever it runs more than ``limit`` rows."""

    def __init__(self, model: nn.Module, limit: int) -> None:
        self.limit, self.fired = limit, 0
        model.register_forward_pre_hook(self._start, with_kwargs=True)

    def _start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and len(ids) > self.limit:
            self.fired += 1
            raise OOM_KINDS["cuda"]()


def test_question_answering_past_the_sequence_is_refused_under_the_trainer(
    tmp_path: Any,
) -> None:
    g = torch.Generator().manual_seed(5)
    starts = torch.randint(0, SEQ, (ROWS,), generator=g)
    starts[::3] = SEQ + 2  # (unanswerable: past the sequence, which transformers ignores)
    rows = [{"input_ids": ids, "start_positions": s, "end_positions": e} for ids, s, e in zip(
        torch.randint(3, VOCAB, (ROWS, SEQ), generator=g), starts,
        torch.randint(0, SEQ, (ROWS,), generator=g), strict=True)]
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(_config())
    before = copy.deepcopy(model.state_dict())
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=ROWS, num_train_epochs=1,
        learning_rate=0.1, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0, optim="sgd")
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    oom = _Oom(trainer.model, limit=ROWS // 2)
    autobatch_trainer(trainer, find=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AutobatchError, match="past its sequence"):
            trainer.train()
    assert oom.fired == 1
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _ctc_model(reduction: str) -> Any:
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0, ctc_loss_reduction=reduction,
        pad_token_id=0, do_stable_layer_norm=True, feat_extract_norm="layer")).double()


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_ctc_head_splits_exactly(reduction: str) -> None:
    """transformers' CTC loss picks every row's targets with ``masked_select`` (concatenated,
    with their lengths): followed as each element's row, a per-row loss."""
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(1, 12, (ROWS, 5), generator=g)
    labels[torch.arange(5) >= torch.randint(1, 6, (ROWS, 1), generator=g)] = -100
    batch = {"input_values": torch.randn(ROWS, 400, generator=g), "labels": labels}
    reference, model = _ctc_model(reduction), _ctc_model(reduction)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain_opt.zero_grad()
    reference(**batch).loss.backward()
    plain_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt, reduction="sum" if reduction == "sum" else "mean")
    def step(batch: dict[str, torch.Tensor]) -> None:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()

    with inject_oom(batch_over=ROWS // 2):
        step(batch)
    assert step.stats.ooms == 1
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("float64")
def test_a_mean_over_masked_select_is_refused_without_items() -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        opt.zero_grad()
        losses = nn.functional.cross_entropy(net(x), y, reduction="none")
        losses.masked_select(y > 0).mean().backward()
        opt.step()

    g = torch.Generator().manual_seed(2)
    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match="a mask or an index"):
        step((torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)))
