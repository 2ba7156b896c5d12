"""PREDICTION: the collective engine on GPUs over NCCL against NCCL's ring all-reduce, from the
engine's measured host work per bucket and NCCL's own published latency model.

Every output is a model output for clusters this project has not run on, and says which of its
inputs are which:

* **measured** (:func:`load_measured`): the engine's host work per bucket, from a
  ``gpu_nccl_check.py profile`` JSON, a ``bench_engine.py``/``gpu_nccl_check.py engine`` JSON or a
  ``gpu_nccl_check.py graphs`` JSON (with and without CUDA graphs);
* **published model constants**: NCCL's small-message latencies (:func:`nccl_latencies_us`), from
  NCCL's ``src/graph/tuning.cc``: the ``baseLat`` and ``hwLat`` tables and ``ncclTopoTuneModel``'s
  formulas (in NCCL 2.28 the same numbers are ``ncclTunerConstantsDefaults.baseLatencies`` and
  ``.hwLatencies``); not measured here;
* **assumed rates**: NCCL's achieved fraction f of line rate R (:class:`NcclParams`) and the device
  kernels' rates (:class:`GpuRates`, H200).

The cluster (:data:`NET`): W GPUs, each a node with its own NIC. One bucket of N bytes::

    T_ring   = L_allreduce(W) + 2 (W-1)/W N / (f R)
    T_engine = host + sum over the plan's collectives c of (L_c(W) + bytes_c / (f R)) + kernel passes

The plan is the one ``omnireduce.engines.plan.choose`` takes on the expected counts
(:func:`engine_plan`; a bucket that chose ``gather`` goes ``fused``: bitmap and blocks in one
all-gather), its bytes :func:`plan_collectives`, its kernels :func:`plan_kernels`. Blocks per rank:
m = d N/s; in the union U = u N/s, with u = 1 - (1-d)^W (``random`` placement) or d (``overlap``).
Everything is added one after the other: an upper bound where the host's work overlaps the device's.
:func:`crossover` finds the density per rank below which the engine beats the ring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ombench.traffic import union_density
from omnireduce.engines.plan import DEFAULT_LATENCY_BYTES, capacity

GBIT = 1e9 / 8
"""Bytes per second of one Gbit/s."""

LABEL = "PREDICTION"

# --- NCCL's published latency model (src/graph/tuning.cc) -------------------------------------------

BASE_LAT_US = {"ring": 6.6, "tree": 6.8, "pat": 8.0}
"""``baseLat``: Ring LL, Tree LL; PAT Simple (NCCL 2.23 and later)."""
HW_LAT_US = {"nvlink": {"ring": 0.6, "tree": 0.6}, "pci": {"ring": 1.0, "tree": 1.0}, "net": {"ring": 2.7, "tree": 5.0}}
"""``hwLat[hw][algorithm][LL]``: each step's latency."""
NET_TREE_SIMPLE_US = 14.0
"""``hwLat[NET][Tree][Simple]``: PAT's network latency with one GPU per node."""
NET_OVERHEAD_US = 1.0
"""``getNetOverhead``: posting a network step, x86 Intel (AMD: 2.0), LL protocol."""


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Where the ranks sit for NCCL's latency model: ``gpus_per_node`` GPUs a node (0: all on one
    node), joined inside a node by ``intra`` (``nvlink`` or ``pci``) and between nodes by the network."""

    name: str
    gpus_per_node: int
    intra: str = "nvlink"
    unit_us: float | None = None
    """A measured latency unit (a 1-element all-reduce's time, omnireduce-bench's ``unit``), taken as every
    collective's small-message latency instead of NCCL's published model (None: the model)."""

    def nodes(self, world: int) -> int:
        return 1 if self.gpus_per_node <= 0 else max(1, -(-world // self.gpus_per_node))


NET = Fabric("net", 1)
"""The predicted flat cluster: every GPU a node of its own, with its own NIC (InfiniBand)."""
NVLINK = Fabric("nvlink", 0)
"""W GPUs in one node on NVLink."""
FABRICS = {"net": NET, "nvlink": NVLINK}


def log2i(n: int) -> int:
    """NCCL's ``log2i``: floor(log2 n) for n >= 1."""
    return max(n, 1).bit_length() - 1


def nccl_latencies_us(coll: str, world: int, nodes: int = 1, intra: str = "nvlink") -> dict[str, float]:
    """NCCL's small-message latency (us) of each algorithm it models for ``coll`` (``allreduce`` or
    ``allgather``) over ``world`` ranks on ``nodes`` nodes, LL protocol (PAT: Simple), as
    ``ncclTopoTuneModel`` computes it::

        ring  base_ring + (steps - inter) max(hw_intra, overhead) + inter hw_inter
              steps: all-reduce 2(W-1), all-gather W-1; inter: 2(n-1), n-1 (none on one node);
              hw_inter: hwLat[NET][Ring], or hwLat[NET][Tree] with one GPU per node ("with ppn=1
              latencies are fully exposed, use the Tree network latency"); overhead on n > 1 only
        tree  (all-reduce) base_tree + 2 ((W/n - 1) hw_intra_tree + floor(log2 n) hwLat[NET][Tree])
        PAT   (all-gather, one GPU per node) 8.0 + floor(log2 n) hwLat[NET][Tree][Simple] / 3.5 + 2.8 W
    """
    if coll not in ("allreduce", "allgather"):
        raise ValueError(f"NCCL's latency model covers allreduce and allgather, not {coll!r}")
    W, n = world, max(1, nodes)
    if W <= 1:
        return {"ring": 0.0}
    reduce = coll == "allreduce"
    steps = 2 * (W - 1) if reduce else W - 1
    inter = 0 if n == 1 else (2 * (n - 1) if reduce else n - 1)
    one_per_node = n == W
    hw_inter = HW_LAT_US["net"]["tree" if one_per_node else "ring"]
    hw_intra = HW_LAT_US[intra]["ring"] if n == 1 else max(HW_LAT_US[intra]["ring"], NET_OVERHEAD_US)
    out = {"ring": BASE_LAT_US["ring"] + (steps - inter) * hw_intra + inter * hw_inter}
    if reduce:
        out["tree"] = BASE_LAT_US["tree"] + 2 * ((W // n - 1) * HW_LAT_US[intra]["tree"]
                                                 + log2i(n) * HW_LAT_US["net"]["tree"])
    elif one_per_node:
        out["pat"] = BASE_LAT_US["pat"] + log2i(n) * NET_TREE_SIMPLE_US / 3.5 + 2.8 * W
    return out


def latency_s(coll: str, world: int, fabric: Fabric) -> float:
    """Seconds of ``coll``'s small-message latency over ``fabric``: NCCL's fastest algorithm (an
    all-reduce: ring or tree; an all-gather: ring or PAT). ``alltoall``: NCCL's model has none (it is
    send/recv); charged a ring all-gather's latency, an assumption."""
    if fabric.unit_us is not None:
        return fabric.unit_us * 1e-6
    nodes = fabric.nodes(world)
    if coll == "alltoall":
        return nccl_latencies_us("allgather", world, nodes, fabric.intra)["ring"] * 1e-6
    return min(nccl_latencies_us(coll, world, nodes, fabric.intra).values()) * 1e-6


# --- rates ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NcclParams:
    """NCCL's achieved rate and the fabric of its latencies (PREDICTION inputs, not measured here)."""

    fraction: float = 0.94
    """Achieved bytes/s over line rate, for every collective's bytes: 47 GB/s of 50 GB/s (400
    Gbit/s), the middle of the ~46-48 GB/s per NIC that published nccl-tests all_reduce_perf runs
    on 400 Gbit/s InfiniBand report for large messages (busbw)."""
    fabric: Fabric = NET
    a2a_fraction: float | None = None
    """The all-to-alls' fraction of line rate (None: ``fraction``; no published figure is used)."""

    def rate(self, coll: str, rate_bytes_s: float) -> float:
        """Bytes/s ``coll`` achieves at line rate ``rate_bytes_s``."""
        f = self.a2a_fraction if coll == "alltoall" and self.a2a_fraction is not None else self.fraction
        return f * rate_bytes_s


@dataclasses.dataclass(frozen=True)
class GpuRates:
    """Device-side kernel rates, bytes/s, as ``bench_gpu.py`` counts them (H200, 100 MiB fp32)."""

    flags: float = 2.5e12
    """``block_flags``: 2556-2568 GB/s (reading the tensor)."""
    compact: float = 1.1e12
    """``compact``: 1049-1565 GB/s (reading the tensor and writing k blocks; 1.1 TB/s at density
    0.1, its fixed costs included: the conservative end)."""
    scatter: float = 2.9e12
    """``scatter``: 2949 GB/s at density 1 (reading and writing k blocks)."""
    owner_sum: float | None = None
    """The rank-order sums (no kernel measured yet; None: the compact rate, a gather of blocks)."""

    @property
    def sum_rate(self) -> float:
        return self.compact if self.owner_sum is None else self.owner_sum


# --- the engine's plans -------------------------------------------------------------------------------

PLANS = ("fused", "gather", "union", "owners")
"""``fused``: bitmap and blocks in one all-gather (a bucket whose last reduction went ``gather``); the
others bitmap-first: the bitmaps' all-gather, then that exchange."""
_CALLS = {"gather": 1, "union": 1, "owners": 2}
_ALIGN = 16  # bytes: where a fused record's blocks start after its bitmap (exchange_device._ALIGN)


def _counts(nbytes: float, density: float, union: float, block_bytes: int) -> tuple[float, float, float]:
    nb = nbytes / block_bytes
    return nb, density * nb, union * nb


def fused_capacity(nbytes: float, density: float, block_bytes: int) -> int:
    """Blocks per rank of the fused all-gather in the steady state: ``plan.capacity`` of m."""
    nb, m, _ = _counts(nbytes, density, 0.0, block_bytes)
    return capacity(round(m), math.ceil(nb))


def plan_collectives(plan: str, nbytes: float, world: int, density: float, union: float,
                     block_bytes: int) -> list[tuple[str, float]]:
    """The collectives of one reduction in ``plan`` and the bytes each rank sends in each, with m and
    U the expected blocks per rank and in the union (nothing non-zero anywhere: the bitmaps' only)::

        fused   all-gather of the bitmap (ceil(nb/8), 16-aligned: head) and cap = plan.capacity(m)
                blocks: (W-1)(head + cap s)
        gather  bitmaps (W-1) ceil(nb/8), then an all-gather of m blocks: (W-1) m s
        union   bitmaps, then an all-reduce of the union's blocks: 2 (W-1)/W U s
        owners  bitmaps, then two all-to-alls: (W-1)/W m s and (W-1)/W U s

    as ``ombench.traffic.collective_link_bytes`` counts them for masks."""
    W, s = world, block_bytes
    nb, m, U = _counts(nbytes, density, union, block_bytes)
    bitmap = math.ceil(nb / 8)
    if plan == "fused":
        head = -(-bitmap // _ALIGN) * _ALIGN
        return [("allgather", (W - 1) * (head + fused_capacity(nbytes, density, s) * s))]
    out = [("allgather", float((W - 1) * bitmap))]
    if U <= 0:
        return out
    if plan == "gather":
        out.append(("allgather", (W - 1) * m * s))
    elif plan == "union":
        out.append(("allreduce", 2 * (W - 1) / W * U * s))
    elif plan == "owners":
        out += [("alltoall", (W - 1) / W * m * s), ("alltoall", (W - 1) / W * U * s)]
    else:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    return out


def plan_kernels(plan: str, nbytes: float, world: int, density: float, union: float, block_bytes: int,
                 gpu: GpuRates) -> dict[str, float]:
    """Seconds of the device's passes in ``plan``, at the rates of :class:`GpuRates` as its
    docstrings count bytes: flags (N), compaction (N and the blocks written: m, the fused capacity,
    or U for ``union``), the rank-order sums (gather and fused: every rank's m blocks read, U
    written; owners: m and U/W; union: none, NCCL sums), scatter (2 U)."""
    N, W, s = nbytes, world, block_bytes
    _, m, U = _counts(nbytes, density, union, block_bytes)
    written = {"fused": fused_capacity(nbytes, density, s), "union": U}.get(plan, m) * s
    out = {"flags": N / gpu.flags, "compact": (N + written) / gpu.compact}
    if U <= 0:
        return out
    sums = {"fused": W * m * s + U * s, "gather": W * m * s + U * s, "owners": m * s + U * s / W}.get(plan, 0.0)
    out["sums"] = sums / gpu.sum_rate
    out["scatter"] = 2 * U * s / gpu.scatter
    return out


def plan_steps(plan: str, nbytes: float, world: int, density: float, union: float, rate_bytes_s: float,
               nccl: NcclParams, gpu: GpuRates, host_s: float, block_bytes: int) -> dict[str, float]:
    """Seconds of one reduction in ``plan``: host work, the collectives' latencies, their bytes on
    the wire at f R, and each kernel pass."""
    colls = plan_collectives(plan, nbytes, world, density, union, block_bytes)
    steps = {"host": host_s,
             "latency": sum(latency_s(c, world, nccl.fabric) for c, _ in colls) if world > 1 else 0.0,
             "wire": sum(b / nccl.rate(c, rate_bytes_s) for c, b in colls)}
    steps.update(plan_kernels(plan, nbytes, world, density, union, block_bytes, gpu))
    return steps


def engine_plan(nbytes: float, world: int, density: float, union: float, block_bytes: int,
                latency_bytes: float = DEFAULT_LATENCY_BYTES, *, order: str = "any", fuse: bool = True) -> str:
    """The plan the engine takes in the steady state: ``plan.choose``'s rule on the expected counts
    (blocks the busiest rank sends times ``block_bytes``, plus ``latency_bytes`` per collective; ties
    in the order gather, union, owners; owners only at W > 2, union not with ``order="rank"``), and
    ``fused`` where it chose gather. With ``fuse`` priced as ``choose(fused=True)`` prices it: the
    others with the bitmaps' all-gather besides, which the fused gather carries."""
    W = world
    _, m, U = _counts(nbytes, density, union, block_bytes)
    moved = {"gather": (W - 1) * m, "union": 2 * U * (W - 1) / W, "owners": (W - 1) * (m + U) / W}
    calls = {e: n + (1 if fuse and e != "gather" else 0) for e, n in _CALLS.items()}
    options = ["gather"] + (["union"] if order == "any" else []) + (["owners"] if W > 2 else [])
    best = min(options, key=lambda e: moved[e] * block_bytes + calls[e] * latency_bytes)
    return "fused" if best == "gather" and fuse else best


# --- times ----------------------------------------------------------------------------------------------


def ring_time(nbytes: float, world: int, rate_bytes_s: float, nccl: NcclParams) -> float:
    """NCCL's ring all-reduce: ``L_allreduce(W) + 2 (W-1)/W N / (f R)``."""
    if world <= 1:
        return 0.0
    return latency_s("allreduce", world, nccl.fabric) + 2 * (world - 1) / world * nbytes / nccl.rate("allreduce",
                                                                                                  rate_bytes_s)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One predicted cluster and bucket: N bytes, W ranks, line rate R (bytes/s), the rest of the inputs."""

    nbytes: float
    world: int
    rate_bytes_s: float
    nccl: NcclParams = NcclParams()
    gpu: GpuRates = GpuRates()
    host_s: float = 0.0
    block_bytes: int = 1024
    latency_bytes: float = DEFAULT_LATENCY_BYTES

    def ring(self) -> float:
        return ring_time(self.nbytes, self.world, self.rate_bytes_s, self.nccl)

    def plan_time(self, plan: str, density: float, placement: str) -> float:
        u = union_density(density, self.world, placement)
        return sum(plan_steps(plan, self.nbytes, self.world, density, u, self.rate_bytes_s, self.nccl, self.gpu,
                              self.host_s, self.block_bytes).values())

    def plan(self, density: float, placement: str) -> str:
        """The engine's plan at ``density`` (:func:`engine_plan`)."""
        u = union_density(density, self.world, placement)
        return engine_plan(self.nbytes, self.world, density, u, self.block_bytes, self.latency_bytes)

    def engine(self, density: float, placement: str) -> float:
        """Seconds of one reduction as the engine chooses."""
        return self.plan_time(self.plan(density, placement), density, placement)

    def cheapest(self, density: float, placement: str) -> float:
        """Seconds of one reduction in the plan this model finds cheapest (not what the engine does)."""
        return min(self.plan_time(p, density, placement) for p in PLANS)

    def one_block(self) -> float:
        """The smallest density: one block per rank."""
        return self.block_bytes / self.nbytes


def crossover(gap: Callable[[float], float], lo: float, points: int = 241, rel_tol: float = 1e-5) -> float | None:
    """The smallest density where ``gap`` (engine minus ring) stops being negative: bracketed on a
    geometric grid of ``points`` from ``lo`` to 1, then bisected to ``rel_tol``. None: not even at
    ``lo`` (never); 1.0: nowhere on the grid (always)."""
    grid = [lo * (1.0 / lo) ** (i / (points - 1)) for i in range(points)] if lo < 1.0 else [1.0]
    if gap(grid[0]) >= 0:
        return None
    above = next((i for i, d in enumerate(grid) if gap(d) >= 0), None)
    if above is None:
        return 1.0
    a, b = grid[above - 1], grid[above]
    while b - a > rel_tol * b:
        mid = (a + b) / 2
        a, b = (mid, b) if gap(mid) < 0 else (a, mid)
    return (a + b) / 2


def wins_again(gap: Callable[[float], float], start: float, points: int = 121) -> float | None:
    """The first density above ``start`` on a geometric grid where the engine is faster again (the
    plan switching), or None."""
    if start >= 1.0:
        return None
    for i in range(1, points):
        d = start * (1.0 / start) ** (i / (points - 1))
        if gap(d) < 0:
            return d
    return None


# --- measured inputs --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measured:
    """What was measured: the engine's host work per bucket (us), where, and what else the file says."""

    host_us: float
    source: str
    kind: str
    caveat: str = ""
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PROFILER_CAVEAT = ("measured under torch.profiler, which adds its own cost to every torch call: the host "
                   "time is inflated")


def _where(data: dict[str, Any]) -> str:
    keys = ("gpu", "device", "backend", "transport", "world_size")
    env = data.get("nccl_env") or {}
    parts = [f"{k} {data[k]}" for k in keys if data.get(k) not in (None, "")]
    if env.get("NCCL_VERSION"):
        parts.append(f"NCCL {env['NCCL_VERSION']}")
    return ", ".join(parts)


def _from_profile(path: str, data: dict[str, Any]) -> Measured:
    buckets = [b for b in data.get("buckets", []) if isinstance(b.get("phases"), dict)]
    if not buckets:
        raise ValueError(f"{path}: no buckets with phases (not the output of gpu_nccl_check.py profile)")
    want = (data.get("fixed_from") or {}).get("bytes")
    bucket = next((b for b in buckets if b.get("bytes") == want), min(buckets, key=lambda b: b.get("bytes", 0)))
    phases = {p: float(c["host_us"]) for p, c in bucket["phases"].items()}
    own = {p: v for p, v in phases.items() if p != "counts"}
    detail = {"bucket_bytes": bucket.get("bytes"), "bucket_density": bucket.get("density"),
              "phases_host_us": own, "counts_host_us": phases.get("counts"),
              "per_bucket_fixed_us": data.get("per_bucket_fixed_us"), "where": _where(data)}
    return Measured(sum(own.values()), f"{path}: {_where(data)}", "profile", PROFILER_CAVEAT, detail)


def _from_engine(path: str, data: dict[str, Any], world: int | None = None) -> Measured:
    rows = [r for r in data["rows"] if r.get("density") == 0.0 and r.get("host_s_per_reduction") is not None
            and (world is None or int(r["world"]) == world)]
    if any(r.get("path") == "device" for r in rows):
        rows = [r for r in rows if r.get("path") == "device"]
    if any(r.get("exchange") in ("auto", "default") for r in rows):
        rows = [r for r in rows if r.get("exchange") in ("auto", "default")]
    if not rows:
        at = "" if world is None else f" at W={world}"
        raise ValueError(f"{path}: no one-block rows (density 0.0) with host_s_per_reduction{at}")
    worlds = sorted({int(r["world"]) for r in rows})
    by_world = {}
    for w in worlds:
        mine = [r for r in rows if int(r["world"]) == w]
        by_world[w] = {k: statistics.median(float(r[k]) for r in mine if r.get(k) is not None)
                       for k in ("units", "unit_ms", "engine_ms", "collectives_per_reduction", "host_s_per_reduction")
                       if any(r.get(k) is not None for r in mine)}
    detail = {"one_block_by_world": by_world, "rows": len(rows), "where": _where(data)}
    host = statistics.median(float(r["host_s_per_reduction"]) for r in rows) * 1e6
    caveat = "engine thread's CPU time per reduction (time.thread_time)" + (
        "" if world is None else f", one-block rows at W={world}, its wait for the counts included")
    return Measured(host, f"{path}: {_where(data)}", "engine", caveat, detail)


def _from_graphs(path: str, data: dict[str, Any], world: int | None = None) -> Measured:
    """``gpu_nccl_check.py graphs``: per way (uncaptured, CUDA graphs) the median over the buckets at
    ``world`` (default 1) that went fused of the engine thread's CPU per reduction less its wait for the
    counts; the uncaptured way's is the host work, the graphs' goes in the detail."""
    w = 1 if world is None else world
    rows = [r for r in data["rows"] if int(r["world"]) == w and r["uncaptured"].get("fused")]
    if not rows:
        raise ValueError(f"{path}: no fused rows at W={w}")
    per_way = {way: statistics.median(r[way]["host_us"] - r[way]["host_wait_us"] for r in rows)
               for way in ("uncaptured", "graphs")}
    detail = {"graphs_host_us": per_way["graphs"], "world": w, "rows": len(rows), "where": _where(data),
              "per_bucket_us": {f"{r['elements']}@{r['density']:g}": {way: r[way]["host_us"] - r[way]["host_wait_us"]
                                                                      for way in ("uncaptured", "graphs")}
                                for r in rows}}
    caveat = (f"engine thread's CPU time per reduction less its wait for the counts, median of W={w}'s fused buckets; "
              f"with CUDA graphs {per_way['graphs']:.0f} us")
    return Measured(per_way["uncaptured"], f"{path}: {_where(data)}", "graphs", caveat, detail)


def _from_bench(path: str, data: dict[str, Any]) -> Measured:
    """An ``omnireduce-bench --json`` file: the engine thread's CPU per reduction at the file's lowest
    density (the closest it has to a bucket's fixed cost), the median over its sizes."""
    rows = [r for r in data["rows"] if r.get("engine_host_us") is not None]
    if not rows:
        raise ValueError(f"{path}: no rows with engine_host_us (an omnireduce-bench JSON of the collective engine)")
    low = min(float(r["density"]) for r in rows)
    mine = [r for r in rows if float(r["density"]) == low]
    head = data.get("header", {})
    detail = {"density": low, "rows": len(mine), "unit_us": statistics.median(float(r["unit_us"]) for r in mine),
              "where": f"{head.get('backend')} W={head.get('world_size')} on {head.get('device')}"}
    host = statistics.median(float(r["engine_host_us"]) for r in mine)
    caveat = f"engine thread's CPU time per reduction at density {low:g} (omnireduce-bench)"
    return Measured(host, f"{path}: {detail['where']}", "engine", caveat, detail)


def load_measured(path: str | Path, shown: str | None = None, world: int | None = None) -> Measured:
    """The engine's measured host work per bucket from ``path`` (named ``shown`` in the output): a
    ``gpu_nccl_check.py profile`` JSON, a ``bench_engine.py``/``gpu_nccl_check.py engine`` JSON
    (``world``: only that world size's rows), a ``gpu_nccl_check.py graphs`` JSON (``world``, default
    1: that world size's rows), or an ``omnireduce-bench --json`` file (see the module docstring)."""
    data = json.loads(Path(path).read_text())
    name = shown or str(path)
    if data.get("command") == "graphs" and isinstance(data.get("rows"), list):
        return _from_graphs(name, data, world)
    if "header" in data and isinstance(data.get("rows"), list):
        return _from_bench(name, data)
    if isinstance(data.get("rows"), list) and any("engine_ms" in r for r in data["rows"]):
        return _from_engine(name, data, world)
    if "buckets" in data or "per_bucket_fixed_us" in data:
        return _from_profile(name, data)
    raise ValueError(f"{name}: neither a gpu_nccl_check.py profile JSON (buckets, per_bucket_fixed_us) nor an "
                     "engine or graphs JSON (rows)")


# --- the sweep ------------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    if x is None:
        return "never"
    return "always (d = 1)" if x >= 1.0 else f"{x * 100:.2g}%"


def _latency_table(worlds: Sequence[int]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, fab in FABRICS.items():
        out[name] = {}
        for W in worlds:
            n = fab.nodes(W)
            out[name][str(W)] = {"allreduce": nccl_latencies_us("allreduce", W, n, fab.intra),
                                 "allgather": nccl_latencies_us("allgather", W, n, fab.intra),
                                 "alltoall (assumed: ring all-gather)": latency_s("alltoall", W, fab) * 1e6}
    return out


def _crossovers(s: Setting, placement: str, ring: float) -> dict[str, Any]:
    """The crossover of ``s`` against ``ring`` (seconds) as the engine chooses, the plan just below it,
    where it wins again above it, and the crossover with the plan this model finds cheapest."""

    def gap(d: float) -> float:
        return s.engine(d, placement) - ring

    def gap_cheapest(d: float) -> float:
        return s.cheapest(d, placement) - ring

    x = crossover(gap, s.one_block())
    return {"crossover": x, "plan_below": s.plan(x * 0.99, placement) if x is not None else None,
            "wins_again_from": wins_again(gap, x) if x is not None else None,
            "crossover_cheapest_plan": crossover(gap_cheapest, s.one_block())}


def sweep(size_mib: float, worlds: Sequence[int], rates_gbit: Sequence[float], densities: Sequence[float],
          nccl: NcclParams, gpu: GpuRates, measured: Measured, hosts_us: Sequence[float] = (300.0, 100.0),
          block_bytes: int = 1024, latency_bytes: float = DEFAULT_LATENCY_BYTES) -> dict[str, Any]:
    """Times (ms) per setting and density and the crossovers, for both placements, with the
    measured host work and with each of ``hosts_us``. Every number is a PREDICTION."""
    N = size_mib * (1 << 20)
    hosts = [("measured", measured.host_us), *((f"{h:g} us", float(h)) for h in hosts_us)]
    rows, crossovers, one_block = [], [], []
    for rate in rates_gbit:
        for W in worlds:
            base = Setting(N, W, rate * GBIT, nccl, gpu, measured.host_us * 1e-6, block_bytes, latency_bytes)
            ring = base.ring()
            lat = latency_s("allreduce", W, nccl.fabric)
            t1 = base.engine(base.one_block(), "overlap")
            one_block.append({"rate_gbit": rate, "workers": W, "engine_ms": t1 * 1e3,
                              "units_of_allreduce_latency": t1 / lat if lat else None})
            for placement in ("random", "overlap"):
                rows.append({"rate_gbit": rate, "workers": W, "placement": placement, "ring_ms": ring * 1e3,
                             "allreduce_latency_us": lat * 1e6,
                             "engine_ms": {str(d): base.engine(d, placement) * 1e3 for d in densities},
                             "plan": {str(d): base.plan(d, placement) for d in densities},
                             "steps_ms_at_1pct": {k: v * 1e3 for k, v in plan_steps(
                                 base.plan(0.01, placement), N, W, 0.01, union_density(0.01, W, placement),
                                 base.rate_bytes_s, nccl, gpu, base.host_s, block_bytes).items()}})
                by_host = [{"host": name, "host_us": host,
                            **_crossovers(dataclasses.replace(base, host_s=host * 1e-6), placement, ring)}
                           for name, host in hosts]
                crossovers.append({"rate_gbit": rate, "workers": W, "placement": placement, "by_host": by_host})
    return {"meta": {"prediction": True, "label": f"{LABEL}: model output, not a measurement",
                     "size_mib": size_mib, "block_bytes": block_bytes, "latency_bytes": latency_bytes,
                     "nccl": dataclasses.asdict(nccl), "gpu_rates": dataclasses.asdict(gpu),
                     "densities": list(densities), "measured": measured.as_dict(),
                     "hosts": [{"host": n, "host_us": h} for n, h in hosts],
                     "latencies_us": _latency_table(worlds),
                     "latency_source": "NCCL src/graph/tuning.cc: baseLat, hwLat (LL; PAT Simple), ncclTopoTuneModel "
                                       "(published model constants, not measured here)"},
            "rows": rows, "crossovers": crossovers, "one_block": one_block}


# --- output ------------------------------------------------------------------------------------------------------

_SHORT = {"fused": "F", "gather": "G", "union": "U", "owners": "O"}


def inputs_lines(res: dict[str, Any]) -> list[str]:
    """What the prediction rests on, one line each: measured, published, assumed."""
    meta, m = res["meta"], res["meta"]["measured"]
    lines = [f"MEASURED: the engine's host work per bucket {m['host_us']:.0f} us ({m['kind']} JSON: {m['source']}"
             + (f"; {m['caveat']}" if m.get("caveat") else "") + ")"]
    d = m.get("detail", {})
    if m["kind"] == "profile":
        lines.append(f"MEASURED: phases' host us, bucket of {d.get('bucket_bytes')} bytes at "
                     f"d={d.get('bucket_density')} (less 'counts', the host waiting for the transport: "
                     f"{d.get('counts_host_us') or 0:.0f} us): "
                     + ", ".join(f"{k} {v:.0f}" for k, v in d.get("phases_host_us", {}).items()))
    for w, v in sorted(d.get("one_block_by_world", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"MEASURED: one block at W={w}: " + ", ".join(f"{k} {x:.3g}" for k, x in v.items()))
    fabric = meta["nccl"]["fabric"]["name"]
    unit = meta["nccl"]["fabric"].get("unit_us")
    if unit is not None:
        lines.append(f"MEASURED: every collective's small-message latency {unit:g} us (a 1-element all-reduce's "
                     f"time: the latency unit given), instead of NCCL's model")
    else:
        lines.append(f"PUBLISHED: NCCL's latency model ({meta['latency_source']}); fabric {fabric}"
                     + (": each GPU a node with its own NIC" if fabric == "net" else ": one node"))
    a2a = meta["nccl"].get("a2a_fraction")
    lines.append(f"ASSUMED: NCCL achieves {meta['nccl']['fraction']:g} of line rate"
                 + (f" (all-to-alls {a2a:g})" if a2a is not None else " (all-to-alls too)") + "; kernels (B/s) "
                 + ", ".join(f"{k} {v:.3g}" for k, v in meta["gpu_rates"].items() if v is not None)
                 + f"; the engine's latency_bytes {meta['latency_bytes']:.0f}; {_buckets(meta)} fp32, "
                 f"blocks of {meta['block_bytes']} bytes")
    return lines


def _buckets(meta: dict[str, Any]) -> str:
    """The bucket size(s) a result is for, in words."""
    sizes = meta.get("sizes_mib") or [meta["size_mib"]]
    return ("buckets " if len(sizes) > 1 else "bucket ") + " and ".join(f"{s:g}" for s in sizes) + " MiB"


def latency_lines(res: dict[str, Any]) -> list[str]:
    """NCCL's small-message latencies per fabric and W, us."""
    out = ["| fabric | W | all-reduce ring | all-reduce tree | all-gather ring | all-gather PAT "
           "| all-to-all (assumed) |", "|---|---|---|---|---|---|---|"]

    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for fab, per_w in res["meta"]["latencies_us"].items():
        for w, v in per_w.items():
            ar, ag = v["allreduce"], v["allgather"]
            out.append(f"| {fab} | {w} | {us(ar['ring'])} | {us(ar.get('tree'))} | {us(ag['ring'])} | "
                       f"{us(ag.get('pat'))} | {us(v['alltoall (assumed: ring all-gather)'])} |")
    return out


def time_lines(res: dict[str, Any]) -> list[str]:
    """Predicted ms per bucket, the engine's plan by letter (F fused, G gather, U union, O owners)."""
    ds = res["meta"]["densities"]
    out = ["| link | W | placement | NCCL ring | " + " | ".join(f"d={d:g}" for d in ds) + " |",
           "|---|---|---|---|" + "---|" * len(ds)]
    for r in res["rows"]:
        out.append(f"| {r['rate_gbit']:g} Gbit/s | {r['workers']} | {r['placement']} | {r['ring_ms']:.2f} | "
                   + " | ".join(f"{r['engine_ms'][str(d)]:.2f} {_SHORT[r['plan'][str(d)]]}" for d in ds) + " |")
    return out


def crossover_cell(h: dict[str, Any]) -> str:
    """One host time's crossover as a table cell: the density, the plan below it, where it wins again."""
    cell = _pct(h["crossover"])
    if h.get("plan_below"):
        cell += f" ({h['plan_below']})"
    if h.get("wins_again_from") is not None:
        cell += f", again from {_pct(h['wins_again_from'])}"
    return cell


def crossover_lines(res: dict[str, Any]) -> list[str]:
    """The density per rank below which the engine beats the ring, per host work."""
    hosts = res["meta"]["hosts"]
    head = [f"host {h['host_us']:.0f} us (measured)" if h["host"] == "measured" else f"host {h['host']}" for h in hosts]
    out = ["| link | GPUs | placement | " + " | ".join(head) + " |", "|---|---|---|" + "---|" * len(head)]
    for c in res["crossovers"]:
        cells = [crossover_cell(h) for h in c["by_host"]]
        out.append(f"| {c['rate_gbit']:g} Gbit/s | {c['workers']} | {c['placement']} | " + " | ".join(cells) + " |")
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    """The docs' block (docs/bench/gpu_nccl.md): inputs, latencies, crossovers, times."""
    return [f"{LABEL} (cost model, not measured). Inputs:", "",
            *(f"- {line}" for line in inputs_lines(res)), "",
            "NCCL's small-message latencies, us (its published model, not measured):", "",
            *latency_lines(res), "",
            f"{LABEL}: the density per rank below which the engine beats NCCL's ring (in brackets the "
            "engine's plan there; 'never': not even with one block per rank):", "",
            *crossover_lines(res), "",
            f"{LABEL}: ms per {res['meta']['size_mib']:g} MiB bucket with the measured host work "
            "(F fused gather, G gather, U union, O owners):", "",
            *time_lines(res)]


def text(res: dict[str, Any]) -> str:
    """Everything for the terminal, every line marked as a prediction."""
    body = [f"the collective engine on NCCL against NCCL's ring all-reduce ({res['meta']['label']})",
            *inputs_lines(res), "", "NCCL's small-message latencies, us (published model, not measured):",
            *latency_lines(res), "", "crossover: the engine beats the ring below this density per rank "
            "(in brackets its plan there):", *crossover_lines(res), "",
            f"ms per {res['meta']['size_mib']:g} MiB bucket, host work as measured (F fused, G gather, U union, "
            "O owners):", *time_lines(res), "", "one block per rank, host work as measured:",
            *(f"{b['rate_gbit']:g} Gbit/s W={b['workers']}: {b['engine_ms']:.3f} ms"
              + (f" = {b['units_of_allreduce_latency']:.1f} units of NCCL's all-reduce latency"
                 if b["units_of_allreduce_latency"] else "") for b in res["one_block"])]
    return "\n".join(f"{LABEL} | {line}" for line in body)
