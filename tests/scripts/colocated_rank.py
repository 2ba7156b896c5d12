"""One rank of a colocated-aggregator test: start the job's aggregators, all-reduce, report as JSON.

argv: mode ("reduce" | "hold"). "hold" prints the addresses and then sleeps (to be killed)."""

import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import omnireduce
from omnireduce.colocate import start_colocated

torch.set_num_threads(1)
mode = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
try:
    aggs = start_colocated(timeout=30)
except omnireduce.OmniReduceError as e:
    print(json.dumps({"rank": rank, "error": str(e)}), flush=True)
    sys.stderr.flush()
    os._exit(3)  # not sys.exit: tearing down a process group whose peer is gone may abort the interpreter
pids = [p.pid for p in aggs.processes]
if mode == "hold":
    print(json.dumps({"rank": rank, "addresses": aggs.addresses, "pids": pids}), flush=True)
    time.sleep(600)
with omnireduce.Worker(aggs.addresses, rank=rank, world_size=world, token=aggs.token, job="colocated",
                       timeout=20) as w:
    x = np.zeros(100_003, np.float32)
    x[rank * 1000: rank * 1000 + 300] = rank + 1.0
    w.allreduce(x)
    want = np.zeros_like(x)
    for r in range(world):
        want[r * 1000: r * 1000 + 300] += r + 1.0
    ok = bool(np.array_equal(x, want))
print(json.dumps({"rank": rank, "addresses": aggs.addresses, "pids": pids, "node": aggs.node, "ok": ok}),
      flush=True)
dist.barrier()
aggs.close()
dist.destroy_process_group()
