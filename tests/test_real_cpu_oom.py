"""A real out-of-memory error on a real device: the CPU, under an address-space limit.

A child process warms torch up, then caps its own virtual address space (RLIMIT_AS) a little
above what it uses, and trains a small MLP on doubling batches until torch's CPU allocator
fails. The child checks that autobatch classifies the genuine error as an OOM, and that after
leaving the ``except`` block the last batch size that fitted trains again in the same process.
Only that is asserted: the exact failing size depends on the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="needs Linux: RLIMIT_AS and /proc/self/status",
)

REPO_ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import gc
import resource
import sys

import torch

from autobatch._oom import is_oom_error, oom_kind

HEADROOM = 256 * 2**20  # address space allowed above the warmed-up process
MAX_BATCH = 2**16       # 1 GiB per activation: far past the headroom, far below the machine


def vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


torch.set_num_threads(1)
torch.manual_seed(0)
# Memory grows with the batch through the 4096-wide hidden layer; the compute stays small.
model = torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def train_step(batch: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    x = torch.randn(batch, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    loss.backward()
    optimizer.step()


# Warm up first, so lazy initialisation (autograd engine, optimizer state, BLAS buffers)
# happens before the limit and the first failure is a tensor allocation.
train_step(2)
train_step(64)

soft, hard = resource.getrlimit(resource.RLIMIT_AS)
limit = vm_size() + HEADROOM
if hard != resource.RLIM_INFINITY and hard < limit:
    print(f"AUTOBATCH-SKIP hard RLIMIT_AS {hard} is below the {limit} bytes needed")
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
print(f"AUTOBATCH-LIMIT {limit >> 20} MiB", flush=True)

batch, fitted, failure = 256, None, None
while batch <= MAX_BATCH:
    try:
        train_step(batch)
    except Exception as exc:  # examined here; nothing of it survives the block
        failure = (type(exc).__name__, str(exc).splitlines()[0], is_oom_error(exc), oom_kind(exc))
        break
    fitted = batch
    batch *= 2

# Outside the except block the traceback, and every tensor of the failed step, is gone.
gc.collect()
if failure is None:
    print(f"AUTOBATCH-NO-OOM up to batch {MAX_BATCH}")
    sys.exit(3)
name, first_line, oom, kind = failure
print(f"AUTOBATCH-FAILED batch={batch} type={name} oom={oom} kind={kind}: {first_line[:200]}")
assert oom, "a genuine CPU allocator failure was not classified as OOM"
assert kind == "cpu_allocator", kind
assert fitted is not None, "even the first batch failed; the headroom is too small"

train_step(fitted)
print(f"AUTOBATCH-RECOVERED batch={fitted}", flush=True)
"""


@pytest.mark.slow
def test_genuine_cpu_oom_is_classified_and_training_recovers() -> None:
    env = dict(os.environ)
    env.update(
        {
            # One malloc arena and one thread: the address space tracks the tensors, and no
            # thread pool reserves stacks or arenas after the limit is set.
            "MALLOC_ARENA_MAX": "1",
            # Fixed threshold: large blocks always come from mmap and go back on free.
            "MALLOC_MMAP_THRESHOLD_": "131072",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        }
    )
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    if "AUTOBATCH-SKIP" in result.stdout:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, report
    assert "AUTOBATCH-FAILED" in result.stdout, report
    assert "oom=True kind=cpu_allocator" in result.stdout, report
    assert "DefaultCPUAllocator" in result.stdout, report
    assert "AUTOBATCH-RECOVERED" in result.stdout, report
