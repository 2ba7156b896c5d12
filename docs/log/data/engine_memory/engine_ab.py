"""The collective engine on four cells, W=4 Gloo on loopback, in the tree this interpreter imports.

Run once per tree, alternating (each tree with its own venv, so that each imports its own
package): ``python engine_ab.py NAME PORT``. Prints NAME and, per cell, (elements, density, median
ms of the slowest rank, median process CPU ms of the slowest rank) over 15 reductions after 3.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CELLS = [(2097152, 0.01), (2097152, 1.0), (4194304, 0.01), (4194304, 0.1)]
WORLD = 4


def rank_main(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from omnireduce._malloc import keep_freed_memory

    keep_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from omnireduce.engines.collective import CollectiveEngine

    engine = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 8, WORLD)
    out = []
    for n, density in CELLS:
        g = torch.Generator().manual_seed(rank * 100 + int(density * 1000))
        nb = n // 256
        x = torch.zeros(n)
        ids = torch.randperm(nb, generator=g)[: max(1, int(nb * density))]
        x.view(nb, 256)[ids] = torch.randn(ids.numel(), 256, generator=g)
        work = torch.empty_like(x)
        wall, cpu = [], []
        for _ in range(18):
            work.copy_(x)
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            engine.allreduce_async(work).wait()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        m = torch.tensor([statistics.median(wall[3:]), statistics.median(cpu[3:])])
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        out.append((n, density, round(m[0].item() * 1e3, 2), round(m[1].item() * 1e3, 2)))
    if rank == 0:
        sys.stdout.write(f"{sys.argv[1]} {out}\n")
    engine.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[2]),), nprocs=WORLD)
