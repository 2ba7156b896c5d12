"""Blocks aligned to embedding rows: the block size of a DDP bucket, from its parameters' shapes.

A bucket is the flat concatenation of its parameters' gradients. With a fixed block size B, an
embedding whose row width w does not divide B has rows that straddle block boundaries: a touched
row of 200 floats on a 256 grid lands in two blocks most of the time, so up to twice the blocks
travel, each carrying parts of neighbouring rows that were not touched. Aligning the grid to the
rows fixes that: with ``B = k * w`` and the table starting on the grid, every block holds k whole
rows.

:func:`aligned_block_size` finds, per bucket, the row width that dominates it: the one with the
most elements among its 2-D (or wider) parameters (``prod(shape[1:])``; tables, and the weights of
linear layers, whose gradients are dense anyway), and returns the largest multiple of it that is at
most the configured block size (the width itself if it is wider). DDP lays parameters out back to
back without padding, so a table may start off the grid (after a bias of odd length): its rows then
straddle two blocks, which for ``w <= B`` still moves no more than the fixed grid does; a row wider
than the configured block size off the grid keeps the configured size. A bucket without 2-D
parameters keeps it too. The choice depends only on the bucket's shapes, so every rank makes the
same one.

What aligning saves in bytes and step time, and why rows of 16 keep blocks of 256, is measured in
docs/bench/training.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from omnireduce.wire import MAX_BLOCK_SIZE


def aligned_block_size(shapes: Sequence[Sequence[int]], base: int) -> int:
    """The block size of a bucket holding tensors of ``shapes`` back to back (see the module
    docstring); ``base`` is the configured block size, for buckets without a dominant row width."""
    mass: dict[int, int] = {}  # row width -> elements of the parameters with rows of that width
    aligned: dict[int, bool] = {}  # row width -> every such parameter starts on a row of the grid
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2 and shape[0] > 0 and numel > 0:
            width = numel // shape[0]
            mass[width] = mass.get(width, 0) + numel
            aligned[width] = aligned.get(width, True) and offset % width == 0
        offset += numel
    if not mass:
        return base
    width = max(mass, key=lambda w: (mass[w], w))
    block = width * max(1, base // width)
    if block > MAX_BLOCK_SIZE or (block > base and not aligned[width]):
        return base
    return block
