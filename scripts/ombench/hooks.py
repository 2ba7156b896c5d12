"""The DDP communication settings that scripts/bench_train.py compares: one table from name to hook.

Each entry of :data:`HOOKS` makes a :class:`Communication`: it registers its hook on a rank's
``DistributedDataParallel`` model, and says how many bytes the rank sent in each step.

* ``allreduce``: DDP's default (no hook): ``2 (W-1)/W * G`` per step, G = gradient bytes.
* ``omnireduce``: ``omnireduce_hook`` with a default ``OmniReduceState``: each dense bucket's path
  (omnireduce or the dense all-reduce) chosen by timing both (``path="measure"``,
  :mod:`omnireduce.ddp.routing.path_choice`); bytes measured, from the state's ``bytes_sent`` counter.
* ``omnireduce-threshold``: the same with ``OmniReduceState(path="threshold")``: the old rule, a
  bucket goes dense once its union density reaches ``dense_threshold`` (0.6).
* ``omnireduce-dense``: the same with ``OmniReduceState(path="dense")``: every bucket through the
  process group's all-reduce from the hook, what a bucket decided dense costs (the hook's floor
  against DDP's own all-reduce).
* ``fp16``: ``fp16_compress_hook``: half the ring figure.
* ``powersgd``: ``powerSGD_hook`` with :data:`POWERSGD`, serialised per bucket
  (:class:`SerialHookState`); the ring figure of its P and Q factors and uncompressed tensors
  once compressing, the plain ring figure before ``start_powerSGD_iter``.
* ``allreduce-fused`` and ``omnireduce-fused``: the same, with the optimizer stepped inside the
  hook (``omnireduce.ddp.fuse_optimizer``) instead of after the backward pass.
* ``omnireduce-colocated``: ``omnireduce_hook`` given no aggregator addresses, so the job runs its
  own (``omnireduce.colocate``), each rank a node of its own: one aggregator per rank host, a child
  of the rank (on the emulated network, in its namespace, on its shaped interface). The dedicated
  aggregators the benchmark started are not used.
* ``omnireduce-collective``: ``omnireduce_hook`` with ``OmniReduceState(engine="collective")``: the
  buckets that take omnireduce are summed by the ranks themselves through the process group
  (:mod:`omnireduce.engines.collective`, a group and thread of the engine's own); the aggregators the
  benchmark started only see the worker's handshake. Bytes measured (``bytes_sent``).
* ``omnireduce-unaligned``: ``omnireduce_hook`` with ``OmniReduceState(align_blocks=False)``: every
  dense bucket on the fixed grid of the configured block size (256), not aligned to its table's rows.
* ``omnireduce-flat``, ``omnireduce-hier`` and ``omnireduce-auto`` (nodes of several ranks,
  scripts/bench_hierarchy.py): ``omnireduce_hook`` with the job's colocated aggregators on the nodes
  the environment names (``GROUP_RANK``, set by ``Network.rank_env``: one aggregator per node) and
  ``OmniReduceState(hierarchical=False)`` / ``(hierarchical=True)`` / the default
  (``hierarchical=None``: each bucket's ways measured flat and through the hierarchy); measured bytes
  towards other nodes (``bytes_sent``; the hierarchy's in-node bytes are in the row's details).
  ``omnireduce-flat-topk0.01`` and ``omnireduce-hier-topk0.01``: the same, flat or hierarchical, with
  compression as ``omnireduce-topk0.01`` below.
* ``omnireduce-topk0.01`` and ``omnireduce-topk0.1``: ``omnireduce_hook`` with
  ``OmniReduceState(compression=BlockTopK(density=...))`` (:data:`TOPK_WARMUP` dense steps): dense buckets
  send their top 1% (10%) of blocks with error feedback, sparse ones stay exact, each way measured;
  bytes measured (``bytes_sent``, the scores' all-reduce included).
* ``hier-dense``: the hierarchy with a dense rail (:class:`HierarchicalDense`): each bucket
  reduce-scattered in the node, the shard all-reduced over its rail's Gloo group, all-gathered in
  the node, what NCCL does on nodes of several GPUs; bytes: the hierarchy's in-node count plus the
  ring figure of each shard over the rail.

torch and omnireduce's DDP module are only imported when a hook is made, in the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ombench.traffic import powersgd_elements, ring_bytes

POWERSGD = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "min_compression_rate": 2,
            "use_error_feedback": True, "warm_start": True}
"""``PowerSGDState`` settings (``random_seed`` is the benchmark's seed)."""

TOPK_WARMUP = 2
"""Dense steps before ``omnireduce-topk*`` compresses (as PowerSGD's ``start_powerSGD_iter``)."""


@dataclasses.dataclass(frozen=True)
class HookSetup:
    """What a hook needs from its rank."""

    model: Any
    """The ``DistributedDataParallel`` model."""
    optimizer: Any
    params: list[Any]
    """The parameters that get gradients."""
    world: int
    seed: int

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


class Communication:
    """DDP's default all-reduce (no hook), and the base of the other settings.

    ``fused``: the optimizer steps inside the hook, so the training loop must not call ``step()``.
    Per step, :meth:`begin_step` runs before the step, :meth:`end_step` and :meth:`bytes_sent`
    after it (all outside its timing).
    """

    fused = False

    def __init__(self, setup: HookSetup) -> None:
        self.world = setup.world
        self.dense_bytes = ring_bytes(setup.grad_bytes, setup.world)

    def begin_step(self) -> None:
        """Called before every step."""

    def end_step(self) -> None:
        """Called after every step (its backward pass's buckets have all been reduced)."""

    def bytes_sent(self, step: int) -> float:
        """Bytes this rank sent in step ``step`` (0-based)."""
        return self.dense_bytes

    def details(self) -> dict[str, Any]:
        """Settings and counters for the benchmark's row (e.g. ``{"powersgd": {...}}``)."""
        return {}

    def close(self) -> None:
        """Release connections (after the last step, once every rank is done)."""


class FusedAllReduce(Communication):
    """DDP's all-reduce as a hook, with the optimizer fused into it."""

    fused = True

    def __init__(self, setup: HookSetup) -> None:
        super().__init__(setup)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from omnireduce.ddp import fuse_optimizer

        setup.model.register_comm_hook(None, fuse_optimizer(allreduce_hook, setup.optimizer))


class OmniReduce(Communication):
    """``omnireduce_hook`` (with the optimizer fused into it when ``fused``); bytes measured."""

    def __init__(self, setup: HookSetup, fused: bool = False, align_blocks: bool = True,
                 hierarchical: bool | None = None, path: str | None = None, engine: str = "auto",
                 density: float | None = None) -> None:
        super().__init__(setup)
        from omnireduce.compression import BlockTopK
        from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook

        self.fused = fused
        compression = BlockTopK(density=density, warmup_steps=TOPK_WARMUP, ramp_steps=0) if density is not None \
            else None  # (no ramp: the steady state's times and bytes)
        self.state = OmniReduceState(align_blocks=align_blocks, hierarchical=hierarchical, path=path, engine=engine,
                                     compression=compression)
        hook = fuse_optimizer(omnireduce_hook, setup.optimizer) if fused else omnireduce_hook
        setup.model.register_comm_hook(self.state, hook)
        self._before = 0
        self._buckets_before = (0, 0)
        self._per_step: list[list[int]] = []  # [dense, omnireduce] buckets of each step

    def begin_step(self) -> None:
        st = self.state.stats()
        self._before = st["bytes_sent"]
        self._buckets_before = (st["buckets_dense"], st["buckets_sparse"])

    def end_step(self) -> None:
        st = self.state.stats()
        self._per_step.append([st["buckets_dense"] - self._buckets_before[0],
                               st["buckets_sparse"] - self._buckets_before[1]])

    def bytes_sent(self, step: int) -> float:
        return self.state.stats()["bytes_sent"] - self._before

    def details(self) -> dict[str, Any]:
        st = self.state.stats()
        info = {k: st.get(k) for k in ("buckets_sparse", "buckets_dense", "buckets_failed", "buckets_coo",
                                       "sent_fraction", "density")}
        # stats()["density"] is keyed by bucket index only, so a bucket from before DDP's rebuild after
        # step 1 can hide the current one with the same index; keep (index, numel, last union density)
        decisions = self.state.recorder.densities  # (its keys are private; density_of is public)
        keys = sorted(getattr(decisions, "_density", {}))
        info["bucket_density"] = [[*k, decisions.density_of(k)] for k in keys]  # (compressed keys end in 1)
        info["block_size"] = self.state.block_size
        info["dense_threshold"] = self.state.options.dense_threshold
        info["align_blocks"] = self.state.options.align_blocks
        # how the buckets chose their path: the knob; with "measure", each bucket's agreed path and the
        # agreed times of both (stats()["paths"]); whatever the knob, the buckets each step sent dense
        # and through omnireduce (the same on every rank)
        info["path"] = st.get("path")
        info["paths"] = {str(i): p for i, p in st.get("paths", {}).items()}
        info["iterations_measuring"] = st.get("iterations_measuring")
        info["step_checks"] = st.get("step_checks", [])
        info["buckets_per_step"] = {"columns": ["dense", "omnireduce"], "steps": self._per_step}
        info["engine"], info["collective_reductions"] = st.get("engine"), st.get("collective_reductions")
        return {"omnireduce": info}

    def close(self) -> None:
        if self.state.worker is not None:
            self.state.worker.close()


class ColocatedOmniReduce(OmniReduce):
    """``omnireduce_hook`` with the job's own aggregators, one per rank host (no addresses given)."""

    def __init__(self, setup: HookSetup, fused: bool = False) -> None:
        import os

        os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
        os.environ["GROUP_RANK"] = os.environ.get("RANK", "0")  # every rank a node (a host) of its own
        if os.environ.get("GLOO_SOCKET_IFNAME"):  # listen where the other hosts reach this one
            os.environ["OMNIREDUCE_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
        super().__init__(setup, fused=fused)

    def details(self) -> dict[str, Any]:
        info = super().details()
        info["omnireduce"]["colocated_aggregators"] = len(self.state.colocated.addresses)
        return info

    def close(self) -> None:
        self.state.close()  # the worker, then this rank's aggregator


class NodeOmniReduce(OmniReduce):
    """``omnireduce_hook`` with the job's own aggregators, one per node as the environment names the
    nodes (``GROUP_RANK``), flat or hierarchical."""

    def __init__(self, setup: HookSetup, hierarchical: bool | None, density: float | None = None) -> None:
        import os

        os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
        if os.environ.get("GLOO_SOCKET_IFNAME") and "OMNIREDUCE_IFNAME" not in os.environ:
            os.environ["OMNIREDUCE_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
        super().__init__(setup, hierarchical=hierarchical, density=density)

    def details(self) -> dict[str, Any]:
        info = super().details()
        st = self.state.stats()
        info["omnireduce"].update(hierarchical=st.get("hierarchical"), hierarchy=st.get("hierarchy"),
                                  bytes_in_node=st.get("bytes_in_node"),
                                  bytes_across_nodes=st.get("bytes_across_nodes"),
                                  colocated_aggregators=len(self.state.colocated.addresses))
        return info

    def close(self) -> None:
        self.state.close()  # the workers, the hierarchy, then this node's aggregator (on its leader)


class HierarchicalDense(Communication):
    """The hierarchy with a dense rail, as a DDP hook (see the module docstring)."""

    def __init__(self, setup: HookSetup) -> None:
        super().__init__(setup)
        from omnireduce.engines.hierarchy import Hierarchy, discover

        topology = discover()
        self.hook_state = _HierDenseState(Hierarchy(topology, backend="gloo", timeout=300.0), setup.world,
                                          len(topology.nodes))
        setup.model.register_comm_hook(self.hook_state, _hier_dense_hook)
        self._before = 0.0

    def _sent(self) -> float:
        return self.hook_state.hierarchy.bytes_in_node + self.hook_state.across

    def begin_step(self) -> None:
        self._before = self._sent()

    def bytes_sent(self, step: int) -> float:
        return self._sent() - self._before

    def details(self) -> dict[str, Any]:
        return {"hierarchy": {"topology": self.hook_state.hierarchy.topology.describe(),
                              "bytes_in_node": self.hook_state.hierarchy.bytes_in_node,
                              "bytes_across_nodes": self.hook_state.across}}

    def close(self) -> None:
        self.hook_state.hierarchy.close()


@dataclasses.dataclass
class _HierDenseState:
    hierarchy: Any
    world: int
    nodes: int
    across: float = 0.0
    """Ring bytes of the shards this rank all-reduced over its rail (counted on the step thread)."""


def _hier_dense_hook(state, bucket):  # no annotations: see _serial_hook
    import torch.distributed as dist

    h = state.hierarchy

    def cross(shard):
        state.across += ring_bytes(shard.numel() * shard.element_size(), state.nodes)
        return dist.all_reduce(shard, group=h.rail_group, async_op=True)

    return h.reduce(bucket.buffer(), cross, divisor=state.world)


class FP16(Communication):
    """``fp16_compress_hook``: half the ring figure."""

    def __init__(self, setup: HookSetup) -> None:
        super().__init__(setup)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        setup.model.register_comm_hook(None, fp16_compress_hook)

    def bytes_sent(self, step: int) -> float:
        return self.dense_bytes / 2


class PowerSGD(Communication):
    """``powerSGD_hook`` with :data:`POWERSGD`, one bucket at a time (see :class:`SerialHookState`)."""

    def __init__(self, setup: HookSetup) -> None:
        super().__init__(setup)
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        self.seed, self.dense_elements = setup.seed, setup.grad_bytes // 4
        state = PowerSGDState(process_group=None, random_seed=setup.seed, **POWERSGD)
        setup.model.register_comm_hook(SerialHookState(state, powerSGD_hook), _serial_hook)
        self.elements = powersgd_elements([tuple(p.shape) for p in setup.params],
                                          POWERSGD["matrix_approximation_rank"], POWERSGD["min_compression_rate"])

    def bytes_sent(self, step: int) -> float:
        if step < POWERSGD["start_powerSGD_iter"]:
            return self.dense_bytes
        return ring_bytes(4 * self.elements["total"], self.world)

    def details(self) -> dict[str, Any]:
        return {"powersgd": {**POWERSGD, "random_seed": self.seed, "elements_per_step": self.elements,
                             "dense_elements": self.dense_elements}}


HOOKS: dict[str, Callable[[HookSetup], Communication]] = {
    "allreduce": Communication,
    "omnireduce": OmniReduce,
    "omnireduce-threshold": functools.partial(OmniReduce, path="threshold"),
    "omnireduce-dense": functools.partial(OmniReduce, path="dense"),
    "fp16": FP16,
    "powersgd": PowerSGD,
    "allreduce-fused": FusedAllReduce,
    "omnireduce-fused": functools.partial(OmniReduce, fused=True),
    "omnireduce-colocated": ColocatedOmniReduce,
    "omnireduce-unaligned": functools.partial(OmniReduce, align_blocks=False),
    "omnireduce-collective": functools.partial(OmniReduce, engine="collective"),
    "omnireduce-topk0.01": functools.partial(OmniReduce, density=0.01),
    "omnireduce-topk0.1": functools.partial(OmniReduce, density=0.1),
    "hier-dense": HierarchicalDense,
    "omnireduce-flat": functools.partial(NodeOmniReduce, hierarchical=False),
    "omnireduce-hier": functools.partial(NodeOmniReduce, hierarchical=True),
    "omnireduce-auto": functools.partial(NodeOmniReduce, hierarchical=None),
    "omnireduce-flat-topk0.01": functools.partial(NodeOmniReduce, hierarchical=False, density=0.01),
    "omnireduce-hier-topk0.01": functools.partial(NodeOmniReduce, hierarchical=True, density=0.01),
}
"""Every setting, by the name ``--hooks`` uses, in the order tables and plots list them."""


class SerialHookState:
    """State of :func:`_serial_hook`: the wrapped hook, its state, and the last bucket's future.

    torch's ``powerSGD_hook`` issues a bucket's P and Q all-reduces from future callbacks, on Gloo's
    threads, while DDP's autograd thread goes on starting the next buckets' hooks. With several
    buckets in flight the ranks can then issue their collectives in different orders, and Gloo aborts
    ("Received data size doesn't match expected size. Is there a distributed collective mismatch")
    or hangs (both seen with torch 2.13 and the recommender, on loopback). Running bucket i's hook
    when bucket i-1's has completed puts every rank's collectives in the same order; the compression
    still overlaps the rest of the backward pass, but buckets no longer overlap each other.
    """

    def __init__(self, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        self.state, self.hook = state, hook
        self.tail: Any = None


# No annotations: DDP's register_comm_hook checks them against the real classes, and this module
# has string annotations (from __future__ import annotations).
def _serial_hook(serial, bucket):
    import torch

    out = torch.futures.Future()

    def start(_previous: Any = None) -> None:
        try:
            inner = serial.hook(serial.state, bucket)
        except BaseException as e:
            out.set_exception(e)
            return

        def finish(f: Any) -> None:
            try:
                out.set_result(f.value())
            except BaseException as e:
                out.set_exception(e)

        inner.add_done_callback(finish)

    previous, serial.tail = serial.tail, out
    if previous is None:
        start()
    else:
        previous.add_done_callback(start)  # runs at once if it is already done
    return out
