"""A model sharded with FSDP2 (``fully_shard``): find the batch, then train through OOMs. Run with

    torchrun --nproc_per_node 2 examples/train_fsdp2_torchrun.py

``find_max_batch`` runs its trials in lockstep on every rank and returns the largest batch that
fits on the tightest one. Training then goes through batches half as large again: when a rank runs
out of memory, every rank stops at its next FSDP collective, the batch is redone in the same
micro-batches on every rank (only the last reduces the gradients), and all ranks step together.
Without a GPU each rank simulates one; rank 1 gets less memory, so only rank 1 runs out.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import autobatch
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS, TinyTransformer


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyTransformer(d_model=64, layers=4).to(device or "cpu")
    for layer in model.encoder.layers:  # one FSDP group per block, then the root
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sample = WORKLOADS["transformer"].sample
    loss_fn = torch.nn.functional.cross_entropy

    @autobatch.retry_on_oom(optimizer=optimizer)
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, labels = (t.to(device or "cpu") for t in batch)
        optimizer.zero_grad()
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    simulated = contextlib.nullcontext() if cuda else SimulatedGPU(f"{16 - 8 * rank}MiB")
    with simulated as gpu:
        if gpu is not None:
            gpu.adopt(model, optimizer)
        size = autobatch.find_max_batch(model, sample, optimizer, loss_fn=loss_fn, max_batch=4096)
        torch.manual_seed(rank)  # each rank its own data, as a DistributedSampler gives
        rows = size + size // 2  # (more than the tightest rank fits whole)
        loader = [sample(rows) for _ in range(4)]
        with autobatch.oom_guard(loader) as guard:
            for batch in guard:
                train_step(batch)
    # (each rank holds a shard of every parameter; full_tensor() gathers the whole of it)
    checksum = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    stats = train_step.stats
    print(f"rank {rank}: batch size {size}; {stats.batches} steps of {rows}, {stats.ooms} "
          f"OOM, micro-batch {stats.micro_batch_size}; parameter checksum {checksum:.10f}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
