"""Models only the tests need."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autobatch.testing import SimulatedGPU
from autobatch.testing.models import mlp


class Branchy(nn.Module):
    """The test MLP, with one more operator past 16 rows: its operators change with the size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out * 2 if x.shape[0] > 16 else out


def gpt2(layers: int = 2, width: int = 64, vocab: int = 1000, positions: int = 128) -> nn.Module:
    """A Hugging Face GPT-2 language model from a small config, with random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=2, vocab_size=vocab, n_positions=positions,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert(layers: int = 2, width: int = 64, vocab: int = 1000, classes: int = 4) -> nn.Module:
    """A Hugging Face BERT sequence classifier from a small config, with random weights."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=2,
        intermediate_size=2 * width, vocab_size=vocab, max_position_embeddings=128,
        num_labels=classes,
    )
    return BertForSequenceClassification(config)


def vit(layers: int = 2, width: int = 64, image: int = 32, classes: int = 10) -> nn.Module:
    """A Hugging Face ViT image classifier from a small config (4x4 patches), random weights."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=image, patch_size=4, num_channels=3, hidden_size=width,
        num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * width,
        num_labels=classes,
    )
    return ViTForImageClassification(config)


def llama(layers: int = 2, width: int = 64, vocab: int = 1000, kv_heads: int = 2) -> nn.Module:
    """A Hugging Face Llama language model from a small config, with random weights
    (``kv_heads=1``: grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def fits_two_steps(
    model: nn.Module, opt_cls: Any, make: Callable[[], tuple[torch.Tensor, torch.Tensor]], n: int,
    capacity: int, sample_rows: int,
) -> bool:
    """Do two real training steps (steady state) at batch ``n`` fit on a fresh simulator
    with the exact allocator (the truth of byte-exact tests; under the caching allocator it is
    :func:`fresh_loop_fits`)? ``make()`` gives the sample (``sample_rows`` rows), called on the
    simulator; its rows are cycled to ``n``. The model's state is put back afterwards."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = opt_cls(model.parameters())
    rows = torch.arange(n) % sample_rows  # made off the simulator: not part of the step
    try:
        with SimulatedGPU(capacity, allocator="exact") as gpu:
            gpu.adopt(model)
            x, y = make()
            xb, yb = x[rows], y[rows]
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(state)


def fresh_loop_peaks(
    template: nn.Module, sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n: int,
    capacity: int | str, *, steps: int = 5, **simulator: Any,
) -> tuple[int, int] | None:
    """A user's own plain loop, ``steps`` steps at batch ``n``: a fresh copy of ``template`` on
    a fresh simulator, a fresh AdamW, and each step a new batch copied to the device (``x, y =
    x.to(device), y.to(device)``), ``loss = ...`` held until the next one. Its allocated and
    reserved peaks, or ``None`` when it ran out of memory."""
    model = copy.deepcopy(template)
    host = [sample(n) for _ in range(2)]  # the loader's batches, in host memory
    try:
        with SimulatedGPU(capacity, **simulator) as gpu:
            gpu.adopt(model)
            opt = torch.optim.AdamW(model.parameters())
            for i in range(steps):
                x, y = (t.clone() for t in host[i % 2])  # .to(device)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
    except torch.OutOfMemoryError:
        return None
    return gpu.peak_bytes, gpu.peak_reserved_bytes


def fresh_loop_fits(
    template: nn.Module, sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n: int,
    capacity: int | str, *, steps: int = 5, **simulator: Any,
) -> bool:
    """Does a user's own plain loop (:func:`fresh_loop_peaks`) train ``steps`` steps at ``n``?"""
    return fresh_loop_peaks(template, sample, n, capacity, steps=steps, **simulator) is not None
