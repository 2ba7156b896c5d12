"""The library without DDP: two ranks sum sparse numpy arrays through one in-process aggregator.

    python examples/allreduce_numpy.py

``omnireduce.Aggregator()`` runs an aggregator on a thread of this process (a free loopback port),
which is handy in notebooks and tests; on a cluster it is ``omnireduce-agg`` on a host of its own.
Each rank is a process with an ``omnireduce.Worker``: ``allreduce`` sums in place, and
``allreduce_async`` returns a future so that several tensors can be in flight. The result is checked
against a float64 sum made here.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

import omnireduce

WORLD_SIZE = 2


def gradient(rank: int, n: int = 1_000_000) -> np.ndarray:
    """Mostly zeros, like an embedding table's gradient: a few rows touched per rank."""
    g = np.zeros(n, np.float32)
    rows = np.random.default_rng(rank).choice(n // 64, 100, replace=False)
    for r in rows:
        g[r * 64:(r + 1) * 64] = rank + 1.0
    return g


def rank_main(rank: int, address: str, results: mp.Queue) -> None:
    with omnireduce.Worker(aggregators=[address], rank=rank, world_size=WORLD_SIZE, job="example") as w:
        grad = gradient(rank)
        w.allreduce(grad)                            # the sum over both ranks, in place
        other = np.full(10, rank + 1.0, np.float16)  # float32, float16 and bfloat16 (torch) travel as such
        fut = w.allreduce_async(other)               # returns at once
        fut.result()                                 # `other`, now summed
        results.put((rank, grad, other, w.stats()))


def main() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with omnireduce.Aggregator() as agg:             # listens on tcp://127.0.0.1:<free port>
        ranks = [ctx.Process(target=rank_main, args=(r, agg.address, results)) for r in range(WORLD_SIZE)]
        for p in ranks:
            p.start()
        got = [results.get(timeout=60) for _ in ranks]
        for p in ranks:
            p.join(30)
    want = sum(gradient(r).astype(np.float64) for r in range(WORLD_SIZE))
    for rank, grad, other, stats in sorted(got, key=lambda g: g[0]):
        assert np.array_equal(grad, want.astype(np.float32)), f"rank {rank}: wrong sum"
        assert other.tolist() == [3.0] * 10
        print(f"rank {rank}: sum correct; sent {stats['bytes_sent'] / 1e6:.2f} MB for "
              f"{grad.nbytes / 1e6:.1f} MB of gradient ({stats['blocks_sent']} of {stats['blocks_total']} blocks)")


if __name__ == "__main__":
    main()
