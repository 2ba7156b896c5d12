"""What ``stats()`` must return: plain values only (dicts, lists, str, int, float, bool, None), so that a
checkpoint holding them loads under torch's default ``weights_only=True`` and they dump as JSON."""

from __future__ import annotations

import io
import json
from typing import Any

import torch

PLAIN = (str, int, float, bool, type(None))


def problems(obj: Any, where: str = "stats") -> list[str]:
    """Where ``obj`` holds something other than plain values (an enum member, a numpy number, a tensor,
    a tuple, ...), each with its type; empty when it is plain throughout. A dict key may be str or int."""
    if type(obj) in PLAIN:
        return []
    if type(obj) is dict:
        out = [f"{where}: key {k!r} is a {type(k).__name__}" for k in obj if type(k) not in (str, int)]
        return out + [p for k, v in obj.items() for p in problems(v, f"{where}[{k!r}]")]
    if type(obj) is list:
        return [p for i, v in enumerate(obj) for p in problems(v, f"{where}[{i}]")]
    return [f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} ({obj!r:.60})"]


def round_trips(obj: Any) -> bool:
    """Whether ``obj`` comes back equal from ``torch.save`` / ``torch.load`` (its default ``weights_only``)
    and from JSON (int keys read back as str there)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    again = torch.load(buf)
    json.dumps(obj, allow_nan=True)
    return bool(_same(again, obj))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # (NaN)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
