"""Rank functions for test_hierarchy.py (run in the RankPool's processes): the three steps of the
hierarchy over real Gloo groups, with the rail reduced by Gloo or by omnireduce."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import omnireduce
from omnireduce.engines.hierarchy import Hierarchy, Topology, discover, wanted
from tests.ddp_cases import process_group

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _values(rank: int, seed: int, numel: int, density: float, dtype: torch.dtype) -> torch.Tensor:
    g = np.random.default_rng([seed, rank])
    x = g.standard_normal(numel).astype(np.float32)
    x[g.random(numel) >= density] = 0.0
    return torch.from_numpy(x).to(dtype)


def three_steps(rank: int, world_size: int, port: int, nodes: list[int], sizes: list[int], seed: int,
                dtype: str, rail: str, aggregator: str = "", job: str = "", density: float = 0.05,
                setting: bool | None = None, rows: tuple[int, ...] = (), device: str = "cpu") -> dict[str, Any]:
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

        def cross_rows(rail: torch.Tensor) -> Any:
            if worker is not None:
                return worker.allreduce_async(rail)
            return None if len(topo.nodes) == 1 else _GlooRows(rail, hier.rail_group)

        try:
            row_futures = [hier.reduce_rows(_rows(rank, seed + i, n, dt).to(device), cross_rows, divisor=world_size)
                           for i, n in enumerate(rows)]
            bufs = [_values(rank, seed + i, n, density, dt).to(device) for i, n in enumerate(sizes)]
            pause = np.random.default_rng([seed, rank, 1]).random(len(bufs)) * 0.01
            futures = []
            for b, p in zip(bufs, pause, strict=True):  # (spread out like DDP's buckets, differently per rank)
                futures.append(hier.reduce(b, cross, divisor=world_size))
                time.sleep(p)
            results = [f.wait().float().cpu().numpy().copy() for f in futures]
            row_results = [f.wait().to_dense().float().cpu().numpy().copy() for f in row_futures]
            coalesced = [bool(f.wait().is_coalesced()) for f in row_futures]
        finally:
            hier.close()
            if worker is not None:
                worker.close()
        expected = []
        for i, n in enumerate(sizes):
            total = sum(_values(r, seed + i, n, density, dt).double().numpy() for r in range(world_size))
            expected.append(np.asarray(total) / world_size if n else np.zeros(0))
        for i, n in enumerate(rows):
            total = sum(_rows(r, seed + i, n, dt).to_dense().double().numpy() for r in range(world_size))
            results.append(row_results[i])
            expected.append(np.asarray(total) / world_size)
        out.update(results=results, expected=expected, bytes_in_node=hier.bytes_in_node, coalesced=coalesced)
        return out


def _rows(rank: int, seed: int, n: int, dtype: torch.dtype, table: int = 500, dim: int = 8) -> torch.Tensor:
    """A sparse COO gradient of a ``table x dim`` embedding: ``n`` looked-up rows, duplicates included."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    idx = torch.randint(0, table, (1, n), generator=g)
    return torch.sparse_coo_tensor(idx, torch.randn(n, dim, generator=g).to(dtype), (table, dim))


class _GlooRows:
    """A rail's reduction of COO rows through its Gloo group (dense: the test's reference rail)."""

    def __init__(self, rail: torch.Tensor, group: Any) -> None:
        self.dense = rail.to_dense().float().cpu()  # (Gloo's sparse and CUDA support vary: host, dense)
        self.device = rail.device
        self.dtype = rail.dtype
        self.work = dist.all_reduce(self.dense, group=group, async_op=True)

    def wait(self, timeout: Any = None) -> None:
        self.work.wait()

    def value(self) -> torch.Tensor:
        return self.dense.to(self.dtype).to_sparse(1).to(self.device)


def topology_only(rank: int, world_size: int, port: int, nodes: list[int]) -> Topology:
    with process_group(rank, world_size, port):
        return discover(node=f"node{nodes[rank]}")
