"""The benchmarks' PNG plots, drawn with matplotlib (imported here only, on the Agg backend).

:func:`density_plot`: bench_allreduce.py's median time against density per method, log-log, with
the wire floors dashed. :func:`train_plot`: bench_train.py's median step time per hook, grouped by
network, one panel per model, with each setting's loss curve below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ombench.hooks import HOOKS

Rows = list[dict[str, Any]]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def density_plot(rows: Rows, labels: list[str], title: str, path: Path) -> bool:
    """Log-log plot of median time against density per method (dashed: wire floors, when known).

    Returns False, drawing nothing, when matplotlib is not installed.
    """
    try:
        plt = _pyplot()
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for lb in labels:
        mine = sorted((r for r in rows if r["label"] == lb and r["density"] > 0), key=lambda r: r["density"])
        xs = [r["density"] for r in mine]
        (line,) = ax.plot(xs, [r["median_s"] * 1e3 for r in mine], marker="o", label=lb)
        if all(r.get("floor_s") for r in mine):
            ax.plot(xs, [r["floor_s"] * 1e3 for r in mine], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of non-zero blocks per rank)")
    ax.set_ylabel("median time per all-reduce, ms (slowest rank)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values (fewer at the start) at every position."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    n = np.minimum(np.arange(1, len(values) + 1), window)
    return ((c[1:] - c[np.arange(1, len(values) + 1) - n]) / n).tolist()


def train_plot(rows: Rows, path: Path, hooks: list[str], nets: list[str], models: list[str], last_n: int) -> None:
    """Bars of median step time (one panel per model, groups = networks, bars = hooks), loss curves
    (running means over ``last_n`` steps) below."""
    plt = _pyplot()
    ok = {(r["model"], r["network"], r["hook"]): r for r in rows if "error" not in r}
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5), squeeze=False)
    colors = {h: plt.get_cmap("tab10")(i) for i, h in enumerate(HOOKS)}
    styles = ["-", "--", ":", "-."]
    width = 0.8 / max(1, len(hooks))
    for col, model in enumerate(models):
        ax, lax = axes[0][col], axes[1][col]
        for j, hook in enumerate(hooks):
            xs, ys, labels = [], [], []
            for i, net in enumerate(nets):
                r = ok.get((model, net, hook))
                if r:
                    xs.append(i + (j - (len(hooks) - 1) / 2) * width)
                    ys.append(r["median_step_s"] * 1e3)
                    labels.append(f"{r['mb_per_step']:.3g} MB")
            bars = ax.bar(xs, ys, width, label=hook, color=colors[hook])
            ax.bar_label(bars, labels=labels, fontsize=7, rotation=90, padding=2)
            for i, net in enumerate(nets):
                r = ok.get((model, net, hook))
                if r:
                    lax.plot(range(1, len(r["losses"]) + 1), running_mean(r["losses"], last_n),
                             styles[i % len(styles)], color=colors[hook], label=f"{hook}, {net}", linewidth=1)
        ax.set_xticks(range(len(nets)), nets)
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{model}: step time per hook (bar labels: MB sent/step/worker)")
        ax.margins(y=0.2)
        if ax.patches:
            ax.legend(fontsize=8)
        lax.set_xlabel("step")
        lax.set_ylabel(f"training loss (mean over ranks, running mean of {last_n} steps)")
        lax.set_title(f"{model}: loss curves")
        if lax.lines:
            lax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
