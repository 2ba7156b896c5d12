"""A user's script as the README shows it, run under torchrun by tests/test_clean_exit.py: an
OmniReduceState with no addresses (colocated aggregators), a few DDP steps, destroy_process_group(),
and no close() anywhere. ``--fuse`` steps the optimizer in the hook (fuse_optimizer).

An exit handler registered before omnireduce is imported runs after all of omnireduce's (handlers run
last-registered first) and reports any omnireduce thread still alive then: the interpreter is about
to shut down, and a thread running into that is what can abort a process at exit.
"""

import atexit
import sys
import threading


def _report_threads() -> None:
    left = [t.name for t in threading.enumerate() if t.name.startswith("omnireduce") and t.is_alive()]
    if left:
        sys.stderr.write(f"LEFTOVER THREADS at exit: {left}\n")


atexit.register(_report_threads)

import logging  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.EmbeddingBag(20000, 16), torch.nn.Linear(16, 64),
                                    torch.nn.Linear(64, 1)), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fuse = "--fuse" in sys.argv
    model.register_comm_hook(OmniReduceState(), fuse_optimizer(omnireduce_hook, opt) if fuse else omnireduce_hook)
    for _ in range(3):
        x = torch.randint(0, 20000, (8, 5))
        opt.zero_grad()
        model(x).sum().backward()
        if not fuse:
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
