"""A finished tensor kept for replays does not keep the caller's tensor alive, nor its lanes' index,
nor its sums for longer than twice the timeout.

With restart recovery on (the default retention), the worker's I/O thread keeps each finished
all-reduce for a while, so that it can replay the sums if an aggregator restarts. What it keeps must
be the sums, not the caller's tensor: under DDP that tensor is a gradient bucket, which DDP replaces
when it rebuilds its buckets after the first iteration, and an old bucket kept alive costs a whole
gradient's worth of memory (scripts/bench_memory.py measures it).

Real worker processes (the session's :class:`~tests.harness.RankPool`) reduce a fresh random tensor
through a real aggregator; once the result is checked against the float64 sum and the finished
tensor is retained, the caller drops its references and a weak reference to the input must be dead.
"""

from __future__ import annotations

from typing import Any

import pytest

import omnireduce
from tests.harness import RankPool


def reduce_then_drop(rank: int, *, world_size: int, addresses: list[str], job: str, kind: str, lanes: int | None,
                     seed: int) -> dict[str, Any]:
    """(Run in the ranks with :meth:`RankPool.call`.) All-reduce a fresh random tensor, check it,
    wait until the I/O thread retains the finished tensor, drop the caller's references and report
    whether the input is still alive."""
    import gc
    import weakref

    from omnireduce import Worker
    from tests.harness import Case, assert_matches, make_input, to_numpy, wait_for

    case = Case(numel=100_003, density=0.3, seed=seed, kind=kind)
    with Worker(addresses, rank=rank, world_size=world_size, job=job, timeout=30.0, lanes=lanes) as w:
        io = w._io
        assert w.config.retain_bytes > 0, "restart recovery (retention) must be on"
        x = make_input(case, rank)
        ref = weakref.ref(x)
        future = w.allreduce_async(x)
        assert future.result(60) is x
        assert_matches(case, world_size, to_numpy(x))
        # the I/O thread files the finished tensor for replays right after completing its future
        retained = bool(wait_for(lambda: 0 in io._retained, timeout=10))
        kept = io._retained.get(0)
        index = kept is not None and (kept._index is not None or any(c is not None for c in kept._cur))
        del x, future, kept
        gc.collect()
        return {"alive": ref() is not None, "retained": retained, "retained_bytes": io._retained_bytes,
                "index": index}


# the default lanes: every lane holds one row (blocks sent with the bootstrap, one round); 8 lanes:
# many rows per lane, rounds in lockstep
@pytest.mark.parametrize("lanes", [None, 8], ids=["one-round", "lockstep"])
@pytest.mark.parametrize("kind", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def test_retained_tensor_does_not_keep_input_alive(pool: RankPool, aggregator: omnireduce.Aggregator, job: str,
                                                   kind: str, lanes: int | None) -> None:
    world_size = 2
    results = pool.call("tests.test_retention_memory:reduce_then_drop", world_size, addresses=[aggregator.address],
                        job=job, kind=kind, lanes=lanes, seed=7, timeout=120)
    for rank, r in enumerate(results):
        assert r["retained"], f"rank {rank}: the finished tensor was not retained for replays ({r})"
        assert r["retained_bytes"] > 0, f"rank {rank}: nothing retained ({r})"
        assert not r["alive"], (f"rank {rank}: the caller's {kind} input is still referenced after the all-reduce "
                                "completed (the retained tensor holds it)")
        assert not r["index"], f"rank {rank}: the retained tensor still holds its lanes' index or rounds"


def reduce_then_wait(rank: int, *, world_size: int, addresses: list[str], job: str,
                     op_timeout: float) -> dict[str, Any]:
    """(Run in the ranks.) One all-reduce and nothing after it: no later tensor moves the watermark,
    so only the age limit (twice the timeout) can drop the retained sums."""
    import time

    from omnireduce import Worker
    from tests.harness import Case, assert_matches, make_input, wait_for

    timeout = op_timeout
    case = Case(numel=50_001, density=0.5, seed=3, kind="numpy")
    with Worker(addresses, rank=rank, world_size=world_size, job=job, timeout=timeout) as w:
        io = w._io
        x = make_input(case, rank)
        w.allreduce(x)
        assert_matches(case, world_size, x)
        done = time.monotonic()
        retained = bool(wait_for(lambda: 0 in io._retained, timeout=10))
        kept_at_half = bool(io._retained) if time.monotonic() - done < timeout else None
        dropped = bool(wait_for(lambda: not io._retained, timeout=4 * timeout + 5))
        return {"retained": retained, "kept_at_half": kept_at_half, "dropped": dropped,
                "after": time.monotonic() - done, "bytes": io._retained_bytes}


def test_retained_sums_are_dropped_after_twice_the_timeout(pool: RankPool, aggregator: omnireduce.Aggregator,
                                                           job: str) -> None:
    timeout = 1.5
    results = pool.call("tests.test_retention_memory:reduce_then_wait", 2, addresses=[aggregator.address], job=job,
                        op_timeout=timeout, timeout=60)
    for rank, r in enumerate(results):
        assert r["retained"] and r["kept_at_half"] is not False, f"rank {rank}: {r}"
        assert r["dropped"] and r["bytes"] == 0, f"rank {rank}: the sums were never dropped: {r}"
        assert r["after"] >= 2 * timeout - 0.5, f"rank {rank}: dropped too early: {r}"


def reduce_and_report_kept(rank: int, *, world_size: int, addresses: list[str], job: str,
                           dense: bool) -> dict[str, Any]:
    """(Run in the ranks.) One all-reduce of an input whose non-zero blocks are every block (``dense``:
    sent straight from the input, runs of blocks) or every other one (gathered into buffers of their
    own); what the rank then keeps of it for replays."""
    import numpy as np

    from omnireduce import Worker
    from tests.harness import wait_for

    B = 256
    rng = np.random.default_rng([rank, 17])
    x = rng.standard_normal(512 * B).astype(np.float32)
    if not dense:
        x.reshape(512, B)[1::2] = 0.0
    want = x.astype(np.float64)  # (the other rank's part follows from its seed)
    other = np.random.default_rng([1 - rank, 17]).standard_normal(512 * B).astype(np.float32)
    if not dense:
        other.reshape(512, B)[1::2] = 0.0
    with Worker(addresses, rank=rank, world_size=world_size, job=job, timeout=30.0) as w:
        io = w._io
        w.allreduce(x)
        assert bool(wait_for(lambda: 0 in io._retained, timeout=10))
        op = io._retained[0]
        parts = [(d.nbytes, bool(d.flags.owndata)) for staged in op._staged.values() for _, d in staged]
        exact = bool(np.array_equal(x, (want + other).astype(np.float32)))  # (two float32 summed once)
        kept = io._retained_bytes
        w.release_kept(1)  # (both ranks have finished tensor 0: what the ranks' agreement would say)
        released = bool(wait_for(lambda: not io._retained, timeout=2))
        return {"gathered": op.gathered_bytes, "parts": parts, "kept": kept, "exact": exact, "released": released}


@pytest.mark.parametrize("dense", [False, True], ids=["every-other-block", "every-block"])
def test_kept_sums_are_copied_only_into_what_the_gathered_blocks_freed(pool: RankPool,
                                                                       aggregator: omnireduce.Aggregator,
                                                                       job: str, dense: bool) -> None:
    """A rank copies the sums it keeps out of the buffers they arrived in only as far as the blocks it
    sent took buffers of their own (freed by then): every part of a sparse input's sums, none of a
    dense one's (its blocks went straight from the input, and a copy would add its whole size). Once
    every rank has finished the tensor, ``release_kept`` lets the copies go at once; sums still in
    the buffers they arrived in stay for the next results (or the age limit)."""
    results = pool.call("tests.test_retention_memory:reduce_and_report_kept", 2, addresses=[aggregator.address],
                        job=job, dense=dense, timeout=60)
    for rank, r in enumerate(results):
        assert r["exact"], f"rank {rank}: {r}"
        total = sum(n for n, _ in r["parts"])
        assert r["kept"] == total > 0, f"rank {rank}: {r}"
        if dense:
            assert r["gathered"] == 0 and not any(own for _, own in r["parts"]), f"rank {rank}: {r}"
            assert not r["released"], f"rank {rank}: sums in the received buffers went at release_kept ({r})"
        else:
            assert r["gathered"] == 256 * 256 * 4, f"rank {rank}: {r}"  # (its 256 non-zero blocks)
            assert all(own for _, own in r["parts"]), f"rank {rank}: {r}"
            assert r["released"], f"rank {rank}: the copies did not go at release_kept ({r})"
