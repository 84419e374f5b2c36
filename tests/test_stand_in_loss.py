"""The stand-in loss (no ``loss_fn``, no labels): on a Hugging Face base model (no head) it finds
no larger batch than a user's own per-token loss on that output, under the caching allocator
(CUDA's, the simulator's default), and the search says it used one and asks for ``loss_fn=``.
(It is not a bound on every loss to the byte: under exact byte accounting GPT-2 trains one row
more with it than with a squared error, whose backward holds its target longer.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from autobatch import search_batch_size
from autobatch.testing import SimulatedGPU

pytest.importorskip("transformers")


def _base(name: str) -> tuple[nn.Module, Any]:
    """A base model from a small config (random weights) and a sample of four rows."""
    import transformers as hf

    tokens = torch.randint(0, 1000, (4, 32))
    if name == "gpt2":
        return hf.GPT2Model(hf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000,
                                          n_positions=64)), tokens
    if name == "bert":
        return hf.BertModel(hf.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
            vocab_size=1000, max_position_embeddings=64)), tokens
    if name == "llama":
        return hf.LlamaModel(hf.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)), tokens
    assert name == "vit"
    return hf.ViTModel(hf.ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128)), torch.randn(4, 3, 32, 32)


def _hidden(output: Any) -> torch.Tensor:
    hidden: torch.Tensor = output.last_hidden_state
    return hidden


def _mse(output: Any) -> torch.Tensor:
    hidden = _hidden(output)
    return nn.functional.mse_loss(hidden, torch.zeros_like(hidden))


def _token_ce(output: Any) -> torch.Tensor:  # each token's features as logits of a class
    hidden = _hidden(output).flatten(0, -2)
    return nn.functional.cross_entropy(hidden, torch.zeros(len(hidden), dtype=torch.long,
                                                           device=hidden.device))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit"])
def test_the_stand_in_finds_no_larger_batch_than_a_per_token_loss(name: str) -> None:
    torch.manual_seed(0)
    model, sample = _base(name)

    def largest(loss_fn: Callable[[Any], torch.Tensor] | None) -> int:
        with SimulatedGPU("24MiB") as gpu:
            gpu.adopt(model)
            found = search_batch_size(model, sample, torch.optim.AdamW, loss_fn=loss_fn,
                                      headroom=0)
        said = any("stand-in" in note and "loss_fn=" in note for note in found.notes)
        assert said == (loss_fn is None)
        return found.max_batch_size

    stand_in = largest(None)
    assert stand_in <= largest(_mse)
    assert stand_in <= largest(_token_ce)
