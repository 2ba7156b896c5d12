"""The kernel exchange's calls in numpy (:mod:`omnireduce.engines.numpy_kernels`), call by call, against
the CUDA kernels' per-item steps compiled for the host (``tests/exchange_host.py``) and against a
float64 sum, on fresh random inputs: every dtype, short last blocks, -0.0, NaN and Inf, sources that
lack blocks the target has (and the reverse), rows split between a first part and a rest, scaled and
not. The engine's reductions through them are compared with the torch ops' in
``tests/test_engine_exchange.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnireduce.engines.numpy_kernels import NumpyKernels
from tests.exchange_host import HostKernels, needs_cxx

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tensor(rng: np.random.Generator, n: int, B: int, dtype: torch.dtype, density: float,
            ugly: bool = False) -> torch.Tensor:
    """``n`` elements whose blocks are non-zero with probability ``density`` (-0.0 elsewhere, now and
    then; NaN, Inf and -0.0 among the values with ``ugly``)."""
    nb = -(-n // B)
    x = rng.standard_normal(nb * B).astype(np.float32)
    keep = rng.random(nb) < density
    x.reshape(nb, B)[~keep] = np.where(rng.random((int((~keep).sum()), B)) < 0.1, -0.0, 0.0)
    if ugly:
        spots = rng.choice(nb * B, size=min(6, nb * B), replace=False)
        x[spots] = [np.nan, np.inf, -np.inf, -0.0, 1e-30, 65504.0][: spots.size]
    t = torch.from_numpy(x[:n].copy()).to(dtype)
    if ugly:  # NaNs with payloads and signs (a float16 NaN's payload is not kept by the sums: see the module)
        words = {torch.float32: (torch.int32, [0x7F800001, -0x003FFFFD]),
                 torch.float16: (torch.int16, [0x7C01, -0x01FD]),
                 torch.bfloat16: (torch.int16, [0x7F81, -0x003D])}[dtype]
        t.view(words[0])[rng.choice(n, size=2, replace=False)] = torch.tensor(words[1], dtype=words[0])
    return t


def _bits(rng: np.random.Generator, W: int, nb: int, density: float, union: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """W random bitmaps and a target row (their union, or random), packed, and the exclusive prefix
    sums of the bytes' popcounts over the whole array."""
    flags = rng.random((W + 1, nb)) < density
    if union:
        flags[W] = flags[:W].any(axis=0)
    packed = np.packbits(flags, axis=1)
    pop = np.array([bin(int(v)).count("1") for v in packed.reshape(-1)], dtype=np.int32)
    prefix = np.zeros(packed.size + 1, dtype=np.int32)
    np.cumsum(pop, out=prefix[1:])
    return torch.from_numpy(packed), torch.from_numpy(prefix)


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_record_rows_and_counts_are_the_kernels_bytes(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(11)
    mine, theirs = NumpyKernels(), HostKernels()
    for n, B, density, cap in [(70_001, 256, 0.1, 40), (300, 64, 0.9, 2), (1000, 1000, 1.0, 1), (4096, 128, 0.0, 3),
                               (257, 256, 0.5, 0), (12_345, 32, 0.3, 500)]:
        x = _tensor(rng, n, B, dtype, density, ugly=n == 12_345)
        nb = -(-n // B)
        nbytes = -(-nb // 8)
        head = -(-nbytes // 16) * 16
        size = head + cap * B * x.element_size()
        a, b = torch.full((size,), 0xAB, dtype=torch.uint8), torch.full((size,), 0xAB, dtype=torch.uint8)
        pa, pb = mine.record(x, B, 0.0, a, head, cap), theirs.record(x, B, 0.0, b, head, cap)
        where = (str(dtype), n, B, density, cap)
        assert torch.equal(a, b), where  # (the bitmap, the rows, and nothing else written)
        assert torch.equal(pa, pb), where
        for W in (1, 2, 3, 5):
            gathered = torch.full((W, size), 0xCD, dtype=torch.uint8)  # (past the bitmaps: not read)
            gathered[0] = a
            for r in range(1, W):
                other = np.packbits(rng.random(nb) < density)
                other[-1] |= (1 << (-nb % 8)) - 1  # (set padding bits: cleared by both)
                gathered[r, :nbytes] = torch.from_numpy(other)
            for lanes, pairs in ((1, False), (7, True), (64, True)):
                got, want = mine.counts(gathered, nb, lanes, pairs), theirs.counts(gathered, nb, lanes, pairs)
                for g, w, what in zip(got, want, ("bits", "prefix", "counts"), strict=True):
                    assert torch.equal(g, w), (where, W, lanes, what)
            bits, prefix, _ = mine.counts(gathered, nb, 3, False)
            for lo, hi in ((0, nb), (1, 3), (cap, cap + 7), (0, 0)):
                mask = bits[min(1, W - 1)] if W > 1 else None
                for m in (None, mask):
                    ra = torch.full((max(hi - lo, 1), B), 7, dtype=dtype)
                    rb = ra.clone()
                    mine.rows(x, B, bits[W], prefix[W * nbytes:], m, lo, hi, ra)
                    theirs.rows(x, B, bits[W], prefix[W * nbytes:].contiguous(), m, lo, hi, rb)
                    assert torch.equal(ra.view(torch.uint8), rb.view(torch.uint8)), (where, W, lo, hi, m is None)


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_blocks_are_the_kernels_bits(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(12)
    mine, theirs = NumpyKernels(), HostKernels()
    for n, B, W, density, union, cap, scale in [
            (70_001, 256, 2, 0.2, True, 10, 1.0), (70_001, 256, 3, 0.4, True, 0, 1.0 / 3),
            (3000, 64, 4, 0.5, False, 5, 0.25), (300, 64, 2, 0.9, True, 100, 0.5), (100, 256, 1, 1.0, True, 1, 1.0),
            (20_000, 16, 3, 0.05, False, 2, 1.0), (5000, 128, 2, 0.0, True, 4, 1.0),
            (300_001, 64, 2, 1.0, True, 2000, 0.5)]:  # (every block: runs of rows, across first and rest)
        nb = -(-n // B)
        nbytes = -(-nb // 8)
        bits, prefix = _bits(rng, W, nb, density, union)
        most = int(np.unpackbits(bits[:W].numpy(), axis=1, count=nb).sum(axis=1).max())
        vals = _tensor(rng, W * (cap + max(most - cap, 0)) * B, B, dtype, 1.0, ugly=W == 3)
        first = vals[: W * cap * B].view(W, cap, B) if cap else None
        rest = vals[W * cap * B:].view(W, -1, B) if most > cap else None
        for src_row, nsrc in ((0, W), (W, 1)):
            if src_row == W:
                first = vals[: cap * B].view(1, cap, B) if cap else None
                rest = vals[cap * B: (cap + nb) * B].view(1, -1, B) if nb > cap else None
            x = _tensor(rng, n, B, dtype, 0.5)
            y = x.clone()
            mine.sum_blocks(x, B, bits, prefix, W, src_row, nsrc, first, rest, scale)
            theirs.sum_blocks(y, B, bits, prefix, W, src_row, nsrc, first, rest, scale)
            where = (str(dtype), n, B, W, density, union, cap, scale, src_row)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), where
            assert nbytes == bits.shape[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_blocks_are_the_float64_sums(dtype: torch.dtype) -> None:
    """Without the compiled steps: every union block is the sum of the rows that have it (float64,
    rounded to the dtype: within its rounding), every other block untouched."""
    rng = np.random.default_rng(13)
    n, B, W, cap = 10_001, 64, 3, 6
    nb = -(-n // B)
    bits, prefix = _bits(rng, W, nb, 0.1, True)
    flags = np.unpackbits(bits.numpy(), axis=1, count=nb).astype(bool)
    most = int(flags[:W].sum(axis=1).max())
    vals = _tensor(rng, W * most * B, B, dtype, 1.0)
    first = vals[: W * cap * B].view(W, cap, B)
    rest = vals[W * cap * B:].view(W, most - cap, B)
    x = _tensor(rng, n, B, dtype, 0.5)
    before = x.double().numpy().copy()
    NumpyKernels().sum_blocks(x, B, bits, prefix, W, 0, W, first, rest, 0.5)
    want = np.zeros((nb, B))
    for s in range(W):
        ids = np.flatnonzero(flags[s])
        rows = torch.cat([first[s], rest[s]]).double().numpy()[: ids.size]
        want[ids] += rows
    want = (want.reshape(-1)[:n]) * 0.5
    got = x.double().numpy()
    touched = np.repeat(flags[W], B)[:n]
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert np.allclose(got[touched], want[touched], rtol=tol, atol=tol * np.abs(want).max())
    assert np.array_equal(got[~touched], before[~touched])
    assert touched.any() and (~touched).any()
