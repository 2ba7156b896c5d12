"""The protocol in one process: every rank's TensorOp (worker side) against SlotStates (aggregator side).

No sockets and no threads. Each message goes through the wire format: ``wire.encode``, to bytes (a
fresh writable buffer per receiver, as zmq delivers it), then ``unpack_header`` and ``wire.decode``
on the other side. Every rank-aggregator connection is a FIFO queue in each direction, as a zmq
connection is; which queue delivers next is drawn at random (seeded), so messages of different slots,
ranks and aggregators interleave differently from run to run, and arrival order must not matter.

The aggregator side (:class:`_Aggregator`) is what the aggregator service does with BOOTSTRAP,
CONTRIB and FINAL, without membership, limits or deadlines: it feeds each slot's SlotState and sends
what that returns (a round's RESULT to every rank, or a REPLAY). An aggregator restart replaces it with
a fresh one and cuts its connections; each rank then recovers as the I/O thread does on a new
instance's WELCOME (``TensorOp.recover``: FINAL for the slots it finished, a retry BOOTSTRAP for the
others). Results are compared with the float64 sum of the inputs, and bit for bit with the
rank-order float32 sum the aggregator promises.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from omnireduce.aggregator.slot import Replay, Round, SlotState, TensorMeta
from omnireduce.blocks import Layout, block_nonzero
from omnireduce.dtypes import DType, narrow, widen
from omnireduce.wire import (
    FLAG_EAGER,
    FLAG_RETRY,
    Bootstrap,
    Contribution,
    Header,
    Message,
    MsgType,
    Result,
    SlotSums,
    decode,
    encode,
    frame_bytes,
    header_dtype,
    unpack_header,
)
from omnireduce.worker.op import ReduceFuture, TensorOp
from omnireduce.worker.sources import DeviceSource, HostSource
from tests.harness import Case, assert_matches, make_values

DTYPES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}

# (most lanes per slot, most slots, aggregators): one slot of one row; several slots over several
# aggregators with several rows per lane; one lane (a round per non-zero row).
GEOMETRIES = [(32768, 4, 1), (16, 5, 2), (3, 2, 3), (1, 1, 1)]


def _transmit(msg: Message) -> list[bytearray]:
    """What the receiver gets: the encoded frames, copied into buffers of its own."""
    return [bytearray(f.tobytes() if isinstance(f, np.ndarray) else f) for f in encode(msg)]


class _Aggregator:
    """The aggregator side of one tensor: a SlotState per slot, fed decoded messages, answering with
    (rank, message) pairs as the aggregator service does."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: dict[int, SlotState] = {}

    def receive(self, frames: list[bytearray]) -> list[tuple[int, Message]]:
        msg = decode(unpack_header(frames[0]), frames[1:])
        hdr, lay = msg.header, msg.layout
        meta = TensorMeta(lay.numel, header_dtype(hdr), lay.block_size, lay.lanes, lay.slots)
        state = self.slots.get(hdr.slot)
        if state is None:
            state = self.slots[hdr.slot] = SlotState(meta, hdr.slot, self.world_size, hdr.rank, now=0.0)
        assert state.meta == meta, "the ranks disagree about the tensor"
        if isinstance(msg, Bootstrap):
            out = state.bootstrap(hdr.rank, msg.rows, msg.data, now=0.0)
        elif isinstance(msg, SlotSums):
            out = state.take_final(hdr.rank, msg.ids, msg.data, now=0.0)
        else:
            assert isinstance(msg, Contribution), hdr.mtype
            assert hdr.count == state.expected_count(hdr.rank), "a rank sent other lanes than the instruction named"
            out = state.contribute(hdr.rank, hdr.round, msg.rows, msg.data, now=0.0)
        return self._answer(state, hdr, out)

    def _answer(self, state: SlotState, hdr: Header, out: Round | Replay | None) -> list[tuple[int, Message]]:
        """A completed round's RESULT for every rank, or a slot's REPLAY for the ranks named."""
        if out is None:
            return []
        if out.finished:
            del self.slots[hdr.slot]
        if isinstance(out, Replay):
            replay = Header(MsgType.REPLAY, dtype=hdr.dtype, seq=hdr.seq, slot=hdr.slot, count=int(out.ids.size))
            return [(r, SlotSums(replay, state.layout, out.ids, out.data)) for r in out.ranks]
        result = Header(MsgType.RESULT, dtype=hdr.dtype, flags=FLAG_EAGER if out.eager else 0, seq=hdr.seq,
                        slot=hdr.slot, round=out.round, count=out.count)
        return [(r, Result(result, state.layout, out.cur, out.data)) for r in range(self.world_size)]


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
    """The connections between the ranks' TensorOps and the aggregators: a FIFO queue per connection
    and direction, delivered one message at a time from a queue drawn at random."""

    def __init__(self, ops: list[TensorOp], aggregators: int, seed: int) -> None:
        self.ops = ops
        self.futures = [op.future for op in ops]
        self.aggs = [_Aggregator(len(ops)) for _ in range(aggregators)]
        self.rng = np.random.default_rng(seed)
        self.queues: dict[tuple[str, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.sent = [0] * len(ops)  # bytes of each rank's tensor in flight, as the I/O thread counts them
        self.received = [0] * len(ops)
        self.delivered: collections.Counter = collections.Counter()

    def send(self, rank: int, agg: int, msg: Message) -> None:
        frames = _transmit(msg)
        if not self.futures[rank].done():  # (a finished tensor is no longer in flight: its FINALs not counted)
            self.sent[rank] += frame_bytes(frames)
        self.queues["up", rank, agg].append(frames)

    def restart(self, agg: int) -> None:
        """Aggregator ``agg`` starts again with no state; what was in flight to or from it is lost."""
        self.aggs[agg] = _Aggregator(len(self.ops))
        for (direction, a, b), q in self.queues.items():
            if agg == (b if direction == "up" else a):
                q.clear()
        for r in range(len(self.ops)):
            self.queues["down", agg, r].append(None)  # the new instance's WELCOME

    def deliver(self) -> bool:
        """Deliver one message; False when none is left."""
        busy = [key for key, q in self.queues.items() if q]
        if not busy:
            return False
        direction, a, b = key = busy[self.rng.integers(len(busy))]
        frames = self.queues[key].popleft()
        if frames is None:  # rank b recovers its slots at aggregator a
            self.delivered["WELCOME"] += 1
            for msg in self.ops[b].recover(a):
                self.send(b, a, msg)
            return True
        hdr = unpack_header(frames[0])
        self.delivered[hdr.mtype.name + ("+RETRY" if hdr.flags & FLAG_RETRY else "")] += 1
        if direction == "up":  # rank a -> aggregator b
            for rank, msg in self.aggs[b].receive(frames):
                self.queues["down", b, rank].append(_transmit(msg))
        elif not self.futures[b].done():  # aggregator a -> rank b (the I/O thread drops what comes after)
            self._to_rank(b, a, hdr, frames)
        return True

    def _to_rank(self, rank: int, agg: int, hdr: Header, frames: list[bytearray]) -> None:
        op = self.ops[rank]
        self.received[rank] += frame_bytes(frames)
        reply = op.receive(decode(hdr, frames[1:], op.layout, op.dtype))
        if reply is not None:
            self.send(rank, agg, reply)
        if op.done:
            op.finish(bytes_sent=self.sent[rank], bytes_received=self.received[rank])


def _reduce(values: list[np.ndarray], dtype: DType, layout: Layout, *, aggregators: int = 1, seed: int = 0,
            source: str = "host", average: bool = False, restart: tuple[int, int] | None = None) -> _Run:
    """All-reduce the float32 ``values`` (one array per rank, exact in ``dtype``) over a :class:`_Network`;
    every rank must complete. ``restart=(a, k)``: aggregator ``a`` restarts after ``k`` deliveries."""
    world = len(values)
    raws = [narrow(np.asarray(v, np.float32), dtype).copy() for v in values]
    ops = [TensorOp(0, raws[r], _source(raws[r], dtype, layout, source), rank=r, world_size=world,
                    num_aggregators=aggregators, average=average, threshold=0.0, future=ReduceFuture())
           for r in range(world)]
    net = _Network(ops, aggregators, seed)
    for r, op in enumerate(ops):
        op.prepare()
        for agg, msg in op.bootstraps():
            net.send(r, agg, msg)
    deliveries = 0
    while True:
        if restart is not None and deliveries == restart[1]:
            net.restart(restart[0])
            restart = None
        if not net.deliver():
            break
        deliveries += 1
    assert restart is None, "the run ended before the restart"
    for r, op in enumerate(ops):
        f = net.futures[r]
        assert op.done and f.done(), f"rank {r} did not finish: waiting on {op.waiting_on()}"
        assert (f.info["bytes_sent"], f.info["bytes_received"], f.stream) == (net.sent[r], net.received[r], None)
    assert not any(agg.slots for agg in net.aggs), "the aggregators still hold slots"
    return _Run([f.result() for f in net.futures], net.futures, net.delivered)


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
    """An aggregator restarts after each message of a reduction in turn (its slots start from fresh
    SlotStates): ranks that had finished a slot send FINAL, the others bootstrap again with
    FLAG_RETRY and are replayed the sums or run the rounds again. The sum is exact every time."""
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
    assert seen["BOOTSTRAP+RETRY"] and seen["FINAL"], seen
    if world > 1:  # some ranks had finished a slot when others had not: they were replayed its sums
        assert seen["REPLAY"], seen
