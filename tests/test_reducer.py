"""The Reducer's parts on their own (no process group): its future, its failures, its info, the
aggregators' adapter over a worker's concurrent future, and the paths made from the ways."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from omnireduce.ddp.routing.path import Path, Span
from omnireduce.engines.aggregators import WorkerReducer
from omnireduce.engines.reducer import Reduction, ReductionInfo, fail
from omnireduce.engines.ways import ENGINES, Way
from omnireduce.errors import OmniReduceTimeout


def test_a_failed_future_raises_its_cause_wherever_it_is_read() -> None:
    cause = OmniReduceTimeout("omnireduce_hook failed at iteration 3, bucket 1: no answer")
    fut = Reduction()
    fail(fut, cause)
    fail(fut, ValueError("later"))  # (complete already: ignored)
    assert fut.done()
    for read in (fut.value, fut.wait):
        with pytest.raises(OmniReduceTimeout) as err:
            read()
        assert err.value is cause
    seen = fut.then(lambda f: f.value())  # a callback reading it gets the cause too (torch wraps it in its text)
    with pytest.raises(RuntimeError, match="OmniReduceTimeout: omnireduce_hook failed at iteration 3"):
        seen.wait()


def test_a_reduction_completes_with_its_tensor_after_its_info() -> None:
    t = torch.ones(4)
    fut = Reduction(t)
    seen: list[ReductionInfo] = []
    fut.add_done_callback(lambda f: seen.append(fut.info))
    info = ReductionInfo(blocks_total=8, blocks_nonzero=3, blocks_union=4, bytes_sent=10, bytes_received=12)
    fut.complete(t, info)
    assert fut.value() is t and seen == [info]
    assert info.union_density == 0.5 and info.plus(5, 6) == ReductionInfo(8, 3, 4, 15, 18)
    assert ReductionInfo(dense=True).union_density is None, "a dense all-reduce not scanned counts no blocks"
    assert ReductionInfo(dense=True, measured=0.25).union_density == 0.25
    assert ReductionInfo().union_density == 0.0


class FakeWorker:
    """A worker's shape: allreduce_async returns a concurrent future with ``info`` and ``stream``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.futures: list[concurrent.futures.Future] = []
        self.used: list[list[int]] = []

    def allreduce_async(self, x: torch.Tensor, *, average: bool = False, synchronize: bool = True,
                        block_size: int | None = None) -> concurrent.futures.Future:
        self.calls.append({"average": average, "synchronize": synchronize, "block_size": block_size})
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.info, f.stream = {}, None  # type: ignore[attr-defined]
        self.futures.append(f)
        return f

    def use_aggregators(self, indices: list[int]) -> None:
        self.used.append(list(indices))


def test_the_aggregators_adapter_completes_with_the_tensor_and_typed_info() -> None:
    worker = FakeWorker()
    reducer = WorkerReducer(worker)
    t = torch.zeros(10)
    fut = reducer.allreduce_async(t, average=True, block_size=4)
    assert worker.calls == [{"average": True, "synchronize": False, "block_size": 4}], "never waits for a device"
    assert not fut.done()
    worker.futures[0].info = {"blocks_total": 3, "blocks_nonzero": 1, "blocks_union": 2, "bytes_sent": 40,  # type: ignore[attr-defined]
                              "bytes_received": 80}
    worker.futures[0].set_result(t)
    assert fut.value() is t and fut.info == ReductionInfo(3, 1, 2, 40, 80)
    failing = reducer.allreduce_async(t, average=True)
    worker.futures[1].set_exception(OmniReduceTimeout("slot 0 round 2"))
    with pytest.raises(OmniReduceTimeout, match="slot 0 round 2"):
        failing.wait()


def test_a_rail_worker_takes_the_agreed_aggregators_shifted_by_its_offset() -> None:
    worker = FakeWorker()
    rail = WorkerReducer(worker, offset=1, count=3)  # its list starts at the job's second aggregator
    rail.use((0, 2))
    rail.use((0, 2))  # (unchanged: not told again)
    rail.use(None)
    rail.use((1,))
    assert worker.used == [[2, 1], [0]]


def test_every_way_has_its_paths_flat_and_through_the_hierarchy() -> None:
    for way in Way:
        flat, hier = Path.of(way), Path.of(way, hierarchical=True)
        assert (flat.way, flat.hierarchical, hier.way, hier.hierarchical) == (way, False, way, True)
        assert str(hier) == f"hier:{way}" and hier.flat is flat and flat.through_hierarchy() is hier
    assert Path.UNCOMPRESSED.whole and Path.UNCOMPRESSED.way is Way.DENSE
    assert Path.HIER_UNCOMPRESSED.flat is Path.UNCOMPRESSED
    assert set(ENGINES) <= set(Way) and Way.AGGREGATORS not in ENGINES and Way.DENSE not in ENGINES
    assert {str(s) for s in Span} == {"flat", "hierarchical"}
