"""FSDP2 and HSDP: omnireduce as the all-reduce across the replicas of a model sharded with ``fully_shard``.

HSDP shards a model inside a node and replicates it across nodes: on a 2-D DeviceMesh
``("replicate", "shard")`` each FSDP unit's gradients are reduce-scattered inside the node, then
the reduce-scatter output is all-reduced across the nodes. That all-reduce crosses the slow
network, and an embedding table's shard is mostly zero. Shard on ``mesh["shard"]`` instead and let
:func:`use_omnireduce` reduce the reduce-scatter outputs across ``mesh["replicate"]``: an
all-reduce hook on every FSDP unit (:mod:`~omnireduce.integrations.fsdp.hook`) hands each output to
the DDP side's router as a bucket of its own (:mod:`~omnireduce.integrations.fsdp.reducer`), which
gives each unit its way as it gives a DDP bucket its way: timed on the unit, the fastest kept, agreed
on every rank of the replicate group (``path="measure"``), so a sparse table's shard sends only its
non-zero blocks and dense layers stay on the dense all-reduce; averaged as native HSDP averages::

    mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    reduced = use_omnireduce(model, mesh=mesh)   # every rank, before the first backward
    ...train...
    reduced.stats()                              # bytes sent, ways, per FSDP module too
    reduced.close()

The parameters equal native HSDP's (``fully_shard(model, mesh=mesh)``): same reduce-scatter, same
sums, same division. Supported: ``MixedPrecisionPolicy`` (the reduce dtype travels),
``set_requires_gradient_sync(False)`` accumulation, ``reshard_after_forward`` either way, one
``fully_shard`` per block, ``set_gradient_divide_factor``. Refused with a clear error: per-parameter
meshes, modules not sharded on ``mesh["shard"]``, native HSDP, a module that already has an
all-reduce hook (:mod:`~omnireduce.integrations.fsdp.units`); ``engine="aggregators"`` without
aggregator addresses (the job starts no aggregators of its own for FSDP); a torch older than 2.9 (FSDP2's
all-reduce hook came in 2.7; 2.8's Gloo reduce-scatter sums where FSDP2 averages), naming the version found.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from omnireduce.config import WorkerConfig, env_aggregators, env_timeout
from omnireduce.ddp.options import AGGREGATORS, AUTO, DEFAULT_DENSE_THRESHOLD, ENGINE_NAMES, Options
from omnireduce.engines.ways import ENGINES
from omnireduce.integrations.fsdp.hook import ReplicaHook
from omnireduce.integrations.fsdp.passes import BackwardPasses
from omnireduce.integrations.fsdp.recorder import Recorder
from omnireduce.integrations.fsdp.reducer import Replicas
from omnireduce.integrations.fsdp.units import Unit, check_torch, find_units, is_fsdp

__all__ = ["OmniReduceFSDP", "check_torch", "is_fsdp", "use_omnireduce"]

log = logging.getLogger("omnireduce.integrations")




class OmniReduceFSDP:
    """What :func:`use_omnireduce` returns: ``names`` (each FSDP unit's module path), :meth:`stats`
    and :meth:`close`; also a context manager."""

    def __init__(self, units: list[Unit], hooks: list[ReplicaHook], reducer: Replicas, recorder: Recorder) -> None:
        self.names = [u.name for u in units]
        self._hooks, self._reducer, self._recorder = hooks, reducer, recorder
        self._closed = False

    def stats(self) -> dict[str, Any]:
        """This rank's counters summed over the FSDP units: ``reductions`` (``_sparse`` through
        omnireduce, ``_dense``), ``bytes_sent``, ``bytes_received``, ``dense_equivalent_bytes`` (what
        native HSDP's ring all-reduce of the same tensors sends), ``sent_fraction`` (bytes sent over
        that); ``per_module``: each unit's module path (``"(the model)"`` for the root) to its own
        counters, ``sent_fraction``, last way (``path``: ``"collective"``, ``"aggregators"`` for the
        aggregators, ``"dense"``), ``union_density``, ``block_size`` and ``numel``; ``paths``: each
        unit's module path to its path choice (the way decided, ``phase``, the agreed times of each
        way in ms, ``decided_at``, ``measurements``; the same on every rank of its replicate group);
        ``engine`` (the ways through omnireduce: ``"collective"``, ``"aggregators"``, ``"measured"``),
        ``step_checks``, ``iterations_measuring``, ``collective_exchanges`` and
        ``aggregators_in_use``, as the DDP hook's ``stats()`` has them."""
        out = self._recorder.stats()
        runtime = self._reducer.stats()
        names = {key: name or "(the model)" for key, name in enumerate(self.names)}
        out["paths"] = {names[key]: entry for key, entry in runtime["paths"].items() if key in names}
        for k in ("engine", "step_checks", "iterations_measuring", "collective_exchanges", "aggregators_in_use"):
            out[k] = runtime[k]
        return out

    def close(self) -> None:
        """Stop reducing: the hooks stay on the modules but raise if called (a backward after this
        fails, rather than training replicas apart), and the engines' threads, the worker and the
        groups are let go once the reductions asked for are done. Idempotent."""
        if not self._closed:
            self._closed = True
            for hook in self._hooks:
                hook.closed = True
            self._reducer.close()

    def __enter__(self) -> OmniReduceFSDP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def use_omnireduce(module: nn.Module, *, mesh: Any, path: str = "measure",
                   dense_threshold: float = DEFAULT_DENSE_THRESHOLD, engine: str = AUTO,
                   aggregators: str | list[str] | None = None, token: str | None = None, job: str | None = None,
                   block_size: int | None = None, align_blocks: bool = True, timeout: float | None = None,
                   measure_trials: int = 3, remeasure_every: int | None = None, sum_order: str = "any",
                   lanes: int | None = None, slots: int | None = None, threshold: float = 0.0) -> OmniReduceFSDP:
    """Reduce the reduce-scatter outputs of ``module``'s FSDP units across ``mesh["replicate"]``
    through omnireduce (see the module). Collective: call it on every rank, with the same arguments,
    after ``fully_shard`` and before the first backward.

    Args:
        module: the model (or a part of it) whose FSDP units, sharded with
            ``fully_shard(..., mesh=mesh["shard"])``, get the hook.
        mesh: the 2-D DeviceMesh, dimensions named ``("replicate", "shard")``.
        path: each unit's way, the same on every rank of its replicate group, as the DDP hook's
            ``path`` (docs/explanation/path-choice.md): ``"measure"`` (time the ways on the unit, keep
            the fastest, check the plan on whole steps), ``"threshold"`` (dense once the unit's union
            density, the fraction of its blocks non-zero on some replica, reached ``dense_threshold``;
            a unit seen the first time is probed: one number all-reduced), ``"omnireduce"`` (always
            the first way through omnireduce: the aggregators where given, else the collective
            engine) or ``"dense"``.
        dense_threshold: see ``path`` (0.6).
        engine: the ways through omnireduce: ``"auto"`` (the collective engine, and with aggregator
            addresses the aggregators too, both timed with ``path="measure"``), ``"collective"`` (the
            replicas sum each other's blocks through the process group's collectives; no aggregator),
            ``"aggregators"`` (the aggregator processes at ``aggregators``).
        aggregators: aggregator addresses (None: ``$OMNIREDUCE_AGGREGATORS``; neither: no aggregators;
            for FSDP the job starts none of its own). Each column of the mesh is a job of its own there.
        token, job: the aggregators' secret and the job's name (the DDP hook's; the columns' jobs are
            ``job`` with ``.shard<column>``).
        block_size: elements per block (None: ``$OMNIREDUCE_BLOCK_SIZE`` or 256); with
            ``align_blocks`` each unit's blocks are aligned to the rows of its dominant parameter.
        timeout: seconds a reduction may take before backward fails (None: ``$OMNIREDUCE_TIMEOUT``
            or 60).
        measure_trials, remeasure_every, sum_order, lanes, slots, threshold: as the DDP hook's
            (:class:`omnireduce.ddp.OmniReduceState`).
    """
    check_torch()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("use_omnireduce(module, mesh=...) needs torch.distributed initialised "
                           "(dist.init_process_group) and the model sharded with fully_shard")
    limit = float(timeout) if timeout is not None else env_timeout()
    options = _options(path=path, dense_threshold=dense_threshold, engine=engine, aggregators=aggregators,
                       token=token, job=job, block_size=block_size, timeout=limit, lanes=lanes, slots=slots,
                       threshold=threshold, measure_trials=measure_trials, remeasure_every=remeasure_every,
                       align_blocks=align_blocks, sum_order=sum_order)
    replicas = mesh.size(0) if getattr(mesh, "ndim", 0) == 2 else 0
    layout = WorkerConfig.resolve(rank=0, world_size=max(replicas, 1), block_size=block_size, timeout=limit,
                                  lanes=lanes, slots=slots, threshold=threshold, without_aggregators=True)
    units = find_units(module, mesh, layout.block_size, align_blocks)
    recorder = Recorder([u.name for u in units])
    reducer = Replicas.bind(mesh, dataclasses.replace(options, block_size=layout.block_size), recorder)
    passes = BackwardPasses(reducer.after_backward)
    hooks = [ReplicaHook(u, reducer, passes, layout.block_size) for u in units]
    for unit, hook in zip(units, hooks, strict=True):
        unit.module.set_all_reduce_hook(hook)
    log.info("omnireduce: HSDP across %d replicas (path %s, ways %s), %d FSDP module(s): %s", replicas, options.path,
             reducer.stats()["engine"], len(units), ", ".join(u.name or "(the model)" for u in units))
    return OmniReduceFSDP(units, hooks, reducer, recorder)


def _options(*, engine: str, aggregators: str | list[str] | None, **rest: Any) -> Options:
    """The DDP side's options for the replicas' runtime, checked (ValueError for a bad value): the
    hierarchy off (FSDP's reduce-scatter is the step inside the node), and without aggregator
    addresses the collective engine (``"auto"``), or a refusal (``"aggregators"``): no aggregator is
    started for FSDP."""
    if engine not in ENGINE_NAMES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINE_NAMES))}, got {engine!r}")
    given = aggregators is not None or bool(env_aggregators())
    if engine == AGGREGATORS and not given:
        raise ValueError("engine='aggregators' needs aggregator addresses (aggregators= or $OMNIREDUCE_AGGREGATORS): "
                         "for FSDP the job starts no aggregators of its own; run omnireduce-agg, or use "
                         "engine='collective' (or 'auto')")
    if engine == AUTO and not given:  # (the first engine of the ranks' own that "auto" measures)
        engine = next(str(way) for way, e in ENGINES.items() if e.auto)
    return Options.resolve(engine=engine, aggregators=aggregators, hierarchical=False, **rest)
