#!/usr/bin/env python3
"""Shrink the result files under docs/bench and docs/log/data without changing what they say.

JSON: below the top level, a container of scalars, or a short one of those (a table row), on one
line, the rest indented by one; timings (keys ending in ``_s``, ``_ms``, ``_us``) to 8 significant
digits, far finer than any clock's noise in these runs, so the tables generated from them stay the
same (``scripts/bench_tables.py --check``). PNG plots: a 64-colour palette, which holds matplotlib's
few colours and their anti-aliasing (needs Pillow, which matplotlib brings; a palette PNG is left as it
is). Running it twice changes nothing the second time.

    python scripts/compact_results.py            # every JSON and PNG under docs/bench and docs/log/data
    python scripts/compact_results.py FILE ...   # these files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [ROOT / "docs" / "bench", ROOT / "docs" / "log" / "data"]
TIMING = re.compile(r"(_s|_ms|_us)$")
DIGITS = 8
ROW = 1000  # characters: a two-level container up to this long goes on one line


def rounded(x: Any, key: str = "") -> Any:
    """``x`` with the floats under timing keys to ``DIGITS`` significant digits."""
    if isinstance(x, float) and TIMING.search(key):
        return float(f"{x:.{DIGITS}g}")
    if isinstance(x, list):
        return [rounded(v, key) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v, k) for k, v in x.items()}
    return x


def _depth(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max(map(_depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(_depth, x), default=0)
    return 0


def dumps(x: Any, level: int = 0) -> str:
    """JSON text: below the top, containers of scalars and short containers of those on one line; the rest
    indented by one."""
    depth = _depth(x)
    if depth == 0 or (level > 0 and (depth == 1 or (depth == 2 and len(json.dumps(x)) <= ROW))):
        return json.dumps(x)
    pad = " " * (level + 1)
    if isinstance(x, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, level + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(pad + dumps(v, level + 1) for v in x) + "\n" + " " * level + "]"


def compact_json(path: Path) -> None:
    doc = rounded(json.loads(path.read_text()))
    text = dumps(doc) + "\n"
    if json.dumps(json.loads(text)) != json.dumps(doc):  # (never: the text is the same document)
        raise RuntimeError(f"{path}: the compact text does not read back as the document")
    path.write_text(text)


def compact_png(path: Path) -> bool:
    """A 64-colour palette; False where Pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        return False
    with Image.open(path) as image:
        if image.mode == "P":
            return True
        palette = image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT,
                                                 dither=Image.Dither.NONE)
    palette.save(path, optimize=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="default: every JSON and PNG under docs/bench and docs/log/data")
    args = parser.parse_args(argv)
    files = args.files or [f for d in FOLDERS for f in sorted(d.rglob("*")) if f.suffix in (".json", ".png")]
    before = sum(f.stat().st_size for f in files)
    no_pillow = []
    for f in files:
        if f.suffix == ".json":
            compact_json(f)
        elif f.suffix == ".png" and not compact_png(f):
            no_pillow.append(f)
    after = sum(f.stat().st_size for f in files)
    print(f"{len(files)} files: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB")
    if no_pillow:
        print(f"left {len(no_pillow)} PNG as they were: no Pillow (pip install pillow)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
