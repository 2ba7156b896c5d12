"""Runs executed inside the test pool's rank processes for tests/test_compression.py.

Each function initialises a real Gloo process group and returns plain data for the test to judge.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from omnireduce.compression import BlockTopK, BucketCompressor
from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int):
    """A Gloo group for the call; DDP models left over are collected while it lives (a reducer collected
    later, in another call's group, can hang that call)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


class Mlp(nn.Module):
    """Layers whose sizes are not multiples of the block sizes used (several DDP buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 301), nn.Tanh(), nn.Linear(301, 77), nn.Tanh(), nn.Linear(77, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _data(rank: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    w = torch.randn(20, 3, generator=torch.Generator().manual_seed(seed))
    out = []
    for _ in range(n):
        x = torch.randn(16, 20, generator=g)
        out.append((x, torch.tanh(x @ w) + 0.1 * torch.randn(16, 3, generator=g)))
    return out


def _ddp(model: nn.Module, cap: float = 0.02) -> DistributedDataParallel:
    return DistributedDataParallel(model, bucket_cap_mb=cap)


def _dense_state(compression: BlockTopK, **kw: Any) -> OmniReduceState:
    """The compressed buckets' blocks on the process group's all-reduce: no aggregator, no hierarchy."""
    return OmniReduceState(compression=compression, path="dense", engine="collective", hierarchical=False, **kw)


def ef_bookkeeping(rank: int, world_size: int, port: int, steps: int, density: float, selection: str,
                   warmup: int) -> dict:
    """Backward passes without optimizer steps: W * sum of reduced gradients + sum of residuals over ranks
    must equal the sum over ranks and steps of the local gradients (float64 reference). With no warm-up,
    the first step compresses DDP's initial buckets, whose residuals must survive DDP's bucket rebuild."""
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = Mlp()
        local = copy.deepcopy(base)
        model = _ddp(base)
        state = _dense_state(BlockTopK(density=density, block_size=32, warmup_steps=warmup, selection=selection))
        model.register_comm_hook(state, omnireduce_hook)
        names = [n for n, _ in local.named_parameters()]
        reduced = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        truth = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        mag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        for x, y in _data(rank, steps, 1):
            model.zero_grad(), local.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            ((local(x) - y) ** 2).mean().backward()
            for (n, p), q in zip(model.module.named_parameters(), local.parameters(), strict=True):
                reduced[n] += p.grad.double() * world_size
                truth[n] += q.grad.double()
                mag[n] += q.grad.double().abs()
        sd = state.compression_state_dict(model)
        out = {}
        for n in names:
            res = sd["residuals"][n].double().reshape(reduced[n].shape) if n in sd["residuals"] \
                else torch.zeros_like(reduced[n])
            t, r, m = truth[n].clone(), res.clone(), mag[n].clone()
            for z in (t, r, m):
                dist.all_reduce(z)
            err = (reduced[n] + r - t).abs()
            out[n] = {"max_err": err.max().item(), "max_ratio": (err / (m * steps * 2.0**-23 * 4 + 1e-30)).max().item(),
                      "residual_norm": r.norm().item(), "truth_norm": t.norm().item()}
        st = state.stats()
        keep = ("k", "blocks", "steps_compressed")
        return {"params": out, "iteration": st["iteration"],
                "buckets": {i: {k: b[k] for k in keep} for i, b in st["compression"].items()}}


def shared_union(rank: int, world_size: int, port: int, numel: int, density: float, steps: int) -> list[list[int]]:
    """The compressor with a real all-reduce of the scores: each step's selected block indices."""
    with process_group(rank, world_size, port):
        comp = BucketCompressor(numel, BlockTopK(density=density, block_size=64))
        g = torch.Generator().manual_seed(rank)
        out = []
        for _ in range(steps):
            comp.accumulate(torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4)
            s = comp.scores()
            dist.all_reduce(s)
            idx = comp.select(s)
            comp.compact(idx)
            out.append(idx.tolist())
        return out


def _train(model: DistributedDataParallel, opt: torch.optim.Optimizer, data: list, fused: bool) -> list[torch.Tensor]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if not fused:
            opt.step()
        losses.append(loss.detach())
    return losses


def _opt(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=3e-3)


def density_one(rank: int, world_size: int, port: int, optimizer: str, fused: bool) -> dict:
    """density=1 (no warm-up) against DDP's default all-reduce: parameters after every step."""
    with process_group(rank, world_size, port):
        torch.manual_seed(3)
        base = Mlp()
        data = _data(rank, 8, 2)
        ref = _ddp(copy.deepcopy(base))
        _train(ref, _opt(optimizer, ref.parameters()), data, False)
        mine = _ddp(copy.deepcopy(base))
        opt = _opt(optimizer, mine.parameters())
        state = _dense_state(BlockTopK(density=1.0, block_size=32, warmup_steps=0))
        mine.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt) if fused else omnireduce_hook)
        _train(mine, opt, data, fused)
        diffs = [(a - b).abs().max().item() for a, b in zip(mine.parameters(), ref.parameters(), strict=True)]
        equal = all(torch.equal(a, b) for a, b in zip(mine.parameters(), ref.parameters(), strict=True))
        moved = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), base.parameters(), strict=True))
        return {"equal": equal, "max_diff": max(diffs), "moved": moved,
                "compressed": sum(b["steps_compressed"] for b in state.stats()["compression"].values())}


def checkpoint(rank: int, world_size: int, port: int, path: str) -> dict:
    """Train 6 steps, checkpoint (model, optimizer, compression state), train 6 more: the same 6 steps from
    a fresh DDP model and state loaded from the checkpoint give the same parameters. One bucket, so that the
    fresh model's first (not yet rebuilt) bucket holds the parameters in the same order as the rebuilt one.
    Blocks of one value: the selection does not depend on where DDP puts a parameter in the bucket (the
    fresh DDP's first bucket is laid out before its rebuild)."""
    opts = BlockTopK(density=0.05, block_size=1, warmup_steps=2)
    with process_group(rank, world_size, port):
        torch.manual_seed(5)
        data = _data(rank, 12, 3)
        model = _ddp(Mlp(), 25)
        opt = _opt("sgd", model.parameters())
        state = _dense_state(opts)
        model.register_comm_hook(state, omnireduce_hook)
        _train(model, opt, data[:6], False)
        ckpt = {"model": copy.deepcopy(model.module.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                "compression": state.compression_state_dict(model)}
        torch.save(ckpt, f"{path}.{rank}")
        _train(model, opt, data[6:], False)
        loaded = torch.load(f"{path}.{rank}", weights_only=True)
        fresh = Mlp()
        fresh.load_state_dict(loaded["model"])
        model2 = _ddp(fresh, 25)
        opt2 = _opt("sgd", model2.parameters())
        opt2.load_state_dict(loaded["opt"])
        state2 = _dense_state(opts)
        state2.load_compression_state_dict(model2, loaded["compression"])
        reloaded = state2.compression_state_dict(model2)["residuals"]
        same = all(torch.equal(reloaded[n], t) for n, t in loaded["compression"]["residuals"].items())
        model2.register_comm_hook(state2, omnireduce_hook)
        _train(model2, opt2, data[6:], False)
        # without the residuals (only the step count): what a checkpoint that drops them would give
        fresh3 = Mlp()
        fresh3.load_state_dict(loaded["model"])
        model3 = _ddp(fresh3, 25)
        opt3 = _opt("sgd", model3.parameters())
        opt3.load_state_dict(loaded["opt"])
        state3 = _dense_state(opts)
        state3.iteration = loaded["compression"]["iteration"]
        model3.register_comm_hook(state3, omnireduce_hook)
        _train(model3, opt3, data[6:], False)
        pairs = list(zip(model.parameters(), model2.parameters(), strict=True))
        res_norm = sum(float(t.norm()) ** 2 for t in loaded["compression"]["residuals"].values()) ** 0.5
        return {"equal": all(torch.equal(a, b) for a, b in pairs), "residuals_restored": same,
                "max_diff": max((a - b).abs().max().item() for a, b in pairs),
                "diff_without": max((a - b).abs().max().item()
                                    for a, b in zip(model.parameters(), model3.parameters(), strict=True)),
                "residual_norm": res_norm, "iteration": loaded["compression"]["iteration"]}


def convergence(rank: int, world_size: int, port: int, optimizer: str, density: float, steps: int) -> dict:
    """Train the MLP on a fixed regression task; return the final mean loss (last 20 steps) and a held-out loss."""
    with process_group(rank, world_size, port):
        torch.manual_seed(7)
        model = _ddp(Mlp())
        opt = _opt(optimizer, model.parameters())
        if density < 1:
            state = _dense_state(BlockTopK(density=density, block_size=32, warmup_steps=10))
            model.register_comm_hook(state, omnireduce_hook)
        losses = _train(model, opt, _data(rank, steps, 4), False)
        x, y = zip(*_data(1000, 20, 4), strict=True)
        with torch.no_grad():
            held = ((model(torch.cat(x)) - torch.cat(y)) ** 2).mean().item()
        return {"final": float(torch.stack(losses[-20:]).mean()), "first": float(torch.stack(losses[:5]).mean()),
                "held_out": held}


def loss_scale(rank: int, world_size: int, port: int) -> dict:
    """With a GradScaler whose scale doubles every 2 steps, a state told the scaler (``grad_scaler=``) trains exactly
    as without loss scaling (power-of-two scales are exact); without telling the state, scales mix in the
    residual and the parameters differ."""
    opts = BlockTopK(density=0.05, block_size=32, warmup_steps=2)
    with process_group(rank, world_size, port):
        torch.manual_seed(9)
        base, data, out = Mlp(), _data(rank, 10, 6), []
        for mode in ("plain", "told", "untold"):
            model = _ddp(copy.deepcopy(base))
            opt = _opt("sgd", model.parameters())
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=mode != "plain")
            state = _dense_state(opts, grad_scaler=scaler if mode == "told" else None)
            model.register_comm_hook(state, omnireduce_hook)
            for x, y in data:
                opt.zero_grad()
                scaler.scale(((model(x) - y) ** 2).mean()).backward()
                scaler.step(opt)
                scaler.update()
            out.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scaler.get_scale()))
        (plain, _), (told, s1), (untold, _) = out
        return {"told_equal": torch.equal(plain, told), "untold_diff": (plain - untold).abs().max().item(),
                "final_scale": s1}


def deprecated_alias(rank: int, world_size: int, port: int) -> dict:
    """The deprecated ``CompressionState``/``compression_hook`` against ``_dense_state`` with
    ``omnireduce_hook``, 8 SGD steps each from the same model: the parameters, and the residuals of the
    alias's older checkpoint format loaded into the one state, must be the same; two states made, the
    warnings they gave."""
    import omnireduce.ddp.compression_hook as old

    old._warned = False  # (this pool process may have made one for an earlier test)
    opts = BlockTopK(density=0.05, block_size=32, warmup_steps=2)
    with process_group(rank, world_size, port):
        torch.manual_seed(11)
        base, data = Mlp(), _data(rank, 8, 7)
        alias, one = _ddp(copy.deepcopy(base)), _ddp(copy.deepcopy(base))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st_alias = old.CompressionState(opts, module=alias)
            old.CompressionState(opts)
        alias.register_comm_hook(st_alias, old.compression_hook)
        st_one = _dense_state(opts)
        one.register_comm_hook(st_one, omnireduce_hook)
        _train(alias, _opt("sgd", alias.parameters()), data, False)
        _train(one, _opt("sgd", one.parameters()), data, False)
        loaded = _dense_state(opts)
        loaded.load_compression_state_dict(one, st_alias.state_dict())
        mine, theirs = loaded.compression_state_dict(one), st_one.compression_state_dict(one)
        pairs = list(zip(alias.parameters(), one.parameters(), strict=True))
        return {"warnings": [(w.category.__name__, str(w.message)) for w in caught
                             if "CompressionState" in str(w.message)],
                "equal": all(torch.equal(a, b) for a, b in pairs),
                "moved": max((a - b).abs().max().item() for a, b in zip(one.parameters(), base.parameters(),
                                                                         strict=True)),
                "same_checkpoint": mine["iteration"] == theirs["iteration"] == 8 and set(mine["residuals"])
                == set(theirs["residuals"]) and all(torch.equal(t, theirs["residuals"][n])
                                                    for n, t in mine["residuals"].items()),
                "residual_norm": sum(float(t.norm()) ** 2 for t in theirs["residuals"].values()) ** 0.5}


# -- OmniReduceState(compression=...): the compressed buckets through the path choice's ways ---------------


class Tables(nn.Module):
    """An embedding table whose gradient is sparse (a few rows per batch) beside a dense MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4000, 16)
        self.mlp = Mlp()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[:, :2].abs() * 997).long() % 4000  # a few rows per batch
        return self.mlp(x) + self.head(self.emb(rows).sum(dim=1))


def _state(aggregator: str, compression: BlockTopK, **kw: Any) -> OmniReduceState:
    return OmniReduceState(aggregators=[aggregator], timeout=30, block_size=64, compression=compression, **kw)


def state_bookkeeping(rank: int, world_size: int, port: int, aggregator: str, path: str, steps: int,
                      density: float, warmup: int) -> dict:
    """ef_bookkeeping through omnireduce_hook and OmniReduceState(compression=...), with ``path``: W * the sum
    of reduced gradients + the ranks' residuals equals the sum of every rank's local gradients (float64);
    the embedding table's bucket, sparse, stays exact (its reduced gradient is the mean of the local ones
    at every step)."""
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = Tables()
        local = copy.deepcopy(base)
        model = _ddp(base)
        state = _state(aggregator, BlockTopK(density=density, block_size=32, warmup_steps=warmup, ramp_steps=0),
                       path=path)
        model.register_comm_hook(state, omnireduce_hook)
        names = [n for n, _ in local.named_parameters()]
        reduced = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        truth = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        mag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in local.named_parameters()}
        emb_err = 0.0
        for x, y in _data(rank, steps, 1):
            model.zero_grad(), local.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            ((local(x) - y) ** 2).mean().backward()
            for (n, p), q in zip(model.module.named_parameters(), local.parameters(), strict=True):
                reduced[n] += p.grad.double() * world_size
                truth[n] += q.grad.double()
                mag[n] += q.grad.double().abs()
                if n == "emb.weight":
                    mean = q.grad.double()
                    dist.all_reduce(mean)
                    emb_err = max(emb_err, (p.grad.double() * world_size - mean).abs().max().item())
        sd = state.compression_state_dict(model)
        out = {}
        for n in names:
            res = sd["residuals"][n].double().reshape(reduced[n].shape) if n in sd["residuals"] \
                else torch.zeros_like(reduced[n])
            t, r, m = truth[n].clone(), res.clone(), mag[n].clone()
            for z in (t, r, m):
                dist.all_reduce(z)
            err = (reduced[n] + r - t).abs()
            out[n] = {"max_ratio": (err / (m * steps * 2.0**-23 * 8 + 1e-30)).max().item(),
                      "residual_norm": r.norm().item(), "truth_norm": t.norm().item()}
        st = state.stats()
        state.close()
        return {"params": out, "emb_err": emb_err, "emb_scale": mag["emb.weight"].max().item(),
                "buckets": st["buckets"], "compression": st["compression"], "paths": st["paths"],
                "sent_fraction": st["sent_fraction"], "iteration": st["iteration"]}


def state_density_one(rank: int, world_size: int, port: int, aggregator: str, optimizer: str, path: str) -> dict:
    """OmniReduceState(compression=BlockTopK(density=1)) against DDP's default all-reduce: parameters
    after 8 steps (the same up to the summation order's rounding)."""
    with process_group(rank, world_size, port):
        torch.manual_seed(3)
        base = Mlp()
        data = _data(rank, 8, 2)
        ref = _ddp(copy.deepcopy(base))
        _train(ref, _opt(optimizer, ref.parameters()), data, False)
        mine = _ddp(copy.deepcopy(base))
        opt = _opt(optimizer, mine.parameters())
        state = _state(aggregator, BlockTopK(density=1.0, block_size=32, warmup_steps=0), path=path)
        mine.register_comm_hook(state, omnireduce_hook)
        _train(mine, opt, data, False)
        pairs = list(zip(mine.parameters(), ref.parameters(), strict=True))
        st = state.stats()
        state.close()
        moved = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), base.parameters(), strict=True))
        return {"allclose": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs),
                "max_diff": max((a - b).abs().max().item() for a, b in pairs), "moved": moved,
                "compressed": sum(b.get("compressed", False) for b in st["buckets"].values()),
                "ways": sorted({b["way"] for b in st["buckets"].values()})}


def state_checkpoint(rank: int, world_size: int, port: int, aggregator: str, path: str) -> dict:
    """checkpoint() with OmniReduceState: compression_state_dict saved beside the model and optimizer, loaded
    into a fresh state: the resumed steps give the same parameters as the uninterrupted run (through the
    aggregators: rank-order sums, the same on both runs)."""
    opts = BlockTopK(density=0.05, block_size=1, warmup_steps=2)
    with process_group(rank, world_size, port):
        torch.manual_seed(5)
        data = _data(rank, 12, 3)
        model = _ddp(Mlp(), 25)
        opt = _opt("sgd", model.parameters())
        state = _state(aggregator, opts, path="omnireduce")
        model.register_comm_hook(state, omnireduce_hook)
        _train(model, opt, data[:6], False)
        ckpt = {"model": copy.deepcopy(model.module.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                "compression": state.compression_state_dict(model)}
        torch.save(ckpt, f"{path}.{rank}")
        _train(model, opt, data[6:], False)
        loaded = torch.load(f"{path}.{rank}", weights_only=True)
        runs = {}
        for name, restore in (("restored", True), ("without", False)):
            fresh = Mlp()
            fresh.load_state_dict(loaded["model"])
            model2 = _ddp(fresh, 25)
            opt2 = _opt("sgd", model2.parameters())
            opt2.load_state_dict(loaded["opt"])
            state2 = _state(aggregator, opts, path="omnireduce")
            if restore:
                state2.load_compression_state_dict(model2, loaded["compression"])
            else:  # (the iteration only: no new warm-up, but the residuals lost)
                state2.load_compression_state_dict(model2, {**loaded["compression"], "residuals": {}})
            model2.register_comm_hook(state2, omnireduce_hook)
            _train(model2, opt2, data[6:], False)
            state2.close()
            runs[name] = max((a - b).abs().max().item()
                             for a, b in zip(model.parameters(), model2.parameters(), strict=True))
        state.close()
        res_norm = sum(float(t.norm()) ** 2 for t in loaded["compression"]["residuals"].values()) ** 0.5
        return {"max_diff": runs["restored"], "diff_without": runs["without"], "residual_norm": res_norm,
                "iteration": loaded["compression"]["iteration"]}


def state_loss_scale(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """loss_scale() through OmniReduceState(compression=..., grad_scaler=...): told the scaler, the run equals
    the unscaled one bit for bit (power-of-two scales, rank-order sums at the aggregators); untold, it differs."""
    opts = BlockTopK(density=0.05, block_size=32, warmup_steps=2)
    with process_group(rank, world_size, port):
        torch.manual_seed(9)
        base, data, out = Mlp(), _data(rank, 10, 6), []
        for mode in ("plain", "told", "untold"):
            model = _ddp(copy.deepcopy(base))
            opt = _opt("sgd", model.parameters())
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=mode != "plain")
            state = _state(aggregator, opts, path="omnireduce", grad_scaler=scaler if mode == "told" else None)
            model.register_comm_hook(state, omnireduce_hook)
            for x, y in data:
                opt.zero_grad()
                scaler.scale(((model(x) - y) ** 2).mean()).backward()
                scaler.step(opt)
                scaler.update()
            state.close()
            out.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scaler.get_scale()))
        (plain, _), (told, s1), (untold, _) = out
        return {"told_equal": torch.equal(plain, told), "untold_diff": (plain - untold).abs().max().item(),
                "final_scale": s1}
