"""The dense all-reduce's reduction, continued on Gloo's thread (as before) or on omnireduce's
completer thread (DenseReducer now): time from the call to the caller's wait returning, W=2,
the two taking turns repeat by repeat. Usage: python latency.py [--repeats 600] [--port 29561]."""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main(rank: int, port: int, repeats: int, sizes: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from omnireduce.engines.dense import DenseReducer
    from omnireduce.engines.reducer import Reduction, ReductionInfo

    reducer = DenseReducer(None)

    def on_gloos_thread(t: torch.Tensor) -> Reduction:
        work = dist.all_reduce(t, async_op=True)
        out = Reduction(t)
        work.get_future().add_done_callback(lambda f: out.complete(f.value()[0], ReductionInfo(dense=True)))
        return out

    ways = {"on Gloo's thread": on_gloos_thread,
            "on the completer's thread": lambda t: reducer.allreduce_async(t, average=False)}
    rows = []
    for n in sizes:
        t = torch.ones(n)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(repeats):
            for name, way in ways.items():
                dist.barrier()
                start = time.perf_counter()
                way(t).wait()
                times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=20)
            rows.append({"elements": n, "way": name, "p25_ms": q[4] * 1e3, "p50_ms": statistics.median(ts) * 1e3,
                         "p75_ms": q[14] * 1e3, "mean_ms": statistics.fmean(ts) * 1e3})
    reducer.close()
    if rank == 0:
        print(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=600)
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--sizes", default="1,65536,1048576")
    a = p.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(main, args=(a.port, a.repeats, [int(s) for s in a.sizes.split(",")]), nprocs=2)
    sys.exit(0)
