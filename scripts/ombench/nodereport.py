"""scripts/bench_hierarchy.py's output: Markdown tables and a plot, from its rows.

Rows come in two kinds, one per part of the benchmark, each with its ``network``, ``method`` (the
micro-benchmark's names, :data:`ombench.nodemethods.METHODS`) or ``hook`` (bench_train.py's), the
median time, the bytes the library counted, and ``link``: the bytes that crossed each node's link
per operation or step (:func:`ombench.linkbytes.summary`; None on loopback). The tables print, per
network (and density), every method's median time and busiest node-link bytes, with their ratios
against the Gloo ring and against flat omnireduce, and the wire floor: the busiest direction's
bytes over the link rate (what the link needs at the very least to carry what was measured).

The tables are GitHub Markdown, so that the lab notebook (docs/log/) quotes them as printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ombench.nodemethods import LABELS, PARTIAL

Rows = list[dict[str, Any]]
MB = 2**20
TRAIN_LABELS = {"allreduce": "Gloo ring (DDP default)", "hier-dense": "hier. dense (NCCL-like)",
                "omnireduce-flat": "flat omnireduce", "omnireduce-hier": "hier. omnireduce",
                "omnireduce-auto": "omnireduce (default: measured)"}
RING = {"micro": "ring", "train": "allreduce"}
FLAT = {"micro": "flat", "train": "omnireduce-flat"}


def _name(row: dict[str, Any]) -> str:
    return row["method"] if "method" in row else row["hook"]


def _busiest(row: dict[str, Any]) -> float | None:
    link = row.get("link")
    return link["busiest"] if link else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _mb(v: float | None) -> str:
    return f"{v / MB:.1f}" if v is not None else "-"


def _group_table(rows: Rows, part: str, time_key: str, rate_bps: float | None) -> list[str]:
    by = {_name(r): r for r in rows}
    ring, flat = by.get(RING[part]), by.get(FLAT[part])
    out = ["| method | median ms | time x ring | time x flat | link MB up/down (mean node) | busiest MB | "
           "bytes x ring | bytes x flat | wire floor ms | time/floor | library MB in node / across |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in by.items():
        if "error" in r:
            out.append(f"| {_label(part, name)} | failed: {r['error']} |" + " |" * 9)
            continue
        t = r[time_key]
        link = r.get("link")
        busiest = _busiest(r)
        partial = name in PARTIAL  # its bytes stay in the node: no floor to speak of
        floor = busiest * 8 / rate_bps if busiest is not None and rate_bps and not partial else None
        updown = f"{_mb(link['up_mean'])} / {_mb(link['down_mean'])}" if link else "-"
        lib = f"{_mb(r.get('lib_in_node'))} / {_mb(r.get('lib_across'))}"
        out.append(f"| {_label(part, name)} | {t * 1e3:.0f} | {_ratio(t, ring and ring.get(time_key))} | "
                   f"{_ratio(t, flat and flat.get(time_key))} | {updown} | {_mb(busiest)} | "
                   f"{_ratio(busiest, ring and _busiest(ring))} | {_ratio(busiest, flat and _busiest(flat))} | "
                   f"{f'{floor * 1e3:.0f}' if floor else '-'} | {_ratio(t, floor)} | {lib} |")
    return out


def _label(part: str, name: str) -> str:
    return (LABELS if part == "micro" else TRAIN_LABELS).get(name, name)


def micro_tables(rows: Rows, rates: dict[str, float | None]) -> str:
    """One table per (network, density) of the micro-benchmark's rows."""
    out: list[str] = []
    for net in dict.fromkeys(r["network"] for r in rows):
        for d in dict.fromkeys(r["density"] for r in rows if r["network"] == net):
            mine = [r for r in rows if r["network"] == net and r["density"] == d]
            first = mine[0]
            agree = all(r.get("agrees") is not False for r in mine)
            out.append(f"\n**{net}, density {d:g}** ({first['size_mib']:g} MiB fp32, {first['topology']}; node "
                       f"sum density {first['node_union']:.3f}, global {first['global_union']:.3f}; every method "
                       f"{'agrees' if agree else 'DOES NOT agree'} with the ring's sum within 1e-5)\n")
            out += _group_table(mine, "micro", "median_s", rates.get(net))
    return "\n".join(out)


def train_tables(rows: Rows, rates: dict[str, float | None]) -> str:
    """One table per network of the recommender's rows (step time and bytes per step)."""
    out: list[str] = []
    for net in dict.fromkeys(r["network"] for r in rows):
        mine = [r for r in rows if r["network"] == net]
        losses = ", ".join(f"{_label('train', r['hook'])} {r['final_loss']:.4f}" for r in mine if "final_loss" in r)
        out.append(f"\n**{net}, recommender** (final loss: {losses})\n")
        out += _group_table(mine, "train", "median_step_s", rates.get(net))
    return "\n".join(out)


def plot(micro: Rows, train: Rows, path: Path, title: str) -> bool:
    """Bars of median time and busiest node-link bytes per method, one column per (network,
    density) and one for the recommender per network. False (nothing drawn) without matplotlib."""
    try:
        from ombench.plots import _pyplot

        plt = _pyplot()
    except ImportError:
        return False
    groups: list[tuple[str, Rows]] = []
    for net in dict.fromkeys(r["network"] for r in micro):
        for d in dict.fromkeys(r["density"] for r in micro if r["network"] == net):
            groups.append((f"{net}\nd={d:g}", [r for r in micro if r["network"] == net and r["density"] == d]))
    for net in dict.fromkeys(r["network"] for r in train):
        groups.append((f"{net}\nrecsys step", [r for r in train if r["network"] == net]))
    if not groups:
        return False
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(groups)), 7), sharex=True)
    width = 0.16
    labelled: set[int] = set()
    for k in range(5):
        for gi, (_, rows) in enumerate(groups):
            if k >= len(rows) or "error" in rows[k]:
                continue
            r = rows[k]
            t = r.get("median_s", r.get("median_step_s"))
            part = "micro" if "method" in r else "train"
            kw = {"color": f"C{k}", "label": None if k in labelled else _label(part, _name(r))}
            labelled.add(k)
            axes[0].bar(gi + (k - 2) * width, t * 1e3, width, **kw)
            b = _busiest(r)
            if b is not None:
                axes[1].bar(gi + (k - 2) * width, b / MB, width, color=f"C{k}")
    axes[0].set_ylabel("median time, ms")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("busiest node link, MB per op/step")
    axes[1].set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
    axes[0].legend(fontsize=8)
    axes[0].set_title(title, fontsize=9)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
