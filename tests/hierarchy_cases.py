"""Rank functions for test_hierarchy.py (run in the RankPool's processes): the three steps of the
hierarchy over real Gloo groups, with the rail reduced by Gloo or by omnireduce."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import omnireduce
from omnireduce.hierarchy import Hierarchy, Topology, discover, wanted
from tests.ddp_cases import process_group

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _values(rank: int, seed: int, numel: int, density: float, dtype: torch.dtype) -> torch.Tensor:
    g = np.random.default_rng([seed, rank])
    x = g.standard_normal(numel).astype(np.float32)
    x[g.random(numel) >= density] = 0.0
    return torch.from_numpy(x).to(dtype)


def three_steps(rank: int, world_size: int, port: int, nodes: list[int], sizes: list[int], seed: int,
                dtype: str, rail: str, aggregator: str = "", job: str = "", density: float = 0.05,
                setting: bool | None = None) -> dict[str, Any]:
    """Rank ``rank`` on node ``nodes[rank]``: reduce one buffer of each size through the hierarchy
    (the rail by Gloo, or by omnireduce against ``aggregator``); returns the results, the float64
    sums of every rank's inputs, and the topology as this rank saw it."""
    torch.set_num_threads(1)
    dt = DTYPES[dtype]
    with process_group(rank, world_size, port):
        topo = discover(node=f"node{nodes[rank]}")
        on, why = wanted(setting, topo)
        out: dict[str, Any] = {"on": on, "why": why, "nodes": [list(n) for n in topo.nodes],
                               "local_rank": topo.local_rank}
        if not on:
            return out
        hier = Hierarchy(topo, timeout=30.0)
        worker = None
        if rail == "omnireduce":
            worker = omnireduce.Worker([aggregator], rank=topo.node, world_size=len(topo.nodes),
                                       job=f"{job}-rail{topo.local_rank}", timeout=30.0)

        def cross(shard: torch.Tensor) -> Any:
            if worker is not None:
                return worker.allreduce_async(shard)
            return dist.all_reduce(shard, group=hier.rail_group, async_op=True)

        try:
            bufs = [_values(rank, seed + i, n, density, dt) for i, n in enumerate(sizes)]
            pause = np.random.default_rng([seed, rank, 1]).random(len(bufs)) * 0.01
            futures = []
            for b, p in zip(bufs, pause, strict=True):  # (spread out like DDP's buckets, differently per rank)
                futures.append(hier.reduce(b, cross, divisor=world_size))
                time.sleep(p)
            results = [f.wait().float().numpy().copy() for f in futures]
        finally:
            hier.close()
            if worker is not None:
                worker.close()
        expected = []
        for i, n in enumerate(sizes):
            total = sum(_values(r, seed + i, n, density, dt).double().numpy() for r in range(world_size))
            expected.append(np.asarray(total) / world_size if n else np.zeros(0))
        out.update(results=results, expected=expected, bytes_in_node=hier.bytes_in_node)
        return out


def topology_only(rank: int, world_size: int, port: int, nodes: list[int]) -> Topology:
    with process_group(rank, world_size, port):
        return discover(node=f"node{nodes[rank]}")
