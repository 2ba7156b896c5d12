"""omnireduce.sums, the rank-order sum every summer uses, against a scalar reference: row by row, element
by element, in float32 from -0.0 over the parts that hold the row, in their order; on fresh random
inputs of every dtype, with dense parts (every row), sparse ones, single parts and repeated rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnireduce.dtypes import DType, narrow, widen
from omnireduce.sums import accumulator, add_in_order, add_repeats_in_order, rank_order_sum

RNG = np.random.default_rng()


def _reference(k: int, B: int, parts: list[tuple[np.ndarray | None, np.ndarray]], dtype: DType) -> np.ndarray:
    out = np.empty((k, B), np.float32)
    values = [(np.arange(k) if pos is None else pos, widen(rows, dtype)) for pos, rows in parts]
    for p in range(k):
        for e in range(B):
            s = np.float32(-0.0)
            for pos, vals in values:
                hit = np.flatnonzero(pos == p)
                if hit.size:
                    s = np.float32(s + vals[hit[0], e])
            out[p, e] = s
    return out


def _rows(n: int, B: int, dtype: DType) -> np.ndarray:
    x = (RNG.standard_normal((n, B)) * 10 ** RNG.uniform(-3, 3, (n, 1))).astype(np.float32)
    x[RNG.random((n, B)) < 0.05] = -0.0
    return narrow(x, dtype)


def _parts(k: int, B: int, dtype: DType, kinds: str) -> list[tuple[np.ndarray | None, np.ndarray]]:
    parts = []
    for kind in kinds:
        if kind == "d":  # every row
            parts.append((None, _rows(k, B, dtype)))
        else:  # some rows, ascending
            pos = np.flatnonzero(RNG.random(k) < 0.5)
            parts.append((pos, _rows(pos.size, B, dtype)))
    return parts


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("kinds", ["d", "s", "dd", "ddd", "ds", "sd", "ss", "sds", "dsd"])
def test_rank_order_sum_matches_the_scalar_reference(dtype: DType, kinds: str) -> None:
    k, B = int(RNG.integers(1, 12)), int(RNG.integers(1, 6))
    parts = _parts(k, B, dtype, kinds)
    want = _reference(k, B, parts, dtype)
    held = np.zeros(k, bool)
    for pos, _ in parts:
        held[slice(None) if pos is None else pos] = True
    copies = [(pos, rows.copy()) for pos, rows in parts]  # (rank_order_sum may sum into a part's buffer)
    got = rank_order_sum(k, B, copies, dtype)
    assert np.array_equal(_bits(got[held]), _bits(want[held]))
    assert np.all(_bits(got[~held]) == _bits(np.float32(-0.0)))  # rows no part holds: -0.0


@pytest.mark.parametrize("dtype", list(DType))
def test_add_in_order_on_torch_gives_the_same_bits(dtype: DType) -> None:
    k, B = 9, 4
    parts = _parts(k, B, dtype, "sds")
    want = rank_order_sum(k, B, [(p, r.copy()) for p, r in parts], dtype)
    acc = torch.full((k, B), -0.0, dtype=torch.float32)
    got = add_in_order(acc, [(None if p is None else torch.from_numpy(p), torch.from_numpy(widen(r, dtype).copy()))
                             for p, r in parts])
    assert np.array_equal(_bits(got.numpy()), _bits(want))


def test_repeated_rows_are_added_in_their_order() -> None:
    k, B, n = 5, 3, 40
    positions = RNG.integers(0, k, n)
    rows = _rows(n, B, DType.FLOAT32)
    got = add_repeats_in_order(accumulator(k, B), positions, rows)
    parts = [(np.array([p]), rows[i: i + 1]) for i, p in enumerate(positions)]  # one part per entry, in order
    want = _reference(k, B, parts, DType.FLOAT32)
    assert np.array_equal(_bits(got), _bits(want))
