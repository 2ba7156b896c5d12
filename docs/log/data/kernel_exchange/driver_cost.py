"""Host seconds of the kernel exchange's Python driver at W=1, with kernel calls that do nothing."""
import os, time, statistics, torch, torch.distributed as dist
torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
from omnireduce.engines import exchange_kernels, exchange_device
from omnireduce.engines.plan import Step, Exchange

class Null:
    def __init__(self, nb, W): 
        nbytes = -(-nb // 8)
        self.p = torch.zeros(nbytes + 1, dtype=torch.int32)
        self.bits = torch.zeros((W + 1, nbytes), dtype=torch.uint8)
        self.pp = torch.zeros(self.bits.numel() + 1, dtype=torch.int32)
        self.c = torch.tensor([3, 3, 0] + [0] * 0, dtype=torch.int64)
    def record(self, *a): return self.p
    def rows(self, *a): pass
    def counts(self, *a): return self.bits, self.pp, self.c
    def sum_blocks(self, *a): pass

for numel in (1 << 16, 1 << 20):
    x = torch.zeros(numel)
    k = Null(-(-numel // 256), 1)
    ws = exchange_device.Workspace()
    for fused in (False, True):
        ts = []
        for i in range(300):
            t0 = time.thread_time()
            exchange_kernels.reduce(x, 256, kernels=k, group=dist.group.WORLD, rank=0, world=1, average=False,
                                    step=Step(True, 8) if fused else Step(False), decide=lambda c: Exchange.GATHER,
                                    total_lanes=64, pairs=False, timeout=10.0, workspace=ws)
            ts.append(time.thread_time() - t0)
        print(f"numel {numel} fused {fused}: driver host time median {statistics.median(ts[50:])*1e6:.0f} us")
dist.destroy_process_group()
