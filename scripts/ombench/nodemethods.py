"""The all-reduce methods that scripts/bench_hierarchy.py compares on nodes of several ranks.

DDP-free: each method sums a flat float32 tensor in place over every rank by calling the library's
pieces directly (the Gloo process group, :class:`omnireduce.engines.hierarchy.Hierarchy`,
:class:`omnireduce.Worker`), as the DDP hook would on a bucket of that size, without DDP around it.
Every method is set up once per rank, in the same order on every rank (a hierarchy's groups are
created collectively), and reports the bytes the library counted this rank sending, split into
inside the node and towards other nodes.

* ``ring``: ``torch.distributed.all_reduce`` (Gloo's ring over all W ranks: plain DDP's). Bytes:
  the ring formula ``2 (W-1)/W * N`` per rank, not a measurement.
* ``hier-dense``: the hierarchy with a dense rail: reduce-scatter in the node, the rail group's
  Gloo all-reduce of the shard across nodes, all-gather in the node (what NCCL does on nodes of
  several GPUs). Bytes in the node: the hierarchy's count; across: the ring formula of the shard
  over the rail.
* ``flat``: flat omnireduce: one :class:`omnireduce.Worker` per rank against the job's colocated
  aggregators (``omnireduce.colocate.start_colocated``: one per node, started by the node's lowest
  rank), as ``OmniReduceState(hierarchical=False)`` runs a sparse bucket.
* ``hier``: hierarchical omnireduce: the hierarchy whose rail is an omnireduce job of its own
  (``JOB.railI``, the node's index as rank, one member per node) at the same colocated aggregators,
  shards cut at the block size, as ``OmniReduceState(hierarchical=True)`` runs a sparse bucket.
* ``node-only``: the hierarchy's steps 1 and 3 alone (reduce-scatter and all-gather in the node,
  nothing across nodes: the result is the node's sum, not the whole one, and is not checked). It
  measures what the node's interconnect costs, here TCP over the namespace's loopback on the
  machine's shared cores, where real nodes have NVLink or shared memory: a hierarchical method's
  time less this one is its time across nodes.

The hook's dense fallback (a bucket whose union density reaches 0.6 goes dense) is left out: at
the densities benchmarked it would not trigger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ombench.traffic import ring_bytes

METHODS = ("ring", "hier-dense", "flat", "hier", "node-only")
LABELS = {"ring": "Gloo ring", "hier-dense": "hier. dense (NCCL-like)", "flat": "flat omnireduce",
          "hier": "hier. omnireduce", "node-only": "in-node steps only"}
PARTIAL = frozenset({"node-only"})
"""Methods whose result is not the whole sum (not compared with the ring's)."""


@dataclasses.dataclass
class NodeSetup:
    """What a method needs from its rank (after ``dist.init_process_group``)."""

    rank: int
    world: int
    block: int
    job: str
    timeout: float
    dist: Any
    topology: Any
    """The :class:`omnireduce.engines.hierarchy.Topology` every rank discovered."""
    colocated: Any = None
    """The job's colocated aggregators, started by :meth:`aggregators` on first use."""

    def aggregators(self) -> Any:
        """The colocated aggregators (collective the first time: every rank calls it at the same point)."""
        if self.colocated is None:
            from omnireduce.colocate import start_colocated

            self.colocated = start_colocated(timeout=self.timeout)
        return self.colocated


@dataclasses.dataclass
class Method:
    """A method set up in one rank: ``run(x)`` sums ``x`` in place; ``counted()`` is what the library
    counted so far (bytes this rank sent inside its node and towards other nodes, from
    ``numel``-element tensors for the formula-based ones)."""

    run: Callable[[Any], Any]
    counted: Callable[[int], dict[str, float]]
    closers: list[Callable[[], Any]] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c()


def _ring(s: NodeSetup) -> Method:
    calls = [0]

    def run(x: Any) -> None:
        s.dist.all_reduce(x)
        calls[0] += 1

    return Method(run, lambda numel: {"in_node": 0.0, "across": calls[0] * ring_bytes(4 * numel, s.world)})


def _hierarchy(s: NodeSetup) -> Any:
    from omnireduce.engines.hierarchy import Hierarchy

    return Hierarchy(s.topology, backend="gloo", timeout=s.timeout)


def _hier_dense(s: NodeSetup) -> Method:
    h = _hierarchy(s)
    nodes = len(s.topology.nodes)
    calls = [0]

    def cross(shard: Any) -> Any:
        return s.dist.all_reduce(shard, group=h.rail_group, async_op=True)

    def run(x: Any) -> None:
        h.reduce(x, cross, align=s.block).wait()
        calls[0] += 1

    def counted(numel: int) -> dict[str, float]:
        shard = h.shard_size(numel, s.block) * 4
        return {"in_node": float(h.bytes_in_node), "across": calls[0] * ring_bytes(shard, nodes)}

    return Method(run, counted, [h.close])


def _flat(s: NodeSetup) -> Method:
    import omnireduce

    aggs = s.aggregators()
    w = omnireduce.Worker(aggs.addresses, rank=s.rank, world_size=s.world, job=f"{s.job}-flat", token=aggs.token,
                          block_size=s.block, timeout=s.timeout)
    return Method(w.allreduce, lambda _n: {"in_node": 0.0, "across": float(w.stats()["bytes_sent"])}, [w.close])


def _hier(s: NodeSetup) -> Method:
    import omnireduce

    aggs = s.aggregators()
    h = _hierarchy(s)
    t = s.topology
    rail = omnireduce.Worker(aggs.addresses, rank=t.node, world_size=len(t.nodes), job=f"{s.job}.rail{t.local_rank}",
                             token=aggs.token, block_size=s.block, timeout=s.timeout)

    def cross(shard: Any) -> Any:
        return rail.allreduce_async(shard, block_size=s.block)

    def run(x: Any) -> None:
        h.reduce(x, cross, align=s.block).wait()

    def counted(_numel: int) -> dict[str, float]:
        return {"in_node": float(h.bytes_in_node), "across": float(rail.stats()["bytes_sent"])}

    return Method(run, counted, [h.close, rail.close])


def _node_only(s: NodeSetup) -> Method:
    h = _hierarchy(s)

    def run(x: Any) -> None:
        h.reduce(x, lambda _shard: None, align=s.block).wait()

    return Method(run, lambda _n: {"in_node": float(h.bytes_in_node), "across": 0.0}, [h.close])


SETUPS: dict[str, Callable[[NodeSetup], Method]] = {"ring": _ring, "hier-dense": _hier_dense, "flat": _flat,
                                                     "hier": _hier, "node-only": _node_only}
"""Every method, by the name ``--methods`` uses, in the order the tables list them."""
