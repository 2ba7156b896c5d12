#!/usr/bin/env python3
"""GPU check, part 1: build or load omnireduce's CUDA kernels in this process, timed, and try them once.

    python scripts/gpu_prepare.py --expect built  --json build.json   # first process: the cold build
    python scripts/gpu_prepare.py --expect loaded --json load.json    # a second one: from the cache

Design. One call of :func:`omnireduce.cuda.build.prepare` on CUDA, timed with the wall clock,
with ``OMNIREDUCE_CUDA_KERNELS=require`` (a failed build is an error here, not the torch-ops
fallback). :func:`~omnireduce.cuda.build.describe` is read first, which says without building
whether the cache (``OMNIREDUCE_CUDA_BUILD_DIR``) already holds this build: ``--expect loaded``
fails if it did not (a second process must not rebuild); ``--expect built`` only notes it (a
reused cache makes no cold build to time). Then the three block operations run once on a random
bucket and are compared with the torch-ops fallback, so a build that loads but computes nonsense
does not pass. Prints a ``RESULT:`` line for the summary and writes the numbers as JSON. Exit
status 77 (skipped) without a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from gpu_common import require_cuda


def try_kernels(ck: object, n: int = (1 << 20) + 37, B: int = 256) -> list[str]:
    """The kernels against the torch-ops fallback on a random, mostly zero bucket: what differs."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n, device="cuda", generator=gen)
    x[torch.rand(n, device="cuda", generator=gen) < 0.999] = 0.0
    problems = []
    flat = x.view(-1)
    if not torch.equal(ck.block_flags(x, B), ck._flags_torch(flat, B, 0.0)):
        problems.append("block_flags")
    idx, blocks = ck.compact(x, B)
    ref_idx, ref_blocks = ck._compact_torch(flat, B, 0.0)
    if not (torch.equal(idx, ref_idx) and torch.equal(blocks, ref_blocks)):
        problems.append("compact")
    y, ref = torch.zeros_like(x), torch.zeros_like(x)
    ck.scatter(y, idx, blocks, 0.5)
    ck._scatter_torch(ref, ref_idx, ref_blocks, 0.5)
    if not torch.equal(y, ref):
        problems.append("scatter")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--expect", choices=["built", "loaded"], required=True)
    ap.add_argument("--json", required=True, help="where to write the numbers")
    args = ap.parse_args()
    require_cuda("building the CUDA kernels")
    os.environ["OMNIREDUCE_CUDA_KERNELS"] = "require"
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from omnireduce.cuda import build
    from omnireduce.cuda import ops as ck

    before = build.describe()
    cached = "built, in" in before
    print(f"before: {before}", flush=True)
    t0 = time.perf_counter()
    backend = build.prepare("cuda")
    seconds = time.perf_counter() - t0
    print(f"prepare('cuda') -> {backend} in {seconds:.2f} s; after: {build.describe()}", flush=True)
    problems = try_kernels(ck) if backend == "cuda-kernels" else ["not built"]
    out = {"expect": args.expect, "backend": backend, "seconds": seconds, "cached_before": cached,
           "describe_before": before, "cache": os.environ.get("OMNIREDUCE_CUDA_BUILD_DIR"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "kernels_differ_from_torch_ops": problems}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    how = "loaded from the cache" if cached else "built"
    if problems:
        sys.exit(f"RESULT: {how} in {seconds:.1f} s, but the kernels differ from torch ops: {', '.join(problems)}")
    if args.expect == "loaded" and not cached:
        sys.exit(f"RESULT: a second process rebuilt the kernels ({seconds:.1f} s) instead of loading the cached build")
    note = " (the cache already held this build: not a cold build)" if args.expect == "built" and cached else ""
    print(f"RESULT: cuda-kernels {how} in {seconds:.2f} s{note}; flags, compact, scatter equal torch ops")


if __name__ == "__main__":
    main()
