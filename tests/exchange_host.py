"""The engine's exchange kernels run on the host, for tests on machines without a GPU.

:class:`HostKernels` has the four calls of the CUDA extension's kernel exchange (``record``, ``rows``,
``counts``, ``sum_blocks``: ``csrc/bindings.cpp``), and the guarded sums a CUDA graph takes
(``sum_blocks_within``), on CPU tensors. Each runs the same per-item steps as the CUDA kernels
(``csrc/exchange_steps.h``), compiled here by the C++ compiler into a small shared library
(``tests/csrc/exchange_host.cpp``, called through ctypes), in loops instead of grids. The
block flags come from :func:`omnireduce.cuda.ops.flags_of` (the CUDA flags kernel is tested on its
own). What this cannot check is the kernels' grid mapping and their use of shared memory and
atomics: the GPU check runs the real ones.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from omnireduce.cuda import ops

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "tests" / "csrc" / "exchange_host.cpp", ROOT / "csrc" / "exchange_steps.h")
_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: the kernels' host build cannot be made")


def build() -> Path:
    """The shared library, compiled once per source digest into the temporary directory."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"omnireduce-exchange-host-{digest}.so"
    if not out.exists():
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Werror", "-shared", "-fPIC", "-I", str(ROOT / "csrc"),
                        str(SOURCES[0]), "-o", str(tmp)], check=True, capture_output=True, text=True, timeout=300)
        tmp.replace(out)  # (atomic: ranks building at once each finish their own)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class HostKernels:
    """The kernel exchange's four calls on CPU tensors (see the module)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(build()))
        lib.host_pack.argtypes = [_P, _I, _P]
        lib.host_scan.argtypes = [_P, _I, _P]
        lib.host_rows.argtypes = [_P, _I, _I, ctypes.c_int, _P, _P, _P, _I, _I, _P]
        lib.host_counts.argtypes = [_P, _I, ctypes.c_int, _I, _I, ctypes.c_int, _P, _P]
        lib.host_sum_blocks.argtypes = [_P, _I, _I, ctypes.c_int, _P, _P, _I, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int, _P, _I, _I, _P, _I, ctypes.c_float]
        lib.host_sum_blocks_within.argtypes = [*lib.host_sum_blocks.argtypes, _P, _I]
        self.lib = lib
        self.calls: list[str] = []

    def record(self, x: torch.Tensor, B: int, threshold: float, out: torch.Tensor, head: int, cap: int) -> torch.Tensor:
        self.calls.append("record")
        nb = -(-x.numel() // B)
        nbytes = -(-nb // 8)
        assert out.dtype == torch.uint8 and out.is_contiguous() and head >= nbytes and head % 16 == 0
        assert out.numel() >= head + cap * B * x.element_size()
        flags = ops.flags_of(x.view(-1), B, threshold).view(torch.uint8)  # (block_flags without its checks)
        self.lib.host_pack(flags.data_ptr(), nb, out.data_ptr())
        prefix = torch.empty(nbytes + 1, dtype=torch.int32)
        self.lib.host_scan(out.data_ptr(), nbytes, prefix.data_ptr())
        if cap:
            self.lib.host_rows(x.data_ptr(), x.numel(), B, _CODES[x.dtype], out.data_ptr(), prefix.data_ptr(), None,
                               0, cap, out.data_ptr() + head)
        return prefix

    def rows(self, x: torch.Tensor, B: int, bitmap: torch.Tensor, prefix: torch.Tensor, mask: torch.Tensor | None,
             lo: int, hi: int, out: torch.Tensor) -> None:
        self.calls.append("rows")
        assert bitmap.is_contiguous() and prefix.is_contiguous() and out.is_contiguous()
        assert out.dim() == 2 and out.shape[0] >= hi - lo and out.shape[1] == B and out.dtype == x.dtype
        self.lib.host_rows(x.data_ptr(), x.numel(), B, _CODES[x.dtype], bitmap.data_ptr(), prefix.data_ptr(),
                           _ptr(mask), lo, hi, out.data_ptr())

    def counts(self, gathered: torch.Tensor, nb: int, lanes: int,
               pairs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls.append("counts")
        W, nbytes = gathered.shape[0], -(-nb // 8)
        assert gathered.dtype == torch.uint8 and gathered.stride(1) == 1 and gathered.shape[1] >= nbytes
        bits = torch.empty((W + 1, nbytes), dtype=torch.uint8)
        out = torch.empty(W + 2 + (W * W + W if pairs else 0), dtype=torch.int64)
        self.lib.host_counts(gathered.data_ptr(), gathered.stride(0), W, nb, lanes, int(pairs), bits.data_ptr(),
                             out.data_ptr())
        prefix = torch.empty(bits.numel() + 1, dtype=torch.int32)
        self.lib.host_scan(bits.data_ptr(), bits.numel(), prefix.data_ptr())
        return bits, prefix, out

    def sum_blocks(self, x: torch.Tensor, B: int, bits: torch.Tensor, prefix: torch.Tensor, target: int, src_row: int,
                   nsrc: int, first: torch.Tensor | None, rest: torch.Tensor | None, scale: float) -> None:
        self.calls.append("sum_blocks")
        self.lib.host_sum_blocks(*self._sum_args(x, B, bits, prefix, target, src_row, nsrc, first, rest, scale))

    def sum_blocks_within(self, x: torch.Tensor, B: int, bits: torch.Tensor, prefix: torch.Tensor, target: int,
                          src_row: int, nsrc: int, first: torch.Tensor | None, rest: torch.Tensor | None, scale: float,
                          counts: torch.Tensor, limit: int) -> None:
        """:meth:`sum_blocks`, writing nothing unless each of the first ``nsrc`` of ``counts`` is at most
        ``limit`` (the CUDA extension's guarded sums, which a CUDA graph enqueues before the counts are read)."""
        self.calls.append("sum_blocks_within")
        assert counts.dtype == torch.int64 and counts.is_contiguous() and counts.numel() >= nsrc
        self.lib.host_sum_blocks_within(*self._sum_args(x, B, bits, prefix, target, src_row, nsrc, first, rest, scale),
                                        counts.data_ptr(), limit)

    def _sum_args(self, x: torch.Tensor, B: int, bits: torch.Tensor, prefix: torch.Tensor, target: int, src_row: int,
                  nsrc: int, first: torch.Tensor | None, rest: torch.Tensor | None, scale: float) -> tuple:
        for t in (first, rest):
            assert t is None or (t.dim() == 3 and t.shape[-1] == B and t.stride(-1) == 1 and t.dtype == x.dtype
                                 and (t.shape[1] <= 1 or t.stride(1) == B))
        cap = first.shape[1] if first is not None else 0
        return (x.data_ptr(), x.numel(), B, _CODES[x.dtype], bits.data_ptr(), prefix.data_ptr(), bits.shape[1], target,
                src_row, nsrc, _ptr(first), first.stride(0) if first is not None else 0, cap, _ptr(rest),
                rest.stride(0) if rest is not None else 0, scale)
