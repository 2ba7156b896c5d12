"""The collective engine's own cost per reduction with one rank (no collective to wait for): its host
path through numpy's kernel exchange (OMNIREDUCE_ENGINE_KERNELS=1) against the torch ops, 2,000
reductions of a bucket with one non-zero block, taking turns; median wall time and mean CPU time.
Usage: python one_rank.py ELEMENTS [--port 29641]"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("elements", type=int)
p.add_argument("--port", type=int, default=29641)
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=0, world_size=1)
from omnireduce.engines import collective  # noqa: E402

engine = collective.CollectiveEngine(dist.new_group(backend="gloo"), block_size=256, lanes=1, slots=1,
                                     exchange="gather")
x = torch.zeros(a.elements)
x[7 * 256: 8 * 256] = 1.0
wall: dict[str, list[float]] = {"numpy": [], "torch": []}
cpu: dict[str, list[float]] = {"numpy": [], "torch": []}
for _ in range(2000):
    for way in wall:
        os.environ["OMNIREDUCE_ENGINE_KERNELS"] = "1" if way == "numpy" else "0"
        t = x.clone()
        c0, t0 = time.process_time(), time.perf_counter()
        engine.allreduce_async(t).wait()
        wall[way].append(time.perf_counter() - t0)
        cpu[way].append(time.process_time() - c0)
engine.release()
for way in wall:
    print(f"{a.elements} elements, {way}: wall {statistics.median(wall[way][100:]) * 1e6:.1f} us (median), "
          f"cpu {statistics.mean(cpu[way][100:]) * 1e6:.1f} us (mean)")
dist.destroy_process_group()
