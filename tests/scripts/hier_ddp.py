"""One rank of a hierarchical DDP job under torchrun (tests/test_hierarchy_ddp.py): for each config,
plain DDP, the hook on the flat path and the hook on the hierarchy (config ``runs``: any of ``flat``,
``hier`` and ``auto``, ``hierarchical`` left to None; default the first two; ``compression``: a density,
every bucket compressed) train the same model from
the same weights on the same data; this rank writes, as JSON, the largest difference of the parameters
from plain DDP's after every step, and the hook's stats. Usage: hier_ddp.py OUT_DIR CONFIG_JSON..."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from omnireduce.compression import BlockTopK
from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook
from tests.ddp_cases import Net

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SparseNet(nn.Module):
    """A sparse-gradient embedding (COO buckets) under a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5000, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Flatten(), nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(idx))


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, cfg: dict, fused: bool,
           after: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    """The parameters (float32) after every step, ``after`` called after each. (Not tests.ddp_cases._train:
    that one also flattens every gradient, which a sparse COO gradient cannot be, and keeps half-precision
    snapshots.)"""
    snaps = []
    accumulate = cfg.get("accumulate", 1)
    for i in range(0, len(batches), accumulate):
        opt.zero_grad()
        group = batches[i:i + accumulate]
        for j, (x, y) in enumerate(group):
            sync = contextlib.nullcontext() if j == len(group) - 1 else model.no_sync()
            with sync:
                ((model(x).float() - y) ** 2).mean().backward()
        if not fused:
            opt.step()
        snaps.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone())
        after()
    return snaps


def _diff(a: torch.Tensor, b: torch.Tensor, half: bool) -> float:
    """The largest difference of ``a`` from ``b``: relative per element in float32 (1e-3 floor); in
    half precision relative to the largest magnitude (elementwise, rounding to 8 or 11 bits that
    summation orders round differently dominates, and a step can flip a tiny parameter's sign)."""
    if half:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return ((a - b).abs() / (b.abs() + 1e-3)).max().item()


def run(cfg: dict, rank: int) -> dict:
    """One config (``device``: where the models and data live, ``cpu`` unless given; the GPU check
    runs this on ``cuda:0`` over NCCL, scripts/gpu_nccl_check.py; ``dense_reference``: plain DDP's
    embedding takes dense gradients)."""
    half = cfg.get("dtype", "float32") != "float32"
    dev = torch.device(cfg.get("device", "cpu"))
    torch.manual_seed(1234)
    base = SparseNet() if cfg.get("sparse") else Net(unused=cfg.get("find_unused", False))
    base = base.to(device=dev, dtype=DTYPES[cfg.get("dtype", "float32")])
    g = torch.Generator().manual_seed(77 + rank)
    steps = cfg.get("steps", 4) * cfg.get("accumulate", 1)
    high = 5000 if cfg.get("sparse") else 20000
    batches = [(torch.randint(0, high, (8, 5), generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev))
               for _ in range(steps)]
    kw = {"bucket_cap_mb": 0.05, "find_unused_parameters": cfg.get("find_unused", False),
          "device_ids": [dev.index] if dev.type == "cuda" else None}
    ref_module = copy.deepcopy(base)
    if cfg.get("dense_reference"):  # plain DDP takes dense embedding gradients (the same sums; NCCL has no sparse
        for m in ref_module.modules():  # all-reduce)
            if getattr(m, "sparse", False):
                m.sparse = False
    ref = DistributedDataParallel(ref_module, **kw)
    ref_snaps = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), batches, cfg, fused=False)
    out: dict = {"config": cfg}
    runs = cfg.get("runs", ["flat", "hier"])
    for name, hierarchical in [(n, h) for n, h in (("flat", False), ("hier", True), ("auto", None)) if n in runs]:
        model = DistributedDataParallel(copy.deepcopy(base), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        how = {"path": cfg["path"], "measure_trials": 1} if "path" in cfg else {"dense_fallback": False}
        if "compression" in cfg:  # every bucket compressed after one dense step, at this density
            how["compression"] = BlockTopK(density=cfg["compression"], block_size=64, warmup_steps=1, ramp_steps=0,
                                           min_blocks=0, exact_below=0.0)
        state = OmniReduceState(hierarchical=hierarchical, block_size=64, timeout=60, engine=cfg.get("engine", "auto"),
                                **how)
        model.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt) if cfg.get("fused") else omnireduce_hook)
        in_node: list[int] = []  # the state's bytes_in_node after every step
        snaps = _train(model, opt, batches, cfg, fused=bool(cfg.get("fused")),
                       after=lambda: in_node.append(state.stats()["bytes_in_node"]))  # noqa: B023 (called in this loop)
        out[name + "_in_node"] = in_node
        out[name] = [_diff(a, b, half) for a, b in zip(snaps, ref_snaps, strict=True)]
        out[name + "_snaps"] = snaps
        stats = state.stats()
        out[name + "_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}
        out[name + "_paths"] = {"paths": stats["paths"], "step_checks": stats["step_checks"]}
        out[name + "_compression"] = stats.get("compression", {})
        state.close()
    if "flat" in runs and "hier" in runs:
        out["flat_vs_hier"] = max(_diff(a, b, half) for a, b in zip(out["flat_snaps"], out["hier_snaps"], strict=True))
    for name in runs:
        del out[name + "_snaps"]
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = [run(json.loads(c), rank) for c in sys.argv[2:]]
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world_size": dist.get_world_size(), "group_rank": os.environ.get("GROUP_RANK"),
         "results": results}))
    # DDP models left to the cycle collector still hold Gloo work at interpreter exit: collect them while the
    # process group lives (without this, plain DDP aborted at exit in ~15% of runs here, "terminate called
    # without an active exception", with torch 2.13 and Gloo)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
