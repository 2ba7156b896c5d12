"""What a bound state runs on: the value binding returns (:func:`omnireduce.ddp.binding.bind`), whole.

A :class:`Runtime` is built in one call, frozen: the rank, the job, the blocks' configuration, the
agreement, the router (which holds every reducer the buckets may take) and the sparse COO batch, and
the :class:`Parts` binding opened (the worker, the colocated aggregators, the engines, the
hierarchy), which it closes. For each bucket it asks the router for the route and executes it
(:meth:`Runtime.reduce_bucket`): the route's reducer reduces the bucket, the reducer's info goes to the
state's recorder, and the future DDP gets completes with the bucket's tensor. It decides nothing.
It is never pickled: an unpickled state binds again and gets a new one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from omnireduce.config import WorkerConfig
from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.options import Options, engine_name
from omnireduce.ddp.paths.coo import CooBatch
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.router import Route, Router
from omnireduce.engines.hierarchy import Hierarchy
from omnireduce.engines.reducer import Engine, Reduction
from omnireduce.launch.colocate import Colocated
from omnireduce.worker import Worker

log = logging.getLogger("omnireduce.ddp")


class Parts:
    """What binding opened for one state, closed once, in order: the hierarchy's step threads, the
    engines and rail workers (``engines``, in the order made), the worker this rank made (not the
    user's), then the colocated aggregators. ``engine``: the flat collective engine, where there is one
    (its reductions are counted in ``stats()``); ``rail_engine``: this rank's rail's."""

    def __init__(self, worker: Worker | None = None, owns_worker: bool = True) -> None:
        self.worker, self.owns_worker = worker, owns_worker  # this rank's omnireduce.Worker (None: no aggregators)
        self.colocated: Colocated | None = None  # the job's own aggregators when this rank started them
        self.hierarchy: Hierarchy | None = None
        self.engines: list[Engine | Worker] = []
        self.engine: Any = None  # (an engine's stats() counts its reductions)
        self.rail_engine: Any = None
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


@dataclasses.dataclass(frozen=True, eq=False)
class Runtime:
    """One bound state's parts (see the module); made by :func:`omnireduce.ddp.binding.bind`."""

    options: Options
    process_group: Any  # the group DDP reduces over (None: the default group)
    rank: int
    world_size: int
    job: str
    config: WorkerConfig  # the blocks: size, lanes, slots, threshold; the timeout
    recorder: Recorder
    agreement: Agreement
    router: Router
    coo: CooBatch
    parts: Parts

    @property
    def worker(self) -> Worker | None:
        """This rank's omnireduce.Worker (None: no aggregators)."""
        return self.parts.worker

    @property
    def colocated(self) -> Colocated | None:
        return self.parts.colocated

    def reduce(self, grad_bucket: Any, iteration: int) -> torch.futures.Future[torch.Tensor]:
        """Hand one DDP bucket to its route (:meth:`reduce_bucket`)."""
        return self.reduce_bucket(Bucket.of(grad_bucket, iteration, self.config.block_size, self.options.align_blocks))

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        """Average ``bucket`` over the ranks (sum it, where it says so: :attr:`Bucket.average`), as its
        route says: the previous iteration's agreement applied at the iteration's first bucket, the
        route asked of the router and executed, the future returned at once (its :attr:`Reduction.path`
        names the route's way). Every rank hands over the same buckets in the same order; a DDP
        bucket is :meth:`Bucket.of` one, any other tensor :meth:`Bucket.of_tensor` one (then call
        :meth:`after_last_bucket` after each iteration's last, as the hook does)."""
        self.agreement.at_bucket(self.worker, bucket.iteration, self.router.choice)
        return self._execute(bucket, self.router.route(bucket))

    def _execute(self, bucket: Bucket, route: Route) -> Reduction:
        """Reduce ``bucket`` (averaged, or summed) as ``route`` says; the future completes with its tensor once
        the reduction is recorded, or fails with the recorder's error naming the bucket."""
        if route.batched:
            return self.coo.add(bucket, route.reducer)
        self.coo.flush()  # the sparse buckets gathered so far go first (the same order on every rank)
        reduction = route.reducer.allreduce_async(bucket.buffer, average=bucket.average, block_size=bucket.block_size)
        out = Reduction(bucket.buffer)
        out.path = route.path
        key = bucket.as_compressed().key if route.compressed else bucket.key
        nbytes = 0 if bucket.coo else bucket.nbytes

        def recorded(f: torch.futures.Future[Any]) -> None:
            try:
                result = f.value()
                self.recorder.reduced(key, reduction.info, nbytes=nbytes, world_size=self.world_size,
                                      rails=route.path.hierarchical)
                out.complete(result, reduction.info)
            except BaseException as e:
                out.fail(self.recorder.failure(e, bucket.iteration, bucket.index))

        reduction.add_done_callback(recorded)
        if route.trial is not None:
            route.trial.watch(out)
        return out

    def after_last_bucket(self, iteration: int, device: torch.device) -> None:
        """Start this iteration's agreement, once its last bucket is on its way (collective)."""
        self.agreement.after_last_bucket(self.worker, self.process_group, iteration, device, self.router.choice)

    def close(self, *, drain: bool = True) -> None:
        """Close what this runtime opened: the agreement in flight (waited for, with ``drain``), then
        its :class:`Parts` (the colocated aggregators once the other ranks' workers have left them,
        with ``drain``). Idempotent; the worker stays readable (closed)."""
        if drain:  # (nothing of ours left queued on the process group)
            self.agreement.settle(float(self.config.timeout))
        else:
            self.agreement.release()
        self.parts.close(drain=drain)

    def stats(self) -> dict[str, Any]:
        """The runtime's part of ``OmniReduceState.stats()``."""
        parts, router = self.parts, self.router
        out: dict[str, Any] = {
            "engine": engine_name(router.ways.sparse),
            "collective_reductions": parts.engine.stats()["reductions"] if parts.engine is not None else 0,
            "collective_exchanges": parts.engine.stats().get("exchanges", {}) if parts.engine is not None else {},
            "collective_kernel_reductions": parts.engine.stats().get("kernel_reductions", 0)
            if parts.engine is not None else 0,
            "aggregators_in_use": parts.worker.aggregators_in_use() if parts.worker is not None else [],
            "hierarchical": parts.hierarchy is not None,
            # whether dense buckets go through the hierarchy: "on" (all), "off", or "measured" (per bucket, stats paths)
            "hierarchy": "off" if parts.hierarchy is None else "on" if router.hierarchical else "measured",
        }
        if parts.hierarchy is not None:
            rail = parts.rail_engine
            out.update(bytes_in_node=parts.hierarchy.bytes_in_node, rail_density=self.recorder.rail_densities.latest(),
                       rail_collective_reductions=rail.stats()["reductions"] if rail is not None else 0)
        choice = router.choice
        out.update(paths=choice.stats(), iterations_measuring=choice.iterations_measuring,
                   step_checks=choice.check_stats())
        return out
