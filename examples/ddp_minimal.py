"""The smallest DDP training script with the omnireduce hook: the README's snippet as a whole file.

    omnireduce-run --nproc 2 examples/ddp_minimal.py
    torchrun --nproc-per-node 2 examples/ddp_minimal.py
    mpiexec -n 2 python examples/ddp_minimal.py

Two lines differ from plain DDP: the import and ``register_comm_hook``. The hook averages gradients
like DDP's default all-reduce, so the training loop does not change. Each bucket is timed through
omnireduce and through the dense all-reduce for its first 8 steps, then takes the faster: the
script prints what it chose. No aggregator to set up: with
no ``OMNIREDUCE_AGGREGATORS``, the job starts its own (one per node, from the node's first rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, omnireduce_hook
from omnireduce.launch import init_distributed


def main() -> None:
    torch.set_num_threads(1)
    rank, _ = init_distributed()  # torchrun's variables, or mpiexec's ranks; Gloo on CPU
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(100_000, 32, mode="sum"), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    state = OmniReduceState()
    ddp.register_comm_hook(state, omnireduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(20):  # (the first 12 or so time each path; see stats()["paths"] below)
        ids = torch.randint(0, 100_000, (64, 8), generator=gen)  # each step touches a few rows
        target = torch.randn(64, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(ids), target)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    s = state.stats()
    print(f"rank {rank}: sent {s['bytes_sent'] / 1e6:.2f} MB where a ring all-reduce sends "
          f"{s['dense_equivalent_bytes'] / 1e6:.2f} MB ({s['buckets_sparse']} buckets through omnireduce)")
    for index, p in s["paths"].items():  # each bucket was timed through each path, then took the fastest
        timed = ", ".join(f"{k[:-3]} {v} ms" for k, v in p.items() if k.endswith("_ms"))
        print(f"rank {rank}: bucket {index} takes {p['path']}: {timed}")
    state.close()  # the last agreement finished, the worker gone, then this rank's aggregator
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
