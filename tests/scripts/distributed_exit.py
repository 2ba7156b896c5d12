"""A user's script of ``omnireduce.distributed.all_reduce`` that ends as such scripts do, one rank of a Gloo
job of 2: ``python distributed_exit.py PORT RANK END``, run by tests/test_distributed_exit.py.

Twelve calls (float32, bfloat16 and float16; SUM and AVG; ``async_op`` False and True) on the default
group, each result checked, then one of four ends (END):

- ``exit``: nothing more; the interpreter's exit closes everything;
- ``shutdown``: ``omnireduce.distributed.shutdown()``, then the exit;
- ``destroy``: the program's own last all-reduce, then ``destroy_process_group()``;
- ``shutdown-destroy``: ``shutdown()``, the program's own last all-reduce, ``destroy_process_group()``.

The hazard: a Gloo group's worker thread drops each collective's work (and its tensors) after the
caller has seen it complete, and dropping a tensor that has a Python object takes the GIL there. If
the group is still alive when the interpreter shuts down, that thread cannot take the GIL and the
process aborts ("terminate called without an active exception") after a complete run. Two things make
it likely here where it is rare in a real script: the program's last all-reduce is left to Gloo's
thread to drop (its handle not kept), and the main thread keeps the GIL from then on wherever it does
not block (a long switch interval), so that thread waits for it.

Printed (rank's stdout): ``calls 12``, then at exit, after omnireduce's exit handlers and before the
interpreter's shutdown (a handler registered before omnireduce's runs after them), ``private freed`` or
``private held`` (omnireduce's own group of the default group's ranks) and, after a
``destroy_process_group()``, ``world freed`` or ``world held`` (the default group): a group still held
then keeps its threads alive into the shutdown.
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

import omnireduce.distributed as odist  # noqa: E402
from omnireduce.distributed import groups  # noqa: E402


def main() -> None:
    port, rank, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    calls = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op, want in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 0.5)):
            for async_op in (False, True):
                x = torch.zeros(1 << 16, dtype=dtype)
                x[rank * 256:(rank + 1) * 256] = 1.0
                work = odist.all_reduce(x, op=op, async_op=async_op)
                if work is not None:
                    work.wait()
                assert float(x[0]) == want and float(x[256]) == want and float(x[512]) == 0, (dtype, op, async_op)
                calls += 1
    held["private"] = weakref.ref(groups._runtimes[dist.group.WORLD].own)
    print("calls", calls, flush=True)
    sys.setswitchinterval(100.0)  # (the main thread keeps the GIL from here on where it does not block)
    if end in ("shutdown", "shutdown-destroy"):
        odist.shutdown()
    if end in ("destroy", "shutdown-destroy"):
        dist.all_reduce(torch.ones(1), async_op=True)  # (its work and tensor left to Gloo's thread to drop)
        held["world"] = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()


main()
