"""The collective engine's dense exchanges (:mod:`omnireduce.engines.exchange_device`) and their choice
(:mod:`omnireduce.engines.plan`).

The exchanges run here on CPU tensors over real Gloo groups, the same torch ops a CUDA tensor
takes: every aten op they dispatch is recorded, and none may be one whose CUDA kernel makes the
host wait (``nonzero``, ``.item()``, boolean indexing, ...): the one wait of a reduction is the
read of its counts, counted. The sums must equal a float64 reference of every rank's inputs. The
choice is pure arithmetic, checked against hand-worked counts.
"""

from __future__ import annotations

import pytest

from omnireduce.engines.plan import (
    Counts,
    Exchange,
    History,
    Order,
    Shape,
    blocks_copied,
    blocks_moved,
    capacity,
    choose,
)
from omnireduce.launch.procs import free_port
from tests.engine_cases import SYNCING
from tests.exchange_host import needs_cxx
from tests.harness import RankPool

_CASES = [
    {"numel": 70_001, "density": 0.1, "dtype": "float32", "exchange": "gather"},
    {"numel": 70_001, "density": 0.1, "dtype": "float32", "exchange": "gather", "capacity": 2},  # overflows
    {"numel": 70_001, "density": 0.1, "dtype": "float32", "exchange": "gather", "capacity": 400, "average": True},
    {"numel": 70_001, "density": 0.3, "dtype": "float32", "exchange": "union"},
    {"numel": 70_001, "density": 0.3, "dtype": "bfloat16", "exchange": "union", "average": True},
    {"numel": 33_333, "density": 0.5, "dtype": "float16", "exchange": "gather"},
    {"numel": 33_333, "density": 0.5, "dtype": "float32", "exchange": "owners"},
    {"numel": 33_333, "density": 0.5, "dtype": "float16", "exchange": "owners", "average": True},
    {"numel": 100, "density": 1.0, "dtype": "float32", "exchange": "union"},  # one short block
    {"numel": 100, "density": 1.0, "dtype": "float32", "exchange": "owners"},
    {"numel": 5_000, "density": 0.0, "dtype": "float32", "exchange": "gather"},  # nothing anywhere
    {"numel": 20_000, "density": 0.3, "dtype": "float32", "exchange": "union", "threshold": 0.5},  # lossy
    {"numel": 20_000, "density": 0.3, "dtype": "float32", "exchange": "gather", "threshold": 0.5},
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_exchanges_wait_once_and_sum_exactly(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.engine_cases:dispatched", world_size, port=free_port(), cases=_CASES)
    for rank, per_rank in enumerate(results):
        for case, r in zip(_CASES, per_rank, strict=True):
            where = f"rank {rank} {case}"
            assert not set(r["ops"]) & set(SYNCING), (where, sorted(set(r["ops"]) & set(SYNCING)))
            assert r["bool_indexed"] == [], where
            assert r["reads"] == ["the blocks' counts"], where  # the one host wait of a reduction
            assert r["exchange"] == case["exchange"], where
            assert "nonzero_static" in r["ops"] or case["density"] == 0, (where, r["ops"])  # (the recorder sees)
            if "threshold" in case:  # (lossy: blocks under it dropped; the aggregators' bits are tested elsewhere)
                assert r["finite"], where
                continue
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[case["dtype"]]
            assert r["err"] <= tol * max(r["scale"], 1e-30) + 1e-30, (where, r["err"], r["scale"])
        overflowed = [r["overflow"] for case, r in zip(_CASES, per_rank, strict=True) if case.get("capacity")]
        assert overflowed == [True, False], overflowed
        # a fused gather is one all-gather; one that overflows, two; a bitmap-first one, two
        assert [r["collectives"] for r in per_rank[:3]] == [2, 2, 1]


# the same inputs summed in place (a float32 host bucket's way) and through a float32 buffer and the
# scatter (the device's way): the short last block on some ranks only, -0.0 in the zero blocks,
# averaged, and a fused all-gather that overflows
_IN_PLACE = [dict(numel=n, density=d, dtype="float32", exchange="gather", seed=900 + k, **extra, in_place=way)
             for k, (n, d, extra) in enumerate([(70_001, 0.3, {"average": True}), (70_001, 0.1, {"capacity": 2}),
                                                (20_000, 0.5, {"capacity": 400}), (300, 0.9, {"average": True})])
             for way in (True, False)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sums_in_place_are_the_buffers_bits(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.engine_cases:dispatched", world_size, port=free_port(), cases=_IN_PLACE)
    for rank, per_rank in enumerate(results):
        for case, here, there in zip(_IN_PLACE[::2], per_rank[::2], per_rank[1::2], strict=True):
            assert here["digest"] == there["digest"], f"rank {rank} {case}: the two ways' bits differ"
            assert here["err"] <= 1e-5 * max(here["scale"], 1e-30) + 1e-30, (rank, case, here["err"])
        assert len({r["digest"] for r in per_rank}) > len(_IN_PLACE) // 4, "the cases' results are not distinct"


# the kernel exchange (its kernels' steps run on the host) against the torch ops' way, case by case:
# every dtype, a fused all-gather that overflows and one that does not, the union's all-reduce, the
# owners' fallback, short last blocks, nothing anywhere, NaN, Inf and -0.0, averaging
_KERNEL_CASES = [dict(numel=n, density=d, dtype=dt, exchange=e, seed=700 + k, **extra)
                 for k, (n, d, dt, e, extra) in enumerate([
                     (70_001, 0.1, "float32", "gather", {}),
                     (70_001, 0.1, "float32", "gather", {"capacity": 2}),
                     (70_001, 0.1, "float32", "gather", {"capacity": 400, "average": True}),
                     (70_001, 0.3, "bfloat16", "gather", {"capacity": 5, "average": True}),
                     (33_333, 0.5, "float16", "gather", {"average": True}),
                     (70_001, 0.3, "float32", "union", {}),
                     (70_001, 0.3, "bfloat16", "union", {"average": True}),
                     (33_333, 0.2, "float16", "union", {"average": True}),
                     (33_333, 0.5, "float32", "owners", {"average": True}),
                     (100, 1.0, "float32", "gather", {}),  # one short block
                     (100, 1.0, "float16", "union", {"average": True}),
                     (5_000, 0.0, "float32", "gather", {}),  # nothing anywhere
                     (12_345, 0.2, "float32", "gather", {"ugly": True, "average": True}),
                     (12_345, 0.2, "float16", "gather", {"ugly": True, "capacity": 3}),
                     (12_345, 0.2, "bfloat16", "union", {"ugly": True}),
                     (256 * 64, 0.4, "float32", "dense", {}),
                 ])]


@needs_cxx
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_kernel_exchange_gives_the_torch_ops_bits(pool: RankPool, world_size: int) -> None:
    _check_kernels_way(pool, world_size, {"kernels": True})


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_numpy_kernels_give_the_torch_ops_bits(pool: RankPool, world_size: int) -> None:
    """The host's way (:mod:`omnireduce.engines.numpy_kernels`) through the kernel exchange."""
    _check_kernels_way(pool, world_size, {"kernels": "numpy"})


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_host_exchange_gives_the_torch_ops_bits(pool: RankPool, world_size: int) -> None:
    """The host's way through the engine (:mod:`omnireduce.engines.host_exchange`): it reads nothing from a
    device, so nothing waits (no read of the counts through a device)."""
    _check_kernels_way(pool, world_size, {"kernels": "host"}, reads=[])


def _check_kernels_way(pool: RankPool, world_size: int, way: dict,
                       reads: tuple[str, ...] | list[str] = ("the blocks' counts",)) -> None:
    """The kernel exchange with ``way``'s kernels against the torch ops, case by case (``_KERNEL_CASES``)."""
    cases = [dict(c, **w) for c in _KERNEL_CASES for w in ({"in_place": False}, way)]
    results = pool.call("tests.engine_cases:dispatched", world_size, port=free_port(), cases=cases)
    for rank, per_rank in enumerate(results):
        for case, ops_way, kernels_way in zip(_KERNEL_CASES, per_rank[::2], per_rank[1::2], strict=True):
            where = f"rank {rank} {case} {way}"
            assert kernels_way["digest"] == ops_way["digest"], f"{where}: the kernels' bits differ from the torch ops'"
            for key in ("exchange", "overflow", "collectives", "counts"):
                assert kernels_way[key] == ops_way[key], (where, key, kernels_way[key], ops_way[key])
            assert kernels_way["reads"] == list(reads), where
            assert not set(kernels_way["ops"]) & set(SYNCING), (where, sorted(set(kernels_way["ops"]) & set(SYNCING)))
            assert kernels_way["specials"], f"{where}: NaN or Inf not where the reference has them"
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[case["dtype"]]
            assert kernels_way["err"] <= tol * max(kernels_way["scale"], 1e-30) + 1e-30, (where, kernels_way["err"])
        assert len({r["digest"] for r in per_rank[1::2]}) == len(_KERNEL_CASES), "the cases' results are not distinct"


def test_the_recorder_sees_what_waits() -> None:
    """The check above can fail: the recorder catches a boolean index, a nonzero and an item."""
    import torch

    from tests.engine_cases import Recorder

    x = torch.arange(6.0)
    with Recorder() as rec:
        _ = x[x > 2]
        _ = torch.nonzero(x)
        _ = float(x.sum())
    assert rec.bool_indexed == ["index"] and {"nonzero", "_local_scalar_dense"} <= set(rec.ops), rec.ops


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 262_145])
def test_the_bitmaps_device_ops_match_the_hosts(n: int) -> None:
    """A device's bitmaps (torch ops: what CUDA runs) and the host's (numpy) are the same bytes and
    the same flags back, and the device's wait for nothing."""
    import numpy as np
    import torch

    from omnireduce.engines import bitmaps
    from tests.engine_cases import Recorder

    rng = np.random.default_rng(n)
    flags, other = (torch.from_numpy(rng.random(n) < p) for p in (0.3, 0.6))
    with Recorder() as rec:
        packed = bitmaps.pack_torch(flags)
        both = torch.stack([packed, bitmaps.pack_torch(other)])
        back = bitmaps.unpack_torch(both, n)
    assert not set(rec.ops) & set(SYNCING) and rec.bool_indexed == [], rec.ops
    assert torch.equal(packed, bitmaps.pack(flags)) and packed.numel() == -(-n // 8)
    assert torch.equal(back, bitmaps.unpack(both, n)) and torch.equal(back[0], flags) and torch.equal(back[1], other)
    union = back.any(dim=0)
    if n == 0:  # (no counts for a tensor without blocks: the engine returns before them)
        return
    owner = torch.from_numpy(rng.integers(0, 2, n))
    for own in (None, owner):
        ones = bitmaps.counts_host(*bitmaps.unpack_host(both.numpy(), n), own, 2)
        assert torch.equal(ones, bitmaps.counts_device(back, union, own, 2)), ones
        assert ones.dtype == torch.int64
    want = [int(flags.sum()), int(other.sum()), int((flags | other).sum()), int(flags[-1] | other[-1])]
    want += [int((f & (owner == o)).sum()) for f in (flags, other) for o in (0, 1)]
    assert ones.tolist() == want + [int((flags | other)[owner == o].sum()) for o in (0, 1)]


def test_choice_prices_bytes_and_collectives() -> None:
    W = 4
    # no overlap: 4 ranks of 10 blocks, a union of 40, owned 10 each
    apart = Counts((10,) * W, 40, False, tuple(tuple(3 if o != s else 1 for o in range(W)) for s in range(W)),
                   (10,) * W)
    assert blocks_moved(Exchange.GATHER, apart) == 30 and blocks_moved(Exchange.UNION, apart) == 60
    assert blocks_moved(Exchange.OWNERS, apart) == 9 + 30
    assert choose(apart, 1024) is Exchange.GATHER
    # the same 10 blocks on every rank: the union's all-reduce moves the fewest
    same = Counts((10,) * W, 10, False, tuple(tuple(3 if o < 2 else 2 for o in range(W)) for _ in range(W)),
                  (3, 3, 2, 2))
    assert blocks_moved(Exchange.UNION, same) == 15 and choose(same, 1024, latency_bytes=0) is Exchange.UNION
    # rank order: the union's all-reduce is never taken
    assert choose(same, 1024, order=Order.RANK, latency_bytes=0) is Exchange.OWNERS
    # a collective's fixed cost decides between near equals: owners pays for two
    assert choose(same, 1, order=Order.RANK, latency_bytes=1 << 20) is Exchange.GATHER
    with pytest.raises(ValueError, match="no exchange left"):
        choose(same, 1024, order=Order.RANK, allowed=[Exchange.UNION])
    # without the pairs' counts the owners' exchange is not priced
    assert choose(Counts((5, 5), 6), 1024, allowed=[Exchange.OWNERS, Exchange.GATHER]) is Exchange.GATHER
    assert Counts.from_flat([3, 4, 5, 1, 1, 2, 3, 4, 6, 7], 2) == Counts((3, 4), 5, True, ((1, 2), (3, 4)), (6, 7))


def test_the_steady_state_prices_the_bitmaps_collective_gather_folds_in() -> None:
    """fused=True: a shape that goes gather sends its bitmap with its blocks next time, so every
    other exchange pays the bitmaps' all-gather besides its own: the same block on 4 ranks goes
    union one reduction at a time, gather in the steady state; where the union's all-reduce saves
    more bytes than a collective is worth it still wins; the dense all-reduce pays it too."""
    one = Counts((1,) * 4, 1, False)
    assert choose(one, 1024, num_blocks=256) is Exchange.UNION  # 2 blocks against 3
    assert choose(one, 1024, num_blocks=256, fused=True) is Exchange.GATHER  # 3 blocks + 1 call, 2 + 2 calls
    assert choose(one, 1024, latency_bytes=0, fused=True) is Exchange.UNION  # (calls priced at nothing)
    overlap = Counts((1000,) * 4, 1000, False)  # gather 3000 blocks, union 1500: 1.5 MiB saved > 256 KiB
    assert choose(overlap, 1024, num_blocks=4096, fused=True) is Exchange.UNION
    # every block everywhere at 2 ranks: the dense all-reduce, priced with the bitmaps' all-gather too
    full = Counts((4096, 4096), 4096, True)
    assert choose(full, 1024, num_blocks=4096, local_weight=0.2, fused=True) is Exchange.DENSE  # the copies decide
    assert choose(full, 1024, num_blocks=4096, local_weight=0.0, fused=True) is Exchange.GATHER  # one call fewer


def test_the_dense_all_reduce_is_chosen_where_every_block_is_non_zero() -> None:
    """Every block non-zero at 2 ranks: the gather and the whole bucket's all-reduce move the same
    bytes, and the copies the gather makes on the rank decide for the dense all-reduce once priced;
    a sparse bucket still goes sparse, and rank order never goes dense."""
    full = Counts((10, 10), 10, True)
    assert blocks_moved(Exchange.DENSE, full, 10) == blocks_moved(Exchange.GATHER, full) == 10
    assert blocks_copied(Exchange.DENSE, full) == 0 < blocks_copied(Exchange.UNION, full)
    assert choose(full, 1024, num_blocks=10, local_weight=0.2) is Exchange.DENSE
    assert choose(full, 1024, num_blocks=10, local_weight=0.0) is Exchange.GATHER  # (a tie: the first listed)
    assert choose(full, 1024, local_weight=0.2) is not Exchange.DENSE  # (no bucket size: not priced)
    assert choose(full, 1024, num_blocks=10, local_weight=0.2, order=Order.RANK) is Exchange.GATHER
    assert choose(Counts((10,), 10, True), 1024, num_blocks=10, local_weight=0.2) is Exchange.GATHER  # (one rank)
    sparse = Counts((1, 1), 2, False)
    assert choose(sparse, 1024, num_blocks=100, local_weight=0.2) is Exchange.GATHER
    # at 8 ranks with every block everywhere the union's all-reduce moves what the dense one does:
    # its compaction copies tip it to dense
    eight = Counts((50,) * 8, 50, True)
    assert choose(eight, 1024, num_blocks=50, local_weight=0.02) is Exchange.DENSE
    assert choose(eight, 1024, num_blocks=50, local_weight=0.0) is Exchange.UNION


def test_a_small_bucket_goes_dense_whole() -> None:
    from omnireduce.engines.plan import goes_dense

    # 2 (W-1)/W of the bucket's bytes against one collective's worth (256 KiB by default)
    assert goes_dense(65_536, 4, 2) and not goes_dense(65_537, 4, 2)
    assert goes_dense(43_690, 4, 4) and not goes_dense(43_691, 4, 4)  # 1.5 x 4 bytes x 43,690 = 262,140
    assert not goes_dense(10, 4, 2, order=Order.RANK) and not goes_dense(10, 4, 1)
    assert goes_dense(1 << 20, 2, 2, latency_bytes=2 << 20) and not goes_dense(1 << 20, 2, 2, latency_bytes=0)


def test_history_fuses_after_a_gather_and_stays_bounded() -> None:
    h = History(limit=2)
    a, b, c = (Shape(n, "torch.float32", 256) for n in (1000, 2000, 3000))
    assert not h.next_step(a, 4, fuse=True).fused  # nothing known: bitmaps first
    h.record(a, Exchange.GATHER, Counts((3, 7), 9))
    step = h.next_step(a, 4, fuse=True)
    assert step.fused and step.capacity == capacity(7, 4) == 4  # (at most the bucket's blocks)
    assert not h.next_step(a, 4, fuse=False).fused
    assert capacity(100, 10_000) == 128 and capacity(0, 10_000) == 4  # 126 up to a multiple of 8 (64 / 8)
    assert len({capacity(m, 10**9) for m in range(2600, 2700)}) <= 2  # nearby counts: the same sizes
    assert all(capacity(m, 10**9) >= m + m // 4 + 1 for m in range(0, 5000, 7))
    h.record(a, Exchange.UNION, Counts((3, 7), 9))
    assert not h.next_step(a, 4, fuse=True).fused  # the union went its own way: bitmaps first again
    h.record(b, Exchange.GATHER, Counts((1, 1), 1))
    h.record(c, Exchange.GATHER, Counts((1, 1), 1))
    assert len(h) == 2 and not h.next_step(a, 4, fuse=True).fused  # the oldest shape went first
