"""Unit tests: block/lane/slot arithmetic, detection, lane index, gather/scatter, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnireduce.blocks import (
    INF,
    SCAN_BLOCKS,
    LaneIndex,
    Layout,
    block_nonzero,
    gather_blocks,
    scatter_blocks,
    zero_blocks,
)
from omnireduce.dtypes import DType, bf16_to_f32, dtype_from_name, f32_to_bf16

layouts = st.builds(Layout.for_tensor, st.integers(0, 5000), st.integers(1, 64), st.integers(1, 40),
                    st.integers(1, 6))


@given(layouts)
@settings(max_examples=300, deadline=None)
def test_layout_covers_every_block_once(lay: Layout) -> None:
    nb, T = lay.num_blocks, lay.total_lanes
    assert lay.rows * T >= nb and (lay.rows - 1) * T < max(nb, 1)
    seen = np.zeros(nb, dtype=int)
    for slot in range(lay.slots):
        valid = lay.valid_rows(slot)
        for lane in range(lay.lanes):
            rows = np.arange(valid[lane])
            b = lay.slot_blocks(slot, np.full(rows.size, lane), rows)
            # block b sits in lane b mod T, row b div T, slot (b mod T) div L
            assert np.all(b % T == slot * lay.lanes + lane) and np.all(b // T == rows)
            seen[b] += 1
    assert np.all(seen == 1)


def test_layout_geometry() -> None:
    # 100 MiB of float32, blocks of 256: spread over 4 slots, one row per lane
    lay = Layout.for_tensor(26_214_400, 256, 32768, 4)
    assert (lay.lanes, lay.slots, lay.rows, lay.row_width) == (25600, 4, 1, 0)
    # capped lanes: several rows per lane, rows on the wire as one byte
    lay = Layout.for_tensor(26_214_400, 256, 4096, 4)
    assert (lay.lanes, lay.slots, lay.rows, lay.row_width) == (4096, 4, 7, 1)
    # small tensors are one slot; empty ones one slot of one lane
    assert Layout.for_tensor(1000, 256, 32768, 4) == Layout(1000, 256, 4, 1)
    assert Layout.for_tensor(0, 256, 32768, 4) == Layout(0, 256, 1, 1)
    lay = Layout(1000, 256, 2, 1)
    assert lay.tail == 232 and lay.full_blocks == 3 and lay.holds_short(0)
    assert lay.short_index(np.array([0, 3, 2])) == 1 and lay.short_index(np.array([0, 2])) is None
    lay = Layout(10, 4, lanes=2, slots=2)  # blocks 0,1,2; block 2 short, lane 0 of slot 1, row 0
    assert lay.holds_short(1) and not lay.holds_short(0)
    assert Layout(8, 4, lanes=2, slots=1).short_index(np.array([1])) is None  # every block full


def _brute_nonzero(values: np.ndarray, B: int, threshold: float = 0.0) -> np.ndarray:
    out = []
    for i in range(0, values.size, B):
        blk = values[i:i + B].astype(np.float64)
        out.append(any((not (abs(v) <= threshold)) if threshold else (v != 0 or np.isnan(v)) for v in blk))
    return np.array(out, dtype=bool)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("B", [1, 3, 8, 100, 256])
def test_block_nonzero_matches_elementwise_definition(dtype: str, B: int) -> None:
    rng = np.random.default_rng(B)
    n = 37 * B + B // 2 + 1
    vals = np.zeros(n, np.float32)
    hot = rng.random(n) < 0.02
    vals[hot] = rng.standard_normal(hot.sum())
    specials = rng.choice(n, 12, replace=False)
    vals[specials] = [np.nan, np.inf, -np.inf, -0.0, 1e-30, -1e-30, np.nan, -0.0, -0.0, 5, -5, 0.0]
    vals[: 2 * B] = -0.0  # a block of -0.0 is a zero block
    raw, dt = _raw(vals, dtype)
    want = _brute_nonzero(_values(raw, dt), B)
    assert np.array_equal(block_nonzero(raw, dt, B), want)
    want_thr = _brute_nonzero(_values(raw, dt), B, threshold=0.5)
    assert np.array_equal(block_nonzero(raw, dt, B, threshold=0.5), want_thr)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("B", [1, 3, 256])
def test_block_nonzero_across_scan_passes(dtype: str, B: int) -> None:
    """Tensors of several of block_nonzero's passes (SCAN_BLOCKS blocks each), a non-zero block at
    every pass boundary, against a per-block reference in float64."""
    rng = np.random.default_rng(7 + B)
    n = (2 * SCAN_BLOCKS + 5) * B + B // 2
    vals = np.zeros(n, np.float32)
    hot = rng.random(n) < 0.001
    vals[hot] = rng.standard_normal(hot.sum())
    for edge in (SCAN_BLOCKS - 1, SCAN_BLOCKS, 2 * SCAN_BLOCKS - 1, 2 * SCAN_BLOCKS):
        vals[edge * B + B - 1] = 0.75  # the last element of the block on either side of a boundary
    vals[[5, n - 1]] = [np.nan, -0.0]
    raw, dt = _raw(vals, dtype)
    values = _values(raw, dt).astype(np.float64)
    padded = np.concatenate([values, np.zeros(-n % B)]).reshape(-1, B)
    want = np.any((padded != 0) | np.isnan(padded), axis=1)
    assert np.array_equal(block_nonzero(raw, dt, B), want)
    want_thr = ~np.all(np.abs(padded) <= 0.5, axis=1)  # (NaN is not <= 0.5)
    assert np.array_equal(block_nonzero(raw, dt, B, threshold=0.5), want_thr)


def _raw(vals: np.ndarray, dtype: str) -> tuple[np.ndarray, DType]:
    dt = dtype_from_name(dtype)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(vals), dt
    with np.errstate(over="ignore"):
        return vals.astype(dtype), dt


def _values(raw: np.ndarray, dt: DType) -> np.ndarray:
    return bf16_to_f32(raw) if dt is DType.BFLOAT16 else raw


@given(layouts, st.integers(0, 2**32 - 1), st.floats(0, 1))
@settings(max_examples=200, deadline=None)
def test_lane_index_walks_each_lane_in_row_order(lay: Layout, seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    nz = rng.random(lay.num_blocks) < density
    idx = LaneIndex(lay, nz)
    T = lay.total_lanes
    for slot in range(lay.slots):
        lanes = slot * lay.lanes + np.arange(lay.lanes)
        expect = [[b // T for b in np.flatnonzero(nz) if b % T == lane] for lane in lanes]
        while True:
            pend = idx.pending(slot)
            want = np.array([e[0] if e else INF for e in expect], dtype=np.uint32)
            assert np.array_equal(pend, want)
            movers = np.flatnonzero(pend != INF)
            if movers.size == 0:
                break
            movers = movers[rng.random(movers.size) < 0.7] if movers.size > 1 else movers
            nxt = idx.advance(slot, movers)
            for m, n_ in zip(movers, nxt, strict=True):
                expect[m].pop(0)
                assert n_ == (expect[m][0] if expect[m] else INF)


@pytest.mark.parametrize("n,B", [(1000, 256), (1024, 256), (7, 3), (1, 256), (300, 1)])
def test_gather_scatter_round_trip_with_short_block(n: int, B: int) -> None:
    rng = np.random.default_rng(n)
    lay = Layout(n, B, lanes=max(1, -(-n // B) // 2), slots=1)
    x = rng.standard_normal(n).astype(np.float32)
    nb = lay.num_blocks
    for ids in (np.arange(nb), rng.permutation(nb)[: max(1, nb // 2)], np.array([nb - 1]), np.array([0])):
        wire = gather_blocks(x, lay, ids)
        has_short = bool(lay.tail) and nb - 1 in ids
        assert wire.size == ids.size * B - ((B - lay.tail) if has_short else 0)
        want = np.concatenate([x[b * B:(b + 1) * B] for b in ids])
        assert np.array_equal(wire, want)
        y = np.zeros_like(x)
        scatter_blocks(y, lay, ids, wire)
        mask = np.zeros(n, bool)
        for b in ids:
            mask[b * B:(b + 1) * B] = True
        assert np.array_equal(y[mask], x[mask]) and not y[~mask].any()
        z = np.zeros_like(x)
        scatter_blocks(z, lay, ids, wire, lambda dst, src: np.multiply(src, 2, out=dst))
        assert np.array_equal(z[mask], 2 * x[mask])
    zero_blocks(x, lay, np.array([0, nb - 1]))
    assert not x[:B].any() and not x[(nb - 1) * B:].any()


def test_bfloat16_conversion_matches_torch() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
                        np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40],
                                 np.float32)])
    ours = f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(bf16_to_f32(ours[nan])).all()
    assert np.array_equal(bf16_to_f32(theirs), torch.from_numpy(theirs.view(np.int16)).view(torch.bfloat16)
                          .float().numpy(), equal_nan=True)


def test_unsupported_dtypes_are_named() -> None:
    for name in ("float64", "int32", "torch.int64", "complex64"):
        with pytest.raises(TypeError, match=name.removeprefix("torch.")):
            dtype_from_name(name)


@pytest.mark.parametrize("numel, lanes, slots", [(1000, 64, 2), (5000, 8, 2), (4097, 16, 4), (100, 64, 2), (0, 8, 1)])
def test_lane_index_reset_starts_a_slot_over(numel: int, lanes: int, slots: int) -> None:
    """After some rounds, reset(slot) gives that slot's lanes exactly the state of a fresh index
    (one row per lane and several), and leaves the other slots where they were."""
    B = 4
    rng = np.random.default_rng()
    lay = Layout(numel, B, lanes, slots)
    flags = rng.random(lay.num_blocks) < 0.4
    fresh = LaneIndex(lay, flags)
    idx = LaneIndex(lay, flags)
    for s in range(lay.slots):
        for _ in range(2):  # two rounds: every lane with a pending row sends it
            pend = idx.pending(s)
            idx.advance(s, np.flatnonzero(pend != INF).astype(np.uint32))
    moved = idx.next.copy()
    idx.reset(0)
    L = lay.lanes
    assert np.array_equal(idx.pending(0), fresh.pending(0))
    assert np.array_equal(idx.next[L:], moved[L:])
    # after the reset the slot walks the same rows again
    for _ in range(lay.rows + 1):
        a, b = idx.pending(0), fresh.pending(0)
        assert np.array_equal(a, b)
        send = np.flatnonzero(a != INF).astype(np.uint32)
        assert np.array_equal(idx.advance(0, send), fresh.advance(0, send))


@pytest.mark.parametrize(("itemsize", "block_size"), [(4, 256), (2, 256), (4, 1024), (2, 16)])
def test_a_round_of_a_slot_fits_in_the_frame_limit(itemsize: int, block_size: int) -> None:
    """Lanes are capped so that a round's blocks (one per lane) fit in MAX_FRAME_BYTES: larger
    receive buffers would be fresh, page-faulting memory every time (glibc's mmap threshold)."""
    from omnireduce.blocks import MAX_FRAME_BYTES

    numel = 400 * 2**20 // itemsize  # 400 MiB: more blocks than any slot layout holds in one row
    lay = Layout.for_tensor(numel, block_size, 32768, 4, itemsize)
    assert lay.lanes * block_size * itemsize <= MAX_FRAME_BYTES
    if 32768 * block_size * itemsize > MAX_FRAME_BYTES:  # the cap bites: as many lanes as fit
        assert (lay.lanes + 1) * block_size * itemsize > MAX_FRAME_BYTES
    else:
        assert lay.lanes == 32768
