"""The library without DDP, with nothing deployed: the job's ranks start their own aggregators.

    torchrun --nproc-per-node 2 examples/colocated_worker.py
    mpiexec -n 2 python examples/colocated_worker.py

``start_colocated()`` is collective over a torch.distributed process group: the first rank of each
node starts one aggregator (its child: it stops with it), rank 0 makes a token, and every rank gets
the same addresses and token, to give ``omnireduce.Worker``. The sums are checked against float64.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

import omnireduce
from omnireduce.colocate import start_colocated
from omnireduce.launch import init_distributed


def gradient(rank: int, n: int = 1_000_000) -> np.ndarray:
    """Mostly zeros, like an embedding table's gradient: a few rows touched per rank."""
    g = np.zeros(n, np.float32)
    rows = np.random.default_rng(rank).choice(n // 64, 100, replace=False)
    for r in rows:
        g[r * 64:(r + 1) * 64] = rank + 1.0
    return g


def main() -> None:
    rank, world_size = init_distributed()  # torchrun's variables, or mpiexec's ranks
    with start_colocated() as aggs, omnireduce.Worker(aggs.addresses, rank=rank, world_size=world_size,
                                                      token=aggs.token, job="colocated-example") as w:
        grad = gradient(rank)
        w.allreduce(grad)  # the sum over every rank, in place
        want = sum(gradient(r).astype(np.float64) for r in range(world_size))
        ok = np.array_equal(grad, want.astype(np.float32))
        s = w.stats()
        print(f"rank {rank}: sum {'correct' if ok else 'WRONG'}; sent {s['bytes_sent']} bytes for "
              f"{grad.nbytes} bytes of gradient, through {len(aggs.addresses)} aggregator(s)", flush=True)
        dist.barrier()  # every rank is done before the aggregators stop
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
