from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

# One intra-op thread for the whole run, and for the processes the tests start (the command
# line, torchrun, spawned ranks): the models are tiny, and several threads per process spin
# and fight over the cores, which costs several times the CPU on a small shared machine
# (a caching-allocator search: 23 s of CPU with two threads, 6 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is faster than several fighting over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """What the process holds before a module's tests, frozen out of garbage collection: the
    guard calls gc.collect() after every OOM (and a framework after training), which would
    walk every object of a process that imported torch and a framework, a fifth of a second
    each time; frozen, it scans only what the tests made. For every module."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def float64() -> Iterator[None]:
    """The default dtype float64 for the test (exactness to 1e-9 needs it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
