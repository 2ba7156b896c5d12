"""The collective engine's host path through numpy's kernel exchange (OMNIREDUCE_ENGINE_KERNELS=1)
against the torch ops (0), taking turns repeat by repeat in one process group: per case (world size,
elements, density, dtype, exchange), the median of the slowest rank's time from the call to the
result, the dense all-reduce of the same bucket, and this process's CPU time per reduction. Every
result is checked equal to the torch ops' (the same bits).
Usage: python ab.py [--port 29611] [--repeats 40] > ab.txt"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [  # (W, elements, density, dtype, exchange); density 0: one block
    (2, 1 << 16, 0.0, "float32", "gather"), (2, 1 << 20, 0.01, "float32", "auto"),
    (2, 1 << 22, 0.01, "float32", "auto"), (2, 1 << 22, 0.1, "float32", "auto"),
    (2, 1 << 24, 0.01, "float32", "auto"), (2, 1 << 24, 1.0, "float32", "gather"),
    (2, 1 << 22, 0.01, "bfloat16", "auto"), (2, 1 << 22, 0.1, "float16", "auto"),
    (4, 1 << 20, 0.01, "float32", "auto"), (4, 1 << 22, 0.01, "float32", "auto"),
    (4, 1 << 24, 0.1, "float32", "auto"), (4, 1 << 24, 0.1, "bfloat16", "auto"),
]


def bucket(rank: int, n: int, density: float, dtype: str) -> torch.Tensor:
    B, nb = 256, -(-n // 256)
    rng = np.random.default_rng(rank)
    keep = np.zeros(nb, bool)
    if density == 0.0:
        keep[7] = True
    else:
        keep = rng.random(nb) < density
    x = rng.standard_normal((nb, B)).astype(np.float32) * keep[:, None]
    return torch.from_numpy(x.reshape(-1)[:n].copy()).to(getattr(torch, dtype))


def main(rank: int, world: int, port: int, repeats: int, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from omnireduce.engines import collective

    engines = {ex: collective.CollectiveEngine(dist.new_group(backend="gloo"), block_size=256, lanes=1, slots=1,
                                               **({} if ex == "auto" else {"exchange": ex}))
               for ex in ("auto", "gather")}
    for W, n, density, dtype, ex in cases:
        x = bucket(rank, n, density, dtype)
        times: dict[str, list[float]] = {"numpy": [], "torch": [], "dense": []}
        cpu: dict[str, list[float]] = {"numpy": [], "torch": []}
        results = {}
        for i in range(repeats + 3):
            for way in times:
                os.environ["OMNIREDUCE_ENGINE_KERNELS"] = "1" if way == "numpy" else "0"
                t = x.clone()
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                if way == "dense":
                    dist.all_reduce(t)
                else:
                    engines[ex].allreduce_async(t).wait()
                dt = time.perf_counter() - t0
                if way in cpu:
                    cpu[way].append(time.process_time() - c0)
                    results[way] = t
                m = torch.tensor([dt])
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                if i >= 3:
                    times[way].append(m.item())
        same = torch.equal(results["numpy"].view(-1).view(torch.uint8), results["torch"].view(-1).view(torch.uint8))
        if rank == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            c = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
            name = "one block" if density == 0 else f"{density:g}"
            print(f"W={W} n={n:>9} d={name:>9} {dtype:8} {ex:6} | numpy {med['numpy']:8.3f} ms (cpu {c['numpy']:7.3f}) "
                  f"| torch ops {med['torch']:8.3f} ms (cpu {c['torch']:7.3f}) | dense {med['dense']:8.3f} ms "
                  f"| numpy/torch {med['numpy'] / med['torch']:.2f} | numpy/dense {med['numpy'] / med['dense']:.3f} "
                  f"| same bits {same}", flush=True)
    for e in engines.values():
        e.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--repeats", type=int, default=40)
    a = p.parse_args()
    for W in (2, 4):
        cases = [c for c in CASES if c[0] == W]
        mp.spawn(main, args=(W, a.port + W, a.repeats, cases), nprocs=W)
    sys.stdout.flush()
