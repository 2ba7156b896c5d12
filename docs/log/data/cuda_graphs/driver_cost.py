"""Host seconds of the collective engine around a CUDA graph's replay at W=1, on this machine's CPU:
the engine's thread and the whole process per reduction, with a graph backend that does nothing once
it has "captured" (no device: what remains is the engine's own Python around a replay).

    python docs/log/data/cuda_graphs/driver_cost.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # (the checkout: tests.graph_double)

from omnireduce.engines.collective import CollectiveEngine
from omnireduce.engines.graphs import Graphs, Statics
from omnireduce.launch.procs import free_port
from tests.graph_double import host_kernels


class Nothing:
    """A graph backend whose capture returns empty buffers and whose replay does nothing."""

    device_type = "cpu"

    def host_buffer(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64)

    def capture(self, run: object, flat: torch.Tensor) -> tuple[object, Statics]:
        z = torch.zeros(1)
        return object(), Statics(z, z, z, z, z, 0, 1)

    def replay(self, handle: object, flat: torch.Tensor) -> None:
        pass

    def wait(self, device: object, timeout: object) -> None:
        pass

    def release(self, handle: object) -> None:
        pass


def main() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    with host_kernels():
        engine = CollectiveEngine(dist.group.WORLD, 256, 1024, 1, timeout=30.0)
        engine._graphs = Graphs(engine.group, 0, 1, 30.0, engine._workspace, backend=Nothing())
        for n in (1 << 16, 1 << 20):
            x = torch.zeros(n)
            x[:256] = 1.0
            work = torch.empty_like(x)
            for _ in range(4):  # (bitmaps first, fused uncaptured, captured: then replays)
                work.copy_(x)
                engine.allreduce_async(work).wait()
            thread, process = [], []
            for _ in range(5):
                s0, c0, reps = engine.stats(), time.process_time(), 1000
                for _ in range(reps):
                    engine.allreduce_async(work).wait()
                c1, s1 = time.process_time(), engine.stats()
                assert s1["graph_replays"] - s0["graph_replays"] == reps
                thread.append((s1["host_s"] - s0["host_s"]) / reps * 1e6)
                process.append((c1 - c0) / reps * 1e6)
            print(f"{n:>8} elements: engine thread {statistics.median(thread):.1f} us (runs {min(thread):.1f}-"
                  f"{max(thread):.1f}), process {statistics.median(process):.1f} us ({min(process):.1f}-"
                  f"{max(process):.1f}) per reduction")
        engine.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
