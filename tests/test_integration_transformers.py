"""``autobatch_trainer`` with a real Hugging Face ``Trainer`` on a small GPT-2 built from a config
(random weights), on the CPU under a simulated GPU: the size it finds, and training steps that
recover from OOM exactly (also with gradient accumulation and a loss averaged per batch)."""

from __future__ import annotations

import doctest
import math
import random
import warnings
from typing import Any

import pytest
import torch
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
    pytest.mark.usefixtures("one_thread"),
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
        assert result.oom_trials >= 1
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
    accumulation steps. Float64 throughout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 48, dtype=torch.float64)
        self.head = nn.Linear(48, VOCAB, dtype=torch.float64)

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
    _train(trainer, "400KiB", lambda t: autobatch_trainer(t, find=False))
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
    trainer = _train(_trainer(_gpt2(torch.float32), tmp_path, bf16=True), "1500KiB",
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
    _train(trainer, LARGE, lambda t: autobatch_trainer(t, find=False))
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
    _train(trainer, LARGE, lambda t: autobatch_trainer(t, find=False))
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


def test_module_examples_run() -> None:
    import autobatch.integrations.transformers as module

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
