"""Checked by mypy (it is in ``files`` in pyproject.toml), never run: type checkers see the
parameters of the front-ends that take ``search_batch_size``'s options. Every ``type: ignore``
below must be needed (mypy's ``warn_unused_ignores``), so a front-end whose signature hid its
parameters (``*args, **kwargs``) would fail ``mypy``, and ``tests/test_project.py`` with it."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

import autobatch


def _calls(model: torch.nn.Module, sample: torch.Tensor) -> None:
    size = autobatch.find_max_batch(model, sample, torch.optim.SGD, headroom=0.1, max_batch=8)
    assert_type(size, int)
    autobatch.find_max_batch(model, sample, headroom="lots")  # type: ignore[arg-type]
    autobatch.find_max_batch(model, sample, max_bach=8)  # type: ignore[call-arg]
    autobatch.find_max_batch(model, sample, torch.optim.SGD, None)  # type: ignore[call-arg]
    table = autobatch.search_batch_sizes(model, lambda length: sample, [16, 32], max_batch=8)
    assert_type(table, autobatch.LengthTable)
    autobatch.search_batch_sizes(model, lambda length: sample, [16], bogus=1)  # type: ignore[call-arg]
