"""Where the collective engine's thread spends a reduction: cProfile of that thread, W=2 on Gloo, one
bucket of N float32 elements with a fraction D of its 256-element blocks non-zero (random blocks, a
different set on each rank), 40 reductions, the first 5 not timed. Prints the median time from the
call to the caller's wait returning, the exchanges taken, and the thread's functions by own time.
Usage: python engine_thread.py [--port 29571] [--elements 4194304] [--density 0.01]."""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist


def main(rank: int, port: int, n: int, density: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from omnireduce.engines import collective

    prof = cProfile.Profile()
    loop = collective.CollectiveEngine._loop

    def profiled(self: collective.CollectiveEngine) -> None:
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()

    collective.CollectiveEngine._loop = profiled
    engine = collective.CollectiveEngine(dist.new_group(backend="gloo"), block_size=256, lanes=1, slots=1)
    B = 256
    nb = n // B
    g = torch.Generator().manual_seed(rank)
    x = torch.zeros(n)
    k = max(1, int(nb * density))
    x.view(nb, B)[torch.randperm(nb, generator=g)[:k]] = torch.randn(k, B, generator=g)
    times = []
    for _ in range(40):
        t = x.clone()
        dist.barrier()
        start = time.perf_counter()
        engine.allreduce_async(t, average=False).wait()
        times.append(time.perf_counter() - start)
    engine.close()
    time.sleep(0.5)
    if rank == 0:
        print(f"median {statistics.median(times[5:]) * 1e3:.2f} ms; exchanges {engine.stats()['exchanges']}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--elements", type=int, default=4194304)
    p.add_argument("--density", type=float, default=0.01)
    a = p.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(main, args=(a.port, a.elements, a.density), nprocs=2)
