"""The collective engine inside the test pool's rank processes (see tests/test_collective.py).

Each rank reduces the same inputs twice, through the aggregators (:class:`omnireduce.Worker`) and
through :class:`omnireduce.engines.collective.CollectiveEngine` on a real Gloo process group, and returns
both results' bytes for the test to compare with each other and with a float64 reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import omnireduce
from omnireduce.engines.collective import CollectiveEngine
from tests.ddp_cases import process_group
from tests.harness import Case, make_input, to_bits, to_numpy


def both_engines(rank: int, world_size: int, port: int, aggregator: str, job: str, cases: list[Case],
                 average: bool, threshold: float = 0.0, slots: int = 4, device: str = "cpu",
                 options: dict[str, Any] | None = None, repeat: int = 1,
                 host_kernels: bool = False, parts: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """``device``: where the inputs are (``cuda:0``: every rank's tensors on that GPU, Gloo between them);
    ``options``: the engine's (``exchange``, ``order``); ``repeat``: each case reduced that many times
    through the engine (the later ones may fuse the bitmap with the blocks), every result kept;
    ``host_kernels``: the engine's device path takes the kernel exchange, its steps run on the host
    (tests/exchange_host.py), where a CUDA bucket would take the CUDA kernels; ``parts``: from how many
    bytes and in how many parts a host ``gather`` goes (:mod:`omnireduce.engines.host_exchange`) for this
    call."""
    from omnireduce.engines import exchange_kernels, host_exchange

    real, real_parts = exchange_kernels.kernels_for, (host_exchange.PARTS_FROM, host_exchange.PARTS)
    if parts is not None:
        host_exchange.PARTS_FROM, host_exchange.PARTS = parts
    if host_kernels:  # (for this call only: the rank process serves other tests after it)
        from tests.exchange_host import HostKernels

        kernels = HostKernels()
        exchange_kernels.kernels_for = lambda flat, threshold, world: None if threshold > 0 else kernels
    try:
        return _both_engines(rank, world_size, port, aggregator, job, cases, average, threshold, slots, device,
                             options, repeat)
    finally:
        exchange_kernels.kernels_for = real
        host_exchange.PARTS_FROM, host_exchange.PARTS = real_parts


def _both_engines(rank: int, world_size: int, port: int, aggregator: str, job: str, cases: list[Case],
                  average: bool, threshold: float, slots: int, device: str, options: dict[str, Any] | None,
                  repeat: int) -> list[dict[str, Any]]:
    out = []
    with process_group(rank, world_size, port), \
            omnireduce.Worker([aggregator], rank=rank, world_size=world_size, job=job, timeout=30, slots=slots,
                              threshold=threshold) as w:
        engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, w.config.block_size, w.config.lanes, slots,
                                            threshold, **(options or {}))
        try:
            for case in cases:
                a = make_input(case, rank)
                if device != "cpu":
                    a = torch.as_tensor(a).to(device)
                w.allreduce(a, average=average)
                if device != "cpu":
                    torch.cuda.synchronize()
                    a = a.cpu()
                for _ in range(repeat):
                    b = make_input(case, rank)
                    b = torch.as_tensor(b).to(device) if device != "cpu" else \
                        b if isinstance(b, torch.Tensor) else torch.from_numpy(b)
                    fut = engine.allreduce_async(b, average=average)
                    fut.wait()
                    info = dataclasses.asdict(fut.info)  # (a ReductionInfo)
                    if device != "cpu":
                        torch.cuda.synchronize()
                        b = b.cpu()
                    out.append({"aggregators": to_bits(a), "collective": to_bits(b), "values": to_numpy(b),
                                "aggregators_values": to_numpy(a), "info": info})
            out.append({"stats": engine.stats()})
        finally:
            engine.close()
    return out


def sparse_both_engines(rank: int, world_size: int, port: int, aggregator: str, job: str,
                        specs: list[dict[str, Any]], average: bool) -> list[dict[str, Any]]:
    """Sparse COO tensors (rows with duplicates, fresh per rank) through both engines: each result's
    indices and value bytes."""
    out = []
    with process_group(rank, world_size, port), \
            omnireduce.Worker([aggregator], rank=rank, world_size=world_size, job=job, timeout=30) as w:
        cfg = w.config
        engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, cfg.block_size, cfg.lanes, cfg.slots)
        try:
            for n, spec in enumerate(specs):
                g = torch.Generator().manual_seed(1000 * n + rank)
                rows, dim, nnz = spec["rows"], spec["dim"], spec["nnz"] if rank % 2 == 0 else spec["nnz"] // 3
                idx = torch.randint(0, rows, (1, nnz), generator=g)
                dtype = getattr(torch, spec.get("dtype", "float32"))
                vals = torch.randn(nnz, dim, generator=g).to(dtype)
                x = torch.sparse_coo_tensor(idx, vals, (rows, dim))
                a = w.allreduce(x, average=average)
                fut = engine.allreduce_async(x, average=average)
                b = fut.wait()
                bits = [t._values().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (a, b)]
                dense = x.to_dense().to(torch.float64)
                out.append({"same_indices": bool(torch.equal(a._indices(), b._indices())), "bits": bits,
                            "coalesced": b.is_coalesced(), "shape": tuple(b.shape), "dtype": str(b.dtype),
                            "values": b.to_dense().to(torch.float64).numpy(), "mine": dense.numpy(),
                            "info": dataclasses.asdict(fut.info)})
            out.append({"stats": engine.stats()})
        finally:
            engine.close()
    return out


def shared_block(rank: int, world_size: int, port: int, numel: int, block: int, steps: int,
                 latency_bytes: int | None) -> dict[str, Any]:
    """The same one block non-zero on every rank (fresh values per rank and step), ``steps`` times
    through one engine: every result, the float64 sums of every rank's inputs, and the engine's stats."""
    results, wants = [], []
    with process_group(rank, world_size, port):
        engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, block, 1024, world_size,
                                            latency_bytes=latency_bytes)
        try:
            for step in range(steps):
                every = []
                for r in range(world_size):
                    g = torch.Generator().manual_seed(7919 * step + r)
                    x = torch.zeros(numel)
                    x[3 * block: 4 * block] = torch.randn(block, generator=g)
                    every.append(x)
                wants.append(torch.stack(every).double().sum(0).numpy())
                results.append(engine.allreduce_async(every[rank].clone()).wait().double().numpy())
            stats = engine.stats()
        finally:
            engine.release()
    return {"results": results, "wants": wants, "stats": stats}


def waiting_styles(rank: int, world_size: int, port: int, seed: int, rounds: int) -> dict[str, Any]:
    """Each round three reductions of fresh random tensors (sizes off the block grid, float32 and
    bfloat16, one summed and two averaged): even ranks wait for each as soon as it is asked for (it
    runs on their thread), odd ranks ask for all three and then wait (the engine's thread runs
    them). Every result and every rank's input, for the test's float64 reference."""
    out: list[dict[str, Any]] = []
    with process_group(rank, world_size, port):
        engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, 256, 1024, world_size)
        try:
            for step in range(rounds):
                inputs = []
                for i, (numel, dtype, average) in enumerate(((70_001, torch.float32, False),
                                                             (4_097, torch.bfloat16, True),
                                                             (300_000, torch.float32, True))):
                    every = []
                    for r in range(world_size):
                        g = torch.Generator().manual_seed(seed + 1000 * step + 100 * i + r)
                        x = torch.zeros(numel)
                        for b in torch.randperm(-(-numel // 256), generator=g)[: 1 + step % 5].tolist():
                            x[b * 256:(b + 1) * 256] = torch.randn(len(x[b * 256:(b + 1) * 256]), generator=g)
                        every.append(x.to(dtype))
                    inputs.append((every, average))
                if rank % 2 == 0:
                    got = [engine.allreduce_async(e[rank].clone(), average=a).wait() for e, a in inputs]
                else:
                    futs = [engine.allreduce_async(e[rank].clone(), average=a) for e, a in inputs]
                    got = [f.wait() for f in futs]
                for (every, average), g in zip(inputs, got, strict=True):
                    out.append({"got": g.double().numpy(), "every": [e.double().numpy() for e in every],
                                "average": average, "dtype": str(every[0].dtype)})
            stats = engine.stats()
        finally:
            engine.release()
    return {"results": out, "stats": stats}
