#!/usr/bin/env python3
"""The collective engine's fixed cost per bucket, in latency units, against the dense all-reduce.

    python scripts/bench_engine.py                                   # Gloo on this machine: host and device path
    python scripts/bench_engine.py --quick                           # a minute: 64K and 1M elements, W=2
    python scripts/bench_engine.py --exchanges auto,owners           # two exchanges of the engine, same run
    python scripts/gpu_nccl_check.py engine --worlds 1,2,4 --json X  # NCCL on a GPU (the GPU check's NCCL part)
    python scripts/bench_engine.py --report docs/bench/engine/engine_gloo.json   # the tables again
    python scripts/bench_engine.py --before /tmp/old --before-name a599527       # against an older tree, same run

Per bucket size (``--sizes``, elements), density (``one``: a single non-zero block, the same on every
rank; else blocks non-zero at random per rank) and world size, the rank side
(``scripts/engine_cost.py``) times in one process group and run: the group's 1-element all-reduce
(the latency unit), the dense all-reduce of the bucket, and the engine once per exchange asked
for; medians of the slowest rank. The table gives the engine's time in units and against the
dense all-reduce, the process's CPU time per bucket, and where the engine counts them its host
waits and collectives per bucket (on CUDA also kernel launches and blocking synchronisations from
a profiler trace). Every engine result is checked against the dense all-reduce's.

On Gloo (``--backend gloo``, the default here) it runs twice, the host path (numpy views of the
tensor) and the device path (``OMNIREDUCE_DEVICE_PATH=1``: the torch ops CUDA tensors take, on
the CPU). The ranks share this machine's cores: run nothing else meanwhile, and compare only rows
of one run. Output: the tables, and ``<out>/engine_<backend>.json`` with a plot beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

DENSITY_NAMES = {"one": 0.0}


def _densities(s: str) -> list[float]:
    return [DENSITY_NAMES.get(v) if v in DENSITY_NAMES else float(v) for v in s.split(",") if v]


def _ints(s: str) -> list[int]:
    return [int(float(v)) for v in s.split(",") if v]


def density_name(d: float) -> str:
    return "one" if d == 0.0 else f"{d:g}"


def table(rows: list[dict[str, Any]], title: str) -> str:
    """The rows as a fixed-width table."""
    head = (f"{'path':<6} {'W':>2} {'elements':>10} {'density':>7} {'exchange':<12} {'engine ms':>9} {'units':>6} "
            f"{'dense ms':>9} {'vs dense':>8} {'cpu ms':>7} {'waits':>5} {'colls':>5} {'launch':>6} {'syncs':>5}  ok")
    lines = [title, head]
    for r in rows:
        def opt(key: str, fmt: str = ".1f", r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return "-" if v is None else format(v, fmt)

        lines.append(f"{r.get('path', '-'):<6} {r['world']:>2} {r['elements']:>10} {density_name(r['density']):>7} "
                     f"{r['exchange']:<12} {r['engine_ms']:>9.3f} {r['units']:>6.1f} {r['dense_ms']:>9.3f} "
                     f"{r['vs_dense']:>7.2f}x {r['process_cpu_ms']:>7.2f} {opt('host_waits_per_reduction'):>5} "
                     f"{opt('collectives_per_reduction'):>5} {opt('launches'):>6} {opt('syncs'):>5}  "
                     f"{'yes' if r['agree'] else 'NO'}")
    return "\n".join(lines)


def cmd_engine(args: argparse.Namespace, run_case: Any, env: dict[str, str] | None = None,
               path: str = "device") -> tuple[bool, str, dict[str, Any]]:
    """The parent side: one job per world size; rank 0's rows, a table, a verdict (the sums must
    agree; times are reported, never judged)."""
    extra = {"sizes": args.engine_sizes, "densities": args.engine_densities, "exchanges": args.exchanges,
             "repeats": args.repeats, "warmup": args.warmup, "dtype": args.dtype}
    rows, problems, unit = [], [], {}
    for world in args.worlds:
        ranks, results, _ = run_case("engine", args, world, extra, env=env)
        if results[0] is None or any(r["rc"] != 0 for r in ranks):
            problems.append(f"W={world}: exit status {[r['rc'] for r in ranks]}")
            rows += [dict(r, world=world, path=path, salvaged=True) for r in salvage(ranks[0]["output"])]
            continue
        unit[world] = results[0]["unit_ms"]
        rows += [dict(r, world=world, path=path) for r in results[0]["rows"]]
    problems += [f"{r['path']} W={r['world']} n={r['elements']} d={density_name(r['density'])} {r['exchange']}: "
                 f"the engine's sums differ from the dense all-reduce's ({r['max_err']:.3g})"
                 for r in rows if not r["agree"]]
    problems += [f"{r['path']} W={r['world']} n={r['elements']} d={density_name(r['density'])} {r['exchange']}: "
                 "the kernel exchange did not run (OMNIREDUCE_ENGINE_KERNELS=1, but no CUDA kernels with it?)"
                 for r in rows if r["exchange"].endswith("+kernels") and args.device == "cuda"
                 and not r.get("kernel_reductions_per_reduction")
                 and any(n for k, n in r.get("exchanges", {}).items() if k != "whole")]  # (whole: no bitmaps)
    res = {"rows": rows, "unit_ms": unit, "problems": problems}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    small = [r for r in rows if r["density"] == 0.0]
    cells = [f"{r['path']} W={r['world']} n={r['elements']} {r['exchange']} {r['units']:.1f} units"
             for r in small[:6]]
    return True, "one block: " + ", ".join(cells), res


def salvage(output: str) -> list[dict[str, Any]]:
    """The rows rank 0 printed before its job ended early (``ROW {json}`` lines)."""
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("ROW {")]


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> bool:
    """Engine time over dense all-reduce time per density, a line per (path, W, size, exchange)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = sorted({(r.get("path", "-"), r["world"], r["elements"], r["exchange"]) for r in rows})
    for key in keys:
        pts = sorted((r["density"], r["vs_dense"], r["units"]) for r in rows
                     if (r.get("path", "-"), r["world"], r["elements"], r["exchange"]) == key)
        xs = [max(p[0], 1e-5) for p in pts]
        label = f"{key[0]} W={key[1]} n={key[2]} {key[3]}"
        axes[0].plot(xs, [p[1] for p in pts], marker="o", label=label)
        axes[1].plot(xs, [p[2] for p in pts], marker="o", label=label)
    for ax, ylab in zip(axes, ("engine / dense all-reduce", "engine / 1-element all-reduce (units)"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (1e-5: one block)")
        ax.set_ylabel(ylab)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def add_engine_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The workload's options (``prefix``: where another command already has ``--sizes``)."""
    ap.add_argument(f"--{prefix}sizes", dest="engine_sizes", type=_ints,
                    default=[1 << 16, 1 << 20, 1 << 22, 1 << 24], help="bucket sizes, elements")
    ap.add_argument(f"--{prefix}densities", dest="engine_densities", type=_densities,
                    default=[0.0, 0.001, 0.01, 0.1, 1.0], help="comma-separated; 'one' is a single non-zero block")
    ap.add_argument("--exchanges", type=lambda s: s.split(","), default=["default"],
                    help="the engine's exchanges to time (default: the engine as constructed)")
    ap.add_argument("--dtype", default="float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["gloo"], default="gloo", help="(NCCL: gpu_nccl_check.py engine)")
    ap.add_argument("--device", choices=["cpu"], default="cpu")
    ap.add_argument("--paths", default="host,device", help="host, device or both (Gloo on the CPU)")
    ap.add_argument("--worlds", type=_ints, default=[2, 4])
    add_engine_args(ap)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64K and 1M elements, W=2, fewer repeats")
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--launch-timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=Path("results/engine"))
    ap.add_argument("--name", default=None, help="the output's file name (default engine_<backend>)")
    ap.add_argument("--report", type=Path, default=None, help="print the tables and draw the plot of a saved run")
    ap.add_argument("--before", type=Path, default=None,
                    help="a folder holding another tree's omnireduce package (e.g. `git archive` of an older commit, "
                         "aggregator/ and worker/ moved into omnireduce/): its engine runs the same workload, "
                         "rows labelled path@NAME")
    ap.add_argument("--before-name", default="before", help="the label of --before's rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.engine_sizes, args.worlds, args.repeats, args.warmup = [1 << 16, 1 << 20], [2], 9, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        data = json.loads(args.report.read_text())
        print(table(data["rows"], data["title"]))
        plot(data["rows"], args.report.with_suffix(".png"), data["title"])
        return 0
    from ombench.rankjobs import run_case

    t0 = time.time()
    rows, problems, units = [], [], {}
    with tempfile.TemporaryDirectory(prefix="bench_engine-") as tmp:
        args.work = tmp
        runs = [(path, {"OMNIREDUCE_DEVICE_PATH": "1" if path == "device" else "0"}) for path in args.paths.split(",")]
        if args.before is not None:  # the same workload through another tree's engine, as it was constructed
            runs += [(f"{path}@{args.before_name}", dict(env, OMNIREDUCE_BENCH_TREE=str(args.before.resolve())))
                     for path, env in runs]
        exchanges = args.exchanges
        for path, env in runs:
            args.exchanges = ["default"] if "@" in path else exchanges
            _, line, res = cmd_engine(args, run_case, env, path)
            print(f"{path} path: {line}", flush=True)
            rows += res["rows"]
            problems += res["problems"]
            units[path] = res["unit_ms"]
        args.exchanges = exchanges
    title = (f"collective engine, {args.backend} on {args.device} (loopback, this machine's cores), "
             f"{args.dtype}, median of {args.repeats}")
    print(table(rows, title))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"engine_{args.backend}")
    from ombench.machine import machine_info

    meta = {"argv": ["scripts/bench_engine.py", *(sys.argv[1:] if argv is None else argv)],
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_info(SCRIPTS.parent), "elapsed_s": time.time() - t0,
            "args": {k: v for k, v in vars(args).items() if k not in ("work", "out", "report")}}
    stem.with_suffix(".json").write_text(json.dumps({"title": title, "rows": rows, "unit_ms": units,
                                                     "problems": problems, "meta": meta}, indent=1, default=str)
                                         + "\n")
    drew = plot(rows, stem.with_suffix(".png"), title)
    print(f"rows in {stem.with_suffix('.json')}" + (f", plot {stem.with_suffix('.png')}" if drew else ""))
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
