#!/usr/bin/env python3
"""Where ``ops.compact`` spends its time: a breakdown for the next round of kernel work.

    python scripts/gpu_profile_compact.py --sizes-mb 4,100 --densities 0.01,1 --json out.json

Design. ``compact`` runs a flags pass, CUB's flagged selection, a copy of the count to the host, a
stream synchronisation and a gather of the ``k`` non-zero blocks. On an H200 it took 0.07-0.15 ms
for 100 MiB whatever the density, against 0.035-0.048 ms for the flags pass alone, so most of its
time is not spent reading the tensor. This script puts numbers on each part instead of guessing:

* ``wall``: the host's time per call (``compact`` returns once ``k`` is known and the gather is
  queued, so this is what a caller waits), median over ``--repeats`` calls; and the same for
  ``block_flags`` followed by a stream synchronisation, the least any compaction must cost;
* per device activity (the flags kernel, CUB's kernels, the gather kernel, the device-to-host copy
  of the count), its device time per call, from ``torch.profiler`` over ``--repeats`` calls;
* per CUDA runtime call made on the host (kernel launches, ``cudaMemcpyAsync``,
  ``cudaStreamSynchronize``), its host time and count per call.

The difference between ``wall`` and the sum of device times is time the device sat idle waiting
for the host (launch latency, the round trip of the count). Runs on CPU too (the torch-ops
fallback; no device activity), which is how it is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from omnireduce.cuda import build, ops

MB = 1 << 20
# Device activities by what part of compact they are (first match wins; lower-case substrings).
DEVICE_PARTS = [("flags kernel", ("flags_kernel", "flags_flat_kernel")), ("gather kernel", ("gather_kernel",)),
                ("cub select", ("cub", "deviceselect", "select", "scan")),
                ("count to host", ("memcpy dtoh", "memcpy device -> host", "memcpydtoh")),
                ("other device", ("",))]
RUNTIME_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaPeekAtLastError", "cudaGetLastError", "cudaMalloc", "cudaFree")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="4,100")
    p.add_argument("--densities", default="0.01,1")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=Path("results/gpu_profile_compact.json"))
    return p.parse_args()


def bucket(numel: int, B: int, density: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random values in a random ``density`` of the blocks, zeros elsewhere."""
    g = torch.Generator().manual_seed(numel + int(density * 1000))
    nb = -(-numel // B)
    keep = torch.rand(nb, generator=g) < density
    x = torch.randn(nb * B, generator=g).reshape(nb, B) * keep[:, None]
    return x.reshape(-1)[:numel].to(dtype).to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall_ms(fn: Any, repeats: int, device: str) -> float:
    """Median host time per call of ``fn`` (the device idle before each call)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def _device_us(evt: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def breakdown(fn: Any, repeats: int, device: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Device time per call of each part (us), and host time and count per call of each runtime call."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        _sync(device)
    parts: dict[str, float] = defaultdict(float)
    runtime: dict[str, dict[str, float]] = {}
    for evt in prof.key_averages():
        name = evt.key
        dev = _device_us(evt)
        if name in RUNTIME_CALLS:
            runtime[name] = {"host_us_per_call": evt.cpu_time_total / repeats, "count_per_call": evt.count / repeats}
        elif dev > 0 and evt.device_type != torch.autograd.DeviceType.CPU:
            low = name.lower()
            part = next(p for p, keys in DEVICE_PARTS if any(k in low for k in keys))
            parts[part] += dev / repeats
    return dict(parts), runtime


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda"):
        backend = build.prepare(args.device)
        if backend != "cuda-kernels":
            raise SystemExit(f"the CUDA kernels are not available on {args.device}: {backend}")
    B = args.block_size
    rows = []
    for size in (float(s) for s in args.sizes_mb.split(",")):
        numel = int(size * MB) // dtype.itemsize
        for density in (float(d) for d in args.densities.split(",")):
            x = bucket(numel, B, density, dtype, args.device)
            for _ in range(5):  # warm-up: the allocator's blocks, CUB's kernels loaded
                ops.compact(x, B)

            def flags_then_sync(x: torch.Tensor = x) -> None:
                ops.block_flags(x, B)
                _sync(args.device)

            row: dict[str, Any] = {"size_mb": size, "density": density, "dtype": args.dtype, "numel": numel,
                                   "k": int(ops.compact(x, B)[0].numel()),
                                   "compact_wall_ms": wall_ms(lambda x=x: ops.compact(x, B), args.repeats,
                                                              args.device),
                                   "flags_sync_wall_ms": wall_ms(flags_then_sync, args.repeats, args.device)}
            row["device_us"], row["runtime"] = breakdown(lambda x=x: ops.compact(x, B), args.repeats,
                                                         args.device)
            row["device_busy_us"] = sum(row["device_us"].values())
            row["device_idle_us"] = row["compact_wall_ms"] * 1e3 - row["device_busy_us"]
            rows.append(row)
            del x
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    out = {"device": device_name, "torch": torch.__version__, "block_size": B, "repeats": args.repeats, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    lines = [f"compact on {device_name}, {args.dtype}, blocks of {B}, median of {args.repeats} (us per call)",
             f"{'MiB':>5} {'density':>7} {'wall':>7} {'flags+sync':>10} {'busy':>6} {'idle':>6}  device parts; "
             "runtime calls (host us x count)"]
    for r in rows:
        dev = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["device_us"].items(), key=lambda kv: -kv[1]))
        rt = ", ".join(f"{k} {v['host_us_per_call']:.1f}x{v['count_per_call']:.0f}" for k, v in r["runtime"].items())
        lines.append(f"{r['size_mb']:>5g} {r['density']:>7g} {r['compact_wall_ms'] * 1e3:>7.1f} "
                     f"{r['flags_sync_wall_ms'] * 1e3:>10.1f} {r['device_busy_us']:>6.1f} {r['device_idle_us']:>6.1f}  "
                     f"{dev or '-'}; {rt or '-'}")
    logging.info("\n".join(lines))
    best = rows[-1] if rows else None
    if best is not None:
        print(f"RESULT: {best['size_mb']:g} MiB d={best['density']:g}: compact {best['compact_wall_ms'] * 1e3:.0f} us "
              f"wall, device busy {best['device_busy_us']:.0f} us; "
              f"flags+sync {best['flags_sync_wall_ms'] * 1e3:.0f} us")


if __name__ == "__main__":
    main()
