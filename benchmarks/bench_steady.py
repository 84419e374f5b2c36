"""Can a trial stop once the reserved memory is steady? (not run in CI)

Under CUDA's caching allocator a trial of the finder runs a user's loop for five steps (more
while the reserved memory still grows) before it says a size fits. Stopping earlier, as soon as
a step reserves nothing new, would make every trial cheaper. This benchmark asks whether that is
safe: for bench_caching's models at one capacity each, without and with expandable segments, it
runs a user's fresh loop (bench_search's: a fresh copy of the model and optimizer in a fresh
``SimulatedGPU(capacity, allocator="caching")``, a new batch copied in each step) at the sizes
just above the largest that trains five steps, and counts the sizes that run out of memory in a
later step although the reserved peak did not grow in step 2 (or 3): the sizes a trial stopped
"when steady" after 2 (or 3) steps would call fitting, wrongly.

A stricter test of steadiness would be exact: once the allocator's whole layout (its segments,
and every block's place, size and state) after a step is the layout after the step before, or
the one before that (a batch and its loss alternate between two places), the same requests give
the same steps from then on. The last column says after which step that first happens, in
:data:`LAYOUT_STEPS` steps of the same loop at the largest size and at 8 rows (a first trial's
size): a trial stopped by that test could stop no sooner.

    python benchmarks/bench_steady.py      # 16 cases, a few minutes on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from autobatch._units import format_bytes, parse_bytes
from autobatch.testing import SimulatedGPU

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_caching  # sibling modules of this script
import bench_search

STEPS = bench_search.CACHING_STEPS
LAYOUT_STEPS = 8  # the steps run to see the allocator's layout repeat
CASES = {"mlp": "4MiB", "conv": "32MiB", "transformer": "24MiB", "tiny-mlp": "2MiB",
         "branchy": "6MiB", "bert": "16MiB", "embedding-bag": "64MiB", "lstm": "32MiB"}
STARTS = {"mlp": 250, "conv": 60, "transformer": 30, "tiny-mlp": 2900, "branchy": 500,
          "bert": 40, "embedding-bag": 32000, "lstm": 70}


def layout_repeats(setup: bench_search.Setup, capacity: int, n: int) -> str:
    """After which step of the fresh loop at ``n`` the allocator's layout (segments, and each
    block's address, size and state) first equals its layout after one of the two steps
    before; "none in 8" (:data:`LAYOUT_STEPS`) where it never does, "out of memory in step k"
    where the loop stops there."""
    layouts: list[object] = []

    def record(gpu: SimulatedGPU) -> None:
        model = gpu.allocator_copy()
        assert model is not None
        layouts.append(tuple(
            (segment["address"], segment["total_size"],
             tuple((block["size"], block["state"]) for block in segment["blocks"]))
            for segment in model.snapshot()))

    fits, _ = bench_search.fresh_loop_reserved(setup, capacity, n, LAYOUT_STEPS, record)
    for step in range(2, len(layouts) + 1):
        if layouts[step - 1] in layouts[max(0, step - 3):step - 1]:
            return str(step)
    return f"none in {LAYOUT_STEPS}" if fits else f"out of memory in step {len(layouts) + 1}"


def main() -> int:
    torch.set_num_threads(1)
    print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    print("| model | capacity | setting | largest (5 steps) | failing sizes above it tried "
          "| steady after 2 steps, failing later | steady after 3 steps, failing later "
          "| layout repeats after step (largest; 8 rows) |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    wrong = {2: 0, 3: 0}
    layouts: list[str] = []
    for setting, expandable in bench_caching.SETTINGS.items():
        with bench_caching.allocator_setting(expandable):
            for name, text in CASES.items():
                setup, capacity = bench_caching.setup_for(name), parse_bytes(text)
                largest = bench_search.largest_fitting(
                    bench_search.Truth(setup, capacity, "caching"), STARTS[name])
                tried, steady = 0, {2: 0, 3: 0}
                stride = max(1, largest // 160)
                for n in range(largest + 1, largest + 1 + max(8, largest // 20), stride):
                    fits, reserved = bench_search.fresh_loop_reserved(setup, capacity, n)
                    if fits:
                        continue  # (an island above: not this question)
                    tried += 1
                    for k in steady:
                        if len(reserved) >= k and reserved[k - 1] == reserved[k - 2]:
                            steady[k] += 1
                wrong = {k: wrong[k] + steady[k] for k in wrong}
                repeats = [layout_repeats(setup, capacity, n) for n in (largest, 8)]
                layouts += repeats
                print(f"| {name} | {format_bytes(capacity)} | {setting} | {largest} | {tried} "
                      f"| {steady[2]} | {steady[3]} | {'; '.join(repeats)} |", flush=True)
    print(f"\nsizes a trial stopped when steady would call fitting, wrongly: {wrong[2]} after 2 "
          f"steps, {wrong[3]} after 3 (the finder's trials run {STEPS} steps)")
    repeated = [int(step) for step in layouts if step.isdigit()]
    print(f"the allocator's layout repeats in {len(repeated)} of {len(layouts)} loops, after "
          f"step {min(repeated, default=0)} at the soonest; in {len(layouts) - len(repeated)} "
          f"not within {LAYOUT_STEPS} steps: no trial could stop before step {STEPS} on it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
