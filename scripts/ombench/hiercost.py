"""The cost model on nodes of G GPUs: the hierarchy against a hierarchical ring and flat omnireduce.

Extends :mod:`ombench.costmodel` (read it first: CPU per op, message and MB, fitted on this 2-core
machine; bytes per link direction; phases pipelined over slots) to a cluster of ``N`` nodes of
``G`` GPUs: NVLink inside a node (``nvlink_bytes_s`` per GPU and direction), one NIC per GPU
(``nic_bytes_s`` per direction), a core per process. Everything here is a PREDICTION: the CPU
costs are this machine's, the cluster is assumed.

What one step's reduction of ``n`` bytes (one DDP buffer) costs
----------------------------------------------------------------
* **Hierarchical ring at its floor** (NCCL's): reduce-scatter in the node over NVLink, a ring
  all-reduce of the shard ``n / G`` among the node's peers (one per node, over its own NIC),
  all-gather over NVLink::

      (G-1)/G n / B  +  2 (N-1)/N (n/G) / R  +  (G-1)/G n / B

* **Hierarchical omnireduce** (:mod:`omnireduce.engines.hierarchy`): the same NVLink steps at the same
  floor, and in between ``G`` rails at once, rail ``i`` an omnireduce job of the ``N`` local ranks
  ``i`` reducing shard ``i`` (``n / G``) at the density of the node's sum.
* **Flat omnireduce**: one job of all ``W = N G`` ranks, each over its own NIC.

The omnireduce jobs run at colocated aggregators, ``P`` per node (``OMNIREDUCE_AGGREGATORS_PER_NODE``),
listed in node order; a job's tensor has the Worker's layout (``Layout.for_tensor`` with
``max(4, A)`` slots, A = N P), and slot ``s`` of job ``j`` goes to aggregator ``(s + offset_j) mod A``.
Two deployments (:class:`Cluster.spread`):

* ``spread`` (the default; what the hierarchy needs): ``P = G``, aggregator ``p`` of a node on the
  node's NIC ``p``, and the rails' slots staggered over the aggregators (``offset_j = j A / J``).
* ``as coded``: ``P = 1``, every aggregator of a node on one NIC (colocate.py listens on the one
  address that routes to the master), and every rail's slot ``s`` at aggregator ``s mod A`` (the
  identity route of ``worker/op.py``: all rails load the same aggregators).

Traffic is the **expected** traffic of random block placement (no masks): a member of a job sends
``d_sent`` of its tensor's blocks and receives the union ``d_union`` of them, spread evenly over the
slots (block ``b`` in lane ``b mod T``). Bytes between a rank and an aggregator of its own node do
not cross a NIC. Every count is linear in the two densities, so :func:`jobs_structure` builds it
once per cluster and :meth:`JobsStructure.at` evaluates it per density. Densities, per GPU density
``d``: ``independent`` (each rank's blocks drawn independently): the node's sum holds
``1 - (1-d)^G`` (:func:`union_density`), a rail's union ``1 - (1-d)^(G N)``, a flat job's union the
same; ``overlapping`` (every rank has the same blocks): both ``d``.

Time of the jobs' part: :func:`ombench.costmodel.phased_time` over all the jobs' processes and NIC
directions at once (they run concurrently): the scan of a member's tensor, then up and down phases,
each as long as its busiest process or NIC direction, pipelined over the fewest slots (all jobs
together) an aggregator with work holds; + 2 latency per round trip. An aggregator pays its per-op
cost once per job it serves. The steps of one buffer follow each other (no overlap across
buckets, for omnireduce and the ring alike).

Assumptions (besides the base model's): the rank's CPU costs are those fitted for CPU tensors
(the GPU's scan and the device-host copies of a CUDA shard are not modelled: the fitted host scan
stands in for them); NVLink and the rings run at their bandwidth floors (no latency, no NCCL
protocol overheads); each aggregator and rank has a core of its own; NICs are independent
(a rail-optimised, non-blocking fabric).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ombench.costmodel import (
    MB,
    CostParams,
    Machine,
    Prediction,
    crossover_density,
    message_bytes,
    phased_time,
    rank_cpu,
    ring_floor,
)
from omnireduce.blocks import Layout
from omnireduce.config import DEFAULT_LANES, DEFAULT_SLOTS

PLACEMENTS = ("independent", "overlapping")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus`` GPUs; NIC and NVLink rates in bytes/s per GPU and direction;
    ``latency_s`` one way per message over the network; ``spread``: the deployment (module
    docstring); ``aggregators_per_node``: P (None: G when spread, 1 when not)."""

    nodes: int
    nic_bytes_s: float
    gpus: int = 8
    nvlink_bytes_s: float = 300e9
    latency_s: float = 25e-6
    spread: bool = True
    aggregators_per_node: int | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    @property
    def per_node(self) -> int:
        if self.aggregators_per_node is not None:
            return self.aggregators_per_node
        return self.gpus if self.spread else 1

    @property
    def aggregators(self) -> int:
        return self.nodes * self.per_node


# --------------------------------------------------------------------------------------------
# densities and floors


def union_density(d: float, k: int) -> float:
    """Fraction of blocks non-zero in at least one of ``k`` ranks that each hold ``d`` of them,
    independently: ``1 - (1-d)^k``."""
    return 1.0 - (1.0 - d) ** k


def densities(d: float, c: Cluster, placement: str, hierarchical: bool) -> tuple[float, float]:
    """(what a job's member sends, the job's union) for per-GPU density ``d``: a rail member sends
    the node's sum; a flat member its own blocks (module docstring)."""
    if placement == "overlapping":
        return d, d
    if placement != "independent":
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    sent = union_density(d, c.gpus) if hierarchical else d
    return sent, union_density(d, c.world)


def nvlink_step_s(nbytes: float, c: Cluster) -> float:
    """A reduce-scatter (or all-gather) of ``nbytes`` in the node at NVLink's floor: each GPU sends
    and receives ``(G-1)/G nbytes``."""
    return (c.gpus - 1) / c.gpus * nbytes / c.nvlink_bytes_s


def hierarchical_ring_floor(nbytes: float, c: Cluster) -> Prediction:
    """NCCL's hierarchical all-reduce at its floor: reduce-scatter (NVLink), ring all-reduce of
    ``nbytes / G`` across the nodes (NIC), all-gather (NVLink)."""
    rs = nvlink_step_s(nbytes, c)
    cross = ring_floor(nbytes / c.gpus, c.nodes, c.nic_bytes_s)
    return Prediction(2 * rs + cross, "link", {"reduce-scatter": rs, "cross": cross, "all-gather": rs})


# --------------------------------------------------------------------------------------------
# the omnireduce jobs' expected traffic, linear in the densities


@dataclasses.dataclass(frozen=True)
class JobsStructure:
    """Concurrent omnireduce jobs on a cluster, as coefficients: every byte count is ``blocks x
    density + overhead`` (the densities: ``d_sent`` for blocks sent up, ``d_union`` for sums sent
    down; overheads are the messages' headers and bitmaps). Arrays are per process (ranks: every
    job's members; aggregators) or per NIC direction (``nic_*``: one entry per NIC)."""

    tensor_bytes: float  # a member's tensor (what it scans)
    rank_blocks: np.ndarray  # bytes of a member's blocks (its tensor)
    rank_over: np.ndarray  # header bytes each way
    rank_messages: np.ndarray  # each way
    agg_up_blocks: np.ndarray  # received: x d_sent
    agg_down_blocks: np.ndarray  # sent: x d_union
    agg_over: np.ndarray  # each way
    agg_messages: np.ndarray  # each way
    agg_ops: np.ndarray  # jobs it serves
    agg_slots: np.ndarray  # slots it holds, all jobs
    nic_up_out: np.ndarray  # up phase, leaving the node (x d_sent) ...
    nic_up_in: np.ndarray  # ... and arriving (x d_sent)
    nic_down_out: np.ndarray  # down phase (x d_union)
    nic_down_in: np.ndarray
    nic_up_out_over: np.ndarray
    nic_up_in_over: np.ndarray
    nic_down_out_over: np.ndarray
    nic_down_in_over: np.ndarray
    round_trips: int

    def at(self, d_sent: float, d_union: float) -> dict[str, np.ndarray]:
        """Bytes at the given densities: ``rank_sent``, ``rank_received``, ``agg_received``,
        ``agg_sent`` per process; ``nic_up``/``nic_down``: per NIC direction (outgoing NICs first,
        then incoming) in each phase."""
        return {"rank_sent": d_sent * self.rank_blocks + self.rank_over,
                "rank_received": d_union * self.rank_blocks + self.rank_over,
                "agg_received": d_sent * self.agg_up_blocks + self.agg_over,
                "agg_sent": d_union * self.agg_down_blocks + self.agg_over,
                "nic_up": np.concatenate([d_sent * self.nic_up_out + self.nic_up_out_over,
                                          d_sent * self.nic_up_in + self.nic_up_in_over]),
                "nic_down": np.concatenate([d_union * self.nic_down_out + self.nic_down_out_over,
                                            d_union * self.nic_down_in + self.nic_down_in_over])}


def job_layout(numel: int, block: int, aggregators: int, lanes: int = DEFAULT_LANES) -> Layout:
    """The Worker's layout of a job's tensor: ``max(4, A)`` slots at most (``OMNIREDUCE_SLOTS``'s default)."""
    return Layout.for_tensor(numel, block, lanes, max(DEFAULT_SLOTS, aggregators))


def slot_bytes(layout: Layout) -> np.ndarray:
    """Bytes of the blocks of each slot (block ``b`` in lane ``b mod T``, slot ``lane div lanes``)."""
    nb = layout.num_blocks
    sizes = np.full(nb, layout.block_size * 4.0)
    if layout.numel % layout.block_size:
        sizes[-1] = (layout.numel % layout.block_size) * 4.0
    slot = (np.arange(nb) % (layout.lanes * layout.slots)) // layout.lanes
    return np.bincount(slot, weights=sizes, minlength=layout.slots)


def jobs_structure(c: Cluster, hierarchical: bool, numel: int, block: int, *, lanes: int = DEFAULT_LANES,
                   headers: bool = True) -> JobsStructure:
    """The expected traffic of the omnireduce part: ``hierarchical``: G rails (job ``i``: local rank
    ``i`` of every node, a shard of ``ceil(numel / G)`` elements); else one job of all ranks.
    Aggregator ``a`` lives on node ``a div P``, on NIC ``a mod P mod G`` when spread, else NIC 0."""
    N, G, P, A = c.nodes, c.gpus, c.per_node, c.aggregators
    if hierarchical:
        jobs = [[(h, i) for h in range(N)] for i in range(G)]
        numel_job = -(-numel // G)
    else:
        jobs = [[(h, g) for h in range(N) for g in range(G)]]
        numel_job = numel
    J = len(jobs)
    layout = job_layout(numel_job, block, A, lanes)
    S = layout.slots
    sb = slot_bytes(layout)
    msgs = np.full(S, 1.0 if layout.one_round else 1.0 + layout.rows)  # each way, per member and slot
    over = msgs * (message_bytes(layout) if headers else 0)
    agg_node = np.arange(A) // P
    agg_nic = (np.arange(A) % P) % G if c.spread else np.zeros(A, dtype=int)

    rank_blocks, rank_over, rank_msgs = [], [], []
    agg = {k: np.zeros(A) for k in ("up", "down", "over", "msgs", "ops", "slots")}
    nic = {k: np.zeros((N, G)) for k in ("up_out", "up_in", "down_out", "down_in",
                                         "up_out_o", "up_in_o", "down_out_o", "down_in_o")}
    for j, members in enumerate(jobs):
        offset = (j * A) // J if c.spread else 0
        owner = (np.arange(S) + offset) % A
        remote_of = {h: agg_node[owner] != h for h in range(N)}  # slots whose aggregator is off node h
        for h, g in members:
            rank_blocks.append(sb.sum())
            rank_over.append(over.sum())
            rank_msgs.append(msgs.sum())
            far = remote_of[h]
            nic["up_out"][h, g] += sb[far].sum()
            nic["up_out_o"][h, g] += over[far].sum()
            nic["down_in"][h, g] += sb[far].sum()
            nic["down_in_o"][h, g] += over[far].sum()
        M = len(members)
        per_node = np.bincount([h for h, _ in members], minlength=N)
        np.add.at(agg["up"], owner, M * sb)
        np.add.at(agg["down"], owner, M * sb)
        np.add.at(agg["over"], owner, M * over)
        np.add.at(agg["msgs"], owner, M * msgs)
        np.add.at(agg["slots"], owner, 1)
        agg["ops"][np.unique(owner)] += 1
        remote_members = M - per_node[agg_node[owner]]  # per slot: members off its aggregator's node
        for key, vals in (("up_in", sb), ("down_out", sb), ("up_in_o", over), ("down_out_o", over)):
            np.add.at(nic[key], (agg_node[owner], agg_nic[owner]), remote_members * vals)
    busy = agg["slots"] > 0
    return JobsStructure(
        tensor_bytes=float(sb.sum()), rank_blocks=np.array(rank_blocks), rank_over=np.array(rank_over),
        rank_messages=np.array(rank_msgs), agg_up_blocks=agg["up"][busy], agg_down_blocks=agg["down"][busy],
        agg_over=agg["over"][busy], agg_messages=agg["msgs"][busy], agg_ops=agg["ops"][busy],
        agg_slots=agg["slots"][busy],
        nic_up_out=nic["up_out"].ravel(), nic_up_in=nic["up_in"].ravel(), nic_down_out=nic["down_out"].ravel(),
        nic_down_in=nic["down_in"].ravel(), nic_up_out_over=nic["up_out_o"].ravel(),
        nic_up_in_over=nic["up_in_o"].ravel(), nic_down_out_over=nic["down_out_o"].ravel(),
        nic_down_in_over=nic["down_in_o"].ravel(), round_trips=int(msgs.max()))


def jobs_time(s: JobsStructure, d_sent: float, d_union: float, p: CostParams, c: Cluster) -> Prediction:
    """Time of the concurrent jobs (module docstring) at the given densities: each process's CPU
    per phase from the fitted costs, each NIC direction's bytes, through
    :func:`ombench.costmodel.phased_time`."""
    b = s.at(d_sent, d_union)
    scan, rank_up, rank_down = rank_cpu(p.rank, s.tensor_bytes, b["rank_sent"], b["rank_received"],
                                        s.rank_messages)
    a = p.aggregator
    fixed = s.agg_ops * a.per_op_s / 2 + a.per_message_s * s.agg_messages  # each phase
    agg_up = fixed + a.per_mb_received_s * b["agg_received"] / MB
    agg_down = fixed + a.per_mb_sent_s * b["agg_sent"] / MB
    up = {f"nic{i}": float(v) for i, v in enumerate(b["nic_up"])}
    down = {f"nic{i}": float(v) for i, v in enumerate(b["nic_down"])}
    k = int(s.agg_slots.min()) if s.agg_slots.size else 1
    return phased_time(scan, rank_up, rank_down, agg_up, agg_down, up, down,
                       Machine(rate_bytes_s=c.nic_bytes_s, latency_s=c.latency_s, cores=None),
                       slots_per_aggregator=k, round_trips=s.round_trips, workers=len(rank_up))


def hierarchical_omnireduce(nbytes: float, s: JobsStructure, d: float, placement: str, p: CostParams,
                            c: Cluster) -> Prediction:
    """Reduce-scatter over NVLink, the rails (``s``: ``jobs_structure(c, True, ...)``) at the node
    sum's density, all-gather over NVLink; ``bound``: the rails' bound."""
    sent, union = densities(d, c, placement, hierarchical=True)
    cross = jobs_time(s, sent, union, p, c)
    rs = nvlink_step_s(nbytes, c)
    terms = {"reduce-scatter": rs, "cross": cross.time_s, "all-gather": rs}
    return Prediction(2 * rs + cross.time_s, cross.bound, terms)


def flat_omnireduce(s: JobsStructure, d: float, placement: str, p: CostParams, c: Cluster) -> Prediction:
    """One job of all ``N G`` ranks (``s``: ``jobs_structure(c, False, ...)``), each over its NIC."""
    sent, union = densities(d, c, placement, hierarchical=False)
    return jobs_time(s, sent, union, p, c)


def scaled(p: CostParams, factor: float) -> CostParams:
    """Every CPU cost of ``p`` times ``factor`` (a leaner data path: what if the costs were 10x lower?)."""
    return CostParams.from_dict({kind: {k: v * factor for k, v in costs.items()}
                                 for kind, costs in p.to_dict().items()})


def crossover(densities_: Sequence[float], times: Sequence[float], reference: Sequence[float]) -> dict[str, object]:
    """Where ``times`` stops being below ``reference`` as density grows (see
    :func:`ombench.costmodel.crossover_density`): the density, and whether it is below at every
    density of the grid (``always``) or at none (``never``)."""
    below = [t < r for t, r in zip(times, reference, strict=True)]
    return {"density": crossover_density(densities_, times, reference), "always": all(below),
            "never": not any(below)}


def gbit(rate_gbit: float) -> float:
    """Bytes/s of ``rate_gbit`` Gbit/s."""
    return rate_gbit * 1e9 / 8

