#!/usr/bin/env python3
"""GPU check, part 2: does a DDP step with omnireduce's hook make the training thread wait for the GPU?

    python scripts/gpu_sync_check.py --config hook    # omnireduce_hook
    python scripts/gpu_sync_check.py --config fused   # fuse_optimizer(omnireduce_hook, SGD)
    python scripts/gpu_sync_check.py --config amp     # torch.autocast(float16) + GradScaler
    python scripts/gpu_sync_check.py --config hook --backend nccl --engine collective

Design. ``--world-size`` ranks (default 2, spawned here, all on ``cuda:0``, Gloo on CUDA tensors,
the job's own aggregator) train :class:`gpu_common.Net` for ``--warmup`` unchecked steps (DDP
times its first iterations with CUDA events; the hook's buckets find their paths), then
``--checked`` steps under CUDA's sync debug mode. ``--backend nccl``: the ranks share the GPU
through NCCL instead (each its own ``NCCL_HOSTID``, sockets on loopback: ``gpu_common.nccl_rank_env``),
and ``--engine`` is the state's (``collective``: the ranks sum each other's blocks over NCCL, and
it must have reduced some). Every synchronising CUDA call made from Python is then caught with
the step, the phase (forward, backward, optimizer), the thread and the Python stack that made it.

Why ``warn`` and not ``error``: the mode is process-wide, not per thread, and omnireduce's own
threads (named ``omnireduce-*``: I/O, compaction, fused optimizer, the collective engine) wait for the device by design
(compaction learns how many blocks it found); ``error`` would break them, not check the training
thread. So the mode is ``warn``, and each warning raised on any other thread (the training thread,
and autograd's, which runs the hook) is what ``error`` would have raised there: a failure when the
synchronising call is omnireduce's own (the innermost Python frame is in omnireduce), reported
when it is someone else's (the GradScaler reads ``found_inf``; the dense path's Gloo all-reduce).
Syncs inside C++ with no Python caller are not seen (they print to standard error instead).

The ranks' parameters must agree and every bucket must have been reduced (none failed, some went
the sparse way). Prints each caught sync and a ``RESULT:`` line; exit status 1 on a failure, 77
(skipped) without a GPU; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_common import Net, batches, init_group, require_cuda
from torch.nn.parallel import DistributedDataParallel

SYNC_MESSAGE = "called a synchronizing CUDA operation"


class SyncWatch:
    """Catches the sync debug mode's warnings, with where they came from (see the module docstring)."""

    def __init__(self) -> None:
        import omnireduce
        import omnireduce.worker

        self.roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (omnireduce, omnireduce.worker))
        self.step, self.phase = -1, ""
        self.found: list[dict[str, Any]] = []
        self._previous = warnings.showwarning
        self._catch = warnings.catch_warnings()

    def _show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
              line: Any = None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._previous(message, category, filename, lineno, file, line)
            return
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
        frames = [f"{f.filename}:{f.lineno} {f.name}" for f in stack[-8:]]
        thread = threading.current_thread().name
        own_thread = thread.startswith("omnireduce-")
        self.found.append({
            "step": self.step, "phase": self.phase, "thread": thread, "where": f"{filename}:{lineno}",
            "omnireduce_thread": own_thread, "by_omnireduce": filename.startswith(self.roots),
            "through_omnireduce": any(f.filename.startswith(self.roots) for f in stack), "stack": frames})

    def __enter__(self) -> SyncWatch:
        self._catch = warnings.catch_warnings()  # (a fresh one each time: a watch may be entered again)
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if torch.cuda.is_available():  # (without CUDA only warnings raised by hand arrive: tests/test_gpu_check.py)
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(*exc)


def rank_main(rank: int, world_size: int, port: int, config: str, warmup: int, checked: int, out_dir: str,
              backend: str = "gloo", engine: str = "auto") -> None:
    torch.set_num_threads(1)
    init_group(rank, world_size, port, backend)
    from omnireduce.ddp import OmniReduceState, fuse_optimizer, omnireduce_hook

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(device), device_ids=[0], bucket_cap_mb=4, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = OmniReduceState(engine=engine)
    model.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt) if config == "fused" else omnireduce_hook)
    scaler = torch.amp.GradScaler("cuda") if config == "amp" else None
    data = batches(rank, warmup + checked, 512, device)
    losses = []
    watch = SyncWatch()
    torch.cuda.synchronize()
    for step, (ids, target) in enumerate(data):
        if step == warmup:
            torch.cuda.synchronize()
            watch.__enter__()
        watch.step = step
        watch.phase = "zero_grad"
        opt.zero_grad(set_to_none=False)
        watch.phase = "forward"
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            loss = torch.nn.functional.mse_loss(model(ids).float(), target)
        watch.phase = "backward"
        (scaler.scale(loss) if scaler is not None else loss).backward()
        watch.phase = "optimizer"
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif config != "fused":
            opt.step()
        losses.append(loss.detach())
    watch.phase = "end"
    watch.__exit__(None, None, None)
    torch.cuda.synchronize()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    stats = state.stats()
    state.close()
    dist.destroy_process_group()
    result = {"rank": rank, "losses": [float(v) for v in losses], "param_checksum": checksum, "syncs": watch.found,
              "stats": {k: v for k, v in stats.items() if isinstance(v, int | float | str)}}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def verdict(config: str, ranks: list[dict[str, Any]], checked: int) -> tuple[bool, str]:
    """Whether the check passed, and the RESULT line."""
    syncs = [dict(s, rank=r["rank"]) for r in ranks for s in r["syncs"]]
    training = [s for s in syncs if not s["omnireduce_thread"]]
    bad = [s for s in training if s["by_omnireduce"]]
    problems = []
    if bad:
        s = bad[0]
        problems.append(f"omnireduce synchronized on the training thread {len(bad)} time(s), first: rank {s['rank']} "
                        f"step {s['step']} ({s['phase']}) at {s['where']} on thread {s['thread']}")
    checksums = {r["param_checksum"] for r in ranks}
    if len(checksums) != 1:
        problems.append(f"the ranks' parameters differ (checksums {sorted(checksums)})")
    for r in ranks:
        st = r["stats"]
        if st.get("buckets_failed", 0) or not st.get("buckets_sparse", 0):
            problems.append(f"rank {r['rank']}: buckets_failed {st.get('buckets_failed')}, "
                            f"buckets_sparse {st.get('buckets_sparse')}")
    others = sorted({s["where"] for s in training if not s["by_omnireduce"]})
    own = sum(s["omnireduce_thread"] for s in syncs)
    tail = (f"; {len(training) - len(bad)} sync(s) on the training thread by others ({', '.join(others)})"
            if others else "") + f"; {own} on omnireduce's own threads (allowed)"
    if problems:
        return False, f"{config}: " + "; ".join(problems) + tail
    return True, f"{config}: no sync by omnireduce on the training thread in {checked} checked steps x {len(ranks)} " \
                 f"ranks{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=["hook", "fused", "amp"], required=True)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=13, help="unchecked steps first")
    ap.add_argument("--checked", type=int, default=3, help="steps under the sync debug mode")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--engine", choices=["auto", "aggregators", "collective"], default="auto",
                    help="OmniReduceState(engine=...)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    require_cuda("the sync check")
    from omnireduce.launch.procs import free_port

    with tempfile.TemporaryDirectory(prefix="gpu_sync_check-") as tmp:
        mp.spawn(rank_main, args=(args.world_size, free_port(), args.config, args.warmup, args.checked, tmp,
                                  args.backend, args.engine), nprocs=args.world_size, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    for r in ranks:
        print(f"rank {r['rank']}: losses {', '.join(f'{v:.4f}' for v in r['losses'][-4:])} (last 4), "
              f"stats {r['stats']}")
        for s in r["syncs"]:
            who = "omnireduce thread" if s["omnireduce_thread"] else "TRAINING thread"
            mark = " <- omnireduce's call" if s["by_omnireduce"] else ""
            print(f"  sync: step {s['step']} {s['phase']:<9} {who} {s['thread']}: {s['where']}{mark}")
            if not s["omnireduce_thread"]:
                print("        " + "\n        ".join(s["stack"]))
    name = args.config if (args.backend, args.engine) == ("gloo", "auto") else \
        f"{args.config} ({args.backend}, engine={args.engine})"
    ok, line = verdict(name, ranks, args.checked)
    if args.engine == "collective" and not all(r["stats"].get("collective_reductions", 0) for r in ranks):
        ok, line = False, f"{line}; but the collective engine reduced nothing on some rank"
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "backend": args.backend, "engine": args.engine,
                                               "passed": ok, "result": line, "ranks": ranks}, indent=1) + "\n")
    print(f"RESULT: {line}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
