"""The device path's threading, failure and numerics contracts, checked on CPU tensors.

``OMNIREDUCE_DEVICE_PATH=1`` sends CPU torch tensors through :class:`DeviceSource` (torch ops
instead of the CUDA kernels), so what does not need a GPU is checked here: where the kernels are
prepared, that the I/O thread keeps serving other tensors while a device tensor's blocks are found
(and that the deadline still holds), that a failing release never leaves a future pending, that the
dense/sparse decision reads a host value, and that averaging gives the same bits on both paths.
The GPU side of the same contracts is in tests/test_cuda_path.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.blocks import Layout, gather_blocks
from omnireduce.cuda import build as cuda_build
from omnireduce.dtypes import DType, narrow, widen
from omnireduce.errors import OmniReduceError, OmniReduceTimeout
from omnireduce.launch.procs import free_port
from omnireduce.sources.device import DeviceSource
from omnireduce.sources.host import HostSource
from omnireduce.worker.io_loop import IOLoop
from omnireduce.worker.op import ReduceFuture, TensorOp
from tests.device_cases import check_device_ddp
from tests.harness import Case, RankPool

DEVICE_PATH = {"OMNIREDUCE_DEVICE_PATH": "1"}
TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIREDUCE_DEVICE_PATH", "1")


# -- kernels prepared eagerly, on the caller's thread ------------------------------------------------


def test_kernels_are_prepared_on_the_callers_thread_before_the_tensor_is_queued(
        aggregator, job: str, device_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, object, int]] = []
    real_prepare, real_submit = cuda_build.prepare, IOLoop.submit

    def prepare(device: object = None, **kwargs: object) -> str:
        events.append(("prepare", device, threading.get_ident()))
        return real_prepare(device, **kwargs)

    def submit(self: IOLoop, item: object) -> None:
        if isinstance(item, TensorOp):
            events.append(("submit", item.seq, threading.get_ident()))
        real_submit(self, item)

    monkeypatch.setattr(cuda_build, "prepare", prepare)
    monkeypatch.setattr(IOLoop, "submit", submit)
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=10) as w:
        a, b = torch.ones(1000), torch.full((300,), 2.0)
        w.allreduce(a)
        w.allreduce(b)
        w.allreduce(np.ones(10, np.float32))  # the host path prepares nothing
    me = threading.get_ident()
    assert events == [("prepare", torch.device("cpu"), me), ("submit", 0, me), ("submit", 1, me),
                      ("submit", 2, me)], events
    assert torch.equal(a, torch.ones(1000)) and torch.equal(b, torch.full((300,), 2.0))


def test_a_kernel_build_error_is_raised_to_the_caller_and_uses_no_sequence_number(
        aggregator, job: str, device_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def prepare(device: object = None, **kwargs: object) -> str:
        raise RuntimeError("OMNIREDUCE_CUDA_KERNELS=require but the omnireduce CUDA kernels could not be built "
                           "or loaded: ninja not found")

    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=10) as w:
        monkeypatch.setattr(cuda_build, "prepare", prepare)
        with pytest.raises(RuntimeError, match=r"OMNIREDUCE_CUDA_KERNELS=require.*ninja not found"):
            w.allreduce_async(torch.ones(10))
        with pytest.raises(RuntimeError, match="require"):  # every time, not once
            w.allreduce_async(torch.ones(10))
        monkeypatch.undo()
        monkeypatch.setenv("OMNIREDUCE_DEVICE_PATH", "1")
        f = w.allreduce_async(torch.ones(10))
        assert torch.equal(f.result(10), torch.ones(10))
        assert w._seq == 1, "a refused tensor must not take a place in the sequence"


# -- the I/O thread never waits for the device ------------------------------------------------------


def test_the_loop_serves_other_tensors_while_a_device_tensor_is_stuck_and_its_deadline_holds(
        aggregator, job: str, device_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device tensor whose blocks cannot be found (a stuck stream, simulated) blocks only the
    device's thread: host tensors submitted after it complete meanwhile; it fails at its deadline
    with a timeout that says where it stuck; once the device moves again, later tensors work."""
    gate = threading.Event()
    stuck_on: list[str] = []
    real = DeviceSource.nonzero

    def nonzero(self: DeviceSource, threshold: float) -> np.ndarray:
        if self.layout.numel == 1234:
            stuck_on.append(threading.current_thread().name)
            gate.wait(60)
        return real(self, threshold)

    monkeypatch.setattr(DeviceSource, "nonzero", nonzero)
    timeout = 1.5
    try:
        with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=timeout) as w:
            t0 = time.monotonic()
            stuck = w.allreduce_async(torch.ones(1234))
            others = [w.allreduce_async(np.full(5000, float(i), np.float32)) for i in range(3)]
            for i, f in enumerate(others):
                assert np.array_equal(f.result(timeout), np.full(5000, float(i), np.float32))
            assert not stuck.done(), "the stuck tensor completed"
            assert time.monotonic() - t0 < timeout
            with pytest.raises(OmniReduceTimeout, match=r"before it was sent: finding its non-zero blocks on cpu"):
                stuck.result(timeout + 5)
            assert time.monotonic() - t0 < timeout + 1.0
            assert stuck_on and stuck_on[0].startswith("omnireduce-compact-"), stuck_on
            gate.set()
            later = torch.arange(100, dtype=torch.float32)
            assert torch.equal(w.allreduce(later), torch.arange(100, dtype=torch.float32))
            assert w.stats()["tensors_failed"] == 1
    finally:
        gate.set()


def test_several_device_tensors_in_flight_complete_in_any_order(aggregator, job: str, device_path: None) -> None:
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=10) as w:
        xs = [torch.arange(n, dtype=torch.float32) for n in (1, 700, 70_001, 0, 5000)]
        futures = [w.allreduce_async(x) for x in xs]
        for f, x, n in zip(futures, xs, (1, 700, 70_001, 0, 5000), strict=True):
            assert f.result(10) is x and torch.equal(x, torch.arange(n, dtype=torch.float32))
            assert f.stream is None


# -- failures never leave a future pending ----------------------------------------------------------


class _ReleaseFails(HostSource):
    def __init__(self, seen: list[bool], future: ReduceFuture) -> None:
        layout = Layout.for_tensor(10, 4, 8, 2)
        super().__init__(np.zeros(10, np.float32), DType.FLOAT32, layout, None)
        self.seen, self.future = seen, future

    def release(self) -> None:
        self.seen.append(self.future.done())
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_fail_completes_the_future_before_releasing_and_survives_a_release_that_raises() -> None:
    seen: list[bool] = []
    future = ReduceFuture()
    op = TensorOp(0, None, _ReleaseFails(seen, future), rank=0, world_size=1, num_aggregators=1, average=False,
                  threshold=0.0, future=future)
    error = OmniReduceError("the device failed")
    op.fail(error)  # must not raise
    assert seen == [True], "the future must be completed before the source is released"
    assert future.exception() is error
    op.fail(OmniReduceError("again"))  # idempotent: the source is gone
    assert seen == [True]


def test_a_release_that_raises_completes_the_future_and_the_loop_survives(
        aggregator, job: str, device_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a sticky CUDA error, where recording the release's event raises: a tensor that
    succeeded still completes with its result, one that failed with its error, and the I/O thread
    goes on serving tensors."""

    def release(self: DeviceSource) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    real = DeviceSource.nonzero

    def nonzero(self: DeviceSource, threshold: float) -> np.ndarray:
        if self.layout.numel == 999:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real(self, threshold)

    monkeypatch.setattr(DeviceSource, "release", release)
    monkeypatch.setattr(DeviceSource, "nonzero", nonzero)
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=10) as w:
        ok = torch.full((500,), 3.0)
        assert torch.equal(w.allreduce_async(ok).result(10), torch.full((500,), 3.0))
        bad = w.allreduce_async(torch.ones(999))
        with pytest.raises(OmniReduceError, match=r"finding its non-zero blocks on cpu failed.*illegal memory"):
            bad.result(10)
        assert np.array_equal(w.allreduce(np.ones(7, np.float32)), np.ones(7, np.float32))
        assert torch.equal(w.allreduce(torch.full((64,), 2.0)), torch.full((64,), 2.0))
        assert w._io._thread.is_alive()


# -- the dense/sparse decision reads a host value ---------------------------------------------------


def test_union_density_of_a_device_path_tensor_is_a_python_float(device_path: None) -> None:
    from omnireduce.config import WorkerConfig
    from omnireduce.ddp.densities import as_float, union_density

    cfg = WorkerConfig.resolve(aggregators=["tcp://127.0.0.1:1"], rank=0, world_size=1, job="j", block_size=4)
    t = torch.zeros(40)
    t[:4] = 1.0
    t[20] = 2.0
    assert isinstance(adapt_source(t), DeviceSource)
    density = union_density(t, cfg)
    assert type(density) is float and density == 0.2
    assert as_float(density) == 0.2


def adapt_source(t: torch.Tensor) -> object:
    from omnireduce.sources.adapt import adapt

    return adapt(t)


def test_ddp_stores_host_densities_on_the_device_path(pool: RankPool, aggregator) -> None:
    results = pool.call("tests.device_cases:density_types", 2, port=free_port(), aggregator=aggregator.address,
                        env=DEVICE_PATH)
    for rank, r in enumerate(results):
        assert r["device_path"], r
        assert r["dense"] > 0 and r["sparse"] > 0, f"rank {rank}: both paths must be taken: {r}"
        assert r["types"] and set(r["types"]) == {"float"}, f"rank {rank}: stored densities {r['types']}"
        assert all(r["ok"]), f"rank {rank}: parameters differ from plain DDP: {r}"
    assert results[0]["paths"] == results[1]["paths"]


def test_ddp_on_the_device_path_with_half_buckets_and_the_dense_fallback(pool: RankPool, aggregator) -> None:
    """tests.device_cases.device_ddp on CPU tensors down the device path (its GPU configs are in
    tests/test_cuda_path.py): fp16/bf16 buckets, copied and viewed gradients, the fused optimizer,
    and a dense fallback that goes both ways."""
    configs = [{"dtype": "float16"}, {"dtype": "bfloat16", "bucket_view": True, "fused": True},
               {"dense_threshold": 0.5, "alternate": True, "steps": 6, "fused": True},
               {"path": "measure", "measure_trials": 1, "remeasure_every": 2, "steps": 10, "dtype": "bfloat16"},
               {"engine": "collective", "dtype": "float16", "fused": True},
               {"compression": 1.0, "dtype": "float16"}, {"compression": 0.05, "lossy": True, "steps": 6}]
    results = pool.call("tests.device_cases:device_ddp", 2, port=free_port(), aggregator=aggregator.address,
                        configs=configs, device="cpu", env=DEVICE_PATH)
    check_device_ddp(results)
    for per_config in results:
        assert per_config[2]["stats"]["buckets_dense"] > 0 and set(per_config[2]["stored"]) == {"float"}, per_config[2]
        measured = per_config[3]["stats"]
        assert measured["buckets_dense"] > 0 and measured["iterations_measuring"] >= 4, measured
        assert all(p["measurements"] >= 1 for p in measured["paths"].values()), measured["paths"]
    assert results[0][3]["stats"]["paths"] == results[1][3]["stats"]["paths"]
    for per_config in results:  # the collective engine's device path carried every bucket
        st = per_config[4]["stats"]
        whole = st["collective_exchanges"]["whole"]  # (small buckets: the dense all-reduce whole, counted dense)
        assert st["engine"] == "collective" and st["collective_reductions"] == st["buckets_sparse"] + whole, st
        assert st["buckets_sparse"] > 0, st
    for per_config in results:  # compressed (density 1: exact, checked above), the sparse table's bucket exact
        for r in per_config[5:]:
            ways = {i: b["compressed"] for i, b in r["stats"]["buckets"].items()}
            assert r["stats"]["compression"] and any(ways.values()) and not all(ways.values()), r
        assert all(b["k"] < b["blocks"] for b in per_config[6]["stats"]["compression"].values())


# -- averaging: the same bits on the host and the device path ------------------------------------------


def _averaged(kind: str, x: np.ndarray, dtype: DType, layout: Layout, staged: list, divisor: int) -> np.ndarray:
    raw = narrow(x, dtype).copy()
    if kind == "host":
        HostSource(raw, dtype, layout, None).finish(staged, divisor)
    else:
        flat = torch.from_numpy(raw.view(np.int16) if dtype is DType.BFLOAT16 else raw).view(TORCH[dtype])
        source = DeviceSource(flat, dtype, layout, None)
        assert source.finish(staged, divisor) is None  # CPU: done, no stream
        source.release()
    return raw


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16], ids=lambda d: d.name.lower())
def test_averaging_is_bit_identical_on_host_and_device_paths(dtype: DType) -> None:
    """At W = 3 (where x / 3 and x * float32(1/3) differ in the last bit for some x) both paths store
    float32(sum) * float32(1/3), rounded once to the dtype: bit for bit (NaN: the same positions)."""
    rng = np.random.default_rng(3)
    n, B, W = 10_007, 64, 3
    layout = Layout.for_tensor(n, B, 32, 3)
    x = rng.standard_normal(n).astype(np.float32)
    sums = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 3.0, 1e4], n)).astype(np.float32)
    sums[:40] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-42, 3.0, 6.0, 9.0] * 4  # specials, subnormals
    sums[40:1000] = np.arange(960, dtype=np.float32) * 3 + 1  # integers: many round differently
    sums_raw = narrow(sums, dtype)
    ids = np.sort(rng.choice(layout.num_blocks, size=layout.num_blocks * 2 // 3, replace=False))
    ids = np.union1d(ids, [0, layout.num_blocks - 1])  # the first and the short last block
    half = ids.size // 2
    staged = [(part, gather_blocks(sums_raw, layout, part)) for part in (ids[:half], ids[half:])]
    host = widen(_averaged("host", x, dtype, layout, staged, W), dtype)
    device = widen(_averaged("device", x, dtype, layout, staged, W), dtype)
    nan = np.isnan(host)
    assert np.array_equal(nan, np.isnan(device))
    assert np.array_equal(host[~nan].view(np.uint32), device[~nan].view(np.uint32)), \
        f"{np.count_nonzero(host[~nan] != device[~nan])} elements differ"
    # and both are float32(sum) * float32(1/3), rounded once, in the summed blocks; the rest untouched
    touched = np.zeros(layout.num_blocks * B, bool).reshape(-1, B)
    touched[ids] = True
    touched = touched.reshape(-1)[:n]
    want = widen(narrow(widen(sums_raw, dtype) * np.float32(1 / 3), dtype), dtype)
    keep = touched & ~np.isnan(want)
    assert np.array_equal(host[keep].view(np.uint32), want[keep].view(np.uint32))
    assert np.array_equal(host[~touched].view(np.uint32), widen(narrow(x, dtype), dtype)[~touched].view(np.uint32))
    if dtype is DType.FLOAT32:  # the case this guards: division would differ here
        exact = sums[40:1000] / np.float32(3)
        assert np.any(exact != sums[40:1000] * np.float32(1 / 3))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_averaged_reductions_are_bit_identical_on_both_paths(pool: RankPool, aggregator, job: str,
                                                             dtype: str) -> None:
    cases = [Case(n, dtype=dtype, density=d, seed=s, kind="torch") for s, (n, d) in
             enumerate([(70_001, 0.3), (4_099, 1.0), (257, 0.5)])]
    host = pool.run([aggregator.address], 3, cases, job=job + "-host", average=True)
    device = pool.run([aggregator.address], 3, cases, job=job + "-device", average=True, env=DEVICE_PATH)
    for rank in range(3):
        for i, case in enumerate(cases):
            h, d = host[rank]["results"][i], device[rank]["results"][i]
            assert h[0] == "ok" and d[0] == "ok", (h, d)
            assert h[2] == d[2], f"rank {rank}, {case}: the host and device paths' averages differ"


# -- a result lost with the aggregator, replayed --------------------------------------------------------


def replay_after_restart(job: str, device: str) -> None:
    """The aggregator dies after sending a slot's last result to rank 0 but not to rank 1; after
    the restart rank 0's FINAL is replayed to rank 1. Both ranks' torch tensors on ``device`` (the
    device path) hold the exact sum. Shared with tests/test_cuda_path.py."""
    from tests.harness import RankThreads, drop_results, wait_for

    address = f"tcp://127.0.0.1:{free_port()}"
    first = omnireduce.Aggregator(address)
    lost = drop_results(first, lambda hdr, rank: rank == 1 and hdr.round == 1)
    first.start()
    second = None
    values = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(2)]
    values[1][:1000] = 0.0  # some blocks on rank 0 only
    xs = [torch.from_numpy(v.copy()).to(device) for v in values]
    workers: list[omnireduce.Worker] = []
    try:
        workers = [omnireduce.Worker([address], rank=r, world_size=2, job=job, timeout=20) for r in range(2)]
        ranks = RankThreads(lambda r: workers[r].allreduce(xs[r]), 2).start()
        wait_for(lambda: ranks.finished(0), 10)
        assert 0 in ranks.results and not ranks.finished(1) and lost, "rank 0 should have finished, rank 1 not"
        first.stop()
        second = omnireduce.Aggregator(address).start()
        got = ranks.join(20)
        for r in range(2):
            assert isinstance(adapt_source(got[r]), DeviceSource)
            np.testing.assert_array_equal(got[r].cpu().numpy(), values[0] + values[1])
        assert wait_for(lambda: second.counters["replays"] >= 1, 2.0), second.counters
    finally:
        for w in workers:
            w.close()
        for agg in (first, second):
            if agg is not None:
                agg.stop()


def test_a_result_lost_with_the_aggregator_is_replayed_on_the_device_path(job: str, device_path: None) -> None:
    replay_after_restart(job, "cpu")
