#!/usr/bin/env python3
"""Render benchmark JSON files (bench_allreduce.py, bench_train.py) as Markdown tables.

    python scripts/report.py results/allreduce_1gbit_W4.json results/bench_train.json

For docs/BENCHMARKS.md: the tables there were produced by this script from the JSON files kept in
docs/bench/, so they can be regenerated and checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def cpu_ms(row: dict[str, Any]) -> float:
    """CPU per all-reduce of one row, all ranks + aggregators, in ms."""
    return (row["worker_cpu_s_per_op"] + row.get("aggregator_cpu_s_per_op", 0.0)) * 1e3


def ratio_label(rows: list[dict[str, Any]]) -> str | None:
    """The omnireduce label that the "gloo / omnireduce" column divides by: the one with the most
    aggregators (None without gloo or omnireduce rows)."""
    if not any(r.get("label", r["method"]) == "gloo" for r in rows):
        return None
    omni = [r for r in rows if r["method"] == "omnireduce"]
    if not omni:
        return None
    best = max(omni, key=lambda r: r.get("aggregators", 1))
    return best.get("label", best["method"])


def gloo_ratio(by: dict[tuple[str, float], dict[str, Any]], label: str, density: float) -> float | None:
    """Gloo's median time over ``label``'s at ``density`` (None when either is missing)."""
    gloo, omni = by.get(("gloo", density)), by.get((label, density))
    if gloo is None or omni is None or not omni["median_s"]:
        return None
    return gloo["median_s"] / omni["median_s"]


def allreduce_table(data: dict[str, Any]) -> str:
    """The Markdown tables of one bench_allreduce.py JSON: time (x wire floor) per method, then CPU."""
    rows, meta = data["rows"], data["meta"]
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in rows))
    by = {(r.get("label", r["method"]), r["density"]): r for r in rows}
    densities = sorted({r["density"] for r in rows}, reverse=True)
    network = meta.get("net") or "loopback"
    floors = any(r.get("floor_s") for r in rows)
    head = ["density"] + [f"{lb} ms" + (" (x floor)" if floors else "") for lb in labels]
    ratio = ratio_label(rows)
    if ratio is not None:
        head.append(f"Gloo / {ratio}")
    out = [f"W={meta['workers']}, {network}, placement {meta['placement']}, {meta['size_mib']:g} MiB fp32, "
           f"median of {meta['iters']} after {meta['warmup']} warm-up",
           "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in densities:
        cells = [f"{d:g}"]
        for lb in labels:
            r = by.get((lb, d))
            if r is None:
                cells.append("")
            elif r.get("floor_s") and r.get("time_over_floor") is not None:
                cells.append(f"{r['median_s'] * 1e3:.1f} ({r['time_over_floor']:.2f}x)")
            else:
                cells.append(f"{r['median_s'] * 1e3:.1f}")
        if ratio is not None:
            x = gloo_ratio(by, ratio, d)
            cells.append("" if x is None else f"{x:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    cpu = ["", "CPU per all-reduce, all ranks + aggregators, ms:", "",
           "| density | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for d in densities:
        cpu.append(f"| {d:g} | " + " | ".join(f"{cpu_ms(by[(lb, d)]):.0f}" if (lb, d) in by else ""
                                              for lb in labels) + " |")
    return "\n".join(out + cpu)


def train_table(data: dict[str, Any]) -> str:
    """The Markdown table of one bench_train.py JSON: one line per (model, network, hook)."""
    out = ["| model | network | hook | median step ms | MB sent / step / worker | loss after N steps |",
           "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if r.get("error"):
            out.append(f"| {r['model']} | {r['network']} | {r['hook']} | failed: {r['error'][:60]} | | |")
            continue
        out.append(f"| {r['model']} | {r['network']} | {r['hook']} | {r['median_step_s'] * 1e3:.1f} | "
                   f"{r['mb_per_step']:.2f} | {r['final_loss']:.4f} |")
    return "\n".join(out)


def main() -> None:
    """Print the tables of every JSON file named on the command line."""
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        print(f"\n<!-- {path} -->")
        print(train_table(data) if "rows" in data and data["rows"] and "hook" in data["rows"][0]
              else allreduce_table(data))


if __name__ == "__main__":
    main()
