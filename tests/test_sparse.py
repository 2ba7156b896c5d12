"""Sparse COO tensors (embedding gradients) through the worker, against references built here.

The reference of a reduction is computed from the inputs alone: a float64 dense sum (small tables),
and, bit for bit, the documented order of the sums (omnireduce.sources.sparse): each rank's
duplicates of a row summed in float32 in input order and rounded once to the dtype, then the ranks'
rows summed in rank order in float32 and rounded once. Levels: the lane index built from ids
against the one built from flags; the protocol without sockets (every rank's SparseOp against the
aggregator's SlotStates, random interleavings, an aggregator restart); real workers and an
aggregator over zmq (threads as ranks), including a table of 10^8 rows, and bad input.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.blocks import INF, MAX_FRAME_BYTES, LaneIndex, Layout
from omnireduce.dtypes import DType, narrow, widen
from omnireduce.errors import OmniReduceError, OmniReduceMismatchError
from omnireduce.sources.sparse import (
    SparseInputError,
    SparseSource,
    blocks_per_row,
    check_sparse,
    coalesce_rows,
    sparse_layout,
)
from omnireduce.worker.op import ReduceFuture
from omnireduce.worker.sparse import SparseOp
from tests.harness import RankThreads, run_in_threads
from tests.test_protocol import _Network

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}


# -- inputs and the reference ----------------------------------------------------------------------

def make_coo(rows: int, dim: int, nnz: int, dtype: str = "float32", seed: int = 0, *, coalesced: bool = False,
             every_row: bool = False) -> torch.Tensor:
    """A (rows, dim) COO tensor with ``nnz`` entries (duplicate row ids among them), values exactly
    representable in ``dtype`` (some exactly zero, some -0.0)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, rows, size=nnz) if rows else np.zeros(0, np.int64)
    if every_row:
        idx = np.concatenate([rng.permutation(rows), idx])
    vals = rng.standard_normal((idx.size, dim)).astype(np.float32)
    vals[rng.random(vals.shape) < 0.05] = 0.0
    vals[rng.random(vals.shape) < 0.02] = -0.0
    vals = widen(narrow(vals, DTYPES[dtype]), DTYPES[dtype])
    x = torch.sparse_coo_tensor(torch.from_numpy(idx).reshape(1, -1), torch.from_numpy(vals).to(TORCH[dtype]),
                                (rows, dim), check_invariants=False)
    return x.coalesce() if coalesced else x


def _rows_of(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Row ids and float32 values of a COO tensor, entries in stored order."""
    return x._indices()[0].numpy(), x._values().to(torch.float32).numpy()


def spec_sum(inputs: list[torch.Tensor], dtype: str, average: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rows, float32 values) the reduction must give, bit for bit, computed entry by entry."""
    dt = DTYPES[dtype]

    def rnd(v: np.ndarray) -> np.ndarray:
        return widen(narrow(np.asarray(v, np.float32), dt), dt)

    per_rank = []
    for x in inputs:
        acc: dict[int, np.ndarray] = {}
        idx, vals = _rows_of(x)
        for i, row in enumerate(idx.tolist()):
            acc[row] = vals[i].copy() if row not in acc else (acc[row] + vals[i]).astype(np.float32)
        per_rank.append({row: rnd(v) for row, v in acc.items()})
    rows = sorted(set().union(*per_rank))
    dim = inputs[0].shape[1]
    out = np.zeros((len(rows), dim), np.float32)
    for k, row in enumerate(rows):
        acc_row = None
        for r in range(len(inputs)):  # rank order
            v = per_rank[r].get(row)
            if v is not None:
                acc_row = v.copy() if acc_row is None else (acc_row + v).astype(np.float32)
        v = rnd(acc_row)
        out[k] = rnd(v * np.float32(1.0 / len(inputs))) if average else v
    return np.asarray(rows, np.int64), out


def check_result(out: torch.Tensor, inputs: list[torch.Tensor], dtype: str, *, average: bool = False) -> None:
    """``out`` is coalesced, of the inputs' shape and dtype, equals the float64 dense sum within the
    dtype's rounding, and is bit for bit the documented rank-order sum."""
    x0 = inputs[0]
    assert out.layout == torch.sparse_coo and out.is_coalesced() and out.shape == x0.shape and out.dtype == x0.dtype
    rows, want = spec_sum(inputs, dtype, average)
    got_rows, got = _rows_of(out)
    assert np.array_equal(got_rows, rows), (got_rows[:10], rows[:10])
    exact = ~np.isnan(want) & (want != 0)
    assert np.array_equal(got[exact].view(np.uint32), want[exact].view(np.uint32))
    assert not got[~exact & ~np.isnan(want)].any()
    if x0.shape[0] * x0.shape[1] <= 1 << 22:  # the float64 dense reference
        ref = sum(x.to(torch.float64).to_dense() for x in inputs)
        mag = sum(torch.sparse_coo_tensor(x._indices(), x._values().to(torch.float64).abs(), x.shape).to_dense()
                  for x in inputs)  # (abs() of an uncoalesced tensor would sum the entries first)
        if average:
            ref, mag = ref / len(inputs), mag / len(inputs)
        tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
        assert ((out.to_dense().to(torch.float64) - ref).abs() <= tol * mag + 1e-30).all()


# -- pieces ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel,block,lanes,slots", [(1000, 1, 1024, 4), (10_000, 10, 8, 3), (999, 7, 5, 2),
                                                     (70_001, 1, 4, 1), (64, 64, 32768, 4)])
def test_lane_index_from_ids_is_the_flags_index(numel: int, block: int, lanes: int, slots: int) -> None:
    layout = Layout.for_tensor(numel, block, lanes, slots)
    rng = np.random.default_rng(numel)
    for density in (0.0, 0.01, 0.3, 1.0):
        flags = rng.random(layout.num_blocks) < density
        a, b = LaneIndex(layout, flags), LaneIndex.from_ids(layout, np.flatnonzero(flags))
        assert np.array_equal(a.next, b.next)
        for s in range(layout.slots):  # send everything, one round at a time; restart a slot midway
            for step in range(layout.rows + 1):
                pending = a.pending(s)
                assert np.array_equal(pending, b.pending(s))
                lanes_now = np.flatnonzero(pending != INF)
                if lanes_now.size == 0:
                    break
                send = lanes_now[rng.random(lanes_now.size) < 0.7]
                assert np.array_equal(a.advance(s, send), b.advance(s, send))
                if step == 1:
                    a.reset(s)
                    b.reset(s)
                    assert np.array_equal(a.next, b.next)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_coalesce_sums_duplicates_in_input_order(dtype: str) -> None:
    x = make_coo(50, 6, 400, dtype, seed=3)
    idx, vals = x._indices()[0].numpy(), x._values()
    raw = vals.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else vals.numpy()
    rows, got = coalesce_rows(idx, raw, DTYPES[dtype])
    want_rows, want = spec_sum([x], dtype)
    assert np.array_equal(rows, want_rows)
    assert np.array_equal(widen(got, DTYPES[dtype]).view(np.uint32), want.view(np.uint32))
    # an already coalesced input is used as it is (no copy, no arithmetic)
    c = x.coalesce()
    craw = c._values().view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else c._values().numpy()
    rows2, got2 = coalesce_rows(c._indices()[0].numpy(), craw, DTYPES[dtype], presorted=True)
    assert got2 is craw and np.array_equal(rows2, c._indices()[0].numpy())


def test_geometry_one_row_per_block_and_limits() -> None:
    lay, per_row = sparse_layout(10**8, 16, DType.FLOAT32, 32768, 4)
    assert (lay.block_size, per_row, lay.num_blocks, lay.lanes * lay.slots) == (16, 1, 10**8, 131072)
    lay, _ = sparse_layout(1000, 100_000, DType.FLOAT32, 32768, 4)  # wide rows: fewer lanes
    assert lay.lanes * lay.block_size * 4 <= MAX_FRAME_BYTES < (lay.lanes + 1) * lay.block_size * 4
    assert blocks_per_row(1 << 20) == 1 and blocks_per_row((1 << 20) + 2) == 2 and blocks_per_row(3 << 20) == 3
    with pytest.raises(ValueError, match="2\\^40"):
        check_sparse(torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 1 << 12),
                                             (1 << 30, 1 << 12)))


# -- the protocol without sockets --------------------------------------------------------------------

def _protocol_reduce(inputs: list[torch.Tensor], *, lanes: int, slots: int, aggregators: int, seed: int = 0,
                     average: bool = False, restart: tuple[int, int] | None = None) -> list[Any]:
    world = len(inputs)
    net = _Network(world, aggregators, seed)  # (each rank a WorkerCore, each aggregator a Core)
    for r, x in enumerate(inputs):
        dtype, rows, dim = check_sparse(x)
        net.submit(SparseOp(0, x, SparseSource(x, dtype, rows, dim, lanes, slots), rank=r, world_size=world,
                            num_aggregators=aggregators, average=average, threshold=0.0, future=ReduceFuture()))
    net.run(restart)
    futures = [net.futures[r, 0] for r in range(world)]
    assert all(f.done() for f in futures), [f for f in futures if not f.done()]
    assert net.slots_held() == 0
    return [f.result() for f in futures]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_protocol_sums_rows_in_rank_order(world: int, dtype: str) -> None:
    """Duplicates, nnz 0 on some ranks, every row touched, coalesced inputs, several geometries (one
    row per lane; several rows per lane over several slots and aggregators; one lane)."""
    cases = [(200, 8, [30, 0, 55, 1]), (64, 3, [200, 200, 0, 7]), (1000, 1, [0, 0, 0, 0]), (300, 5, [5, 900, 40, 2])]
    for c, (rows, dim, nnz) in enumerate(cases):
        inputs = [make_coo(rows, dim, nnz[r], dtype, seed=100 * c + r, coalesced=r == 1, every_row=c == 1 and r == 0)
                  for r in range(world)]
        for lanes, slots, aggs in [(32768, 4, 1), (16, 5, 2), (1, 1, 1)]:
            outs = _protocol_reduce(inputs, lanes=lanes, slots=slots, aggregators=aggs, seed=c)
            for out in outs:
                check_result(out, inputs, dtype)


def test_protocol_average_and_aggregator_restart() -> None:
    inputs = [make_coo(500, 4, n, "float32", seed=n) for n in (40, 0, 300)]
    for out in _protocol_reduce(inputs, lanes=8, slots=3, aggregators=2, average=True):
        check_result(out, inputs, "float32", average=True)
    for k in (0, 5, 20, 60):
        for out in _protocol_reduce(inputs, lanes=8, slots=3, aggregators=2, seed=k, restart=(k % 2, k)):
            check_result(out, inputs, "float32")


# -- real workers over zmq ----------------------------------------------------------------------------

def _reduce_all(address: str, job: str, inputs: list[Any], *, average: bool = False, timeout: float = 20.0,
                **worker: Any) -> list[Any]:
    """Each rank (a thread) reduces its list of tensors in turn; per rank, the results (or errors)."""
    world = len(inputs)
    # Ranks stay in the job until all are done, as training processes do: a job whose members have all
    # left is forgotten by the aggregator, and a late rank would then wait for them until its deadline.
    together = threading.Barrier(world)

    def rank_main(rank: int) -> list[Any]:
        out = []
        with omnireduce.Worker(address, rank=rank, world_size=world, job=job, timeout=timeout, **worker) as w:
            for x in inputs[rank]:
                try:
                    out.append(w.allreduce(x, average=average))
                except Exception as e:
                    out.append(e)
            together.wait(4 * timeout)
        return out

    return run_in_threads(rank_main, world, timeout=4 * timeout)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_worker_reduces_sparse_tensors(aggregator, job: str, dtype: str) -> None:
    world = 3
    cases = [(1000, 16, [50, 0, 80]), (40, 7, [300, 10, 500]), (5000, 3, [0, 0, 0]), (12, 2, [1, 1, 1])]
    inputs = [[make_coo(rows, dim, nnz[r], dtype, seed=10 * c + r, coalesced=(c + r) % 2 == 0, every_row=c == 1)
               for c, (rows, dim, nnz) in enumerate(cases)] for r in range(world)]
    before = [[x.clone() for x in per] for per in inputs]
    results = _reduce_all(aggregator.address, job, inputs)
    for c in range(len(cases)):
        mine = [inputs[r][c] for r in range(world)]
        for r in range(world):
            check_result(results[r][c], mine, dtype)
            x, b = inputs[r][c], before[r][c]
            assert torch.equal(x._indices(), b._indices()) and torch.equal(x._values(), b._values()), "input changed"
    averaged = _reduce_all(aggregator.address, job + "-avg", [per[:2] for per in inputs], average=True)
    for c in range(2):
        for r in range(world):
            check_result(averaged[r][c], [inputs[q][c] for q in range(world)], dtype, average=True)


def test_the_same_bits_every_run(aggregator, job: str) -> None:
    inputs = [[make_coo(300, 8, n, "float32", seed=n)] for n in (400, 250, 333)]
    runs = [_reduce_all(aggregator.address, f"{job}-{i}", inputs) for i in range(2)]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a[0]._values(), b[0]._values()) and torch.equal(a[0]._indices(), b[0]._indices())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_table_of_10_to_the_8_rows_costs_its_touched_rows(aggregator, job: str) -> None:
    """10^8 rows of 16 floats (6.4 GB as a dense table; its block flags alone would be 100 MB): a few
    thousand touched rows per rank. Python-level allocations (tracemalloc: every numpy array, at the
    workers and the in-process aggregator) and the process's resident memory stay small."""
    rows, dim, world = 10**8, 16, 2
    inputs = [[make_coo(rows, dim, 3000, seed=r)] for r in range(world)]
    peak_rss, stop = [_rss()], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak_rss[0] = max(peak_rss[0], _rss())
            time.sleep(0.002)

    base_rss = _rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        results = _reduce_all(aggregator.address, job, inputs)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        stop.set()
        sampler.join()
    for r in range(world):
        check_result(results[r][0], [inputs[q][0] for q in range(world)], "float32")
    assert peak < 24 << 20, f"traced peak {peak / 2**20:.1f} MiB"
    assert peak_rss[0] - base_rss < 64 << 20, f"resident memory grew by {(peak_rss[0] - base_rss) / 2**20:.1f} MiB"
    assert elapsed < 10, elapsed


# -- bad input: an error on every rank, at once, the input untouched ------------------------------------

def test_shapes_and_dtypes_that_differ_fail_every_rank(aggregator, job: str) -> None:
    good = [make_coo(100, 4, 10, seed=r) for r in range(3)]
    cases = {"rows": make_coo(120, 4, 10, seed=9), "dim": make_coo(100, 5, 10, seed=9),
             "dtype": make_coo(100, 4, 10, "float16", seed=9)}
    for what, odd in cases.items():
        inputs = [[good[0]], [odd], [good[2]]]
        t0 = time.monotonic()
        results = _reduce_all(aggregator.address, f"{job}-{what}", inputs, timeout=20)
        assert time.monotonic() - t0 < 10, (what, results)
        for r in range(3):
            e = results[r][0]
            assert isinstance(e, OmniReduceMismatchError), (what, r, e)
            assert "sparse" in str(e) and "disagree" in str(e), str(e)


@pytest.mark.parametrize("where", ["above", "negative"])
def test_row_ids_out_of_range_fail_every_rank_and_the_job_goes_on(aggregator, job: str, where: str) -> None:
    bad_id = 100 if where == "above" else -3
    bad = torch.sparse_coo_tensor(torch.tensor([[1, bad_id, 5]]), torch.ones(3, 4), (100, 4), check_invariants=False)
    after = [make_coo(100, 4, 20, seed=r) for r in range(3)]
    inputs = [[make_coo(100, 4, 10, seed=r) if r != 1 else bad, after[r]] for r in range(3)]
    saved = bad._values().clone()
    t0 = time.monotonic()
    results = _reduce_all(aggregator.address, job, inputs, timeout=20)
    assert time.monotonic() - t0 < 10, results
    assert isinstance(results[1][0], SparseInputError) and f"row id {bad_id} is out of range" in str(results[1][0])
    for r in (0, 2):
        assert isinstance(results[r][0], OmniReduceError) and "aborted by rank 1" in str(results[r][0])
        assert f"row id {bad_id} is out of range" in str(results[r][0])
    assert torch.equal(bad._values(), saved)
    for r in range(3):  # the next tensor is reduced as usual: every rank's numbering stayed in step
        check_result(results[r][1], after, "float32")


def _bad_kinds() -> dict[str, Any]:
    dense = torch.zeros(10, 4)
    return {
        "1-D": torch.zeros(10).to_sparse(),
        "3-D": torch.zeros(10, 4, 2).to_sparse(1),
        "hybrid, 2 dense dims": torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 4, 2), (10, 4, 2)),
        "2 sparse dims": dense.to_sparse(),
        "CSR": dense.to_sparse_csr(),
        "float64": torch.zeros(10, 4, dtype=torch.float64).to_sparse(1),
    }


@pytest.mark.parametrize("kind", list(_bad_kinds()))
def test_bad_kinds_raise_here_and_fail_the_others_at_once(aggregator, job: str, kind: str) -> None:
    """Rank 0 passes a sparse tensor omnireduce cannot reduce, the others a good one: rank 0 gets a
    TypeError at once, the others an error naming it (not a timeout); then all go on in step."""
    bad = _bad_kinds()[kind]
    good = [make_coo(10, 4, 5, seed=r) for r in range(3)]
    nxt = [make_coo(10, 4, 5, seed=10 + r) for r in range(3)]
    errors: dict[int, BaseException] = {}
    together = threading.Barrier(3)

    def rank_main(rank: int) -> Any:
        with omnireduce.Worker(aggregator.address, rank=rank, world_size=3, job=job, timeout=20) as w:
            t0 = time.monotonic()
            try:
                w.allreduce(bad if rank == 0 else good[rank])
            except Exception as e:
                errors[rank] = e
            took = time.monotonic() - t0
            out = w.allreduce(nxt[rank])
            together.wait(60)
            return took, out

    results = RankThreads(rank_main, 3).start().join(60)
    assert isinstance(errors[0], TypeError), errors
    for r in (1, 2):
        assert isinstance(errors[r], OmniReduceError) and "aborted by rank 0" in str(errors[r]), errors[r]
        assert "TypeError" in str(errors[r])
    for took, out in results:
        assert took < 5
        check_result(out, nxt, "float32")


def test_stacked_tables_reduce_like_each_table(aggregator, job: str) -> None:
    """concat_rows/split_rows (how the DDP hook reduces all its sparse buckets at once): the same
    bits as reducing each table alone."""
    from omnireduce.ddp.paths.coo import concat_rows, split_rows

    world, shapes = 3, [(500, 8), (7, 8), (2000, 8), (1, 8)]
    tables = [[make_coo(r_, d, [40, 3, 0][r] + i, seed=10 * i + r) for i, (r_, d) in enumerate(shapes)]
              for r in range(world)]
    stacked = [[concat_rows(per)[0]] for per in tables]
    offsets = concat_rows(tables[0])[1]
    assert offsets == [0, 500, 507, 2507, 2508]
    alone = _reduce_all(aggregator.address, job, tables)
    together = _reduce_all(aggregator.address, job + "-stacked", stacked)
    for r in range(world):
        for i, part in enumerate(split_rows(together[r][0], offsets)):
            assert part.is_coalesced() and part.shape == shapes[i]
            assert torch.equal(part._indices(), alone[r][i]._indices())
            assert torch.equal(part._values(), alone[r][i]._values())


def test_a_late_ranks_abort_caused_by_a_mismatch_is_told_as_a_mismatch() -> None:
    """The cause travels as a field (OmniReduceError.cause, from the ERROR's JSON), not as message text."""

    def fail_with(error: BaseException) -> BaseException:
        x = make_coo(10, 4, 3, seed=1)
        dtype, rows, dim = check_sparse(x)
        future = ReduceFuture()
        SparseOp(0, x, SparseSource(x, dtype, rows, dim, 16, 1), rank=0, world_size=2, num_aggregators=1,
                 average=False, threshold=0.0, future=future).fail(error)
        exc = future.exception(timeout=0)
        assert exc is not None
        return exc

    late = OmniReduceError("tensor 0 of job 'j' was aborted: the ranks differ")
    late.cause = "MISMATCH"
    told = fail_with(late)
    assert isinstance(told, OmniReduceMismatchError) and told.__cause__ is late
    assert "sparse" in str(told) and "rows x row width" in str(told)
    other = OmniReduceError("tensor 0 of job 'j' was aborted: ranks disagree about tensor 0 (in the text only)")
    other.cause = "ABORTED"
    assert fail_with(other) is other  # another cause: passed on as it is, whatever the text says
