"""Which of the collective engine's reductions a CUDA graph carries: the preconditions, and the book of
graphs an engine keeps (sans-I/O: no torch, no device, no clock).

Design. In the steady state a sparse bucket's reduction is a fused ``gather``
(:class:`omnireduce.engines.plan.History`): one all-gather of every rank's bitmap and first
``capacity`` blocks, the counts, the sums. Once the bucket's layout and that capacity are known, the
whole of it can be captured as a CUDA graph and replayed, one launch instead of a handful
(:mod:`omnireduce.engines.graphs` does the device's part). What decides, here:

* :func:`refusal`: why a reduction cannot be captured (None: it can). A graph carries only the
  kernel exchange's fused steps on a CUDA tensor, exact (no lossy threshold), with kernels that
  have the guarded sum, over a process group that does not wait on the host inside a collective;
  and nothing after a capture failed once.
* :class:`GraphBook`: per :class:`GraphKey` (the bucket's memory, elements, dtype, block size, the
  capacity, the group's size, the lanes, whether the owners' pairs are counted, averaging), what the
  next reduction does (:class:`Action`): the first of a key runs uncaptured (the process group's
  communicator, the kernels and the capacity are then known to work), the second is captured, and
  every later one replays. At most ``limit`` graphs are kept, the least recently used let go first.

A graph is bound to the memory it was captured on, so the key holds the bucket's address: a DDP
bucket's buffer stays put from its second iteration on, and a tensor elsewhere is another key.

Every rank decides for itself. That is safe because a replay issues the collectives the uncaptured
path issues at the same point, with the same sizes (one all-gather of the same record; after an
overflow, the same second one), so ranks that capture at different reductions, or not at all,
still meet at every collective. After a replay the counts say whether any rank had more blocks
than the capacity (:func:`overflowed`): the same answer on every rank, so every rank finishes the
same way.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Generic, NamedTuple, TypeVar

G = TypeVar("G")


class GraphKey(NamedTuple):
    """What a captured reduction is bound to (see the module)."""

    device: str
    address: int
    numel: int
    dtype: str
    block_size: int
    capacity: int
    world: int
    total_lanes: int
    pairs: bool
    average: bool


class Action(str, enum.Enum):
    """What the next reduction of a key does."""

    RUN = "run"  # uncaptured (the key's first, or graphs off after a failure)
    CAPTURE = "capture"  # capture its steps, then replay them
    REPLAY = "replay"


def refusal(*, device_type: str, graph_device: str, threshold: float, kernels: object, fused: bool, world: int,
            max_world: int, host_waits: bool, broken: str | None) -> str | None:
    """Why a reduction cannot be carried by a CUDA graph, or None where it can: ``device_type`` the
    tensor's, ``graph_device`` the one graphs are made on (``"cuda"``); ``kernels`` the kernel
    exchange's (None: the torch ops' way); ``fused`` the step :class:`~omnireduce.engines.plan.History`
    gave; ``host_waits``: the process group waits for its collectives on the host (NCCL's blocking
    wait), which a capture cannot hold; ``broken``: why an earlier capture failed."""
    if broken is not None:
        return f"a capture failed earlier: {broken}"
    if device_type != graph_device:
        return f"not a {graph_device} tensor ({device_type})"
    if threshold > 0.0:
        return "a lossy threshold (the torch ops' way)"
    if kernels is None:
        return "the torch ops' way (no kernel exchange: OMNIREDUCE_ENGINE_KERNELS=1 gives one)"
    if not callable(getattr(kernels, "sum_blocks_within", None)):
        return "kernels without the guarded sum (built before it)"
    if not fused:
        return "not fused: the bitmaps go first"
    if world > max_world:
        return f"a group of {world} ranks (the kernels count at most {max_world})"
    if host_waits:
        return "the process group waits on the host (blocking wait)"
    return None


def overflowed(nonzero: tuple[int, ...], capacity: int) -> bool:
    """Whether some rank had more non-zero blocks than a fused all-gather's ``capacity`` carried: the
    graph's sums wrote nothing, and the rest of the blocks still has to travel (the same on every rank)."""
    return max(nonzero, default=0) > capacity


class GraphBook(Generic[G]):
    """The graphs of one engine and what each key's next reduction does (see the module). Bounded:
    ``limit`` graphs, the least recently used let go first, and ``4 * limit`` keys remembered as seen.
    Whoever holds the graphs frees what :meth:`make_room`, :meth:`fail` and :meth:`close` return."""

    def __init__(self, limit: int = 16) -> None:
        if limit < 1:
            raise ValueError(f"a graph book keeps at least one graph, got limit={limit}")
        self.limit = limit
        self._graphs: OrderedDict[GraphKey, G] = OrderedDict()
        self._seen: OrderedDict[GraphKey, None] = OrderedDict()
        self.broken: str | None = None
        self.counts = {"graph_captures": 0, "graph_replays": 0, "graph_fallbacks": 0, "graph_failures": 0}

    def plan(self, key: GraphKey) -> Action:
        """What the reduction of ``key`` about to run does; the key counts as seen from now on."""
        if self.broken is not None:
            return Action.RUN
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return Action.REPLAY
        if key in self._seen:
            return Action.CAPTURE
        self._seen[key] = None
        while len(self._seen) > 4 * self.limit:
            self._seen.popitem(last=False)
        return Action.RUN

    def make_room(self) -> list[G]:
        """The graphs to let go before one more is captured (the least recently used, down to
        ``limit - 1``): freed before a capture begins, never during one."""
        out = []
        while len(self._graphs) >= self.limit:
            out.append(self._graphs.popitem(last=False)[1])
        return out

    def captured(self, key: GraphKey, graph: G) -> None:
        """``graph`` now carries ``key`` (its first replay is the reduction that captured it)."""
        self._graphs[key] = graph
        self.counts["graph_captures"] += 1

    def graph(self, key: GraphKey) -> G:
        return self._graphs[key]

    def replayed(self, overflow: bool) -> None:
        """A graph carried a reduction; ``overflow``: its counts said the capacity was short, and the
        uncaptured path finished it."""
        self.counts["graph_replays"] += 1
        self.counts["graph_fallbacks"] += overflow

    def fail(self, reason: str) -> list[G]:
        """A capture failed: no graph from now on (every later reduction runs uncaptured); the graphs to free."""
        self.broken = reason
        self.counts["graph_failures"] += 1
        return self.close()

    def close(self) -> list[G]:
        """Every graph held, to free; the book keeps none."""
        out = list(self._graphs.values())
        self._graphs.clear()
        self._seen.clear()
        return out

    def __len__(self) -> int:
        return len(self._graphs)
