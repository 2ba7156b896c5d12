"""Percentiles of small Gloo collectives on this machine, taking turns repeat by repeat, and the
collective engine's 64K-element bucket taken whole (its thread, then the dense all-reduce) against
the same bucket through the fused gather (one all-to-all).

    .venv/bin/python docs/log/data/gloo_small/probe.py [W] [repeats]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PERCENTILES = (10, 25, 50, 75, 90)


def _rank(rank: int, world: int, reps: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from omnireduce.engines.collective import CollectiveEngine

    whole = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 1024, world)
    sparse = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 1024, world, latency_bytes=0)
    one = torch.zeros(65536)
    one[256 * 17: 256 * 18] = torch.randn(256)

    def all_reduce(n: int):
        x = torch.ones(n)
        return lambda: dist.all_reduce(x)

    def all_to_all(n: int):
        x, y = torch.ones(n * world), torch.empty(n * world)
        return lambda: dist.all_to_all_single(y, x)

    def all_gather(n: int):
        x, ys = torch.ones(n), [torch.empty(n) for _ in range(world)]
        return lambda: dist.all_gather(ys, x)

    def engine(e: CollectiveEngine):
        return lambda: e.allreduce_async(one.clone()).wait()

    runs = {"all_reduce 1": all_reduce(1), "all_reduce 8": all_reduce(8), "all_reduce 1K": all_reduce(1024),
            "all_reduce 64K": all_reduce(65536), "all_to_all 8/rank": all_to_all(8),
            "all_to_all 1K/rank": all_to_all(1024), "all_to_all 32K/rank": all_to_all(32768),
            "all_gather 8": all_gather(8), "all_gather 1K": all_gather(1024),
            "engine 64K one block, whole": engine(whole), "engine 64K one block, gather": engine(sparse)}
    took: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            took[name].append(time.perf_counter() - t0)
    if rank == 0:
        print(f"W={world}, {reps} repeats, ms: " + " ".join(f"p{p}" for p in PERCENTILES) + " mean")
        for name, v in took.items():
            ms = np.array(v) * 1e3
            print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in np.percentile(ms, PERCENTILES))
                  + f" | {ms.mean():.3f} |")
        print("exchanges:", whole.stats()["exchanges"], sparse.stats()["exchanges"])
    whole.release()
    sparse.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(_rank, args=(W, int(sys.argv[2]) if len(sys.argv) > 2 else 300), nprocs=W)
