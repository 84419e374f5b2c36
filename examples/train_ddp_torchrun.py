"""DistributedDataParallel training that survives an OOM on one rank: run with

    torchrun --nproc_per_node 2 examples/train_ddp_torchrun.py

``retry_on_oom`` and ``oom_guard`` agree across ranks: when one rank runs out of memory, every
rank redoes that batch in the same micro-batches, gradients are averaged once per optimizer
step, and all ranks end with the same parameters. Without a GPU each rank simulates one; rank 1
gets less memory, so only rank 1 runs out.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

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
    work = WORKLOADS["mlp"]
    model = DistributedDataParallel(work.model().to(device or "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)  # each rank its own data, as a DistributedSampler gives
    loader = [work.sample(1024) for _ in range(6)]

    @autobatch.retry_on_oom(optimizer=optimizer)
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = (t.to(device or "cpu") for t in batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    simulated = contextlib.nullcontext() if cuda else SimulatedGPU(f"{16 - 10 * rank}MiB")
    with simulated as gpu, autobatch.oom_guard(loader) as guard:
        if gpu is not None:
            gpu.adopt(model, optimizer)
        for batch in guard:
            train_step(batch)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    stats = train_step.stats
    print(f"rank {rank}: {stats.batches} steps, {stats.ooms} OOM, micro-batch "
          f"{stats.micro_batch_size}, parameter checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
