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


def allreduce_table(data: dict) -> str:
    rows, meta = data["rows"], data["meta"]
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in rows))
    by = {(r.get("label", r["method"]), r["density"]): r for r in rows}
    densities = sorted({r["density"] for r in rows}, reverse=True)
    network = meta.get("net") or "loopback"
    floors = any(r.get("floor_s") for r in rows)
    head = ["density"] + [f"{lb} ms" + (" (x floor)" if floors else "") for lb in labels]
    if "gloo" in labels:
        head.append("Gloo / omnireduce" + (" A=W" if any(lb.startswith("omnireduce A=") for lb in labels) else ""))
    out = [f"W={meta['workers']}, {network}, placement {meta['placement']}, {meta['size_mib']:g} MiB fp32, "
           f"median of {meta['iters']} after {meta['warmup']} warm-up",
           "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    omni = [lb for lb in labels if lb.startswith("omnireduce")]
    for d in densities:
        cells = [f"{d:g}"]
        for lb in labels:
            r = by.get((lb, d))
            if r is None:
                cells.append("")
            elif r.get("floor_s"):
                cells.append(f"{r['median_s'] * 1e3:.1f} ({r['time_over_floor']:.2f}x)")
            else:
                cells.append(f"{r['median_s'] * 1e3:.1f}")
        if "gloo" in labels and omni:
            cells.append(f"{by[('gloo', d)]['median_s'] / by[(omni[-1], d)]['median_s']:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    cpu = ["", "CPU per all-reduce, all ranks + aggregators, ms:", "",
           "| density | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for d in densities:
        cpu.append(f"| {d:g} | " + " | ".join(
            f"{(by[(lb, d)]['worker_cpu_s_per_op'] + by[(lb, d)].get('aggregator_cpu_s_per_op', 0)) * 1e3:.0f}"
            if (lb, d) in by else "" for lb in labels) + " |")
    return "\n".join(out + cpu)


def train_table(data: dict) -> str:
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
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        print(f"\n<!-- {path} -->")
        print(train_table(data) if "rows" in data and data["rows"] and "hook" in data["rows"][0]
              else allreduce_table(data))


if __name__ == "__main__":
    main()
