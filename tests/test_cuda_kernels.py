"""Block-sparsity ops on torch tensors (omnireduce.cuda.ops) against the numpy reference.

The reference is omnireduce.blocks (block_nonzero, gather_blocks, scatter_blocks) and
omnireduce.dtypes (float32 <-> float16/bfloat16 rounding), which know nothing of torch. Inputs are
fresh random blocks of every kind that matters (zero, -0.0, dense, a single element anywhere, NaN,
+-Inf, subnormals, values around the threshold), on sizes with and without a short last block, at
storage offsets that break 16-byte alignment. Set OMNIREDUCE_TEST_SEED to replay a failure.

- CPU: the torch-ops backend (runs everywhere).
- CUDA (skipped without a GPU): the kernels against the reference and the torch-ops backend on the
  same CUDA tensors, also past the grid size (grid-stride loops) and past 2^31 elements (several GiB
  of GPU memory); the GIL released while compact() waits for the stream; a CUDA error left pending
  by earlier work reported as such.
- nvcc (skipped without nvcc): every csrc/*.cu compiles with the flags torch's cpp_extension uses,
  without torch, and exports the launchers of csrc/block_sparse.h; bindings.cpp parses against the
  installed torch's headers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from omnireduce.blocks import Layout, block_nonzero, gather_blocks, scatter_blocks
from omnireduce.cuda import build, ops
from omnireduce.dtypes import DType, narrow, widen
from omnireduce.wire import to_wire

SEED = int(os.environ.get("OMNIREDUCE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
CSRC = Path(__file__).resolve().parent.parent / "csrc"
DTYPES = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16}
DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# (numel, block size): empty, shorter than a block, exact multiples, short last blocks, blocks of one
# element, odd sizes (no 16-byte multiple), blocks around the warp/CTA switch of the kernels (4 KB).
SHAPES = [(0, 256), (1, 256), (255, 256), (256, 256), (257, 256), (3000, 256), (10240, 256), (1000, 1), (1001, 3),
          (999, 64), (5000, 1000), (9000, 2048), (9000, 2049), (20000, 4096)]
# Blocks of a power-of-two number of 16-byte vectors (1 to 512 of them, depending on the dtype), which the
# flat flags pass takes on aligned tensors; sizes with a partial last vector and a short last block.
FLAT_SHAPES = [(4096 * 8 + 5, 4), (70_001, 8), (70_000, 16), (65_553, 32), (65_536 + 17, 128), (300_000, 512),
               (300_003, 1024), (300_001, 2048)]
THRESHOLD = 0.05
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernels cannot run")


def rng_for(*key: object) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements, flat, in the reference's storage types (bfloat16 as uint16 words)."""
    t = t.detach().cpu().contiguous().view(-1)
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def words(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_same(actual: np.ndarray, expected: np.ndarray, dt: DType, what: str, nan_payload: bool = True) -> None:
    """Bit-identical (so -0.0 != +0.0); with ``nan_payload=False`` any NaN matches any NaN."""
    a, e = words(actual), words(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape} (seed {SEED})"
    differ = a != e
    if not nan_payload:
        differ &= ~(np.isnan(widen(actual, dt)) & np.isnan(widen(expected, dt)))
    bad = np.flatnonzero(differ)
    assert bad.size == 0, (f"{what}: {bad.size} elements differ, first at {bad[:5]}: got {a[bad[:5]]}, "
                           f"expected {e[bad[:5]]} (seed {SEED})")


def make_values(rng: np.random.Generator, n: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements whose blocks of ``B`` are each one random kind (zero, -0.0, dense, sparse, special)."""
    tiny = 6e-8 if dtype == torch.float16 else 1e-40  # subnormal in the dtype, non-zero after conversion
    x = np.zeros(n, np.float32)
    nb = -(-n // B)
    for b, kind in enumerate(rng.integers(0, 10, nb)):
        blk = x[b * B: min(n, (b + 1) * B)]  # a view
        pos = int(rng.integers(0, blk.size))
        if kind == 4:
            blk[:] = -0.0
        elif kind == 5:
            blk[:] = rng.standard_normal(blk.size)
        elif kind == 6:
            blk[pos] = rng.standard_normal()
        elif kind == 7:
            blk[rng.random(blk.size) < 0.5] = -0.0
            blk[pos] = rng.choice([np.nan, np.inf, -np.inf])
        elif kind == 8:  # all within the threshold, some exactly at it, or one just above it
            blk[:] = rng.uniform(-THRESHOLD, THRESHOLD, blk.size)
            blk[pos] = np.float32(THRESHOLD) * rng.choice([-1, 1])
            if rng.random() < 0.3:
                blk[int(rng.integers(0, blk.size))] = np.nextafter(np.float32(THRESHOLD), np.float32(1))
        elif kind == 9:
            blk[pos] = tiny * rng.choice([-1, 1])
        # kinds 0-3: all +0.0
    return torch.from_numpy(x).to(dtype)


def in_buffer(values: torch.Tensor, offset: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` copied into a contiguous view at element ``offset`` of a larger buffer of sentinels
    (so the view is misaligned for offsets that are not a multiple of 16 bytes), and the buffer."""
    n = values.numel()
    buf = torch.full((offset + n + 37,), 3.0, dtype=values.dtype, device=device)
    x = buf[offset: offset + n]
    x.copy_(values)
    return x, buf


def ref_compact(x: torch.Tensor, B: int, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Reference indices and wire data (short block trimmed) of the non-zero blocks."""
    data = raw(x)
    ids = np.flatnonzero(block_nonzero(data, DTYPES[x.dtype], B, t))
    return ids, gather_blocks(data, Layout(x.numel(), B, 1, 1), ids)


def ref_scatter(x: torch.Tensor, ids: np.ndarray, blocks: torch.Tensor, scale: float) -> np.ndarray:
    """Reference result of scattering ``blocks`` (k, B) into a copy of ``x``."""
    n, B = x.numel(), blocks.shape[1]
    lay = Layout(n, B, 1, 1)
    dt = DTYPES[x.dtype]
    hit = np.flatnonzero(ids == lay.full_blocks) if lay.tail else np.zeros(0, np.int64)
    data = to_wire(raw(blocks).reshape(len(ids), B), int(hit[0]) if hit.size else None, lay.tail)
    out = raw(x).copy()
    s = np.float32(scale)

    def write(dst: np.ndarray, src: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            dst[...] = narrow(widen(src, dt) * s, dt)

    scatter_blocks(out, lay, ids, data, None if s == 1 else write)
    return out


def check_compact(x: torch.Tensor, B: int, t: float, idx: torch.Tensor, blocks: torch.Tensor, what: str) -> None:
    dt = DTYPES[x.dtype]
    ids, wire = ref_compact(x, B, t)
    k = len(ids)
    assert idx.dtype == torch.int64 and idx.shape == (k,) and blocks.shape == (k, B) and blocks.dtype == x.dtype
    assert np.array_equal(idx.cpu().numpy(), ids), f"{what}: indices differ (seed {SEED})"
    lay = Layout(x.numel(), B, 1, 1)
    got = raw(blocks).reshape(k, B)
    short = int(np.flatnonzero(ids == lay.full_blocks)[0]) if lay.tail and k and ids[-1] == lay.full_blocks else None
    assert_same(to_wire(got, short, lay.tail), wire, dt, f"{what}: blocks")
    if short is not None:
        assert not np.any(words(got[short, lay.tail:])), f"{what}: short block not padded with +0 (seed {SEED})"


def scatter_case(rng: np.random.Generator, n: int, B: int, dtype: torch.dtype, order: str,
                 device: str = "cpu") -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Distinct block ids (sometimes including the short last block), their index tensor and (k, B) data."""
    nb = -(-n // B)
    k = int(rng.integers(0, nb + 1))
    ids = rng.choice(nb, k, replace=False)
    if nb and rng.random() < 0.5 and nb - 1 not in ids:
        ids = np.append(ids, nb - 1)
    ids = np.sort(ids) if order == "ascending" else rng.permutation(ids)
    blocks = make_values(rng, len(ids) * B, B, dtype).view(len(ids), B).to(device)
    return ids.astype(np.int64), torch.from_numpy(ids.astype(np.int64)).to(device), blocks


# --- torch-ops backend on CPU ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), SHAPES)
@pytest.mark.parametrize("threshold", [0.0, THRESHOLD])
def test_block_flags_match_reference(dtype: torch.dtype, n: int, B: int, threshold: float) -> None:
    for offset in (0, 1, 3):
        x, _ = in_buffer(make_values(rng_for("flags", dtype, n, B, threshold, offset), n, B, dtype), offset)
        expected = block_nonzero(raw(x), DTYPES[dtype], B, threshold)
        got = ops.block_flags(x, B, threshold)
        assert got.dtype == torch.bool and got.shape == (expected.size,)
        assert np.array_equal(got.numpy(), expected), f"offset {offset}, seed {SEED}"
        if expected.size >= 40:  # the input exercises both outcomes
            assert expected.any() and not expected.all(), f"seed {SEED}"


@pytest.mark.parametrize("dtype", list(DTYPES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), SHAPES)
@pytest.mark.parametrize("threshold", [0.0, THRESHOLD])
def test_compact_matches_reference(dtype: torch.dtype, n: int, B: int, threshold: float) -> None:
    for offset in (0, 1):
        x, _ = in_buffer(make_values(rng_for("compact", dtype, n, B, threshold, offset), n, B, dtype), offset)
        idx, blocks = ops.compact(x, B, threshold)
        check_compact(x, B, threshold, idx, blocks, f"offset {offset}")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), SHAPES)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3, 1e5])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_scatter_matches_reference(dtype: torch.dtype, n: int, B: int, scale: float, order: str) -> None:
    rng = rng_for("scatter", dtype, n, B, scale, order)
    offset = int(rng.integers(0, 4))
    x, buf = in_buffer(make_values(rng, n, B, dtype), offset)
    before = buf.clone()
    ids, idx, blocks = scatter_case(rng, n, B, dtype, order)
    expected = ref_scatter(x, ids, blocks, scale)
    ops.scatter(x, idx, blocks, scale)
    assert_same(raw(x), expected, DTYPES[dtype], f"scatter offset {offset}", nan_payload=scale == 1.0)
    # nothing outside x written, in particular not the padding of the short block's row
    assert torch.equal(buf[:offset].view(torch.uint8), before[:offset].view(torch.uint8))
    assert torch.equal(buf[offset + n:].view(torch.uint8), before[offset + n:].view(torch.uint8))


def test_scatter_rounds_once_in_float32() -> None:
    # values whose products with float32(1/3) are not representable in float16/bfloat16
    for dtype in DTYPES:
        x = torch.zeros(4, dtype=dtype)
        blocks = torch.tensor([[1 + 2**-7, -1.5, 1e-3, 65504.0]], dtype=torch.float32).to(dtype)
        ops.scatter(x, torch.tensor([0]), blocks, 1 / 3)
        expected = narrow(widen(raw(blocks), DTYPES[dtype]) * np.float32(1 / 3), DTYPES[dtype])
        assert_same(raw(x), expected, DTYPES[dtype], str(dtype))


def test_empty_all_zero_and_all_nonzero() -> None:
    for dtype in DTYPES:
        e = torch.zeros(0, dtype=dtype)
        assert ops.block_flags(e, 256).shape == (0,)
        idx, blocks = ops.compact(e, 256)
        assert idx.shape == (0,) and idx.dtype == torch.int64 and blocks.shape == (0, 256) and blocks.dtype == dtype
        ops.scatter(e, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 256, dtype=dtype))
        z = torch.zeros(1000, dtype=dtype)
        z[::3] = -0.0
        assert not ops.block_flags(z, 256).any()
        assert not ops.block_flags(z, 256, THRESHOLD).any()
        idx, blocks = ops.compact(z, 256)
        assert idx.numel() == 0 and blocks.shape == (0, 256)
        d = torch.full((1000,), -2.0, dtype=dtype)
        idx, blocks = ops.compact(d, 256, THRESHOLD)
        assert idx.tolist() == [0, 1, 2, 3] and torch.equal(blocks[3, 232:], torch.zeros(24, dtype=dtype))
        y = torch.zeros(1000, dtype=dtype)
        ops.scatter(y, idx, blocks, 0.5)
        assert torch.equal(y, torch.full((1000,), -1.0, dtype=dtype))


def test_threshold_semantics() -> None:
    t = np.float32(0.1)
    x = torch.zeros(4 * 8)
    x[0:8] = float(t)  # |x| == t: zero
    x[8] = float(np.nextafter(t, np.float32(1)))  # just above: non-zero
    x[16] = float("nan")  # NaN is never <= t
    x[24:32] = -float(t)
    assert ops.block_flags(x, 8, 0.1).tolist() == [False, True, True, False]
    assert ops.block_flags(x, 8).tolist() == [True, True, True, True]
    assert ops.block_flags(x, 8, float("inf")).tolist() == [False, False, True, False]


def test_invalid_arguments() -> None:
    x = torch.zeros(512)
    with pytest.raises(ValueError, match="contiguous"):
        ops.block_flags(torch.zeros(4, 512).t(), 256)
    with pytest.raises(TypeError, match="float32"):
        ops.compact(torch.zeros(512, dtype=torch.int32), 256)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_size"):
            ops.block_flags(x, bad)  # type: ignore[arg-type]
    assert ops.block_flags(x, np.int64(256)).shape == (2,)  # numpy ints are fine
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="threshold"):
            ops.compact(x, 256, bad)
    idx = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="float16"):
        ops.scatter(x, idx, torch.zeros(2, 256, dtype=torch.float16))
    with pytest.raises(ValueError, match="2 indices but 3 blocks"):
        ops.scatter(x, idx, torch.zeros(3, 256))
    with pytest.raises(ValueError, match="2-D"):
        ops.scatter(x, idx, torch.zeros(512))
    with pytest.raises(ValueError, match="indices"):
        ops.scatter(x, idx.float(), torch.zeros(2, 256))


def test_backend_on_cpu_is_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "require")  # only concerns CUDA tensors
    assert ops.backend(torch.zeros(3)) == "torch-ops"
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="OMNIREDUCE_CUDA_KERNELS"):
        build._kernels()


# --- building and loading the extension (cpp_extension.load faked) --------------------------------


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """A loader that has not tried yet, a build cache in tmp_path, and a record of load() calls.

    The prerequisites (ninja, a CUDA build of torch, nvcc) count as present: load() is faked here,
    and test_cuda_build.py checks them for real."""
    monkeypatch.setattr(build, "_state", build._LoadState())
    monkeypatch.setattr(build, "_capabilities", lambda: [(9, 0)])
    monkeypatch.setattr(build, "_missing_prerequisites", lambda: [])
    monkeypatch.setenv("OMNIREDUCE_CUDA_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OMNIREDUCE_CUDA_KERNELS", raising=False)
    return []


def test_build_failure_falls_back_once_or_raises_when_required(
        fresh_loader: list[dict], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def failing_load(**kwargs: object) -> None:
        fresh_loader.append(kwargs)
        raise RuntimeError("Error building extension: nvcc fatal: boom")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    assert build._kernels() is None and build._kernels() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "omnireduce.cuda_kernels"]
    assert len(warnings) == 1 and "boom" in warnings[0].getMessage()
    assert len(fresh_loader) == 1  # not retried on every call
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "require")
    with pytest.raises(RuntimeError, match=r"require.*boom"):
        build._kernels()
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "off")
    assert build._kernels() is None


def test_build_is_logged_once_and_cached_by_source_hash(
        fresh_loader: list[dict], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    caplog.set_level(logging.INFO, logger="omnireduce.cuda_kernels")
    module = object()

    def fake_load(**kwargs: object) -> object:
        fresh_loader.append(kwargs)
        return module

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build._kernels() is module and build._kernels() is module
    assert len(fresh_loader) == 1
    call = fresh_loader[0]
    build_dir = Path(str(call["build_directory"]))
    assert build_dir.parent == tmp_path / "cache" and build_dir.is_dir()
    assert sorted(Path(s).name for s in call["sources"]) == sorted(  # type: ignore[union-attr]
        p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp"))
    assert not any("fast_math" in f for f in call["extra_cuda_cflags"])  # type: ignore[union-attr]
    messages = [r.getMessage() for r in caplog.records if r.name == "omnireduce.cuda_kernels"]
    assert sum("building" in m for m in messages) == 1 and sum(re.search(r"built .* in [\d.]+ s", m) is not None
                                                                for m in messages) == 1

    # a second process finds the built library in the same directory and does not announce a build
    (build_dir / f"{build._EXT_NAME}.so").write_bytes(b"")
    monkeypatch.setattr(build, "_state", build._LoadState())
    caplog.clear()
    assert build._kernels() is module
    assert Path(str(fresh_loader[1]["build_directory"])) == build_dir
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("building" in m or "built" in m for m in messages)
    assert sum("loaded the omnireduce CUDA kernels from" in m for m in messages) == 1
    assert build.prepare("cuda:0") == "cuda-kernels" and build.prepare(torch.device("cpu")) == "torch-ops"
    assert len(fresh_loader) == 2  # prepare() reuses the outcome

    # the key follows the sources and the GPU archs
    sources = build._source_files()
    key = build._build_key(sources, [(9, 0)])
    assert key == build._build_key(sources, [(9, 0)]) != build._build_key(sources, [(8, 0)])
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    monkeypatch.setattr(build, "_CSRC", copy)
    assert build._build_key(build._source_files(), [(9, 0)]) == key
    cu = copy / "block_sparse.cu"
    cu.write_text(cu.read_text() + "\n// changed\n")
    assert build._build_key(build._source_files(), [(9, 0)]) != key


# --- CUDA kernels (need a GPU) --------------------------------------------------------------------


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail rather than fall back if the extension cannot be built."""
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "require")


@needs_cuda
def test_cuda_backend_is_kernels(kernels: None) -> None:
    assert ops.backend(torch.zeros(3, device="cuda")) == "cuda-kernels"


@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), [*SHAPES, *FLAT_SHAPES, (1 << 22, 256), ((1 << 22) + 3, 256), (100_003, 64),
                                     (50_000, 70_000)])
@pytest.mark.parametrize("threshold", [0.0, THRESHOLD])
def test_cuda_flags_and_compact(kernels: None, dtype: torch.dtype, n: int, B: int, threshold: float) -> None:
    rng = rng_for("cuda", dtype, n, B, threshold)
    values = make_values(rng, n, B, dtype) if n <= 100_000 else _big_values(rng, n, B, dtype)
    for offset in (0, 1, 5, 8):  # 0 and 8 (16 or 32 bytes) keep 16-byte alignment: the flat flags pass
        x, buf = in_buffer(values, offset, "cuda")
        before = buf.clone()
        flags = ops.block_flags(x, B, threshold)
        expected = block_nonzero(raw(x), DTYPES[dtype], B, threshold)
        assert flags.is_cuda and np.array_equal(flags.cpu().numpy(), expected), f"offset {offset}, seed {SEED}"
        assert torch.equal(flags, ops._flags_torch(x, B, threshold))
        idx, blocks = ops.compact(x, B, threshold)
        assert idx.is_cuda and blocks.is_cuda
        check_compact(x, B, threshold, idx, blocks, f"cuda offset {offset}")
        ref_idx, ref_blocks = ops._compact_torch(x, B, threshold)
        assert torch.equal(idx, ref_idx)
        assert torch.equal(blocks.view(-1).view(torch.uint8), ref_blocks.view(-1).view(torch.uint8))
        assert torch.equal(buf.view(torch.uint8), before.view(torch.uint8))  # inputs untouched


@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), [*SHAPES, ((1 << 20) + 3, 256), (100_003, 64)])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3, 1e5])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_cuda_scatter(kernels: None, dtype: torch.dtype, n: int, B: int, scale: float, order: str) -> None:
    rng = rng_for("cuda-scatter", dtype, n, B, scale, order)
    values = make_values(rng, n, B, dtype) if n <= 100_000 else _big_values(rng, n, B, dtype)
    ids, idx, blocks = scatter_case(rng, n, B, dtype, order, "cuda") if n <= 100_000 else _big_scatter(rng, n, B, dtype)
    for offset in (0, 1, 6):
        x, buf = in_buffer(values, offset, "cuda")
        before = buf.clone()
        expected = ref_scatter(x, ids, blocks, scale)
        ops.scatter(x, idx, blocks, scale)
        assert_same(raw(x), expected, DTYPES[dtype], f"cuda scatter offset {offset}", nan_payload=scale == 1.0)
        assert torch.equal(buf[:offset].view(torch.uint8), before[:offset].view(torch.uint8))
        assert torch.equal(buf[offset + n:].view(torch.uint8), before[offset + n:].view(torch.uint8))
        y, _ = in_buffer(values, offset, "cuda")
        ops._scatter_torch(y, idx, blocks, float(np.float32(scale)))
        assert_same(raw(x), raw(y), DTYPES[dtype], "kernels vs torch ops", nan_payload=scale == 1.0)


@needs_cuda
def test_cuda_side_stream_and_round_trip(kernels: None) -> None:
    rng = rng_for("stream")
    x = make_values(rng, 300_001, 256, torch.bfloat16).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        idx, blocks = ops.compact(x, 256)
        y = torch.zeros_like(x)
        ops.scatter(y, idx, blocks)
    torch.cuda.current_stream().wait_stream(stream)
    nz = ops.block_flags(x, 256)
    mask = nz.repeat_interleave(256)[: x.numel()]
    assert torch.equal(y[mask].view(torch.int16), x[mask].view(torch.int16))
    assert not y[~mask].view(torch.int16).any()

# --- past the grid and the 32-bit limits (several GiB of GPU memory) -------------------------------

# (numel, block size), both past 2^31 elements (4 GiB in float16/bfloat16) with a short last block:
# warp groups (blocks of <= 4 KB, 8 per CUDA block) past 2^23 blocks, i.e. past the 2^20 CUDA blocks of
# the largest grid, and CTA groups (one tensor block per CUDA block) past 2^20 blocks.
HUGE = [((1 << 31) + 1000, 256), (((1 << 20) + 3) * 2049 - 5, 2049)]


def _huge_input(n: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """1% random dense blocks; NaN, Inf, a subnormal, a -0.0 block around element 2^31; the last element set."""
    g = torch.Generator(device="cuda").manual_seed(SEED)
    x = torch.zeros(n, dtype=dtype, device="cuda")
    full = n // B
    ids = torch.randperm(full, generator=g, device="cuda")[: full // 100]
    x[: full * B].view(full, B)[ids] = torch.randn(ids.numel(), B, generator=g, device="cuda").to(dtype)
    edge = 1 << 31
    x[edge + 5 * B: edge + 6 * B] = -0.0
    for pos, value in ((edge - 1, 1.0), (edge, float("nan")), (edge + 1, -float("inf")), (edge + 3 * B + 1, 6e-8),
                       (n - 1, 0.5)):
        x[pos] = value
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor, nan_payload: bool = True) -> bool:
    word = torch.int32 if a.element_size() == 4 else torch.int16
    differ = a.view(word) != b.view(word)
    if not nan_payload:
        differ &= ~(a.isnan() & b.isnan())
    return a.shape == b.shape and not bool(differ.any())


@needs_cuda
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("n", "B"), HUGE, ids=["warp-groups", "cta-groups"])
def test_cuda_past_grid_and_int32_limits(kernels: None, dtype: torch.dtype, n: int, B: int) -> None:
    x = _huge_input(n, B, dtype)
    nb = -(-n // B)
    nan_block = (1 << 31) // B
    for t in (0.0, THRESHOLD):
        flags = ops.block_flags(x, B, t)
        assert flags.shape == (nb,) and bool(flags[-1]) and bool(flags[nan_block]), f"threshold {t}, seed {SEED}"
        assert torch.equal(flags, ops._flags_torch(x, B, ops._threshold(t))), f"threshold {t}, seed {SEED}"
        del flags
    idx, blocks = ops.compact(x, B)
    ref_idx, ref_blocks = ops._compact_torch(x, B, 0.0)
    assert torch.equal(idx, ref_idx) and int(idx[-1]) == nb - 1, f"seed {SEED}"
    assert _same_bits(blocks, ref_blocks), f"seed {SEED}"
    del ref_idx, ref_blocks
    for scale in (1.0, 1 / 3):
        y = torch.zeros_like(x)
        ops.scatter(y, idx, blocks, scale)
        ref = torch.zeros_like(x)
        ops._scatter_torch(ref, idx, blocks, float(np.float32(scale)))
        assert _same_bits(y, ref, nan_payload=scale == 1.0), f"scale {scale}, seed {SEED}"
        del y, ref
    del x, idx, blocks
    torch.cuda.empty_cache()


@needs_cuda
def test_cuda_more_than_2_31_blocks(kernels: None) -> None:
    """Flags work for any count; compact refuses more than 2^31-1 blocks (CUB counts in int) clearly."""
    x = torch.zeros((1 << 31) + 5, dtype=torch.float16, device="cuda")
    x[(1 << 31) + 1] = 2.0
    x[-1] = 1.0
    flags = ops.block_flags(x, 1)
    assert flags.shape == (x.numel(),) and int(flags.sum()) == 2 and bool(flags[-1]) and bool(flags[(1 << 31) + 1])
    with pytest.raises(RuntimeError, match=r"at most 2\^31-1 blocks"):
        ops.compact(x, 1)
    del x, flags
    torch.cuda.empty_cache()


# --- the GIL and CUDA errors ----------------------------------------------------------------------


@needs_cuda
def test_cuda_compact_lets_other_threads_run_while_it_waits(kernels: None) -> None:
    x = torch.zeros(1 << 20, device="cuda")
    x[12345] = 1.0
    ops.compact(x, 256)  # loaded, allocator warm
    torch.cuda.synchronize()
    ticks: list[float] = []
    stop = threading.Event()

    def count() -> None:  # needs the GIL for every tick
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(1e-4)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clock cycles ahead of compact's work
        t0 = time.perf_counter()
        idx, _ = ops.compact(x, 256)  # waits for the sleep in cudaStreamSynchronize
        t1 = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    assert idx.tolist() == [12345 // 256]
    assert t1 - t0 > 0.2, f"the GPU sleep lasted {t1 - t0:.3f} s: too short to tell"
    inside = sum(t0 + 0.05 < t < t1 - 0.05 for t in ticks)
    assert inside > 100, f"another thread ran {inside} times in {t1 - t0:.2f} s of compact(): the GIL was held"


def _loaded_cuda_runtimes() -> list[ctypes.CDLL]:
    """The CUDA runtime libraries in this process (torch's, and the extension's if it is another)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line.rsplit("/", 1)[-1]}
    return [ctypes.CDLL(p) for p in sorted(paths)]


@needs_cuda
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_cuda_error_left_by_earlier_work_is_reported_as_such(kernels: None) -> None:
    x = torch.ones(1000, device="cuda")
    assert ops.block_flags(x, 256).all()  # the extension and its CUDA runtime loaded
    runtimes = _loaded_cuda_runtimes()
    assert runtimes, "no dynamically loaded libcudart"
    for rt in runtimes:  # a failed runtime call nobody checks: its error stays pending on this thread
        assert rt.cudaSetDevice(ctypes.c_int(1 << 20)) != 0
    assert any(rt.cudaPeekAtLastError() != 0 for rt in runtimes)
    try:
        with pytest.raises(RuntimeError, match=r"error from earlier work was pending before omr_block_flags.*not "
                                               r"raised by omnireduce.*cudaErrorInvalidDevice"):
            ops.block_flags(x, 256)
    finally:
        for rt in runtimes:
            rt.cudaGetLastError()
    assert ops.block_flags(x, 256).all()  # reported once, then cleared
    idx, _ = ops.compact(x, 256)
    assert idx.tolist() == [0, 1, 2, 3]


def _big_values(rng: np.random.Generator, n: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """A large input built without a Python loop: random non-zero blocks, a few specials."""
    x = np.zeros(n, np.float32)
    nb = -(-n // B)
    for b in rng.choice(nb, max(1, nb // 10), replace=False):
        x[b * B: min(n, (b + 1) * B)] = rng.standard_normal(min(n, (b + 1) * B) - b * B)
    x[rng.choice(n, 64, replace=False)] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 1e-40, THRESHOLD], 64)
    x[-1] = 1.0  # the short block is non-zero
    return torch.from_numpy(x).to(dtype)


def _big_scatter(rng: np.random.Generator, n: int, B: int,
                 dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    nb = -(-n // B)
    ids = np.append(rng.choice(nb - 1, nb // 3, replace=False), nb - 1).astype(np.int64)
    rng.shuffle(ids)
    blocks = torch.from_numpy(rng.standard_normal((ids.size, B), dtype=np.float32)).to(dtype)
    return ids, torch.from_numpy(ids).cuda(), blocks.cuda()


# --- compiling the CUDA sources without torch -----------------------------------------------------

# What torch.utils.cpp_extension passes nvcc (COMMON_NVCC_FLAGS, -std=c++20), for two architectures
# (compiled side by side: --threads 2, a quarter less time here).
NVCC_FLAGS = ["-std=c++20", "-O3", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
              "-Xcompiler", "-fPIC", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


@pytest.mark.e2e  # (the toolchain, 10 s a file: make test-e2e)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: cannot compile csrc/*.cu")
@pytest.mark.parametrize("source", sorted(CSRC.glob("*.cu")), ids=lambda p: p.name)
def test_nvcc_compiles_without_torch(source: Path, tmp_path: Path) -> None:
    text = source.read_text()
    assert not re.search(r"#\s*include\s*[<\"](torch|ATen|c10|pybind11)/", text), "kernels must not include torch"
    obj = tmp_path / (source.stem + ".o")
    cmd = ["nvcc", "-c", "--threads", "2", *NVCC_FLAGS, "-I", str(CSRC), str(source), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-6000:]}"
    assert obj.stat().st_size > 0
    if shutil.which("nm") is not None and source.name == "block_sparse.cu":
        declared = set(re.findall(r"\b(omr_\w+)\(", (CSRC / "block_sparse.h").read_text()))
        symbols = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True,
                                 check=True).stdout.split()
        missing = declared - set(symbols)
        assert declared and not missing, f"launchers not exported (or C++-mangled): {missing}"


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    roots = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return Path(root) / "include"
    return None


@pytest.mark.e2e  # (torch's headers, 20 s: make test-e2e)
@pytest.mark.skipif(shutil.which("c++") is None or _cuda_include() is None,
                    reason="needs a C++ compiler and the CUDA toolkit headers")
def test_bindings_parse_against_torch_headers(tmp_path: Path) -> None:
    """bindings.cpp is only built on CUDA machines; check here at least that it parses against this
    torch's C++ API (-fsyntax-only). CPU wheels lack one generated CUDA header, stubbed here."""
    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    includes = [*cpp_extension.include_paths(), str(_cuda_include()), str(CSRC), str(tmp_path),
                sysconfig.get_paths()["include"]]
    cmd = ["c++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=omr_syntax_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-I{p}" for p in includes), str(CSRC / "bindings.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
