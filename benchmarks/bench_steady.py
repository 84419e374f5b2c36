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

    python benchmarks/bench_steady.py      # 16 cases, a few minutes on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from autobatch._units import format_bytes, parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_caching  # sibling modules of this script
import bench_search

STEPS = bench_search.CACHING_STEPS
CASES = {"mlp": "4MiB", "conv": "32MiB", "transformer": "24MiB", "tiny-mlp": "2MiB",
         "branchy": "6MiB", "bert": "16MiB", "embedding-bag": "64MiB", "lstm": "32MiB"}
STARTS = {"mlp": 250, "conv": 60, "transformer": 30, "tiny-mlp": 2900, "branchy": 500,
          "bert": 40, "embedding-bag": 32000, "lstm": 70}


def main() -> int:
    torch.set_num_threads(1)
    print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    print("| model | capacity | setting | largest (5 steps) | failing sizes above it tried "
          "| steady after 2 steps, failing later | steady after 3 steps, failing later |")
    print("|---|---:|---|---:|---:|---:|---:|")
    wrong = {2: 0, 3: 0}
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
                print(f"| {name} | {format_bytes(capacity)} | {setting} | {largest} | {tried} "
                      f"| {steady[2]} | {steady[3]} |", flush=True)
    print(f"\nsizes a trial stopped when steady would call fitting, wrongly: {wrong[2]} after 2 "
          f"steps, {wrong[3]} after 3 (the finder's trials run {STEPS} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
