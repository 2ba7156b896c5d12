"""A call's header: what every rank says about a call before any block travels, and the error when they
disagree.

Before each reduction the ranks all-gather a header of :data:`FIELDS` int64 values (a few hundred bytes
on the wire at most): the call's number on the group, single or coalesced, SUM or AVG, strided or
sparse, the dtype, the element count, the number of dimensions (or tensors), the first three sizes, and
a CRC of every shape. Where every rank's header equals rank 0's the reduction goes ahead; otherwise
every rank sees the same headers and raises the same :class:`~omnireduce.errors.OmniReduceMismatchError`,
naming what each rank had, and nothing else is sent (the group stays usable). Two ranks at different
call numbers (one rank's earlier call went to torch.distributed, say) are named the same way.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

MAGIC = 0x4F4D5244  # "OMRD"
FIELDS = 12
SINGLE, COALESCED = 0, 1
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_NAMES = {v: str(k).removeprefix("torch.") for k, v in _DTYPES.items()}


def encode(seq: int, tensors: Sequence[torch.Tensor], *, average: bool, coalesced: bool) -> np.ndarray:
    """The header of call ``seq`` on ``tensors`` (one, or a coalesced call's list)."""
    first = tensors[0]
    if coalesced:
        sizes = [t.numel() for t in tensors]
        count, shapes = len(tensors), [tuple(t.shape) for t in tensors]
    else:
        sizes, count, shapes = list(first.shape), first.dim(), [tuple(first.shape)]
    head = [MAGIC, seq, COALESCED if coalesced else SINGLE, int(average), int(first.layout != torch.strided),
            _DTYPES[first.dtype], sum(t.numel() for t in tensors), count]
    head += (sizes + [-1] * 3)[:3]
    head.append(zlib.crc32(repr(shapes).encode()))
    return np.array(head, dtype=np.int64)


def describe(row: Sequence[int]) -> str:
    """One rank's header in words."""
    if len(row) != FIELDS or row[0] != MAGIC:
        return f"no header of omnireduce.distributed ({list(row)[:4]}...)"
    _, seq, kind, average, sparse, dtype, numel, count = (int(v) for v in row[:8])
    sizes = [int(v) for v in row[8:11] if v >= 0]
    more = f", ... (shapes' CRC {int(row[11]) & 0xFFFFFFFF:08x})" if count > 3 else ""
    name = _NAMES.get(dtype, f"dtype #{dtype}")
    op = "AVG" if average else "SUM"
    if kind == COALESCED:
        shown = ", ".join(map(str, sizes)) + more
        what = f"{count} {name} tensors of {numel} elements in all (sizes {shown})"
    else:
        dims = ", ".join(map(str, sizes)) + more + ("," if count == 1 else "")
        what = f"a {'sparse ' if sparse else ''}{name} tensor of shape ({dims})"
    return f"call {seq}: {what}, {op}"


def disagreement(rows: np.ndarray, ranks: Sequence[int], where: str) -> str | None:
    """None when every rank's header (``rows``, one per rank of the group in group order) equals the first
    one's; else the message of the error every rank raises (``ranks``: the group's global ranks;
    ``where``: the function called)."""
    if rows.shape[0] == 0 or (rows == rows[0]).all():
        return None
    said: dict[str, list[int]] = {}
    for r, row in enumerate(rows):
        said.setdefault(describe(row.tolist()), []).append(ranks[r])
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}" for text, rs in said.items()]
    return (f"{where}: the ranks of the group (global ranks {list(ranks)}) disagree about this call: "
            + "; ".join(parts) + ". Every rank must pass tensors of the same shape and dtype, with the same op, "
            "in the same order of calls")
