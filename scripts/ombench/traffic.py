"""Bytes on the wire: what each all-reduce scheme must move, as plain arithmetic.

Pure functions of sizes and block masks (numpy only; no processes, no torch), so they can be
checked by hand: the ring all-reduce's per-rank bytes, the elements PowerSGD sends once it
compresses, and the payload omnireduce moves over every link direction given which blocks are
non-zero on which rank and which aggregator owns each block, and what the collective engine
(:mod:`omnireduce.engines.collective`, the ranks as aggregators) moves per rank. The benchmarks turn these
into wire floors (bytes over the busiest link direction / link rate) and bytes-per-step columns.
"""

from __future__ import annotations

import math

import numpy as np

from omnireduce.blocks import Layout


def ring_bytes(nbytes: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (W-1)/W * nbytes``."""
    return 2 * (world - 1) * nbytes / world if world > 1 else 0.0


def block_bytes(numel: int, block: int, itemsize: int = 4) -> np.ndarray:
    """Bytes of each block's real elements (the short last block counts only its real elements)."""
    nb = -(-numel // block)
    sizes = np.full(nb, block * itemsize, dtype=np.int64)
    if numel % block:
        sizes[-1] = (numel % block) * itemsize
    return sizes


def omnireduce_link_bytes(masks: np.ndarray, numel: int, block: int, aggregators: int, lanes: int,
                          slots: int) -> dict[str, int]:
    """Payload bytes over every link direction of an omnireduce all-reduce (``masks``: W x blocks).

    Block b is in lane ``b mod T``, slot ``(b mod T) div L`` of ``Layout.for_tensor(numel, block,
    lanes, slots)``; slot s goes to aggregator ``s mod A``. Each worker sends its non-zero blocks
    up and receives the union down; each aggregator receives its slots' blocks from every worker
    and sends its slots' sums to every worker.
    """
    W = masks.shape[0]
    sizes = block_bytes(numel, block)
    layout = Layout.for_tensor(numel, block, lanes, slots)
    lane = np.arange(sizes.size) % (layout.lanes * layout.slots)
    owner = (lane // layout.lanes) % aggregators  # slot s -> aggregator s mod A
    union = masks.any(axis=0)
    links: dict[str, int] = {}
    for w in range(W):
        links[f"w{w} up"] = int(sizes[masks[w]].sum())
        links[f"w{w} down"] = int(sizes[union].sum())
    for a in range(aggregators):
        mine = owner == a
        links[f"a{a} down"] = int(sum(sizes[masks[w] & mine].sum() for w in range(W)))
        links[f"a{a} up"] = int(W * sizes[union & mine].sum())
    return links


def colocated_link_bytes(masks: np.ndarray, numel: int, block: int, lanes: int, slots: int) -> dict[str, int]:
    """Payload bytes over every worker host's link directions with colocated aggregators (``masks``: W x blocks).

    Aggregator h runs on worker host h (W aggregators; slot s goes to aggregator ``s mod W``, the
    blocks of its slots are ``G_h``). Traffic between a worker and the aggregator on its own host
    never crosses its link: host h sends up its worker's blocks of the other aggregators
    (``M_h - G_h``) and its aggregator's sums to the W-1 other workers (``U & G_h``, each), and
    receives down the other aggregators' sums (``U - G_h``) and the other workers' blocks of its
    slots (``M_v & G_h``, v != h).
    """
    W = masks.shape[0]
    sizes = block_bytes(numel, block)
    layout = Layout.for_tensor(numel, block, lanes, slots)
    lane = np.arange(sizes.size) % (layout.lanes * layout.slots)
    owner = (lane // layout.lanes) % W
    union = masks.any(axis=0)
    links: dict[str, int] = {}
    for h in range(W):
        mine = owner == h
        links[f"host{h} up"] = int(sizes[masks[h] & ~mine].sum() + (W - 1) * sizes[union & mine].sum())
        links[f"host{h} down"] = int(sizes[union & ~mine].sum()
                                     + sum(sizes[masks[v] & mine].sum() for v in range(W) if v != h))
    return links


def collective_link_bytes(masks: np.ndarray, numel: int, block: int, lanes: int, slots: int,
                          itemsize: int = 4, exchange: str = "auto") -> dict[str, int]:
    """Bytes each rank sends (``r{w} up``) and receives (``r{w} down``) in one reduction of the
    collective engine (``masks``: W x blocks; ``lanes``, ``slots``: the engine's, which makes at
    least W slots), through ``exchange`` (``auto``: the one the engine chooses from these masks,
    ``omnireduce.engines.plan.choose``, or for a bucket small enough, ``plan.goes_dense``, the
    backend's all-reduce of the whole bucket: ``2 (W-1)/W`` of its bytes each way, no bitmaps).
    Every block travels whole (the short last block padded): ``s`` bytes a block.

    First the bitmap all-gather: every rank sends its ``ceil(nb / 8)`` bytes to, and receives them
    from, each of the W-1 others. Then, with U the union's blocks and M_w rank w's:

    * ``gather``: an all-gather of every rank's blocks padded to the most any rank has, m:
      ``(W-1) m s`` each way;
    * ``union``: a ring all-reduce of the union's blocks: ``2 (W-1)/W U s`` each way;
    * ``owners``: lane l is owned by rank ``l mod W`` (``omnireduce.engines.sparse_rows.owners``;
      ``G_w``: the blocks of rank w's lanes, in the layout of
      ``Layout.for_tensor(numel, block, lanes, max(slots, W), itemsize)``); blocks to their owners
      (rank w sends ``M_w - G_w`` and receives ``M_v & G_w`` from each other rank v), then sums back
      (rank w sends ``U & G_w`` to each of the W-1 others and receives ``U - G_w``). With the blocks
      spread evenly over the owners, density d per rank and union density u, each is about
      ``(W-1)/W (d + u) N`` (:func:`collective_rank_bytes`).
    """
    from omnireduce.engines.plan import Counts, Exchange, choose, goes_dense
    from omnireduce.engines.sparse_rows import owners

    W = masks.shape[0]
    slots = max(slots, W)
    s = block * itemsize
    if exchange == "auto" and goes_dense(numel, itemsize, W):  # (small: the dense all-reduce, no bitmaps)
        ring = 2 * (W - 1) * numel * itemsize // W
        return {f"r{w} {way}": ring for w in range(W) for way in ("up", "down")}
    owner = owners(Layout.for_tensor(numel, block, lanes, slots, itemsize), W)
    union = masks.any(axis=0)
    bitmaps = (W - 1) * (-(-masks.shape[1] // 8))
    if exchange == "auto":
        pairs = tuple(tuple(int((masks[v] & (owner == o)).sum()) for o in range(W)) for v in range(W))
        counts = Counts(tuple(int(m.sum()) for m in masks), int(union.sum()), bool(union[-1]) if union.size else False,
                        pairs, tuple(int((union & (owner == o)).sum()) for o in range(W)))
        exchange = choose(counts, s, allowed=[Exchange.GATHER, Exchange.UNION] + ([Exchange.OWNERS] if W > 2 else []))
        exchange = exchange.value
    links: dict[str, int] = {}
    for w in range(W):
        if exchange == "gather":
            up = down = (W - 1) * int(masks.sum(axis=1).max()) * s
        elif exchange == "union":
            up = down = 2 * (W - 1) * int(union.sum()) * s // W
        else:
            mine = owner == w
            up = s * int((masks[w] & ~mine).sum() + (W - 1) * (union & mine).sum())
            down = s * int((union & ~mine).sum() + sum((masks[v] & mine).sum() for v in range(W) if v != w))
        links[f"r{w} up"], links[f"r{w} down"] = bitmaps + up, bitmaps + down
    return links


def collective_rank_bytes(nbytes: float, world: int, density: float, union: float, block_bytes: int = 1024) -> float:
    """Bytes each rank of the collective engine sends (and receives) in one reduction of ``nbytes``,
    in expectation, with every rank's non-zero blocks (fraction ``density``) and their union
    (fraction ``union``) spread evenly over the W owners: ``(W-1) (nb/8 + d N / W + u N / W)``,
    nb = N / ``block_bytes``. The ring's ``2 (W-1)/W N`` (:func:`ring_bytes`) is the d = u = 1 case
    less the bitmaps."""
    if world <= 1:
        return 0.0
    nb = nbytes / block_bytes
    return (world - 1) * (math.ceil(nb / 8) + (density + union) * nbytes / world)


def union_density(density: float, world: int, placement: str = "random") -> float:
    """The union's density of W ranks' blocks at ``density`` each: ``1 - (1 - d)^W`` for blocks
    drawn independently (``random``), ``d`` for the same blocks on every rank (``overlap``)."""
    if placement == "overlap":
        return density
    if placement != "random":
        raise ValueError(f"placement must be 'random' or 'overlap', got {placement!r}")
    return 1.0 - (1.0 - density) ** world


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float) -> dict[str, int]:
    """Elements PowerSGD all-reduces per step once compressing, as ``powerSGD_hook`` splits the tensors.

    Each gradient is viewed as ``n x m`` (n = first dimension); with ``r = min(n, m, rank)`` it is
    compressed iff ``(n + m) r * min_compression_rate < n m``, sending P (n x r) and Q (m x r); the
    others (``uncompressed``) are all-reduced whole.
    """
    p = q = unc = 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if shape else 1
        m = numel // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p += n * r
            q += m * r
        else:
            unc += numel
    return {"p": p, "q": q, "uncompressed": unc, "total": p + q + unc}
