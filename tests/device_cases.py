"""DDP runs on the device path, executed inside the test pool's rank processes.

``density_types`` runs on CPU tensors with ``OMNIREDUCE_DEVICE_PATH=1`` (tests/test_device_path.py);
``device_ddp`` runs on ``cuda:0`` for every rank of the pool (tests/test_cuda_path.py), or on CPU
tensors down the device path (its configs without CUDA-only keys). The process group is Gloo.
Each returns plain data for the test to judge.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from omnireduce.compression import BlockTopK
from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def density_types(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """An embedding bucket whose union density alternates across dense_threshold (as in
    ddp_cases.dense_both_ways): after every step, the type of each stored density (what the next
    decision reads) and the path taken; parameters against plain DDP."""
    from omnireduce.sources.adapt import adapt
    from omnireduce.sources.device import DeviceSource

    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = nn.EmbeddingBag(2000, 16, mode="sum")
        ref = DistributedDataParallel(copy.deepcopy(base))
        mine = DistributedDataParallel(copy.deepcopy(base))
        state = OmniReduceState(aggregators=[aggregator], dense_threshold=0.5, block_size=64)
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
        g = torch.Generator().manual_seed(rank)
        paths, types, ok = [], [], []
        for step in range(6):
            n = 1900 if step % 2 == 0 else 3
            idx = torch.randperm(2000, generator=g)[:n].view(1, n)
            before = state.stats()["buckets_dense"]
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                m(idx).pow(2).sum().backward()
                o.step()
            paths.append("dense" if state.stats()["buckets_dense"] > before else "sparse")
            types += [type(v).__name__ for v in state.recorder.densities.stored()]
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        stats = state.stats()
        state.close()  # (its worker, once the last agreement finished on every rank)
        return {"paths": paths, "types": types, "ok": ok, "dense": stats["buckets_dense"],
                "sparse": stats["buckets_sparse"], "device_path": isinstance(adapt(torch.zeros(4)), DeviceSource)}


# -- CUDA -----------------------------------------------------------------------------------------


class _Slow(torch.autograd.Function):
    """Identity whose backward first keeps the current (producer) stream busy for ``cycles``: the
    gradients of the layers before it are produced late on the device, after their hooks ran."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.cycles:
            torch.cuda._sleep(ctx.cycles)
        return grad * 1, None


class CudaNet(nn.Module):
    """An embedding (sparse gradients) under an MLP, with an optional slow point between them."""

    def __init__(self, slow: int = 0) -> None:
        super().__init__()
        self.slow = slow
        self.emb = nn.EmbeddingBag(20000, 16, mode="mean")  # (bags of thousands of rows stay small)
        self.mlp = nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(_Slow.apply(self.emb(idx), self.slow))


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
                      for p in model.parameters()])


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


@contextlib.contextmanager
def _delayed_scatter(cycles: int):
    """Every scatter of the sums into a tensor starts ``cycles`` late on omnireduce's side stream."""
    from omnireduce.cuda import ops as cuda_ops

    real = cuda_ops.scatter

    def delayed(*args: Any, **kwargs: Any) -> None:
        torch.cuda._sleep(cycles)  # on the current stream: the side stream
        real(*args, **kwargs)

    cuda_ops.scatter = delayed
    try:
        yield
    finally:
        cuda_ops.scatter = real


@contextlib.contextmanager
def _sync_warnings(found: list[dict]):
    """torch's sync debug mode set to warn; each warning raised from a file of omnireduce on a
    thread that is not omnireduce's own (its I/O, compaction and optimizer threads may wait for the
    device; the training and autograd threads must not) is added to ``found``."""
    import omnireduce
    import omnireduce.worker

    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (omnireduce, omnireduce.worker))
    previous = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        thread = threading.current_thread().name
        if filename.startswith(roots) and not thread.startswith("omnireduce-"):
            found.append({"message": str(message), "where": f"{filename}:{lineno}", "thread": thread})

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            warnings.showwarning = previous


def device_ddp(rank: int, world_size: int, port: int, aggregator: str, configs: list[dict[str, Any]],
               device: str = "cuda:0") -> list[dict]:
    """For each config: DDP on ``device`` with omnireduce_hook (or fuse_optimizer around it), SGD,
    against a reference computed from the same model without DDP: each rank's local gradients,
    averaged over the ranks in float64 through the process group, and the same SGD update. After
    every step: the reduced gradients and the parameters, compared with the reference.

    Config keys: ``dtype`` (float32/float16/bfloat16: the model's, hence the buckets'), ``fused``,
    ``bucket_view`` (gradient_as_bucket_view), ``dense_threshold`` (dense fallback on, else off),
    ``alternate`` (batches touching most, then few embedding rows, so that the union density
    crosses the threshold both ways), ``steps``, ``compression`` (a BlockTopK density, no warm-up;
    with ``lossy`` the comparison with the reference is left out: below density 1 it differs); CUDA
    only: ``slow`` (cycles the producer stream
    sleeps in the middle of backward), ``delay_scatter`` (cycles every scatter waits on the side
    stream), ``sync_debug`` (the last step under torch's sync debug mode). ``dense`` counts the
    buckets that took the dense path at each step (the same on every rank, or the ranks would hang)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    out = []
    with process_group(rank, world_size, port):
        for n, cfg in enumerate(configs):
            dtype = getattr(torch, cfg.get("dtype", "float32"))
            torch.manual_seed(1234 + n)
            base = CudaNet(slow=int(cfg.get("slow", 0))).to(device=dev, dtype=dtype)
            ref = copy.deepcopy(base)
            mine = DistributedDataParallel(copy.deepcopy(base), device_ids=[dev.index] if cuda else None,
                                           bucket_cap_mb=0.02,
                                           gradient_as_bucket_view=cfg.get("bucket_view", False))
            lr = 0.1
            opt = torch.optim.SGD(mine.parameters(), lr=lr)
            dense = "dense_threshold" in cfg or "path" in cfg
            state = OmniReduceState(aggregators=[aggregator], timeout=60, block_size=64, dense_fallback=dense,
                                    dense_threshold=cfg.get("dense_threshold", 0.6), path=cfg.get("path"),
                                    measure_trials=cfg.get("measure_trials", 3),
                                    remeasure_every=cfg.get("remeasure_every"),
                                    engine=cfg.get("engine", "auto"),
                                    compression=BlockTopK(density=cfg["compression"], block_size=64, warmup_steps=0)
                                    if "compression" in cfg else None)
            fused = bool(cfg.get("fused"))
            mine.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt) if fused else omnireduce_hook)
            g = torch.Generator().manual_seed(100 * n + rank)
            steps = int(cfg.get("steps", 5))
            grads_ok, params_ok, dense_steps, found = [], [], [], []
            delayed = cfg.get("delay_scatter")
            with _delayed_scatter(int(delayed)) if delayed else contextlib.nullcontext():
                for step in range(steps):
                    rows = 19000 if cfg.get("alternate") and step % 2 == 0 else 40
                    idx = torch.randint(0, 20000, (8, max(1, rows // 8)), generator=g).to(dev)
                    y = torch.randn(8, 4, generator=g).to(device=dev, dtype=dtype)
                    # the reference: local gradients, averaged in float64, the same SGD update
                    for p in ref.parameters():
                        p.grad = None
                    ((ref(idx) - y) ** 2).mean().backward()
                    want = _grads(ref)
                    dist.all_reduce(want)
                    want /= world_size
                    with torch.no_grad():
                        at = 0
                        for p in ref.parameters():
                            p.add_(want[at: at + p.numel()].view_as(p).to(device=dev, dtype=dtype), alpha=-lr)
                            at += p.numel()
                    before = state.stats()["buckets_dense"]
                    opt.zero_grad()
                    last = cfg.get("sync_debug") and step == steps - 1
                    if last:
                        synchronize()
                    with _sync_warnings(found) if last else contextlib.nullcontext():
                        ((mine(idx) - y) ** 2).mean().backward()
                        if not fused:
                            opt.step()
                    synchronize()
                    dense_steps.append(state.stats()["buckets_dense"] - before)
                    got = _grads(mine.module)
                    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # (half types: a few ulps)
                    scale = want.abs().max().item()
                    grads_ok.append(bool(torch.allclose(got, want, rtol=rtol, atol=rtol * scale)))
                    params_ok.append(bool(torch.allclose(_params(mine.module), _params(ref), rtol=2.5 * rtol,
                                                         atol=rtol * 1e-1)))
            densities = state.recorder.densities.stored()
            stored = [type(v).__name__ for v in densities]
            pinned = [bool(v.host.is_pinned()) and not v.host.is_cuda for v in densities if hasattr(v, "host")]
            stats = state.stats()
            state.close()  # (engine="collective" has no worker: no aggregators)
            out.append({"config": cfg, "grads_ok": grads_ok, "params_ok": params_ok, "dense": dense_steps,
                        "sync_warnings": found, "stored": stored, "pinned": pinned,
                        "stats": {k: v for k, v in stats.items() if k != "density"}})
            time.sleep(0.1)
    return out


def check_device_ddp(results: list[list[dict]]) -> None:
    """Judge :func:`device_ddp`'s results (one list of per-config results per rank)."""
    for rank, per_config in enumerate(results):
        for r in per_config:
            cfg = r["config"]
            if not cfg.get("lossy"):
                assert all(r["grads_ok"]), f"rank {rank} {cfg}: reduced gradients differ from the reference: {r}"
                assert all(r["params_ok"]), f"rank {rank} {cfg}: parameters differ from the reference: {r}"
            assert r["stats"]["buckets_failed"] == 0 and r["stats"]["buckets_sparse"] > 0, (cfg, r["stats"])
            assert not r["sync_warnings"], f"rank {rank} {cfg}: host-device syncs: {r['sync_warnings']}"
    for per_config in zip(*results, strict=True):
        assert len({tuple(r["dense"]) for r in per_config}) == 1, [r["dense"] for r in per_config]
