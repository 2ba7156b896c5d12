"""What a bound state runs on: the value binding returns (:func:`omnireduce.ddp.binding.bind`).

A :class:`Runtime` holds what binding resolved or opened (the rank, the job, the worker, the
colocated aggregators, the collective engine, the hierarchy) and what ties them together for one
DDP model (the agreement, the router, the sparse COO batch). It takes a bucket from the hook, asks
the router for its way and hands it to that path (:meth:`Runtime.reduce`); the paths report to the
state's recorder. It is never pickled: an unpickled state binds again and gets a new one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnireduce.config import WorkerConfig
from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.options import COLLECTIVE, DENSE, OMNIREDUCE, UNCOMPRESSED, Options
from omnireduce.ddp.paths.aggregators import aggregators_allreduce
from omnireduce.ddp.paths.collective import collective_allreduce
from omnireduce.ddp.paths.compressed import compressed_allreduce, loss_scale
from omnireduce.ddp.paths.coo import CooBatch
from omnireduce.ddp.paths.dense import dense_allreduce
from omnireduce.ddp.paths.hierarchy import HierarchicalPath
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.residuals import Residuals
from omnireduce.ddp.router import COO, HIERARCHICAL, Route, Router

_ENGINES: dict[tuple[str, ...], str] = {(OMNIREDUCE,): "aggregators", (COLLECTIVE,): "collective"}


@dataclasses.dataclass(eq=False)
class Runtime:
    """One bound state's parts (see the module); made by :func:`omnireduce.ddp.binding.bind`."""

    options: Options
    process_group: Any  # the group DDP reduces over (None: the default group)
    rank: int
    world_size: int
    job: str
    recorder: Recorder
    sparse_paths: tuple[str, ...]  # the ways through omnireduce the path choice measures with the dense one
    worker: Any = None  # this rank's omnireduce.Worker (None: no aggregators, engine="collective")
    owns_worker: bool = True  # (False: the user's, not closed here)
    colocated: Any = None  # the job's own aggregators when this rank started them
    layout: WorkerConfig | None = None  # blocks, lanes, slots, threshold, timeout
    engine: Any = None  # the collective engine, where buckets may take it
    hierarchy: HierarchicalPath | None = None
    agreement: Agreement = dataclasses.field(default_factory=Agreement)
    router: Router | None = None
    coo: CooBatch | None = None
    residuals: Residuals | None = None  # the compressed buckets' error feedback (the state's, kept across binds)
    grad_scaler: Any = None  # the GradScaler whose scale the compressed buckets' gradients carry (the state's)

    def reduce(self, grad_bucket: Any, iteration: int) -> torch.futures.Future[torch.Tensor]:
        """Hand one DDP bucket to its path: the previous iteration's agreement applied at the first
        bucket, the way asked of the router, the future returned at once."""
        assert self.router is not None and self.coo is not None and self.layout is not None
        self.agreement.at_bucket(self.worker, iteration, self.router.choice)
        bucket = Bucket.of(grad_bucket, iteration, self.layout.block_size, self.options.align_blocks)
        route = self.router.route(bucket)
        if route.way == COO:
            return self.coo.add(bucket)
        self.coo.flush()  # the sparse buckets gathered so far go first (the same order on every rank)
        if route.compressed:
            assert self.residuals is not None
            through = route.way == HIERARCHICAL
            whole = (route.rail if through else route.way) == UNCOMPRESSED  # (every block, residual and all, dense)
            carrier = route if not whole else Route(HIERARCHICAL, rail=DENSE) if through else Route(DENSE)
            fut = compressed_allreduce(bucket.as_compressed(), grad_bucket.parameters(), self.residuals,
                                       self.process_group, self.world_size, self.recorder,
                                       lambda payload: self._start(carrier, payload), whole=whole,
                                       scale=loss_scale(self.grad_scaler) if self.grad_scaler is not None else None,
                                       step=iteration - self.residuals.options.warmup_steps)
        else:
            fut = self._start(route, bucket)
        return fut if route.trial is None else route.trial.watch(fut)

    def _start(self, route: Route, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        way, recorder, world = route.way, self.recorder, self.world_size
        if way == HIERARCHICAL:
            assert self.hierarchy is not None
            return self.hierarchy.reduce(bucket, self.agreement.usable, route.rail)
        if way == DENSE:
            return dense_allreduce(bucket, self.process_group, world, recorder, self.layout if route.measure else None)
        if way == COLLECTIVE:
            return collective_allreduce(bucket, self.engine, world, recorder)
        assert way == OMNIREDUCE, way
        return aggregators_allreduce(bucket, self.worker, world, recorder)

    def after_last_bucket(self, iteration: int, device: torch.device) -> None:
        """Start this iteration's agreement, once its last bucket is on its way (collective)."""
        assert self.router is not None
        self.agreement.after_last_bucket(self.worker, self.process_group, iteration, device, self.router.choice)

    def close(self, *, drain: bool = True) -> None:
        """Close what this runtime opened: the agreement in flight (waited for, with ``drain``), the
        hierarchy, the engine, the worker it made, then the colocated aggregators (once the other ranks'
        workers have left them, with ``drain``).
        Idempotent; the worker stays readable (closed)."""
        if drain:  # (nothing of ours left queued on the process group)
            self.agreement.settle(float(self.layout.timeout) if self.layout is not None else 30.0)
        else:
            self.agreement.release()
        hierarchy, engine, colocated = self.hierarchy, self.engine, self.colocated
        self.hierarchy = self.engine = self.colocated = None
        for part in (hierarchy, engine):
            if part is not None:
                part.close()
        if self.worker is not None and self.owns_worker:
            self.worker.close()
        if colocated is not None:
            colocated.close(drain=drain)

    def stats(self) -> dict[str, Any]:
        """The runtime's part of ``OmniReduceState.stats()``."""
        engine, worker, hierarchy = self.engine, self.worker, self.hierarchy
        out: dict[str, Any] = {
            "engine": _ENGINES.get(self.sparse_paths, "measured"),
            "collective_reductions": engine.stats()["reductions"] if engine is not None else 0,
            "aggregators_in_use": worker.aggregators_in_use() if worker is not None else [],
            "hierarchical": hierarchy is not None,
            # whether dense buckets go through the hierarchy: "on" (all), "off", or "measured" (per bucket, stats paths)
            "hierarchy": "off" if hierarchy is None else "measured" if self.router and self.router.layouts else "on",
        }
        if hierarchy is not None:
            out.update(hierarchy.stats())
        if self.router is not None:
            choice = self.router.choice
            out.update(paths=choice.stats(), iterations_measuring=choice.iterations_measuring,
                       step_checks=choice.check_stats())
        return out
