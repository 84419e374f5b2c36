"""How close and how fast is the planner? (not run in CI)

Five tables:

1. Accuracy. For an MLP, a conv net with BatchNorm and a small transformer (Adam, cross-entropy),
   the planned peak of one training step at several batch sizes next to the peak the simulated GPU
   measures for the same real CPU step (``search_batch_size`` at that one size), and the planned
   largest batch for a capacity next to the exact largest the simulator finds with real steps.
   The plan is made with ``device="cpu"``, which counts what the simulator counts.
1b. Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: 1 and 2 layers, batch_first both
   ways) and Hugging Face GPT-2, BERT, ViT and Llama built from small configs (random weights),
   with and without an attention mask: the planned largest batch next to the simulator's exact
   one.
2. Speed. A ~29M-parameter transformer (``torch.nn`` layers: d_model 512, 8 heads, 8 layers,
   vocabulary 8000, sequence 128) planned for an 80 GiB GPU, and its planned peak at batch 2 next
   to the simulated peak of a real CPU step there.
3. Seeding. In bench_search's cases (the same setups, capacities and exact B*), the real trials
   ``search_batch_size(..., start=plan.max_batch_size, prior=plan.memory_model)`` takes, next
   to the unseeded search.

4. Segments. On bench_caching's models, capacities and allocator settings, the plan on the
   caching allocator's model (the default) next to the largest size a user's fresh loop trains
   in the caching simulator, and the plan on exact accounting beside it.

No GPU is needed; a comparison with ``torch.cuda.max_memory_allocated`` on a real GPU is
benchmarks/gpu_check.py's job.

    python benchmarks/bench_plan.py            # everything, a few minutes on 2 cores
    python benchmarks/bench_plan.py --quick    # small targets in table 3, 3 models in table 4
    python benchmarks/bench_plan.py --only 4 --models mlp bert
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch._sizing._planner import plan_max_batch
from autobatch._units import format_bytes, parse_bytes
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS, RecurrentClassifier, TinyTransformer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_caching  # sibling modules of this script
import bench_search

SIZES = (1, 8, 64, 256)
CAPACITY = {"mlp": "16MiB", "conv": "128MiB", "transformer": "128MiB"}
GOAL_ERROR, GOAL_SECONDS, GOAL_MEDIAN_TRIALS, GOAL_SEGMENTS = 0.01, 10.0, 3, 0.05


def simulated(model: nn.Module, sample: Any, capacity: int | str, **options: Any) -> Any:
    """search_batch_size with real CPU steps on a simulated GPU of ``capacity``."""
    with SimulatedGPU(capacity, allocator="exact") as gpu:
        gpu.adopt(model)
        return autobatch.search_batch_size(
            model, sample, torch.optim.Adam, loss_fn=F.cross_entropy, headroom=0, **options
        )


def simulated_peak(model: nn.Module, sample: Any, n: int) -> int:
    result = simulated(model, sample, 2**50, min_batch=n, max_batch=n)
    peak: int = result.trials[0].peak_bytes
    return peak


def accuracy() -> bool:
    print("## 1. Planned vs simulated (device='cpu', Adam, cross-entropy)\n")
    print("| model | n | planned peak | simulated peak | error % | capacity | planned max "
          "| exact max | plan s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name in sorted(WORKLOADS):
        work = WORKLOADS[name]
        torch.manual_seed(0)
        model, sample = work.model(), work.sample(4)
        started = time.perf_counter()
        plan = plan_max_batch(model, sample, torch.optim.Adam, CAPACITY[name],
                              loss_fn=F.cross_entropy, device="cpu", allocator="exact")
        seconds = time.perf_counter() - started
        exact = simulated(model, sample, CAPACITY[name]).max_batch_size
        ok &= plan.max_batch_size == exact
        for n in (*SIZES, exact):
            planned = plan_max_batch(model, sample, torch.optim.Adam, "1TiB", min_batch=n,
                                     max_batch=n, loss_fn=F.cross_entropy, device="cpu",
                                     allocator="exact")
            peak = dict(planned.points)[n]
            real = simulated_peak(model, sample, n)
            error = (peak - real) / real
            ok &= abs(error) <= GOAL_ERROR
            print(f"| {name} | {n} | {peak:,} | {real:,} | {100 * error:+.3f} | "
                  f"{CAPACITY[name]} | {plan.max_batch_size} | {exact} | {seconds:.2f} |")
    print()
    return ok


def _hugging_face(kind: str) -> tuple[nn.Module, Any]:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
    )

    ids = torch.randint(0, 1000, (2, 64))
    if kind.startswith("ViT"):
        vit = ViTForImageClassification(ViTConfig(
            image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=128, num_labels=10,
        ))
        return vit, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))}
    if kind.startswith("Llama"):
        model: nn.Module = LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1 if "grouped" in kind else 2,
            max_position_embeddings=128,
        ))
        sample: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids}
    elif kind.startswith("GPT-2"):
        model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0,
            eos_token_id=0,
        ))
        sample = {"input_ids": ids, "labels": ids}
    else:
        model = BertForSequenceClassification(BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
            vocab_size=1000, max_position_embeddings=128, num_labels=4,
        ))
        sample = {"input_ids": ids, "labels": torch.zeros(2, dtype=torch.long)}
    if "mask" in kind:
        sample["attention_mask"] = torch.ones_like(ids)
    return model, sample


def recurrent_and_hugging_face() -> bool:
    print("## 1b. Recurrent layers and Hugging Face models (device='cpu', AdamW)\n")
    print("Recurrent layers keep workspaces a meta run does not see, and transformers reads an "
          "attention mask with `.item()`, which no meta run can answer: both are planned from "
          "small real steps on a CPU copy (`method` steps), measured up to the answer when the "
          "capacity is small. Attention without a mask (ViT, Llama, GPT-2) runs on meta with the "
          "kernel the CPU chooses (its fused flash kernel here), as the simulator measures. The "
          "goal: within 2% of the exact largest batch, never above.\n")
    print("| model | capacity | planned max | exact max | planned/exact | method | plan s |")
    print("|---|---:|---:|---:|---:|:---:|---:|")
    ok = True
    cases: list[tuple[str, Any, str]] = [
        (f"{kind} {layers} layer{'s' if layers > 1 else ''}, batch_first={first}",
         (kind, layers, first), "16MiB")
        for kind in ("LSTM", "GRU", "RNN") for layers in (1, 2) for first in (True, False)
    ]
    cases += [(kind, kind, "64MiB") for kind in (
        "GPT-2", "GPT-2, attention_mask", "BERT, attention_mask", "ViT", "Llama",
        "Llama, grouped-query attention", "Llama, attention_mask",
    )]
    for label, spec, capacity in cases:
        torch.manual_seed(0)
        if isinstance(spec, tuple):
            model: nn.Module = RecurrentClassifier(*spec)
            sample: Any = (torch.randn(2, 32, 16), torch.randint(0, 10, (2,)))
            loss: Any = F.cross_entropy
        else:
            model, sample = _hugging_face(spec)
            loss = None
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's warning; the method column says it
            plan = plan_max_batch(model, sample, torch.optim.AdamW, capacity, loss_fn=loss,
                                  device="cpu", headroom=0, allocator="exact")
        seconds = time.perf_counter() - started
        with SimulatedGPU(capacity, allocator="exact") as gpu:
            gpu.adopt(model)
            exact = autobatch.search_batch_size(
                model, sample, torch.optim.AdamW, loss_fn=loss, headroom=0
            ).max_batch_size
        ratio = plan.max_batch_size / exact
        ok &= 0.98 <= ratio <= 1.0
        print(f"| {label} | {capacity} | {plan.max_batch_size} | {exact} | {ratio:.4f} | "
              f"{plan.method} | {seconds:.2f} |")
    print()
    return ok


def speed() -> bool:
    print("## 2. A ~29M-parameter transformer (seq 128) planned for 80 GiB\n")
    torch.manual_seed(0)
    model = TinyTransformer(vocab=8000, d_model=512, heads=8, layers=8)
    params = sum(p.numel() for p in model.parameters())
    sample = (torch.randint(0, 8000, (1, 128)), torch.randint(0, 10, (1,)))
    started = time.perf_counter()
    plan = plan_max_batch(model, sample, torch.optim.Adam, "80GiB", loss_fn=F.cross_entropy)
    seconds = time.perf_counter() - started
    print(f"parameters: {params:,}; whole plan: {seconds:.2f} s "
          f"(goal <= {GOAL_SECONDS:g} s), {len(plan.points)} planned steps\n")
    print("```\n" + repr(plan) + "\n```\n")
    at_two = plan_max_batch(model, sample, torch.optim.Adam, "1TiB", min_batch=2, max_batch=2,
                            loss_fn=F.cross_entropy, device="cpu", allocator="exact")
    started = time.perf_counter()
    real = simulated_peak(model, sample, 2)
    real_seconds = time.perf_counter() - started
    peak = dict(at_two.points)[2]
    print(f"batch 2: planned {format_bytes(peak)} ({peak:,} bytes), simulated "
          f"{format_bytes(real)} ({real:,} bytes), error {100 * (peak - real) / real:+.3f} %; "
          f"the real CPU step took {real_seconds:.1f} s\n")
    return seconds <= GOAL_SECONDS and abs(peak - real) <= GOAL_ERROR * real


def seeded(targets: dict[str, tuple[int, ...]]) -> bool:
    print("## 3. Seeded search in bench_search's cases (real trials to the exact B*)\n")
    print("| model | B* | planned max | plan s | seeded trials | sizes | unseeded trials |")
    print("|---|---:|---:|---:|---:|---|---:|")
    counts: list[int] = []
    ok = True
    for name, wanted in targets.items():
        setup = bench_search.make_setup(name, "exact")
        for target in wanted:
            capacity, bstar = bench_search.exact_truth(setup, target).capacity, target
            model, optimizer = setup.copy()
            started = time.perf_counter()
            plan = plan_max_batch(model, (setup.inputs, setup.labels), optimizer, capacity,
                                  loss_fn=F.cross_entropy, device="cpu", allocator="exact")
            seconds = time.perf_counter() - started
            runs = {}
            for label, options in (
                ("seeded", {"start": plan.max_batch_size, "prior": plan.memory_model}),
                ("unseeded", {}),
            ):
                model, optimizer = setup.copy()
                with SimulatedGPU(capacity, allocator="exact") as gpu:
                    gpu.adopt(model, optimizer)
                    runs[label] = autobatch.search_batch_size(
                        model, (setup.inputs, setup.labels), optimizer,
                        loss_fn=F.cross_entropy, headroom=0, **options,
                    )
            found = runs["seeded"]
            ok &= found.max_batch_size == bstar == runs["unseeded"].max_batch_size
            counts.append(len(found.trials))
            sizes = ", ".join(f"{t.size}{'' if t.fits else '✗'}" for t in found.trials)
            print(f"| {name} | {bstar} | {plan.max_batch_size} | {seconds:.2f} | "
                  f"{len(found.trials)} | {sizes} | {len(runs['unseeded'].trials)} |")
    median = statistics.median(counts)
    print(f"\nmedian seeded trials: {median:g} (goal <= {GOAL_MEDIAN_TRIALS}), "
          f"max {max(counts)}\n")
    return ok and median <= GOAL_MEDIAN_TRIALS


def segments(models: dict[str, tuple[str, ...]]) -> bool:
    """The plan on the caching allocator's model against a user's fresh loop in the simulator."""
    print("## 4. Segments: the plan against the caching allocator's truth\n")
    print("The plan (`allocator=\"caching\"`, the default; `device=\"cpu\"`, which plans the "
          "kernels the simulator runs) for bench_caching's models, capacities and settings, "
          "next to the largest size a user's fresh loop trains in "
          "`SimulatedGPU(capacity, allocator=\"caching\")` (fresh model, fresh optimizer, "
          f"{bench_search.CACHING_STEPS} steps, each batch copied in), found by galloping from "
          "the plan and bisecting, then again above it where 1.25, 1.5 or 2 times it trains. "
          "The old plan (`allocator=\"exact\"`, allocated bytes only) "
          "beside it.\n")
    print("| model | capacity | setting | truth | plan | error % | plan trains | plan+1 fails "
          "| plan s | exact-accounting plan | its error % |")
    print("|---|---:|---|---:|---:|---:|:---:|:---:|---:|---:|---:|")
    errors: list[float] = []
    for name, capacities in models.items():
        for capacity_text in capacities:
            capacity = parse_bytes(capacity_text)
            for setting, expandable in bench_caching.SETTINGS.items():
                setup = bench_caching.setup_for(name)
                sample = (setup.inputs, setup.labels)
                with bench_caching.allocator_setting(expandable), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (a step planned from real CPU steps)
                    model, optimizer = setup.copy()
                    started = time.perf_counter()
                    plan = plan_max_batch(model, sample, optimizer, capacity,
                                          loss_fn=F.cross_entropy, device="cpu")
                    seconds = time.perf_counter() - started
                    model, optimizer = setup.copy()
                    old = plan_max_batch(model, sample, optimizer, capacity,
                                         loss_fn=F.cross_entropy, device="cpu",
                                         allocator="exact").max_batch_size
                    truth = bench_search.Truth(setup, capacity, "caching")
                    largest = largest_trained(truth, plan.max_batch_size)
                    planned = plan.max_batch_size
                    error = 100 * (planned - largest) / largest
                    errors.append(abs(error))
                    print(f"| {name} | {format_bytes(capacity)} | {setting} | {largest} | "
                          f"{planned} | {error:+.1f} | {yes(truth(planned))} | "
                          f"{yes(not truth(planned + 1))} | {seconds:.2f} | {old} | "
                          f"{100 * (old - largest) / largest:+.1f} |", flush=True)
    worst = max(errors)
    print(f"\nlargest error {worst:.1f} % (goal <= {100 * GOAL_SEGMENTS:g} %), median "
          f"{statistics.median(errors):.1f} %\n")
    return worst <= 100 * GOAL_SEGMENTS


def largest_trained(truth: bench_search.Truth, start: int) -> int:
    """The largest size that trains, galloping and bisecting from ``start``, then again from
    1.25, 1.5 or 2 times it where one of those trains (under caching, fitting is not monotone:
    a larger size can train above one that fails)."""
    try:
        largest = bench_search.largest_fitting(truth, start)
    except RuntimeError:  # no clean boundary near it: the largest that trained
        largest = max(n for n, fits in truth.known.items() if fits)
    above = [round(largest * p) for p in bench_caching.PROBES]
    return next((largest_trained(truth, n) for n in above if truth(n)), largest)


def yes(value: bool) -> str:
    return "yes" if value else "no"


def targets_of(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    return bench_search.QUICK_TARGETS if args.quick else bench_search.TARGETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small targets in table 3")
    parser.add_argument("--only", choices=["1", "1b", "2", "3", "4"], help="one table")
    parser.add_argument("--models", nargs="+", choices=sorted(bench_caching.MODELS),
                        help="table 4's models (default: all of bench_caching's)")
    args = parser.parse_args(argv)
    models = {m: c for m, c in bench_caching.MODELS.items() if m in (args.models or [m])}
    if args.quick and args.models is None:
        models = dict(bench_caching.QUICK_MODELS)
    tables = {"1": accuracy, "1b": recurrent_and_hugging_face, "2": speed,
              "3": lambda: seeded(targets_of(args)), "4": lambda: segments(models)}
    if args.only is not None:
        return 0 if tables[args.only]() else 1
    results = [table() for table in tables.values()]
    print("all goals met" if all(results) else "GOALS MISSED: see the tables above")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
