"""The benchmarks' tables, as text: fixed-width ones for the terminal, Markdown ones for the lab notebook (docs/log/).

Every function takes the rows the benchmarks write to their JSON (one dict per method and density,
or per model, network and hook) and returns the table; the scripts print it. The derived columns
are computed in one place each, so the terminal and the Markdown tables cannot disagree: CPU per
all-reduce (:func:`cpu_ms`) and Gloo's time over omnireduce's (:func:`gloo_ratio`, against the
omnireduce row with the most aggregators, :func:`ratio_label`, and against the collective engine's
where the run has one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ombench.hooks import HOOKS

Rows = list[dict[str, Any]]


def cpu_ms(row: dict[str, Any]) -> float:
    """CPU per all-reduce of one row, all ranks + aggregators, in ms."""
    return (row["worker_cpu_s_per_op"] + row.get("aggregator_cpu_s_per_op", 0.0)) * 1e3


def ratio_label(rows: Rows) -> str | None:
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


# -- bench_allreduce.py, on the terminal


def loopback_table(rows: Rows, labels: list[str], densities: list[float]) -> str:
    """Median ms and CPU per all-reduce per method, and gloo over omnireduce."""
    by = {(r["label"], r["density"]): r for r in rows}
    omni = ratio_label(rows)
    width = {m: max(14, len(m) + 3) for m in labels}
    short = {m: m[:5] if " A=" not in m else "om" + m.rsplit(" ", 1)[1] for m in labels}  # "omnir", "omA=4"
    out = ["", "median time per all-reduce (slowest rank), ms; CPU = all ranks + aggregators per all-reduce, ms",
           f"{'density':>8} " + " ".join(f"{m + ' ms':>{width[m]}}" for m in labels)
           + " ".join(f"{short[m] + ' CPU':>11}" for m in labels)
           + (f"   gloo/{omni}" if omni else "") + f"{'scan floor':>12}" + (f"{'CPU/floor':>11}" if omni else "")]
    for d in densities:
        line = f"{d:>8} " + " ".join(f"{by[(m, d)]['median_s'] * 1e3:>{width[m]}.2f}" for m in labels)
        line += " ".join(f"{cpu_ms(by[(m, d)]):>11.0f}" for m in labels)
        if omni:
            x = gloo_ratio(by, omni, d)
            line += f"   {'-' if x is None else f'{x:.2f}x':>{len(omni) + 7}}"
        floor = scan_floor_ms(by, labels, d)
        line += f"{'-' if floor is None else f'{floor:.1f}':>12}"
        if omni:
            line += f"{'-' if not floor else f'{cpu_ms(by[(omni, d)]) / floor:.2f}x':>11}"
        out.append(line)
    out.append("scan floor: one pass over every rank's tensor to find its non-zero blocks (block_nonzero, "
               "timed in each rank), summed over ranks, ms")
    return "\n".join(out)


def scan_floor_ms(by: dict[tuple[str, float], dict[str, Any]], labels: list[str], density: float) -> float | None:
    """The scan floor measured at ``density`` (CPU ms of one read of every rank's tensor), if recorded."""
    for lb in labels:
        floor = by.get((lb, density), {}).get("scan_floor_cpu_s")
        if floor:
            return float(floor) * 1e3
    return None


def net_table(rows: Rows, labels: list[str], densities: list[float], net: str) -> str:
    """Time, wire floor and time/floor per method and density ('-' where the floor is 0); then CPU."""
    by = {(r["label"], r["density"]): r for r in rows}
    width = 26
    out = ["", f"median time per all-reduce (slowest rank) | floor = busiest link direction's payload bytes / {net} "
           "| x = time / floor",
           f"{'':>8} " + " ".join(f"{lb:^{width}}" for lb in labels),
           f"{'density':>8} " + " ".join(f"{'time ms':>9} {'floor ms':>9} {'x':>6}" for _ in labels)]
    for d in densities:
        cells = []
        for lb in labels:
            r = by[(lb, d)]
            floor, over = r.get("floor_s"), r.get("time_over_floor")
            floor_ms = f"{floor * 1e3:>9.1f}" if floor else f"{'-':>9}"
            x = f"{over:>5.2f}x" if floor and over is not None else f"{'-':>6}"
            cells.append(f"{r['median_s'] * 1e3:>9.1f} {floor_ms} {x}")
        out.append(f"{d:>8} " + " ".join(cells))
    out += ["floors: omnireduce from the actual non-zero blocks and the slot -> aggregator layout; gloo: ring, "
            "2 (W-1)/W N per rank;\n        mpi: the ring figure as a lower bound (MPICH picks its own algorithm); "
            "agsparse: (W-1) K (4 B + 8) per rank;\n        payload only (no headers, bitmaps or TCP/IP/Ethernet "
            "framing: tbf counts frames, so ~1.05x is the practical best); '-': nothing to move",
            "", "CPU per all-reduce (all ranks + aggregators), ms",
            f"{'density':>8} " + " ".join(f"{lb:>16}" for lb in labels)]
    for d in densities:
        out.append(f"{d:>8} " + " ".join(f"{cpu_ms(by[(lb, d)]):>16.0f}" for lb in labels))
    return "\n".join(out)


# -- bench_train.py, on the terminal


def train_summary(rows: Rows, workers: int, steps: int, warmup: int, *, models: Sequence[str], last_n: int) -> str:
    """One line per (model, network, hook), in ``models``' order, then the networks' (as they come), then
    :data:`~ombench.hooks.HOOKS`'; step time and MB against the same model and network's allreduce."""
    out = ["", f"W={workers}, {steps} steps ({warmup} warm-up); step time = median of the slowest rank's; "
           f"MB (2^20 B) sent per step per worker; loss = mean of the last {last_n} steps",
           f"{'model':<13} {'network':<9} {'hook':<20} {'step ms':>9} {'vs allred.':>10} {'MB/step':>9} "
           f"{'vs allred.':>10} {'CPU ms':>8} {'final loss':>11}"]
    base = {(r["model"], r["network"]): r for r in rows if r["hook"] == "allreduce" and "error" not in r}
    nets = list(dict.fromkeys(r["network"] for r in rows))
    order = list(HOOKS)
    for r in sorted(rows, key=lambda r: (models.index(r["model"]), nets.index(r["network"]), order.index(r["hook"]))):
        if "error" in r:
            out.append(f"{r['model']:<13} {r['network']:<9} {r['hook']:<20} FAILED: {r['error']}")
            continue
        ref = base.get((r["model"], r["network"]))
        speed = f"{ref['median_step_s'] / r['median_step_s']:.2f}x" if ref else "-"
        frac = f"{r['mb_per_step'] / ref['mb_per_step'] * 100:.1f}%" if ref and ref["mb_per_step"] else "-"
        cpu = f"{r['cpu_ms_per_step']:.0f}" if "cpu_ms_per_step" in r else "-"
        out.append(f"{r['model']:<13} {r['network']:<9} {r['hook']:<20} {r['median_step_s'] * 1e3:>9.1f} {speed:>10} "
                   f"{r['mb_per_step']:>9.2f} {frac:>10} {cpu:>8} {r['final_loss']:>11.4f}")
    return "\n".join(out)


# -- Markdown, from the JSON files (scripts/report.py)


def allreduce_markdown(data: dict[str, Any]) -> str:
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
    engine = "collective" if "collective" in labels and "gloo" in labels else None  # the collective engine's ratio
    if engine is not None:
        head.append("Gloo / collective")
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
        for lb in (ratio, engine):
            if lb is not None:
                x = gloo_ratio(by, lb, d)
                cells.append("" if x is None else f"{x:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    scans = any(r.get("scan_floor_cpu_s") for r in rows)
    cpu = ["", "CPU per all-reduce, all ranks + aggregators, ms" + (" (scan floor: one read of every rank's "
           "tensor)" if scans else "") + ":", "",
           "| density | " + " | ".join(labels) + (" | scan floor" if scans else "") + " |",
           "|" + "---|" * (len(labels) + 1 + scans)]
    for d in densities:
        floor = scan_floor_ms(by, labels, d) if scans else None
        cells = []
        for lb in labels:
            if (lb, d) not in by:
                cells.append("")
                continue
            c = cpu_ms(by[(lb, d)])
            cells.append(f"{c:.0f}" + (f" ({c / floor:.2f}x)" if floor else ""))
        tail = (" | " + (f"{floor:.1f}" if floor else "")) if scans else ""
        cpu.append(f"| {d:g} | " + " | ".join(cells) + tail + " |")
    return "\n".join(out + cpu)


def train_markdown(data: dict[str, Any]) -> str:
    """The Markdown table of one bench_train.py JSON: one line per (model, network, hook); CPU
    columns when the run measured them."""
    cpu = any("cpu_ms_per_step" in r for r in data["rows"])
    extra = " CPU ms / step / worker | aggregator CPU ms / step |" if cpu else ""
    out = ["| model | network | hook | median step ms | MB sent / step / worker |" + extra + " loss after N steps |",
           "|---|---|---|---|---|" + ("---|---|" if cpu else "") + "---|"]
    for r in data["rows"]:
        if r.get("error"):
            out.append(f"| {r['model']} | {r['network']} | {r['hook']} | failed: {r['error'][:60]} | |"
                       + (" | |" if cpu else "") + " |")
            continue
        cells = ""
        if cpu:
            agg = r.get("agg_cpu_ms_per_step")
            cells = f" {r.get('cpu_ms_per_step', float('nan')):.0f} | {'-' if agg is None else f'{agg:.0f}'} |"
        out.append(f"| {r['model']} | {r['network']} | {r['hook']} | {r['median_step_s'] * 1e3:.1f} | "
                   f"{r['mb_per_step']:.2f} |{cells} {r['final_loss']:.4f} |")
    return "\n".join(out)


PATH_HOOKS = ("allreduce", "omnireduce-threshold", "omnireduce")
"""The settings the path-choice table compares: plain DDP, the threshold rule, measuring (the default)."""


def bucket_paths(row: dict[str, Any], warmup: int) -> str:
    """The buckets a hook row sent ``dense / omnireduce`` per timed step (``a / b`` when every
    timed step did the same, else the range of each), from its ``buckets_per_step``."""
    steps = (row.get("omnireduce") or {}).get("buckets_per_step", {}).get("steps", [])[warmup:]
    if not steps:
        return "-"
    dense, omni = sorted({s[0] for s in steps}), sorted({s[1] for s in steps})

    def span(v: list[int]) -> str:
        return str(v[0]) if len(v) == 1 else f"{v[0]}-{v[-1]}"

    return f"{span(dense)} / {span(omni)}"


def measured_paths(row: dict[str, Any]) -> str:
    """Each bucket's agreed path and the agreed (slowest rank's median) times of both paths, from
    ``stats()["paths"]``: ``0 dense (59 / 50 ms)``, omnireduce's time first (with the collective
    engine measured too, ``0 dense (59 / 61 / 50)``, its time between; ``(vetoed)``: dense by the
    step check); then each step check: the buckets, the plan's and the dense steps' medians."""
    paths = (row.get("omnireduce") or {}).get("paths") or {}

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"

    def times(p: dict[str, Any]) -> str:  # (the collective engine's time between, where it was measured)
        aggregators = "aggregators" if "aggregators_ms" in p else "omnireduce"  # (its name in older runs)
        ways = (aggregators, "collective", "dense") if "collective_ms" in p else (aggregators, "dense")
        return " / ".join(ms(p.get(f"{w}_ms")) for w in ways)

    buckets = "; ".join(f"{i} {p.get('path')}{' (vetoed)' if p.get('vetoed_by_step_check') else ''} ({times(p)})"
                        for i, p in sorted(paths.items(), key=lambda kv: int(kv[0]))) or "-"
    checks = (row.get("omnireduce") or {}).get("step_checks") or []
    return buckets + "".join(f"; step check {c['buckets']}: {ms(c['plan_ms'])} / {ms(c['dense_ms'])} ms, "
                             f"{'kept' if c['kept'] else 'dense'}" for c in checks)


def path_choice_markdown(data: dict[str, Any]) -> str:
    """The Markdown table of a bench_train.py run with the hooks of :data:`PATH_HOOKS`: per (model,
    network), the three median step times (``-``: not run), ``measure``'s against plain DDP's and
    the threshold rule's, the buckets each sent dense / through omnireduce in the timed steps, each
    bucket's measured decision with both agreed times, and the machine's load during the three."""
    warmup = data["meta"]["warmup"]
    by = {(r["model"], r["network"], r["hook"]): r for r in data["rows"]}
    out = ["| model | network | allreduce ms | threshold ms | measure ms | measure / allreduce | "
           "measure / threshold | threshold buckets dense / omni | measure buckets dense / omni | "
           "measure: bucket path (omnireduce / [collective /] dense ms agreed) | load (1 min) |",
           "|---|---|---:|---:|---:|---:|---:|---|---|---|---|"]
    for model, net in dict.fromkeys((r["model"], r["network"]) for r in data["rows"]):
        found = [by.get((model, net, h)) for h in PATH_HOOKS]
        base, thr, mea = (r if r is not None and "error" not in r else None for r in found)
        times = ["-" if f is None else "failed" if r is None else f"{r['median_step_s'] * 1e3:.1f}"
                 for f, r in zip(found, (base, thr, mea), strict=True)]
        ratios = ["-" if r is None or ref is None else f"{r['median_step_s'] / ref['median_step_s']:.2f}"
                  for r, ref in ((mea, base), (mea, thr))]
        loads = [v for f in found if f is not None for v in f.get("loadavg_1min", [])]
        cells = [model, net, *times, *ratios, bucket_paths(thr, warmup) if thr else "-",
                 bucket_paths(mea, warmup) if mea else "-", measured_paths(mea) if mea else "-",
                 f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown(data: dict[str, Any]) -> str:
    """The Markdown of a JSON file written by either benchmark (told apart by its rows); a
    bench_train.py run with the threshold rule's hook gets the path-choice table too."""
    if "rows" in data and data["rows"] and "hook" in data["rows"][0]:
        if any(r["hook"] == "omnireduce-threshold" for r in data["rows"]):
            return train_markdown(data) + "\n\n" + path_choice_markdown(data)
        return train_markdown(data)
    return allreduce_markdown(data)
