#!/usr/bin/env python3
"""``make demo``: train the recommender with omnireduce, then with the dense all-reduce, and compare.

Both runs train examples/train_recsys.py (a 1M-row embedding recommender) on ``--nproc`` workers
with the same seed and data: first with ``omnireduce_hook``, then with DDP's default all-reduce
(Gloo). Nothing else is started: through ``omnireduce-run``, the job runs its own aggregator (the
hook starts it, from rank 0, as a child process), as any DDP job given no aggregator addresses
does. What the demo shows holds on any machine: the bytes each rank sends per step, the CPU each
rank spends per step, and the two loss curves (equal up to float rounding). On loopback there
is no network to save, so step times there measure CPU, not a network; what the measured bytes
mean on real links is printed as arithmetic (bytes x 8 / link rate), labelled as such. A PNG of
the loss curves and step times is written next to the JSON of both runs (``--out``).

``--net 1gbit`` (as root, with network namespaces) runs the same comparison over the emulated
network of ``scripts/netem.py`` through ``scripts/bench_train.py`` (hook ``omnireduce-colocated``:
the job's own aggregators, one on each worker host), where the step times do show the network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS_GBIT = (1, 10, 100)


def run(hook: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [str(Path(sys.executable).with_name("omnireduce-run")), "--nproc", str(args.nproc),
           str(ROOT / "examples" / "train_recsys.py"), "--hook", hook, "--steps", str(args.steps),
           "--summary-json", str(out), *args.extra]
    print(f"\n=== {hook}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if rc != 0:
        sys.exit(f"demo: the {hook} run failed with exit code {rc}")
    return json.loads(out.read_text())


def link_ms(mb: float, gbit: float) -> float:
    """Milliseconds a rank's link needs to carry ``mb`` MiB at ``gbit`` Gbit/s (no overheads)."""
    return mb * 2**20 * 8 / (gbit * 1e9) * 1e3


def report(o: dict, a: dict, nproc: int, steps: int) -> str:
    """The comparison table and the link arithmetic, as text."""
    gap = max(abs(x - y) for x, y in zip(o["losses"], a["losses"], strict=True))
    lines = [f"{nproc} workers, {steps} steps of the recommender (1,045,760 embedding rows), loopback, "
             f"{platform.node()} ({os.cpu_count()} cores)",
             f"{'':30}{'omnireduce':>14}{'dense all-reduce':>18}",
             f"{'MB sent per step and rank':30}{o['mb_sent_per_step']:>14.2f}{a['mb_sent_per_step']:>18.2f}",
             f"{'CPU ms per step and rank':30}{o['cpu_ms_per_step']:>14.1f}{a['cpu_ms_per_step']:>18.1f}",
             f"{'median step time (loopback)':30}{o['median_step_s'] * 1e3:>11.1f} ms"
             f"{a['median_step_s'] * 1e3:>15.1f} ms",
             f"{'final loss':30}{o['final_loss']:>14.4f}{a['final_loss']:>18.4f}",
             "",
             f"omnireduce sent {o['mb_sent_per_step'] / a['mb_sent_per_step'] * 100:.1f}% of the dense all-reduce's "
             f"bytes; the loss curves differ by at most {gap:.1e} over {steps} steps.",
             *_paths(o, a, steps),
             "",
             "What those bytes need on real links (arithmetic from the measured bytes, not a measurement):",
             f"{'link':>12}{'omnireduce':>14}{'dense all-reduce':>18}"]
    for gbit in LINKS_GBIT:
        lines.append(f"{gbit:>7} Gb/s{link_ms(o['mb_sent_per_step'], gbit):>11.1f} ms"
                     f"{link_ms(a['mb_sent_per_step'], gbit):>15.1f} ms")
    lines.append("(per step and rank, wire time only; both sides also spend the CPU above. "
                 "Measured on an emulated network: make demo NET=1gbit, as root.)")
    return "\n".join(lines)


def _paths(o: dict, a: dict, steps: int) -> list[str]:
    """What the hook's path choice decided, and what measuring cost in bytes (the table's medians leave
    the measuring steps out; the mean over every step counts them)."""
    paths = o.get("paths")
    if not paths:
        return []
    chosen = [p["path"] for p in paths.values()]
    timed = {k[:-3] for p in paths.values() for k in p if k.endswith("_ms")}
    ways = [w for w in ("aggregators", "collective", "dense") if w in timed]
    return [f"Path choice: each of the {len(chosen)} buckets was timed through each path first "
            f"({', '.join(ways)}; {o['iterations_measuring']} of the {steps} steps measured); "
            f"{chosen.count('aggregators')} then took the aggregators, {chosen.count('collective')} the collective "
            f"engine and {chosen.count('dense')} the dense all-reduce.",
            *_buckets(o, paths),
            f"Counting the measuring steps, omnireduce sent {o['mb_sent_mean_per_step']:.2f} MB per step and rank on "
            f"average ({o['mb_sent_mean_per_step'] / a['mb_sent_per_step'] * 100:.1f}% of the dense bytes)."]


def _buckets(o: dict, paths: dict) -> list[str]:
    """One line per bucket: its size, the way it took at the last step, its bytes then (rank 0). Which
    way wins a bucket is timed on this machine, so it can differ from run to run, and so do the bytes."""
    buckets = o.get("buckets") or {}
    names = {"aggregators": "the aggregators", "collective": "the collective engine", "dense": "the dense all-reduce"}
    lines = []
    for index, b in sorted(buckets.items(), key=lambda kv: int(kv[0])):
        chosen = (paths.get(index) or paths.get(str(index)) or {}).get("path")
        way = "sparse COO rows, batched, to the aggregators" if b["way"] == "coo" else names.get(chosen, b["way"])
        mb = b["bytes_sent"] / 2**20  # (MB as in the table above: 2^20 bytes)
        lines.append(f"  bucket {index}: {b['numel']:>10,} elements, {way}: {mb:.3f} MB at the last step")
    return lines


def plot(o: dict, a: dict, path: Path) -> bool:
    """Loss curves and step times of both runs as a PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run_, label in ((o, "omnireduce"), (a, "dense all-reduce")):
        left.plot(run_["losses"], label=label)
        right.plot([t * 1e3 for t in run_["step_times_s"]], label=label)
    left.set(xlabel="step", ylabel="loss (rank 0)", title="loss")
    right.set(xlabel="step", ylabel="ms", title="step time (loopback: CPU, not a network)")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--net", default="", help="emulated link rate (e.g. 1gbit): run over scripts/netem.py, as root")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "demo", help="where the JSON and PNG go")
    ap.add_argument("extra", nargs="*", help="more arguments for train_recsys.py (after --)")
    args = ap.parse_args()
    if args.net:
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--models", "recsys", "--hooks",
               "allreduce,omnireduce-colocated", "--nets", args.net, "--workers", str(args.nproc),
               "--steps", str(args.steps)]
        print(f"=== {' '.join(cmd[1:])}", flush=True)
        sys.exit(subprocess.call(cmd))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {hook: run(hook, args, args.out / f"{hook}.json") for hook in ("omnireduce", "allreduce")}
    text = report(results["omnireduce"], results["allreduce"], args.nproc, args.steps)
    print("\n" + text)
    (args.out / "summary.txt").write_text(text + "\n")
    png = args.out / "demo.png"
    if plot(results["omnireduce"], results["allreduce"], png):
        print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
