"""FSDP2 and HSDP: omnireduce as the all-reduce across the replicas of a model sharded with ``fully_shard``.

HSDP shards a model inside a node and replicates it across nodes: on a 2-D DeviceMesh
``("replicate", "shard")`` each FSDP unit's gradients are reduce-scattered inside the node, then
the reduce-scatter output is all-reduced across the nodes. That all-reduce crosses the slow
network, and an embedding table's shard is mostly zero. Shard on ``mesh["shard"]`` instead and let
:func:`use_omnireduce` reduce the reduce-scatter outputs across ``mesh["replicate"]``: an
all-reduce hook on every FSDP unit (:mod:`~omnireduce.integrations.fsdp.hook`) sends only their
non-zero blocks through the collective engine, or all-reduces them densely where they are dense
(:mod:`~omnireduce.integrations.fsdp.reducer`), averaged as native HSDP averages::

    mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    reduced = use_omnireduce(model, mesh=mesh)   # every rank, before the first backward
    ...train...
    reduced.stats()                              # bytes sent, per FSDP module too
    reduced.close()

The parameters equal native HSDP's (``fully_shard(model, mesh=mesh)``): same reduce-scatter, same
sums, same division. Supported: ``MixedPrecisionPolicy`` (the reduce dtype travels),
``set_requires_gradient_sync(False)`` accumulation, ``reshard_after_forward`` either way, one
``fully_shard`` per block. Refused with a clear error: per-parameter meshes, modules not sharded
on ``mesh["shard"]``, native HSDP, a module that already has an all-reduce hook
(:mod:`~omnireduce.integrations.fsdp.units`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from omnireduce.config import WorkerConfig, env_timeout
from omnireduce.integrations.fsdp.hook import ReplicaHook
from omnireduce.integrations.fsdp.recorder import Recorder
from omnireduce.integrations.fsdp.reducer import EngineOrDense, PathRule, ReplicaReducer, replica_groups
from omnireduce.integrations.fsdp.units import Unit, find_units, is_fsdp

__all__ = ["OmniReduceFSDP", "is_fsdp", "use_omnireduce"]

log = logging.getLogger("omnireduce.integrations")

DEFAULT_DENSE_THRESHOLD = 0.6


class OmniReduceFSDP:
    """What :func:`use_omnireduce` returns: ``names`` (each FSDP unit's module path), :meth:`stats`
    and :meth:`close`; also a context manager."""

    def __init__(self, units: list[Unit], hooks: list[ReplicaHook], reducer: ReplicaReducer,
                 recorder: Recorder) -> None:
        self.names = [u.name for u in units]
        self._hooks, self._reducer, self._recorder = hooks, reducer, recorder
        self._closed = False

    def stats(self) -> dict[str, Any]:
        """This rank's counters summed over the FSDP units: ``reductions`` (``_sparse`` through
        omnireduce, ``_dense``), ``bytes_sent``, ``bytes_received``, ``dense_equivalent_bytes`` (what
        native HSDP's ring all-reduce of the same tensors sends), ``sent_fraction`` (bytes sent over
        that); and ``per_module``: each unit's module path (``"(the model)"`` for the root) to its own
        counters, ``sent_fraction``, last way (``path``), ``union_density``, ``block_size`` and ``numel``."""
        return self._recorder.stats()

    def close(self) -> None:
        """Stop reducing: the hooks stay on the modules but raise if called (a backward after this
        fails, rather than training replicas apart), and the engine's thread and groups are let go
        once the reductions asked for are done. Idempotent."""
        if not self._closed:
            self._closed = True
            for hook in self._hooks:
                hook.closed = True
            self._reducer.close()

    def __enter__(self) -> OmniReduceFSDP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def use_omnireduce(module: nn.Module, *, mesh: Any, path: str = "threshold",
                   dense_threshold: float = DEFAULT_DENSE_THRESHOLD, block_size: int | None = None,
                   align_blocks: bool = True, timeout: float | None = None, lanes: int | None = None,
                   slots: int | None = None, threshold: float = 0.0) -> OmniReduceFSDP:
    """Reduce the reduce-scatter outputs of ``module``'s FSDP units across ``mesh["replicate"]``
    through omnireduce (see the module). Collective: call it on every rank, after ``fully_shard``
    and before the first backward.

    Args:
        module: the model (or a part of it) whose FSDP units, sharded with
            ``fully_shard(..., mesh=mesh["shard"])``, get the hook.
        mesh: the 2-D DeviceMesh, dimensions named ``("replicate", "shard")``.
        path: each unit's way, the same on every rank: ``"threshold"`` (omnireduce, dense once the
            unit's union density, the fraction of its blocks non-zero on some replica, reached
            ``dense_threshold``), ``"omnireduce"`` or ``"dense"`` (always that way).
        dense_threshold: see ``path`` (0.6).
        block_size: elements per block (None: ``$OMNIREDUCE_BLOCK_SIZE`` or 256); with
            ``align_blocks`` each unit's blocks are aligned to the rows of its dominant parameter.
        timeout: seconds a reduction may take before backward fails (None: ``$OMNIREDUCE_TIMEOUT``
            or 60).
        lanes, slots, threshold: the blocks' layout and the lossy threshold, as the DDP hook's.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("use_omnireduce(module, mesh=...) needs torch.distributed initialised "
                           "(dist.init_process_group) and the model sharded with fully_shard")
    rule = PathRule(path, dense_threshold)  # (refuses a bad path or threshold before anything is made)
    limit = float(timeout) if timeout is not None else env_timeout()
    replicas = mesh.size(0) if getattr(mesh, "ndim", 0) == 2 else 0
    layout = WorkerConfig.resolve(rank=0, world_size=max(replicas, 1), block_size=block_size, timeout=limit,
                                  lanes=lanes, slots=slots, threshold=threshold, without_aggregators=True)
    units = find_units(module, mesh, layout.block_size, align_blocks)
    recorder = Recorder([u.name for u in units])
    reducer = EngineOrDense(replica_groups(mesh, limit), layout, rule, recorder, limit)
    hooks = [ReplicaHook(u, reducer, layout.block_size) for u in units]
    for unit, hook in zip(units, hooks, strict=True):
        unit.module.set_all_reduce_hook(hook)
    log.info("omnireduce: HSDP across %d replicas, %d FSDP module(s): %s", replicas, len(units),
             ", ".join(u.name or "(the model)" for u in units))
    return OmniReduceFSDP(units, hooks, reducer, recorder)
