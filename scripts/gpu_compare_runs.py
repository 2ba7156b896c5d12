#!/usr/bin/env python3
"""GPU check, part 4: compare two runs of examples/train_recsys.py, omnireduce against the default all-reduce.

    python scripts/gpu_compare_runs.py --dir results/gpu/logs --params /tmp/params --out compare.txt

Design. Reads what the example writes for each run (``--summary-json``: step time, megabytes sent
per step and rank, CPU per step, losses; ``--save-params``: the trained parameters) from
``recsys_<hook>.json`` and ``recsys_<hook>.pt`` for the hooks ``omnireduce`` and ``allreduce``,
prints one table, and compares the parameters tensor by tensor: both runs start from the same seed
and data, so they may differ only by the order of float32 additions (``--rtol``/``--atol``). Exit
status 1 if a file is missing or the parameters differ beyond that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HOOKS = ("omnireduce", "allreduce")


def compare_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float,
                   atol: float) -> tuple[float, list[str]]:
    """The largest absolute difference over all tensors, and the names that differ beyond the tolerance."""
    if a.keys() != b.keys():
        return float("inf"), sorted(a.keys() ^ b.keys())
    worst, bad = 0.0, []
    for name in a:
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            bad.append(name)
            continue
        if x.numel():
            worst = max(worst, float((x - y).abs().max()))
        if not torch.allclose(x, y, rtol=rtol, atol=atol):
            bad.append(name)
    return worst, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where recsys_<hook>.json are")
    ap.add_argument("--params", default=None, help="where recsys_<hook>.pt are (default: --dir)")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-6)
    args = ap.parse_args()
    runs, params = {}, {}
    for hook in HOOKS:
        js, pt = Path(args.dir, f"recsys_{hook}.json"), Path(args.params or args.dir, f"recsys_{hook}.pt")
        if not js.is_file() or not pt.is_file():
            sys.exit(f"RESULT: missing {js.name} or {pt.name}: the {hook} run did not finish")
        runs[hook] = json.loads(js.read_text())
        params[hook] = torch.load(pt, map_location="cpu")
    lines = [f"{'hook':>11} {'ranks':>5} {'steps':>5} {'step ms':>8} {'MB sent/step/rank':>18} {'dense MB':>9} "
             f"{'CPU ms/step':>11} {'first loss':>10} {'final loss':>10}"]
    for hook, s in runs.items():
        lines.append(f"{hook:>11} {s['world_size']:>5} {s['steps']:>5} {s['median_step_s'] * 1e3:>8.1f} "
                     f"{s['mb_sent_per_step']:>18.2f} {s['dense_mb_per_step']:>9.2f} {s['cpu_ms_per_step']:>11.1f} "
                     f"{s['first_loss']:>10.4f} {s['final_loss']:>10.4f}")
    worst, bad = compare_params(params["omnireduce"], params["allreduce"], args.rtol, args.atol)
    o, a = runs["omnireduce"], runs["allreduce"]
    lines.append(f"parameters: {len(params['omnireduce'])} tensors, largest difference {worst:.3g}, "
                 f"{len(bad)} beyond rtol {args.rtol:g} / atol {args.atol:g}{': ' + ', '.join(bad[:5]) if bad else ''}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    speed = a["median_step_s"] / o["median_step_s"] if o["median_step_s"] else float("nan")
    summary = (f"omnireduce {o['median_step_s'] * 1e3:.1f} ms/step, {o['mb_sent_per_step']:.2f} MB/step; allreduce "
               f"{a['median_step_s'] * 1e3:.1f} ms/step, {a['mb_sent_per_step']:.2f} MB/step ({speed:.2f}x); "
               f"parameters {'equal within' if not bad else 'DIFFER beyond'} rtol {args.rtol:g} "
               f"(largest difference {worst:.2g})")
    if bad:
        sys.exit(f"RESULT: {summary}")
    print(f"RESULT: {summary}")


if __name__ == "__main__":
    main()
