"""One case of the benchmark (a tensor size, a density, a placement): the methods timed, checked, counted.

Timed in the same run, taking turns repeat by repeat (:mod:`omnireduce.bench.timing`):

- ``unit``: ``torch.distributed.all_reduce`` of one element: the group's latency unit;
- ``dense``: ``torch.distributed.all_reduce`` of the tensor (what the program would otherwise call);
- ``engine``: ``omnireduce.distributed.all_reduce`` through the collective engine;
- ``aggregators``: the same through the aggregators, where ``OMNIREDUCE_AGGREGATORS`` names them;
- ``hook``: with ``--vs-hook``, the DDP hook's collective engine on the same tensor
  (:mod:`omnireduce.bench.hook`).

Per method: the median time, its algorithm bandwidth (the tensor's bytes over the time) and bus
bandwidth (that times ``2 (W-1)/W``, as NCCL's tests report an all-reduce: the ring's bytes per rank
over the time), the time in latency units, the speedup over ``dense``, the bytes this rank sent per
reduction (omnireduce's counters) against the dense ring's ``2 (W-1)/W`` of the tensor (for the
engine also its thread's CPU per reduction, ``engine_host_us``, and its collectives), and with
``check`` the elements that differ from the dense all-reduce's result by more than summation order
can make them differ (``2 W`` unit roundoffs of the sum of magnitudes; NaN where it has NaN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import omnireduce.distributed as odist
from omnireduce.bench import inputs
from omnireduce.bench.timing import Run, interleaved
from omnireduce.config import env_aggregators

ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@dataclasses.dataclass
class Setup:
    """What every case shares: the device, the op (AVG or SUM), the groups omnireduce's calls use (the
    engine's; the aggregators' or None), the DDP comparison (or None), the repeats."""

    device: torch.device
    average: bool
    engine_group: Any
    aggregators_group: Any
    hook: Any
    warmup: int
    repeats: int
    block: int = 256


@contextlib.contextmanager
def _without(name: str) -> Iterator[None]:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def groups(device: torch.device) -> tuple[Any, Any]:
    """The groups the engine's and the aggregators' calls go through: the default group and, where
    ``OMNIREDUCE_AGGREGATORS`` is set, a second group of every rank for the engine (its runtime built
    without the aggregators). Collective."""
    if not env_aggregators():
        odist.all_reduce(torch.zeros(1, device=device))  # (the runtime built before the timing)
        return None, None
    engine = dist.new_group()
    with _without("OMNIREDUCE_AGGREGATORS"):
        odist.all_reduce(torch.zeros(1, device=device), group=engine)
    odist.all_reduce(torch.zeros(1, device=device))
    return engine, dist.group.WORLD


def run_case(setup: Setup, numel: int, density: float, placement: str, dtype: torch.dtype,
             check: bool) -> dict[str, Any]:
    """One row (see the module)."""
    W, dev = dist.get_world_size(), setup.device
    x = inputs.sparse(numel, density, rank=dist.get_rank(), block=setup.block, placement=placement, dtype=dtype,
                      device=dev)
    op = dist.ReduceOp.AVG if setup.average else dist.ReduceOp.SUM
    runs = {"unit": Run(dist.all_reduce, torch.ones(1, device=dev)), "dense": Run(_dense(setup.average, W), x)}
    runs["engine"] = Run(lambda t: odist.all_reduce(t, op=op, group=setup.engine_group), x)
    if setup.aggregators_group is not None:
        runs["aggregators"] = Run(lambda t: odist.all_reduce(t, op=op, group=setup.aggregators_group), x)
    if setup.hook is not None:
        runs["hook"] = setup.hook.run_for(x)
    before = {k: odist.stats(_group(setup, k)) for k in ("engine", "aggregators") if k in runs}
    hook_sent = setup.hook.bytes_sent() if setup.hook is not None else 0
    times = interleaved(runs, setup.warmup, setup.repeats, dev)
    nbytes = numel * x.element_size()
    ring = 2 * (W - 1) * nbytes // W if W > 1 else 0
    row: dict[str, Any] = {"elements": numel, "bytes": nbytes, "dtype": str(dtype).removeprefix("torch."),
                           "density": density, "placement": placement, "op": "avg" if setup.average else "sum",
                           "world": W, "unit_us": times["unit"] * 1e6, "ring_bytes": ring}
    done = setup.warmup + setup.repeats
    mag = _magnitude(x) if check else None
    for name in runs:
        if name == "unit":
            continue
        t = times[name]
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_algbw"] = nbytes / t / 1e9 if t > 0 else float("nan")
        row[f"{name}_busbw"] = row[f"{name}_algbw"] * (2 * (W - 1) / W if W > 1 else 1.0)
        row[f"{name}_units"] = t / times["unit"] if times["unit"] > 0 else float("nan")
        if name != "dense":
            row[f"{name}_speedup"] = times["dense"] / t if t > 0 else float("nan")
        if name in before:
            after = odist.stats(_group(setup, name))
            row[f"{name}_bytes"] = (after.get("bytes_sent", 0) - before[name].get("bytes_sent", 0)) / done
            if "host_s" in after:  # the collective engine's own counts: its thread's CPU, collectives, waits
                row[f"{name}_host_us"] = (after["host_s"] - before[name].get("host_s", 0.0)) / done * 1e6
                row[f"{name}_collectives"] = (after["collectives"] - before[name].get("collectives", 0)) / done
        if name == "hook":
            row["hook_bytes"] = (setup.hook.bytes_sent() - hook_sent) / done
        if mag is not None and name != "dense":
            row[f"{name}_wrong"] = _wrong(runs[name].output(), runs["dense"].work, mag, W, setup.average)
    return row


def _group(setup: Setup, name: str) -> Any:
    return setup.engine_group if name == "engine" else setup.aggregators_group


def _dense(average: bool, world: int) -> Any:
    """torch's all-reduce as the program would call it (AVG: the backend's where it has one, else the sum
    divided)."""
    if not average:
        return dist.all_reduce

    def run(t: torch.Tensor) -> None:
        if "nccl" in str(dist.get_backend()).lower():
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(t)
            t.div_(world)

    return run


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of every element's magnitude, in float32 (the scale of summation errors)."""
    mag = x.abs().float()
    dist.all_reduce(mag)
    return mag


def _wrong(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, world: int, average: bool) -> int:
    """Elements of ``got`` that differ from ``want`` by more than summation order explains (see the
    module), counted over every rank."""
    g, w = got.float(), want.float()
    scale = mag / world if average else mag
    tol = 2 * world * ROUNDOFF[got.dtype] * scale + 1e-30
    nan = torch.isnan(g) != torch.isnan(w)
    both = torch.isfinite(g) & torch.isfinite(w)
    bad = nan | (both & ((g - w).abs() > tol)) | (~both & ~torch.isnan(g) & (g != w))
    count = torch.tensor([int(bad.sum())], dtype=torch.int64, device=got.device)
    dist.all_reduce(count)
    return int(count.item())
