"""The rank side of scripts/gpu_nccl_check.py: what each rank process of the NCCL checks runs.

Design. ``gpu_nccl_check.py rank CASE OUT_DIR ARGS_JSON`` starts one rank (under the check's own
launcher or torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` are set), which
:func:`rank_main` sets up (its NCCL environment, ``cuda:0``, the process group), hands to the case
named, writes the case's result to ``OUT_DIR/rankR.json``, tears the process group down and says how
long that took in ``OUT_DIR/rankR.end.json`` (no file: it hung or died there). Every case runs on
``--backend gloo --device cpu`` too, which is how they are tested without a GPU. The cases:

* ``collectives``: ``all_reduce``, ``all_gather_into_tensor`` and ``all_to_all_single`` (uneven
  splits) against float64 sums and exact copies of every rank's input, made on each rank;
* ``parity``: DDP with omnireduce's hook against plain DDP from the same weights on the same data,
  per config (:func:`parity_config`), every step;
* ``hierarchy``: tests/scripts/hier_ddp.py's run (plain DDP, the flat hook, the hierarchy), under
  torchrun with two node ranks;
* ``dies``: rank W-1 SIGKILLs itself between its forward and backward pass at a given step; the
  others say when their training failed (if Python sees it: NCCL's watchdog may end the process);
* ``profile``: the engine's phases under torch.profiler (gpu_nccl_profile.py);
* ``fsdp``: HSDP through omnireduce against native HSDP (tests/fsdp_cases.py), under the sync watch;
* ``graphs``: the collective engine with and without CUDA graphs (gpu_nccl_graphs.py).

The engine and the CUDA kernels module are internal names of omnireduce: ``ombench.rankside.internals`` is the
one place that imports them.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ombench.rankside import ROOT, Ctx, init

HALF_TOL = {"float16": 1e-3, "bfloat16": 1e-2}  # half precision: relative to the largest parameter


def rank_main(case: str, out: str, args: dict[str, Any]) -> None:
    """Run ``case`` in this rank (see the module docstring)."""
    t0 = time.monotonic()
    ctx = init(args)
    init_s = time.monotonic() - t0
    result = CASES[case](ctx, args)
    result.update(rank=ctx.rank, world_size=ctx.world, init_s=init_s, node=os.environ.get("GROUP_RANK"))
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(result))
    gc.collect()  # (DDP models left to the cycle collector hold work at exit: collect them while the group lives)
    if case != "dies":  # (no rank tears its connections down while another still reads from them)
        ctx.barrier()
    else:
        ctx.sync()
    t0 = time.monotonic()
    dist.destroy_process_group()
    Path(out, f"rank{ctx.rank}.end.json").write_text(json.dumps({"destroy_s": time.monotonic() - t0}))


# -- collectives ------------------------------------------------------------------------------------


def _input(rank: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def _splits(src: int, world: int, n: int) -> list[int]:
    """Elements rank ``src`` sends to each rank in the all-to-all: uneven, some zero."""
    return [0 if (src + d) % 5 == 4 else n // world + 7 * ((src + 2 * d) % 3) for d in range(world)]


def check_ops(ctx: Ctx, n: int, seed: int) -> list[dict[str, Any]]:
    """The three collectives on ``n`` elements per rank, each against its reference."""
    W, me, dev = ctx.world, ctx.rank, ctx.device
    inputs = [_input(r, n, seed) for r in range(W)]  # every rank's input, made here for the references
    out = []

    def record(op: str, t0: float, got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
        got = got.cpu().double()
        err = float((got - want).abs().max()) if want.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 1.0
        ok = err == 0.0 if exact else err <= 1e-5 * scale + 1e-6
        out.append({"op": op, "elements": n, "ok": bool(ok), "max_err": err, "ms": 1e3 * (time.monotonic() - t0)})

    t0 = time.monotonic()
    x = inputs[me].to(dev, copy=True)
    dist.all_reduce(x)
    ctx.sync()
    record("all_reduce", t0, x, sum(t.double() for t in inputs), exact=False)
    t0 = time.monotonic()
    gathered = torch.empty(W * n, device=dev)
    dist.all_gather_into_tensor(gathered, inputs[me].to(dev, copy=True))
    ctx.sync()
    record("all_gather_into_tensor", t0, gathered, torch.cat(inputs).double(), exact=True)
    sends = [_splits(s, W, n) for s in range(W)]
    payload = [_input(s, sum(sends[s]), seed + 1) for s in range(W)]
    want = torch.cat([payload[s][sum(sends[s][:me]): sum(sends[s][: me + 1])] for s in range(W)])
    t0 = time.monotonic()
    got = torch.empty(want.numel(), device=dev)
    dist.all_to_all_single(got, payload[me].to(dev, copy=True), [sends[s][me] for s in range(W)], sends[me])
    ctx.sync()
    record("all_to_all_single", t0, got, want.double(), exact=True)
    return out


def case_collectives(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for i, n in enumerate(args.get("sizes", [1000, 1 << 22])):
        rows += check_ops(ctx, int(n), seed=i)
    return {"ops": rows}


# -- parity -----------------------------------------------------------------------------------------


def _models(cfg: dict[str, Any], dev: torch.device) -> tuple[nn.Module, nn.Module]:
    """(plain DDP's module, the hook's module) from the same weights. The sparse model's reference
    takes dense embedding gradients (the same sums; NCCL has no sparse all-reduce)."""
    from tests.ddp_cases import Net
    from tests.sparse_ddp_cases import SparseNet

    torch.manual_seed(1234)
    base = SparseNet("mixed") if cfg.get("sparse") else Net()
    base = base.to(device=dev, dtype=getattr(torch, cfg.get("dtype", "float32")))
    ref = copy.deepcopy(base)
    for m in ref.modules():
        if getattr(m, "sparse", False):
            m.sparse = False
    return ref, copy.deepcopy(base)


def _batches(cfg: dict[str, Any], rank: int, steps: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if cfg.get("sparse"):
        from tests.sparse_ddp_cases import _batches as sparse_batches

        return sparse_batches(rank, steps, 5, str(dev))
    from tests.ddp_cases import _batches as dense_batches

    return [(x.to(dev), y.to(dev)) for x, y in dense_batches(rank, steps, 5)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, dev: torch.device, *, fused: bool,
           amp: bool) -> list[torch.Tensor]:
    """Train; the parameters (float32, on the host) after every step."""
    scaler = torch.amp.GradScaler(dev.type) if amp else None
    amp_dtype = torch.float16 if dev.type == "cuda" else torch.bfloat16
    snaps = []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp):
            out = model(x)
        loss = ((out.float() - y.float()) ** 2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if not fused:
                opt.step()
        snaps.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu())
    return snaps


def _diffs(snaps: list[torch.Tensor], ref: list[torch.Tensor], dtype: str) -> tuple[list[float], bool]:
    """Per step: the largest difference (float32: elementwise relative, 1e-6 floor; half: relative to
    the largest parameter), and whether every step is within the tolerance (float32: allclose at
    rtol 1e-5, atol 1e-6)."""
    out, ok = [], True
    for a, b in zip(snaps, ref, strict=True):
        if dtype == "float32":
            out.append(float(((a - b).abs() / (b.abs() + 1e-6)).max()))
            ok &= bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))
        else:
            out.append(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)))
            ok &= out[-1] <= HALF_TOL[dtype]
    return out, ok


def parity_config(ctx: Ctx, cfg: dict[str, Any]) -> dict[str, Any]:
    """One config: ``state`` (OmniReduceState's keyword arguments; {} is the default state),
    ``sparse`` (SparseNet's COO gradients), ``dtype``, ``fused`` (fuse_optimizer), ``amp``
    (autocast + GradScaler), ``steps``, ``compression`` (a BlockTopK density: every dense bucket
    compressed after one dense step)."""
    from omnireduce.compression import BlockTopK
    from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook

    dev, dtype = ctx.device, cfg.get("dtype", "float32")
    ref_module, mine_module = _models(cfg, dev)
    batches = _batches(cfg, ctx.rank, int(cfg.get("steps", 6)), dev)
    kw: dict[str, Any] = {"bucket_cap_mb": 0.05, "device_ids": [0] if dev.type == "cuda" else None}
    ref = DistributedDataParallel(ref_module, **kw)
    ref_snaps = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), batches, dev, fused=False,
                       amp=bool(cfg.get("amp")))
    mine = DistributedDataParallel(mine_module, **kw)
    opt = torch.optim.SGD(mine.parameters(), lr=0.05)
    how = dict(cfg.get("state", {}))
    if "compression" in cfg:
        how["compression"] = BlockTopK(density=cfg["compression"], block_size=64, warmup_steps=1, ramp_steps=0)
    state = OmniReduceState(**how)
    mine.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt) if cfg.get("fused") else omnireduce_hook)
    t0 = time.monotonic()
    try:
        snaps = _train(mine, opt, batches, dev, fused=bool(cfg.get("fused")), amp=bool(cfg.get("amp")))
        diffs, ok = _diffs(snaps, ref_snaps, dtype)
        error = None
    except Exception as e:  # what DDP surfaces from the hook's future: recorded, the next config goes on
        diffs, ok, error = [], False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    stats = state.stats()
    state.close()
    del ref, mine
    scalars = {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool)}
    scalars["buckets_compressed"] = sum(bool(b.get("compressed")) for b in stats.get("buckets", {}).values())
    scalars["collective_exchanges"] = stats.get("collective_exchanges", {})  # (which exchanges the engine took)
    return {"config": cfg, "ok": ok, "diffs": diffs, "error": error, "seconds": time.monotonic() - t0,
            "stats": scalars}


def case_parity(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    results = []
    for cfg in args["configs"]:
        results.append(parity_config(ctx, cfg))
        gc.collect()
        ctx.barrier()
    return {"results": results}


# -- the hierarchy, a rank that dies ------------------------------------------------------------------


def case_hierarchy(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    """tests/scripts/hier_ddp.py's comparison, per config, on this rank's device."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hier_ddp", ROOT / "tests" / "scripts" / "hier_ddp.py")
    assert spec is not None and spec.loader is not None
    hier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hier)
    device = "cuda:0" if ctx.device.type == "cuda" else "cpu"
    return {"results": [hier.run(dict(cfg, device=device), ctx.rank) for cfg in args["configs"]]}


def case_dies(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    """Rank W-1 SIGKILLs itself between forward and backward at step ``step`` (after writing when);
    every other rank trains on and writes when and how its training failed, then leaves at once
    (``os._exit``: its collectives with the dead rank would wait out their deadlines)."""
    from omnireduce.ddp import OmniReduceState, omnireduce_hook
    from tests.ddp_cases import Net
    from tests.ddp_cases import _batches as dense_batches

    out, step, victim = Path(args["out"]), int(args.get("step", 3)), ctx.world - 1
    torch.manual_seed(7)
    model = DistributedDataParallel(Net().to(ctx.device), bucket_cap_mb=0.05,
                                    device_ids=[0] if ctx.device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.register_comm_hook(OmniReduceState(timeout=ctx.timeout, **args.get("state", {})), omnireduce_hook)
    error, t0 = None, time.time()
    for i, (x, y) in enumerate(dense_batches(ctx.rank, step + 1000, 3)):
        t0 = time.time()
        try:
            loss = ((model(x.to(ctx.device)) - y.to(ctx.device)) ** 2).mean()
            if i == step and ctx.rank == victim:
                (out / "victim.json").write_text(json.dumps({"rank": ctx.rank, "died_at": time.time(), "step": i}))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            float(loss)  # (waits for the device: a step whose collectives hang shows here)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            break
        if i >= step and time.time() - t0 > 3 * ctx.timeout:
            break
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "error": error, "failed_at": time.time(), "step_started": t0}))
    sys.stdout.flush()
    os._exit(0)


def _profile(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    from gpu_nccl_profile import case_profile

    return case_profile(ctx, args)


def case_fsdp(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    """tests/fsdp_cases.py's comparison with native HSDP on a 2-D mesh of ``shape`` on this device,
    per config; omnireduce's steps after the second under the sync watch (gpu_sync_check.SyncWatch)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.fsdp_cases import compare

    mesh = init_device_mesh(ctx.device.type, tuple(args.get("shape", (2, ctx.world // 2))),
                            mesh_dim_names=("replicate", "shard"))
    results = []
    for cfg in args["configs"]:
        watch = None
        if ctx.device.type == "cuda":
            from gpu_sync_check import SyncWatch

            watch = SyncWatch()
        r = compare(ctx.rank, mesh, dict(cfg, device=str(ctx.device)), watch=watch)
        r["syncs"] = watch.found if watch is not None else []
        results.append(r)
    return {"results": results}


def _engine(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    from engine_cost import case_engine

    return case_engine(ctx, args)


def _graphs(ctx: Ctx, args: dict[str, Any]) -> dict[str, Any]:
    from gpu_nccl_graphs import case_graphs

    return case_graphs(ctx, args)


CASES: dict[str, Callable[[Ctx, dict[str, Any]], dict[str, Any]]] = {
    "collectives": case_collectives, "parity": case_parity, "hierarchy": case_hierarchy, "dies": case_dies,
    "profile": _profile, "engine": _engine, "fsdp": case_fsdp, "graphs": _graphs}
