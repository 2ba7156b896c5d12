"""Which exchange carries a bucket through the collective engine, decided from counts every rank holds.

Design. Once every rank knows every rank's non-zero blocks (their bitmaps, all-gathered), the
engine can move the blocks three ways, each one collective or two on the group:

* ``gather``: one all-gather of every rank's own non-zero blocks (padded to the largest count);
  every rank sums the union itself, in rank order (float32 from -0.0, rounded once: the
  aggregators' bits). Per rank ``(W-1) d_max`` blocks cross its link.
* ``union``: the union's blocks, compacted in the same order on every rank, summed by the backend's
  own all-reduce (NCCL's ring, tree or NVLS; Gloo's ring): ``2 U (W-1)/W`` blocks per rank, summed
  in the backend's order and precision, as the dense all-reduce sums them, not in rank order.
* ``owners``: two all-to-alls, each rank's blocks to the rank that owns their lane, which sums them
  in rank order, then every owner's sums to every rank: about ``(d + U)(W-1)/W`` blocks per rank.

* ``dense``: the backend's all-reduce of the whole bucket, in place: ``2 n (W-1)/W`` blocks per
  rank, in the backend's order, with no block copied in or out.

A bucket so small that its dense all-reduce costs no more than one collective's fixed cost
(:func:`goes_dense`) skips the bitmaps and takes that all-reduce: nothing sparse can beat one
collective.

:func:`choose` prices each sparse one as bytes on the busiest rank plus, per collective,
``latency_bytes`` (the bytes a collective's fixed cost is worth on the fabric), and takes the
cheapest (ties: the one listed first above); then the dense all-reduce, where it costs less than
that one together with the blocks it copies on the rank (compacting, summing, scattering back)
priced at ``local_weight`` of a byte on the wire each. Where the link is memory (Gloo on one
host's loopback) a copy costs about a fifth of a byte on the wire; on a GPU, whose memory is tens
of times faster than its links, a few hundredths. So a bucket whose blocks are nearly all
non-zero goes ``dense`` after its bitmaps. ``order="rank"`` leaves ``union`` and ``dense`` out:
every sum is then the aggregators' bits. :class:`History` remembers per bucket shape what was chosen and how many
blocks the busiest rank had, so that the next reduction of a bucket that went ``gather`` can send
its bitmap and its blocks in one all-gather of a fixed capacity (:func:`capacity`) and skip the
bitmaps' own collective; a rank with more blocks than the capacity makes every rank send the rest
in a second all-gather (every rank sees every count in the first), so the sums stay exact. The
engine prices that steady state (``choose(fused=True)``): ``gather`` as one collective, every other
exchange with the bitmaps' all-gather besides its own collectives.

Nothing here touches a socket, a device or a clock: counts in, a decision out, the same on every
rank because the counts are.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from omnireduce.envvars import env_number


class Exchange(str, enum.Enum):
    """How the engine moves a bucket's blocks (see the module); ``AUTO`` chooses per bucket."""

    AUTO = "auto"
    GATHER = "gather"
    UNION = "union"
    OWNERS = "owners"
    DENSE = "dense"


class Order(str, enum.Enum):
    """Whose summation order the engine's sums follow: ``RANK`` (float32 in rank order, rounded once:
    the aggregators' bits; ``union`` is never chosen) or ``ANY`` (the backend's, where faster)."""

    RANK = "rank"
    ANY = "any"


RANK_ORDER = (Exchange.GATHER, Exchange.OWNERS)
"""The exchanges whose sums are in rank order."""

DEFAULT_LATENCY_BYTES = 256 << 10
"""What one collective's fixed cost is worth in bytes when nothing better is known (a 25 us latency
at 10 GB/s, or 250 us at 1 GB/s: Gloo on loopback); ``OMNIREDUCE_LATENCY_BYTES`` sets another
(:func:`latency_bytes`)."""


def latency_bytes() -> int:
    """``OMNIREDUCE_LATENCY_BYTES``, else :data:`DEFAULT_LATENCY_BYTES`: what the engine prices one
    collective at, and the size under which a bucket takes the dense all-reduce whole (0: never)."""
    value = int(env_number("OMNIREDUCE_LATENCY_BYTES", int, DEFAULT_LATENCY_BYTES))
    if value < 0:
        raise ValueError(f"OMNIREDUCE_LATENCY_BYTES must be >= 0, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Counts:
    """What the bitmaps say about one bucket, the same on every rank.

    ``nonzero[r]``: rank r's non-zero blocks; ``union``: blocks non-zero on some rank;
    ``last_in_union``: whether the tensor's last block is among them; ``pairs[s][o]``: rank s's
    blocks in lanes rank o owns; ``owned[o]``: the union's blocks rank o owns (the owners'
    exchange; empty where it was not counted)."""

    nonzero: tuple[int, ...]
    union: int
    last_in_union: bool = False
    pairs: tuple[tuple[int, ...], ...] = ()
    owned: tuple[int, ...] = ()

    @property
    def world(self) -> int:
        return len(self.nonzero)

    @property
    def most(self) -> int:
        """The largest count of any rank."""
        return max(self.nonzero, default=0)

    @classmethod
    def from_flat(cls, values: Sequence[int], world: int) -> Counts:
        """From the flat vector the device path reads in its one synchronisation: ``world`` counts,
        the union, whether the last block is in it, then (optionally) ``world * world`` pairs and
        ``world`` owned counts."""
        v = [int(x) for x in values]
        nonzero, union, last, rest = tuple(v[:world]), v[world], bool(v[world + 1]), v[world + 2:]
        if not rest:
            return cls(nonzero, union, last)
        pairs = tuple(tuple(rest[s * world:(s + 1) * world]) for s in range(world))
        return cls(nonzero, union, last, pairs, tuple(rest[world * world: world * world + world]))


LOCAL_WEIGHT_HOST = 0.2
"""A block copied in host memory, in bytes on the wire (Gloo over loopback: memory is the link)."""
LOCAL_WEIGHT_DEVICE = 0.02
"""A block copied in a GPU's memory, in bytes on the wire (HBM against NVLink or InfiniBand)."""


def blocks_moved(exchange: Exchange, c: Counts, num_blocks: int = 0) -> int:
    """Blocks the busiest rank sends in ``exchange`` (see the module); ``dense`` needs the bucket's
    ``num_blocks``."""
    W = c.world
    if W <= 1:
        return 0
    if exchange is Exchange.DENSE:
        return -(-2 * num_blocks * (W - 1) // W)
    if exchange is Exchange.GATHER:
        return (W - 1) * c.most
    if exchange is Exchange.UNION:
        return -(-2 * c.union * (W - 1) // W)
    if not c.pairs:
        raise ValueError("the owners' exchange needs the pairs' counts")
    return max(sum(c.pairs[r][o] for o in range(W) if o != r) + (W - 1) * c.owned[r] for r in range(W))


def goes_dense(numel: int, itemsize: int, world: int, *, order: Order = Order.ANY,
               latency_bytes: int = DEFAULT_LATENCY_BYTES) -> bool:
    """Whether a bucket is small enough to take the backend's dense all-reduce whole, before any
    bitmap: its ring bytes are at most what one collective's fixed cost is worth, so no sparse way,
    which needs a collective too, can beat it. Decided from its size alone (the same on every rank);
    never with ``order=RANK`` (the backend sums in its own order)."""
    return order is Order.ANY and world > 1 and 2 * (world - 1) * numel * itemsize // world <= latency_bytes


def collectives(exchange: Exchange) -> int:
    """Collectives ``exchange`` issues after the bitmaps'."""
    return 2 if exchange is Exchange.OWNERS else 1


def blocks_copied(exchange: Exchange, c: Counts) -> int:
    """Blocks the busiest rank reads or writes on its own in ``exchange`` besides the collectives
    (compacting its blocks, summing what arrived, scattering the sums back), roughly."""
    if exchange is Exchange.DENSE:
        return 0
    if exchange is Exchange.UNION:
        return 4 * c.union
    if exchange is Exchange.GATHER:
        return 2 * c.most + 3 * sum(c.nonzero) + 3 * c.union
    received = max((sum(c.pairs[s][o] for s in range(c.world)) for o in range(c.world)), default=0)
    return 4 * c.most + 2 * received + c.world * max(c.owned, default=0) + 2 * c.union


def choose(c: Counts, block_bytes: int, *, order: Order = Order.ANY, latency_bytes: int = DEFAULT_LATENCY_BYTES,
           allowed: Sequence[Exchange] = (Exchange.GATHER, Exchange.UNION, Exchange.OWNERS, Exchange.DENSE),
           num_blocks: int = 0, local_weight: float = 0.0, fused: bool = False) -> Exchange:
    """The cheapest allowed exchange for ``c``: of the sparse ones, by bytes on the busiest rank plus
    ``latency_bytes`` per collective (ties in the order of ``allowed``); the dense all-reduce where
    it costs less than that one with the blocks it copies on the rank priced at ``local_weight``.
    ``order=RANK`` allows only rank-order sums; the owners' exchange is priced only where ``c`` has
    its counts, the dense all-reduce only where the bucket's ``num_blocks`` is given and there are
    ranks to sum (at one rank the sparse exchanges run, as :func:`goes_dense` lets them).

    ``fused``: the caller fuses a shape that went ``gather`` (:class:`History`), so each exchange is
    priced as it will run from the next reduction on: ``gather``'s all-gather carries the bitmaps
    too, every other exchange pays the bitmaps' own all-gather besides its collectives. (The
    capacity's padding is not priced: priced, it sent moderately dense buckets to ``owners``, which
    measured slower than ``gather`` there.)"""
    options = [e for e in allowed if e is not Exchange.AUTO
               and (order is Order.ANY or e in RANK_ORDER) and (e is not Exchange.OWNERS or c.pairs)
               and (e is not Exchange.DENSE or (num_blocks > 0 and c.world > 1))]
    if not options:
        raise ValueError(f"no exchange left to choose among {list(allowed)} with order={order.value}")

    def wire(e: Exchange) -> float:
        calls = collectives(e) + (1 if fused and e is not Exchange.GATHER else 0)
        return blocks_moved(e, c, num_blocks) * block_bytes + calls * latency_bytes

    sparse = [e for e in options if e is not Exchange.DENSE]
    if not sparse:
        return Exchange.DENSE
    best = min(sparse, key=wire)
    copies = local_weight * blocks_copied(best, c) * block_bytes
    if Exchange.DENSE in options and wire(Exchange.DENSE) < wire(best) + copies:
        return Exchange.DENSE
    return best


def capacity(most: int, num_blocks: int) -> int:
    """Blocks per rank a fused all-gather carries for a bucket whose busiest rank last had ``most``:
    a quarter more, at least 4, rounded up to a size class (an eighth of a power of two apart: the
    buffers of successive steps then have the same sizes and reuse each other's memory), at most
    the bucket."""
    want = max(4, most + most // 4 + 1)
    step = max(1, (1 << (want.bit_length() - 1)) // 8)
    return min(num_blocks, -(-want // step) * step)


class Shape(NamedTuple):
    """What the engine's memory is keyed by: a bucket's elements, dtype and block size."""

    numel: int
    dtype: Any
    block_size: int


@dataclasses.dataclass(frozen=True)
class Step:
    """How the next reduction of a shape starts: ``fused`` with this ``capacity`` (bitmap and blocks in
    one all-gather), or not (bitmaps first, then :func:`choose`)."""

    fused: bool
    capacity: int = 0


_UNFUSED = Step(False)


@functools.lru_cache(maxsize=512)
def _fused(cap: int) -> Step:
    """The fused step of capacity ``cap`` (made once: a bucket's steady state asks for the same one)."""
    return Step(True, cap)


class History:
    """Per bucket shape, what the last reduction chose (see the module): every rank updates it from
    the same counts, so every rank takes the same next step. Bounded: the oldest shapes go first."""

    def __init__(self, limit: int = 256) -> None:
        self._last: dict[Shape, tuple[Exchange, int]] = {}
        self.limit = limit

    def next_step(self, shape: Shape, num_blocks: int, fuse: bool) -> Step:
        last = self._last.get(shape)
        if not fuse or last is None or last[0] is not Exchange.GATHER:
            return _UNFUSED
        return _fused(capacity(last[1], num_blocks))

    def record(self, shape: Shape, chosen: Exchange, counts: Counts) -> None:
        self._last.pop(shape, None)
        self._last[shape] = (chosen, counts.most)
        while len(self._last) > self.limit:
            self._last.pop(next(iter(self._last)))

    def __len__(self) -> int:
        return len(self._last)
