"""Train through out-of-memory errors: a step decorated with retry_on_oom inside oom_guard.

The "GPU" is simulated on the CPU with a capacity that the batches of 512 do not fit in, and in the
second epoch another (simulated) process takes a fifth of it for two batches. The simulator counts
allocated bytes exactly (``allocator="exact"``): its default model of CUDA's caching allocator
reserves whole 2 MiB and 20 MiB segments, and keeps the limit it was made with. The step splits
each batch into micro-batches that accumulate into one optimizer step, so the training math is that
of whole batches. The first OOM costs one retry; after that the memory model sizes the pieces from
the free memory, so the pressure in epoch 1 only makes the pieces smaller, without an OOM.

    python examples/train_with_guard.py
"""

from __future__ import annotations

import torch
from torch import nn

from autobatch import oom_guard, retry_on_oom
from autobatch.testing import SimulatedGPU

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(2048, 64), torch.randint(0, 10, (2048,))),
    batch_size=512,
)


@retry_on_oom(optimizer=opt, grow_after=2)
def train_step(batch: list[torch.Tensor]) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


@retry_on_oom  # an eval step learns its own size and never shrinks the training step
def eval_step(batch: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return (model(batch[0]).argmax(dim=1) == batch[1]).float().mean()


def main() -> None:
    with SimulatedGPU("1MiB", allocator="exact", adopt=[model, opt]) as gpu:
        full = gpu.capacity_bytes
        for epoch in range(2):
            with oom_guard(loader) as guard:
                for i, batch in enumerate(guard):
                    # Another process holds memory during batches 1-2 of the second epoch.
                    gpu.capacity_bytes = full * 4 // 5 if epoch == 1 and i in (1, 2) else full
                    loss = train_step(batch)  # the whole batch's loss, detached if split
                    print(f"  epoch {epoch} batch {i}: micro-batch {guard.stats.micro_batch_size}")
            s = guard.stats
            print(
                f"epoch {epoch}: loss {loss.item():.3f}  ooms={s.ooms} shrinks={s.shrinks} "
                f"grows={s.grows} failed_grows={s.failed_grows} "
                f"micro_batch_size={s.micro_batch_size} samples={s.samples}"
            )
            for change in s.history:
                print(f"    batch {change.step}: {change.old} -> {change.new} ({change.reason})")
        accuracy = sum(float(eval_step(b)) for b in loader) / len(loader)
    print(f"train accuracy {accuracy:.3f}; peak {gpu.peak_bytes} of {full} bytes")


if __name__ == "__main__":
    main()
