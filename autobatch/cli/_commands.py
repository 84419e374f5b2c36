"""The subcommands and the entry point: ``find``, ``demo``, ``best``, ``plan``, ``main``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import nn

from autobatch._errors import BatchSizeError
from autobatch._memory._backends import memory_for, resolve_device
from autobatch._records._cache import ResultCache, cached_search, open_cache, search_key
from autobatch._records._plot import plot
from autobatch._records._result import SearchResult, ThroughputResult, result_to_dict
from autobatch._sizing._finder import search_batch_size
from autobatch._sizing._per_length import search_batch_sizes
from autobatch._sizing._throughput import _check, find_best_batch
from autobatch._units import format_bytes, parse_bytes
from autobatch._validate import check_search_options
from autobatch.cli._inputs import (
    _describe_target,
    _language_model_sample,
    _make_loss,
    _make_model,
    _make_sample,
    _parse_sizes,
    _running_on,
    _Sample,
    _Target,
    _target,
)
from autobatch.cli._output import _emit_json, _output, _reporting, _search_lines, _table_lines
from autobatch.cli._parser import (
    _DEMO_TEXT,
    _OPTIMIZERS,
    DEFAULT_SIMULATED,
    DEMO_SIMULATED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOTHING_FITS,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    UsageError,
    _ArgumentError,
    build_parser,
)
from autobatch.testing.models import WORKLOADS


@dataclass
class _Setup:
    model: nn.Module
    sample: _Sample
    optimizer: Any
    loss_fn: Callable[..., torch.Tensor] | None
    train: bool


def _setup(args: argparse.Namespace, length: int | None = None) -> _Setup:
    sample = _make_sample(args, length)
    loss_fn = _make_loss(args.loss, sample.classes)
    model = _make_model(args.model)
    if sample.tokens:
        value, lm_loss = _language_model_sample(sample, model)
        sample = dataclasses.replace(sample, value=value)
        if args.loss == "auto":
            loss_fn = lm_loss
    return _Setup(model, sample, _OPTIMIZERS[args.optimizer], loss_fn, not args.inference)


def _search_options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The search options, checked: a bad one is a usage error before anything runs (a
    ``ValueError`` raised later comes from the model or the sample, not from the command line)."""
    try:
        check_search_options(args.min_batch, args.max_batch, args.multiple_of, args.headroom, 1)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{str(error).replace('_', '-')}") from None
    return {
        "headroom": args.headroom,
        "min_batch": args.min_batch,
        "max_batch": args.max_batch,
        "multiple_of": args.multiple_of,
    }


def _cache_of(args: argparse.Namespace) -> ResultCache | None:
    if getattr(args, "no_cache", True):
        return None
    return open_cache(args.cache_dir if args.cache_dir else True)


def _search(
    setup: _Setup, target: _Target, options: dict[str, Any], store: ResultCache | None
) -> tuple[SearchResult, str | None]:
    """``search_batch_size`` through the result cache; ``(result, cache file or None)``."""
    def key() -> str:
        return search_key(
            setup.model, setup.sample.value, setup.optimizer, memory_for(target.device),
            train=setup.train, steps_per_trial=1, loss_fn=setup.loss_fn, step_fn=None,
            scaler=None, **options,
        )

    def run() -> SearchResult:
        return search_batch_size(
            setup.model, setup.sample.value, setup.optimizer,
            loss_fn=setup.loss_fn, train=setup.train, **options,
        )

    result, file = cached_search(store, key, run)
    return result, None if file is None else str(file)


def _header(setup: _Setup, target: _Target, what: str, stream: TextIO) -> None:
    params = sum(p.numel() for p in setup.model.parameters())
    optimizer = "no optimizer" if setup.optimizer is None else (
        getattr(setup.optimizer, "func", setup.optimizer).__name__
    )
    mode = "inference" if not setup.train else f"training with {optimizer}"
    print(f"{what}: {type(setup.model).__name__} ({params:,} parameters), {mode}, "
          f"sample {setup.sample.text}", file=stream)
    print(_describe_target(target), file=stream, flush=True)


def _plot(result: SearchResult | ThroughputResult, path: str | None, stream: TextIO) -> None:
    if path:
        plot(result, path)
        print(f"plot saved to {path}", file=stream)


def _find(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    if args.lengths is not None:
        return _find_lengths(args, options)
    setup = _setup(args)
    target = _target(args, DEFAULT_SIMULATED)
    out = _output(args)
    _header(setup, target, "find", out)
    start = time.perf_counter()
    with _running_on(target, setup.model):
        result, cached = _search(setup, target, options, _cache_of(args))
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "find", **result_to_dict(result), "cached": cached is not None,
                    "seconds": seconds})
    else:
        print("\n".join(_search_lines(result, seconds, cached)), file=out)
    _plot(result, args.plot, out)
    return EXIT_OK


def _find_lengths(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``find --lengths``: a table of batch sizes, one per sequence length."""
    lengths = sorted(set(_parse_sizes(args.lengths, "--lengths", "sequence lengths")))
    setup = _setup(args, lengths[-1])
    target = _target(args, DEFAULT_SIMULATED)
    out = _output(args)
    _header(setup, target, f"find at lengths {','.join(map(str, lengths))}", out)

    def sample_for(length: int) -> Any:
        return _setup(args, length).sample.value

    no_cache = getattr(args, "no_cache", True)
    start = time.perf_counter()
    with _running_on(target, setup.model):
        table = search_batch_sizes(
            setup.model, sample_for, lengths, setup.optimizer, loss_fn=setup.loss_fn,
            train=setup.train, cache=False if no_cache else (args.cache_dir or True), **options,
        )
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "find", **table.to_dict(), "seconds": seconds})
    else:
        print("\n".join(_table_lines(table, seconds)), file=out)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    try:
        check_search_options(1, None, 1, args.headroom, 1)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{error}") from None
    work = WORKLOADS[args.workload]
    torch.manual_seed(0)
    model = work.model()
    inputs, labels = work.sample(4)
    target = _target(args, DEMO_SIMULATED)
    stream = _output(args)
    params = sum(p.numel() for p in model.parameters())
    row = "x".join(map(str, inputs.shape[1:]))
    print(f"autobatch demo: the largest training batch of {_DEMO_TEXT[args.workload]}\n"
          f"  ({params:,} parameters; inputs {row} {str(inputs.dtype).removeprefix('torch.')}, "
          "10 classes; AdamW, cross-entropy)", file=stream)
    print(_describe_target(target), file=stream, flush=True)
    start = time.perf_counter()
    with _running_on(target, model):
        result = search_batch_size(
            model, (inputs, labels), torch.optim.AdamW,
            loss_fn=nn.functional.cross_entropy, headroom=args.headroom,
        )
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "demo", **result_to_dict(result), "seconds": seconds})
    else:
        print("\n".join(_search_lines(result, seconds, None)), file=stream)
    _plot(result, args.plot, stream)
    return EXIT_OK


def _best(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    try:
        _check(args.tolerance, args.repeats, args.warmup)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{error}") from None
    setup = _setup(args)
    target = _target(args, DEFAULT_SIMULATED)
    candidates = _parse_sizes(args.candidates) if args.candidates else None
    out = _output(args)
    _header(setup, target, "best", out)
    start = time.perf_counter()
    with _running_on(target, setup.model):
        max_batch: int | None = None
        search = None
        if candidates is None:
            search, cached = _search(setup, target, options, _cache_of(args))
            source = "" if cached is None else f" (cached in {cached})"
            print(f"  largest batch that fits: {search.max_batch_size}{source}; timing sizes up "
                  f"to the recommended {search.batch_size}", file=out, flush=True)
            max_batch = search.batch_size
        elif args.max_batch is not None:
            max_batch = args.max_batch
        result = find_best_batch(
            setup.model, setup.sample.value, setup.optimizer,
            max_batch=max_batch, candidates=candidates, tolerance=args.tolerance,
            repeats=args.repeats, warmup=args.warmup, loss_fn=setup.loss_fn, train=setup.train,
            min_batch=args.min_batch, multiple_of=args.multiple_of,
        )
    seconds = time.perf_counter() - start
    if args.json:
        document = _throughput_dict(result)
        document["search"] = None if search is None else result_to_dict(search)
        _emit_json({"command": "best", **document, "seconds": seconds})
    else:
        print(
            f"fastest: batch {result.fastest_batch_size} at "
            f"{result.best_samples_per_s:,.1f} samples/s\n"
            f"chosen:  batch {result.batch_size} at {result.samples_per_s:,.1f} samples/s "
            f"(the smallest within {result.tolerance:.0%} of the fastest)\n"
            f"timed {len(result.points)} sizes up to {result.max_batch_size} in {seconds:.1f} s"
        )
        for note in result.notes:
            print(f"note: {note}")
    _plot(result, args.plot, out)
    return EXIT_OK


def _throughput_dict(result: ThroughputResult) -> dict[str, Any]:
    return {
        "batch_size": result.batch_size,
        "samples_per_s": result.samples_per_s,
        "fastest_batch_size": result.fastest_batch_size,
        "best_samples_per_s": result.best_samples_per_s,
        "max_batch_size": result.max_batch_size,
        "tolerance": result.tolerance,
        "device": result.device,
        "train": result.train,
        "repeats": result.repeats,
        "warmup": result.warmup,
        "points": [
            {"size": p.size, "samples_per_s": p.samples_per_s, "seconds": p.seconds,
             "error": p.error}
            for p in result.points
        ],
        "notes": list(result.notes),
    }


def _plan(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    setup = _setup(args)
    if args.capacity is not None:
        try:
            capacity = parse_bytes(args.capacity, name="--capacity")
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None
        where = f"a device of {format_bytes(capacity)}"
    else:
        try:
            device = resolve_device(args.device)
            memory = memory_for(device)
        except (RuntimeError, ValueError) as error:
            raise UsageError(f"--device {args.device}: {error}") from None
        if device.type == "cpu":
            raise UsageError("no GPU here to read the capacity of; give --capacity, e.g. 80GiB")
        capacity = memory.capacity_bytes()
        where = memory.name
    try:
        overhead = 0 if args.overhead is None else parse_bytes(args.overhead, name="--overhead")
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    if overhead >= capacity:
        raise UsageError(
            f"--overhead {args.overhead} ({format_bytes(overhead)}) leaves nothing of the "
            f"{format_bytes(capacity)} device; lower it"
        )
    try:
        from autobatch._sizing._planner import plan_max_batch  # type: ignore[import-not-found,unused-ignore]
    except ImportError as error:
        raise RuntimeError(f"the planner is not available in this installation ({error})") from None
    print(f"plan: {type(setup.model).__name__} for {where}, sample {setup.sample.text}",
          file=_output(args), flush=True)
    start = time.perf_counter()
    plan = plan_max_batch(
        setup.model, setup.sample.value, setup.optimizer, capacity,
        loss_fn=setup.loss_fn, train=setup.train, overhead=overhead, **options,
    )
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "plan", **_plan_dict(plan), "seconds": seconds})
        return EXIT_OK
    print(f"predicted largest batch: {plan.max_batch_size}")
    print(f"recommended batch size:  {plan.batch_size} (headroom {plan.headroom:g}: "
          f"{1 - plan.headroom:.0%} of the largest)")
    if plan.memory_model is not None:
        model = plan.memory_model
        print(f"memory model: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)} "
              "per sample")
    print(f"at batch {plan.max_batch_size}: {plan.breakdown}")
    for note in plan.notes:
        print(f"note: {note}")
    print(f"planned in {seconds:.1f} s, without running a step on a device")
    return EXIT_OK


def _plan_dict(plan: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dataclasses.asdict(plan)
    fields["breakdown"]["peak"] = plan.breakdown.peak
    return fields


# --------------------------------------------------------------------------- entry point


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for JSON output (read before, or without, argparse)."""
    return "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv


def _failed(
    command: str, code: int, kind: str, error: BaseException, *, json_out: bool, hint: str = ""
) -> int:
    """Report a failure: one line on stderr and, with ``--json``, one JSON object on stdout."""
    message = _one_line(error)
    print(f"{command}: {kind}: {message}{hint}", file=sys.stderr, flush=True)
    if json_out:
        _emit_json({
            "command": command.removeprefix(f"{PROG} ") if command != PROG else None,
            "error": message,
            "kind": kind,
            "exit_code": code,
        })
    return code


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "find": _find, "plan": _plan, "best": _best, "demo": _demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autobatch`` command; returns the exit code.

    >>> main(["--version"])  # doctest: +SKIP
    autobatch 0.1.0

    Exit codes: 0 success; 2 a usage error (a bad option, or a model, sample or loss that
    cannot be loaded), found before anything runs; 3 nothing fits; 1 any other error,
    including every error raised while the model runs (a ``ValueError`` in ``forward`` too);
    130 interrupted. With ``--json`` a failure also prints one JSON object on stdout, with an
    ``"error"`` field.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(words)
    except SystemExit as done:  # --help or --version
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    except _ArgumentError as error:
        hint = f" (see {error.prog} --help)"
        return _failed(error.prog, EXIT_USAGE, "error", error, json_out=_wants_json(words),
                       hint=hint)
    handler = _COMMANDS[args.command]
    command = f"{PROG} {args.command}"
    json_out = bool(getattr(args, "json", False))
    try:
        with _reporting(args.verbose, _output(args), sys.stderr):
            return handler(args)
    except BrokenPipeError:  # the reader went away (``autobatch ... | head``): stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt):
            code, kind = EXIT_INTERRUPTED, "interrupted"
        elif isinstance(error, BatchSizeError):
            code, kind = EXIT_NOTHING_FITS, "nothing fits"
        elif isinstance(error, UsageError):
            code, kind = EXIT_USAGE, "error"
        elif isinstance(error, Exception):  # the model, the sample, the loss or autobatch
            code, kind = EXIT_ERROR, "error"
        else:
            raise
        if args.verbose:
            traceback.print_exc(file=sys.stderr)
        hint = "" if args.verbose or code == EXIT_INTERRUPTED else " (--verbose for details)"
        if isinstance(error, (UsageError, BatchSizeError)):
            hint = ""
        return _failed(command, code, kind, error, json_out=json_out, hint=hint)
