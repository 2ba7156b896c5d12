"""Training runs executed inside the test pool's rank processes (see tests/test_ddp.py).

Each function initialises a real Gloo process group, trains real DDP models and returns plain data
(per-step differences, errors, stats) for the test to judge.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook
from tests import plain


class Net(nn.Module):
    """An embedding table (sparse gradients) under an MLP (dense gradients); with ``unused``, a layer
    forward never uses. The MLP's gradients arrive first and fill DDP's 1 MiB first bucket, so the
    rebuilt buckets are several: dense MLP buckets and the sparse embedding's."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(20000, 16, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 4))
        if unused:
            self.unused = nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(idx))


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _batches(rank: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randint(0, 20000, (8, 5), generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, cfg: dict[str, Any],
           fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train; return the flattened reduced gradients and parameters after every optimizer step."""
    snapshots, grads = [], []
    accumulate = cfg.get("accumulate", 1)
    join = Join([model]) if cfg.get("uneven") else contextlib.nullcontext()
    with join:
        for i in range(0, len(batches), accumulate):
            opt.zero_grad()
            group = batches[i:i + accumulate]
            for j, (x, y) in enumerate(group):
                sync = contextlib.nullcontext() if j == len(group) - 1 else model.no_sync()
                with sync:
                    ((model(x) - y) ** 2).mean().backward()
            grads.append(_flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()))
            if not fused:
                opt.step()
            snapshots.append(_flat(model.parameters()))
    return grads, snapshots


def parity(rank: int, world_size: int, port: int, aggregator: str, configs: list[dict[str, Any]]) -> list[dict]:
    """For each config: DDP's default all-reduce vs omnireduce_hook (or the fused optimizer helper)
    from the same initial weights on the same data; the largest relative difference after each step."""
    out = []
    with process_group(rank, world_size, port):
        for n, cfg in enumerate(configs):
            torch.manual_seed(1234 + n)
            base = Net(unused=cfg.get("find_unused", False))
            ddp_kwargs = {"bucket_cap_mb": 0.02, "gradient_as_bucket_view": cfg.get("bucket_view", False),
                          "static_graph": cfg.get("static_graph", False),
                          "find_unused_parameters": cfg.get("find_unused", False)}
            steps = cfg.get("steps", 6) * cfg.get("accumulate", 1) + (rank if cfg.get("uneven") else 0)
            batches = _batches(rank, steps, n)
            ref = DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
            ref_opt = _optimizer(cfg.get("optimizer", "sgd"), ref.parameters())
            ref_grads, ref_snaps = _train(ref, ref_opt, batches, cfg, fused=False)
            mine = DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
            opt = _optimizer(cfg.get("optimizer", "sgd"), mine.parameters())
            state = OmniReduceState(aggregators=[aggregator], timeout=30, block_size=cfg.get("block_size", 64),
                                    dense_fallback=cfg.get("dense_fallback", "path" in cfg),
                                    dense_threshold=cfg.get("dense_threshold", 0.6),
                                    hierarchical=cfg.get("hierarchical"), path=cfg.get("path"),
                                    measure_trials=cfg.get("measure_trials", 3),
                                    remeasure_every=cfg.get("remeasure_every"),
                                    engine=cfg.get("engine", "auto"), sum_order=cfg.get("sum_order", "any"))
            hook = fuse_optimizer(omnireduce_hook, opt) if cfg.get("fused") else omnireduce_hook
            mine.register_comm_hook(state, hook)
            grads, snaps = _train(mine, opt, batches, cfg, fused=bool(cfg.get("fused")))
            diffs = [((a - b).abs() / (b.abs() + 1e-6)).max().item() for a, b in zip(snaps, ref_snaps, strict=True)]
            ok = [bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6)) for a, b in zip(snaps, ref_snaps, strict=True)]
            # reduced gradients: rounding of a different summation order only (Gloo's ring vs rank order)
            gscale = max(g.abs().max().item() for g in ref_grads)
            grad_ok = [bool(torch.allclose(a, b, rtol=1e-5, atol=1e-7 * gscale))
                       for a, b in zip(grads, ref_grads, strict=True)]
            moved = (snaps[-1] - torch.cat([p.reshape(-1) for p in base.parameters()])).abs().max().item()
            stats = state.stats()
            worker = state.worker.stats() if state.worker is not None else {}
            state.close()  # (the worker, and the collective engine's thread and group where it made one)
            unplain = plain.problems(stats) + plain.problems(worker, "worker.stats()")
            out.append({"config": cfg, "max_rel_diff": diffs, "allclose": ok, "grads_allclose": grad_ok, "moved": moved,
                        "unplain": unplain, "round_trips": not unplain and plain.round_trips([stats, worker]),
                        "stats": {k: v for k, v in stats.items() if k != "density"},
                        "buckets": len(stats["density"]), "block_size": state.block_size})
    return out


def aggregator_dies(rank: int, world_size: int, port: int, aggregator: str, agg_pid: int, hook_timeout: float) -> dict:
    """Train two steps, kill the aggregator (rank 0), train again: backward() must raise in time, and
    the process group must still work afterwards."""
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        model = DistributedDataParallel(Net(), bucket_cap_mb=0.02)
        state = OmniReduceState(aggregators=[aggregator], timeout=hook_timeout, dense_fallback=False)
        model.register_comm_hook(state, omnireduce_hook)
        batches = _batches(rank, 3, 0)
        for x, y in batches[:2]:
            ((model(x) - y) ** 2).mean().backward()
        dist.barrier()
        if rank == 0:
            os.kill(agg_pid, signal.SIGKILL)
        dist.barrier()
        t0 = time.monotonic()
        error = None
        try:
            x, y = batches[2]
            ((model(x) - y) ** 2).mean().backward()
        except Exception as e:  # what DDP surfaces from the hook's future
            error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - t0
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # the process group still works
        state.close()  # (its worker, once the last agreement finished on every rank)
        return {"error": error, "elapsed": elapsed, "after": t.item(), "failed": state.stats()["buckets_failed"]}


def sparse_gradients(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """A model with ``nn.Embedding(sparse=True)``: its sparse COO bucket goes through omnireduce by
    rows, like the dense buckets; parameters as with plain DDP."""
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Embedding(1000, 8, sparse=True), nn.Flatten(), nn.Linear(24, 600), nn.ReLU(),
                             nn.Linear(600, 600), nn.Linear(600, 1))
        ref = DistributedDataParallel(copy.deepcopy(base))
        mine = DistributedDataParallel(copy.deepcopy(base))
        state = OmniReduceState(aggregators=[aggregator], dense_fallback=False)
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
        ok = []
        for step in range(4):
            x = torch.randint(0, 1000, (4, 3), generator=torch.Generator().manual_seed(rank * 10 + step))
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        stats = state.stats()
        state.close()  # (its worker, once the last agreement finished on every rank)
        return {"ok": ok, "stats": {k: v for k, v in stats.items() if k != "density"}}


def pickled_state(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """Rank 0 pickles its state (as in a checkpoint); every rank trains with that copy: it must
    reconnect as its own rank, carry no token, and give the same parameters as plain DDP."""
    import pickle

    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = Net()
        state = OmniReduceState(aggregators=[aggregator], token="s3cret-t0ken", dense_fallback=False, block_size=64)
        state.iteration = 5
        blob = [pickle.dumps(state) if rank == 0 else None]
        dist.broadcast_object_list(blob, src=0)
        state.close()  # (its worker, once the last agreement finished on every rank)
        clone = pickle.loads(blob[0])
        ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        mine.register_comm_hook(clone, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, mine)]
        ok = []
        for x, y in _batches(rank, 3, 7):
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                o.step()
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        out = {"ok": ok, "rank": clone.rank, "world_size": clone.world_size, "iteration": clone.iteration,
               "token_in_blob": b"s3cret-t0ken" in blob[0], "sparse": clone.stats()["buckets_sparse"]}
        clone.close()
        return out


def dense_both_ways(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """One embedding bucket whose union density alternates: a batch touching most rows, then a
    batch touching a few. With dense_threshold 0.5 the bucket goes dense after a dense step (and at
    its first step, from the ranks' largest local density) and comes back to omnireduce after a
    sparse one; parameters as with plain DDP throughout."""
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = nn.EmbeddingBag(2000, 16, mode="sum")
        ref = DistributedDataParallel(copy.deepcopy(base))
        mine = DistributedDataParallel(copy.deepcopy(base))
        state = OmniReduceState(aggregators=[aggregator], dense_threshold=0.5, block_size=64)
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
        g = torch.Generator().manual_seed(rank)
        paths, ok = [], []
        for step in range(6):
            n = 1900 if step % 2 == 0 else 3  # rows touched by this rank's batch
            idx = torch.randperm(2000, generator=g)[:n].view(1, n)
            before = dict(state.stats())
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                m(idx).pow(2).sum().backward()
                o.step()
            after = state.stats()
            paths.append("dense" if after["buckets_dense"] > before["buckets_dense"] else "sparse")
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        state.close()  # (its worker, once the last agreement finished on every rank)
        stats = state.stats()
        return {"paths": paths, "ok": ok, "density": stats["density"], "probed": stats["buckets_probed"]}


def late_binding(rank: int, world_size: int, port: int) -> dict:
    """No aggregator anywhere: the state is made (and pickled, as a spawning launcher does) before
    init_process_group and before the model; it binds in the first hook call and starts the job's
    own (colocated) aggregator. Parameters as with plain DDP; the aggregator stops with close()."""
    import pickle

    os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    torch.set_num_threads(1)
    state = OmniReduceState(timeout=30, block_size=64, dense_fallback=False)  # torch.distributed not up yet
    state = pickle.loads(pickle.dumps(state))
    unbound = [not state.bound, state.worker is None, state.rank is None]
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        base = Net()
        ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, mine)]
        ok = []
        for x, y in _batches(rank, 4, 3):
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                o.step()
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        stats = state.stats()
        addresses = list(state.colocated.addresses)
        pids = [p.pid for p in state.colocated.processes]
        dist.barrier()
        state.close()
        return {"unbound": unbound, "ok": ok, "rank": state.rank, "world_size": state.world_size, "job": state.job,
                "addresses": addresses, "pids": pids, "token": state.worker.config.token is not None,
                "stats": {k: v for k, v in stats.items() if k != "density"}}


def colocated_failure(rank: int, world_size: int, ports: list[int], ifname: dict[int, str]) -> dict:
    """The node's aggregator cannot start (``OMNIREDUCE_IFNAME`` names no interface on the rank that
    starts it). Made after init_process_group, the state raises on every rank; made before, backward()
    raises on every rank, and again at once on the next step (no second attempt, no collective left
    waiting); both name the node and the cause, and the process group still works."""
    os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    if rank in ifname:
        os.environ["OMNIREDUCE_IFNAME"] = ifname[rank]
    try:
        constructor = None
        with process_group(rank, world_size, ports[0]):
            try:
                OmniReduceState(timeout=10)
            except Exception as e:
                constructor = f"{type(e).__name__}: {e}"
        state = OmniReduceState(timeout=10, dense_fallback=False)
        errors, times = [], []
        with process_group(rank, world_size, ports[1]):
            torch.manual_seed(0)
            model = DistributedDataParallel(Net(), bucket_cap_mb=0.02)
            model.register_comm_hook(state, omnireduce_hook)
            for x, y in _batches(rank, 2, 0):
                t0 = time.monotonic()
                try:
                    ((model(x) - y) ** 2).mean().backward()
                    errors.append(None)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                times.append(time.monotonic() - t0)
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
        return {"constructor": constructor, "errors": errors, "times": times, "after": t.item(),
                "failed": state.stats()["buckets_failed"]}
    finally:
        os.environ.pop("OMNIREDUCE_IFNAME", None)


def lost_aggregator(rank: int, world_size: int, port: int, aggregators: list[str] | None, steps: int = 40,
                    kill: dict[str, Any] | None = None, restart: dict[str, Any] | None = None,
                    nodes: list[int] | None = None, timeout: float = 20.0, hierarchical: bool | None = None,
                    settle: bool = False) -> dict:
    """Plain DDP, then omnireduce_hook from the same weights on the same data, while an aggregator is
    SIGKILLed mid-iteration by one rank (``kill``: rank, step, and pid, or ``colocated``: this rank's
    own aggregator) and maybe started again (``restart``: rank, step, cmd, pidfile; then every rank
    waits until it reaches it). ``nodes[r]``: rank r's node (for colocated aggregators and the
    hierarchy; ``hierarchical`` as the state's knob). ``settle``: the step after the kill, every rank
    waits until it finds the aggregator lost (where no step stalls on it, the step it is found lost
    at depends on the machine's speed). Returns the
    largest parameter difference from plain DDP over the steps and the state's stats."""
    if nodes is not None:
        os.environ["GROUP_RANK"] = str(nodes[rank])
        os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    with process_group(rank, world_size, port):
        torch.manual_seed(7)
        base = Net()
        batches = _batches(rank, steps, 7)
        cfg: dict[str, Any] = {}
        ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        _, ref_snaps = _train(ref, ref_opt, batches, cfg, fused=False)

        mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        state = OmniReduceState(aggregators=aggregators, timeout=timeout, dense_fallback=False,
                                hierarchical=hierarchical)
        killed: list[float] = []

        def hook(st, bucket):  # (no annotations: DDP checks them, and they are strings in this module)
            fut = omnireduce_hook(st, bucket)
            if kill and rank == kill["rank"] and st.iteration == kill["step"] and not killed:
                pid = st.colocated.processes[0].pid if kill.get("colocated") else kill["pid"]
                os.kill(pid, signal.SIGKILL)  # a bucket of this iteration is in flight
                killed.append(time.monotonic())
            return fut

        mine.register_comm_hook(state, hook)
        snaps, in_use, step_times = [], [], []
        for step, (x, y) in enumerate(batches):
            if settle and kill and step == kill["step"] + 1:
                deadline = time.monotonic() + 30
                while all(state.worker.reachable()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                dist.barrier()
            if restart and step == restart["step"]:
                if rank == restart["rank"]:
                    p = subprocess.Popen(restart["cmd"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    Path(restart["pidfile"]).write_text(str(p.pid))
                    assert p.stdout is not None and "listening" in p.stdout.readline()
                deadline = time.monotonic() + 30
                while not all(state.worker.reachable()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                dist.barrier()
            t0 = time.monotonic()
            opt.zero_grad()
            ((mine(x) - y) ** 2).mean().backward()
            opt.step()
            step_times.append(time.monotonic() - t0)
            snaps.append(_flat(mine.parameters()))
            in_use.append(len(state.stats()["aggregators_in_use"]))
        diff = max((a - b).abs().max().item() for a, b in zip(snaps, ref_snaps, strict=True))
        stats = state.stats()
        wstats = state.worker.stats()
        state.close()
        return {"steps": len(snaps), "max_abs_diff": diff, "in_use": in_use, "stats": {
            k: v for k, v in stats.items() if k != "density"}, "worker": wstats,
            "slowest_step": max(step_times), "killed": bool(killed)}


def rank_dies(rank: int, world_size: int, port: int, nodes: list[int], victim: int, step: int, hook_timeout: float,
              out: str, hierarchical: bool = True, engine: str = "auto") -> dict:
    """The hierarchy (or not) on ``nodes``, colocated aggregators, the given engine: rank ``victim``
    SIGKILLs itself at ``step``;
    every other rank writes to ``out``/rankR.json how long its failing step took and what it raised,
    and returns without tearing the process group down (its collectives with the dead rank would
    wait out their deadlines): the test replaces these processes afterwards."""
    import json

    os.environ["GROUP_RANK"] = str(nodes[rank])
    os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(7)
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.02)
    state = OmniReduceState(timeout=hook_timeout, dense_fallback=False, hierarchical=hierarchical, engine=engine)
    model.register_comm_hook(state, omnireduce_hook)
    error, elapsed = None, 0.0
    for i, (x, y) in enumerate(_batches(rank, step + 2, 3)):
        if i == step and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            ((model(x) - y) ** 2).mean().backward()
        except Exception as e:  # what DDP surfaces from the hook's future
            error, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - t0
            break
    result = {"error": error, "elapsed": elapsed, "hierarchical": state.stats()["hierarchical"]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    return result


def amp_parity(rank: int, world_size: int, port: int, aggregator: str, configs: list[dict[str, Any]],
               device: str = "cpu") -> list[dict]:
    """For each config: DDP under autocast with a GradScaler and a fused=True optimizer, fused into
    the hook (``fuse_optimizer(..., scaler=)``, loop ``scale(loss).backward(); update()``), against
    the same training without fusion through DDP's default all-reduce (``scaler.step(opt)``), from
    the same weights on the same data. After every step: the parameters and the scale of both.

    Config keys: ``dtype`` (autocast's: bfloat16/float16), ``optimizer`` (adamw/sgd), ``hook``
    (omnireduce/allreduce: torch's default all-reduce hook), ``inf_step`` (at that step rank 1's
    embedding gradient, in the last bucket DDP reduces, gets an inf), ``steps``, ``init_scale``,
    ``growth_interval``."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    out = []
    with process_group(rank, world_size, port):
        for n, cfg in enumerate(configs):
            out.append(_amp_config(rank, dev, aggregator, n, cfg))
    return out


def _amp_config(rank: int, dev: torch.device, aggregator: str, n: int, cfg: dict[str, Any]) -> dict:
    """One config of :func:`amp_parity`."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(4321 + n)
    base = Net().to(dev)
    dtype = getattr(torch, cfg.get("dtype", "bfloat16"))
    inf_step = cfg.get("inf_step", -1)
    batches = [(x.to(dev), y.to(dev)) for x, y in _batches(rank, cfg.get("steps", 6), 50 + n)]

    def make(params: Any) -> torch.optim.Optimizer:
        if cfg.get("optimizer", "adamw") == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)

    def train(model: DistributedDataParallel, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
              fused: bool) -> tuple[list[torch.Tensor], list[float]]:
        def poison(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g[0, 0] = float("inf")
            return g

        snaps, scales = [], []
        for step, (x, y) in enumerate(batches):
            handle = None
            if step == inf_step and rank == 1:
                handle = model.module.emb.weight.register_hook(poison)
            opt.zero_grad()
            with torch.autocast(dev.type, dtype=dtype):
                loss = ((model(x).float() - y) ** 2).mean()
            scaler.scale(loss).backward()
            if not fused:
                scaler.step(opt)
            scaler.update()
            if handle is not None:
                handle.remove()
            snaps.append(_flat(model.parameters()))
            scales.append(scaler.get_scale())
        return snaps, scales

    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler(dev.type, init_scale=cfg.get("init_scale", 2.0 ** 10),
                                    growth_interval=cfg.get("growth_interval", 2))

    ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
    ref_snaps, ref_scales = train(ref, make(ref.parameters()), scaler(), fused=False)

    mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
    opt, sc = make(mine.parameters()), scaler()
    state = None
    inner = allreduce_hook
    if cfg.get("hook", "omnireduce") == "omnireduce":
        state = OmniReduceState(aggregators=[aggregator], timeout=30, block_size=64, dense_fallback=False)
        inner = omnireduce_hook
    buckets: set[int] = set()

    def counted(st, bucket):  # (no annotations: DDP checks the registered hook's, not this one's)
        buckets.add(bucket.index())
        return inner(st, bucket)

    mine.register_comm_hook(state, fuse_optimizer(counted, opt, scaler=sc))
    snaps, scales = train(mine, opt, sc, fused=True)
    first = _flat(base.parameters())
    before = [first, *snaps[:-1]]
    result = {
        "config": cfg,
        "ok": [bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6)) for a, b in zip(snaps, ref_snaps, strict=True)],
        "max_abs_diff": [(a - b).abs().max().item() for a, b in zip(snaps, ref_snaps, strict=True)],
        "scales": scales, "ref_scales": ref_scales,
        "unchanged": [bool(torch.equal(a, b)) for a, b in zip(snaps, before, strict=True)],
        "ref_unchanged": [bool(torch.equal(a, b)) for a, b in zip(ref_snaps, before, strict=True)],
        "sparse": state.stats()["buckets_sparse"] if state is not None else None,
        "buckets": len(buckets),
    }
    if state is not None:
        state.close()
    return result



def amp_failed_bucket(rank: int, world_size: int, port: int) -> dict:
    """fuse_optimizer(..., scaler=) around a hook whose first bucket's reduction fails at the second
    step (after DDP's bucket rebuild): backward() must raise that error (no bucket future left
    waiting for a round that cannot step), and the parameters must not move."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # No teardown of the process group: after a failed backward, DDP's and Gloo's teardown hung now and
    # then (about 1 run in 4: every bucket's future had completed; a rank stayed in C++ when the model
    # was dropped); the test replaces these processes afterwards.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(), bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fail = [False]

    def broken(_f):
        raise RuntimeError("bucket 0 failed")

    def failing(st, bucket):
        # the reduction fails once its communication is done, on every rank alike
        fut = allreduce_hook(st, bucket)
        return fut.then(broken) if fail[0] and bucket.index() == 0 else fut

    model.register_comm_hook(None, fuse_optimizer(failing, opt, scaler=scaler))
    error, before, after = None, None, None
    for step, (x, y) in enumerate(_batches(rank, 2, 9)):
        opt.zero_grad()
        if step == 1:
            fail[0] = True
            before = _flat(model.parameters())
        t0 = time.monotonic()
        try:
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            scaler.update()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - t0
        after = _flat(model.parameters())
    _KEPT.append(model)  # (dropping it is what hung)
    return {"error": error, "elapsed": elapsed, "unchanged": bool(torch.equal(before, after))}


_KEPT: list[Any] = []  # models after a failed backward, kept until the test replaces the process


def join_live_ranks(rank: int, world_size: int, port: int, aggregator: str) -> dict:
    """Uneven inputs under ``join(divide_by_initial_world_size=False)``: rank r runs 3 + 2 r steps of a bias-free
    linear layer on inputs of 50, and each step's gradient (one element) is reported for three models: plain
    DDP, DDP with torch's ``allreduce_hook``, DDP with ``omnireduce_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    out: dict[str, list[float]] = {}
    with process_group(rank, world_size, port):
        for name in ("plain", "allreduce_hook", "omnireduce_hook"):
            torch.manual_seed(0)
            net = DistributedDataParallel(nn.Linear(3, 3, bias=False))
            state = None
            if name == "allreduce_hook":
                net.register_comm_hook(None, allreduce_hook)
            elif name == "omnireduce_hook":
                state = OmniReduceState(aggregators=[aggregator], timeout=30, dense_fallback=False)
                net.register_comm_hook(state, omnireduce_hook)
            grads = []
            with net.join(divide_by_initial_world_size=False):
                for _ in range(3 + 2 * rank):
                    net(torch.ones(1, 3) * 50).sum().backward()
                    grads.append(float(next(net.parameters()).grad[0, 0]))
                    net.zero_grad()
            if state is not None:
                state.close()
            out[name] = grads
    return out


def tensor_buckets(rank: int, world_size: int, port: int, aggregator: str, iterations: int) -> dict:
    """Plain tensors, not DDP buckets, through a bound state's runtime (what an integration other than
    DDP does: Bucket.of_tensor, Runtime.reduce_bucket, after_last_bucket): two tensors per iteration,
    one mostly zero, one dense, measured as DDP's buckets are. Each result against the float64 mean of
    every rank's input (made here for every rank from its seed)."""
    from omnireduce.ddp.bucket import Bucket

    def inputs(r: int, it: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * it + r)
        sparse = torch.zeros(40_000)
        sparse[torch.randint(0, 40_000, (300,), generator=g)] = torch.randn(300, generator=g)
        return [sparse, torch.randn(5_000, generator=g)]

    errors = []
    with process_group(rank, world_size, port):
        state = OmniReduceState(aggregators=[aggregator], timeout=30, block_size=64, measure_trials=1)
        runtime = state.bind()
        for it in range(iterations):
            mine = inputs(rank, it)
            futs = [runtime.reduce_bucket(Bucket.of_tensor(t, i, it, runtime.config.block_size, last=i == 1))
                    for i, t in enumerate(mine)]
            runtime.after_last_bucket(it, mine[0].device)
            for i, f in enumerate(futs):
                want = sum(inputs(r, it)[i].double() for r in range(world_size)) / world_size
                errors.append(float((f.wait().double() - want).abs().max()))
        stats = state.stats()
        state.close()
    return {"errors": errors, "paths": {i: p["path"] for i, p in stats["paths"].items()},
            "buckets": stats["buckets_sparse"] + stats["buckets_dense"]}


def two_models(rank: int, world_size: int, port: int, mode: str) -> dict:
    """Two DDP models in one job, as TorchRec has (its dense layers and its data-parallel tables).

    ``mode="shared"``: one state registered on both (the mistake): the second model's first bucket
    fails its backward with a ValueError that names the fix, and the first model keeps training.
    ``mode="sibling"``: a state and its ``sibling()``: parameters equal plain DDP's on both models,
    one set of colocated aggregators (the sibling starts none), separate job names."""
    os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    with process_group(rank, world_size, port):
        torch.manual_seed(0)
        bases = [Net(), nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 4))]
        refs = [DistributedDataParallel(copy.deepcopy(b), bucket_cap_mb=0.02) for b in bases]
        mine = [DistributedDataParallel(copy.deepcopy(b), bucket_cap_mb=0.02) for b in bases]
        first = OmniReduceState(timeout=30, block_size=64, path="omnireduce")
        states = [first, first if mode == "shared" else first.sibling()]
        for m, s in zip(mine, states, strict=True):
            m.register_comm_hook(s, omnireduce_hook)
        params = [p for m in refs for p in m.parameters()], [p for m in mine for p in m.parameters()]
        opts = [torch.optim.SGD(ps, lr=0.1) for ps in params]
        ok, errors = [], []
        for x, y in _batches(rank, 4, 5):
            for models, o in zip((refs, mine), opts, strict=True):
                o.zero_grad()
                ((models[0](x) - y) ** 2).mean().backward()
                try:
                    ((models[1](torch.randn(8, 16, generator=torch.Generator().manual_seed(len(ok)))) - y) ** 2
                     ).mean().backward()
                except Exception as e:  # (DDP raises the hook's error from backward())
                    errors.append(f"{type(e).__name__}: {e}")
                o.step()
            ok.append([torch.equal(a, b) for a, b in zip(*params, strict=True)])
        n0 = len(list(bases[0].parameters()))
        out = {"ok": ok, "errors": errors, "jobs": [s.job for s in states], "first_ok": [all(o[:n0]) for o in ok],
               "stats": [{k: v for k, v in s.stats().items() if k in ("buckets_sparse", "iteration")} for s in states],
               "colocated": [s.colocated is not None for s in states],
               "addresses": [list(s.worker.config.aggregators) for s in states]}
        pids = [p.pid for p in first.colocated.processes] if first.colocated is not None else []
        dist.barrier()
        for s in reversed(states):
            s.close()
        out["pids"] = pids
        return out


def collective_without_aggregators(rank: int, world_size: int, port: int) -> dict:
    """``engine="collective"``: no aggregator process starts and no port opens; the layout comes from
    the state's options; parameters equal plain DDP's, sparse COO tables included."""
    import psutil

    os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
    me = psutil.Process()
    def listening() -> set[int]:
        return {c.laddr.port for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    with process_group(rank, world_size, port):
        before = listening()
        dist.new_group(list(range(world_size)))  # what one Gloo process group of the job's ranks listens on
        per_group = len(listening() - before)
        before = listening()
        torch.manual_seed(0)
        base = Net()
        base.emb = nn.EmbeddingBag(20000, 16, mode="sum", sparse=True)  # (a sparse COO gradient too)
        ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
        state = OmniReduceState(engine="collective", block_size=32, lanes=64, slots=3, timeout=30, path="omnireduce")
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
        ok = []
        for x, y in _batches(rank, 3, 7):
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                o.step()
            ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                          for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
        new_ports = len(listening() - before)
        children = [c.cmdline() for c in me.children(recursive=True)]
        layout = state.bind().config
        stats = state.stats()
        dist.barrier()
        state.close()
        return {"ok": ok, "worker": state.worker is None, "colocated": state.colocated is None,
                "new_ports": new_ports, "per_group": per_group, "children": children,
                "layout": [layout.block_size, layout.lanes, layout.slots, layout.aggregators],
                "stats": {k: stats[k] for k in ("engine", "collective_reductions", "buckets_sparse", "buckets_failed")}}


class _Proposes:
    """What rides along in an agreement (omnireduce.ddp.routing.agreement.Rider): a fixed proposal."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def proposal(self, iteration: int) -> list[int]:
        return self.values

    def agreed(self, values: list[int], iteration: int) -> None:
        pass


def agreement_settles(rank: int, world_size: int, port: int, late: float, deadline: float) -> dict:
    """Rank 0 starts an agreement and settles it (as a closing state does) while rank 1 joins its
    all-reduce ``late`` seconds later: whether rank 0's work had finished when ``settle`` returned,
    and whether it finishes afterwards (a settle cut short by ``deadline``)."""
    from omnireduce.ddp.routing.agreement import Agreement

    with process_group(rank, world_size, port):
        agreement = Agreement()
        if rank == 1:
            time.sleep(late)
        agreement.after_last_bucket(0, torch.device("cpu"), _Proposes([rank + 1]))
        work = agreement._round.work  # (the all-reduce in flight)
        agreement.settle(deadline)
        done_at_settle = work.is_completed()
        work.wait()
        dist.barrier()
        return {"done_at_settle": done_at_settle, "round_left": agreement._round is not None,
                "min": agreement_flags(work)}


class _Progress:
    """A worker as the agreement sees it (omnireduce.ddp.routing.agreement.Aggregators): one aggregator
    it reaches, how far it has finished (set by the caller), and what it is told."""

    def __init__(self) -> None:
        self.finished = 0
        self.released: list[int] = []
        self.used: list[list[int]] = []

    def reachable(self) -> list[bool]:
        return [True]

    def use_aggregators(self, indices: list[int]) -> None:
        self.used.append(list(indices))

    def finished_below(self) -> int:
        return self.finished

    def release_kept(self, below: int) -> None:
        self.released.append(below)


def agreement_releases(rank: int, world_size: int, port: int, finished: list[list[int]]) -> dict:
    """Iteration i's agreement with this rank having finished ``finished[i][rank]`` tensors (and a
    rider's value along): what its worker is told at each next iteration's first bucket."""
    from omnireduce.ddp.routing.agreement import Agreement

    worker = _Progress()
    rider = _Proposes([-(rank + 1)])
    agreed: list[list[int]] = []
    rider.agreed = lambda values, iteration: agreed.append(list(values))  # type: ignore[method-assign]
    told: list[list[int]] = []
    with process_group(rank, world_size, port):
        agreement = Agreement(worker)
        for i, row in enumerate(finished):
            worker.finished = row[rank]
            agreement.after_last_bucket(i, torch.device("cpu"), rider)
            agreement.at_bucket(i + 1, rider)
            told.append(list(worker.released))
        dist.barrier()
    return {"told": told, "used": worker.used, "agreed": agreed}


def agreement_flags(work: Any) -> list[int]:
    """The all-reduced values of an agreement's finished work."""
    return [int(v) for v in work.result()[0].tolist()]

