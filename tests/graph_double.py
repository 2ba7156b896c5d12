"""A stand-in for CUDA graphs on CPU tensors, so that the collective engine's graph path
(:mod:`omnireduce.engines.graphs`) runs on machines without a GPU.

:class:`HostGraphs` is a :class:`~omnireduce.engines.graphs.GraphBackend`: a capture runs the
captured steps once (as a CUDA capture followed by its first replay does) and keeps them; a replay
runs them again and copies every buffer they return into the buffers the capture returned, so the
host finds the results where a graph leaves them, in the graph's own buffers. Nothing a replay
computes reaches the host any other way. The steps themselves are the engine's: the kernel exchange's
calls through :class:`tests.exchange_host.HostKernels` (the CUDA kernels' per-item steps, the guarded
sum's included, compiled for the host) and the real collectives of the rank's Gloo group. What it
cannot show is CUDA's side: that the steps capture (no host read, no allocation outside the graph's
pool, NCCL inside a graph), and the time saved; the GPU check does (``gpu_nccl_check.py graphs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omnireduce.engines.graphs import Graphs, Statics

_BUFFERS = ("own_prefix", "gathered", "bits", "prefix", "counts")


@dataclasses.dataclass
class Recorded:
    """A captured reduction: its steps and the buffers its capture left."""

    run: Callable[[torch.Tensor], Statics]
    statics: Statics
    address: int
    replays: int = 0
    released: bool = False


class HostGraphs:
    """CUDA graphs' stand-in on CPU tensors (see the module). ``fail``: every capture raises this
    (a capture that fails); ``watch``: a context manager entered around every run of captured steps."""

    device_type = "cpu"

    def __init__(self, fail: str | None = None, watch: Callable[[], Any] | None = None) -> None:
        self.fail, self.watch = fail, watch
        self.graphs: list[Recorded] = []

    def host_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64)

    def capture(self, run: Callable[[torch.Tensor], Statics], flat: torch.Tensor) -> tuple[Recorded, Statics]:
        if self.fail is not None:
            raise RuntimeError(self.fail)
        with self.watch() if self.watch is not None else contextlib.nullcontext():
            statics = run(flat)
        graph = Recorded(run, statics, flat.data_ptr())
        self.graphs.append(graph)
        return graph, statics

    def replay(self, handle: Recorded, flat: torch.Tensor) -> None:
        assert not handle.released, "a released graph replayed"
        assert flat.data_ptr() == handle.address, "a graph replayed on memory it was not captured on"
        with self.watch() if self.watch is not None else contextlib.nullcontext():
            fresh = handle.run(flat)
        for name in _BUFFERS:
            mine, new = getattr(handle.statics, name), getattr(fresh, name)
            if new is not mine:  # (a buffer the steps made anew: into the graph's own, as a replay leaves it)
                mine.copy_(new)
        assert (fresh.sent, fresh.collectives) == (handle.statics.sent, handle.statics.collectives)
        handle.replays += 1

    def wait(self, device: torch.device, timeout: float | None) -> None:
        pass  # (the host's steps are done when they return)

    def release(self, handle: Recorded) -> None:
        handle.released = True


def install(engine: Any, backend: HostGraphs | None = None, limit: int = 16) -> HostGraphs:
    """Give ``engine`` (a :class:`~omnireduce.engines.collective.CollectiveEngine`, before its first
    reduction) graphs made by ``backend`` (a new :class:`HostGraphs`); returns the backend."""
    backend = backend if backend is not None else HostGraphs()
    engine._graphs = Graphs(engine.group, engine.rank, engine.world_size, engine.timeout, engine._workspace,
                            engine.threshold, backend=backend, limit=limit)
    return backend


@contextlib.contextmanager
def host_kernels() -> Iterator[Any]:
    """Every engine's kernel exchange through :class:`tests.exchange_host.HostKernels` (what a CUDA
    bucket takes, with ``OMNIREDUCE_ENGINE_KERNELS=1``), for as long as the context lasts."""
    from omnireduce.engines import exchange_kernels
    from tests.exchange_host import HostKernels

    kernels, real = HostKernels(), exchange_kernels.kernels_for
    exchange_kernels.kernels_for = lambda flat, threshold, world: None if threshold > 0 else kernels
    try:
        yield kernels
    finally:
        exchange_kernels.kernels_for = real
