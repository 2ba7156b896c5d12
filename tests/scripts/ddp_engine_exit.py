"""A user's DDP script with omnireduce's hook on the collective engine that ends as such scripts do, one
rank of a Gloo job of 2: ``python ddp_engine_exit.py PORT RANK END [ENGINE]``, run by
tests/test_ddp_engine_exit.py.

A small model (an embedding bag and two linear layers, buckets of 0.1 MB) and
``register_comm_hook(OmniReduceState(engine=ENGINE), omnireduce_hook)`` (ENGINE: ``collective`` by
default; ``auto`` times the engine against the aggregators and the dense all-reduce), a few steps, then
one of three ends (END): ``exit`` (nothing more: the interpreter's exit closes everything), ``destroy``
(``dist.destroy_process_group()`` first) or ``late`` (as ``exit``, the engine's group left with a last
collective whose work and tensor Gloo's thread drops: as the engine's last reduction's can be).

The hazard: the engine's process group, a Gloo group omnireduce made for it at binding, is one torch's
registry holds until ``destroy_process_group()``. A Gloo group's worker thread drops each collective's
work (and its tensors) after the caller has seen it complete, and dropping a tensor that has a Python
object takes the GIL there; if the group is still alive when the interpreter shuts down, that thread
cannot take the GIL and the process aborts ("terminate called without an active exception"). The main
thread keeps the GIL from the last step on wherever it does not block (a long switch interval), which
makes such a thread wait for it.

Printed (rank's stdout): ``steps N``, then at exit, after omnireduce's exit handlers and before the
interpreter's shutdown (a handler registered before omnireduce's runs after them), ``engine freed`` or
``engine held`` (the engine's own process group): a group still held then keeps its threads alive into
the shutdown.
"""

import atexit
import sys
import weakref

held: dict = {}  # weak references to the groups looked at when the interpreter exits


def _report() -> None:
    for name, ref in held.items():
        print(name, "held" if ref() is not None else "freed", flush=True)


atexit.register(_report)  # (before omnireduce's first handler: it runs after all of them)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from omnireduce.ddp import OmniReduceState, omnireduce_hook  # noqa: E402

STEPS = 4


def main() -> None:
    port, rank, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = sys.argv[4] if len(sys.argv) > 4 else "collective"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.EmbeddingBag(20000, 16), torch.nn.Linear(16, 64),
                                    torch.nn.Linear(64, 1)), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = OmniReduceState(engine=engine)
    model.register_comm_hook(state, omnireduce_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randint(0, 20000, (8, 5), generator=g)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    runtime = state._runtime
    assert runtime is not None and runtime.parts.engine is not None
    group = runtime.parts.engine.group
    held["engine"] = weakref.ref(group)
    print("steps", state.iteration, flush=True)
    sys.setswitchinterval(100.0)  # (the main thread keeps the GIL from here on where it does not block)
    if end == "late":
        dist.all_reduce(torch.ones(1), group=group, async_op=True)  # (its work and tensor left to Gloo's thread)
    del runtime, group
    if end == "destroy":
        dist.destroy_process_group()


main()
