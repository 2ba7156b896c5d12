#!/usr/bin/env python3
"""GPU check, part 3: a torch.profiler trace of one DDP step with omnireduce's hook, and whether its
device-to-host copies overlap the backward pass.

    python scripts/gpu_profile_step.py --trace results/gpu/ddp_step_trace.json --json overlap.json

Design. One rank (world size 1, Gloo, the job's own aggregator) trains :class:`gpu_common.Net`
in 4 MB DDP buckets with the dense fallback off, so every bucket takes omnireduce's device path
(compaction on the side stream, one device-to-host copy, one copy back, the scatter). After
``--warmup`` steps, one step runs under ``torch.profiler`` (host and CUDA activities) with
``loss.backward()`` inside ``record_function("gpu_check.backward")``; the step ends with a device
synchronisation inside the profiled region, so every kernel and copy is in the trace. The trace is
saved as a chrome trace (open it in chrome://tracing or Perfetto), and
:mod:`gpu_trace_overlap` says how the copies fall against the backward's kernels. Measures, never
fails on the answer; exit status 77 (skipped) without a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_common import Net, batches, init_group, require_cuda
from gpu_trace_overlap import describe, overlap_summary
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

ANNOTATION = "gpu_check.backward"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="the chrome trace to write (.json)")
    ap.add_argument("--json", default=None, help="the overlap numbers")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    require_cuda("profiling a DDP step on CUDA")
    from omnireduce.ddp import OmniReduceState, omnireduce_hook
    from omnireduce.launch.procs import free_port

    init_group(0, 1, free_port())
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(device), device_ids=[0], bucket_cap_mb=4, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = OmniReduceState(dense_fallback=False)
    model.register_comm_hook(state, omnireduce_hook)
    data = batches(0, args.warmup + 1, args.batch, device)

    def step(ids: torch.Tensor, target: torch.Tensor, mark: bool) -> None:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(ids), target)
        if mark:
            with record_function(ANNOTATION):
                loss.backward()
        else:
            loss.backward()
        opt.step()

    for ids, target in data[:-1]:
        step(ids, target, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(*data[-1], True)
        torch.cuda.synchronize()
    Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(args.trace)
    stats = state.stats()
    state.close()
    dist.destroy_process_group()

    summary = overlap_summary(json.loads(Path(args.trace).read_text()), ANNOTATION)
    summary["hook_stats"] = {k: v for k, v in stats.items() if isinstance(v, int | float | str)}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15))
    print(json.dumps(summary, indent=1))
    print(f"RESULT: {describe(summary)}; trace {Path(args.trace).name}")


if __name__ == "__main__":
    main()
