"""``autobatch_trainer`` with a real Hugging Face ``Trainer`` on a small GPT-2 built from a config
(random weights), on the CPU under a simulated GPU: the size it finds, and training steps that
recover from OOM exactly (also with gradient accumulation and a loss averaged per batch)."""

from __future__ import annotations

import doctest
import logging
import math
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _logs import logging_set_up, nothing_configured
from torch import nn
from torch.nn import functional as F

transformers = pytest.importorskip("transformers")  # in the test extra
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import autobatch  # noqa: E402
from autobatch import AutobatchError  # noqa: E402
from autobatch.integrations.transformers import (  # noqa: E402
    autobatch_trainer,
    recovery_stats,
    search_result,
)
from autobatch.testing import OOM_KINDS, SimulatedGPU  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("one_thread", "frozen_heap"),
]


ROWS, SEQ, VOCAB = 192, 16, 64  # a few hundred examples: six optimizer steps of 32
STEPS = ROWS // 32
LARGE = "1GiB"
SMALL = "4MiB"  # a batch of 32 does not fit in float64; about a dozen rows do


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(level)


def _gpt2(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config).to(dtype)


def _data(ragged: bool = False) -> list[dict[str, torch.Tensor]]:
    """Token rows with labels; ``ragged``: each row's labels end at its own length (-100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    if ragged:
        lengths = torch.randint(2, SEQ + 1, (ROWS, 1), generator=g)
        labels[torch.arange(SEQ) >= lengths] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(ROWS)]


def _trainer(model: nn.Module, root: Any, *, batch: int = 32, accumulate: int = 1,
             ragged: bool = False, **options: Any) -> Any:
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate, num_train_epochs=1, learning_rate=0.1,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0, **{"optim": "sgd", **options},
    )
    return Trainer(model=model, args=args, train_dataset=_data(ragged))


def _train(trainer: Any, capacity: str, prepare: Any = None) -> Any:
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(trainer.model)
        if prepare is not None:
            prepare(trainer)
        trainer.train()
    return trainer


def _close(a: nn.Module, b: nn.Module, rtol: float = 1e-9, atol: float = 1e-12) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _train_loss(trainer: Any) -> float:
    return float(trainer.state.log_history[-1]["train_loss"])


# Finding ------------------------------------------------------------------------------------


def _reference_size(trainer: Any, model: nn.Module) -> int:
    """``find_max_batch`` with the Trainer's step written out: its loss normalised by the
    batch's label count and divided by the accumulation steps (1) before backward, clipping at
    1.0, its optimizer; on the same first rows of the dataset."""
    optimizer = trainer.create_optimizer()
    batch = trainer.data_collator(trainer.train_dataset[:8])

    def step(m: nn.Module, b: dict[str, torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        items = (b["labels"] != -100).sum()
        loss = m(**b, num_items_in_batch=items).loss
        (loss / 1).backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        optimizer.step()

    try:
        return autobatch.find_max_batch(model, batch, optimizer, step_fn=step, max_batch=ROWS)
    finally:
        trainer.optimizer = None


def test_find_equals_find_max_batch_on_the_same_step_and_trains_with_it(tmp_path: Any) -> None:
    model = _gpt2(torch.float32)
    trainer = _trainer(model, tmp_path, batch=8, optim="adamw_torch")
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state(), random.getstate()
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        assert autobatch_trainer(trainer, guard=False) is trainer
        found = trainer.args.per_device_train_batch_size
        assert trainer.optimizer is None  # created for the search, dropped: train() makes it
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
        assert all(p.grad is None for p in model.parameters())
        assert torch.equal(torch.get_rng_state(), rng[0])
        assert random.getstate() == rng[1]

        reference = _reference_size(trainer, model)
        result = search_result(trainer)
        assert result is not None
        # exact: the size above ran out of memory, in a trial or in the allocator's replay
        assert result.smallest_failing == result.max_batch_size + 1
        assert 1 < found == result.batch_size == reference < ROWS
        trainer.train()  # the size found trains without running out
    assert trainer.state.global_step == math.ceil(ROWS / found)


def test_find_runs_the_step_in_the_accelerators_mixed_precision(tmp_path: Any) -> None:
    """Before ``train()`` the model is not prepared yet: the trials still run under its
    autocast, with the outputs in float32, as training does."""
    model = _gpt2(torch.float32)
    trainer = _trainer(model, tmp_path, batch=8, bf16=True)
    seen: list[tuple[bool, torch.dtype, torch.dtype]] = []
    head: list[torch.dtype] = []
    model.lm_head.register_forward_hook(lambda m, a, out: head.append(out.dtype))
    model.register_forward_hook(lambda m, a, out: seen.append(
        (torch.is_autocast_enabled("cpu"), head[-1], out.logits.dtype)))
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        autobatch_trainer(trainer, guard=False)
        searched = set(seen)
        seen.clear()
        trainer.train()
    assert searched == set(seen) == {(False, torch.bfloat16, torch.float32)}
    assert "forward" not in vars(model) or hasattr(model, "_original_forward")


def test_find_checkpoints_activations_as_training_will(tmp_path: Any) -> None:
    sizes = {}
    for checkpointing in (False, True):
        model = _gpt2(torch.float32)
        trainer = _trainer(model, tmp_path, batch=8, activation_checkpointing=checkpointing)
        with SimulatedGPU("3MiB") as gpu:
            gpu.adopt(model)
            autobatch_trainer(trainer, guard=False)
            assert not model.is_activation_checkpointing  # train() turns it on, not autobatch
            sizes[checkpointing] = trainer.args.per_device_train_batch_size
            trainer.train()  # and the size found fits with it on
        assert model.is_activation_checkpointing == checkpointing
    assert sizes[True] > sizes[False]


# The guard ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("accumulate", "ragged"), [(1, False), (2, True)])
def test_guard_recovers_to_the_parameters_of_an_uninterrupted_run(
    tmp_path: Any, accumulate: int, ragged: bool
) -> None:
    """GPT-2's own loss, normalised by the tokens of the whole accumulation window
    (``num_items_in_batch``, the same for every micro-batch): the micro-batches add up. Its
    float32 cross-entropy is computed per token, so the float64 weights see no difference."""
    batch = 32 // accumulate
    reference = _train(_trainer(_gpt2(), tmp_path, batch=batch, accumulate=accumulate,
                                ragged=ragged), LARGE)
    trainer = _train(_trainer(_gpt2(), tmp_path, batch=batch, accumulate=accumulate,
                              ragged=ragged), SMALL, lambda t: autobatch_trainer(t, find=False))
    stats = recovery_stats(trainer)
    assert stats.ooms >= 1
    assert stats.micro_batch_size is not None
    assert stats.micro_batch_size < batch
    assert trainer.state.global_step == reference.state.global_step == STEPS
    _close(trainer.model, reference.model)
    assert _train_loss(trainer) == pytest.approx(_train_loss(reference), rel=1e-6)


class _TokenModel(nn.Module):
    """A model of one's own: forward takes no loss kwargs, so the Trainer does not count items
    and its loss is a mean per batch (over the batch's labelled tokens), divided by the
    accumulation steps; autobatch cannot know that, so the tests declare it
    (``reduction="mean"``). Float64 throughout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 512, dtype=torch.float64)
        self.head = nn.Linear(512, VOCAB, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
                "logits": logits}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_guard_weights_a_loss_averaged_per_batch_by_its_tokens(
    tmp_path: Any, accumulate: int
) -> None:
    batch = 32 // accumulate
    reference = _train(_trainer(_TokenModel(), tmp_path, batch=batch, accumulate=accumulate,
                                ragged=True), LARGE)
    trainer = _trainer(_TokenModel(), tmp_path, batch=batch, accumulate=accumulate, ragged=True)
    assert not trainer.model_accepts_loss_kwargs
    _train(trainer, SMALL, lambda t: autobatch_trainer(t, find=False, reduction="mean"))
    assert recovery_stats(trainer).ooms >= 1
    assert trainer.state.global_step == reference.state.global_step == STEPS
    _close(trainer.model, reference.model)
    assert _train_loss(trainer) == pytest.approx(_train_loss(reference), rel=1e-9)


def test_guard_counts_shifted_labels_for_a_causal_lm_averaged_per_batch(tmp_path: Any) -> None:
    """GPT-2 told not to take ``num_items_in_batch``: its loss is a mean over ``labels[:, 1:]``
    (the Trainer cannot tell: its loss_type is unset), so micro-batches weigh by those. Its
    float32 cross-entropy rounds each micro-batch's mean: close, not bit-equal."""

    def trainer() -> Any:
        made = _trainer(_gpt2(), tmp_path, ragged=True)
        made.model_accepts_loss_kwargs = False
        return made

    reference = _train(trainer(), LARGE)
    guarded = _train(trainer(), SMALL, lambda t: autobatch_trainer(t, find=False))
    assert recovery_stats(guarded).ooms >= 1
    _close(guarded.model, reference.model, rtol=1e-6, atol=1e-9)


def test_guard_under_bf16_mixed_precision(tmp_path: Any) -> None:
    reference = _train(_trainer(_gpt2(torch.float32), tmp_path, bf16=True), LARGE)
    trainer = _train(_trainer(_gpt2(torch.float32), tmp_path, bf16=True), "2MiB",
                     lambda t: autobatch_trainer(t, find=False))
    assert recovery_stats(trainer).ooms >= 1
    assert trainer.state.global_step == reference.state.global_step == STEPS
    _close(trainer.model, reference.model, rtol=1e-2, atol=1e-3)


def test_find_and_guard_together(tmp_path: Any) -> None:
    trainer = _train(_trainer(_gpt2(), tmp_path, batch=32), SMALL, autobatch_trainer)
    found = trainer.args.per_device_train_batch_size
    assert found < 32
    assert recovery_stats(trainer).ooms == 0  # the size found fits
    assert trainer.state.global_step == math.ceil(ROWS / found)


class _Fault:
    """CUDA's OOM error, raised once when armed: before the model's forward, or in backward
    just after the gradient of ``head.bias`` was added to what earlier batches left there."""

    def __init__(self, model: _TokenModel, where: str) -> None:
        self.calls, self.armed_at, self.fired = 0, 2, 0
        if where == "forward":
            model.register_forward_pre_hook(self.forward)
        else:
            model.head.bias.register_post_accumulate_grad_hook(self.backward)

    def forward(self, module: nn.Module, args: Any) -> None:
        self.calls += 1
        self.maybe_fire()

    def backward(self, p: torch.Tensor) -> None:
        self.calls += 1
        self.maybe_fire()

    def maybe_fire(self) -> None:
        if self.calls == self.armed_at and not self.fired:  # the 2nd batch of the 1st window
            self.fired += 1
            raise OOM_KINDS["cuda"]()


def test_accumulation_forward_oom_after_earlier_batches_recovers_exactly(tmp_path: Any) -> None:
    reference = _train(_trainer(_TokenModel(), tmp_path, batch=16, accumulate=2, ragged=True),
                       LARGE)
    trainer = _trainer(_TokenModel(), tmp_path, batch=16, accumulate=2, ragged=True)
    fault = _Fault(trainer.model, "forward")
    _train(trainer, LARGE, lambda t: autobatch_trainer(t, find=False, reduction="mean"))
    assert fault.fired == 1
    assert recovery_stats(trainer).ooms == 1
    _close(trainer.model, reference.model)


def test_accumulation_backward_oom_after_adding_to_earlier_batches_recovers_exactly(
    tmp_path: Any,
) -> None:
    """The OOM comes in backward just after a gradient was added to what the window's earlier
    batch left there (it used to be refused): those gradients are kept apart from a backward
    until it completes, so the batch is retried in micro-batches and the window is exact."""
    reference = _train(_trainer(_TokenModel(), tmp_path, batch=16, accumulate=2, ragged=True),
                       LARGE)
    trainer = _trainer(_TokenModel(), tmp_path, batch=16, accumulate=2, ragged=True)
    fault = _Fault(trainer.model, "backward")
    _train(trainer, LARGE, lambda t: autobatch_trainer(t, find=False, reduction="mean"))
    assert fault.fired == 1
    assert recovery_stats(trainer).ooms == 1
    _close(trainer.model, reference.model)


def test_refuses_what_it_cannot_split(tmp_path: Any) -> None:
    with pytest.raises(AutobatchError, match="inside backward"):
        autobatch_trainer(_trainer(_TokenModel(), tmp_path, optim="adalomo"))
    several = _trainer(_TokenModel(), tmp_path)
    several.args._n_gpu = 2
    with pytest.raises(AutobatchError, match="DataParallel"):
        autobatch_trainer(several)
    with pytest.raises(TypeError, match="step_fn"):
        autobatch_trainer(_trainer(_TokenModel(), tmp_path), step_fn=lambda m, b: None)
    with pytest.raises(TypeError, match="Trainer"):
        autobatch_trainer(object())


def test_preparing_twice_guards_the_trainers_own_step_once(tmp_path: Any) -> None:
    trainer = _trainer(_TokenModel(), tmp_path)
    autobatch_trainer(trainer, find=False)
    first = trainer.training_step
    autobatch_trainer(trainer, find=False)
    assert trainer.training_step.original is first.original
    assert type(trainer).training_step is Trainer.training_step


@pytest.mark.parametrize("name", ["transformers", "_trainer_loss", "_common"])
def test_module_examples_run(name: str) -> None:
    import importlib

    module = importlib.import_module(f"autobatch.integrations.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


def test_the_trainers_search_can_be_watched(tmp_path: Any) -> None:
    model = _gpt2(torch.float32)
    trainer = _trainer(model, tmp_path, batch=8, optim="adamw_torch")
    seen: list[Any] = []
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        autobatch_trainer(trainer, guard=False, on_trial=seen.append)
    result = search_result(trainer)
    assert result is not None
    assert seen == list(result.trials)


# The head matrix ------------------------------------------------------------------------------
#
# Each head the Trainer trains, guarded and made to run out of memory whenever more than half a
# batch goes through the model (before its forward, or in backward as the gradient reaches the
# input embeddings, after every later layer's gradient was added), against the same Trainer
# unguarded and never out of memory. Float64 models; sequential sampling (the pieces are the
# same rows every run); ragged labels padded with -100 wherever a head takes token labels.

H_ROWS, H_SEQ, H_VOCAB, H_CLASSES = 32, 8, 100, 3


class _Oom:
    """CUDA's OOM error whenever the model runs more than ``limit`` rows: before its forward,
    or in backward, as the gradient reaches the output of an embedding (after every later
    layer's gradient was added)."""

    def __init__(self, model: nn.Module, phase: str, limit: int) -> None:
        self.phase, self.limit, self.rows, self.fired = phase, limit, 0, 0
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        if phase == "backward":  # (T5's encoder and decoder hold embeddings of their own)
            embeddings = {model.get_input_embeddings()}  # type: ignore[operator]
            embeddings |= {m for m in model.modules() if isinstance(m, nn.Embedding)}
            for module in embeddings:
                module.register_forward_hook(self._arm)

    def _start(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        first = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        self.rows = first.shape[0]
        if self.phase == "forward" and self.rows > self.limit:
            self._fire()

    def _arm(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.rows > self.limit:
            out.register_hook(lambda grad: self._fire())

    def _fire(self) -> None:
        self.fired += 1
        raise OOM_KINDS["cuda"]()


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _ids(g: torch.Generator, shape: tuple[int, ...] = (H_ROWS, H_SEQ)) -> torch.Tensor:
    return torch.randint(3, H_VOCAB, shape, generator=g)


def _pad_rows(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each row's labels end at its own length (-100 after); the first two rows have none."""
    lengths = torch.randint(1, labels.shape[1] + 1, (labels.shape[0], 1), generator=g)
    lengths[:2] = 0
    labels = labels.clone()
    labels[torch.arange(labels.shape[1]) >= lengths] = -100
    return labels


def _rows(**columns: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in columns.items()} for i in range(H_ROWS)]


def _lm_rows() -> list[dict[str, torch.Tensor]]:
    g = _g()
    ids = _ids(g)
    return _rows(input_ids=ids, labels=_pad_rows(ids, g))


def _masked_rows() -> list[dict[str, torch.Tensor]]:
    g = _g()
    ids = _ids(g)
    masked = torch.rand(ids.shape, generator=g) < 0.3
    return _rows(input_ids=torch.where(masked, 2, ids), labels=torch.where(masked, ids, -100))


def _label_rows(labels: torch.Tensor, shape: tuple[int, ...] = (H_ROWS, H_SEQ)
                ) -> list[dict[str, torch.Tensor]]:
    return _rows(input_ids=_ids(_g(), shape), labels=labels)


def _classes() -> torch.Tensor:
    """A class per row; rows 2 and 3 have none (-100, which cross-entropy leaves out)."""
    classes = torch.randint(0, H_CLASSES, (H_ROWS,), generator=torch.Generator().manual_seed(6))
    classes[[2, 3]] = -100
    return classes


def _bert_config(**options: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=H_VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=H_SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **options,
    )


def _gpt2_head() -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=H_VOCAB, n_positions=H_SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=H_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=H_SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    ))


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=H_VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ))


def _bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=H_VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=H_SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    ))


def _vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=H_CLASSES,
    ))


def _images() -> list[dict[str, torch.Tensor]]:
    pixels = torch.randn(H_ROWS, 3, 8, 8, generator=_g(), dtype=torch.float64)
    return _rows(pixel_values=pixels, labels=_classes())


def _summed_token_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
                       ) -> torch.Tensor:
    """A compute_loss_func of one's own: cross-entropy summed over the labelled tokens and
    divided by the accumulation window's count, as transformers' losses do."""
    logits = outputs["logits"]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return loss / num_items_in_batch


class _MeanLossTrainer(Trainer):  # type: ignore[misc]
    """A subclassed compute_loss: its own mean over the labelled tokens, which does not use
    num_items_in_batch (the Trainer divides it by the accumulation steps)."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten())
        return (loss, outputs) if return_outputs else loss


class _CountingTrainer(Trainer):  # type: ignore[misc]
    """A compute_loss that notes the count as a number (for a log of its own) and returns the
    model's loss, which may or may not be divided by it."""

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if num_items_in_batch is not None:
            self.counts = [*getattr(self, "counts", []), int(num_items_in_batch)]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


#: head -> (model, rows, options of autobatch_trainer, of the Trainer, of TrainingArguments)
HEADS: dict[str, tuple[Callable[[], nn.Module], Callable[[], list[Any]], dict[str, Any],
                       dict[str, Any], dict[str, Any]]] = {
    "causal LM (GPT-2)": (_gpt2_head, _lm_rows, {}, {}, {}),
    "causal LM (Llama)": (_llama, _lm_rows, {}, {}, {}),
    "masked LM (BERT)": (lambda: transformers.BertForMaskedLM(_bert_config()), _masked_rows,
                         {}, {}, {}),
    "seq2seq (T5)": (_t5, _lm_rows, {}, {}, {}),
    "seq2seq (BART)": (_bart, _lm_rows, {}, {}, {}),
    "sequence classification, single-label": (
        lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=H_CLASSES)),
        lambda: _label_rows(_classes()), {}, {}, {}),
    "sequence classification, multi-label": (
        lambda: transformers.BertForSequenceClassification(_bert_config(
            num_labels=H_CLASSES, problem_type="multi_label_classification")),
        lambda: _label_rows(torch.rand(H_ROWS, H_CLASSES, generator=_g()).round().double()),
        {}, {}, {}),
    "sequence classification, regression": (
        lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=1)),
        lambda: _label_rows(torch.randn(H_ROWS, generator=_g(), dtype=torch.float64)),
        {}, {}, {}),
    "token classification": (
        lambda: transformers.BertForTokenClassification(_bert_config(num_labels=H_CLASSES)),
        lambda: _label_rows(_pad_rows(torch.randint(0, H_CLASSES, (H_ROWS, H_SEQ),
                                                    generator=_g()), _g())), {}, {}, {}),
    "question answering": (
        lambda: transformers.BertForQuestionAnswering(_bert_config()),
        lambda: _rows(input_ids=_ids(_g()),
                      start_positions=torch.randint(0, H_SEQ, (H_ROWS,), generator=_g()),
                      end_positions=torch.randint(0, H_SEQ, (H_ROWS,),
                                                  generator=torch.Generator().manual_seed(7))),
        {}, {}, {}),
    "multiple choice": (
        lambda: transformers.BertForMultipleChoice(_bert_config()),
        lambda: _label_rows(_classes().clamp(max=1), (H_ROWS, 2, H_SEQ)), {}, {}, {}),
    "image classification (ViT)": (_vit, _images, {}, {}, {}),
    "compute_loss_func of one's own": (
        lambda: transformers.BertForTokenClassification(_bert_config(num_labels=H_CLASSES)),
        lambda: _label_rows(_pad_rows(torch.randint(0, H_CLASSES, (H_ROWS, H_SEQ),
                                                    generator=_g()), _g())),
        {}, {"compute_loss_func": _summed_token_loss}, {}),
    "subclassed compute_loss (reduction='mean' declared)": (
        lambda: transformers.BertForTokenClassification(_bert_config(num_labels=H_CLASSES)),
        lambda: _label_rows(_pad_rows(torch.randint(0, H_CLASSES, (H_ROWS, H_SEQ),
                                                    generator=_g()), _g())),
        {"reduction": "mean"}, {"trainer": _MeanLossTrainer}, {}),
    "subclassed compute_loss that reads the count (causal LM)": (
        _gpt2_head, _lm_rows, {}, {"trainer": _CountingTrainer}, {}),
    "label smoothing (causal LM)": (_gpt2_head, _lm_rows, {}, {},
                                    {"label_smoothing_factor": 0.1}),
    "label smoothing, mean per batch (token classification)": (
        lambda: transformers.BertForTokenClassification(_bert_config(num_labels=H_CLASSES)),
        lambda: _label_rows(_pad_rows(torch.randint(0, H_CLASSES, (H_ROWS, H_SEQ),
                                                    generator=_g()), _g())),
        {}, {"accepts_loss_kwargs": False}, {"label_smoothing_factor": 0.1}),
}

#: Heads whose loss rounds in float32 inside transformers: the label smoother sums in float32,
#: and a mean per micro-batch rounds otherwise than the batch's (a relative 4e-8 here).
FLOAT32_LOSS = {"label smoothing, mean per batch (token classification)"}


def _head_trainer(head: str, root: Any, accumulate: int, **extra: Any) -> Any:
    build, rows, _, trainer_options, arg_options = HEADS[head]
    torch.manual_seed(0)
    model = build().to(torch.float64)
    options = dict(trainer_options)
    cls = options.pop("trainer", Trainer)
    accepts = options.pop("accepts_loss_kwargs", None)
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=8 if accumulate == 1 else 4,
        gradient_accumulation_steps=accumulate, num_train_epochs=1,
        learning_rate=0.1, lr_scheduler_type="constant", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, optim="sgd",
        train_sampling_strategy="sequential", **arg_options, **extra,
    )
    trainer = cls(model=model, args=args, train_dataset=rows(), **options)
    if accepts is not None:
        trainer.model_accepts_loss_kwargs = accepts
    return trainer


_REFERENCES: dict[tuple[str, int], tuple[nn.Module, float]] = {}


def _head_reference(head: str, root: Any, accumulate: int) -> tuple[nn.Module, float]:
    """The unguarded run's parameters and logged training loss (one run per head and
    accumulation, kept for the tests that need it)."""
    key = (head, accumulate)
    if key not in _REFERENCES:
        trainer = _head_trainer(head, root, accumulate)
        trainer.train()
        _REFERENCES[key] = trainer.model, _train_loss(trainer)
    return _REFERENCES[key]


def _head_case(head: str, phase: str, accumulate: int) -> Any:
    marks = [] if (phase, accumulate) in (("forward", 1), ("backward", 4)) else [pytest.mark.slow]
    return pytest.param(head, phase, accumulate, marks=marks, id=f"{head}-{phase}-ga{accumulate}")


@pytest.mark.parametrize(("head", "phase", "accumulate"), [
    _head_case(head, phase, accumulate)
    for head in HEADS for phase in ("forward", "backward") for accumulate in (1, 4)
])
def test_22_1_every_head_recovers_to_the_unguarded_parameters(
    tmp_path: Any, head: str, phase: str, accumulate: int
) -> None:
    reference, loss = _head_reference(head, tmp_path, accumulate)
    trainer = _head_trainer(head, tmp_path, accumulate)
    oom = _Oom(trainer.model, phase, limit=trainer.args.per_device_train_batch_size // 2)
    autobatch_trainer(trainer, find=False, **HEADS[head][2])
    trainer.train()
    stats = recovery_stats(trainer)
    assert oom.fired >= 1
    assert stats.ooms == oom.fired
    assert stats.micro_batch_size is not None
    assert stats.micro_batch_size <= oom.limit
    rtol, atol = (1e-6, 1e-9) if head in FLOAT32_LOSS else (1e-9, 1e-12)
    _close(trainer.model, reference, rtol=rtol, atol=atol)
    # (the causal LM losses sum in float32: the logged loss is that close; a micro-batch
    # without labels, whose mean is 0/0, must add nothing to it)
    assert _train_loss(trainer) == pytest.approx(loss, rel=1e-6)


def _split_run(trainer: Any, **options: Any) -> Any:
    """``trainer`` guarded, trained with every batch over half its rows out of memory."""
    _Oom(trainer.model, "forward", limit=trainer.args.per_device_train_batch_size // 2)
    autobatch_trainer(trainer, find=False, **options)
    trainer.train()
    return trainer


class _OwnStepTrainer(Trainer):  # type: ignore[misc]
    """A training_step of one's own that computes its loss without compute_loss."""

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach()


def _mean_token_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
                     ) -> torch.Tensor:
    return F.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten())


def _token_trainer(root: Any, cls: type = Trainer, **options: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(_bert_config(num_labels=H_CLASSES))
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=8, num_train_epochs=1,
        learning_rate=0.1, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0, optim="sgd", train_sampling_strategy="sequential",
    )
    rows = HEADS["token classification"][1]()
    return cls(model=model.to(torch.float64), args=args, train_dataset=rows, **options)


def _own_loss(model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
              num_items_in_batch: Any = None) -> torch.Tensor:
    """A compute_loss set on a trainer itself: a mean over the labelled tokens."""
    labels = inputs.pop("labels")
    return F.cross_entropy(model(**inputs).logits.flatten(0, 1), labels.flatten())


def _with_own_loss(root: Any) -> Any:
    trainer = _token_trainer(root)
    trainer.compute_loss = _own_loss
    return trainer


def test_22_1_a_loss_autobatch_cannot_tell_is_refused_when_a_batch_is_split(
    tmp_path: Any,
) -> None:
    """A loss that does not use num_items_in_batch and is not a head autobatch knows could be a
    mean over tokens, over rows, or a sum: refused at the first split, not guessed; so is a
    count whose value left as a number (the loss may or may not be divided by it)."""
    cases: dict[str, Callable[[Any], Any]] = {
        "the model's own": lambda root: _trainer(_TokenModel(), root, batch=8),
        "compute_loss_func": lambda root: _token_trainer(root, compute_loss_func=_mean_token_loss),
        "_MeanLossTrainer.compute_loss": lambda root: _token_trainer(root, cls=_MeanLossTrainer),
        "without calling compute_loss": lambda root: _token_trainer(root, cls=_OwnStepTrainer),
        "_CountingTrainer.compute_loss used the value": lambda root: _token_trainer(
            root, cls=_CountingTrainer),
        "_own_loss (the trainer's compute_loss)": _with_own_loss,
    }
    for what, make in cases.items():
        trainer = make(tmp_path)
        autobatch_trainer(trainer, find=False)
        trainer.train()  # nothing split: nothing to weigh, nothing refused
        with pytest.raises(AutobatchError, match="reduction='mean'") as refused:
            _split_run(make(tmp_path))
        assert what in str(refused.value), what


def test_22_1_a_declared_mean_recovers_a_compute_loss_func_that_ignores_the_count(
    tmp_path: Any,
) -> None:
    reference = _token_trainer(tmp_path, compute_loss_func=_mean_token_loss)
    reference.train()
    trainer = _split_run(_token_trainer(tmp_path, compute_loss_func=_mean_token_loss),
                         reduction="mean")
    assert recovery_stats(trainer).ooms >= 1
    _close(trainer.model, reference.model)
    assert _train_loss(trainer) == pytest.approx(_train_loss(reference), rel=1e-9)


def test_22_1_a_router_load_balancing_loss_is_refused(tmp_path: Any) -> None:
    """A mixture of experts' auxiliary loss is a function of the whole batch's routing."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=H_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=H_SEQ, output_router_logits=True,
    ))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=1,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, optim="sgd",
    )
    trainer = Trainer(model=model, args=args, train_dataset=_lm_rows())
    with pytest.raises(AutobatchError, match="load-balancing"):
        _split_run(trainer)


def test_options_of_the_loss_are_checked(tmp_path: Any) -> None:
    trainer = _trainer(_TokenModel(), tmp_path)
    with pytest.raises(ValueError, match="reduction"):
        autobatch_trainer(trainer, find=False, reduction="max")
    with pytest.raises(ValueError, match="items="):
        autobatch_trainer(trainer, find=False, items=lambda b: 1)
    with pytest.raises(TypeError, match="items"):
        autobatch_trainer(trainer, find=False, reduction="mean", items=3)


def test_22_1_the_watched_count_tells_a_loss_computed_from_it() -> None:
    from autobatch.integrations._trainer_loss import Reads, watched

    sums = torch.tensor(6.0, requires_grad=True)
    computed = {  # a loss computed from the count, as a tensor
        "divide": lambda n: sums / n, "after a move": lambda n: sums / n.to("cpu"),
        "scalar on the left": lambda n: 3.0 / n * sums, "twice": lambda n: sums / n / (n * 2),
        "through a view": lambda n: sums / n.view(1)[0],
    }
    escaped = {  # its value used, but the loss not computed from it as a tensor
        "item": lambda n: sums / n.item(), "int": lambda n: sums / int(n),
        "a comparison": lambda n: sums * 2 if n > 0 else sums, "float": lambda n: sums / float(n),
    }
    unused = {  # moved, looked at, passed along
        "move": lambda n: (n.to("cpu"), sums)[1], "is_tensor": lambda n: (torch.is_tensor(n), sums)[1],
        "format": lambda n: (f"{n}", sums)[1],
        "metadata": lambda n: ((n.shape, n.dtype, n.device, n.stride(), n.storage_offset(),
                                n.dim(), n._base, n.is_leaf), sums)[1],
        "passed along": lambda n: ({"num_items_in_batch": n}, sums)[1],
    }
    for (used, from_count), cases in (((True, True), computed), ((True, False), escaped),
                                      ((False, False), unused)):
        for name, loss_of in cases.items():
            reads = Reads()
            loss = loss_of(watched(torch.tensor(4), reads))
            assert (reads.used, reads.computed_from(loss)) == (used, from_count), name
    loss = sums / watched(torch.tensor(4), Reads())
    assert loss.item() == 1.5  # an ordinary tensor, that backpropagates
    loss.backward()
    assert sums.grad is not None
    assert sums.grad.item() == 0.25


@pytest.mark.slow
@pytest.mark.parametrize("head", ["causal LM (GPT-2)", "sequence classification, single-label"])
def test_22_1_a_compiled_model_is_weighed_as_it_runs_eagerly(tmp_path: Any, head: str) -> None:
    """Tracing the model for torch.compile looks at the count (its shape, strides): only a loss
    that divides by it makes the micro-batches add."""

    def trainer() -> Any:  # (the "eager" backend: dynamo's tracing, without a compiler)
        return _head_trainer(head, tmp_path, 1, torch_compile=True,
                             torch_compile_backend="eager")

    reference = trainer()
    reference.train()
    guarded = _split_run(trainer())
    assert recovery_stats(guarded).ooms >= 1
    _close(guarded.model, reference.model)


# The search's sample --------------------------------------------------------------------------


def _pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator that pads to the batch's longest row (labels with -100)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        labels[i, : len(r["labels"])] = r["labels"]
    return {"input_ids": ids, "labels": labels}


def _short_first() -> list[dict[str, torch.Tensor]]:
    """Eight short rows (2 to 4 tokens), then long ones (all 16)."""
    g = torch.Generator().manual_seed(2)
    lengths = [*torch.randint(2, 5, (8,), generator=g).tolist(), *[SEQ] * (ROWS - 8)]
    rows = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The same rows behind ``__getitem__``: their lengths are not at hand."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


class _WithLengths(_Rows):
    """Rows with a length column, as a ``datasets.Dataset`` may hold one."""

    column_names = ("input_ids", "labels", "length")

    def __getitem__(self, index: Any) -> Any:
        if index == "length":
            return [len(r["input_ids"]) for r in self.rows]
        return super().__getitem__(index)


def _found(tmp_path: Any, data: Any, sample: Any = None, **args: Any) -> int:
    model = _gpt2(torch.float32)
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="no", optim="sgd", **args,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=data, data_collator=_pad)
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        autobatch_trainer(trainer, guard=False, sample=sample)
    return int(trainer.args.per_device_train_batch_size)


def test_22_3_the_search_samples_the_longest_rows_it_can_find(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _short_first()
    longest = _found(tmp_path, rows, sample=_pad(rows[-8:]))
    first = _found(tmp_path, rows, sample=_pad(rows[:8]))
    assert first > longest  # the short rows alone would set a size the long ones overrun
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert _found(tmp_path, rows) == longest  # a list of rows: their lengths at hand
        assert not [r for r in caplog.records if "could not find" in r.getMessage()]
        # behind __getitem__, the lengths cost a pass over the dataset: the first rows, and
        # a warning that they differ in length
        assert _found(tmp_path, _Rows(rows)) == first
        assert _found(tmp_path, _WithLengths(rows), remove_unused_columns=False) == longest
    warned = [r.getMessage() for r in caplog.records if "could not find" in r.getMessage()]
    assert len(warned) == 1
    assert "whose lengths differ (2 to 4)" in warned[0]


@pytest.mark.slow
def test_22_3_grouping_by_length_gives_the_search_the_longest_rows(tmp_path: Any) -> None:
    rows = _short_first()
    assert _found(tmp_path, _Rows(rows), train_sampling_strategy="group_by_length") == _found(
        tmp_path, rows, sample=_pad(rows[-8:]))


# What a user sees -----------------------------------------------------------------------------


def _search_with_progress(tmp_path: Any) -> Any:
    model = _gpt2(torch.float32)
    trainer = _trainer(model, tmp_path, batch=8)
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(model)
        autobatch_trainer(trainer, guard=False, progress=True)
    return trainer


def test_22_4_the_size_and_each_recovered_oom_reach_a_user_who_configured_nothing_once(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with nothing_configured() as stream:
        found = _search_with_progress(tmp_path)
        guarded = _split_run(_token_trainer(tmp_path))
        assert logging.getLogger().handlers == []  # the library configured nothing
    lines = stream.getvalue().splitlines()
    size = found.args.per_device_train_batch_size
    assert [line for line in lines if "autobatch_trainer set" in line] == [
        line for line in lines if f"per_device_train_batch_size to {size} " in line]
    assert len([line for line in lines if "autobatch_trainer set" in line]) == 1
    recovered = [line for line in lines if "ran out of memory" in line]
    assert len(recovered) == recovery_stats(guarded).ooms >= 1
    assert all(line.startswith("transformers.trainer.Trainer.training_step: ")
               for line in recovered), recovered  # the trainer's step, not autobatch's
    assert len(lines) == 1 + len(recovered), lines
    result = search_result(found)
    assert result is not None
    shown = [line for line in capsys.readouterr().err.splitlines() if "autobatch: trial" in line]
    assert len(shown) == len(result.trials)  # progress=True: each trial once
    assert logging.getLogger("autobatch").handlers == []


def test_22_4_with_logging_set_up_no_line_is_shown_twice(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with logging_set_up() as records:
        found = _search_with_progress(tmp_path)
    result = search_result(found)
    assert result is not None
    trials = [r for r in records if r.name == "autobatch.trial"]
    assert len(trials) == len(result.trials)
    assert "autobatch: trial" not in capsys.readouterr().err  # progress adds no second line
    assert len([r for r in records if "autobatch_trainer set" in r.getMessage()]) == 1


def test_the_exactness_matrix_names_tests_that_exist_and_every_head() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent
    page = (root.parent / "docs" / "exactness_matrix.md").read_text()
    defined = set()
    for name in ("test_integration_transformers.py", "test_integration_lightning.py",
                 "test_heads_edges.py"):
        defined |= set(re.findall(r"^def (test_\w+)", (root / name).read_text(), flags=re.M))
    named = set(re.findall(r"`(test_\w+)", page))
    assert named
    assert named <= defined, named - defined
    cases = set(re.findall(r"`test_22_[12]_\w+\[(.+?)-\*\]`", page))
    assert set(HEADS) <= cases, set(HEADS) - cases
    from test_integration_lightning import LIGHTNING_FEATURES

    assert set(LIGHTNING_FEATURES) <= cases, set(LIGHTNING_FEATURES) - cases
