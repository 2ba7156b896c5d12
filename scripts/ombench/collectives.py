"""The all-reduce methods that scripts/bench_allreduce.py compares: one table from name to method.

Each :class:`Collective` in :data:`METHODS` says, for one method, how a rank sets it up (once,
after the Gloo process group exists), how one all-reduce of a float32 tensor runs, and its wire
floor: the payload bytes it must move over its busiest link direction. The benchmark's per-rank
loop and its driver only look methods up here, so a new method is one new entry.

* ``omnireduce``: an ``omnireduce.Worker`` against the first A aggregators; floor: the busiest
  link direction of :func:`~ombench.traffic.omnireduce_link_bytes`.
* ``colocated``: the job's own aggregators, as the DDP hook starts them when given no addresses
  (:func:`omnireduce.colocate.start_colocated`), each rank its own node: one aggregator process per
  rank, a child of the rank, on the rank's host (inside its namespace on the emulated network);
  floor: the busiest host link direction of :func:`~ombench.traffic.colocated_link_bytes`
  (a rank's own slots never cross its link).
* ``collective``: :class:`omnireduce.engines.collective.CollectiveEngine` on a process group of its own
  (Gloo), the ranks as aggregators: a bitmap all-gather and two ``all_to_all_single``; the Worker's
  default lanes and slots (at least W slots, slot s owned by rank ``s mod W``); bytes from the
  engine's ``stats()``; floor: the busiest rank link direction of
  :func:`~ombench.traffic.collective_link_bytes` (the colocated figure plus the bitmaps).
* ``gloo``: ``torch.distributed.all_reduce`` (ring); floor: ``2 (W-1)/W * N`` per rank.
* ``mpi``: ``MPI.COMM_WORLD.Allreduce(IN_PLACE)`` (the ranks were started by ``mpiexec``); floor:
  the ring figure, as a lower bound (MPICH picks its own algorithm).
* ``agsparse``: an all-gather of every rank's non-zero blocks and int64 indices, padded to the
  largest count K, then a local sum; floor: ``(W-1) K (4 B + 8)`` received per rank.

torch, mpi4py and omnireduce's Worker are only imported by the setup functions, in the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ombench.traffic import collective_link_bytes, colocated_link_bytes, omnireduce_link_bytes

INDEX_BYTES = 8  # agsparse sends int64 block indices


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What a method's setup needs from its rank."""

    rank: int
    world: int
    block: int
    dist: Any
    """``torch.distributed``, with the Gloo process group initialised."""
    aggregators: list[str]
    """Addresses of every aggregator process; omnireduce with A aggregators uses the first A."""
    aggregator_pids: list[int]
    job: str
    timeout: float
    lanes: int | None = None
    slots: int | None = None


@dataclasses.dataclass
class Prepared:
    """A method set up in one rank: ``run(x)`` all-reduces the float32 tensor ``x`` in place."""

    run: Callable[[Any], Any]
    worker: Any = None
    """The ``omnireduce.Worker`` (its byte counters, lanes and slots), or None."""
    aggregator_pids: list[int] = dataclasses.field(default_factory=list)
    """The aggregator processes whose CPU time the method uses."""
    owned: Any = None
    """Something else the setup made, closed after the worker (the colocated aggregators, the engine)."""
    counters: Callable[[], dict[str, int]] | None = None
    """This rank's byte counters (``bytes_sent``, ``bytes_received``, ...): the Worker's or the
    engine's ``stats``; None for methods that count nothing (their bytes are the floor's)."""
    lanes: int = 0
    slots: int = 0
    """The layout limits the method runs with (omnireduce, colocated, collective; 0 otherwise)."""

    def __post_init__(self) -> None:
        if self.worker is not None:
            self.counters = self.counters or self.worker.stats
            self.lanes, self.slots = self.lanes or self.worker.config.lanes, self.slots or self.worker.config.slots

    def close(self) -> None:
        """Release what the setup made (the omnireduce Worker's connections, colocated aggregators)."""
        if self.worker is not None:
            self.worker.close()
        if self.owned is not None:
            self.owned.close()


Floor = Callable[[np.ndarray, int, int, int, int, int], tuple[int, str]]
"""``(masks, numel, block, aggregators, lanes, slots) -> (bytes, link)``: the bytes the method must
move over its busiest link direction and which one (``masks``: W x blocks, non-zero blocks)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One all-reduce method of the benchmark."""

    setup: Callable[[RankSetup, int], Prepared]
    """``(rank setup, aggregators) -> Prepared``; ``aggregators`` matters to omnireduce only."""
    floor: Floor
    needs_mpi: bool = False
    """The ranks must be started by ``mpiexec`` (and import mpi4py before torch.distributed)."""


def agsparse(x: Any, block: int, dist: Any, torch: Any) -> Any:
    """All-gather of non-zero blocks and their indices (two all_gathers: counts, then padded payloads)."""
    nb = -(-x.numel() // block)
    padded = torch.nn.functional.pad(x, (0, nb * block - x.numel())).view(nb, block)
    idx = padded.ne(0).any(1).nonzero().view(-1)
    W = dist.get_world_size()
    count = torch.tensor([idx.numel()])
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(W)]
    dist.all_gather(counts, count)
    most = int(max(c.item() for c in counts))
    send_idx = torch.full((most,), -1, dtype=torch.long)
    send_idx[: idx.numel()] = idx
    send_val = torch.zeros(most, block)
    send_val[: idx.numel()] = padded[idx]
    all_idx = [torch.empty_like(send_idx) for _ in range(W)]
    all_val = [torch.empty_like(send_val) for _ in range(W)]
    dist.all_gather(all_idx, send_idx)
    dist.all_gather(all_val, send_val)
    out = torch.zeros_like(padded)
    for i, v, c in zip(all_idx, all_val, counts, strict=True):
        n = int(c.item())
        out.index_add_(0, i[:n], v[:n])
    x.copy_(out.view(-1)[: x.numel()])
    return x


# -- setups


def _omnireduce_setup(s: RankSetup, aggregators: int) -> Prepared:
    import omnireduce

    w = omnireduce.Worker(s.aggregators[:aggregators], rank=s.rank, world_size=s.world, job=f"{s.job}-A{aggregators}",
                          block_size=s.block, timeout=s.timeout, lanes=s.lanes, slots=s.slots)
    return Prepared(w.allreduce, worker=w, aggregator_pids=s.aggregator_pids[:aggregators])


def _colocated_setup(s: RankSetup, _aggregators: int) -> Prepared:
    import os

    import omnireduce
    from omnireduce.colocate import start_colocated

    os.environ["GROUP_RANK"] = str(s.rank)  # every rank a node of its own: one aggregator per rank host
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # the emulated network: listen on the host's shaped interface
        os.environ["OMNIREDUCE_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
    aggs = start_colocated(timeout=s.timeout)
    w = omnireduce.Worker(aggs.addresses, rank=s.rank, world_size=s.world, job=f"{s.job}-colocated",
                          block_size=s.block, timeout=s.timeout, token=aggs.token, lanes=s.lanes, slots=s.slots)
    pids: list[Any] = [None] * s.world
    s.dist.all_gather_object(pids, [p.pid for p in aggs.processes])  # one PID namespace: rank 0 reads them all
    return Prepared(w.allreduce, worker=w, aggregator_pids=[p for ps in pids for p in ps],
                    owned=_AfterEveryRank(aggs, s.dist))


class _AfterEveryRank:
    """Close ``closeable`` once every rank has got here (each rank's worker has left the job), so that
    no worker sees an aggregator go while it still says goodbye. Every rank closes its methods in
    the same order, so the barriers match."""

    def __init__(self, closeable: Any, dist: Any) -> None:
        self.closeable, self.dist = closeable, dist

    def close(self) -> None:
        self.dist.barrier()
        self.closeable.close()


def _collective_setup(s: RankSetup, _aggregators: int) -> Prepared:
    from omnireduce.config import DEFAULT_LANES, DEFAULT_SLOTS
    from omnireduce.engines.collective import CollectiveEngine

    engine = CollectiveEngine.for_group(s.dist.group.WORLD, s.timeout, s.block, s.lanes or DEFAULT_LANES,
                                        s.slots or DEFAULT_SLOTS)
    return Prepared(lambda x: engine.allreduce_async(x).wait(), counters=engine.stats, owned=engine,
                    lanes=engine.lanes, slots=engine.slots)


def _gloo_setup(s: RankSetup, _aggregators: int) -> Prepared:
    return Prepared(s.dist.all_reduce)


def _mpi_setup(_s: RankSetup, _aggregators: int) -> Prepared:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return Prepared(lambda x: comm.Allreduce(MPI.IN_PLACE, x.numpy()))


def _agsparse_setup(s: RankSetup, _aggregators: int) -> Prepared:
    import torch

    return Prepared(lambda x: agsparse(x, s.block, s.dist, torch))


# -- wire floors


def _omnireduce_floor(masks: np.ndarray, numel: int, block: int, aggregators: int, lanes: int,
                      slots: int) -> tuple[int, str]:
    links = omnireduce_link_bytes(masks, numel, block, aggregators, lanes, slots)
    busiest = max(links, key=lambda k: links[k])
    return links[busiest], busiest


def _colocated_floor(masks: np.ndarray, numel: int, block: int, _aggregators: int, lanes: int,
                     slots: int) -> tuple[int, str]:
    links = colocated_link_bytes(masks, numel, block, lanes, slots)
    busiest = max(links, key=lambda k: links[k])
    return links[busiest], busiest


def _collective_floor(masks: np.ndarray, numel: int, block: int, _aggregators: int, lanes: int,
                      slots: int) -> tuple[int, str]:
    links = collective_link_bytes(masks, numel, block, lanes, slots)
    busiest = max(links, key=lambda k: links[k])
    return links[busiest], busiest


def _ring_floor(masks: np.ndarray, numel: int, *_: int) -> tuple[int, str]:
    W = masks.shape[0]
    return round(2 * (W - 1) / W * numel * 4), "every worker, up and down (ring)"


def _allgather_floor(masks: np.ndarray, _numel: int, block: int, *_: int) -> tuple[int, str]:
    W = masks.shape[0]
    most = int(masks.sum(axis=1).max())
    return (W - 1) * most * (block * 4 + INDEX_BYTES), "every worker down (padded all-gather)"


METHODS: dict[str, Collective] = {
    "omnireduce": Collective(_omnireduce_setup, _omnireduce_floor),
    "colocated": Collective(_colocated_setup, _colocated_floor),
    "collective": Collective(_collective_setup, _collective_floor),
    "gloo": Collective(_gloo_setup, _ring_floor),
    "mpi": Collective(_mpi_setup, _ring_floor, needs_mpi=True),
    "agsparse": Collective(_agsparse_setup, _allgather_floor),
}
"""Every method, by the name ``--methods`` uses."""


def wire_floor(method: str, masks: np.ndarray, numel: int, block: int, aggregators: int, lanes: int,
               slots: int) -> tuple[int, str]:
    """``(bytes, link)``: the bytes ``method`` must move over its busiest link direction, and which one.

    ``aggregators`` matters to omnireduce only; ``lanes`` and ``slots`` (the Worker's or the
    engine's) to omnireduce, colocated and collective.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}")
    return METHODS[method].floor(masks, numel, block, aggregators, lanes, slots)
