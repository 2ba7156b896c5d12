"""Blocks aligned to embedding rows: the block size of a DDP bucket, from its parameters' shapes.

A bucket is the flat concatenation of its parameters' gradients. With a fixed block size B, an
embedding whose row width w does not divide B has rows that straddle block boundaries: a touched
row of 200 floats on a 256 grid lands in two blocks most of the time, so up to twice the blocks
travel (and each block carries neighbouring rows that were not touched). Aligning the grid to the
rows fixes that: with ``B = k * w`` and the table starting at a multiple of w in the bucket, every
block holds k whole rows.

:func:`aligned_block_size` picks, per bucket, the 2-D (or wider) parameter with the most elements
(the table whose rows dominate the bucket's traffic), and returns the largest multiple of its row
width that is at most the configured block size (the row width itself if it is wider), provided the
table starts at a multiple of its row width in the bucket (DDP lays parameters out back to back,
without padding); otherwise, or for a bucket without such a parameter, the configured block size.
The choice depends only on the bucket's shapes, so every rank makes the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from omnireduce.wire import MAX_BLOCK_SIZE


def aligned_block_size(shapes: Sequence[Sequence[int]], base: int) -> int:
    """The block size of a bucket holding tensors of ``shapes`` back to back (see the module
    docstring); ``base`` is the configured block size."""
    best, best_numel, offset = None, 0, 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2 and shape[0] > 0 and numel > best_numel:
            best, best_numel = (offset, numel // shape[0]), numel
        offset += numel
    if best is None:
        return base
    start, width = best
    if width < 1 or start % width:
        return base
    block = width * max(1, base // width)
    return block if block <= MAX_BLOCK_SIZE else base
