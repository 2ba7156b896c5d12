"""The collective engine with and without CUDA graphs inside the test pool's rank processes
(tests/test_graphs.py: graphs made by the CPU stand-in of tests/graph_double.py; tests/test_cuda_graphs.py:
CUDA graphs on a GPU).

Each rank runs two engines on the same ranks, each on a process group of its own: one with graphs,
one without, both through the kernel exchange (on the host its host build, tests/exchange_host.py;
on ``cuda`` the CUDA kernels, an NCCL group, each rank a host of its own on the one GPU). Every
case is a sequence of inputs of one shape reduced in turn by both engines, each into a buffer of its
own that stays put (a DDP bucket's): the steady state, then a denser input whose blocks overflow the
capacity the steady state set, then the steady state again. Per reduction the test gets both
results' bytes, the float64 reference's error, and both engines' counters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from tests.ddp_cases import process_group
from tests.engine_cases import inputs, nccl_group


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _engine(graphs: bool = False) -> Any:
    """An engine of the world's ranks; ``graphs``: made with ``OMNIREDUCE_CUDA_GRAPHS=1``."""
    import os

    from omnireduce.config import DEFAULT_LANES, DEFAULT_SLOTS
    from omnireduce.engines.collective import CollectiveEngine

    os.environ["OMNIREDUCE_CUDA_GRAPHS"] = "1" if graphs else "0"
    try:
        return CollectiveEngine.for_group(dist.group.WORLD, 30.0, 256, DEFAULT_LANES, DEFAULT_SLOTS)
    finally:
        os.environ.pop("OMNIREDUCE_CUDA_GRAPHS")


def sequence(rank: int, world: int, case: dict[str, Any]) -> list[torch.Tensor]:
    """This rank's inputs of ``case`` in turn: ``steady`` times the sparse input, once the dense one
    (``over``: its density), ``after`` times the sparse one again."""
    sparse = inputs(rank, world, case["numel"], case["density"], case["dtype"], seed=case["seed"],
                    ugly=case.get("ugly", False))
    dense = inputs(rank, world, case["numel"], case["over"], case["dtype"], seed=case["seed"] + 1)
    return [sparse] * case.get("steady", 4) + [dense] + [sparse] * case.get("after", 3)


def with_and_without(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], graphs_on: list[int],
                     fail: str | None = None, limit: int = 16, moved: bool = False,
                     device: str = "cpu") -> dict[str, Any]:
    """Every case through an engine with graphs (on the ranks ``graphs_on``: the others' engine has none,
    the same group) and one without; ``fail``: every capture fails so; ``limit``: graphs kept;
    ``moved``: the graphed engine's buffer moves once in the steady state (a new address). Also
    (``watched``) the aten ops every run of captured steps dispatched. ``device="cuda"``: real CUDA
    graphs (``fail``, ``limit`` and the watch are the stand-in's only)."""
    if device != "cpu":
        return _on_cuda(rank, world_size, port, cases, graphs_on, moved)
    from tests.engine_cases import Recorder
    from tests.graph_double import HostGraphs, host_kernels, install

    recorders: list[Recorder] = []

    def watch() -> Recorder:
        recorders.append(Recorder())
        return recorders[-1]

    logs: list[str] = []
    handler, logger = _ListHandler(logs), logging.getLogger("omnireduce.collective")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # (the pool's ranks log errors only)
    out: dict[str, Any] = {"cases": []}
    try:
        with process_group(rank, world_size, port), host_kernels():
            on, off = _engine(), _engine()
            backend = install(on, HostGraphs(fail=fail, watch=watch), limit=limit) if rank in graphs_on else None
            try:
                for case in cases:
                    out["cases"].append(_one_case(rank, world_size, case, on, off, moved))
                out["stats"] = {"on": dict(on.stats()), "off": dict(off.stats())}
            finally:
                for e in (on, off):
                    e.release()
            if backend is not None:
                out["graphs"] = [{"replays": g.replays, "released": g.released} for g in backend.graphs]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["logs"] = logs
    out["watched"] = [{"ops": sorted(set(r.ops)), "bool_indexed": r.bool_indexed} for r in recorders]
    return out


def _on_cuda(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], graphs_on: list[int],
             moved: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": [], "graphs": [], "logs": [], "watched": []}
    with nccl_group(rank, world_size, port):
        on, off = _engine(graphs=rank in graphs_on), _engine()
        try:
            for case in cases:
                out["cases"].append(_one_case(rank, world_size, case, on, off, moved, "cuda"))
            out["stats"] = {"on": dict(on.stats()), "off": dict(off.stats())}
        finally:
            for e in (on, off):
                e.release()
    return out


def _one_case(rank: int, world: int, case: dict[str, Any], on: Any, off: Any, moved: bool,
              device: str = "cpu") -> list[dict[str, Any]]:
    xs = sequence(rank, world, case)
    average = case.get("average", False)
    bufs = {"on": torch.empty_like(xs[0][rank], device=device), "off": torch.empty_like(xs[0][rank], device=device)}
    steps = []
    for i, x in enumerate(xs):
        if moved and i == 2:
            bufs["on"] = torch.empty_like(bufs["on"])
        row: dict[str, Any] = {}
        for name, engine in (("on", on), ("off", off)):
            before = dict(engine.stats())
            work = bufs[name]
            work.copy_(x[rank])
            fut = engine.allreduce_async(work, average=average)
            fut.wait()
            after = dict(engine.stats())
            row[name] = {"digest": _digest(work), "info": dataclasses.asdict(fut.info),
                         **{k: after[k] - before[k] for k in ("collectives", "host_waits", "fused", "overflows",
                                                               "graph_captures", "graph_replays", "graph_fallbacks",
                                                               "graph_failures", "bytes_sent", "kernel_reductions")}}
        want = sum(v.double() for v in x) / (world if average else 1)
        got = bufs["on"].double().cpu()
        finite = torch.isfinite(want)
        row["err"] = float((got - want)[finite].abs().max()) if finite.any() else 0.0
        row["scale"] = float(want[finite].abs().max()) if finite.any() else 0.0
        steps.append(row)
    return steps


class _ListHandler(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())
