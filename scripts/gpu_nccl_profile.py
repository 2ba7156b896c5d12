"""The rank side of ``gpu_nccl_check.py profile``: the collective engine's cost per bucket, by phase.

Design. One reduction of a dense tensor is, on the engine's thread
(:mod:`omnireduce.engines.exchange_device`): the block flags, the bitmap all-gather (with the first
blocks, where the shape fuses them), the host learning the counts (the one synchronisation), the
exchange's collectives (``blocks``: the union's all-reduce, the rest of a gather, or the owners'
all-to-alls), the rank-order sums, and the scatter into the tensor. :func:`phases` wraps each of
these calls (and the whole reduction) in a ``torch.profiler.record_function`` named
``omnireduce.phase.<phase>``; the
profiler records every thread (``profile_all_threads``), so the engine's thread's spans are in the
trace, and :func:`phase_costs` reads the chrome trace: a phase's host time is its span's length,
its device time the kernels and copies launched on that thread inside the span (by the launch's
correlation id); ``other`` is what the reduction spent outside the named phases (packing the
bitmaps, compacting ids, gathering rows), and ``other_ops_us`` names the host ops it is made of
(:func:`other_ops`). The wrappers also time each phase's host span
themselves, which is what remains where a torch has no ``profile_all_threads`` (no device times).

Rank 0 writes the per-bucket costs: for each bucket size and density, the median per reduction of
each phase's host and device microseconds, and ``per_bucket_fixed_us`` from the smallest bucket: per
phase the larger of the two (the engine's thread waits for the device at the counts only, so a
phase costs a small bucket its launches or its kernels, whichever is longer). That file is what
``cost_model.py collective --measured FILE`` reads. The ranks share one GPU: NCCL's kernels'
device time includes waiting for the other ranks' kernels and for the loopback sockets.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ombench.rankside import label_for

PREFIX = "omnireduce.phase."
REDUCTION = "omnireduce.reduction"
PHASES = ("flags", "bitmap all-gather", "counts", "blocks", "sums", "scatter")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def phase_costs(events: list[dict[str, Any]]) -> list[dict[str, dict[str, float]]]:
    """Per reduction (``omnireduce.reduction`` span, in time order): each phase's ``host_us`` (its
    spans on the reduction's thread) and ``device_us`` (device activities whose launch on that thread
    falls inside the phase's spans), and ``other`` (the rest of the reduction's host span, and its
    launches outside every phase). Where no launch carries the reduction's thread id, the launches of
    any thread inside its span count (the check's main thread waits meanwhile)."""
    spans = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
             and str(e.get("name", "")).startswith((PREFIX, REDUCTION))]
    launches = [e for e in events if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})]
    device_us: dict[Any, float] = defaultdict(float)
    for e in events:
        if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {}):
            device_us[e["args"]["correlation"]] += float(e.get("dur", 0.0))
    out = []
    for red in sorted((s for s in spans if s["name"] == REDUCTION), key=lambda s: s["ts"]):
        lo, hi, tid = red["ts"], red["ts"] + red["dur"], red["tid"]
        inside = [s for s in spans if s["tid"] == tid and s["name"].startswith(PREFIX) and lo <= s["ts"] <= hi]
        mine = [e for e in launches if e["tid"] == tid and lo <= e["ts"] <= hi]
        if not mine:  # (a trace whose launches carry another thread id: any launch in the span)
            mine = [e for e in launches if lo <= e["ts"] <= hi]
        costs: dict[str, dict[str, float]] = {}
        claimed: set[int] = set()
        for s in inside:
            name = s["name"][len(PREFIX):]
            c = costs.setdefault(name, {"host_us": 0.0, "device_us": 0.0})
            c["host_us"] += float(s["dur"])
            for i, e in enumerate(mine):
                if s["ts"] <= e["ts"] <= s["ts"] + s["dur"] and i not in claimed:
                    claimed.add(i)
                    c["device_us"] += device_us.get(e["args"]["correlation"], 0.0)
        costs["other"] = {"host_us": float(red["dur"]) - sum(c["host_us"] for c in costs.values()),
                          "device_us": sum(device_us.get(e["args"]["correlation"], 0.0)
                                           for i, e in enumerate(mine) if i not in claimed)}
        out.append(costs)
    return out


def other_ops(events: list[dict[str, Any]], top: int = 10) -> dict[str, float]:
    """What ``other`` is made of: per op name, the median per reduction of the host time of the
    outermost host ops (``cpu_op``; nested calls are inside their caller's time) that run on the
    reduction's thread inside its span and outside every phase's span; the ``top`` largest."""
    spans = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
             and str(e.get("name", "")).startswith((PREFIX, REDUCTION))]
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"])
    per_reduction = []
    for red in sorted((s for s in spans if s["name"] == REDUCTION), key=lambda s: s["ts"]):
        lo, hi, tid = red["ts"], red["ts"] + red["dur"], red["tid"]
        phased = [(s["ts"], s["ts"] + s["dur"]) for s in spans
                  if s["tid"] == tid and s["name"].startswith(PREFIX) and lo <= s["ts"] <= hi]
        totals: dict[str, float] = defaultdict(float)
        end = float("-inf")  # the end of the last outermost op taken
        for e in ops:
            if e["tid"] != tid or not lo <= e["ts"] <= hi or e["ts"] < end:
                continue
            end = e["ts"] + e["dur"]
            if not any(a <= e["ts"] <= b for a, b in phased):
                totals[str(e["name"])] += float(e["dur"])
        per_reduction.append(totals)
    names = {n for r in per_reduction for n in r}
    medians = {n: statistics.median(r.get(n, 0.0) for r in per_reduction) for n in names}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1])[:top])


def summarize(per_reduction: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The median per reduction of each phase's host and device microseconds."""
    names = [p for p in (*PHASES, "other") if any(p in r for r in per_reduction)]
    return {p: {k: statistics.median(r.get(p, {}).get(k, 0.0) for r in per_reduction) for k in ("host_us", "device_us")}
            for p in names}


def fixed_costs(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per phase, the larger of its host and device microseconds (see the module docstring)."""
    return {p: max(c["host_us"], c["device_us"]) for p, c in phases.items()}


class _Marks:
    """The wrappers' own host spans (seconds), per reduction, and which all-to-all comes next."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.reductions: list[dict[str, float]] = []


@contextlib.contextmanager
def phases(inside: Any, marks: _Marks) -> Iterator[None]:
    """Wrap the engine's calls in record_function spans (see the module docstring); undone on exit."""
    kernels, engine_cls, exchange = inside.cuda_kernels, inside.CollectiveEngine, inside.exchange_device
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, name: Any) -> None:
        real = getattr(owner, attr)

        def wrapper(*a: Any, **kw: Any) -> Any:
            current = getattr(marks.local, "current", None)
            if current is None or getattr(marks.local, "inside", False):  # (a call inside a phase: that phase's)
                return real(*a, **kw)
            label = name(current) if callable(name) else name
            t0 = time.perf_counter()
            marks.local.inside = True
            try:
                with record_function(PREFIX + label):
                    result = real(*a, **kw)
            finally:
                marks.local.inside = False
            current[label] = current.get(label, 0.0) + time.perf_counter() - t0
            return result

        patched.append((owner, attr, real if attr in vars(owner) else None))
        setattr(owner, attr, wrapper)

    def gathered(current: dict[str, float]) -> str:  # the first all-gather carries the bitmaps
        current["_ag"] = current.get("_ag", 0) + 1
        return "bitmap all-gather" if current["_ag"] == 1 else "blocks"

    real_steps = engine_cls._device_steps

    def device_steps(self: Any, job: Any, flat: torch.Tensor) -> None:
        marks.local.current = current = {}
        t0 = time.perf_counter()
        try:
            with record_function(REDUCTION):
                real_steps(self, job, flat)
        finally:
            marks.local.current = None
            current.pop("_ag", None)
            current["reduction"] = time.perf_counter() - t0
            marks.reductions.append(current)

    # (the engine's flags: ops.flags_of, or block_flags in an older tree)
    for owner, attr, name in ((kernels, "block_flags", "flags"), (kernels, "flags_of", "flags"),
                              (exchange, "_all_gather", gathered),
                              (exchange, "read_counts", "counts"), (exchange, "to_host", "counts"),  # (older: to_host)
                              (dist, "all_reduce", "blocks"),
                              (dist, "all_to_all_single", "blocks"), (exchange, "_rank_order_sums", "sums"),
                              (exchange, "_owned_sums", "sums"), (exchange, "_sums_in_place", "sums"),
                              (exchange, "_scatter", "scatter")):
        if hasattr(owner, attr):
            wrap(owner, attr, name)
    patched.append((engine_cls, "_device_steps", real_steps))
    engine_cls._device_steps = device_steps
    try:
        yield
    finally:
        for owner, attr, real in reversed(patched):
            if real is None:  # (inherited, e.g. torch.Tensor.cpu from its C base)
                delattr(owner, attr)
            else:
                setattr(owner, attr, real)


def _profiler(device: torch.device) -> tuple[Any, bool]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        return profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)), True
    except TypeError:  # (a torch without it: only the wrappers' host times)
        return profile(activities=activities), False


def profile_bucket(ctx: Any, engine: Any, inside: Any, numel: int, density: float, dtype: torch.dtype,
                   reps: int, trace: Path | None) -> dict[str, Any]:
    """``reps`` reductions of one bucket under the profiler (after 3 unprofiled ones)."""
    from omnireduce.bench.inputs import sparse

    x = sparse(numel, density, rank=ctx.rank, block=engine.block_size, dtype=dtype, device=ctx.device, seed=3)
    work = torch.empty_like(x)
    marks = _Marks()
    prof, all_threads = _profiler(ctx.device)
    with phases(inside, marks):
        for i in range(3 + reps):
            work.copy_(x)
            ctx.barrier()
            if i == 3:
                prof.__enter__()
            engine.allreduce_async(work).wait()
            ctx.sync()
        prof.__exit__(None, None, None)
    events: list[dict[str, Any]] = []
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    measured = phase_costs(events) if all_threads else []
    host = [{k: v * 1e6 for k, v in r.items()} for r in marks.reductions[3:]]
    return {"elements": numel, "bytes": numel * x.element_size(), "density": density, "dtype": str(dtype)[6:],
            "reductions": reps, "profile_all_threads": all_threads, "profiled_reductions": len(measured),
            "other_ops_us": other_ops(events) if measured else {},
            "phases": summarize(measured) if measured else
            {p: {"host_us": statistics.median(r.get(p, 0.0) for r in host), "device_us": 0.0}
             for p in PHASES if any(p in r for r in host)},
            "reduction_host_us": statistics.median(r["reduction"] for r in host) if host else None}


def case_profile(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    from ombench.rankside import internals

    inside = internals()
    block = int(args.get("block", 256))
    engine = inside.CollectiveEngine.for_group(dist.group.WORLD, ctx.timeout, block, inside.lanes, inside.slots)
    out, buckets = Path(args["out"]), []
    try:
        for mib, density in args.get("buckets", [[1, 0.01], [100, 0.01]]):
            numel = int(float(mib) * (1 << 20)) // 4
            trace = out / f"trace_{mib}MiB_d{density}_rank{ctx.rank}.json" if ctx.rank == 0 else None
            buckets.append(profile_bucket(ctx, engine, inside, numel, float(density), torch.float32,
                                          int(args.get("reps", 10)), trace))
    finally:
        engine.close()
    smallest = min(buckets, key=lambda b: b["bytes"])
    return {"buckets": buckets, "block_size": block, "per_bucket_fixed_us": fixed_costs(smallest["phases"]),
            "fixed_from": {"bytes": smallest["bytes"], "density": smallest["density"]}}


def cmd_profile(args: Any, run_case: Any) -> tuple[bool, str, dict[str, Any]]:
    """The parent side: one job of ``min(worlds)`` ranks; rank 0's costs, with what ran them."""
    import platform

    world = min(args.worlds)
    buckets = [[m, d] for m in args.profile_mib for d in args.profile_densities]
    device_path = {"OMNIREDUCE_DEVICE_PATH": "1"} if args.device == "cpu" else {}  # (CPU: the device path's code)
    ranks, results, out = run_case("profile", args, world, {"buckets": buckets, "reps": args.repeats},
                                   env=device_path)
    if results[0] is None or any(r["rc"] != 0 for r in ranks):
        return False, f"exit status {[r['rc'] for r in ranks]}", {}
    if args.trace_dir:  # (the chrome traces, for a look in Perfetto)
        for t in out.glob("trace_*.json"):
            shutil.copy(t, Path(args.trace_dir, f"nccl_profile_{t.name}"))
    res = dict(results[0], measured=True, world_size=world, backend=args.backend, device=_device_name(args.device),
               transport=label_for(args.backend, args.device),
               host=platform.node(), traces=sorted(p.name for p in out.glob("trace_*.json")))
    for b in res["buckets"]:
        print(f"{b['bytes'] / (1 << 20):g} MiB d={b['density']:g}: reduction {b['reduction_host_us']:.0f} us on the "
              f"host; " + ", ".join(f"{p} {c['host_us']:.0f}/{c['device_us']:.0f}" for p, c in b["phases"].items())
              + " (host/device us)")
    fixed = res["per_bucket_fixed_us"]
    return True, (f"W={world}, per bucket (us, max of host and device, {res['fixed_from']['bytes'] / (1 << 20):g} MiB "
                  f"d={res['fixed_from']['density']:g}): " + ", ".join(f"{p} {v:.0f}" for p, v in fixed.items())), res


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return device
