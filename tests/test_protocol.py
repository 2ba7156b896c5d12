"""The protocol in one process: every rank's WorkerCore against the aggregators' Cores, the real ones.

No sockets, no threads and no clock (the time stands still: no deadline passes). Each message goes
through the wire format: ``wire.encode``, to bytes (a fresh writable buffer per receiver, as zmq
delivers it), then ``unpack_header`` and ``wire.decode`` on the other side. Every rank-aggregator
connection is a FIFO queue in each direction, as a zmq connection is; which queue delivers next is
drawn at random (seeded), so messages of different slots, ranks and aggregators interleave
differently from run to run, and arrival order must not matter.

Both sides are the code that runs in production: each rank is a
:class:`~omnireduce.worker.core.WorkerCore` (handshake, flights, recovery, kept sums; its ``send``
queues the encoded message), each aggregator an :class:`~omnireduce.aggregator.core.Core` (its
``send`` queues the frames for the rank the identity names). The ranks say HELLO first and are
welcomed. An aggregator restart replaces its core with a fresh one (a new instance, no jobs) and
cuts its connections: what was queued to or from it is lost, every rank sees the connection go
down and, later (a marker in the queue from that aggregator), come back; the rank's core then says
HELLO again and, welcomed by a new instance, recovers its slots there (FINAL for the slots it
finished, from tensors in flight or kept for replays; a retry BOOTSTRAP for the others). Results are
compared with the float64 sum of the inputs, and bit for bit with the rank-order float32 sum the
aggregator promises.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Any

import numpy as np
import pytest

from omnireduce.aggregator.core import Core
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.telemetry import Telemetry
from omnireduce.blocks import Layout, block_nonzero
from omnireduce.config import WorkerConfig
from omnireduce.dtypes import DType, narrow, widen
from omnireduce.sources.device import DeviceSource
from omnireduce.sources.host import HostSource
from omnireduce.wire import (
    FLAG_RETRY,
    Message,
    MsgType,
    decode,
    encode,
    frame_bytes,
    unpack_header,
)
from omnireduce.worker.core import WorkerCore
from omnireduce.worker.op import ReduceFuture, TensorOp
from tests.harness import Case, assert_matches, make_values

DTYPES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}

# (most lanes per slot, most slots, aggregators): one slot of one row; several slots over several
# aggregators with several rows per lane; one lane (a round per non-zero row).
GEOMETRIES = [(32768, 4, 1), (16, 5, 2), (3, 2, 3), (1, 1, 1)]

NOW = 0.0  # the clock of every call: it never moves, so no deadline passes and no aggregator is found lost
_TENSOR_UP = (MsgType.BOOTSTRAP, MsgType.CONTRIB, MsgType.FINAL)  # what a rank sends about a tensor
_TENSOR_DOWN = (MsgType.RESULT, MsgType.REPLAY)
_RECONNECT = None  # in a queue from an aggregator: the rank's connection to it is up again
_instances = itertools.count()


def _transmit(frames: list[Any]) -> list[bytearray]:
    """What the receiver gets: the encoded frames, copied into buffers of its own."""
    return [bytearray(f.tobytes() if isinstance(f, np.ndarray) else f) for f in frames]


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


@dataclasses.dataclass
class _Run:
    """One reduction's outcome: each rank's tensor afterwards (its storage) and future."""

    outputs: list[np.ndarray]
    futures: list[ReduceFuture]
    delivered: collections.Counter


def _source(raw: np.ndarray, dtype: DType, layout: Layout, kind: str) -> HostSource | DeviceSource:
    if kind == "host":
        return HostSource(raw, dtype, layout, None)
    import torch

    as_torch = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
    flat = torch.from_numpy(raw.view(np.int16) if dtype is DType.BFLOAT16 else raw).view(as_torch)
    return DeviceSource(flat, dtype, layout, None)  # a CPU tensor down the device path (torch ops)


class _Network:
    """The ranks' WorkerCores, the aggregators' Cores and the connections between them: a FIFO queue
    per connection and direction, delivered one message at a time from a queue drawn at random."""

    def __init__(self, world: int, aggregators: int, seed: int) -> None:
        self.world = world
        self.rng = np.random.default_rng(seed)
        self.queues: dict[tuple[str, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.aggs = [self._aggregator(a) for a in range(aggregators)]
        addresses = tuple(f"inproc://aggregator-{a}" for a in range(aggregators))
        self.cores = [WorkerCore(WorkerConfig(addresses, rank=r, world_size=world, job="protocol", timeout=60.0),
                                 f"client-{r}", functools.partial(self._up, r), NOW) for r in range(world)]
        self.futures: dict[tuple[int, int], ReduceFuture] = {}  # (rank, seq) -> the tensor's future
        # bytes of each rank's messages about each tensor while it is in flight there (as its
        # future's ``info`` must count them)
        self.sent: collections.Counter = collections.Counter()
        self.received: collections.Counter = collections.Counter()
        self.delivered: collections.Counter = collections.Counter()
        for core in self.cores:
            core.greet()
        self.run()
        assert all(core.hello.done() and core.hello.exception() is None for core in self.cores)
        self.delivered.clear()

    def _aggregator(self, a: int) -> Core:
        return Core(functools.partial(self._down, a), limits=AggregatorLimits(), token=None,
                    instance=f"instance-{next(_instances)}", telemetry=Telemetry(0))

    def _in_flight(self, rank: int, seq: int) -> bool:
        future = self.futures.get((rank, seq))
        return future is not None and not future.done()

    def _up(self, rank: int, agg: int, msg: Message) -> int:
        """Rank ``rank``'s core sends ``msg`` to aggregator ``agg`` (its ``send``)."""
        frames = _transmit(encode(msg))
        n = frame_bytes(frames)
        if msg.header.mtype in _TENSOR_UP and self._in_flight(rank, msg.header.seq):
            self.sent[rank, msg.header.seq] += n
        self.queues["up", rank, agg].append(frames)
        return n

    def _down(self, agg: int, identity: bytes, frames: list[Any]) -> None:
        """Aggregator ``agg``'s core sends ``frames`` to the connection ``identity`` (its ``send``)."""
        rank = int(identity.decode().rpartition("-")[2])
        self.queues["down", agg, rank].append(_transmit(frames))

    def submit(self, op: TensorOp) -> None:
        """Hand ``op`` to its rank's core, as the I/O thread does (a device tensor is prepared "on
        its device's thread": here, at once)."""
        core = self.cores[op.rank]
        self.futures[op.rank, op.seq] = op.future
        flight = core.flight(op, NOW)
        if isinstance(op.source, DeviceSource):
            core.preparing(flight)
            op.prepare()
            core.prepared(flight, None, NOW)
        else:
            core.start(flight, NOW)

    def restart(self, agg: int) -> None:
        """Aggregator ``agg`` starts again with no state; what was in flight to or from it is lost,
        and every rank's connection to it drops and comes back."""
        self.aggs[agg] = self._aggregator(agg)
        for (direction, a, b), q in self.queues.items():
            if agg == (b if direction == "up" else a):
                q.clear()
        for r, core in enumerate(self.cores):
            core.disconnected(agg, NOW)
            self.queues["down", agg, r].append(_RECONNECT)

    def deliver(self) -> bool:
        """Deliver one message; False when none is left."""
        busy = [key for key, q in self.queues.items() if q]
        if not busy:
            return False
        direction, a, b = key = busy[self.rng.integers(len(busy))]
        frames = self.queues[key].popleft()
        if frames is _RECONNECT:  # rank b's connection to aggregator a is up again
            self.delivered["CONNECTED"] += 1
            self.cores[b].connected(a, NOW)
            return True
        hdr = unpack_header(frames[0])
        self.delivered[hdr.mtype.name + ("+RETRY" if hdr.flags & FLAG_RETRY else "")] += 1
        if direction == "up":  # rank a -> aggregator b
            self.aggs[b].handle(_identity(a), frames)
            return True
        n = frame_bytes(frames)  # aggregator a -> rank b
        if hdr.mtype in _TENSOR_DOWN and self._in_flight(b, hdr.seq):
            self.received[b, hdr.seq] += n
        self.cores[b].receive(a, hdr, functools.partial(decode, hdr, frames[1:]), n, NOW)
        return True

    def run(self, restart: tuple[int, int] | None = None) -> int:
        """Deliver until nothing is left; ``restart=(a, k)``: aggregator ``a`` restarts after ``k``
        deliveries. Returns how many were made."""
        deliveries = 0
        while True:
            if restart is not None and deliveries == restart[1]:
                self.restart(restart[0])
                restart = None
            if not self.deliver():
                break
            deliveries += 1
        assert restart is None, "the run ended before the restart"
        return deliveries

    def check_finished(self, seq: int) -> None:
        """Every rank finished tensor ``seq``, its future counting the bytes this network saw."""
        for r in range(self.world):
            f = self.futures[r, seq]
            assert f.done(), f"rank {r} did not finish tensor {seq}"
            assert f.exception() is None, f"rank {r}: {f.exception()!r}"
            assert (f.info["bytes_sent"], f.info["bytes_received"], f.stream) == (
                self.sent[r, seq], self.received[r, seq], None), (r, f.info)

    def slots_held(self) -> int:
        return sum(agg.gauges()["slots_in_flight"] for agg in self.aggs)

    def expire(self) -> None:
        """Run the aggregators' sweep past the job's deadline: what they still hold was replayed
        sums that no rank asked for (a FINAL from the ranks that still kept a tensor's sums after a
        restart, when the others had dropped theirs), which are dropped; nothing is aborted."""
        for agg in self.aggs:
            agg.sweep(time.monotonic() + 61.0)
            assert agg.telemetry.counters["tensors_aborted"] == 0


def _op(seq: int, raw: np.ndarray, dtype: DType, layout: Layout, *, rank: int, world: int, aggregators: int,
        source: str = "host", average: bool = False) -> TensorOp:
    future = ReduceFuture()
    future.set_running_or_notify_cancel()
    return TensorOp(seq, raw, _source(raw, dtype, layout, source), rank=rank, world_size=world,
                    num_aggregators=aggregators, average=average, threshold=0.0, future=future)


def _reduce(values: list[np.ndarray], dtype: DType, layout: Layout, *, aggregators: int = 1, seed: int = 0,
            source: str = "host", average: bool = False, restart: tuple[int, int] | None = None) -> _Run:
    """All-reduce the float32 ``values`` (one array per rank, exact in ``dtype``) over a :class:`_Network`;
    every rank must complete. ``restart=(a, k)``: aggregator ``a`` restarts after ``k`` deliveries."""
    world = len(values)
    net = _Network(world, aggregators, seed)
    raws = [narrow(np.asarray(v, np.float32), dtype).copy() for v in values]
    for r in range(world):
        net.submit(_op(0, raws[r], dtype, layout, rank=r, world=world, aggregators=aggregators, source=source,
                       average=average))
    net.run(restart)
    net.check_finished(0)
    assert net.slots_held() == 0, "the aggregators still hold slots"
    futures = [net.futures[r, 0] for r in range(world)]
    return _Run([f.result() for f in futures], futures, net.delivered)


def _rank_order_sum(values: list[np.ndarray], dtype: DType) -> np.ndarray:
    """((x0 + x1) + x2) + ... in float32, rounded once to ``dtype``, as float32."""
    acc = np.asarray(values[0], np.float32).copy()
    with np.errstate(invalid="ignore", over="ignore"):
        for v in values[1:]:
            acc += np.asarray(v, np.float32)
    return widen(narrow(acc, dtype), dtype)


def _check(run: _Run, values: list[np.ndarray], dtype: DType, layout: Layout, case: Case | None = None,
           average: bool = False) -> None:
    """Every rank holds the same sum: the float64 reference within the dtype's tolerance, the
    rank-order float32 sum bit for bit (but for zeros' signs and NaN payloads), and the futures'
    counts are right."""
    world, B = len(values), layout.block_size
    flags = [block_nonzero(np.asarray(v, np.float32), DType.FLOAT32, B) for v in values]
    union = int(np.count_nonzero(np.logical_or.reduce(flags)))
    want = _rank_order_sum(values, dtype)
    first = None
    for r, out in enumerate(run.outputs):
        got = widen(out, dtype)
        if case is not None:
            assert_matches(case, world, got.astype(np.float64), average=average)
        if not average:
            exact = ~np.isnan(want) & (want != 0)
            assert np.array_equal(got[exact].view(np.uint32), want[exact].view(np.uint32)), f"rank {r}"
            assert np.array_equal(np.isnan(got), np.isnan(want)) and not got[~np.isnan(want) & (want == 0)].any()
        if first is None:
            first = got
        assert np.array_equal(first, got, equal_nan=True), f"rank {r} differs from rank 0"
        info = run.futures[r].info
        assert info == {"blocks_total": layout.num_blocks, "blocks_nonzero": int(np.count_nonzero(flags[r])),
                        "blocks_union": union, "bytes_sent": info["bytes_sent"],
                        "bytes_received": info["bytes_received"]}, info


def _case_values(case: Case, world: int) -> list[np.ndarray]:
    return [make_values(case, r) for r in range(world)]


def _run_cases(cases: list[Case], world: int, geometries: list[tuple[int, int, int]], *, source: str = "host",
               average: bool = False) -> None:
    for i, case in enumerate(cases):
        dtype = DTYPES[case.dtype]
        values = _case_values(case, world)
        for max_lanes, max_slots, aggregators in geometries:
            layout = Layout.for_tensor(case.numel, case.block_size, max_lanes, max_slots)
            run = _reduce(values, dtype, layout, aggregators=aggregators, seed=i, source=source, average=average)
            _check(run, values, dtype, layout, case, average=average)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_density_size_and_geometry(world: int, dtype: str) -> None:
    """Densities from empty to full, random or the same blocks on every rank; sizes of 0 elements and
    not multiples of the block size; NaN, Inf and -0.0 among the values."""
    cases = [Case(n, dtype=dtype, density=d, placement=p, block_size=B, seed=s, specials=True)
             for s, (n, B, d, p) in enumerate([
                 (0, 256, 0.0, "random"), (1, 256, 1.0, "random"), (1000, 256, 0.0, "random"),
                 (1000, 256, 1.0, "overlap"), (2049, 64, 0.3, "random"), (2049, 64, 0.3, "overlap"),
                 (9_999, 100, 0.01, "random"), (9_999, 100, 0.5, "overlap"), (5_000, 16, 1.0, "random")])]
    _run_cases(cases, world, GEOMETRIES)


def test_row_widths_of_one_two_and_four_bytes() -> None:
    """Rows announced at every width the layout can need: up to 256 rows per lane, up to 65536, more."""
    cases = [Case(20_000, density=0.05, block_size=4, seed=1, specials=True),  # 1250 rows: 2 bytes
             Case(70_001, density=0.001, block_size=1, seed=2)]  # 70001 rows: 4 bytes
    for case in cases:
        values = _case_values(case, 3)
        layout = Layout.for_tensor(case.numel, case.block_size, 4 if case.block_size > 1 else 1, 1)
        assert layout.row_width == (2 if case.block_size > 1 else 4)
        _check(_reduce(values, DType.FLOAT32, layout), values, DType.FLOAT32, layout, case)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_device_source_and_average(dtype: str) -> None:
    """The device path (compaction, compact host copy, scatter) on CPU tensors, and averaging."""
    cases = [Case(n, dtype=dtype, density=d, block_size=64, seed=s, specials=True, placement=p)
             for s, (n, d, p) in enumerate([(1, 1.0, "random"), (0, 0.0, "random"), (3_001, 0.2, "random"),
                                            (2_048, 0.5, "overlap")])]
    _run_cases(cases, 3, GEOMETRIES[:2], source="device")
    _run_cases(cases, 3, GEOMETRIES[1:2], source="device", average=True)
    _run_cases(cases, 3, GEOMETRIES[1:2], average=True)


@pytest.mark.parametrize("lanes", [1, 3, 8, 64])
def test_sums_in_rank_order_bit_for_bit(lanes: int) -> None:
    rng = np.random.default_rng(lanes)
    n = 250  # 63 blocks of 4, the last one short; 64 lanes: one lane without a block
    xs = []
    for r in range(4):
        x = np.zeros(n, np.float32)
        on = rng.random(n) < (0.05 if r else 0.5)
        x[on] = rng.standard_normal(on.sum()).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 8, on.sum())
        xs.append(x)
    xs[0][:4] = [1e8, 1.0, -0.0, np.nan]
    xs[1][:4] = [1.0, 1e8, -0.0, 1.0]
    xs[2][:4] = [-1e8, -1e8, -0.0, 2.0]
    layout = Layout(n, 4, lanes, 1)
    run = _reduce(xs, DType.FLOAT32, layout, seed=lanes)
    _check(run, xs, DType.FLOAT32, layout)
    for got in run.outputs:
        # rank order: (1e8 + 1) rounds to 1e8, so element 0 is 0; summing -1e8 first would give 1
        assert got[0] == 0.0 and got[1] == 0.0 and np.isnan(got[3])


def test_half_precision_accumulates_in_float32() -> None:
    xs = [np.full(8, 2048, np.float32), np.full(8, 1, np.float32), np.full(8, 1, np.float32)]
    run = _reduce(xs, DType.FLOAT16, Layout(8, 4, 2, 1))
    # float16 accumulation would give 2048 (2048 + 1 rounds back to 2048, twice); float32 gives 2050
    for got in run.outputs:
        assert got.tolist() == [2050.0] * 8


@pytest.mark.parametrize("world,geometry", [(1, (32768, 4, 1)), (2, (16, 3, 2)), (3, (32768, 4, 1)), (4, (4, 2, 2))])
def test_aggregator_restart_at_every_point(world: int, geometry: tuple[int, int, int]) -> None:
    """An aggregator restarts after each message of a reduction in turn (a fresh core: no jobs, no
    slots; the connections drop and come back): each rank says HELLO again and, welcomed by a new
    instance, sends FINAL for the slots it had finished, bootstraps the others again with FLAG_RETRY
    and is replayed the sums or runs the rounds again. The sum is exact every time."""
    max_lanes, max_slots, aggregators = geometry
    case = Case(700, density=0.4, block_size=16, seed=world, specials=True)
    values = _case_values(case, world)
    layout = Layout.for_tensor(case.numel, case.block_size, max_lanes, max_slots)
    total = sum(_reduce(values, DType.FLOAT32, layout, aggregators=aggregators, seed=world).delivered.values())
    seen: collections.Counter = collections.Counter()
    for agg in range(aggregators):
        for k in range(total + 1):
            run = _reduce(values, DType.FLOAT32, layout, aggregators=aggregators, seed=world, restart=(agg, k))
            _check(run, values, DType.FLOAT32, layout, case)
            seen += run.delivered
    assert seen["BOOTSTRAP+RETRY"], seen
    if world > 1 or layout.slots > 1:  # a finished slot, of the tensor in flight or kept for replays
        assert seen["FINAL"], seen
    else:  # one rank keeps no sums for replays (nobody else could need them), one slot is never half done
        assert not seen["FINAL"], seen
    if world > 1:  # some ranks had finished a slot when others had not: they were replayed its sums
        assert seen["REPLAY"], seen


def test_tensors_in_a_row_release_kept_sums_and_survive_a_restart_at_every_point() -> None:
    """Tensor 0 alone, then tensors 1 and 2 in flight together while aggregator 1 restarts after each
    message in turn: every sum is exact, and tensor 0's sums, kept for replays, are dropped once
    every rank has finished it (the watermark in the later tensors' RESULTs)."""
    world, aggregators = 3, 2
    cases = [Case(700, density=d, block_size=16, seed=10 + s, specials=True) for s, d in enumerate((0.4, 0.2, 0.7))]
    values = [_case_values(case, world) for case in cases]
    layout = Layout.for_tensor(700, 16, 16, 3)

    def run(restart: tuple[int, int] | None) -> tuple[_Network, int]:
        net = _Network(world, aggregators, seed=5)
        deliveries = 0
        for seq, group in ((0, [0]), (1, [1, 2])):
            for t in group:
                for r in range(world):
                    raw = np.asarray(values[t][r], np.float32).copy()
                    net.submit(_op(t, raw, DType.FLOAT32, layout, rank=r, world=world, aggregators=aggregators))
            deliveries = net.run(restart if seq == 1 else None)
            for t in group:
                net.check_finished(t)
                futures = [net.futures[r, t] for r in range(world)]
                _check(_Run([f.result() for f in futures], futures, net.delivered), values[t], DType.FLOAT32,
                       layout, cases[t])
        net.expire()
        assert net.slots_held() == 0
        for core in net.cores:
            assert 0 not in core.kept.tensors, "tensor 0's sums were kept after every rank had finished it"
            assert core.kept.nbytes == sum(op.retained_bytes() for op in core.kept.tensors.values()) > 0
        return net, deliveries

    _, total = run(None)  # (the deliveries of tensors 1 and 2)
    retries = 0
    for k in range(total + 1):
        net, _ = run((1, k))
        retries += sum(core.snapshot().get("retries", 0) for core in net.cores)
        assert net.delivered["CONNECTED"] == world
    assert retries > 0
