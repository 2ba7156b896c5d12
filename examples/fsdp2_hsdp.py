"""HSDP with FSDP2 and omnireduce across the nodes: a recommender sharded inside each node, replicated across.

    torchrun --nproc-per-node 4 examples/fsdp2_hsdp.py              # 4 CPU ranks as 2 "nodes" x 2 (Gloo)
    torchrun --nproc-per-node 4 examples/fsdp2_hsdp.py --native     # the same with native HSDP
    torchrun --nproc-per-node 4 examples/fsdp2_hsdp.py --path threshold   # each module's way by its density
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/fsdp2_hsdp.py --ranks-per-node 8

The mesh is 2-D, ``("replicate", "shard")``: ``--ranks-per-node`` ranks share a shard group (a
node), and the nodes replicate. Native HSDP shards on that mesh and all-reduces each FSDP module's
reduce-scatter output across the nodes; with omnireduce the modules are sharded on
``mesh["shard"]`` only and ``use_omnireduce(model, mesh=mesh)`` does the cross-node reduction:
each module's way is timed on it over the first steps and the faster kept, the same on every rank of
its replicate group (``--path threshold``: chosen by its density instead). The embedding table's
shard, mostly zero, can travel as its non-zero blocks; the MLP, small and dense, takes a plain
all-reduce. The parameters are native HSDP's: the runs print the same losses. Each rank prints what
it sent and each module's way.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from omnireduce.integrations import use_omnireduce
from omnireduce.launch import init_distributed

ROWS, DIM, BATCH, IDS = 10_000, 64, 16, 4


class Recommender(nn.Module):
    """An embedding table (bags of ids) under a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids)).sum(-1)


def say(line: str) -> None:
    """One line in one write: the ranks share stdout, and print's separate newline lets them interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags of Zipf-distributed ids (a few dozen rows touched per rank and step) and targets."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.2
    ids = (torch.multinomial(weights, BATCH * IDS, replacement=True, generator=g) * 7_927) % ROWS
    return ids.view(BATCH, IDS), torch.randn(BATCH, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks-per-node", type=int, default=2, help="ranks per shard group (default 2)")
    ap.add_argument("--native", action="store_true", help="native HSDP (fully_shard on the 2-D mesh) instead")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--path", default="measure", help="each module's way: measure (default), threshold, omnireduce, "
                    "dense")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = init_distributed()  # torchrun's variables; Gloo on CPU
    nodes = world // args.ranks_per_node
    mesh = init_device_mesh("cpu", (nodes, args.ranks_per_node), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)
    model = Recommender()
    shard_on = mesh if args.native else mesh["shard"]  # the one difference in how the model is sharded
    for block in (model.table, model.mlp):
        fully_shard(block, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    reduced = None if args.native else use_omnireduce(model, mesh=mesh, path=args.path)

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(args.steps):
        ids, target = batch(rank, step)
        loss = ((model(ids) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            say(f"step {step}: loss {loss.item():.6f}")
    if reduced is not None:
        s = reduced.stats()
        say(f"rank {rank}: sent {s['bytes_sent'] / 1e6:.3f} MB across the nodes where native HSDP's all-reduce "
              f"sends {s['dense_equivalent_bytes'] / 1e6:.3f} MB ({s['sent_fraction']:.1%})")
        for name, m in s["per_module"].items():
            density = "not counted" if m["union_density"] is None else f"{m['union_density']:.3f}"
            say(f"rank {rank}: {name}: {m['path']}, union density {density}, "
                  f"{m['sent_fraction']:.1%} of the dense bytes")
        reduced.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
