"""Host seconds of the kernel exchange's Python driver at W=1, with kernel calls that do nothing.

    python docs/log/data/kernel_exchange/driver_cost.py
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from omnireduce.engines import exchange_device, exchange_kernels
from omnireduce.engines.plan import Exchange, Step


class Null:
    """The kernel exchange's four calls, doing nothing: three blocks non-zero, no overflow at capacity 8."""

    def __init__(self, nb: int, world: int) -> None:
        nbytes = -(-nb // 8)
        self.prefix = torch.zeros(nbytes + 1, dtype=torch.int32)
        self.bits = torch.zeros((world + 1, nbytes), dtype=torch.uint8)
        self.all_prefix = torch.zeros(self.bits.numel() + 1, dtype=torch.int32)
        self.vector = torch.tensor([3, 3, 0], dtype=torch.int64)

    def record(self, *args: object) -> torch.Tensor:
        return self.prefix

    def rows(self, *args: object) -> None:
        pass

    def counts(self, *args: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.bits, self.all_prefix, self.vector

    def sum_blocks(self, *args: object) -> None:
        pass


def main() -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for numel in (1 << 16, 1 << 20):
            kernels = Null(-(-numel // 256), 1)
            x = torch.zeros(numel)
            ws = exchange_device.Workspace()
            for fused in (False, True):
                times = []
                for _ in range(300):
                    t0 = time.thread_time()
                    exchange_kernels.reduce(x, 256, kernels=kernels, group=dist.group.WORLD, rank=0, world=1,
                                            average=False, step=Step(True, 8) if fused else Step(False),
                                            decide=lambda c: Exchange.GATHER, total_lanes=64, pairs=False,
                                            timeout=10.0, workspace=ws)
                    times.append(time.thread_time() - t0)
                median = statistics.median(times[50:]) * 1e6
                print(f"numel {numel} fused {fused}: driver host time median {median:.0f} us")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
