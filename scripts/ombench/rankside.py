"""The rank side's shared parts of the GPU check's NCCL cases (scripts/gpu_nccl_ranks.py and the cases
it runs from other scripts: engine_cost.py, gpu_nccl_profile.py): one rank's context (:class:`Ctx`,
:func:`init`), the internal names of omnireduce they use (:func:`internals`), and what their timings
measure (:func:`label_for`).

Importing it puts the repository first on ``sys.path`` (``tests.ddp_cases`` and the other models the
test suite trains), and ``OMNIREDUCE_BENCH_TREE``'s folder before it where set (another tree's
omnireduce package: a before/after on one machine).
"""

from __future__ import annotations

import datetime
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from ombench import SCRIPTS

ROOT = SCRIPTS.parent
sys.path.insert(0, str(ROOT))  # tests.ddp_cases and friends: the models the test suite trains
if os.environ.get("OMNIREDUCE_BENCH_TREE"):  # another tree's omnireduce package first: a before/after on one machine
    sys.path.insert(0, os.environ["OMNIREDUCE_BENCH_TREE"])

def internals() -> SimpleNamespace:
    """omnireduce's internal names these checks use (the one place that imports them)."""
    from omnireduce.config import DEFAULT_LANES, DEFAULT_SLOTS
    from omnireduce.cuda import ops as cuda_kernels
    from omnireduce.engines import collective
    from omnireduce.engines.collective import CollectiveEngine

    try:
        from omnireduce.engines import exchange_device
    except ImportError:  # (an older tree: OMNIREDUCE_BENCH_TREE)
        exchange_device = None

    return SimpleNamespace(CollectiveEngine=CollectiveEngine, collective=collective, cuda_kernels=cuda_kernels,
                           exchange_device=exchange_device,
                           lanes=DEFAULT_LANES,
                           slots=DEFAULT_SLOTS)


class Ctx:
    """One rank: its place in the job, device and backend."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.backend = args.get("backend", "nccl")
        self.device = torch.device("cuda", 0) if args.get("device", "cuda") == "cuda" else torch.device("cpu")
        self.timeout = float(args.get("timeout", 60))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank here, and this rank's device idle (a one-element all-reduce, not dist.barrier:
        that one guesses a device on NCCL)."""
        self.sync()
        dist.all_reduce(torch.ones(1, device=self.device))
        self.sync()


def init(args: dict[str, Any]) -> Ctx:
    """This rank's NCCL environment, device and process group (env:// from the launcher's variables)."""
    from gpu_common import nccl_rank_env

    torch.set_num_threads(1)
    ctx = Ctx(args)
    kw: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if ctx.backend == "nccl":
        os.environ.update(nccl_rank_env(ctx.rank))
        kw["device_id"] = ctx.device
    dist.init_process_group(ctx.backend, timeout=datetime.timedelta(seconds=ctx.timeout), **kw)
    return ctx


LABEL = "emulated network: NCCL socket transport on loopback, not NVLink"


def label_for(backend: str, device: str) -> str:
    """What the timings measure: :data:`LABEL` over NCCL; otherwise the backend and device (a test run)."""
    return LABEL if backend == "nccl" else f"{backend} on {device}, loopback (not the NCCL check)"
