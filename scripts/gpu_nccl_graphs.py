"""``gpu_nccl_check.py graphs``: the collective engine with and without CUDA graphs, in one job per world.

    python scripts/gpu_nccl_check.py graphs --worlds 1,2,4 --json nccl_graphs.json        # on a GPU (NCCL)
    python scripts/gpu_nccl_check.py graphs --backend gloo --device cpu --worlds 1,2      # the code path, no GPU

Per world size, every rank runs two engines through the kernel exchange (``OMNIREDUCE_ENGINE_KERNELS=1``),
each on a process group of its own: one made with ``OMNIREDUCE_CUDA_GRAPHS=1``, one without. Per bucket
(``--graph-buckets``, default 64K elements with one block, 1M and 4M at 1%, 25 MiB at 0.1% and 1%) both
engines reduce the same inputs, each into a buffer of its own that stays put (a DDP bucket's):

1. ``warmup`` reductions (the graphed engine's second fused one is captured, its third replays), then
   ``repeats`` timed ones, the engines taking turns; every result must be the other engine's bytes;
2. one input with more blocks than the capacity the steady state set (a replay that overflows: the
   graphed engine must finish it uncaptured, ``graph_fallbacks``), then the steady input again: the
   same bytes again;
3. the sums against the group's dense all-reduce (float32: relative 1e-5).

Per bucket and engine it reports the host time per reduction: the process's CPU from the call to the
future's completion (every thread: the engine's and the caller's), the engine thread's own
(``host_s``) and the part of it spent waiting for the counts (``host_wait_s``: on CUDA the thread
polls), the wall time to the result on the device, and on CUDA the launches and blocking
synchronisations per reduction from a torch.profiler trace (``cudaGraphLaunch`` counts one). Exact
results and replays are judged; times are reported against the targets (W=1: 300 us a bucket
uncaptured, 100 us with graphs), never judged.

Without a GPU (``--device cpu``) the graphed engine's graphs are the CPU stand-in of
tests/graph_double.py and both engines' kernels the host build of the CUDA kernels' steps
(tests/exchange_host.py): the launcher, the sequence, the checks and the report run for real;
the times say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

ONE = 0.0  # the density of "one non-zero block, the same on every rank" (engine_cost.ONE)
BUCKETS = "65536:one,1048576:0.01,4194304:0.01,6553600:0.001,6553600:0.01"
TARGET_US = {"uncaptured": 300.0, "graphs": 100.0}
"""W=1 host time per bucket the work aims at: without graphs, and with them."""
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
WAYS = ("uncaptured", "graphs")


def parse_buckets(text: str) -> list[tuple[int, float]]:
    """``elements:density,...`` (density ``one``: a single block) as (elements, density) pairs."""
    out = []
    for item in text.split(","):
        if item:
            n, d = item.split(":")
            out.append((int(float(n)), ONE if d == "one" else float(d)))
    return out


def over_density(density: float) -> float:
    """The density of the input that overflows the steady state's capacity (four times more blocks,
    at least 5%)."""
    return max(0.05, 4 * density)


# --- the rank side --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _engines(ctx: Any, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The two engines (``uncaptured``, ``graphs``): on the host the graphs the CPU stand-in's and the
    kernels the host build's."""
    from ombench.rankside import internals

    inside = internals()
    stack = contextlib.ExitStack()
    if ctx.device.type == "cpu":
        from tests.graph_double import host_kernels

        stack.enter_context(host_kernels())
    engines: dict[str, Any] = {}
    try:
        with stack:
            for way in WAYS:
                os.environ["OMNIREDUCE_CUDA_GRAPHS"] = "1" if way == "graphs" else "0"
                engines[way] = inside.CollectiveEngine.for_group(dist.group.WORLD, ctx.timeout, 256, inside.lanes,
                                                                 inside.slots)
            os.environ.pop("OMNIREDUCE_CUDA_GRAPHS", None)
            if ctx.device.type == "cpu":
                from tests.graph_double import install

                install(engines["graphs"])
            yield engines
    finally:
        os.environ.pop("OMNIREDUCE_CUDA_GRAPHS", None)
        for engine in engines.values():
            engine.release()


def _reduce(ctx: Any, engine: Any, work: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """One timed reduction of a fresh copy of ``x``: the process's CPU seconds until its future completes,
    and the wall seconds until its result is on the device."""
    work.copy_(x)
    ctx.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    engine.allreduce_async(work).wait()
    cpu = time.process_time() - c0
    ctx.sync()
    return cpu, time.perf_counter() - t0


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)))


def _launches(ctx: Any, engine: Any, work: torch.Tensor, x: torch.Tensor, n: int = 3) -> dict[str, float]:
    """CUDA: kernel and graph launches and blocking synchronisations per reduction, every thread, from a
    torch.profiler trace of ``n`` reductions (each after its copy of ``x``: one launch taken off)."""
    from engine_cost import LAUNCHES, SYNCS
    from gpu_nccl_profile import _profiler

    prof, all_threads = _profiler(ctx.device)
    with prof:
        for _ in range(n):
            work.copy_(x)
            engine.allreduce_async(work).wait()
            ctx.sync()
    names = [e.name for e in prof.events()]
    launches = sum(names.count(k) for k in LAUNCHES + GRAPH_LAUNCHES) - n
    return {"launches": launches / n, "graph_launches": sum(names.count(k) for k in GRAPH_LAUNCHES) / n,
            "syncs": (sum(names.count(k) for k in SYNCS) - n) / n, "threads_profiled": all_threads}


def _bucket_row(ctx: Any, engines: dict[str, Any], numel: int, density: float, warmup: int,
                repeats: int) -> dict[str, Any]:
    """One bucket through both engines (see the module): equality, counters and times."""
    from engine_cost import _agree, bucket

    x = bucket(ctx.rank, numel, 256, density, torch.float32, ctx.device)
    over = bucket(ctx.rank, numel, 256, over_density(density), torch.float32, ctx.device, seed=1)
    work = {w: torch.empty_like(x) for w in WAYS}
    snap = [{w: dict(e.stats()) for w, e in engines.items()}]
    same, times = [], {w: [] for w in WAYS}
    for i in range(warmup + repeats):
        for w in WAYS:
            took = _reduce(ctx, engines[w], work[w], x)
            if i >= warmup:
                times[w].append(took)
        same.append(_same(work["graphs"], work["uncaptured"]))
    snap.append({w: dict(e.stats()) for w, e in engines.items()})
    dense = x.clone()
    dist.all_reduce(dense)
    agree, err = _agree(work["uncaptured"], dense)
    # (in the steady state, before the overflow changes the capacity: a trace of replays, no capture)
    launches = {w: _launches(ctx, e, work[w], x) for w, e in engines.items()} if ctx.device.type == "cuda" else {}
    same += [_same(work["graphs"], work["uncaptured"])]
    snap.append({w: dict(e.stats()) for w, e in engines.items()})
    after_over = []
    for y in (over, x):
        for w in WAYS:
            _reduce(ctx, engines[w], work[w], y)
        after_over.append(_same(work["graphs"], work["uncaptured"]))
    snap.append({w: dict(e.stats()) for w, e in engines.items()})
    row: dict[str, Any] = {"elements": numel, "density": density, "over_density": over_density(density),
                           "equal_steady": all(same), "equal_overflow": after_over[0], "equal_after": after_over[1],
                           "agree": agree, "max_err": err, "warmup": warmup, "repeats": repeats}
    for w in WAYS:
        row[w] = _way(snap, w, warmup + repeats, times[w])
        row[w].update(launches.get(w, {}))
    return row


def _way(snap: list[dict[str, dict[str, Any]]], w: str, steady_n: int, times: list[tuple[float, float]]
         ) -> dict[str, Any]:
    """One engine's part of a row from its stats before the steady state, after it, after the trace and
    after the overflow (``snap``), and its timed reductions."""
    s0, s1, s2, s3 = (s[w] for s in snap)
    return {"cpu_us": statistics.median(c for c, _ in times) * 1e6,
            "wall_us": statistics.median(t for _, t in times) * 1e6,
            "host_us": (s1["host_s"] - s0["host_s"]) / steady_n * 1e6,
            "host_wait_us": (s1["host_wait_s"] - s0["host_wait_s"]) / steady_n * 1e6,
            "collectives": (s1["collectives"] - s0["collectives"]) / steady_n,
            "fused": s1["fused"] - s0["fused"], "whole": s1["exchanges"]["whole"] - s0["exchanges"]["whole"],
            "overflows": s3["overflows"] - s2["overflows"],
            **{k: s3[k] - s0[k] for k in ("graph_captures", "graph_replays", "graph_fallbacks", "graph_failures",
                                           "kernel_reductions")},
            "steady_replays": s1["graph_replays"] - s0["graph_replays"],
            "overflow_fallbacks": s3["graph_fallbacks"] - s2["graph_fallbacks"]}


def case_graphs(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The rank side (see the module): one row per bucket, printed as it comes (``ROW {json}``)."""
    import json

    os.environ["OMNIREDUCE_ENGINE_KERNELS"] = "1"
    rows = []
    try:
        with _engines(ctx, args) as engines:
            for numel, density in args.get("buckets", parse_buckets(BUCKETS)):
                row = _bucket_row(ctx, engines, int(numel), float(density), int(args.get("warmup", 3)),
                                  int(args.get("repeats", 10)))
                rows.append(row)
                if ctx.rank == 0:  # (what a job cut off at its deadline still reports)
                    print("ROW " + json.dumps(row), flush=True)
    finally:
        os.environ.pop("OMNIREDUCE_ENGINE_KERNELS", None)
    return {"rows": rows}


# --- the parent side ---------------------------------------------------------------------------------


def name(row: dict[str, Any]) -> str:
    n, d = row["elements"], row["density"]
    size = f"{n * 4 / 2**20:.3g} MiB" if n * 4 >= 1 << 20 else f"{n / 1024:.3g}K elements"
    return f"{size} {'one block' if d == ONE else f'{d:.3g}'}"


def problems_of(rows: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the rows: results that differ, sums off the dense all-reduce's, graphs that
    never replayed, an overflow that was not finished uncaptured."""
    out = []
    for r in rows:
        where = f"W={r['world']} {name(r)}"
        g = r["graphs"]
        for key, what in (("equal_steady", "the steady state"), ("equal_overflow", "the overflow"),
                          ("equal_after", "after the overflow")):
            if not r[key]:
                out.append(f"{where}: with graphs the bits differ from the uncaptured engine's in {what}")
        if not r["agree"]:
            out.append(f"{where}: the sums differ from the dense all-reduce's ({r['max_err']:.3g})")
        if g["graph_failures"]:
            out.append(f"{where}: {g['graph_failures']} capture(s) failed (the rank's log says why)")
        elif not r["uncaptured"]["fused"]:
            continue  # (no fused reduction to capture: taken whole, say, as a small bucket at W > 1 is)
        elif not g["steady_replays"]:
            out.append(f"{where}: no reduction of the steady state replayed a graph")
        elif g["overflow_fallbacks"] != 1 or g["overflows"] != r["uncaptured"]["overflows"]:
            out.append(f"{where}: the overflow: {g['overflow_fallbacks']} fallback(s), overflows "
                       f"{g['overflows']} with graphs against {r['uncaptured']['overflows']}")
    return out


def table_lines(rows: list[dict[str, Any]], label: str) -> list[str]:
    """The rows as the Markdown table of the docs' page: host and wall time per reduction, both ways."""
    out = ["| W | bucket | uncaptured: CPU us | engine thread us (waiting) | launches | graphs: CPU us | "
           "engine thread us (waiting) | launches | wall us, uncaptured / graphs | same bits |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def cells(w: dict[str, Any]) -> str:
        launches = "-" if w.get("launches") is None else f"{w['launches']:.0f}"
        return f"{w['cpu_us']:.0f} | {w['host_us']:.0f} ({w['host_wait_us']:.0f}) | {launches}"

    for r in rows:
        same = "yes" if r["equal_steady"] and r["equal_overflow"] and r["equal_after"] else "NO"
        whole = " (taken whole: no graph)" if not r["uncaptured"]["fused"] and r["uncaptured"]["whole"] else ""
        out.append(f"| {r['world']} | {name(r)}{whole} | {cells(r['uncaptured'])} | {cells(r['graphs'])} | "
                   f"{r['uncaptured']['wall_us']:.0f} / {r['graphs']['wall_us']:.0f} | {same} |")
    return [*out, "", f"Medians per reduction over the timed repeats (the engine thread's: over every reduction "
                      f"of the steady state); {label}."]


def targets_line(rows: list[dict[str, Any]]) -> str:
    """W=1's host time per bucket (the engine thread's, less its wait for the counts, and the process's
    CPU) against the targets; reported, never judged."""
    one = [r for r in rows if r["world"] == 1]
    if not one:
        return "no W=1 rows"
    parts = []
    for w in WAYS:
        work = [r[w]["host_us"] - r[w]["host_wait_us"] for r in one]
        cpu = [r[w]["cpu_us"] for r in one]
        met = "met" if max(cpu) <= TARGET_US[w] else "not met"
        parts.append(f"{w} {min(cpu):.0f}-{max(cpu):.0f} us CPU a bucket (engine thread less waiting "
                     f"{min(work):.0f}-{max(work):.0f}; target {TARGET_US[w]:.0f}: {met})")
    return "W=1: " + "; ".join(parts)


def cmd_graphs(args: Any, run_case: Any) -> tuple[bool, str, dict[str, Any]]:
    """The parent side: one job per world size; rank 0's rows, a table, a verdict (exactness and
    replays; times reported)."""
    from bench_engine import salvage

    from ombench.rankside import label_for

    extra = {"buckets": parse_buckets(args.graph_buckets), "warmup": args.warmup, "repeats": args.repeats}
    rows, problems = [], []
    for world in args.worlds:
        ranks, results, _ = run_case("graphs", args, world, extra)
        if results[0] is None or any(r["rc"] != 0 for r in ranks):
            problems.append(f"W={world}: exit status {[r['rc'] for r in ranks]}")
            rows += [dict(r, world=world, salvaged=True) for r in salvage(ranks[0]["output"])]
            continue
        rows += [dict(r, world=world) for r in results[0]["rows"]]
    problems += problems_of(rows)
    label = label_for(args.backend, args.device)
    if args.device == "cpu":
        label += "; graphs: the CPU stand-in of tests/graph_double.py"
    print("\n".join(table_lines(rows, label)))
    line = targets_line(rows)
    print(line)
    res = {"rows": rows, "problems": problems, "label": label, "targets_us": TARGET_US, "targets": line}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    worlds = ",".join(map(str, args.worlds))
    return True, (f"with CUDA graphs the engine's bits equal the uncaptured engine's at W={worlds} over "
                  f"{len(rows) // max(len(args.worlds), 1)} buckets, the overflow finished uncaptured; {line}"), res
