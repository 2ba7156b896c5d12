"""A small DDP training run with omnireduce_hook, for launcher tests. ``--fail-rank R --code C``:
rank R exits with code C after the first step; ``--hang``: every rank waits forever after a step."""

import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, omnireduce_hook
from omnireduce.launch import init_distributed

ap = argparse.ArgumentParser()
ap.add_argument("--fail-rank", type=int, default=-1)
ap.add_argument("--code", type=int, default=1)
ap.add_argument("--hang", action="store_true")
args = ap.parse_args()
torch.set_num_threads(1)
rank, world = init_distributed()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Flatten(),
                                                    torch.nn.Linear(24, 1)))
state = OmniReduceState(timeout=30)
model.register_comm_hook(state, omnireduce_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randint(0, 5000, (16, 3), generator=torch.Generator().manual_seed(rank * 100 + step))
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.5f}", flush=True)
    if rank == args.fail_rank:
        print("failing on purpose", flush=True)
        sys.exit(args.code)
    if args.hang:
        print("hanging", flush=True)
        while True:
            time.sleep(1)
print(f"done, world {world}, sent {state.stats()['bytes_sent']} bytes, own aggregators {state.colocated is not None}",
      flush=True)
# Free the DDP model (and the Gloo work its buckets still hold) while the process group lives. Left to the
# interpreter's shutdown as a module global, this script aborted at exit in 1 run of 30 here ("terminate
# called without an active exception", torch 2.13, Gloo; once in CI); freed first, in none of 40.
del model, opt
gc.collect()
dist.destroy_process_group()
