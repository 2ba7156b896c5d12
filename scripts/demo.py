#!/usr/bin/env python3
"""``make demo``: train the recommender with omnireduce, then with the dense all-reduce, and compare.

Both runs use ``omnireduce-run`` (4 workers through torchrun, 1 local aggregator) on
examples/train_recsys.py with the same seed and data; the summary shows each run's median step
time, megabytes sent per step and per rank, and final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(hook: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [str(Path(sys.executable).with_name("omnireduce-run")), "--nproc", str(args.nproc),
           str(ROOT / "examples" / "train_recsys.py"), "--hook", hook, "--steps", str(args.steps),
           "--summary-json", str(out), *args.extra]
    print(f"\n=== {hook}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if rc != 0:
        sys.exit(f"demo: the {hook} run failed with exit code {rc}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("extra", nargs="*", help="more arguments for train_recsys.py (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {hook: run(hook, args, Path(tmp) / f"{hook}.json") for hook in ("omnireduce", "allreduce")}
    o, a = results["omnireduce"], results["allreduce"]
    print(f"\n{args.nproc} workers, {args.steps} steps of the recommender (1,045,760 embedding rows), "
          "loopback, this machine")
    print(f"{'':24}{'omnireduce':>14}{'dense all-reduce':>18}")
    print(f"{'median step time':24}{o['median_step_s'] * 1e3:>11.1f} ms{a['median_step_s'] * 1e3:>15.1f} ms")
    print(f"{'MB sent per step/rank':24}{o['mb_sent_per_step']:>14.2f}{a['mb_sent_per_step']:>18.2f}")
    print(f"{'final loss':24}{o['final_loss']:>14.4f}{a['final_loss']:>18.4f}")
    gap = max(abs(x - y) for x, y in zip(o["losses"], a["losses"], strict=True))
    print(f"\nomnireduce: {a['median_step_s'] / o['median_step_s']:.2f}x the step rate, "
          f"{o['mb_sent_per_step'] / a['mb_sent_per_step'] * 100:.1f}% of the bytes; "
          f"the two loss curves differ by at most {gap:.2e}")


if __name__ == "__main__":
    main()
