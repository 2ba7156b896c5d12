"""How the cost of one all-reduce grows with the tensor and the world size, omnireduce against Gloo.

Runs ``scripts/bench_allreduce.py --loopback`` once per world size W and tensor size (one
aggregator; methods omnireduce and gloo; densities ``--densities``), then, for each W, method and
density, fits ``time = fixed + per_mb * MiB`` and ``CPU = fixed + per_mb * MiB`` (least squares
over the sizes, the smallest sizes weighing as much as the largest: relative residuals) and prints
the per-tensor fixed cost and the cost per MiB. On loopback every process shares this machine's
cores, so time here is CPU-bound; the CPU columns (all ranks + aggregator) are what a cluster's cores
would spend.

Usage::

    python scripts/bench_scaling.py                                     # W = 2, 4, 8; 64 KiB .. 400 MiB
    python scripts/bench_scaling.py --workers 2,4 --sizes-mib 0.0625,1,25 --densities 0.01

Writes every bench_allreduce JSON under ``--out`` (default ``results/bench_scaling``), the fitted
table as ``scaling.json`` and a plot ``scaling.png`` (time and CPU against size, per W).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ombench.machine import machine_info
from ombench.scaling import fit_line
from ombench.tables import cpu_ms

ROOT = Path(__file__).resolve().parent.parent


def run_one(args: argparse.Namespace, workers: int, size: float, out: Path) -> Path | None:
    """The JSON of one bench_allreduce run (made now unless it exists), or None if the run failed
    (e.g. W ranks' copies of a large tensor do not fit in memory): reported and left out of the fits."""
    path = out / f"W{workers}_{size:g}MiB.json"
    if path.exists() and not args.rerun:
        return path
    iters = args.iters if size <= 100 else max(3, args.iters // 2)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_allreduce.py"), "--loopback", "--workers", str(workers),
           "--aggregators", "1", "--methods", "omnireduce,gloo", "--size-mib", f"{size:g}",
           "--densities", args.densities, "--iters", str(iters), "--warmup", str(args.warmup),
           "--json", str(path), "--plot", str(path.with_suffix(".png"))]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"  W={workers}, {size:g} MiB failed (exit status {done.returncode}), left out: "
              f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}", flush=True)
        return None
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--sizes-mib", default="0.0625,1,25,100,400")
    ap.add_argument("--densities", default="0.01,1")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_scaling"))
    ap.add_argument("--rerun", action="store_true", help="run again even where a JSON exists")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workers = [int(w) for w in args.workers.split(",")]
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for w in workers:
        for size in sizes:
            path = run_one(args, w, size, out)
            if path is None:
                failed.append({"workers": w, "size_mib": size})
                continue
            data = json.loads(path.read_text())
            for r in data["rows"]:
                rows.append({"workers": w, "size_mib": size, "method": r["label"], "density": r["density"],
                             "median_ms": r["median_s"] * 1e3, "cpu_ms": cpu_ms(r)})
    fits = []
    print("\nper all-reduce on loopback, one aggregator: time and CPU (all ranks + aggregator) = fixed + per MiB"
          " x size")
    print(f"{'W':>3} {'method':<11} {'density':>7} {'time fixed ms':>14} {'time ms/MiB':>12} {'CPU fixed ms':>13} "
          f"{'CPU ms/MiB':>11}   " + " ".join(f"{s:g} MiB".rjust(11) for s in sizes))
    for w in workers:
        for method in ("omnireduce", "gloo"):
            for d in sorted({r["density"] for r in rows}, reverse=True):
                pts = sorted((r for r in rows if (r["workers"], r["method"], r["density"]) == (w, method, d)),
                             key=lambda r: r["size_mib"])
                if not pts:
                    continue
                xs = [p["size_mib"] for p in pts]
                at = {p["size_mib"]: p for p in pts}
                t_fixed, t_mb = fit_line(xs, [p["median_ms"] for p in pts])
                c_fixed, c_mb = fit_line(xs, [p["cpu_ms"] for p in pts])
                fits.append({"workers": w, "method": method, "density": d, "time_fixed_ms": t_fixed,
                             "time_ms_per_mib": t_mb, "cpu_fixed_ms": c_fixed, "cpu_ms_per_mib": c_mb,
                             "points": pts})
                print(f"{w:>3} {method:<11} {d:>7g} {t_fixed:>14.2f} {t_mb:>12.3f} {c_fixed:>13.2f} {c_mb:>11.3f}   "
                      + " ".join(f"{at[s]['median_ms']:>11.1f}" if s in at else f"{'failed':>11}" for s in sizes))
    (out / "scaling.json").write_text(json.dumps({"meta": {"machine": machine_info(ROOT), "densities": args.densities,
                                                           "iters": args.iters}, "fits": fits, "failed": failed},
                                                indent=1))
    _plot(fits, out / "scaling.png")
    print(f"\nwrote {out / 'scaling.json'} and {out / 'scaling.png'}")


def _plot(fits: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({f["workers"] for f in fits})
    fig, axes = plt.subplots(2, len(workers), figsize=(4.5 * len(workers), 7), squeeze=False)
    for col, w in enumerate(workers):
        for f in (f for f in fits if f["workers"] == w):
            xs = [p["size_mib"] for p in f["points"]]
            style = "-" if f["method"] == "omnireduce" else "--"
            label = f"{f['method']} d={f['density']:g}"
            axes[0][col].plot(xs, [p["median_ms"] for p in f["points"]], style, marker="o", label=label)
            axes[1][col].plot(xs, [p["cpu_ms"] for p in f["points"]], style, marker="o", label=label)
        axes[0][col].set_title(f"W = {w}, loopback, one aggregator")
        axes[0][col].set_ylabel("median time per all-reduce, ms")
        axes[1][col].set_ylabel("CPU per all-reduce, ms (all processes)")
        for row in axes:
            row[col].set_xscale("log")
            row[col].set_yscale("log")
            row[col].set_xlabel("tensor size, MiB (fp32)")
            row[col].grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
