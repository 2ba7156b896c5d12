"""The benchmark's tensors: blocks non-zero at a given density, placed per rank or alike on every rank.

A tensor of ``numel`` elements is cut into blocks of ``block`` elements; ``int(blocks * density)``
blocks (at least one, at any positive density) are non-zero, with normal values. ``random``: each
rank picks its blocks independently (seeded by rank), so the union grows with the ranks; ``overlap``:
every rank picks the same blocks (the hot rows of an embedding table), with values of its own. Density
1 is every block. The workload of the OmniReduce paper's artifact.
"""

from __future__ import annotations

import torch

PLACEMENTS = ("random", "overlap")


def one_block(numel: int, *, rank: int, block: int = 256, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """A single non-zero block, the same one on every rank (values of each rank's own): the smallest
    sparse reduction, whose time is an engine's fixed cost."""
    nb = -(-numel // block)
    g = torch.Generator().manual_seed(seed * 7919)
    x = torch.zeros(nb, block)
    x[int(torch.randint(nb, (1,), generator=g))] = torch.randn(block, generator=g) * (1.0 + rank)
    return x.reshape(-1)[:numel].to(dtype).contiguous().to(device)


def sparse(numel: int, density: float, *, rank: int, block: int = 256, placement: str = "random",
           dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """A tensor as the module says (made on the CPU, then moved to ``device``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    nb = -(-numel // block)
    k = nb if density >= 1 else max(1, int(nb * density)) if density > 0 else 0
    pick = torch.Generator().manual_seed(seed * 7919 + (0 if placement == "overlap" else rank + 1))
    blocks = torch.randperm(nb, generator=pick)[:k]
    values = torch.Generator().manual_seed(seed * 7919 + 104729 + rank)
    x = torch.zeros(nb, block)
    x[blocks] = torch.randn(k, block, generator=values)
    return x.reshape(-1)[:numel].to(dtype).contiguous().to(device)
