"""DDP runs with sparse embedding gradients, executed inside the test pool's rank processes (see
tests/test_sparse_ddp.py): default DDP against omnireduce_hook.

Each function initialises a real Gloo process group, trains two copies of a model from the same
weights on the same data, and returns plain data (per-step comparisons, the hook's stats, whether
any sparse tensor reached the process group) for the test to judge.

Models concatenate their tables' outputs rather than add them: when two sparse gradients share one
upstream gradient's storage (``e1(x) + e2(x)``), default DDP divides that storage in place once per
parameter (torch 2.13), so its own result is wrong there and cannot be the reference.

The reference is default DDP with one part replaced: Gloo's sparse all-reduce, which corrupts the heap
(glibc's ``malloc(): unaligned tcache chunk detected``, ``double free or corruption``, segfaults) in
torch 2.13 with no omnireduce code in the process, most often with ``find_unused_parameters=True``,
an unused parameter and two sparse tables (``scripts/repro_gloo_sparse_heap.py``). DDP's reference
runs with :func:`dense_reference_hook`: default DDP's arithmetic, each sparse gradient summed as a
dense tensor.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook
from tests.ddp_cases import process_group

ROWS = 3000


class SparseNet(nn.Module):
    """Sparse tables of the ``kind`` asked for, a dense table (dense gradient, rows of 12) and an
    MLP; with ``unused``, a layer forward never uses."""

    def __init__(self, kind: str, unused: bool = False) -> None:
        super().__init__()
        self.kind = kind
        if kind == "bag_sum":
            self.tables = nn.ModuleList([nn.EmbeddingBag(ROWS, 16, mode="sum", sparse=True)])
        elif kind == "bag_mean":
            self.tables = nn.ModuleList([nn.EmbeddingBag(ROWS, 16, mode="mean", sparse=True)])
        elif kind == "padding":
            self.tables = nn.ModuleList([nn.Embedding(ROWS, 16, padding_idx=0, sparse=True)])
        else:  # mixed: two sparse tables of other widths, a dense one, dense layers
            self.tables = nn.ModuleList([nn.Embedding(ROWS, 16, sparse=True),
                                         nn.EmbeddingBag(ROWS // 3, 8, mode="sum", sparse=True),
                                         nn.EmbeddingBag(2000, 12, mode="sum")])
        width = sum(t.embedding_dim for t in self.tables)
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))
        if unused:
            self.unused = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outs = []
        for t in self.tables:
            ids = idx % t.num_embeddings
            outs.append(t(ids) if isinstance(t, nn.EmbeddingBag) else t(ids).sum(1))
        return self.mlp(torch.cat(outs, dim=1)).squeeze(1)


def _batches(rank: int, n: int, seed: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(n):
        idx = torch.randint(0, ROWS, (16, 4), generator=g)
        idx[0, 0] = 0  # the padding row, where there is one
        out.append((idx.to(device), torch.randn(16, generator=g).to(device)))
    return out


def _optimizers(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    sparse = [p for m in model.modules() if getattr(m, "sparse", False) for p in m.parameters()]
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    if name == "sparse_adam":
        return [torch.optim.SparseAdam(sparse, lr=0.01), torch.optim.Adam(dense, lr=0.01)]
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if name == "sgd_momentum" else 0.0)]


def _dense_grads(model: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.to_dense() if p.grad.is_sparse else p.grad).clone() if p.grad is not None
            else torch.zeros_like(p) for p in model.parameters()]


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], batches: list, accumulate: int, fused: bool
           ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    grads, params = [], []
    for i in range(0, len(batches), accumulate):
        for o in opts:
            o.zero_grad()
        group = batches[i:i + accumulate]
        for j, (x, y) in enumerate(group):
            with contextlib.nullcontext() if j == len(group) - 1 else model.no_sync():
                ((model(x) - y) ** 2).mean().backward()
        grads.append(_dense_grads(model))
        if not fused:
            for o in opts:
                o.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads, params


def dense_reference_hook(_, bucket):  # (unannotated: DDP checks the annotations, here strings, at runtime)
    """Default DDP's reduction (each rank's gradient divided by the world size, then summed by Gloo),
    with a sparse gradient summed as a dense tensor: its result holds every row some rank touched,
    coalesced, as Gloo's sparse all-reduce gives."""
    world = dist.get_world_size()
    grad = bucket.buffer()
    if grad.is_sparse:
        grad = grad.coalesce()
        touched = torch.zeros(grad.shape[0], dtype=grad.dtype, device=grad.device)
        touched[grad.indices()[0]] = 1
        dense = grad.to_dense().div_(world)
        both = torch.cat([touched, dense.reshape(-1)])
        dist.all_reduce(both)
        rows = both[:grad.shape[0]].nonzero().reshape(1, -1)
        summed = both[grad.shape[0]:].reshape(dense.shape)
        result = torch.sparse_coo_tensor(rows, summed[rows[0]], grad.shape, is_coalesced=True)
    else:
        result = grad.div_(world)
        dist.all_reduce(result)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(result)
    return done


def parity(rank: int, world_size: int, port: int, aggregator: str, configs: list[dict[str, Any]]) -> list[dict]:
    """For each config: default DDP (with :func:`dense_reference_hook`) against omnireduce_hook from the
    same weights on the same data; per step, whether the reduced gradients and the parameters agree
    (rtol 1e-5). A config's ``device`` ("cpu" by default, or "cuda": every rank on the one GPU, Gloo's
    all-reduce of CUDA tensors in the reference) holds both models and the data."""
    out = []
    with process_group(rank, world_size, port):
        original = dist.all_reduce
        sparse_to_group = [0]

        def watching(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            if tensor.layout != torch.strided:
                sparse_to_group[0] += 1
            return original(tensor, *a, **k)

        for n, cfg in enumerate(configs):
            torch.manual_seed(100 + n)
            device = cfg.get("device", "cpu")
            base = SparseNet(cfg["model"], unused=cfg.get("find_unused", False)).to(device)
            kwargs = {"bucket_cap_mb": cfg.get("bucket_cap_mb", 0.05),
                      "find_unused_parameters": cfg.get("find_unused", False),
                      "gradient_as_bucket_view": cfg.get("bucket_view", False)}
            accumulate = cfg.get("accumulate", 1)
            batches = _batches(rank, cfg.get("steps", 5) * accumulate, n, device)
            ref = DistributedDataParallel(copy.deepcopy(base), **kwargs)
            ref.register_comm_hook(None, dense_reference_hook)
            ref_grads, ref_params = _train(ref, _optimizers(cfg["optimizer"], ref), batches, accumulate, fused=False)
            mine = DistributedDataParallel(copy.deepcopy(base), **kwargs)
            opts = _optimizers(cfg["optimizer"], mine)
            state = OmniReduceState(aggregators=[aggregator], timeout=30, dense_threshold=0.05,
                                    dense_fallback=cfg.get("dense_fallback", False), engine=cfg.get("engine", "auto"))
            if cfg.get("pickled"):  # as from a checkpoint: rank 0's state, unpickled on every rank
                blob = [pickle.dumps(state) if rank == 0 else None]
                dist.broadcast_object_list(blob, src=0)
                state.close()
                state = pickle.loads(blob[0])
            hook = omnireduce_hook
            if cfg.get("fused"):
                for o in opts:
                    hook = fuse_optimizer(hook, o)
            mine.register_comm_hook(state, hook)
            dist.all_reduce = watching
            try:
                grads, params = _train(mine, opts, batches, accumulate, fused=bool(cfg.get("fused")))
            finally:
                dist.all_reduce = original
            # reduced gradients: the rounding of another summation order only (Gloo divides each rank's
            # gradient, then sums; omnireduce sums in rank order, then scales), relative to their scale
            gscale = max(g.abs().max().item() for step in ref_grads for g in step)
            grad_ok = [all(torch.allclose(a, b, rtol=1e-5, atol=1e-7 * gscale) for a, b in zip(g, rg, strict=True))
                       for g, rg in zip(grads, ref_grads, strict=True)]
            param_ok = [all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(p, rp, strict=True))
                        for p, rp in zip(params, ref_params, strict=True)]
            grad_diff = [max(((a - b).abs() / (b.abs() + 1e-6)).max().item() for a, b in zip(g, rg, strict=True))
                         for g, rg in zip(grads, ref_grads, strict=True)]
            moved = max((a - b).abs().max().item() for a, b in zip(params[-1], base.parameters(), strict=True))
            stats = state.stats()
            state.close()
            del ref, mine  # (no config's models outlive their group: a plain torch process that exits
            gc.collect()  # just after destroying a group a DDP model still holds can abort, see the log)
            out.append({"config": cfg, "grads_ok": grad_ok, "grad_diff": grad_diff, "params_ok": param_ok,
                        "moved": moved,
                        "sparse_to_group": sparse_to_group[0], "pickled": bool(cfg.get("pickled")),
                        "stats": {k: v for k, v in stats.items() if k != "density"}})
            sparse_to_group[0] = 0
    return out
