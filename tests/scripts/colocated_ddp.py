"""One rank of a DDP job given no aggregator addresses, under any launcher (torchrun, mpiexec,
omnireduce-run, or started directly with torchrun's variables): plain DDP and omnireduce_hook train
side by side from the same weights on the same data, and the rank prints one JSON line.

``--kill-after K``: train K steps with the hook only, print a "paused" JSON line (with this rank's pid
and the aggregators it started), wait 3 s (the test kills a rank meanwhile), train one more step
and report what backward() raised and how long it took."""

import argparse
import copy
import gc
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, omnireduce_hook
from omnireduce.launch import init_distributed

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--timeout", type=float, default=30)
ap.add_argument("--kill-after", type=int, default=-1)
args = ap.parse_args()
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
torch.set_num_threads(1)
state = OmniReduceState(timeout=args.timeout, block_size=64, dense_fallback=False)  # before init: binds late
rank, world = init_distributed()
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.EmbeddingBag(20000, 16, mode="sum"), torch.nn.Linear(16, 256), torch.nn.ReLU(),
                           torch.nn.Linear(256, 1))
mine = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02)
mine.register_comm_hook(state, omnireduce_hook)
models = [mine] if args.kill_after >= 0 else [DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.02), mine]
opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]


def step(i: int) -> None:
    g = torch.Generator().manual_seed(rank * 1000 + i)
    x, y = torch.randint(0, 20000, (8, 5), generator=g), torch.randn(8, 1, generator=g)
    for m, o in zip(models, opts, strict=True):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.step()


def aggregator_pids() -> list[int]:
    return [p.pid for p in state.colocated.processes] if state.colocated is not None else []


if args.kill_after >= 0:
    for i in range(args.kill_after):
        step(i)
    print(json.dumps({"rank": rank, "paused": True, "pid": os.getpid(), "aggregator_pids": aggregator_pids()}),
          flush=True)
    time.sleep(3)
    t0 = time.monotonic()
    try:
        step(args.kill_after)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"rank": rank, "error": error, "elapsed": time.monotonic() - t0}), flush=True)
    os._exit(0)  # a peer is gone: no goodbyes

ok = []
for i in range(args.steps):
    step(i)
    ok.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                  for a, b in zip(models[0].parameters(), mine.parameters(), strict=True)))
moved = max((a - b).abs().max().item() for a, b in zip(base.parameters(), mine.parameters(), strict=True))
s = state.stats()
print(json.dumps({"rank": rank, "world": world, "ok": ok, "moved": moved, "node": state.colocated.node,
                  "addresses": state.colocated.addresses, "aggregator_pids": aggregator_pids(),
                  "sent_fraction": s["sent_fraction"], "buckets_sparse": s["buckets_sparse"],
                  "buckets_failed": s["buckets_failed"]}), flush=True)
dist.barrier()
state.close()
models.clear(), opts.clear()  # free the DDP models (and their buckets' Gloo work) while the process group lives
del mine
gc.collect()
dist.destroy_process_group()
sys.exit(0)
