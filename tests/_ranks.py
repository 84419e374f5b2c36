"""Running a function on several gloo ranks in spawned processes, with a hard time limit."""

from __future__ import annotations

import gc
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple[Any, ...],
    pg_timeout: float,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    result = fn(rank, *args)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    # What the ranks built (DDP modules and their reducers sit in reference cycles) goes while
    # the process group lives: one left to the collector at exit can abort its process.
    gc.collect()
    # Every rank reaches the barrier before any tears gloo down: a rank that leaves early can
    # abort a peer whose gloo threads still talk to it.
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout: float = 90,
    pg_timeout: float = 60,
) -> list[Any]:
    """Runs ``fn(rank, *args)`` on ``world`` gloo ranks; returns each rank's JSON result.

    Fails (never hangs) when the ranks do not finish within ``timeout`` seconds; ``pg_timeout``
    is the process group's own timeout.
    """
    context = mp.start_processes(
        _entry, args=(fn, world, _free_port(), str(tmp), args, pg_timeout), nprocs=world,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s (a hang)")
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
