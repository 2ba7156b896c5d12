"""What a bound state runs on: the value binding returns (:func:`omnireduce.ddp.binding.bind`), whole.

A :class:`Runtime` is built in one call, frozen: the rank, the job, the blocks' configuration, the
model's intake (:class:`~omnireduce.ddp.bucket.Intake`), the router (which holds every reducer the
buckets may take, and the ranks' agreement) and the sparse COO batch, and the :class:`Parts`
binding opened (the worker, the colocated aggregators, the engines, the hierarchy), which it closes.
For each bucket it asks the router for the route and executes it (:meth:`Runtime.reduce_bucket`):
the route's reducer reduces the bucket and returns the future DDP gets, which the state's recorder
watches (its bytes and density once it completes; its failure named). It decides nothing. It is
never pickled: an unpickled state binds again and gets a new one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig
from omnireduce.ddp.bucket import Bucket, Intake
from omnireduce.ddp.options import Options
from omnireduce.ddp.paths.coo import CooBatch
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.routing.agreement import Agreement
from omnireduce.ddp.routing.router import Router, RouterStats
from omnireduce.engines.hierarchy import Hierarchy
from omnireduce.engines.reducer import Engine, Reduction
from omnireduce.launch.colocate import Colocated
from omnireduce.worker import Worker

log = logging.getLogger("omnireduce.ddp")


class Closing(Protocol):
    """What :class:`Parts` closes: an engine, a rail's worker, the dense all-reduce's completer."""

    def close(self) -> None: ...


class Parts:
    """What binding opened for one state, closed once, in order: the hierarchy's step threads, the
    engines and rail workers (``engines``, in the order made), the worker this rank made (not the
    user's), then the colocated aggregators. ``engine``: the flat engine of the ranks' own, where there
    is one (its ``stats()`` count in the state's); ``rail_engine``: this rank's rail's."""

    def __init__(self, worker: Worker | None = None, owns_worker: bool = True) -> None:
        self.worker, self.owns_worker = worker, owns_worker  # this rank's omnireduce.Worker (None: no aggregators)
        self.colocated: Colocated | None = None  # the job's own aggregators when this rank started them
        self.hierarchy: Hierarchy | None = None
        self.engines: list[Closing] = []
        self.engine: Engine | None = None
        self.rail_engine: Engine | None = None
        self._closed = False

    def close(self, *, drain: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self.hierarchy is not None:
            self.hierarchy.close()
        for part in self.engines:
            part.close()
        if self.worker is not None and self.owns_worker:
            self.worker.close()
        if self.colocated is not None:
            self.colocated.close(drain=drain)


class _RuntimeStats(RouterStats):
    collective_reductions: int
    collective_exchanges: dict[str, int]
    collective_kernel_reductions: int
    aggregators_in_use: list[str]
    hierarchical: bool


class RuntimeStats(_RuntimeStats, total=False):
    """The runtime's part of ``OmniReduceState.stats()`` (:meth:`Runtime.stats`; its docstring explains
    each), the router's included; ``bytes_in_node``, ``rail_density`` and ``rail_collective_reductions``
    where the hierarchy runs."""

    bytes_in_node: int
    rail_density: dict[int, float]
    rail_collective_reductions: int


@dataclasses.dataclass(frozen=True, eq=False)
class Runtime:
    """One bound state's parts (see the module); made by :func:`omnireduce.ddp.binding.bind`."""

    options: Options
    process_group: dist.ProcessGroup | None  # the group DDP reduces over (None: the default group)
    rank: int
    world_size: int
    job: str
    config: WorkerConfig  # the blocks: size, lanes, slots, threshold; the timeout
    recorder: Recorder
    intake: Intake  # DDP's buckets of the model, counted into iterations
    router: Router
    agreement: Agreement  # (the router's; closed here)
    coo: CooBatch
    parts: Parts

    @property
    def worker(self) -> Worker | None:
        """This rank's omnireduce.Worker (None: no aggregators)."""
        return self.parts.worker

    @property
    def colocated(self) -> Colocated | None:
        return self.parts.colocated

    def reduce(self, grad_bucket: dist.GradBucket) -> Reduction:
        """Hand one DDP ``GradBucket`` to its route (:meth:`reduce_bucket`), as the model's intake takes it
        (its iteration counted there); after the iteration's last, the ranks' agreement starts. A failure
        comes back as the future's, naming the bucket and its iteration."""
        bucket = self.intake.take(grad_bucket)
        try:
            return self.reduce_bucket(bucket)
        except BaseException as e:  # (named by its own iteration: the intake has counted a last bucket's already)
            return self.recorder.failed(e, bucket.iteration, bucket.index)
        finally:  # (once the last bucket is on its way, so that its all-reduce does not queue behind this one)
            if bucket.last:
                self.after_last_bucket(bucket.iteration, bucket.buffer.device)

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        """Average ``bucket`` over the ranks (sum it, where it says so: :attr:`Bucket.average`) as its
        route says, and return the future at once: it completes with the bucket's tensor (its
        :attr:`Reduction.path` names the route's way, its ``info`` what it cost), or fails with the
        recorder's error naming the bucket. Every rank hands over the same buckets in the same order;
        a DDP bucket comes through :meth:`reduce`, any other tensor as :meth:`Bucket.of_tensor` (then
        call :meth:`after_last_bucket` after each iteration's last, as :meth:`reduce` does)."""
        route = self.router.route(bucket)
        if route.batched:
            return self.coo.add(bucket, route.reducer)
        if len(self.coo):
            self.coo.flush()  # the sparse buckets gathered so far go first (the same order on every rank)
        reduction = route.reducer.allreduce_async(bucket.buffer, average=bucket.average, block_size=bucket.block_size)
        reduction.path = route.path
        key = bucket.as_compressed().key if route.compressed else bucket.key
        self.recorder.watch(reduction, key, bucket.iteration, 0 if bucket.coo else bucket.nbytes, self.world_size,
                            route.hierarchical)
        if route.trial is not None:
            route.trial.watch(reduction)
        return reduction

    def after_last_bucket(self, iteration: int, device: torch.device) -> None:
        """Start this iteration's agreement, once its last bucket is on its way (collective); a failure
        is logged (DDP raises the bucket's own, if any)."""
        try:
            self.router.after_last_bucket(iteration, device)
        except BaseException as e:
            log.error("omnireduce: the agreement of iteration %d could not start: %s", iteration, e)

    def close(self, *, drain: bool = True) -> None:
        """Close what this runtime opened: the agreement in flight (waited for, with ``drain``), then
        its :class:`Parts` (the colocated aggregators once the other ranks' workers have left them,
        with ``drain``). Idempotent; the worker stays readable (closed)."""
        if drain:  # (nothing of ours left queued on the process group)
            self.agreement.settle(float(self.config.timeout))
        else:
            self.agreement.release()
        self.parts.close(drain=drain)

    def stats(self) -> RuntimeStats:
        """The runtime's part of ``OmniReduceState.stats()`` (plain values only)."""
        parts = self.parts
        engine = parts.engine.stats() if parts.engine is not None else None
        out: RuntimeStats = {
            "collective_reductions": engine["reductions"] if engine is not None else 0,
            "collective_exchanges": dict(engine["exchanges"]) if engine is not None else {},
            "collective_kernel_reductions": engine["kernel_reductions"] if engine is not None else 0,
            "aggregators_in_use": parts.worker.aggregators_in_use() if parts.worker is not None else [],
            "hierarchical": parts.hierarchy is not None,
            **self.router.stats(),
        }
        if parts.hierarchy is not None:
            rail = parts.rail_engine.stats() if parts.rail_engine is not None else None
            out.update({"bytes_in_node": parts.hierarchy.bytes_in_node,
                        "rail_density": self.recorder.rail_densities.latest(),
                        "rail_collective_reductions": rail["reductions"] if rail is not None else 0})
        return out
