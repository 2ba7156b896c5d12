"""FSDP2 runs executed inside the test pool's rank processes (see tests/test_fsdp.py).

Four ranks on a real Gloo process group, a 2-D DeviceMesh ("replicate", "shard") of 2 "nodes" x 2:
each function trains (or reduces, or refuses) and returns plain data for the test to judge.
The reference of every training is native HSDP (``fully_shard`` on the 2-D mesh) run in the same
processes on the same batches; the reference of the reducer is the float64 sum of the replicas'
inputs (tests/harness.py).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from omnireduce.integrations import use_omnireduce
from omnireduce.integrations.fsdp.units import check_torch, torch_release
from tests.ddp_cases import process_group


def refused_torch() -> str | None:
    """Why the FSDP2 integration refuses this torch (its own error, naming what is missing), or None."""
    try:
        check_torch()
    except RuntimeError as e:
        return str(e)
    return None


#: Tests that train or refuse through the integration: on a torch it refuses, skipped with its reason
#: (tests/test_torch_versions.py checks the refusal itself).
needs_fsdp_torch = pytest.mark.skipif(refused_torch() is not None, reason=str(refused_torch()))

#: Native HSDP, the trainings' reference, with a gradient divide factor equal to the shard group's size
#: reduce-scatters with AVG from torch 2.10; torch 2.9 asks Gloo for PREMUL_SUM, which Gloo does not have.
native_divide_factor_on_gloo = pytest.mark.skipif(
    torch_release(torch.__version__) < (2, 10),
    reason=f"native HSDP (the reference) with a gradient divide factor on Gloo needs torch 2.10 (torch 2.9 asks "
           f"Gloo for ReduceOp.PREMUL_SUM, which Gloo lacks); this is torch {torch.__version__}")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROWS, DIM = 10_000, 64


class Recommender(nn.Module):
    """A 10,000 x 64 EmbeddingBag (bags of 4 Zipf-distributed ids) under a small MLP: the table is
    97% of the parameters and about 1% of its rows get a gradient per step over the 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.mlp(self.table(ids)).sum(-1) - y) ** 2).mean()

    def blocks(self) -> list[nn.Module]:
        return [self.table, self.mlp[0], self.mlp[2]]


class Dense(nn.Module):
    """Three GELU layers, 48 wide: every gradient element non-zero every step."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.layers(x).sum(-1) - y) ** 2).mean()

    def blocks(self) -> list[nn.Module]:
        return [self.layers[0], self.layers[2], self.layers[4]]


MODELS = {"recsys": Recommender, "dense": Dense}


def batch(model: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs at ``step`` (the same for both trainings): 16 bags of 4 ids drawn from
    a Zipf law of exponent 1.2 over the table's rows, or 16 Gaussian rows; Gaussian targets."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    if model == "recsys":
        weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(weights, 64, replacement=True, generator=g).view(16, 4)
        # (frequency ranks scattered over the table, so that hot rows are not all in one shard)
        ids = (ids * 7_927) % ROWS
        return ids, torch.randn(16, generator=g)
    return torch.randn(16, 32, generator=g), torch.randn(16, generator=g)


def _build(cfg: dict[str, Any], mesh: Any) -> nn.Module:
    torch.manual_seed(cfg.get("seed", 0))
    model = MODELS[cfg["model"]]().to(cfg.get("device", "cpu"))  # (made on the CPU: the same weights anywhere)
    dtype = DTYPES[cfg.get("reduce_dtype", "float32")]
    mp = MixedPrecisionPolicy(reduce_dtype=dtype if dtype != torch.float32 else None)
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": cfg.get("reshard", True)}
    if cfg.get("blocks", False) == "grouped":  # one fully_shard over a list of modules: one unit
        fully_shard(model.blocks(), **kw)
    elif cfg.get("blocks", False):
        for block in model.blocks():
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    if cfg.get("divide_factor"):  # (on every FSDP module: the call sets its own module's groups only)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(cfg["divide_factor"])
    return model


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _diff(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        x, y = _local(p).detach(), _local(q).detach()
        assert x.shape == y.shape, (name, x.shape, y.shape)
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _step(model: nn.Module, opt: torch.optim.Optimizer, cfg: dict[str, Any], rank: int, step: int) -> None:
    """One optimizer step; with ``accumulate``, two backwards per step, the first without gradient
    sync (``set_requires_gradient_sync(False)``). The batch on ``cfg["device"]`` (default the CPU)."""
    micro = 2 if cfg.get("accumulate") else 1
    dev = torch.device(cfg.get("device", "cpu"))
    for i in range(micro):
        model.set_requires_gradient_sync(i == micro - 1)
        model(*(t.to(dev) for t in batch(cfg["model"], rank, step * micro + i))).backward()
    opt.step()
    opt.zero_grad()


def _optimizer(cfg: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """Adam (lr 0.01), or with ``optimizer="sgd"`` plain SGD (lr 0.05): its steps scale with the
    gradients, where Adam's barely do (a gradient summed where it should be averaged shows only so)."""
    if cfg.get("optimizer") == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def compare(rank: int, mesh: Any, cfg: dict[str, Any], watch: Any = None) -> dict[str, Any]:
    """Native HSDP and HSDP through omnireduce, trained side by side: the largest parameter
    difference after each step, the handle's stats, and both trainings' time. ``watch``: a context
    manager entered around omnireduce's steps after the second (the GPU check's sync watch)."""
    native = _build(cfg, mesh)
    ours = _build(cfg, mesh["shard"])
    reduced = use_omnireduce(ours, mesh=mesh, **cfg.get("options", {}))
    opts = [_optimizer(cfg, m) for m in (native, ours)]
    diffs, times = [], [0.0, 0.0]
    try:
        for step in range(cfg.get("steps", 20)):
            for i, (m, o) in enumerate(zip((native, ours), opts, strict=True)):
                t0 = time.perf_counter()
                if i == 1 and watch is not None and step >= 2:
                    with watch:
                        _step(m, o, cfg, rank, step)
                else:
                    _step(m, o, cfg, rank, step)
                times[i] += time.perf_counter() - t0
            diffs.append(_diff(native, ours))
    finally:
        reduced.close()
    moved = _diff(_build(cfg, mesh), native)  # (the training moved the parameters: the comparison means something)
    return {"config": cfg, "diffs": diffs, "moved": moved, "stats": reduced.stats(), "names": reduced.names,
            "times": times}


def train(rank: int, world_size: int, port: int, configs: list[dict[str, Any]],
          shape: tuple[int, int] = (2, 2)) -> list[dict[str, Any]]:
    """:func:`compare` for each of ``configs`` on one mesh of ``shape`` (nodes x ranks per node)."""
    with process_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))
        return [compare(rank, mesh, cfg) for cfg in configs]


def replicas(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], path: str,
             average: bool, shape: tuple[int, int] = (2, 2)) -> list[Any]:
    """Reduce each case's input across this rank's replicas through the reducer alone (``path``
    forced, the collective engine as omnireduce's way) on a mesh of ``shape``: rank r is replica
    ``r // S`` of shard ``r % S``; each shard's replicas reduce the case of seed ``seed + shard``, all
    in one backward pass. Returns the results as float64 lists (NaN as NaN) and the recorder's stats."""
    from omnireduce.ddp.options import Options
    from omnireduce.integrations.fsdp.recorder import Recorder
    from omnireduce.integrations.fsdp.reducer import Replicas
    from tests.harness import Case, make_input, to_numpy

    with process_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))
        shards = shape[1]
        options = Options.resolve(path=path, engine="collective", timeout=30.0, hierarchical=False)
        recorder = Recorder([f"case{i}" for i in range(len(cases))])
        reducer = Replicas.bind(mesh, options, recorder)
        out = []
        try:
            for key, c in enumerate(cases):
                case = Case(**{**c, "seed": c["seed"] + rank % shards, "kind": "torch"})
                x = make_input(case, rank // shards).reshape(-1)
                got = reducer.reduce(x, key, iteration=0, average=average, block_size=case.block_size).wait()
                assert got is x, "the reducer reduces in place"
                out.append(to_numpy(x).tolist())
            reducer.after_backward(0, torch.device("cpu"))
        finally:
            reducer.close()
        return [out, recorder.stats()]


def refusals(rank: int, world_size: int, port: int) -> dict[str, str]:
    """Each unsupported setting's error (type and message), by name; ``None`` where nothing was raised."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard

    from omnireduce.ddp import OmniReduceState

    def attempt(fn: Any) -> str | None:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    with process_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        out: dict[str, str | None] = {}

        def sharded(on: Any, **kw: Any) -> nn.Module:
            torch.manual_seed(0)
            return fully_shard(Dense(), mesh=on, **kw)

        out["native_hsdp"] = attempt(lambda: use_omnireduce(sharded(mesh), mesh=mesh))
        out["other_1d_mesh"] = attempt(lambda: use_omnireduce(sharded(mesh["replicate"]), mesh=mesh))
        if hasattr(_fsdp_common, "ShardPlacementResult"):  # (per-parameter meshes: torch 2.13 on)
            other = _fsdp_common.FSDPMeshInfo(mesh["replicate"], shard_mesh_dim=0)
            per_param = lambda p: _fsdp_common.ShardPlacementResult(Shard(0), other) if p.dim() == 1 else None  # noqa: E731
            out["per_param_mesh"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"], shard_placement_fn=per_param),
                                                                   mesh=mesh))
        out["one_d_mesh"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"]), mesh=mesh["shard"]))
        named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
        out["dim_names"] = attempt(lambda: use_omnireduce(sharded(named["fsdp"]), mesh=named))
        out["not_fsdp"] = attempt(lambda: use_omnireduce(Dense(), mesh=mesh))
        out["no_mesh"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"])))
        out["ddp_state"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"]), cast(OmniReduceState, object()),
                                                          mesh=mesh))
        out["bad_path"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"]), mesh=mesh, path="fastest"))
        out["bad_engine"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"]), mesh=mesh, engine="fastest"))
        os.environ.pop("OMNIREDUCE_AGGREGATORS", None)
        out["aggregators_without_addresses"] = attempt(lambda: use_omnireduce(sharded(mesh["shard"]), mesh=mesh,
                                                                              engine="aggregators"))
        model = sharded(mesh["shard"])
        model.set_all_reduce_hook(lambda t: None)
        out["hook_already"] = attempt(lambda: use_omnireduce(model, mesh=mesh))
        # closed: the next backward fails, naming the module and saying why
        model = sharded(mesh["shard"])
        reduced = use_omnireduce(model, mesh=mesh)
        model(*batch("dense", rank, 0)).backward()
        reduced.close()
        out["after_close"] = attempt(lambda: model(*batch("dense", rank, 1)).backward())
        return out


def expected_rows(steps: int = 20) -> float:
    """The mean fraction of the table's rows the 4 ranks' batches touch per step (for the test's
    claim that the recommender is about 1% dense)."""
    fractions = []
    for step in range(steps):
        rows = torch.cat([batch("recsys", r, step)[0].reshape(-1) for r in range(4)])
        fractions.append(rows.unique().numel() / ROWS)
    return sum(fractions) / len(fractions) if fractions else math.nan


def a_node_stays_away(rank: int, world_size: int, port: int, path: str, limit: float) -> dict[str, Any]:
    """Node 1's ranks (2 and 3) train one step and then skip the second backward: node 0's ranks
    must fail that backward within ``limit`` seconds (and a little) with an error that says what failed
    where, not hang. Returns the error (None on node 1) and how long the failing backward took."""
    with process_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        cfg = {"model": "recsys", "blocks": True}
        model = _build(cfg, mesh["shard"])
        reduced = use_omnireduce(model, mesh=mesh, path=path, timeout=limit)
        out: dict[str, Any] = {"error": None, "seconds": None}
        try:
            model(*batch("recsys", rank, 0)).backward()
            if rank < 2:
                t0 = time.monotonic()
                try:
                    model(*batch("recsys", rank, 1)).backward()
                except Exception as e:
                    out["error"] = f"{type(e).__name__}: {e}"
                out["seconds"] = time.monotonic() - t0
        finally:
            reduced.close()
        dist.barrier()  # (on the default group: every rank leaves together, node 1 after node 0 has failed)
        return out
