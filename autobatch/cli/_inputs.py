"""Reading the command line: the model, sample, loss and the device to size for."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from autobatch._errors import BatchSizeError
from autobatch._memory._backends import memory_for, resolve_device
from autobatch._oom import oom_kind
from autobatch._sizing._workload import LossFn, language_model_loss
from autobatch._units import format_bytes, parse_bytes
from autobatch.cli._parser import _LOSSES, UsageError
from autobatch.testing import SimulatedGPU


def _load(spec: str, option: str) -> Any:
    """The object ``package.module:attribute`` names (the current directory is importable)."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"{option} {spec!r}: write package.module:callable, e.g. mypkg.models:resnet")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"{option} {spec!r}: cannot import {module_name!r} ({error})") from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"{option} {spec!r}: {module_name} has no {attribute!r}") from None
    return target


def _make_model(spec: str) -> nn.Module:
    factory = _load(spec, "--model")
    model = factory if isinstance(factory, nn.Module) else None
    if model is None:
        if not callable(factory):
            raise UsageError(f"--model {spec!r} is a {type(factory).__name__}, not a callable")
        model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _takes_size(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` has a required positional parameter (it is ``n -> batch``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    )


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    shape = tuple(int(part) for part in parts if part.isdigit())
    if len(shape) != len(parts) or any(d < 1 for d in shape):
        raise UsageError(
            f"--sample-shape {text!r}: give the shape of one row as positive ints, e.g. 3,224,224"
        )
    return shape


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {name!r} is not a torch dtype; e.g. float32, bfloat16, int64")
    return dtype


def _parse_labels(text: str) -> int | str | None:
    """``classes:N`` gives N, ``tokens`` gives "tokens", ``none`` None."""
    if text in ("none", "tokens"):
        return None if text == "none" else text
    kind, _, count = text.partition(":")
    if kind == "classes" and count.isdigit() and int(count) >= 1:
        return int(count)
    raise UsageError(
        f"--labels {text!r}: write classes:N (e.g. classes:1000), tokens (a language model: the "
        "labels are the input tokens) or none"
    )


@dataclass(frozen=True)
class _Sample:
    value: Any
    classes: int | None
    text: str
    tokens: bool = False


def _make_sample(args: argparse.Namespace, length: int | None = None) -> _Sample:
    """The sample the command line describes; at sequence ``length`` (``--lengths``), the first
    dimension of ``--sample-shape`` is the length, and a ``--sample`` factory is called with
    ``length=``."""
    if args.sample is not None:
        if args.labels != "none":
            raise UsageError("--labels goes with --sample-shape; a --sample makes its own labels")
        factory = _load(args.sample, "--sample")
        if length is not None:
            try:
                accepts = "length" in inspect.signature(factory).parameters
            except (TypeError, ValueError):
                accepts = False
            if not accepts:
                raise UsageError(
                    f"--lengths with --sample {args.sample}: the factory must take length= (a "
                    "function of the sequence length returning a few rows at that length)"
                )
            return _Sample(factory(length=length), None, f"{args.sample}(length=L)")
        if not callable(factory):
            return _Sample(factory, None, args.sample)
        if _takes_size(factory):
            return _Sample(factory, None, f"{args.sample}(n)")
        return _Sample(factory(), None, f"{args.sample}()")
    shape = _parse_shape(args.sample_shape)
    if length is not None:
        shape = (length, *shape[1:])
    dtype = _parse_dtype(args.dtype)
    labels = _parse_labels(args.labels)
    generator = torch.Generator().manual_seed(0)  # never touches the global RNG
    if dtype.is_floating_point or dtype.is_complex:
        inputs = torch.randn((1, *shape), generator=generator).to(dtype)
    else:
        inputs = torch.zeros((1, *shape), dtype=dtype)
    text = f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
    if labels is None:
        return _Sample(inputs, None, text)
    if labels == "tokens":
        if dtype.is_floating_point or dtype.is_complex or len(shape) != 1:
            raise UsageError(
                f"--labels tokens needs token ids: --sample-shape LENGTH --dtype int64, not "
                f"{text}"
            )
        return _Sample(inputs, None, f"{text} tokens, labels the tokens", tokens=True)
    assert isinstance(labels, int)
    target = torch.randint(0, labels, (1,), generator=generator)
    return _Sample((inputs, target), labels, f"{text} with a label of {labels} classes")


def _language_model_sample(sample: _Sample, model: nn.Module) -> tuple[Any, LossFn | None]:
    """``--labels tokens``: the model's own loss when its forward takes ``labels=`` (a Hugging
    Face model: ``{input name: tokens, "labels": tokens}``), else ``(tokens, tokens)`` and a
    next-token cross-entropy over the logits."""
    tokens = sample.value
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters]
    if "labels" in names and parameters and parameters[0].name != "labels":
        return {parameters[0].name: tokens, "labels": tokens}, None
    return (tokens, tokens), language_model_loss


def _make_loss(spec: str, classes: int | None) -> Callable[..., torch.Tensor] | None:
    if spec == "auto":
        return nn.functional.cross_entropy if classes is not None else None
    if spec in _LOSSES:
        return _LOSSES[spec]
    loss = _load(spec, "--loss")
    if not callable(loss):
        raise UsageError(f"--loss {spec!r} is not callable")
    return loss  # type: ignore[no-any-return]


def _parse_sizes(text: str, option: str = "--candidates", what: str = "batch sizes") -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    sizes = [int(part) for part in parts if part.isdigit()]
    if len(sizes) != len(parts) or any(s < 1 for s in sizes):
        raise UsageError(f"{option} {text!r}: give positive {what}, e.g. 16,32,64")
    return sizes



@dataclass(frozen=True)
class _Target:
    """Where to run: a real device, or the CPU under a simulated GPU of ``simulate`` bytes."""

    device: torch.device
    simulate: int | None
    defaulted: bool


def _target(args: argparse.Namespace, default_simulated: str) -> _Target:
    simulate: str | None = args.simulate
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    if simulate is not None and simulate.lower() != "off":
        if device.type != "cpu":
            raise UsageError(
                f"--simulate runs on the CPU, but --device {args.device} was given; drop one"
            )
        try:
            size = parse_bytes(simulate, name="--simulate")
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None
        return _Target(torch.device("cpu"), size, defaulted=False)
    try:
        memory_for(device)  # fails clearly for a device this machine does not have
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    if device.type == "cpu" and simulate is None:
        return _Target(device, parse_bytes(default_simulated), defaulted=True)
    if device.type == "cpu" and getattr(args, "max_batch", None) is None:
        raise UsageError(
            "--simulate off on the CPU searches host memory, where running out can bring in the "
            "operating system's out-of-memory killer instead of an error; give --max-batch N"
        )
    return _Target(device, None, defaulted=False)


@contextlib.contextmanager
def _running_on(target: _Target, model: nn.Module) -> Iterator[None]:
    """Moves the model to the device, or runs under the simulated GPU with the model counted.

    A model that does not fit at all is a :class:`~autobatch.BatchSizeError` (nothing fits).
    """
    failed: str | None = None
    if target.simulate is None:
        try:
            model.to(target.device)
        except Exception as error:
            failed = oom_kind(error)
            if failed is None:
                raise
        if failed is not None:  # out of the except block: the partial copy is gone
            _model_does_not_fit(model, target, failed)
        yield
        return
    with SimulatedGPU(target.simulate) as gpu:
        try:
            gpu.adopt(model)
        except torch.OutOfMemoryError:
            failed = "cuda_allocator"
        if failed is not None:
            _model_does_not_fit(model, target, failed)
        yield


def _model_does_not_fit(model: nn.Module, target: _Target, kind: str) -> NoReturn:
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    capacity = target.simulate or memory_for(target.device).capacity_bytes()
    raise BatchSizeError(
        f"the model alone ({format_bytes(size)} of parameters and buffers) does not fit in "
        f"{format_bytes(capacity)} ({kind}), so no batch can run; use a device with more memory"
        + (" (--simulate a larger size)" if target.simulate else ""),
        batch_size=1,
        needed_bytes=size,
        capacity_bytes=capacity,
    )


def _describe_target(target: _Target) -> str:
    if target.simulate is None:
        memory = memory_for(target.device)
        name = f"{memory.name} with {format_bytes(memory.capacity_bytes())}"
    else:
        name = f"a simulated GPU with {format_bytes(target.simulate)} on the CPU"
    if target.defaulted:
        return f"running on {name} (no GPU in use; --simulate SIZE picks another size)"
    return f"running on {name}"


