"""The same batch size on every rank: run with

    torchrun --nproc_per_node 2 examples/find_batch_torchrun.py

Every rank runs the same trials in lockstep; a size fits only if it fits on every rank, so all
ranks return the same answer (the smallest rank's). Without a GPU each rank simulates one, with
different capacities to show the agreement.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import autobatch
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    work = WORKLOADS["conv"]
    model = work.model().to(device or "cpu")
    simulated = contextlib.nullcontext() if cuda else SimulatedGPU(f"{24 + 8 * rank}MiB")
    with simulated as gpu:
        if gpu is not None:
            gpu.adopt(model)
        result = autobatch.search_batch_size(
            model, work.sample(4), torch.optim.AdamW, loss_fn=torch.nn.functional.cross_entropy
        )
    print(f"rank {rank}: batch size {result.batch_size} (largest that fits on every rank: "
          f"{result.max_batch_size}) after {len(result.trials)} trials", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
