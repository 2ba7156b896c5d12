"""The hierarchy's predictions: the sweep, its tables (text and markdown) and its plot.

:func:`sweep` runs the model of :mod:`ombench.hiercost` over node counts, NIC rates, per-GPU
densities, the two block placements and the two deployments, with each fitted path's CPU costs and
with none (``wire``), and finds where each omnireduce scheme stops beating the hierarchical ring
at its floor (:func:`ombench.hiercost.crossover` on a fine density grid). The result is one JSON-able
dict; :func:`text_tables`, :func:`markdown` and :func:`plot` only read it. Every number it holds is
a PREDICTION of the cost model, not a measurement; the tables and the plot say so.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ombench import hiercost as hc
from ombench.costmodel import CostParams
from omnireduce.config import DEFAULT_LANES

NODES = (2, 4, 8, 16, 32, 64)
RATES_GBIT = (100, 400)
DENSITIES = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)
DEPLOYMENTS = {"spread": True, "as coded": False}
SCHEMES = ("hier omnireduce", "flat omnireduce")
LABEL = "PREDICTION (cost model, not measured)"
CPU_CUTS = (10, 100)  # the primary path's CPU costs divided by these, as well


@dataclasses.dataclass(frozen=True)
class Setting:
    """What the sweep holds fixed: the buffer, the node, the links' latency, the grid."""

    size_mib: float = 100
    block: int = 256
    gpus: int = 8
    nvlink_gbyte_s: float = 300.0
    latency_s: float = 25e-6
    grid: int = 31
    nodes: tuple[int, ...] = NODES
    rates_gbit: tuple[float, ...] = RATES_GBIT
    lanes: int = DEFAULT_LANES  # the Worker's lane limit (OMNIREDUCE_LANES): fewer lanes, more slots

    @property
    def numel(self) -> int:
        return int(self.size_mib * (1 << 20)) // 4

    def fine(self) -> list[float]:
        """The densities of the crossovers: the table's and a geometric grid from 0.5 to 0.001."""
        grid = np.geomspace(max(DENSITIES), min(DENSITIES), self.grid).round(6).tolist()
        return sorted(set(grid) | set(DENSITIES), reverse=True)


def sweep(params: dict[str, CostParams], primary: str, s: Setting) -> dict[str, Any]:
    """Every prediction: ``rows`` (one per deployment, rate, node count, scheme, placement and table
    density, with the ``primary`` path's CPU costs, and the no-CPU time beside) and ``crossovers``
    (per deployment, rate, node count, placement: the density above which each scheme, with each
    path's CPU costs and with none, is slower than the hierarchical ring floor)."""
    nbytes = s.numel * 4.0
    fine = s.fine()
    costs = {**params, **{f"{primary} / {f:g}": hc.scaled(params[primary], 1 / f) for f in CPU_CUTS},
             "wire": CostParams()}
    rows: list[dict[str, Any]] = []
    crossovers: list[dict[str, Any]] = []
    for dep, spread in DEPLOYMENTS.items():
        for N in s.nodes:
            base = hc.Cluster(nodes=N, nic_bytes_s=1.0, gpus=s.gpus, nvlink_bytes_s=s.nvlink_gbyte_s * 1e9,
                              latency_s=s.latency_s, spread=spread)
            structure = {"hier omnireduce": hc.jobs_structure(base, True, s.numel, s.block, lanes=s.lanes),
                         "flat omnireduce": hc.jobs_structure(base, False, s.numel, s.block, lanes=s.lanes)}
            for rate in s.rates_gbit:
                c = dataclasses.replace(base, nic_bytes_s=hc.gbit(rate))
                ring = hc.hierarchical_ring_floor(nbytes, c)
                key = {"deployment": dep, "nodes": N, "rate_gbit": rate}
                rows.append({**key, "scheme": "hier ring floor", "placement": "-", "time_s": ring.time_s,
                             "bound": ring.bound, "terms_s": ring.terms})
                for placement in hc.PLACEMENTS:
                    cross: dict[str, Any] = {**key, "placement": placement}
                    for scheme in SCHEMES:
                        times = {path: [_time(scheme, nbytes, structure[scheme], d, placement, q, c).time_s
                                        for d in fine] for path, q in costs.items()}
                        for path in costs:
                            cross[f"{scheme} ({path})"] = hc.crossover(fine, times[path], [ring.time_s] * len(fine))
                        for d in DENSITIES:
                            pr = _time(scheme, nbytes, structure[scheme], d, placement, params[primary], c)
                            sent, union = hc.densities(d, c, placement, scheme == "hier omnireduce")
                            rows.append({**key, "scheme": scheme, "placement": placement, "density": d,
                                         "member_density": sent, "union_density": union,
                                         "time_s": pr.time_s, "bound": pr.bound, "terms_s": pr.terms,
                                         "wire_only_s": times["wire"][fine.index(d)]})
                    crossovers.append(cross)
    return {"meta": {"kind": LABEL, "size_mib": s.size_mib, "block": s.block, "numel": s.numel, "gpus": s.gpus,
                     "lanes": s.lanes,
                     "nvlink_gbyte_s_per_gpu_direction": s.nvlink_gbyte_s, "latency_s": s.latency_s,
                     "cpu_path": primary, "params": {k: q.to_dict() for k, q in params.items()},
                     "hier ring floor": "2 (G-1)/G n / B + 2 (N-1)/N (n/G) / R",
                     "traffic": "expected, random block placement", "deployments": {
                         "spread": "P = G aggregators per node, one per NIC, rails' slots staggered",
                         "as coded": "P = 1 aggregator per node, on one NIC, every rail's slot s at "
                                     "aggregator s mod A"},
                     "crossover": f"density above which the scheme is slower than the hierarchical ring floor "
                                  f"(grid of {len(fine)} densities {max(fine)}..{min(fine)}, log-log interpolation)",
                     "time": time.strftime("%Y-%m-%d %H:%M:%S")},
            "rows": rows, "crossovers": crossovers}


def _time(scheme: str, nbytes: float, structure: hc.JobsStructure, d: float, placement: str, p: CostParams,
          c: hc.Cluster) -> Any:
    if scheme == "hier omnireduce":
        return hc.hierarchical_omnireduce(nbytes, structure, d, placement, p, c)
    return hc.flat_omnireduce(structure, d, placement, p, c)


def to_json(res: dict[str, Any]) -> str:
    """``res`` as JSON, one row or crossover per line, numbers to 5 significant digits."""
    def rounded(x: Any) -> Any:
        if isinstance(x, float):
            return float(f"{x:.5g}")
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rounded(v) for v in x]
        return x

    r = rounded(res)
    parts = [f'"meta": {json.dumps(r["meta"], indent=1)}']
    for key in ("rows", "crossovers"):
        parts.append(f'"{key}": [\n' + ",\n".join(json.dumps(v) for v in r[key]) + "\n]")
    return "{\n" + ",\n".join(parts) + "\n}\n"


# --------------------------------------------------------------------------------------------
# tables


def crossover_text(c: dict[str, Any]) -> str:
    """A crossover for the tables: the density, ``all`` (faster up to 0.5), ``none`` (slower down to 0.001)."""
    if c["density"] is not None:
        return f"{c['density']:.2g}"
    return "all" if c["always"] else "none"


def _row(res: dict[str, Any], dep: str, rate: float, N: int, scheme: str, placement: str) -> dict[float, dict]:
    return {r["density"]: r for r in res["rows"] if r["deployment"] == dep and r["rate_gbit"] == rate
            and r["nodes"] == N and r["scheme"] == scheme and r["placement"] == placement}


def _ring(res: dict[str, Any], dep: str, rate: float, N: int) -> float:
    return next(r["time_s"] for r in res["rows"] if r["deployment"] == dep and r["rate_gbit"] == rate
                and r["nodes"] == N and r["scheme"] == "hier ring floor")


def time_lines(res: dict[str, Any], dep: str, nodes: Sequence[int] | None = None) -> list[list[str]]:
    """Rows of the times table (ms) of one deployment: per rate and node count, the ring floor, then
    each scheme and placement with the primary path's CPU costs, then hier omnireduce with no CPU."""
    out = []
    meta_nodes = sorted({r["nodes"] for r in res["rows"]})
    rates = sorted({r["rate_gbit"] for r in res["rows"]})
    for rate in rates:
        for N in nodes or meta_nodes:
            ring = _ring(res, dep, rate, N)
            out.append([f"{rate:g}", str(N), "hier ring floor"] + [f"{ring * 1e3:.2f}"] * len(DENSITIES))
            for scheme in SCHEMES:
                for placement in hc.PLACEMENTS:
                    mine = _row(res, dep, rate, N, scheme, placement)
                    out.append([f"{rate:g}", str(N), f"{scheme}, {placement}"]
                               + [f"{mine[d]['time_s'] * 1e3:.1f}" for d in DENSITIES])
            for placement in hc.PLACEMENTS:
                mine = _row(res, dep, rate, N, "hier omnireduce", placement)
                out.append([f"{rate:g}", str(N), f"hier omnireduce, {placement}, no CPU"]
                           + [f"{mine[d]['wire_only_s'] * 1e3:.2f}" for d in DENSITIES])
    return out


def crossover_lines(res: dict[str, Any], dep: str,
                    keys: Sequence[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of the crossover table of one deployment: per rate and node count, each
    scheme and CPU path (``keys``; None: all), independent and overlapping placement as ``a / b``."""
    first = next(c for c in res["crossovers"] if c["deployment"] == dep)
    keys = list(keys or [k for k in first if k not in ("deployment", "nodes", "rate_gbit", "placement")])
    out = []
    for c in res["crossovers"]:
        if c["deployment"] != dep or c["placement"] != "independent":
            continue
        o = next(x for x in res["crossovers"] if x["deployment"] == dep and x["nodes"] == c["nodes"]
                 and x["rate_gbit"] == c["rate_gbit"] and x["placement"] == "overlapping")
        out.append([f"{c['rate_gbit']:g}", str(c["nodes"])]
                   + [f"{crossover_text(c[k])} / {crossover_text(o[k])}" for k in keys])
    return keys, out


def text_tables(res: dict[str, Any]) -> str:
    """The tables as plain text (what the subcommand prints)."""
    lines = [f"{LABEL}: one step's reduction of {res['meta']['size_mib']:g} MiB fp32 on nodes of "
             f"{res['meta']['gpus']} GPUs, NVLink {res['meta']['nvlink_gbyte_s_per_gpu_direction']:g} GB/s, "
             f"CPU costs of the {res['meta']['cpu_path']} path"]
    for dep in DEPLOYMENTS:
        lines.append(f"\n[{dep}] ms; columns: per-GPU density")
        lines.append(f"  {'Gbit/s':>6} {'N':>3} {'scheme':<40} " + " ".join(f"{d:>7g}" for d in DENSITIES))
        for r in time_lines(res, dep):
            lines.append(f"  {r[0]:>6} {r[1]:>3} {r[2]:<40} " + " ".join(f"{v:>7}" for v in r[3:]))
        keys, rows = crossover_lines(res, dep)
        lines.append(f"\n[{dep}] crossover vs the hierarchical ring floor (independent / overlapping placement): "
                     "the density above which the scheme is slower; all: faster up to 0.5; none: slower down to 0.001")
        lines.append(f"  {'Gbit/s':>6} {'N':>3} " + " ".join(f"{k:>28}" for k in keys))
        for r in rows:
            lines.append(f"  {r[0]:>6} {r[1]:>3} " + " ".join(f"{v:>28}" for v in r[2:]))
    return "\n".join(lines)


def markdown_keys(res: dict[str, Any]) -> list[str]:
    """The crossover columns of the documented tables: the hierarchy with the primary path's CPU
    costs, a tenth and a hundredth of them, and none; flat omnireduce with a hundredth and none
    (the other path's costs and flat omnireduce's at full cost are in the JSON: none ever crosses)."""
    p = res["meta"]["cpu_path"]
    return [f"hier omnireduce ({p})", *(f"hier omnireduce ({p} / {f:g})" for f in CPU_CUTS), "hier omnireduce (wire)",
            f"flat omnireduce ({p} / {max(CPU_CUTS):g})", "flat omnireduce (wire)"]


def markdown(res: dict[str, Any], nodes: Sequence[int] | None = (2, 8, 64)) -> str:
    """The markdown tables of docs/log/2026-11-23-memory-cost-model-cpu.md: the crossovers of both deployments
    (:func:`markdown_keys`), and the times of the spread deployment at ``nodes`` (None: all)."""
    out = []
    for dep in DEPLOYMENTS:
        keys, rows = crossover_lines(res, dep, markdown_keys(res))
        out += [f"<!-- {dep} -->", "| PREDICTION: NIC Gbit/s | nodes | " + " | ".join(keys) + " |",
                "|---|---|" + "---|" * len(keys)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    out += ["| PREDICTION: NIC Gbit/s | nodes | scheme | " + " | ".join(f"{d:g}" for d in DENSITIES) + " |",
            "|---|---|---|" + "---|" * len(DENSITIES)]
    out += ["| " + " | ".join(r) + " |" for r in time_lines(res, "spread", nodes)]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# plot


def plot(res: dict[str, Any], path: Path, nodes: Sequence[int] = (8, 64)) -> None:
    """Per NIC rate (rows): times against density at ``nodes`` (spread deployment), and the
    crossover densities against the node count (both deployments)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_gbit"] for r in res["rows"]})
    fig, axes = plt.subplots(len(rates), len(nodes) + 1, figsize=(5 * (len(nodes) + 1), 4.2 * len(rates) + 1.6))
    axes = np.atleast_2d(axes)
    colors = {"hier omnireduce": "tab:blue", "flat omnireduce": "tab:red"}
    styles = {"independent": "-", "overlapping": "--"}
    xs = list(DENSITIES)
    for i, rate in enumerate(rates):
        for j, N in enumerate(nodes):
            ax = axes[i][j]
            for scheme in SCHEMES:
                for placement in hc.PLACEMENTS:
                    mine = _row(res, "spread", rate, N, scheme, placement)
                    ax.plot(xs, [mine[d]["time_s"] * 1e3 for d in xs], styles[placement], color=colors[scheme],
                            marker="o", ms=3, label=f"{scheme}, {placement}")
                    if scheme == "hier omnireduce":
                        ax.plot(xs, [mine[d]["wire_only_s"] * 1e3 for d in xs], styles[placement], color="tab:cyan",
                                label=f"hier omnireduce, {placement}, no CPU")
            ax.axhline(_ring(res, "spread", rate, N) * 1e3, color="black", linestyle=":", label="hier ring floor")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{N} nodes x {res['meta']['gpus']} GPUs, {rate:g} Gbit/s NICs (spread)", fontsize=9)
            ax.set_xlabel("per-GPU density")
            ax.set_ylabel("ms per step's reduction")
        ax = axes[i][len(nodes)]
        p = res["meta"]["cpu_path"]
        lines = [("spread", "hier omnireduce (wire)", "tab:cyan"),
                 ("spread", f"hier omnireduce ({p} / 100)", "tab:green"),
                 ("spread", f"hier omnireduce ({p} / 10)", "tab:blue"),
                 ("spread", "flat omnireduce (wire)", "tab:red"),
                 ("as coded", "hier omnireduce (wire)", "tab:gray")]
        for dep, key, color in lines:
            for placement in hc.PLACEMENTS:
                cs = sorted((c for c in res["crossovers"] if c["deployment"] == dep and c["rate_gbit"] == rate
                             and c["placement"] == placement), key=lambda c: c["nodes"])
                pts = [(c["nodes"], c[key]["density"] if c[key]["density"] is not None else max(DENSITIES))
                       for c in cs if c[key]["density"] is not None or c[key]["always"]]
                if pts:
                    ax.plot(*zip(*pts, strict=True), styles[placement], marker="x" if dep == "as coded" else "o",
                            color=color, label=f"{key}, {placement}, {dep}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(min(DENSITIES) * 0.8, max(DENSITIES) * 1.3)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"crossover vs hier ring floor, {rate:g} Gbit/s", fontsize=9)
        ax.set_xlabel("nodes (a missing point: slower at every density; at 0.5: faster at all)", fontsize=8)
        ax.set_ylabel("density above which the ring floor wins")
    for col, anchor in ((0, (0.02, 0.0)), (len(nodes), (0.45, 0.0))):
        handles, labels = axes[0][col].get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        fig.legend(list(seen.values()), list(seen), loc="lower left", bbox_to_anchor=anchor, ncol=2, fontsize=7)
    fig.suptitle(f"{LABEL}: {res['meta']['size_mib']:g} MiB fp32, CPU costs fitted on a 2-core VM, "
                 f"NVLink {res['meta']['nvlink_gbyte_s_per_gpu_direction']:g} GB/s", fontsize=11, color="darkred")
    fig.tight_layout(rect=(0, 0.14, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
