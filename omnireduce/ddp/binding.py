"""Binding a DDP hook's state to its job: what :meth:`OmniReduceState.bind` resolves, opens and returns.

Binding is collective over the process group (every rank binds, in the same order) and returns a
:class:`~omnireduce.ddp.runtime.Runtime`, whole, in one call; nothing here writes into the state.

- the rank, world size and job name (``$OMNIREDUCE_JOB``, else a name rank 0 makes up and broadcasts);
- the aggregators and this rank's :class:`omnireduce.Worker`: at the given addresses (``aggregators=``
  or ``$OMNIREDUCE_AGGREGATORS``), else at aggregators the job starts for itself, one per node
  (:func:`omnireduce.launch.colocate.start_colocated`). With ``engine="collective"`` (any engine of
  the ranks' own) there are none: no process starts and no port opens, the ranks sum each other's blocks;
- the reducers of the ways the buckets may take (:class:`~omnireduce.ddp.routing.router.Ways`): the
  aggregators (:class:`~omnireduce.engines.aggregators.WorkerReducer`), each engine of the ranks' own
  that is asked for or measured (:data:`omnireduce.engines.ways.ENGINES`, on a process group of its
  own, which a Gloo one is destroyed with: :mod:`omnireduce.engines.own_groups`), the process group's
  all-reduce;
- the hierarchy, where nodes hold several ranks (:mod:`omnireduce.engines.hierarchy`): every dense bucket
  takes it when forced (``hierarchical=True``) or left to ``auto`` with a ``path`` other than
  ``"measure"``; left to ``auto`` and measured, whole steps through it are timed against flat ones
  (:mod:`omnireduce.ddp.routing.path_choice`), so the flat ways serve beside it. Its rails take the same ways,
  each on the rail: a worker of the rail's own job, the engines on a group of the rail's own, the
  rail's all-reduce;
- the agreement, the router and the sparse COO batch, which tie them together.

What is opened goes into the runtime's :class:`~omnireduce.ddp.runtime.Parts`; if a later step fails,
it is closed again before the error leaves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig, env_aggregators, env_hierarchical, env_job, env_timeout
from omnireduce.ddp.backend import backend_name
from omnireduce.ddp.bucket import Intake
from omnireduce.ddp.options import AUTO, Mode, Options
from omnireduce.ddp.paths.compressed import Compression
from omnireduce.ddp.paths.coo import CooBatch
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.residuals import Residuals
from omnireduce.ddp.routing.agreement import Agreement
from omnireduce.ddp.routing.router import Router, Ways
from omnireduce.ddp.routing.rules import ThresholdRule
from omnireduce.ddp.runtime import Closing, Parts, Runtime
from omnireduce.engines import own_groups
from omnireduce.engines.aggregators import WorkerReducer
from omnireduce.engines.dense import DenseReducer
from omnireduce.engines.hierarchical import Hierarchical
from omnireduce.engines.hierarchy import Hierarchy, Topology, discover, wanted
from omnireduce.engines.reducer import Reducer
from omnireduce.engines.ways import ENGINES, Way
from omnireduce.exits import LEAVE, RELEASE, at_exit
from omnireduce.launch.colocate import Colocated
from omnireduce.worker import Worker

log = logging.getLogger("omnireduce.ddp")


def sparse_paths(engine: str, path: str, backend: str) -> tuple[Way, ...]:
    """The ways through omnireduce a state's buckets may take, given its ``engine`` and ``path``
    and its process group's backend: the aggregators (``"omnireduce"``), an engine of the ranks' own
    (``"collective"``), or (``engine="auto"`` measuring on Gloo or NCCL, where the engines have run
    on the real backend) the aggregators and every engine ``"auto"`` measures, timed against each
    other and the dense all-reduce. On other backends ``"auto"`` keeps to the aggregators (see
    ``OmniReduceState``'s ``engine``)."""
    if engine in ENGINES:
        return (Way(engine),)
    if engine == AUTO and path == Mode.MEASURE and any(b in backend for b in PROVEN_BACKENDS):
        return (Way.AGGREGATORS, *(way for way, e in ENGINES.items() if e.auto))
    return (Way.AGGREGATORS,)


PROVEN_BACKENDS = ("gloo", "nccl")  # the backends engine="auto" measures the engines on (rails too)


def bind(options: Options, process_group: dist.ProcessGroup | None, worker: Worker | None, recorder: Recorder,
         warn: Callable[[str, str], None], residuals: Residuals | None = None,
         grad_scaler: torch.amp.GradScaler | None = None, *,
         engine_group: Callable[[], dist.ProcessGroup | None] | None = None, average_op: bool = False,
         iteration: int = 0) -> Runtime:
    """This rank's runtime for a state with ``options`` (collective over the process group); ``worker``:
    one the user gave (not closed by the runtime); ``residuals`` and ``grad_scaler``: the state's, with
    ``compression``. ``engine_group``: makes the process group of each flat engine of the ranks' own
    (collective over the default group, like ``dist.new_group``: every rank of the job calls it, in the
    same order). None: a new group of the process group's ranks, which is right where every rank binds
    one process group of the same ranks; where the ranks bind different groups (each FSDP replicate
    set its own), the caller makes every set's group on every rank and returns this rank's.
    ``average_op``: the dense all-reduce averages with the backend's ``ReduceOp.AVG`` (native HSDP's
    bits) instead of dividing first (DDP's ``allreduce_hook``'s). ``iteration``: the iterations done so far
    (an unpickled state's), where the model's intake counts on from."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("omnireduce_hook needs torch.distributed to be initialised (dist.init_process_group) "
                           "before its first call")
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    job = options.job or job_name(group)
    backend = backend_name(group)
    sparse = sparse_paths(options.engine, options.path, backend)
    parts = Parts(worker, owns_worker=worker is None)
    try:
        if worker is None and Way.AGGREGATORS in sparse:
            parts.worker, parts.colocated = connect(options, rank, world_size, job, group)
        config = parts.worker.config if parts.worker is not None else _config(options, rank, world_size, job)
        setting = options.hierarchical if options.hierarchical is not None else env_hierarchical()
        topology = _topology(group, setting)
        measured = setting is None and options.path == Mode.MEASURE and topology is not None  # (flat or not)
        agreement = Agreement(parts.worker, process_group)
        at_exit(RELEASE, _release_at_exit, weakref.ref(agreement))
        ways = _ways(options, sparse, parts, process_group, group, config, job, agreement, topology, backend,
                     flat_engines=topology is None or measured, engine_group=engine_group, average_op=average_op)
        rule = ThresholdRule(recorder.densities, options.dense_threshold, process_group, config, recorder)
        rail_rule = None
        if ways.rail_scanned is not None and parts.hierarchy is not None:
            rail_rule = ThresholdRule(recorder.rail_densities, options.dense_threshold, parts.hierarchy.rail_group,
                                      config, recorder)
        compression = Compression(residuals, process_group, grad_scaler) if residuals is not None else None
        router = Router(options, ways, agreement, rule, recorder, warn, rail_rule=rail_rule, compression=compression,
                        measure_hierarchy=measured)
        intake = Intake(config.block_size, options.align_blocks, iteration)
        return Runtime(options=options, process_group=process_group, rank=rank, world_size=world_size, job=job,
                       config=config, recorder=recorder, intake=intake, router=router, agreement=agreement,
                       coo=CooBatch(recorder, world_size), parts=parts)
    except BaseException:
        parts.close(drain=False)
        raise


def _ways(options: Options, sparse: tuple[Way, ...], parts: Parts, process_group: dist.ProcessGroup | None,
          group: dist.ProcessGroup | None, config: WorkerConfig, job: str, agreement: Agreement,
          topology: Topology | None, backend: str, *, flat_engines: bool,
          engine_group: Callable[[], dist.ProcessGroup | None] | None = None, average_op: bool = False) -> Ways:
    """The reducers of the ways the buckets may take, flat and through the hierarchy (what they open
    goes into ``parts``). ``flat_engines``: the buckets may take the engines flat (else every bucket
    takes the hierarchy; an engine asked for by name is made flat all the same, for the sparse COO rows);
    ``engine_group``, ``average_op``: see :func:`bind`."""
    dense = _opened(parts, DenseReducer(process_group, average_op=average_op))
    flat: dict[Way, Reducer] = {Way.DENSE: dense}
    if parts.worker is not None:
        flat[Way.AGGREGATORS] = WorkerReducer(parts.worker)
    for way in sparse:
        if way in ENGINES and (flat_engines or options.engine == way):
            own = engine_group() if engine_group is not None else own_groups.new_group(  # (its engine's alone)
                dist.get_process_group_ranks(group), dist.get_backend(group), float(config.timeout))
            engine = ENGINES[way].build(own, config, options.sum_order)
            flat[way] = _opened(parts, engine)
            parts.engine = parts.engine or engine
    rows = flat[Way(options.engine)] if options.engine in ENGINES else flat.get(Way.AGGREGATORS, dense)
    if topology is None:
        return Ways(sparse, flat, dense.measured(config), rows)
    hierarchy = parts.hierarchy = Hierarchy(topology, backend=backend or None, timeout=float(config.timeout))
    rails = _rails(parts, sparse, config, job, topology, backend, options.sum_order) if len(topology.nodes) > 1 else {}
    missing = [str(way) for way in (*sparse, Way.DENSE) if rails and way not in rails]
    if missing:  # (a way with no rail reducer would skip the step across the nodes)
        raise RuntimeError(f"omnireduce: no reducer on this rank's rail for {', '.join(missing)}")
    rail_worker = rails.get(Way.AGGREGATORS)
    prepare = functools.partial(_prepared, rail_worker, agreement) if isinstance(rail_worker, WorkerReducer) else None
    base = Hierarchical(hierarchy, None, flat=rows, prepare=prepare)
    through = {way: base.through(rails.get(way)) for way in (*sparse, Way.DENSE)}
    rail_dense = rails.get(Way.DENSE)
    scanned = rail_dense.measured(config) if isinstance(rail_dense, DenseReducer) and \
        options.path == Mode.THRESHOLD else None
    return Ways(sparse, flat, dense.measured(config), base.through(rail_worker or rails.get(sparse[0])), through,
                scanned)


def _rails(parts: Parts, sparse: tuple[Way, ...], config: WorkerConfig, job: str, topology: Topology,
           backend: str, sum_order: str) -> dict[Way, Reducer]:
    """Each way on this rank's rail of the hierarchy (several nodes): a member of the rail's own
    omnireduce job (rail i lists the aggregators from the i-th on, so that slot s of its tensors goes to
    aggregator (s + i) mod A and the rails' first slots spread over them), each engine on a group of the
    rail's own (every rank makes every rail's group, in the same order), the rail's all-reduce."""
    assert parts.hierarchy is not None
    rails: dict[Way, Reducer] = {Way.DENSE: _opened(parts, DenseReducer(parts.hierarchy.rail_group))}
    worker = parts.worker
    if worker is not None and Way.AGGREGATORS in sparse:
        cfg = worker.config
        offset = topology.local_rank % len(cfg.aggregators)
        addresses = list(cfg.aggregators[offset:]) + list(cfg.aggregators[:offset])
        rail = _opened(parts, Worker(addresses, rank=topology.node, world_size=len(topology.nodes),
                                     job=f"{job}.rail{topology.local_rank}", block_size=cfg.block_size,
                                     timeout=cfg.timeout, token=cfg.token, lanes=cfg.lanes, slots=cfg.slots,
                                     threshold=cfg.threshold))
        rails[Way.AGGREGATORS] = WorkerReducer(rail, offset, len(cfg.aggregators))
    for way in sparse:
        if way not in ENGINES:
            continue
        mine = None
        for i in range(topology.local_size):
            g = own_groups.new_group(list(topology.rail(i)), backend or None, float(config.timeout))
            if i == topology.local_rank:
                mine = g
        engine = ENGINES[way].build(mine, config, sum_order)
        rails[way] = _opened(parts, engine)
        parts.rail_engine = parts.rail_engine or engine
    return rails


_Part = TypeVar("_Part", bound=Closing)


def _opened(parts: Parts, part: _Part) -> _Part:
    """``part``, to be closed with the runtime (in the order made, after the hierarchy's threads)."""
    parts.engines.append(part)
    return part


def _prepared(rail: WorkerReducer, agreement: Agreement) -> Callable[[], None]:
    """At a tensor's submission: what makes the rail's worker take the aggregators agreed on by then,
    just before the tensor's rail reduction (on the hierarchy's step thread)."""
    return functools.partial(rail.use, agreement.usable)


def job_name(group: dist.ProcessGroup | None) -> str:
    """The job's name at the aggregators when the user gave none (collective)."""
    if env_job():
        return str(env_job())
    name = [f"ddp-{uuid.uuid4().hex[:16]}" if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0  # (None: the default group)
    dist.broadcast_object_list(name, src=src, group=group)
    return str(name[0])


def connect(options: Options, rank: int, world_size: int, job: str,
            group: dist.ProcessGroup | None) -> tuple[Worker, Colocated | None]:
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
        opts["aggregators"], opts["token"] = colocated.addresses, colocated.token
        worker = Worker(rank=rank, world_size=world_size, job=job, **opts)
    except BaseException:
        colocated.close(drain=False)
        raise
    # The worker says goodbye while its aggregators still listen (they stop in the stage after, from
    # their own handler). It holds the worker, not the state, which DDP may have dropped by then.
    at_exit(LEAVE, _leave_at_exit, worker)
    return worker, colocated


def _config(options: Options, rank: int, world_size: int, job: str) -> WorkerConfig:
    """The blocks' configuration from the options alone, for a job without aggregators."""
    return WorkerConfig.resolve(rank=rank, world_size=world_size, job=job, block_size=options.block_size,
                                timeout=options.timeout, token=options.token, lanes=options.lanes,
                                slots=options.slots, threshold=options.threshold, without_aggregators=True)


def _topology(group: dist.ProcessGroup | None, setting: bool | None) -> Topology | None:
    """The nodes' topology where the hierarchy runs (collective over the whole default group), or None
    where :func:`omnireduce.engines.hierarchy.wanted` says the flat ways are used (logged once, with
    the reason)."""
    if setting is False:
        return None
    topology = discover(group)
    on, why = wanted(setting, topology, group)
    if not on:
        (log.warning if setting else log.info)("omnireduce: not hierarchical: %s", why)
        return None
    log.info("omnireduce: hierarchical: %s", why)
    return topology


def _leave_at_exit(worker: Worker) -> None:
    with contextlib.suppress(Exception):
        worker.close()


def _release_at_exit(ref: weakref.ref[Agreement]) -> None:
    """At interpreter exit: the last agreement's work is let go while the interpreter still runs (a
    Gloo work destroyed during the shutdown can abort the process)."""
    agreement = ref()
    if agreement is not None:
        agreement.release()
