"""A user's script that profiles with ``torch.profiler`` and ends, one rank of a Gloo job of 2:
``python profiler_exit.py PORT RANK ORDER``, run by tests/test_default_group.py.

``torch.profiler`` imports ``torch.distributed.nn.functional`` the first time it starts, and that
module's functions keep the default group as a default argument where it is first imported after
``init_process_group()`` (see omnireduce/default_group.py). ORDER says when omnireduce's engine is
imported: ``before`` the process group exists (the defaults then hold none) or ``after`` it (omnireduce
lets go of them at exit). Then: reductions through a collective engine under the profiler, the
program's own last all-reduce left to Gloo's thread to drop, ``destroy_process_group()``, the exit.

Printed (rank's stdout): ``reductions 4``, then at exit, after omnireduce's exit handlers and before
the interpreter's shutdown, ``world freed`` or ``world held`` (the default group: held, its threads
live into the shutdown, where one still dropping a tensor aborts the process).
"""

import atexit
import sys
import weakref

held: dict = {}


def _report() -> None:
    for name, ref in held.items():
        print(name, "held" if ref() is not None else "freed", flush=True)


atexit.register(_report)  # (before omnireduce's handlers: it runs after them)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    port, rank, order = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if order == "before":
        from omnireduce.engines.collective import CollectiveEngine
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    if order == "after":
        from omnireduce.engines.collective import CollectiveEngine
    from torch.profiler import ProfilerActivity, profile

    engine = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 1024, 1)
    reductions = 0
    with profile(activities=[ProfilerActivity.CPU]):
        for i in range(4):
            x = torch.zeros(1 << 17)
            x[(rank + 2 * i) * 256:(rank + 2 * i + 1) * 256] = 1.0
            engine.allreduce_async(x).wait()
            assert float(x.sum()) == 512.0, float(x.sum())
            reductions += 1
    engine.close()
    print("reductions", reductions, flush=True)
    sys.setswitchinterval(100.0)  # (the main thread keeps the GIL from here on where it does not block)
    dist.all_reduce(torch.ones(1), async_op=True)  # (its work and tensor left to Gloo's thread to drop)
    held["world"] = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()


main()
