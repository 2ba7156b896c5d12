"""A profiled run of the collective engine that ends at once: a 1-rank Gloo group, an engine on a group of
its own (``CollectiveEngine.for_group``), a few hundred reductions of a 65,536-element bucket with one
non-zero block, ten more under ``torch.profiler``, then ``close()``, ``destroy_process_group()`` and the
interpreter's exit, with the engine a local of ``main``. ``python engine_profiler_exit.py PORT``.

Before ``close()`` waited for the engine's thread, that thread could drop the engine's last reference
(and so its group's) while the interpreter was shutting down, and the process aborted ("terminate called
without an active exception") in a fifth to a half of the runs (docs/log/2026-11-29-engine-exit-abort.md).
What the script does, and in which order, is what made that race likely: keep it."""

import sys

import torch
import torch.distributed as dist

from omnireduce.engines.collective import CollectiveEngine


def bucket(n: int, nonzero: int) -> torch.Tensor:
    t = torch.zeros(n)
    g = torch.Generator().manual_seed(1)
    for b in torch.randperm(n // 256, generator=g)[:nonzero].tolist():
        t[b * 256:(b + 1) * 256] = torch.randn(256, generator=g)
    return t


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    engine = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 1024, 1)
    t = bucket(65536, 1)
    for _ in range(320):
        x = t.clone()
        engine.allreduce_async(x).wait()
    assert torch.equal(x, t)
    clones = [t.clone() for _ in range(300)]
    del clones
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.allreduce_async(t.clone()).wait()
    prof.key_averages()
    print("reductions", engine.stats()["reductions"], flush=True)
    engine.close()
    dist.destroy_process_group()


main()
