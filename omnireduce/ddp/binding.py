"""Binding a DDP hook's state to its job: what :meth:`OmniReduceState.bind` resolves, opens and returns.

Binding is collective over the process group (every rank binds, in the same order) and returns a
:class:`~omnireduce.ddp.runtime.Runtime` as a value; nothing here writes into the state.

- the rank, world size and job name (``$OMNIREDUCE_JOB``, else a name rank 0 makes up and broadcasts);
- the aggregators and this rank's :class:`omnireduce.Worker`: at the given addresses (``aggregators=``
  or ``$OMNIREDUCE_AGGREGATORS``), else at aggregators the job starts for itself, one per node
  (:func:`omnireduce.launch.colocate.start_colocated`). With ``engine="collective"`` there are none: no
  process starts and no port opens, the ranks sum each other's blocks;
- the collective engine, where the buckets may take it (asked for, or measured with ``"auto"``);
- the hierarchy, where nodes hold several ranks (:mod:`omnireduce.engines.hierarchy`): every dense bucket
  takes it when forced (``hierarchical=True``) or left to ``auto`` with a ``path`` other than
  ``"measure"``; left to ``auto`` and measured, whole steps through it are timed against flat ones
  (:mod:`omnireduce.ddp.path_choice`), so the flat worker and engine serve beside it;
- the agreement, the router and the sparse COO batch, which tie them together.

A part made before a later one fails is closed again before the error leaves.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from omnireduce.config import WorkerConfig, env_aggregators, env_hierarchical, env_job, env_timeout
from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.backend import backend_name
from omnireduce.ddp.densities import Densities
from omnireduce.ddp.options import COLLECTIVE, MEASURE, OMNIREDUCE, THRESHOLD, Options
from omnireduce.ddp.paths.coo import CooBatch, RowsReducer, flat_rows
from omnireduce.ddp.paths.hierarchy import HierarchicalPath
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.residuals import Residuals
from omnireduce.ddp.router import Router, ThresholdRule
from omnireduce.ddp.runtime import Runtime
from omnireduce.engines.collective import CollectiveEngine
from omnireduce.engines.hierarchy import Hierarchy, Topology, discover, wanted
from omnireduce.exits import LEAVE, RELEASE, at_exit
from omnireduce.launch.colocate import Colocated
from omnireduce.worker import Worker

log = logging.getLogger("omnireduce.ddp")


def sparse_paths(engine: str, path: str, backend: str) -> tuple[str, ...]:
    """The ways through omnireduce a state's buckets may take, given its ``engine`` and ``path``
    and its process group's backend: the aggregators (``"omnireduce"``), the collective engine
    (``"collective"``), or (``engine="auto"`` measuring on Gloo or NCCL, where the engine has run
    on the real backend) both, measured against each other and the dense all-reduce. On other
    backends ``"auto"`` keeps to the aggregators (see ``OmniReduceState``'s ``engine``)."""
    if engine == COLLECTIVE:
        return (COLLECTIVE,)
    if engine == "auto" and path == MEASURE and any(b in backend for b in PROVEN_BACKENDS):
        return (OMNIREDUCE, COLLECTIVE)
    return (OMNIREDUCE,)


PROVEN_BACKENDS = ("gloo", "nccl")  # the backends engine="auto" measures the collective engine on (rails too)


def bind(options: Options, process_group: Any, worker: Worker | None, recorder: Recorder,
         warn: Callable[[str, str], None], residuals: Residuals | None = None, grad_scaler: Any = None) -> Runtime:
    """This rank's runtime for a state with ``options`` (collective over the process group); ``worker``:
    one the user gave (not closed by the runtime); ``residuals`` and ``grad_scaler``: the state's, with
    ``compression``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("omnireduce_hook needs torch.distributed to be initialised (dist.init_process_group) "
                           "before its first call")
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    job = options.job or job_name(group)
    backend = backend_name(group)
    paths = sparse_paths(options.engine, options.path, backend)
    rt = Runtime(options=options, process_group=process_group, rank=rank, world_size=world_size, job=job,
                 recorder=recorder, sparse_paths=paths, worker=worker, owns_worker=worker is None,
                 residuals=residuals, grad_scaler=grad_scaler)
    try:
        if worker is None and options.engine != COLLECTIVE:
            rt.worker, rt.colocated = connect(options, rank, world_size, job, group)
        cfg = rt.layout = rt.worker.config if rt.worker is not None else _layout(options, rank, world_size, job)
        setting = options.hierarchical if options.hierarchical is not None else env_hierarchical()
        rt.hierarchy = _hierarchy(rt, cfg, group, setting, backend)
        layouts = setting is None and options.path == MEASURE and rt.hierarchy is not None  # (flat or not: measured)
        if options.engine == COLLECTIVE or (COLLECTIVE in paths and (rt.hierarchy is None or layouts)):
            rt.engine = CollectiveEngine.for_group(group, cfg.timeout, cfg.block_size, cfg.lanes, cfg.slots,
                                                   cfg.threshold)
        rt.agreement = Agreement()
        at_exit(RELEASE, _release_at_exit, weakref.ref(rt.agreement))
        rule = ThresholdRule(recorder.densities, options.dense_threshold, process_group, cfg, recorder)
        rail_densities = rt.hierarchy.densities if rt.hierarchy is not None else None
        rt.router = Router(options, paths, rt.agreement, rule, rt.hierarchy is not None and not layouts,
                           rail_densities, warn, layouts=layouts)
        rt.coo = CooBatch(_rows_reducer(rt), recorder, world_size)
    except BaseException:
        rt.close(drain=False)
        raise
    return rt


def job_name(group: Any) -> str:
    """The job's name at the aggregators when the user gave none (collective)."""
    if env_job():
        return str(env_job())
    name = [f"ddp-{uuid.uuid4().hex[:16]}" if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    return str(name[0])


def connect(options: Options, rank: int, world_size: int, job: str, group: Any) -> tuple[Worker, Colocated | None]:
    """A worker for this rank: at the given aggregators, or at colocated ones started now (returned
    with it; they stop at interpreter exit, after the worker has left them)."""
    opts = options.worker_options()
    if "aggregators" in opts or env_aggregators():
        worker = Worker(rank=rank, world_size=world_size, job=job, **opts)
        at_exit(LEAVE, _leave_at_exit, worker)  # (before the aggregators of a state this one shares stop)
        return worker, None
    from omnireduce.launch.colocate import start_colocated

    colocated = start_colocated(group, timeout=float(opts.get("timeout", env_timeout())))
    try:
        opts.update(aggregators=colocated.addresses, token=colocated.token)
        worker = Worker(rank=rank, world_size=world_size, job=job, **opts)
    except BaseException:
        colocated.close(drain=False)
        raise
    # The worker says goodbye while its aggregators still listen (they stop in the stage after, from
    # their own handler). It holds the worker, not the state, which DDP may have dropped by then.
    at_exit(LEAVE, _leave_at_exit, worker)
    return worker, colocated


def _layout(options: Options, rank: int, world_size: int, job: str) -> WorkerConfig:
    """The blocks' layout from the options alone, for a job without aggregators."""
    return WorkerConfig.resolve(rank=rank, world_size=world_size, job=job, block_size=options.block_size,
                                timeout=options.timeout, token=options.token, lanes=options.lanes,
                                slots=options.slots, threshold=options.threshold, without_aggregators=True)


def _hierarchy(rt: Runtime, cfg: WorkerConfig, group: Any, setting: bool | None,
               backend: str) -> HierarchicalPath | None:
    """The hierarchical path (collective over the whole default group), or None where
    :func:`omnireduce.engines.hierarchy.wanted` says the flat path is used (logged once, with the reason)."""
    if setting is False:
        return None
    topology = discover(group)
    on, why = wanted(setting, topology, group)
    if not on:
        (log.warning if setting else log.info)("omnireduce: not hierarchical: %s", why)
        return None
    log.info("omnireduce: hierarchical: %s", why)
    hierarchy = Hierarchy(topology, backend=backend or None, timeout=float(cfg.timeout))
    worker, offset = _rail_worker(rt, topology)
    engine = _rail_engine(rt, cfg, topology, backend)
    densities = Densities()
    rule = None
    if rt.options.path == THRESHOLD:
        rule = ThresholdRule(densities, rt.options.dense_threshold, hierarchy.rail_group, cfg, rt.recorder)
    return HierarchicalPath(hierarchy, worker, engine, offset, rt.recorder, cfg, rt.sparse_paths[0], rule,
                            densities)


def _rail_worker(rt: Runtime, topology: Topology) -> tuple[Worker | None, int]:
    """This rank's member of its rail's omnireduce job (None: one node, or no aggregators), and the
    offset of its list of aggregators: rail i lists them from the i-th on, so that slot s of its
    tensors goes to aggregator (s + i) mod A and the rails' first slots spread over them."""
    if len(topology.nodes) == 1 or rt.worker is None:
        return None, 0
    cfg = rt.worker.config
    offset = topology.local_rank % len(cfg.aggregators)
    addresses = list(cfg.aggregators[offset:]) + list(cfg.aggregators[:offset])
    worker = Worker(addresses, rank=topology.node, world_size=len(topology.nodes),
                    job=f"{rt.job}.rail{topology.local_rank}", block_size=cfg.block_size, timeout=cfg.timeout,
                    token=cfg.token, lanes=cfg.lanes, slots=cfg.slots, threshold=cfg.threshold)
    return worker, offset


def _rail_engine(rt: Runtime, cfg: WorkerConfig, topology: Topology, backend: str) -> CollectiveEngine | None:
    """Where the buckets may take the collective engine and there are several nodes: this rank's
    rail's engine, on a group of its own (every rank makes every rail's group, in the same order)."""
    if COLLECTIVE not in rt.sparse_paths or len(topology.nodes) == 1:
        return None
    limit = datetime.timedelta(seconds=float(cfg.timeout))
    mine = None
    for i in range(topology.local_size):
        g = dist.new_group(list(topology.rail(i)), timeout=limit, backend=backend or None)
        if i == topology.local_rank:
            mine = g
    return CollectiveEngine(mine, cfg.block_size, cfg.lanes, cfg.slots, cfg.threshold, float(cfg.timeout))


def _rows_reducer(rt: Runtime) -> RowsReducer:
    """Who sums a batch of sparse COO rows: the hierarchy by rail (tables of rows), else the collective
    engine with ``engine="collective"``, else the aggregators."""
    flat = flat_rows(rt.engine if rt.options.engine == COLLECTIVE else rt.worker)
    hierarchy = rt.hierarchy
    if hierarchy is None:
        return flat
    return lambda stacked, first: (hierarchy.reduce_rows if stacked.dim() == 2 else flat)(stacked, first)


def _leave_at_exit(worker: Worker) -> None:
    with contextlib.suppress(Exception):
        worker.close()


def _release_at_exit(ref: weakref.ref[Agreement]) -> None:
    """At interpreter exit: the last agreement's work is let go while the interpreter still runs (a
    Gloo work destroyed during the shutdown can abort the process)."""
    agreement = ref()
    if agreement is not None:
        agreement.release()
