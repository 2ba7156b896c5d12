"""A cost model of one all-reduce: omnireduce (dedicated or colocated aggregators) and a ring.

The model turns what a scheme moves (bytes and messages per process and per link direction, from
:mod:`ombench.traffic`) into time, with CPU costs measured on this machine. It is meant to
explain the measurements of ``scripts/bench_allreduce.py`` and to predict clusters we do not have;
``scripts/cost_model.py`` fits it, validates it and prints the predictions. Nodes of several GPUs
(the hierarchy, a hierarchical ring) are :mod:`ombench.hiercost`, which ends in :func:`phased_time`.

CPU costs (seconds; MB = 10^6 bytes), fitted by least squares from bench_allreduce rows
------------------------------------------------------------------------------------------
One set per path the bytes take (:func:`fit_paths`): ``loopback`` (127.0.0.1) and ``network`` (the
emulated links: veth, bridge and tbf cost more CPU per byte); the per-op and per-message costs are
Python's and shared, fitted on loopback runs whose tensors have 4 to 64 slots.

* a rank (worker process, all its threads), per all-reduce::

      rank = per_op + per_message * messages + per_mb_sent * MB sent + per_mb_received * MB received
             + scan_per_mb * MB of tensor

  ``messages`` counts the messages it sends and receives; MB sent and received include the 64-byte
  header and the row bitmap of every message. The scan is the one read of the tensor that finds its
  non-zero blocks (``scan_floor_cpu_s`` of the benchmark, measured in each rank on its own).
* an aggregator, per all-reduce::

      aggregator = per_op + per_message * messages + per_mb_received * MB received (and summed)
                   + per_mb_sent * MB sent

  Every block an aggregator receives is summed once, so receiving and summing share a coefficient.
  In the phases below a rank's up phase holds half its per-op cost, its messages sent and its MB
  sent, its down phase the rest; an aggregator's up phase receiving and summing, its down phase sending.
* a ring rank (Gloo), per all-reduce: ``per_op + per_mb * MB sent`` with ``2 (W-1)/W N`` sent (it
  receives and reduces as much as it sends).

Bytes on the wire: the payload of every link direction (:func:`~ombench.traffic.omnireduce_link_bytes`,
:func:`~ombench.traffic.colocated_link_bytes`, :func:`~ombench.traffic.ring_bytes`)
plus the headers and bitmaps of the messages that cross the link; a link direction at rate R bytes/s
is busy ``bytes / R``. Each message also has a one-way latency; a round trip costs two.

Time of one all-reduce
----------------------
omnireduce runs in three phases. Every rank first scans its whole tensor for its non-zero blocks
(nothing is sent before the scan ends). Then the **up** phase: the ranks gather and send their
blocks, the aggregators receive and sum them; then the **down** phase: the aggregators send the
sums, the ranks receive them. An aggregator answers a slot only when every rank's blocks for it are
in, so the two phases of one slot do not overlap; the slots of one aggregator (k of them) form a
pipeline. Each phase lasts as long as its busiest resource: a process's core (its CPU time in that
phase), a link direction (its bytes in that phase / R), or, when processes share fewer cores than
there are processes, all of them on the shared cores::

    time = scan + max(max(up, down) + min(up, down) / k,      # the phases, pipelined
                      busiest rank's CPU, busiest aggregator's CPU,
                      busiest link direction's bytes / R, all processes on the shared cores)
           + 2 * latency * round trips

(``scan``: the W scans, on the shared cores if there are fewer than W; the processes' CPU in the
max leaves the scan out.)

Shared cores (the machine here: C = 2 for W ranks and A aggregators) are modelled as the kernel's
fair scheduler: each runnable process gets ``C / n`` of a core (at most one), so the last of a set
of processes that start together finishes after :func:`fair_share` of their CPU times, which is at
least their total / C (the lower bound) and at least the largest. On the predicted clusters every
process has a core of its own, and only the phases, processes and links count. Round trips: 1 for
a tensor whose lanes hold one row each (one BOOTSTRAP up, one RESULT down per slot), else 1 + the
rounds of the busiest slot (rounds are lockstep; the phase model then lumps their ups and downs).

ring: ``time = max(CPU per rank, fair share of W ranks on C cores, 2 (W-1)/W N / R) + 2 (W-1) *
latency``; the predictions for clusters use the ring at its bandwidth floor ``2 (W-1)/W N / R``
(:func:`ring_floor`), the best a ring can do.

Assumptions (what the model leaves out)
---------------------------------------
* CPU cost per message and per byte is the same on a cluster as here, where the bytes went through
  the loopback TCP stack (a NIC saves some copies; an interrupt-heavy NIC costs some).
* Processes do not slow each other down beyond sharing cores (no memory-bandwidth or cache
  contention), and work overlaps perfectly within a phase: the model is a lower bound of sorts,
  which misses when processes wait on each other (TCP windows, incast losses and retransmission
  timeouts, scheduling latency).
* Other jobs on the machine are not modelled: they take cores away (``C`` can be given as a
  fraction to say so).
* Random block placement: each rank's non-zero blocks are independent, so the union of W ranks
  holds ``1 - (1 - d)^W`` of the blocks (:func:`random_masks`).

Everything here is a pure function of numbers and numpy arrays (no processes, no torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ombench.traffic import block_bytes, colocated_link_bytes, omnireduce_link_bytes, ring_bytes
from omnireduce.blocks import Layout
from omnireduce.config import DEFAULT_LANES

MB = 1e6
HEADER_BYTES = 64


# --------------------------------------------------------------------------------------------
# parameters


@dataclasses.dataclass(frozen=True)
class RankCost:
    """CPU seconds of one omnireduce rank per all-reduce."""

    per_op_s: float = 0.0
    per_message_s: float = 0.0
    per_mb_sent_s: float = 0.0
    per_mb_received_s: float = 0.0
    scan_per_mb_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class AggregatorCost:
    """CPU seconds of one aggregator per all-reduce it takes part in."""

    per_op_s: float = 0.0
    per_message_s: float = 0.0
    per_mb_received_s: float = 0.0
    per_mb_sent_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RingCost:
    """CPU seconds of one ring (Gloo) rank per all-reduce."""

    per_op_s: float = 0.0
    per_mb_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Every CPU parameter of the model."""

    rank: RankCost = RankCost()
    aggregator: AggregatorCost = AggregatorCost()
    ring: RingCost = RingCost()

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {"rank": dataclasses.asdict(self.rank), "aggregator": dataclasses.asdict(self.aggregator),
                "ring": dataclasses.asdict(self.ring)}

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, float]]) -> CostParams:
        return cls(RankCost(**d["rank"]), AggregatorCost(**d["aggregator"]), RingCost(**d["ring"]))


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the all-reduce runs.

    ``rate_bytes_s``: each link direction's rate (``math.inf``: no link limit, e.g. loopback);
    ``latency_s``: one-way latency per message; ``cores``: cores shared by all processes (may be
    fractional, for cores partly taken by other jobs), or None for one core per process.
    """

    rate_bytes_s: float = math.inf
    latency_s: float = 0.0
    cores: float | None = None


# --------------------------------------------------------------------------------------------
# traffic


@dataclasses.dataclass(frozen=True)
class OmniTraffic:
    """What one omnireduce all-reduce moves: per process (for CPU) and per link direction and phase
    (for the wire). Bytes include the messages' headers and bitmaps unless built with ``headers=False``."""

    workers: int
    aggregators: int
    colocated: bool
    tensor_bytes: float
    rank_sent: np.ndarray  # (W,) bytes
    rank_received: np.ndarray
    rank_messages: np.ndarray  # (W,) each way (a rank receives one message per message it sends)
    agg_received: np.ndarray  # (A,)
    agg_sent: np.ndarray
    agg_messages: np.ndarray  # (A,) each way
    up_links: dict[str, float]  # link direction -> bytes of the up phase (blocks to the aggregators)
    down_links: dict[str, float]  # ... of the down phase (sums to the ranks)
    slots_per_aggregator: int  # the fewest slots an aggregator with work holds: the depth of its pipeline
    round_trips: int

    @property
    def links(self) -> dict[str, float]:
        """Bytes of each link direction over the whole all-reduce."""
        return {k: self.up_links[k] + self.down_links[k] for k in self.up_links}


def message_bytes(layout: Layout) -> int:
    """Bytes of a message besides its blocks: the header, the row bitmap and the row numbers (at most
    one per lane)."""
    return HEADER_BYTES + -(-layout.lanes // 8) + layout.row_width * layout.lanes


def _messages_per_slot(masks: np.ndarray, layout: Layout) -> np.ndarray:
    """Messages each way per rank and slot: 1 in a one-round layout (BOOTSTRAP up, RESULT down), else
    1 + the slot's data rounds (the most union rows any of its lanes holds)."""
    if layout.one_round:
        return np.ones(layout.slots, dtype=np.int64)
    T, R = layout.total_lanes, layout.rows
    union = np.zeros(T * R, dtype=bool)
    union[: masks.shape[1]] = masks.any(axis=0)
    per_lane = union.reshape(R, T).sum(axis=0)
    return 1 + np.maximum(1, per_lane.reshape(layout.slots, layout.lanes).max(axis=1))


def omnireduce_traffic(masks: np.ndarray, numel: int, block: int, aggregators: int, *,
                       lanes: int = DEFAULT_LANES, slots: int | None = None, colocated: bool = False,
                       headers: bool = True) -> OmniTraffic:
    """Bytes and messages of one float32 all-reduce whose non-zero blocks are ``masks`` (W x blocks).

    ``aggregators`` is A (ignored when ``colocated``: A = W, one per worker host); ``slots`` defaults
    to the Worker's ``max(4, A)``. Per process, from :func:`~ombench.traffic.omnireduce_link_bytes`
    (colocated or not, the processes exchange the same bytes): each rank sends its blocks and
    receives the union, each aggregator receives the blocks of its slots and sends their sums to
    every rank. Per link and phase (up: blocks to the aggregators; down: sums back): with dedicated
    aggregators the ranks' links carry their blocks up and the union down, the aggregators' links
    the blocks down and the sums up; with colocated ones, what a host's own rank and aggregator
    exchange does not cross its link (the phases add up to
    :func:`~ombench.traffic.colocated_link_bytes`). Messages: one-round tensors one up and
    one down per slot and rank; otherwise 1 + the slot's rounds each way (every rank counted in
    every round: exact for dense tensors, an upper bound otherwise). ``headers=False`` leaves the
    messages' headers and bitmaps out of every byte count (payload only, as traffic.py counts).
    """
    W = masks.shape[0]
    A = W if colocated else aggregators
    S = slots if slots is not None else max(4, A)
    layout = Layout.for_tensor(numel, block, lanes, S)
    per_proc = {k: float(v) for k, v in omnireduce_link_bytes(masks, numel, block, A, lanes, S).items()}
    owner = np.arange(layout.slots) % A
    msgs_slot = _messages_per_slot(masks, layout)  # each way, per rank and slot
    over = message_bytes(layout) if headers else 0
    rank_msgs = float(msgs_slot.sum())
    agg_msgs = np.array([W * float(msgs_slot[owner == a].sum()) for a in range(A)])  # each way
    w_up = np.array([per_proc[f"w{w} up"] for w in range(W)])
    w_down = np.array([per_proc[f"w{w} down"] for w in range(W)])
    a_down = np.array([per_proc[f"a{a} down"] for a in range(A)])
    a_up = np.array([per_proc[f"a{a} up"] for a in range(A)])
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    if colocated:
        total = colocated_link_bytes(masks, numel, block, lanes, S)
        for h in range(W):
            # up phase: rank h's blocks for the other aggregators leave host h, the other ranks'
            # blocks for aggregator h arrive (``own``: rank h's blocks for aggregator h); the down
            # phase is the rest of traffic.py's figure (the sums of aggregator h leaving for the W-1
            # other ranks, the other aggregators' sums arriving)
            own = float(omnireduce_link_bytes(masks[h:h + 1], numel, block, W, lanes, S)[f"a{h} down"])
            mine = agg_msgs[h] / W  # messages between rank h and aggregator h, each way
            up[f"host{h} up"] = w_up[h] - own
            up[f"host{h} down"] = a_down[h] - own
            down[f"host{h} up"] = total[f"host{h} up"] - up[f"host{h} up"] + (W - 1) * mine * over
            down[f"host{h} down"] = total[f"host{h} down"] - up[f"host{h} down"] + (rank_msgs - mine) * over
            up[f"host{h} up"] += (rank_msgs - mine) * over
            up[f"host{h} down"] += (W - 1) * mine * over
    else:
        for w in range(W):
            up[f"w{w} up"], down[f"w{w} up"] = w_up[w] + rank_msgs * over, 0.0
            up[f"w{w} down"], down[f"w{w} down"] = 0.0, w_down[w] + rank_msgs * over
        for a in range(A):
            up[f"a{a} down"], down[f"a{a} down"] = a_down[a] + agg_msgs[a] * over, 0.0
            up[f"a{a} up"], down[f"a{a} up"] = 0.0, a_up[a] + agg_msgs[a] * over
    held = np.bincount(owner, minlength=A)
    return OmniTraffic(workers=W, aggregators=A, colocated=colocated,
                       tensor_bytes=float(block_bytes(numel, block).sum()),
                       rank_sent=w_up + rank_msgs * over, rank_received=w_down + rank_msgs * over,
                       rank_messages=np.full(W, rank_msgs), agg_received=a_down + agg_msgs * over,
                       agg_sent=a_up + agg_msgs * over, agg_messages=agg_msgs, up_links=up, down_links=down,
                       slots_per_aggregator=int(held[held > 0].min()), round_trips=int(msgs_slot.max()))


def random_masks(workers: int, num_blocks: int, density: float | Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """W x blocks masks of random block placement: each rank ``int(num_blocks * density)`` distinct
    blocks chosen uniformly (or, given a sequence, that many blocks on each rank), independently."""
    counts = ([int(num_blocks * density)] * workers if isinstance(density, (int, float))
              else [int(c) for c in density])
    masks = np.zeros((workers, num_blocks), dtype=bool)
    for w, k in enumerate(counts):
        if k >= num_blocks:
            masks[w] = True
        elif k > 0:
            masks[w, rng.choice(num_blocks, k, replace=False)] = True
    return masks


# --------------------------------------------------------------------------------------------
# time


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted all-reduce time and its terms (seconds); ``bound`` names the largest term."""

    time_s: float
    bound: str
    terms: dict[str, float]


def fair_share(demands: Sequence[float] | np.ndarray, cores: float | None) -> float:
    """When the last of several processes that start together finishes, if they share ``cores``
    fairly (each runnable process gets ``cores / n`` of a core, at most one; None: one core each)
    and each needs its CPU seconds in ``demands``. At least the largest demand and the total / cores."""
    d = np.sort(np.asarray(demands, dtype=float))
    if d.size == 0:
        return 0.0
    if cores is None:
        return float(d[-1])
    t = done = 0.0
    for i, need in enumerate(d):
        t += (need - done) / min(1.0, cores / (d.size - i))
        done = float(need)
    return t


def rank_cpu(c: RankCost, tensor_bytes: float, sent: np.ndarray, received: np.ndarray,
             messages: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """(scan, up-phase, down-phase) CPU seconds per rank of one all-reduce: the scan; sending its
    blocks (half the per-op cost, its messages sent); receiving the sums (the other half, its
    messages received). ``messages``: each way."""
    up = c.per_op_s / 2 + c.per_message_s * messages + c.per_mb_sent_s * sent / MB
    down = c.per_op_s / 2 + c.per_message_s * messages + c.per_mb_received_s * received / MB
    return c.scan_per_mb_s * tensor_bytes / MB, np.asarray(up, dtype=float), np.asarray(down, dtype=float)


def aggregator_cpu(c: AggregatorCost, received: np.ndarray, sent: np.ndarray,
                   messages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(up-phase, down-phase) CPU seconds of each aggregator in one all-reduce: receiving and summing
    the blocks, then sending the sums; one that holds no slot does nothing. ``messages``: each way."""
    busy = (np.asarray(messages) > 0).astype(float)
    up = busy * c.per_op_s / 2 + c.per_message_s * messages + c.per_mb_received_s * received / MB
    down = busy * c.per_op_s / 2 + c.per_message_s * messages + c.per_mb_sent_s * sent / MB
    return np.asarray(up, dtype=float), np.asarray(down, dtype=float)


def omnireduce_time(t: OmniTraffic, p: CostParams, m: Machine) -> Prediction:
    """Time of one omnireduce all-reduce (see the module docstring).

    ``terms``: ``scan`` (the scan phase), ``up`` and ``down`` (each phase alone: its busiest rank,
    aggregator or link direction, or its processes on the shared cores), and the candidates for the
    rest of the all-reduce: ``phases`` (up and down pipelined over the slots of an aggregator),
    ``rank`` and ``aggregator`` (the busiest process, both phases), ``link`` (the busiest link
    direction, both phases), ``shared cores`` (every process on the cores); then ``latency``.
    """
    scan, rank_up, rank_down = rank_cpu(p.rank, t.tensor_bytes, t.rank_sent, t.rank_received, t.rank_messages)
    agg_up, agg_down = aggregator_cpu(p.aggregator, t.agg_received, t.agg_sent, t.agg_messages)
    return phased_time(scan, rank_up, rank_down, agg_up, agg_down, t.up_links, t.down_links, m,
                       slots_per_aggregator=t.slots_per_aggregator, round_trips=t.round_trips, workers=t.workers)


def phased_time(scan_s: float, rank_up: np.ndarray, rank_down: np.ndarray, agg_up: np.ndarray,
                agg_down: np.ndarray, up_links: dict[str, float], down_links: dict[str, float], m: Machine, *,
                slots_per_aggregator: int, round_trips: int, workers: int) -> Prediction:
    """The time of the module docstring from each process's CPU seconds per phase (ranks, then
    aggregators: arrays, possibly empty for the aggregators) and each link direction's bytes per
    phase: the scan, the phases pipelined over ``slots_per_aggregator`` or the busiest process or
    link over both, and ``2 * latency * round_trips``. ``workers``: how many ranks scan (on the
    shared cores, if ``m.cores`` is fewer than the processes). :func:`omnireduce_time` and the
    hierarchy's model (:mod:`ombench.hiercost`) both end here."""
    W, A, R = workers, len(agg_up), m.rate_bytes_s
    cores = m.cores if m.cores is not None and m.cores < W + A else None

    def phase(ranks: np.ndarray, aggs: np.ndarray, links: dict[str, float]) -> tuple[float, str]:
        parts = {"rank": float(ranks.max()), "aggregator": float(aggs.max()) if A else 0.0,
                 "link": max(links.values()) / R if links else 0.0}
        if cores is not None:
            parts["shared cores"] = fair_share(np.concatenate([ranks, aggs]), cores)
        name = max(parts, key=lambda k: parts[k])
        return parts[name], name

    up, up_name = phase(rank_up, agg_up, up_links)
    down, down_name = phase(rank_down, agg_down, down_links)
    k = max(1, slots_per_aggregator)
    links = {key: up_links[key] + down_links[key] for key in up_links}
    rest = {"phases": max(up, down) + min(up, down) / k, "rank": float((rank_up + rank_down).max()),
            "aggregator": float((agg_up + agg_down).max()) if A else 0.0,
            "link": max(links.values()) / R if up_links else 0.0}
    if cores is not None:
        rest["shared cores"] = fair_share(np.concatenate([rank_up + rank_down, agg_up + agg_down]), cores)
    bound = max(rest, key=lambda key: rest[key])
    scan_phase = fair_share(np.full(W, scan_s), cores)  # the whole scan before anything is sent
    latency = 2 * m.latency_s * round_trips
    label = f"phases ({up_name if up >= down else down_name})" if bound == "phases" else bound
    return Prediction(scan_phase + rest[bound] + latency, label,
                      {"scan": scan_phase, "up": up, "down": down, **rest, "latency": latency})


def ring_cpu(c: RingCost, nbytes: float, workers: int) -> float:
    """CPU seconds of one ring rank in one all-reduce of ``nbytes``."""
    return c.per_op_s + c.per_mb_s * ring_bytes(nbytes, workers) / MB


def ring_floor(nbytes: float, workers: int, rate_bytes_s: float) -> float:
    """The ring all-reduce's bandwidth floor: ``2 (W-1)/W N / R`` seconds."""
    return ring_bytes(nbytes, workers) / rate_bytes_s


def ring_time(nbytes: float, workers: int, p: CostParams, m: Machine) -> Prediction:
    """Time of one ring all-reduce (see the module docstring)."""
    cpu = ring_cpu(p.ring, nbytes, workers)
    terms = {"rank": cpu, "link": ring_floor(nbytes, workers, m.rate_bytes_s)}
    if m.cores is not None and m.cores < workers:
        terms["shared cores"] = fair_share([cpu] * workers, m.cores)
    bound = max(terms, key=lambda k: terms[k])
    latency = 2 * (workers - 1) * m.latency_s
    return Prediction(terms[bound] + latency, bound, {**terms, "latency": latency})


def crossover_density(densities: Sequence[float], omni_s: Sequence[float], ring_s: Sequence[float]) -> float | None:
    """The density above which omnireduce is slower than the ring, or None if the curves do not cross.

    Walks from the lowest density up to the first point where omnireduce stops being faster and
    interpolates ``log(omni / ring)`` linearly in ``log(density)`` between that point and the one
    before. None when omnireduce is faster everywhere or nowhere on the grid.
    """
    order = np.argsort(np.asarray(densities, dtype=float))
    d = np.log(np.asarray(densities, dtype=float)[order])
    gap = np.log(np.asarray(omni_s, dtype=float)[order] / np.asarray(ring_s, dtype=float)[order])
    if gap[0] >= 0:
        return None
    for i in range(1, d.size):
        if gap[i] >= 0:
            f = gap[i - 1] / (gap[i - 1] - gap[i])
            return float(math.exp(d[i - 1] + f * (d[i] - d[i - 1])))
    return None


# --------------------------------------------------------------------------------------------
# fitting from bench_allreduce rows


@dataclasses.dataclass(frozen=True)
class Observation:
    """One bench_allreduce row reduced to what the fits and the validation need (per all-reduce)."""

    method: str  # omnireduce, colocated or gloo
    label: str
    density: float
    workers: int
    aggregators: int  # A (W for colocated, 0 for gloo)
    numel: int
    block: int
    lanes: int
    slots: int | None
    rate_bytes_s: float
    measured_s: float
    rank_cpu_s: float  # all ranks
    scan_cpu_s: float  # all ranks
    agg_cpu_s: float  # all aggregators
    rank_messages: float  # all ranks, sent + received
    rank_sent: float  # all ranks, bytes (headers included)
    rank_received: float
    blocks_nonzero: tuple[int, ...]
    blocks_union: int

    @property
    def tensor_bytes(self) -> float:
        return float(self.numel * 4)


def _argv_int(argv: Sequence[str], flag: str) -> int | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(flag + "="):
            return int(a.split("=", 1)[1])
    return None


def observation(row: dict[str, Any], meta: dict[str, Any]) -> Observation | None:
    """An :class:`Observation` of a bench_allreduce JSON row (``meta``: the file's meta), or None for
    methods the model does not cover (mpi, agsparse).

    Messages per rank: ``2 * messages_sent_per_op`` where the row has it (a rank receives one message
    per message it sends), else from the layout. Bytes: from the rows' block counts (each non-zero
    block travels up once; the union comes down to every rank) plus every message's header and bitmap.
    """
    method = row["method"]
    if method not in ("omnireduce", "colocated", "gloo"):
        return None
    W, numel, block = int(meta["workers"]), int(meta["numel"]), int(meta["block"])
    argv = meta.get("argv") or []
    lanes = _argv_int(argv, "--lanes") or DEFAULT_LANES
    slots = _argv_int(argv, "--slots")
    A = W if method == "colocated" else int(row.get("aggregators", 0)) if method == "omnireduce" else 0
    rate = float(meta["rate_bps"]) / 8 if meta.get("rate_bps") else math.inf
    nonzero = tuple(int(n) for n in row.get("blocks_nonzero", []))
    union = int(row.get("blocks_union", 0))
    msgs = sent = received = 0.0
    if A:
        layout = Layout.for_tensor(numel, block, lanes, slots or max(4, A))
        if row.get("messages_sent_per_op") is not None:
            msgs = 2.0 * W * float(row["messages_sent_per_op"])
        else:
            msgs = 2.0 * W * layout.slots * (1 if layout.one_round else 1 + layout.rows)
        bb = block * 4
        over = message_bytes(layout) * msgs / 2
        sent = sum(nonzero) * bb + over
        received = W * union * bb + over
    return Observation(method=method, label=row.get("label", method), density=float(row["density"]), workers=W,
                       aggregators=A, numel=numel, block=block, lanes=lanes, slots=slots, rate_bytes_s=rate,
                       measured_s=float(row["median_s"]), rank_cpu_s=float(row["worker_cpu_s_per_op"]),
                       scan_cpu_s=float(row.get("scan_floor_cpu_s") or 0.0),
                       agg_cpu_s=float(row.get("aggregator_cpu_s_per_op") or 0.0), rank_messages=msgs,
                       rank_sent=sent, rank_received=received, blocks_nonzero=nonzero, blocks_union=union)


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares ``X b ~ y`` with ``b >= 0`` (rows weighted by ``weights``): solve, drop the
    columns whose coefficient came out negative (set to 0), solve again, until none is negative."""
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    Xw, yw = X * w[:, None], y * w
    active = np.ones(X.shape[1], dtype=bool)
    b = np.zeros(X.shape[1])
    while active.any():
        sol, *_ = np.linalg.lstsq(Xw[:, active], yw, rcond=None)
        b[:] = 0.0
        b[active] = sol
        if (sol >= 0).all():
            break
        active[np.flatnonzero(active)[sol < 0]] = False
    return b


def _relative(y: np.ndarray) -> np.ndarray:
    """Weights that make each row's residual relative to its value (rows of all sizes count)."""
    return 1.0 / np.maximum(np.abs(y), 1e-6)


def fit_scan(obs: Iterable[Observation]) -> float:
    """Scan CPU seconds per MB of tensor: the median of the rows' measured scan floors."""
    vals = [o.scan_cpu_s / (o.workers * o.tensor_bytes / MB) for o in obs if o.aggregators and o.scan_cpu_s > 0]
    return float(np.median(vals)) if vals else 0.0


def _fit_some(X: np.ndarray, y: np.ndarray, fixed: dict[int, float]) -> np.ndarray:
    """Nonnegative relative least squares of ``X b ~ y`` with the coefficients of the columns in
    ``fixed`` held at the given values (their part is taken off ``y`` first)."""
    b = np.zeros(X.shape[1])
    free = [j for j in range(X.shape[1]) if j not in fixed]
    for j, v in fixed.items():
        b[j] = v
    rest = y - X[:, list(fixed)] @ np.array(list(fixed.values())) if fixed else y
    b[free] = nonnegative_lstsq(X[:, free], rest, _relative(y))
    return b


def fit_rank(obs: Sequence[Observation], scan_per_mb_s: float, base: RankCost | None = None) -> RankCost:
    """Rank costs from the omnireduce rows: ``rank CPU - scans ~ W per_op + messages per_message +
    MB sent per_mb_sent + MB received per_mb_received`` (all ranks), relative least squares, >= 0;
    with ``base``, its per-op and per-message costs are kept and only the costs per MB fitted."""
    rows = [o for o in obs if o.aggregators]
    if not rows:
        return RankCost(scan_per_mb_s=scan_per_mb_s)
    X = np.array([[o.workers, o.rank_messages, o.rank_sent / MB, o.rank_received / MB] for o in rows])
    y = np.array([o.rank_cpu_s - scan_per_mb_s * o.workers * o.tensor_bytes / MB for o in rows])
    b = _fit_some(X, y, {0: base.per_op_s, 1: base.per_message_s} if base else {})
    return RankCost(*map(float, b), scan_per_mb_s=scan_per_mb_s)


def fit_aggregator(obs: Sequence[Observation], base: AggregatorCost | None = None) -> AggregatorCost:
    """Aggregator costs from the omnireduce rows: ``aggregator CPU ~ A per_op + messages per_message +
    MB received per_mb_received + MB sent per_mb_sent`` (all aggregators: they receive what the ranks
    send and send what they receive), relative least squares, >= 0; ``base`` as for :func:`fit_rank`."""
    rows = [o for o in obs if o.aggregators and o.agg_cpu_s > 0]
    if not rows:
        return AggregatorCost()
    X = np.array([[min(o.aggregators, _slots(o)), o.rank_messages, o.rank_sent / MB, o.rank_received / MB]
                  for o in rows])
    y = np.array([o.agg_cpu_s for o in rows])
    b = _fit_some(X, y, {0: base.per_op_s, 1: base.per_message_s} if base else {})
    return AggregatorCost(*map(float, b))


def _slots(o: Observation) -> int:
    return Layout.for_tensor(o.numel, o.block, o.lanes, o.slots or max(4, o.aggregators)).slots


def fit_ring(obs: Sequence[Observation], base: RingCost | None = None) -> RingCost:
    """Ring costs from the gloo rows: ``CPU of all ranks ~ W per_op + W * MB sent per rank * per_mb``;
    with ``base``, its per-op cost is kept."""
    rows = [o for o in obs if o.method == "gloo" and o.workers > 1]
    if not rows:
        return RingCost()
    X = np.array([[o.workers, o.workers * ring_bytes(o.tensor_bytes, o.workers) / MB] for o in rows])
    y = np.array([o.rank_cpu_s for o in rows])
    return RingCost(*map(float, _fit_some(X, y, {0: base.per_op_s} if base else {})))


def observation_cpu(o: Observation, p: CostParams) -> tuple[float, float]:
    """The model's CPU seconds of all ranks and of all aggregators for the row ``o`` (what its CPU
    columns measured), from the same quantities the fits use."""
    if o.method == "gloo":
        return o.workers * ring_cpu(p.ring, o.tensor_bytes, o.workers), 0.0
    r, a = p.rank, p.aggregator
    ranks = (o.workers * (r.per_op_s + r.scan_per_mb_s * o.tensor_bytes / MB) + r.per_message_s * o.rank_messages
             + (r.per_mb_sent_s * o.rank_sent + r.per_mb_received_s * o.rank_received) / MB)
    aggs = (min(o.aggregators, _slots(o)) * a.per_op_s + a.per_message_s * o.rank_messages
            + (a.per_mb_received_s * o.rank_sent + a.per_mb_sent_s * o.rank_received) / MB)
    return ranks, aggs


def fit(obs: Sequence[Observation], base: CostParams | None = None) -> CostParams:
    """Every parameter from the observations; with ``base``, only the costs per MB (and the scan): the
    per-op and per-message costs (Python's, whatever carries the bytes) are taken from ``base``."""
    scan = fit_scan(obs) or (base.rank.scan_per_mb_s if base else 0.0)
    return CostParams(fit_rank(obs, scan, base.rank if base else None),
                      fit_aggregator(obs, base.aggregator if base else None),
                      fit_ring(obs, base.ring if base else None))


PATHS = ("loopback", "network")


def path_of(o: Observation) -> str:
    """Which way the row's bytes went: ``loopback`` (127.0.0.1) or ``network`` (emulated links: veth
    pairs, a bridge and tbf, which cost more CPU per byte)."""
    return "loopback" if math.isinf(o.rate_bytes_s) else "network"


def fit_paths(obs: Sequence[Observation]) -> dict[str, CostParams]:
    """One parameter set per path: loopback from the loopback rows; network from the network rows with
    the per-op and per-message costs of the loopback fit (the network runs have one tensor layout, so
    they cannot tell those apart from each other). A path without rows is left out."""
    groups = {p: [o for o in obs if path_of(o) == p] for p in PATHS}
    out: dict[str, CostParams] = {}
    if groups["loopback"]:
        out["loopback"] = fit(groups["loopback"])
    if groups["network"]:
        out["network"] = fit(groups["network"], out.get("loopback"))
    return out


def predict_observation(o: Observation, p: CostParams, cores: float | None, latency_s: float,
                        rng: np.random.Generator) -> Prediction:
    """The model's time for the setting of a measured row: the row's per-rank block counts placed at
    random (:func:`random_masks`), its W, A, tensor and link rate, on ``cores`` shared cores."""
    m = Machine(rate_bytes_s=o.rate_bytes_s, latency_s=latency_s, cores=cores)
    if o.method == "gloo":
        return ring_time(o.tensor_bytes, o.workers, p, m)
    nb = -(-o.numel // o.block)
    counts = o.blocks_nonzero or (int(nb * o.density),) * o.workers
    masks = random_masks(o.workers, nb, counts, rng)
    t = omnireduce_traffic(masks, o.numel, o.block, o.aggregators, lanes=o.lanes, slots=o.slots,
                           colocated=o.method == "colocated")
    return omnireduce_time(t, p, m)
