"""The collective engine's dense exchanges inside the test pool's rank processes (tests/test_engine_exchange.py).

Each rank runs :func:`omnireduce.engines.exchange_device.reduce` on CPU tensors on the calling
thread, under a ``TorchDispatchMode`` that records every aten op the reduction dispatches, and with
the host's reads of the device counted: the test then checks that nothing but the one read of the
counts would make a CUDA host wait (no ``nonzero``, no ``.item()``, no boolean indexing), and that
the sums equal a float64 reference made from every rank's inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ddp_cases import process_group

#: aten ops whose CUDA kernels make the host wait for the device (their output's size, or a value).
SYNCING = ("nonzero", "masked_select", "_local_scalar_dense", "item", "unique", "_unique", "is_nonzero", "equal",
           "masked_scatter", "repeat_interleave", "bincount", "histc", "allclose")


class Recorder(TorchDispatchMode):
    """Every aten op dispatched, and those that index with a bool tensor (a hidden ``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.bool_indexed: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.bool_indexed.append(name)
        return func(*args, **(kwargs or {}))


def inputs(rank: int, world: int, numel: int, density: float, dtype: str, seed: int,
           ugly: bool = False) -> list[torch.Tensor]:
    """Every rank's input (made on every rank, so that each can compute the reference); ``ugly``: with
    a NaN (rank 0), an Inf (the last rank), -0.0 in a block of zeros and among non-zero values."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 101 + r)
        nb = -(-numel // 256)
        keep = torch.rand(nb, generator=g) < density
        x = (torch.randn(nb, 256, generator=g) * keep[:, None]).reshape(-1)[:numel]
        if ugly:
            x[:256] = -0.0  # (a block of -0.0: zero, never sent)
            x[257:260] = torch.tensor([-0.0, 1.5, -0.0])
            if r == 0:
                x[1000] = float("nan")
            if r == world - 1:
                x[-1] = float("inf")
        out.append(x.to(getattr(torch, dtype)).contiguous())
    return out


@contextlib.contextmanager
def nccl_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """An NCCL group of ``world_size`` ranks on cuda:0, each rank a host of its own (NCCL's sockets on
    loopback carry the bytes)."""
    os.environ.update(NCCL_HOSTID=f"host{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dispatched(rank: int, world_size: int, port: int, cases: list[dict[str, Any]],
               device: str = "cpu") -> list[dict[str, Any]]:
    """Per case (``numel``, ``density``, ``dtype``, ``exchange``, ``fused``/``capacity``, ``average``,
    ``threshold``, ``in_place``: a float32 bucket's sums in place, the default; ``kernels``: the
    kernel exchange, its steps run on the host, or on ``cuda`` the CUDA extension's; ``"numpy"``: the
    host's numpy kernels; ``"host"``: the host exchange): the ops seen,
    the bool-indexed ones, the host reads, the max error against float64, a digest of the result's
    bytes. ``device="cuda"``: every tensor on cuda:0 and an NCCL group, each rank a host of its own
    (several ranks share the one GPU through NCCL's sockets on loopback)."""
    from omnireduce.cuda import build
    from omnireduce.engines import exchange_device, exchange_kernels
    from omnireduce.engines.host_exchange import HostExchange
    from omnireduce.engines.numpy_kernels import NumpyKernels
    from omnireduce.engines.plan import Exchange, Step
    from omnireduce.engines.workspace import Workspace
    from tests.exchange_host import HostKernels

    reads = []
    real = exchange_device.read_counts

    def counted(t: torch.Tensor, timeout: float | None, what: str) -> tuple[list[int], float]:
        reads.append(what)
        return real(t, timeout, what)

    exchange_device.read_counts = exchange_kernels.read_counts = counted
    out = []
    try:
        with (process_group(rank, world_size, port) if device == "cpu" else nccl_group(rank, world_size, port)):
            for i, case in enumerate(cases):
                xs = inputs(rank, world_size, case["numel"], case["density"], case["dtype"], seed=case.get("seed", i),
                            ugly=case.get("ugly", False))
                work = xs[rank].clone().to(device)
                step = Step(True, case["capacity"]) if case.get("capacity") is not None else Step(False)
                exchange = Exchange(case["exchange"])
                reads.clear()
                exchange_device.IN_PLACE_ON_HOST = case.get("in_place", True)
                common = dict(group=dist.group.WORLD, rank=rank, world=world_size, average=case.get("average", False),
                              step=step, decide=lambda c, e=exchange: e, total_lanes=64,
                              pairs=exchange is Exchange.OWNERS, timeout=30.0)
                with Recorder() as rec:
                    if case.get("kernels") == "host":  # the host exchange (the engine's way for CPU tensors)
                        outcome = HostExchange(dist.group.WORLD, rank, world_size, Workspace()).reduce(
                            work, 256, average=common["average"], step=step, decide=common["decide"],
                            total_lanes=64, pairs=common["pairs"])
                    elif case.get("kernels"):  # the kernel exchange: its steps on the host or the GPU, or numpy's
                        kernels = NumpyKernels() if case["kernels"] == "numpy" else \
                            build.extension_for(work) if device == "cuda" else HostKernels()
                        outcome = exchange_kernels.reduce(work, 256, kernels=kernels,
                                                          workspace=Workspace(), **common)
                    else:
                        outcome = exchange_device.reduce(work, 256, threshold=case.get("threshold", 0.0), **common)
                want = sum(x.double() for x in xs) / (world_size if case.get("average") else 1)
                work = work.cpu()
                got = work.double()
                finite = torch.isfinite(want)
                err = float((got - want)[finite].abs().max()) if finite.any() else 0.0
                scale = float(sum(x.double().abs() for x in xs)[finite].max()) if finite.any() else 0.0
                same_specials = bool(torch.equal(torch.isnan(got), torch.isnan(want))
                                     and torch.equal(got[torch.isinf(want)], want[torch.isinf(want)]))
                out.append({"ops": sorted(set(rec.ops)), "bool_indexed": rec.bool_indexed, "reads": list(reads),
                            "err": err, "scale": scale, "exchange": outcome.exchange.value,
                            "overflow": outcome.overflow, "collectives": outcome.collectives,
                            "counts": repr(outcome.counts),
                            "finite": bool(np.isfinite(work.double().numpy()).all()), "specials": same_specials,
                            "digest": _digest(work),
                            "digest_nan": _digest(torch.where(torch.isnan(work), torch.full_like(work, float("nan")),
                                                              work))})
    finally:
        exchange_device.read_counts = exchange_kernels.read_counts = real
        exchange_device.IN_PLACE_ON_HOST = True
    return out


def _digest(t: torch.Tensor) -> str:
    """A CPU tensor's bytes, hashed."""
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
