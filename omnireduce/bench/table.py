"""The benchmark's rows as text: one line per case, the methods side by side.

Columns: the case (bytes, elements, dtype, density, placement), the latency unit, then per method its
time, algorithm and bus bandwidth, and for omnireduce's methods the speedup over torch's all-reduce,
the time in latency units, the bytes sent as a fraction of the dense ring's, and with ``--check`` the
elements that disagree (``#wrong``, 0 when the results agree).
"""

from __future__ import annotations

import math
from typing import Any

NAMES = {"dense": "torch", "engine": "engine", "aggregators": "aggregators", "hook": "DDP hook"}


def _size(n: float) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n:g}"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def methods(rows: list[dict[str, Any]]) -> list[str]:
    """The methods some row has, in the table's order."""
    return [m for m in NAMES if any(f"{m}_ms" in r for r in rows)]


def heading(rows: list[dict[str, Any]]) -> list[str]:
    """The two heading lines."""
    top = f"{'':>7} {'':>9} {'':>8} {'':>7} {'':>8} {'unit':>7}"
    sub = f"{'bytes':>7} {'elements':>9} {'dtype':>8} {'density':>7} {'place':>8} {'us':>7}"
    for m in methods(rows):
        extra = m != "dense"
        width = 23 + (29 if extra else 0)
        top += f" | {NAMES[m]:^{width}}"
        sub += f" | {'ms':>7} {'algbw':>6} {'busbw':>6}"
        if extra:
            sub += f" {'speedup':>7} {'units':>6} {'bytes':>6} {'#wrong':>6}"
    return [top.rstrip(), sub]


def line(row: dict[str, Any], names: list[str]) -> str:
    """One row as text (``names``: the methods of the table)."""
    out = (f"{_size(row['bytes']):>7} {row['elements']:>9} {row['dtype']:>8} {row['density']:>7g} "
           f"{row['placement']:>8} {_num(row.get('unit_us'), '.0f'):>7}")
    for m in names:
        out += (f" | {_num(row.get(f'{m}_ms'), '.2f'):>7} {_num(row.get(f'{m}_algbw'), '.2f'):>6} "
                f"{_num(row.get(f'{m}_busbw'), '.2f'):>6}")
        if m != "dense":
            sent = row.get(f"{m}_bytes")
            frac = sent / row["ring_bytes"] if sent is not None and row.get("ring_bytes") else None
            speed = row.get(f"{m}_speedup")
            out += (f" {(_num(speed, '.2f') + 'x') if speed is not None else '-':>7} "
                    f"{_num(row.get(f'{m}_units'), '.0f'):>6} {_num(frac, '.1%'):>6} "
                    f"{_num(row.get(f'{m}_wrong'), 'd'):>6}")
    return out


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the columns mean, once, under the table."""
    return ["# times: median of the slowest rank per repeat, the methods taking turns; algbw = bytes / time, "
            "busbw = algbw x 2(W-1)/W (GB/s);",
            "# units: the time over the 1-element all-reduce's; bytes: sent per rank, as a fraction of the dense "
            "ring's 2(W-1)/W of the tensor;",
            "# #wrong: elements off the dense all-reduce's by more than summation order allows (--check; - unchecked)"]
