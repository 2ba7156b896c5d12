"""PREDICTION: the collective engine on GPUs over NCCL, against NCCL's ring all-reduce.

Everything here is a model output for hardware this project has not run the engine on: the engine
has no CUDA path yet (:mod:`omnireduce.engines.collective` takes host tensors), NCCL is not measured
here, and the GPU-side costs are the H200 kernel rates of docs/log/2026-11-26-gpu-h200.md
(``bench_gpu.py``, 100 MiB fp32, blocks of 256). Unlike :mod:`ombench.costmodel` there is no CPU
term: on a GPU the bytes never pass through a Python loop.

The cluster: W GPUs, each with a NIC of its own at ``rate`` per direction (a rail-optimised,
non-blocking fabric; NVLink inside a node is not used: the flat case, every GPU one rank).

* **Ring all-reduce** (NCCL), density-blind::

      T_ring = 2 (W-1)/W N / (f_ring R)

  ``f_ring R`` is NCCL's achieved bus bandwidth (nccl-tests ``busbw``, which already folds the
  ring's per-step latencies and protocol overheads of a large message into the rate).

* **The collective engine**, its four steps one after the other (the engine pipelines nothing),
  per rank at density d and union density u (``ombench.traffic.union_density``), nb = N / (B s)
  blocks::

      flags             N / flags_rate                              (the bitmap, before the all-gather)
      bitmap all-gather (W-1) nb/8 / (f_ring R) + latency
      compact           (N + d N) / compact_rate                     (read the tensor, write its k blocks)
      blocks to owners  (W-1)/W d N / (f_a2a R) + latency            (all_to_all_single)
      owner sums        (d N + u N / W) / sum_rate                   (read W ranks' blocks, write the sums)
      sums back         (W-1)/W u N / (f_a2a R) + latency            (all_to_all_single)
      scatter           2 u N / scatter_rate                         (read and write the union's blocks)

  the bytes being :func:`ombench.traffic.collective_rank_bytes` split by step. ``f_a2a`` is the
  fraction of line rate NCCL's all-to-all achieves (a parameter; by default the all-reduce's, and
  the crossovers are also given at lower values: no nccl-tests all-to-all figure is used here).
  The split sizes from the bitmaps (a pass over W nb bits) and the kernel launches are left out.

Measured fixed costs (``cost_model.py collective --measured FILE``): the per-bucket cost of each
phase of one reduction measured on a GPU (``gpu_nccl_check.py profile``: ``per_bucket_fixed_us``,
the larger of host and device time per phase for a small bucket) replaces the assumed latencies:
each collective's ``latency_s`` is dropped, every measured phase's fixed cost is added to its
step's bandwidth term, and the phases the model has no term for (``split sizes``: the host learning
the all-to-alls' split sizes; ``other``: packing bitmaps, owners, the owners' sums' launches)
become steps of their own (:class:`MeasuredFixed`). The small bucket's own bandwidth share (about
1% of 100 MiB's at 1 MiB) is then counted twice. Where those costs were measured (one GPU, NCCL's
sockets on loopback) is in the file and in the output; everything else stays a PREDICTION.

Crossover: the density below which the engine beats the ring (:func:`crossover`), for blocks
drawn independently on every rank (``random``: u = 1 - (1-d)^W, which at W = 64 is near 1 already
at d = 5%) and for the same blocks on every rank (``overlap``: u = d, e.g. embedding rows every rank
touches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ombench.traffic import collective_rank_bytes, ring_bytes, union_density

if TYPE_CHECKING:
    from pathlib import Path

GBIT = 1e9 / 8
"""Bytes per second of one Gbit/s."""


@dataclasses.dataclass(frozen=True)
class NcclParams:
    """NCCL's achieved rates and latencies (PREDICTION inputs, not measured here)."""

    ring_fraction: float = 0.94
    """NCCL ring all-reduce bus bandwidth / line rate: 47 GB/s of 50 GB/s (400 Gbit/s), the middle of
    the ~46-48 GB/s per NIC that published nccl-tests all_reduce_perf runs on 400 Gbit/s
    InfiniBand report for large messages (busbw column)."""
    a2a_fraction: float | None = None
    """NCCL all-to-all's achieved fraction of line rate (None: ``ring_fraction``)."""
    latency_s: float = 25e-6
    """Fixed cost of each of the engine's three collectives (the bitmap all-gather is small:
    latency-bound)."""

    @property
    def a2a(self) -> float:
        return self.ring_fraction if self.a2a_fraction is None else self.a2a_fraction


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
    """The owner's summation (no kernel measured yet; None: the compact rate, a gather of blocks)."""

    @property
    def sum_rate(self) -> float:
        return self.compact if self.owner_sum is None else self.owner_sum


@dataclasses.dataclass(frozen=True)
class MeasuredFixed:
    """Measured fixed costs per bucket and phase, seconds (see the module docstring)."""

    seconds: tuple[tuple[str, float], ...]
    source: str = ""

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


def load_measured(path: str | Path) -> MeasuredFixed:
    """The ``per_bucket_fixed_us`` of a ``gpu_nccl_check.py profile`` JSON file, in seconds."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    fixed = data.get("per_bucket_fixed_us")
    if not isinstance(fixed, dict) or not fixed:
        raise ValueError(f"{path}: no per_bucket_fixed_us (not the output of gpu_nccl_check.py profile)")
    where = ", ".join(f"{k} {data[k]}" for k in ("device", "transport", "world_size", "fixed_from") if k in data)
    return MeasuredFixed(tuple((str(k), float(v) * 1e-6) for k, v in fixed.items()), source=f"{path}: {where}")


def ring_time(nbytes: float, world: int, rate_bytes_s: float, nccl: NcclParams) -> float:
    """NCCL's ring all-reduce of ``nbytes`` at its achieved bus bandwidth."""
    return ring_bytes(nbytes, world) / (nccl.ring_fraction * rate_bytes_s)


def engine_steps(nbytes: float, world: int, density: float, union: float, rate_bytes_s: float, nccl: NcclParams,
                 gpu: GpuRates, block_bytes: int = 1024, fixed: MeasuredFixed | None = None) -> dict[str, float]:
    """Seconds of each step of one reduction of the engine (see the module docstring); with
    ``fixed``, the measured fixed costs instead of the collectives' latencies."""
    W, N, d, u = world, nbytes, density, union
    bitmaps = collective_rank_bytes(N, W, 0.0, 0.0, block_bytes)
    blocks = collective_rank_bytes(N, W, d, 0.0, block_bytes) - bitmaps
    sums = collective_rank_bytes(N, W, 0.0, u, block_bytes) - bitmaps
    net, a2a = nccl.ring_fraction * rate_bytes_s, nccl.a2a * rate_bytes_s
    latency = nccl.latency_s if fixed is None else 0.0
    steps = {
        "flags": N / gpu.flags,
        "bitmap all-gather": bitmaps / net + latency,
        "compact": (N + d * N) / gpu.compact,
        "blocks to owners": blocks / a2a + latency,
        "owner sums": (d * N + u * N / W) / gpu.sum_rate,
        "sums back": sums / a2a + latency,
        "scatter": 2 * u * N / gpu.scatter,
    }
    for name, seconds in fixed.seconds if fixed is not None else ():
        steps[name] = steps.get(name, 0.0) + seconds
    return steps


def engine_time(nbytes: float, world: int, density: float, placement: str, rate_bytes_s: float, nccl: NcclParams,
                gpu: GpuRates, block_bytes: int = 1024, fixed: MeasuredFixed | None = None) -> float:
    """Seconds of one reduction of the engine at ``density`` per rank, ``placement`` random or overlap."""
    u = union_density(density, world, placement)
    return sum(engine_steps(nbytes, world, density, u, rate_bytes_s, nccl, gpu, block_bytes, fixed).values())


def crossover(nbytes: float, world: int, placement: str, rate_bytes_s: float, nccl: NcclParams, gpu: GpuRates,
              block_bytes: int = 1024, tol: float = 1e-6, fixed: MeasuredFixed | None = None) -> float | None:
    """The density at which the engine's time equals the ring's, by bisection on [0, 1] (the engine's
    time grows with the density): below it the engine is faster. None if the engine is slower even
    with nothing to send, 1.0 if it is faster even when dense."""
    ring = ring_time(nbytes, world, rate_bytes_s, nccl)

    def gap(d: float) -> float:
        return engine_time(nbytes, world, d, placement, rate_bytes_s, nccl, gpu, block_bytes, fixed) - ring

    if gap(0.0) >= 0:
        return None
    if gap(1.0) <= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def sweep(size_mib: float, worlds: Sequence[int], rates_gbit: Sequence[float], densities: Sequence[float],
          nccl: NcclParams, gpu: GpuRates, a2a_fractions: Sequence[float], block_bytes: int = 1024,
          fixed: MeasuredFixed | None = None) -> dict[str, Any]:
    """Times (ms) per setting and density, and the crossovers, for both placements; the crossovers
    again with NCCL's all-to-all at each of ``a2a_fractions`` of line rate. Every number is a
    PREDICTION (with ``fixed``: from measured fixed costs per bucket)."""
    N = size_mib * (1 << 20)
    rows, crossovers = [], []
    for rate in rates_gbit:
        R = rate * GBIT
        for W in worlds:
            ring = ring_time(N, W, R, nccl)
            for placement in ("random", "overlap"):
                times = {d: engine_time(N, W, d, placement, R, nccl, gpu, block_bytes, fixed) for d in densities}
                rows.append({"rate_gbit": rate, "workers": W, "placement": placement, "ring_ms": ring * 1e3,
                             "engine_ms": {str(d): t * 1e3 for d, t in times.items()},
                             "steps_ms_at_1": {k: v * 1e3 for k, v in engine_steps(
                                 N, W, 1.0, 1.0, R, nccl, gpu, block_bytes, fixed).items()}})
                c = {"rate_gbit": rate, "workers": W, "placement": placement,
                     "crossover": crossover(N, W, placement, R, nccl, gpu, block_bytes, fixed=fixed)}
                for f in a2a_fractions:
                    alt = dataclasses.replace(nccl, a2a_fraction=f)
                    c[f"a2a at {f:g}"] = crossover(N, W, placement, R, alt, gpu, block_bytes, fixed=fixed)
                crossovers.append(c)
    return {"meta": {"prediction": True, "size_mib": size_mib, "block_bytes": block_bytes,
                     "nccl": dataclasses.asdict(nccl), "gpu_rates": dataclasses.asdict(gpu),
                     "a2a_fractions": list(a2a_fractions), "densities": list(densities),
                     "fixed_costs": None if fixed is None else {
                         "source": fixed.source, "us": {k: v * 1e6 for k, v in fixed.seconds}}},
            "rows": rows, "crossovers": crossovers}


def _pct(x: float | None) -> str:
    if x is None:
        return "never"
    return "always (d = 1)" if x >= 1.0 else f"{x * 100:.2g}%"


def markdown(res: dict[str, Any]) -> str:
    """The tables of docs/log/2026-11-26-collective-engine.md's prediction part: times, then crossovers."""
    meta = res["meta"]
    ds = meta["densities"]
    out = ["PREDICTED ms per 100 MiB fp32 all-reduce (model output, not a measurement):", "",
           "| link | W | placement | NCCL ring | " + " | ".join(f"engine d={d:g}" for d in ds) + " |",
           "|---|---|---|---|" + "---|" * len(ds)]
    for r in res["rows"]:
        out.append(f"| {r['rate_gbit']:g} Gbit/s | {r['workers']} | {r['placement']} | {r['ring_ms']:.2f} | "
                   + " | ".join(f"{r['engine_ms'][str(d)]:.2f}" for d in ds) + " |")
    alts = [k for k in res["crossovers"][0] if k.startswith("a2a at")]
    out += ["", "PREDICTED crossover: the engine beats NCCL's ring below this density per rank:", "",
            f"| link | W | placement | all-to-all at {meta['nccl']['ring_fraction']:g} (= ring) | "
            + " | ".join(alts) + " |", "|---|---|---|---|" + "---|" * len(alts)]
    for c in res["crossovers"]:
        out.append(f"| {c['rate_gbit']:g} Gbit/s | {c['workers']} | {c['placement']} | {_pct(c['crossover'])} | "
                   + " | ".join(_pct(c[k]) for k in alts) + " |")
    return "\n".join(out)


def text(res: dict[str, Any]) -> str:
    """The same tables for the terminal, each line marked as a prediction."""
    fixed = res["meta"].get("fixed_costs")
    lines = ["PREDICTION (model output; no GPU or NCCL measured): the collective engine on NCCL against "
             "NCCL's ring all-reduce", f"parameters: {res['meta']['nccl']}",
             f"GPU rates (B/s): {res['meta']['gpu_rates']}"]
    if fixed:
        lines[0] = ("PREDICTION (model output, with MEASURED fixed costs per bucket instead of the assumed "
                    "latencies): the collective engine on NCCL against NCCL's ring all-reduce")
        lines.append(f"measured fixed costs per bucket (us), from {fixed['source']}: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in fixed["us"].items()))
    return "\n".join([*lines, markdown(res)])
