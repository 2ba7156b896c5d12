"""PREDICTION: how far the collective engine's host time per bucket moves the density below which it
beats NCCL's ring, for DDP's 25 MiB buckets and 100 MiB ones (``cost_model.py host``).

The model is :mod:`ombench.collcost`'s, unchanged: per bucket the engine's host work, NCCL's
published small-message latency for each collective of its plan, each collective's bytes at a
fraction of line rate, and the kernel passes, one after the other; the ring gets its latency and
the same rate. Only the host time per bucket changes from column to column: the one MEASURED
(by default the W=1 rows of the last H200 run, the engine thread's CPU per reduction; after a GPU
run of ``gpu_nccl_check.py graphs``, its W=1 buckets uncaptured and with CUDA graphs, each less the
wait for the counts), and the targets (300 us a bucket uncaptured, 100 us with CUDA graphs). At
W=1 nothing crosses a wire, so what the engine costs there is host time: the number that carries
over to any fabric. Every cell is a model output, labelled PREDICTION.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ombench.collcost import (
    GBIT,
    LABEL,
    GpuRates,
    Measured,
    NcclParams,
    Setting,
    _crossovers,
    crossover_cell,
    inputs_lines,
)
from omnireduce.engines.plan import DEFAULT_LATENCY_BYTES

TARGETS_US = (("target, uncaptured", 300.0), ("target, CUDA graphs", 100.0))


def hosts_of(measured: Measured, targets: Sequence[tuple[str, float]] = TARGETS_US) -> list[tuple[str, float]]:
    """The host times the table is computed at: the measured one (and, from a graphs run, the one with
    CUDA graphs), then ``targets``."""
    out = [("measured" if measured.kind != "graphs" else "measured, uncaptured", measured.host_us)]
    if measured.kind == "graphs":
        out.append(("measured, CUDA graphs", float(measured.detail["graphs_host_us"])))
    return out + [(name, float(us)) for name, us in targets]


def sweep(sizes_mib: Sequence[float], worlds: Sequence[int], rates_gbit: Sequence[float], nccl: NcclParams,
          gpu: GpuRates, measured: Measured, targets: Sequence[tuple[str, float]] = TARGETS_US,
          block_bytes: int = 1024, latency_bytes: float = DEFAULT_LATENCY_BYTES) -> dict[str, Any]:
    """Per bucket size, line rate, world size and placement: NCCL's ring time and the crossover density
    at each host time (:func:`hosts_of`). Every number is a PREDICTION."""
    hosts = hosts_of(measured, targets)
    rows = []
    for size in sizes_mib:
        for rate in rates_gbit:
            for W in worlds:
                base = Setting(size * (1 << 20), W, rate * GBIT, nccl, gpu, measured.host_us * 1e-6, block_bytes,
                               latency_bytes)
                ring = base.ring()
                for placement in ("random", "overlap"):
                    rows.append({"size_mib": size, "rate_gbit": rate, "workers": W, "placement": placement,
                                 "ring_ms": ring * 1e3,
                                 "by_host": [{"host": name, "host_us": us,
                                              **_crossovers(dataclasses.replace(base, host_s=us * 1e-6), placement,
                                                            ring)} for name, us in hosts]})
    return {"meta": {"prediction": True, "label": f"{LABEL}: model output, not a measurement",
                     "sizes_mib": list(sizes_mib), "block_bytes": block_bytes, "latency_bytes": latency_bytes,
                     "nccl": dataclasses.asdict(nccl), "gpu_rates": dataclasses.asdict(gpu),
                     "measured": measured.as_dict(), "hosts": [{"host": n, "host_us": h} for n, h in hosts],
                     "latency_source": "NCCL src/graph/tuning.cc: baseLat, hwLat (LL; PAT Simple), ncclTopoTuneModel "
                                       "(published model constants, not measured here)"},
            "rows": rows}


def table_lines(res: dict[str, Any]) -> list[str]:
    """The crossover per bucket, link, GPUs and placement, a column per host time."""
    hosts = res["meta"]["hosts"]
    head = [f"host {h['host_us']:.0f} us ({h['host']})" for h in hosts]
    out = ["| bucket | link | GPUs | placement | NCCL ring ms | " + " | ".join(head) + " |",
           "|---|---|---|---|---|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [crossover_cell(h) for h in r["by_host"]]
        out.append(f"| {r['size_mib']:g} MiB | {r['rate_gbit']:g} Gbit/s | {r['workers']} | {r['placement']} | "
                   f"{r['ring_ms']:.2f} | " + " | ".join(cells) + " |")
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    """The docs' block (docs/bench/gpu_nccl.md)."""
    return [f"{LABEL} (cost model, not measured). Inputs:", "", *(f"- {line}" for line in inputs_lines(res)), "",
            f"{LABEL}: the density per rank below which the engine beats NCCL's ring, per host time per bucket "
            "(in brackets the engine's plan there; 'never': not even with one block per rank; 'again from': "
            "where a plan for denser buckets wins again):", "",
            *table_lines(res)]


def text(res: dict[str, Any]) -> str:
    """For the terminal, every line marked as a prediction."""
    body = [f"the collective engine's crossover against NCCL's ring per host time ({res['meta']['label']})",
            *inputs_lines(res), "", *table_lines(res)]
    return "\n".join(f"{LABEL} | {line}" for line in body)
