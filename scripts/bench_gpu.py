#!/usr/bin/env python3
"""GPU micro-benchmark: omnireduce's block-sparsity CUDA kernels against its torch-ops fallback.

For each bucket size (1 MB to 256 MB by default) and density (fraction of blocks that are non-zero,
at random places), on one CUDA device, the built kernels against the torch-ops backend that
omnireduce.cuda.ops runs when the extension is unavailable (``_flags_torch``, ``_compact_torch``,
``_scatter_torch``: what users get without it):

    op       kernels (omnireduce.cuda.ops)   torch-ops fallback
    flags    block_flags(x, B)                   bits & magnitude mask, any() per block (+ the short tail)
    compact  compact(x, B)                       flags, nonzero, index_select (+ the short tail)
    scatter  scatter(y, idx, blocks, s)          (blocks.float() * s).to(dtype), index_copy_

Each time is the median of ``--repeats`` CUDA-event timings after ``--warmup`` runs; by default the
L2 cache is flushed before each run (a write of 256 MB), so buckets small enough to stay in L2 are
not flattered. Bandwidth counts the bytes an operation must move at least (flags: read the bucket;
compact: read the bucket and write k blocks; scatter: read and write k blocks), as GB/s and as a
fraction of this device's device-to-device copy bandwidth, measured here with a large ``copy_``
(counting the bytes read and written). Before timing, every configuration checks that the kernels
and the torch-ops fallback agree.

    python scripts/bench_gpu.py                                  # float32, blocks of 256, full sweep
    python scripts/bench_gpu.py --dtype bfloat16 --sizes-mb 16,64 --densities 0.01,1 --json out.json

Prints a table and writes JSON (``--json``, default results/bench_gpu.json). Needs a CUDA device
and a compiler for the extension (the kernels are built on first use; a failed build is an error
here, not a fallback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

SIZES_MB = [1, 4, 16, 64, 256]
DENSITIES = [0.001, 0.01, 0.1, 0.5, 1.0]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default=",".join(map(str, SIZES_MB)), help="bucket sizes in MiB")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)), help="fractions of non-zero blocks")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--scale", type=float, default=0.125, help="scatter scale (1/world_size; default 1/8)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false", help="keep L2 warm between runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/bench_gpu.json", help="where to write the results")
    p.add_argument("--hook-steps", type=int, default=30,
                   help="also train the recommender on the GPU through the DDP hook for this many steps, "
                        "omnireduce vs the dense all-reduce (0: skip)")
    p.add_argument("--hook-nproc", type=int, default=2, help="ranks for the hook benchmark (they share GPUs)")
    return p.parse_args()


class Timer:
    """Median CUDA-event time of a callable, optionally flushing L2 before each run."""

    def __init__(self, repeats: int, warmup: int, flush_l2: bool) -> None:
        self.repeats, self.warmup = repeats, warmup
        self.flush = torch.empty(256 * MB, dtype=torch.uint8, device="cuda") if flush_l2 else None
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.flush is not None:
                self.flush.fill_(1)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_time(self.end))
        return statistics.median(times)


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e6)


def make_bucket(numel: int, B: int, density: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    nb = numel // B
    k = min(nb, max(1, round(nb * density)))
    x = torch.zeros(nb, B, dtype=dtype, device="cuda")
    idx = torch.randperm(nb, generator=gen, device="cpu")[:k].cuda()
    x[idx] = torch.randn(k, B, generator=gen, device="cpu").to(dtype).cuda()
    return x.view(-1)


def torch_ops(ck: Any, B: int) -> dict[str, Callable]:
    """The same three operations through omnireduce's torch-ops fallback (exact mode, threshold 0)."""

    def flags(x: torch.Tensor) -> torch.Tensor:
        return ck._flags_torch(x.view(-1), B, 0.0)

    def compact(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ck._compact_torch(x.view(-1), B, 0.0)

    def scatter(y: torch.Tensor, idx: torch.Tensor, blocks: torch.Tensor, s: float) -> None:
        ck._scatter_torch(y.view(-1), idx, blocks, float(np.float32(s)))  # the float32 scale scatter() uses

    return {"flags": flags, "compact": compact, "scatter": scatter}


def check_agree(ck: Any, ops: dict[str, Callable], x: torch.Tensor, B: int, s: float) -> None:
    """Exit if the kernels and the torch-ops fallback disagree on this bucket."""
    problems = []
    if not torch.equal(ck.block_flags(x, B), ops["flags"](x)):
        problems.append("flags")
    idx, blocks = ck.compact(x, B)
    ref_idx, ref_blocks = ops["compact"](x)
    if not (torch.equal(idx, ref_idx) and torch.equal(blocks, ref_blocks)):
        problems.append("compact")
    y, ref_y = torch.zeros_like(x), torch.zeros_like(x)
    ck.scatter(y, idx, blocks, s)
    ops["scatter"](ref_y, ref_idx, ref_blocks, s)
    if not torch.equal(y, ref_y):
        problems.append("scatter")
    if problems:
        sys.exit(f"bench_gpu.py: kernels and the torch-ops fallback disagree on {', '.join(problems)} "
                 f"(numel {x.numel()}, {x.dtype}, B {B}); not timing wrong results")


def bench_bucket(ck: Any, ops: dict[str, Callable], timer: Timer, x: torch.Tensor, B: int,
                 s: float) -> list[dict[str, Any]]:
    """Time the three operations on one bucket, kernels and torch-ops fallback."""
    es = x.element_size()
    idx, blocks = ck.compact(x, B)
    k = idx.numel()
    y = torch.zeros_like(x)
    work = {
        "flags": (lambda: ck.block_flags(x, B), lambda: ops["flags"](x), x.numel() * es),
        "compact": (lambda: ck.compact(x, B), lambda: ops["compact"](x), x.numel() * es + k * (B * es + 8)),
        "scatter": (lambda: ck.scatter(y, idx, blocks, s), lambda: ops["scatter"](y, idx, blocks, s),
                    k * (2 * B * es + 8)),
    }
    rows = []
    for op, (kern, plain, nbytes) in work.items():
        kern_ms, torch_ms = timer.ms(kern), timer.ms(plain)
        rows.append({"op": op, "numel": x.numel(), "blocks": x.numel() // B, "k": k, "bytes": nbytes,
                     "kernels_ms": kern_ms, "torch_ms": torch_ms, "speedup": torch_ms / kern_ms,
                     "kernels_gbps": nbytes / (kern_ms * 1e6), "torch_gbps": nbytes / (torch_ms * 1e6)})
    return rows


def bench_hook(args: argparse.Namespace) -> list[dict]:
    """The whole hook on a CUDA model: examples/train_recsys.py --device cuda under omnireduce-run,
    with omnireduce_hook and with DDP's default all-reduce (Gloo), same seed and data."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    rows = []
    print(f"\nDDP hook on a CUDA model: recommender, {args.hook_nproc} ranks, {args.hook_steps} steps")
    for hook in ("omnireduce", "allreduce"):
        with tempfile.TemporaryDirectory() as tmp:
            summary = Path(tmp) / "s.json"
            cmd = [str(Path(sys.executable).with_name("omnireduce-run")), "--nproc", str(args.hook_nproc),
                   str(root / "examples" / "train_recsys.py"), "--device", "cuda", "--hook", hook,
                   "--steps", str(args.hook_steps), "--summary-json", str(summary)]
            subprocess.run(cmd, check=True)
            s = json.loads(summary.read_text())
        rows.append({k: s[k] for k in ("hook", "median_step_s", "mb_sent_per_step", "dense_mb_per_step",
                                       "final_loss")})
        print(f"  {hook:>11}: median step {s['median_step_s'] * 1e3:8.1f} ms, {s['mb_sent_per_step']:8.2f} MB "
              f"sent per step per rank, final loss {s['final_loss']:.4f}")
    return rows


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device (torch.cuda.is_available() is False, torch "
                 f"{torch.__version__}, CUDA build {torch.version.cuda}); this benchmark needs a GPU")
    os.environ.setdefault("OMNIREDUCE_CUDA_KERNELS", "require")  # a failed build is an error, not a fallback
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from omnireduce.cuda import ops as ck

    dtype, B = DTYPES[args.dtype], args.block_size
    es = torch.empty(0, dtype=dtype).element_size()
    sizes = [float(v) for v in args.sizes_mb.split(",")]
    densities = [float(v) for v in args.densities.split(",")]
    for size in sizes:
        numel = int(size * MB) // es
        if numel < B or numel % B:
            sys.exit(f"bench_gpu.py: {size} MiB of {args.dtype} is not a whole number of blocks of {B}")
    backend = ck.backend(torch.zeros(1, device="cuda"))  # builds the extension now, outside the timings
    if backend != "cuda-kernels":
        sys.exit(f"bench_gpu.py: the CUDA kernels are not in use (backend {backend}, "
                 f"OMNIREDUCE_CUDA_KERNELS={os.environ.get('OMNIREDUCE_CUDA_KERNELS')})")

    timer = Timer(args.repeats, args.warmup, args.flush_l2)
    copy_gbps = copy_bandwidth(timer)
    device = torch.cuda.get_device_name()
    print(f"{device}: device-to-device copy {copy_gbps:.0f} GB/s (read + write); {args.dtype}, blocks of {B}, "
          f"scale {args.scale}, median of {args.repeats}, L2 {'flushed' if args.flush_l2 else 'warm'}")
    ops = torch_ops(ck, B)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    header = (f"{'MiB':>6} {'density':>8} {'k':>9} {'op':>8} {'kern ms':>9} {'torch ms':>9} {'speedup':>8} "
              f"{'kern GB/s':>10} {'%copy':>6} {'torch GB/s':>11} {'%copy':>6}")
    print(header)
    print("-" * len(header))
    for size in sizes:
        numel = int(size * MB) // es
        for density in densities:
            x = make_bucket(numel, B, density, dtype, gen)
            check_agree(ck, ops, x, B, args.scale)
            for row in bench_bucket(ck, ops, timer, x, B, args.scale):
                row.update(size_mb=size, density=density, kernels_frac_copy=row["kernels_gbps"] / copy_gbps,
                           torch_frac_copy=row["torch_gbps"] / copy_gbps)
                rows.append(row)
                print(f"{size:>6g} {density:>8g} {row['k']:>9} {row['op']:>8} {row['kernels_ms']:>9.3f} "
                      f"{row['torch_ms']:>9.3f} {row['speedup']:>7.1f}x {row['kernels_gbps']:>10.0f} "
                      f"{100 * row['kernels_frac_copy']:>5.0f}% {row['torch_gbps']:>11.0f} "
                      f"{100 * row['torch_frac_copy']:>5.0f}%")
            del x
            torch.cuda.empty_cache()

    hook_rows = bench_hook(args) if args.hook_steps else []

    out = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
           "dtype": args.dtype, "block_size": B, "scale": args.scale, "repeats": args.repeats,
           "warmup": args.warmup, "flush_l2": args.flush_l2, "copy_gbps": copy_gbps, "rows": rows,
           "hook": hook_rows}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
