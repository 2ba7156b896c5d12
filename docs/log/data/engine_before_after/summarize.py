"""Medians of the before/after runs in a folder: ``python summarize.py FOLDER`` (the OUT of run.sh).

``train_{old,new}_N.json`` (scripts/bench_train.py) and ``micro_{old,new}_N.json``
(scripts/bench_allreduce.py): each row's per-run values, their median, and after / before;
``mem_{old,new}_N.json`` (scripts/bench_memory.py), where present: each setting's peak over plain
DDP's (the largest rank's of each), in MiB, per run.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path


def runs(folder: Path, kind: str, key: tuple[str, ...], value: str) -> dict[tuple, dict[str, list[float]]]:
    out: dict[tuple, dict[str, list[float]]] = {}
    for f in sorted(glob.glob(str(folder / f"{kind}_*.json"))):
        tree = Path(f).name.split("_")[1]
        for r in json.loads(Path(f).read_text())["rows"]:
            out.setdefault(tuple(r[k] for k in key), {}).setdefault(tree, []).append(r[value] * 1e3)
    return out


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[0])
    folder = Path(sys.argv[1])
    for kind, key, value in (("train", ("model", "hook"), "median_step_s"),
                             ("micro", ("label", "density"), "median_s")):
        for k, by in sorted(runs(folder, kind, key, value).items(), key=str):
            old, new = by.get("old", []), by.get("new", [])
            ratio = statistics.median(new) / statistics.median(old) if old and new else float("nan")
            print(f"{kind} {k}: before {[round(x, 1) for x in old]} after {[round(x, 1) for x in new]} "
                  f"after/before {ratio:.2f}")
    over: dict[tuple, dict[str, list[float]]] = {}
    for f in sorted(glob.glob(str(folder / "mem_*.json"))):
        tree = Path(f).name.split("_")[1]
        rows = json.loads(Path(f).read_text())["rows"]
        ddp = {r["density"]: max(x["peak_rss"] for x in r["ranks"]) for r in rows if r["config"] == "ddp"}
        for r in rows:
            if r["config"] != "ddp":
                peak = max(x["peak_rss"] for x in r["ranks"]) - ddp[r["density"]]
                over.setdefault((r["config"], r["density"]), {}).setdefault(tree, []).append(peak / 2**20)
    for k, by in sorted(over.items(), key=str):
        print(f"memory {k}: MiB over plain DDP, before {[round(x) for x in by.get('old', [])]} "
              f"after {[round(x) for x in by.get('new', [])]}")


if __name__ == "__main__":
    main()
