"""The rank side of ``gpu_nccl_check.py bench``: the collective engine against ``dist.all_reduce``.

Design. Every rank makes, per dtype and density, a 100 MiB tensor (``--size-mib``) whose blocks of
``block`` elements are non-zero with probability ``density``, independently per rank (seeded by
rank), then times, in the same process group and run, ``repeats`` reductions of a fresh copy of it
by each method after ``warmup`` untimed ones:

* ``engine``: ``CollectiveEngine.allreduce_async(x).wait()`` on an engine of its own group
  (omnireduce's default lanes and slots), then a device synchronisation;
* ``all_reduce``: ``dist.all_reduce(x)`` on the default group, then a device synchronisation.

Before each timed reduction every rank synchronises its device and meets the others (a one-element
all-reduce), so a reduction's time is one rank's host time from the start to the result in device
memory; the row's time is the median over the repeats of the slowest rank's. Bytes: the engine's
``bytes_sent`` per rank and reduction (its counters), against what a ring all-reduce sends per rank,
``2 (W-1)/W N``. The engine's result must equal ``all_reduce``'s (float32: rtol 1e-5; bfloat16: within
1e-2 of the largest value: NCCL sums in bfloat16, the engine in float32 rounded once).

Over NCCL on one GPU shared by every rank (each its own ``NCCL_HOSTID``), the bytes go through
NCCL's socket transport on loopback: an emulated network, not NVLink.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

LABEL = "emulated network: NCCL socket transport on loopback, not NVLink"
MIB = 1 << 20


def label_for(backend: str, device: str) -> str:
    """What the timings measure: :data:`LABEL` over NCCL; otherwise the backend and device (a test run)."""
    return LABEL if backend == "nccl" else f"{backend} on {device}, loopback (not the NCCL check)"


def sparse_input(rank: int, numel: int, block: int, density: float, dtype: torch.dtype, dev: torch.device,
                 seed: int = 0) -> torch.Tensor:
    """``numel`` values whose blocks are non-zero with probability ``density`` (independently per rank)."""
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + rank)
    nb = -(-numel // block)
    keep = torch.rand(nb, generator=g, device=dev) < density
    x = torch.randn(nb, block, generator=g, device=dev) * keep[:, None]
    return x.reshape(-1)[:numel].to(dtype).contiguous()


def _slowest(ctx: Any, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_method(ctx: Any, run: Callable[[torch.Tensor], Any], x: torch.Tensor, work: torch.Tensor, warmup: int,
                repeats: int) -> float:
    """Median seconds (slowest rank per repeat) of ``run(work)`` on fresh copies of ``x``."""
    times = []
    for i in range(warmup + repeats):
        work.copy_(x)
        ctx.barrier()
        t0 = time.perf_counter()
        run(work)
        ctx.sync()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(_slowest(ctx, dt))
    return statistics.median(times)


def _agree(a: torch.Tensor, b: torch.Tensor, dtype: str) -> tuple[bool, float]:
    a, b = a.double().cpu(), b.double().cpu()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 1.0
    if dtype == "float32":
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(scale, 1.0))), err
    return err <= 1e-2 * max(scale, 1e-12), err


def case_bench(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    from gpu_nccl_ranks import internals

    inside = internals()
    block, size = int(args.get("block", 256)), float(args.get("size_mib", 100))
    engine = inside.CollectiveEngine.for_group(dist.group.WORLD, ctx.timeout, block, inside.lanes, inside.slots)
    W, rows = ctx.world, []

    def run_engine(t: torch.Tensor) -> None:
        engine.allreduce_async(t).wait()

    try:
        for dtype_name in args.get("dtypes", ["float32", "bfloat16"]):
            dtype = getattr(torch, dtype_name)
            numel = int(size * MIB) // torch.tensor([], dtype=dtype).element_size()
            for density in args.get("densities", [0.001, 0.01, 0.1, 1.0]):
                x = sparse_input(ctx.rank, numel, block, density, dtype, ctx.device)
                work = torch.empty_like(x)
                sent0 = engine.stats()["bytes_sent"]
                engine_s = time_method(ctx, run_engine, x, work, args.get("warmup", 2), args.get("repeats", 7))
                runs = args.get("warmup", 2) + args.get("repeats", 7)
                per_reduction = (engine.stats()["bytes_sent"] - sent0) / runs
                mine = work.clone()
                ar_s = time_method(ctx, dist.all_reduce, x, work, args.get("warmup", 2), args.get("repeats", 7))
                ok, err = _agree(mine, work, dtype_name)
                rows.append({"dtype": dtype_name, "density": density, "elements": numel, "engine_ms": engine_s * 1e3,
                             "all_reduce_ms": ar_s * 1e3, "engine_bytes_sent": per_reduction,
                             "ring_bytes_sent": 2 * (W - 1) / W * x.numel() * x.element_size(),
                             "speedup": ar_s / engine_s if engine_s else float("nan"), "agree": ok, "max_err": err})
                del x, work, mine
    finally:
        engine.close()
    return {"size_mib": size, "block": block, "rows": rows}


def table(rows: list[dict[str, Any]], label: str) -> str:
    """The bench's rows as a table (``world`` added by the caller)."""
    lines = [f"{label}; median ms per all-reduce of the slowest rank, MB sent per rank",
             f"{'W':>2} {'dtype':<9} {'density':>7} {'engine ms':>10} {'all_reduce ms':>13} {'engine MB':>10} "
             f"{'ring MB':>8} {'speedup':>8}  agree"]
    for r in rows:
        agree = "yes" if r["agree"] else f"NO ({r['max_err']:.3g})"
        lines.append(f"{r['world']:>2} {r['dtype']:<9} {r['density']:>7g} {r['engine_ms']:>10.2f} "
                     f"{r['all_reduce_ms']:>13.2f} {r['engine_bytes_sent'] / MIB:>10.2f} "
                     f"{r['ring_bytes_sent'] / MIB:>8.2f} {r['speedup']:>7.2f}x  {agree}")
    return "\n".join(lines)


def cmd_bench(args: Any, run_case: Callable[..., Any]) -> tuple[bool, str, dict[str, Any]]:
    """The parent side: one job per world size, the rows of rank 0, a table and a verdict (the
    results must agree; the times are measured, never judged)."""
    extra = {"size_mib": args.size_mib, "densities": args.densities, "dtypes": args.dtypes,
             "repeats": args.repeats, "warmup": args.warmup}
    rows, problems = [], []
    for world in args.worlds:
        device_path = {"OMNIREDUCE_DEVICE_PATH": "1"} if args.device == "cpu" else {}  # (CPU: the device path)
        ranks, results, _ = run_case("bench", args, world, extra, env=device_path)
        if results[0] is None or any(r["rc"] != 0 for r in ranks):
            problems.append(f"W={world}: exit status {[r['rc'] for r in ranks]}")
            continue
        rows += [dict(r, world=world) for r in results[0]["rows"]]
    if rows:
        print(table(rows, label_for(args.backend, args.device)))
    problems += [f"W={r['world']} {r['dtype']} d={r['density']:g}: the engine's sums differ from all_reduce's "
                 f"({r['max_err']:.3g})" for r in rows if not r["agree"]]
    label = label_for(args.backend, args.device)
    res = {"label": label, "size_mib": args.size_mib, "rows": rows, "problems": problems}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    cells = [f"W={r['world']} {r['dtype']} d={r['density']:g} {r['speedup']:.2f}x" for r in rows]
    return True, f"engine vs all_reduce ({label}), {args.size_mib:g} MiB: " + ", ".join(cells), res
