"""The rank side of ``gpu_nccl_check.py engine`` and ``bench_engine.py``: the collective engine's fixed
cost per bucket, in latency units of its own process group.

Design. Every rank makes, per bucket size and density, a tensor whose blocks are non-zero at that
density (``one``: a single block, the same on every rank; otherwise independently per rank, seeded
by rank), then times in the same process group and run, ``repeats`` times after ``warmup`` untimed
ones, on fresh copies of it, taking turns repeat by repeat (on a shared machine what drifts drifts
for all of them alike):

* ``unit``: ``dist.all_reduce`` of one element: the latency unit of the group;
* ``dense``: ``dist.all_reduce`` of the whole bucket (what the user would otherwise run);
* ``engine[:exchange]``: ``CollectiveEngine.allreduce_async(x).wait()``, once per exchange asked for
  (``exchanges``; ``default``: the engine as constructed, for an engine that has no choice; a name
  ending ``+kernels``, e.g. ``auto+kernels``, runs that exchange through the kernel exchange,
  ``OMNIREDUCE_ENGINE_KERNELS=1``, and every other name with it off, so both ways are timed in one run).

Before each timed reduction every rank synchronises its device and meets the others, so a time is
one rank's from the start to the result in memory; a row's time is the median over the repeats of
the slowest rank's. Per engine row also: the process's CPU seconds per reduction (every thread:
the engine's, the backend's, the caller's), the engine's own counts where it keeps them (host
seconds on its thread, host waits for the device, collectives issued per reduction), and on CUDA,
from a torch.profiler trace of a few more reductions, the kernel launches and the blocking
synchronisations per reduction. The engine's sums must equal the dense all-reduce's (float32:
relative 1e-5; half types: 1e-2 of the largest value), or the row says it does not. The inputs and
the turns are omnireduce-bench's (:mod:`omnireduce.bench.inputs`, :mod:`omnireduce.bench.timing`).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.bench.inputs import one_block, sparse
from omnireduce.bench.timing import Run, interleaved

ONE = 0.0  # the density that stands for "one non-zero block, the same on every rank"
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
            "cudaMemsetAsync")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def bucket(rank: int, numel: int, block: int, density: float, dtype: torch.dtype, dev: torch.device,
           seed: int = 0) -> torch.Tensor:
    """``numel`` values in blocks of ``block``: one block, the same on every rank (``density == ONE``), or
    blocks non-zero at ``density``, independently per rank (omnireduce-bench's inputs)."""
    if density == ONE:
        return one_block(numel, rank=rank, block=block, dtype=dtype, device=dev, seed=seed)
    return sparse(numel, density, rank=rank, block=block, dtype=dtype, device=dev, seed=seed)


def _agree(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    a, b = got.double().cpu(), want.double().cpu()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 1.0
    if got.dtype == torch.float32:
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(scale, 1.0))), err
    return err <= 1e-2 * max(scale, 1e-12), err


def _profile_counts(ctx: Any, run: Callable[[torch.Tensor], Any], x: torch.Tensor, work: torch.Tensor,
                    n: int) -> dict[str, float]:
    """CUDA: kernel launches and blocking synchronisations per reduction, on every thread, from a
    torch.profiler trace of ``n`` reductions (each preceded by its copy of ``x``: one launch taken off)."""
    from gpu_nccl_profile import _profiler

    prof, all_threads = _profiler(ctx.device)  # (every thread's calls, the engine's too, where torch can)
    with prof:
        for _ in range(n):
            work.copy_(x)
            run(work)
            ctx.sync()
    names = [e.name for e in prof.events()]
    launches = sum(names.count(k) for k in LAUNCHES) - n  # (the copies of x)
    syncs = sum(names.count(k) for k in SYNCS) - n  # (ctx.sync after each)
    return {"launches": launches / n, "syncs": syncs / n, "threads_profiled": all_threads}


def case_engine(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    from ombench.rankside import internals

    inside = internals()
    block = int(args.get("block", 256))
    warmup, repeats = int(args.get("warmup", 2)), int(args.get("repeats", 7))
    dtype = getattr(torch, args.get("dtype", "float32"))
    exchanges = list(args.get("exchanges", ["default"]))
    engines = {}
    for name in exchanges:
        base = name.removesuffix("+kernels")
        kw = {} if base == "default" else {"exchange": base}
        engines[name] = inside.CollectiveEngine.for_group(dist.group.WORLD, ctx.timeout, block, inside.lanes,
                                                          inside.slots, **kw)
    unit_x = torch.ones(1, device=ctx.device)
    units: list[float] = []
    rows = []
    try:
        for numel in args.get("sizes", [1 << 16, 1 << 20]):
            for density in args.get("densities", [ONE, 0.001, 0.01, 0.1, 1.0]):
                x = bucket(ctx.rank, numel, block, density, dtype, ctx.device)
                runs = {"unit": Run(dist.all_reduce, unit_x), "dense": Run(dist.all_reduce, x)}
                for name, engine in engines.items():
                    def run(t: torch.Tensor, engine: Any = engine) -> None:
                        engine.allreduce_async(t).wait()

                    def kernels(on: bool = name.endswith("+kernels")) -> None:
                        os.environ["OMNIREDUCE_ENGINE_KERNELS"] = "1" if on else "0"

                    runs[name] = Run(run, x, prepare=kernels)
                before = {name: dict(engine.stats()) for name, engine in engines.items()}
                took = {k: (t, runs[k].cpu_median) for k, t in interleaved(runs, warmup, repeats, ctx.device).items()}
                (unit_s, _), (dense_s, dense_cpu) = took["unit"], took["dense"]
                units.append(unit_s)
                want = runs["dense"].work
                for name, engine in engines.items():
                    engine_s, engine_cpu = took[name]
                    after = engine.stats()
                    runs_done = warmup + repeats
                    ok, err = _agree(runs[name].work, want)
                    row = {"elements": numel, "density": density, "exchange": name, "dtype": str(dtype)[6:],
                           "engine_ms": engine_s * 1e3, "dense_ms": dense_s * 1e3, "unit_ms": unit_s * 1e3,
                           "units": engine_s / unit_s, "vs_dense": engine_s / dense_s,
                           "process_cpu_ms": engine_cpu * 1e3, "dense_cpu_ms": dense_cpu * 1e3,
                           "agree": ok, "max_err": err}
                    for key in ("host_s", "host_wait_s", "host_waits", "collectives", "bytes_sent",
                                "kernel_reductions", "inline"):
                        if key in after:
                            row[f"{key}_per_reduction"] = (after[key] - before[name].get(key, 0)) / runs_done
                    for key in ("exchanges",):
                        if key in after:
                            row[key] = {k: v - before[name].get(key, {}).get(k, 0) for k, v in after[key].items()}
                    if ctx.device.type == "cuda" and numel <= int(args.get("profile_max", 1 << 20)):
                        r = runs[name]
                        r.prepare()
                        row.update(_profile_counts(ctx, r.run, x, r.work, 3))
                    rows.append(row)
                    if ctx.rank == 0:  # (what a job cut off at its deadline still reports: bench_engine.salvage)
                        print("ROW " + json.dumps(row), flush=True)
                del x, runs, want
    finally:  # (each engine's thread joined and its group let go before the job tears the groups down)
        os.environ.pop("OMNIREDUCE_ENGINE_KERNELS", None)
        for engine in engines.values():
            engine.release()
    unit_s = statistics.median(units) if units else float("nan")
    return {"block": block, "unit_ms": unit_s * 1e3, "rows": rows}
