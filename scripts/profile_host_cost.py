#!/usr/bin/env python3
"""Where a bucket's host time goes, step by step: the hook's steps and the collective engine's, each timed
alone on the real objects of a 1-rank Gloo job (no transport: all of it is host work).

    python scripts/profile_host_cost.py            # prints both tables
    python scripts/profile_host_cost.py --json X   # and saves them
    python scripts/profile_host_cost.py --before /tmp/old --rounds 4 --json X   # the engine: before/after


The hook: a DDP model of 32 ``Linear(256, 256)`` layers, one bucket each, the default state decided
(every bucket dense at one rank); DDP's ``GradBucket`` objects of one backward pass are kept and each
step of the hook's way is timed on them in a loop (median of ``--repeats`` loops of ``--number``
calls, microseconds per call): what DDP's bucket answers, the intake, the route, the dense all-reduce
started and waited for, the future and the recorder, the whole hook, and torch's ``allreduce_hook``.
The engine: the steps of a host bucket's reduction (the scan, the record, the counts, the sums), and
the whole reduction on the engine's thread (the wall time from the call to the future's value, and that
thread's CPU time per reduction) and called directly, against the floor, one scan of a bucket freshly
written (what a DDP bucket is), for one block in 64K elements and 1% of 1M and 4M. Each row is one step
alone, so the rows need not add up to the whole exactly (caches; the hand-off to the engine's thread and
back, whose wake-ups an idle VM makes slow).

With ``--before DIR`` the engine's table is taken ``--rounds`` times, each round running this tree and
DIR's (an older commit's source, see ``scripts/bench_hook_cost.py``), each on the host path, on the
device path (``OMNIREDUCE_DEVICE_PATH=1``: the torch ops a CUDA bucket takes by default) and on the
device path's kernel exchange (``kernels``: ``OMNIREDUCE_ENGINE_KERNELS=1``, a CUDA bucket's four fused
kernel calls, here the host build of the CUDA kernels' per-item steps that the tests use,
``tests/exchange_host.py`` of the tree measured, standing in for the launches), one fresh process per
turn in a fixed rotation: old and new code on the same machine in the same minutes. The medians over
the rounds go to the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _us(fn: Callable[[], Any], number: int, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def hook_steps(number: int, repeats: int) -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from omnireduce.ddp import OmniReduceState, omnireduce_hook
    from omnireduce.engines.reducer import Reduction

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(32)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.2)
    state = OmniReduceState()
    kept: list[Any] = []

    def keeping(st: Any, bucket: Any) -> Any:
        kept.append(bucket)
        return omnireduce_hook(st, bucket)

    keeping.__annotations__ = omnireduce_hook.__annotations__
    ddp.register_comm_hook(state, keeping)
    x = torch.randn(8, 256)
    for _ in range(60):  # (decided: every bucket's way, once measured)
        kept.clear()
        ddp(x).sum().backward()
    gb = kept[len(kept) // 2]  # (a bucket in the middle of an iteration)
    runtime = state.bind()
    intake, router, recorder = runtime.intake, runtime.router, runtime.recorder
    intake._guard._expected = gb.index()  # (the bucket again, out of DDP's order: the guard told)
    bucket = intake.take(gb)
    intake.iteration -= bucket.last  # (taken once more than DDP gave it)
    route = router.route(bucket)
    dense = route.reducer
    buf = gb.buffer()
    rows: list[tuple[str, float]] = []
    rows.append(("GradBucket: index(), buffer(), is_last()", _us(lambda: (gb.index(), gb.buffer(), gb.is_last()),
                                                                  number, repeats)))

    def take() -> None:
        intake._guard._expected = gb.index()  # (the same bucket again: DDP's order kept)
        intake.take(gb)

    rows.append(("Intake.take: the bucket (iteration, model check, block size)", _us(take, number, repeats)))
    rows.append(("Router.route: the plan's route", _us(lambda: router.route(bucket), number, repeats)))
    rows.append(("Reduction(): the future", _us(lambda: Reduction(buf), number, repeats)))
    rows.append(("DenseReducer.allreduce_async + wait (div, all-reduce, completer)",
                 _us(lambda: dense.allreduce_async(buf, average=True).wait(), number, repeats)))
    rows.append(("dist.all_reduce(async) + wait, for comparison",
                 _us(lambda: dist.all_reduce(buf, async_op=True).wait(), number, repeats)))

    def watched() -> None:
        r = Reduction(buf)
        recorder.watch(r, bucket.key, bucket.iteration, bucket.nbytes, 1)
        r.complete(buf, dense._infos.get(bucket.nbytes) or r.info)

    rows.append(("Reduction + Recorder.watch + complete (the recording)", _us(watched, number, repeats)))

    def whole() -> None:
        intake._guard._expected = gb.index()
        runtime.reduce_bucket(intake.take(gb)).wait()

    rows.append(("the runtime's whole way for the bucket + wait", _us(whole, number, repeats)))
    rows.append(("torch's allreduce_hook + wait", _us(lambda: default_hooks.allreduce_hook(None, gb).wait(),
                                                      number, repeats)))
    state.close()
    return rows


def engine_steps(number: int, repeats: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from omnireduce.engines.collective import CollectiveEngine

    engine = CollectiveEngine.for_group(dist.group.WORLD, 60.0, 256, 1024, 1)
    try:
        return [_engine_row(engine, numel, blocks, number, repeats)
                for numel, blocks in ((65536, 1), (1 << 20, 41), (1 << 22, 164))]
    finally:
        engine.close()
        engine.release()


def _engine_row(engine: Any, numel: int, blocks: int, number: int, repeats: int) -> dict[str, Any]:
    """One bucket size's steps and the whole reduction (see the module)."""
    import numpy as np
    import torch

    from omnireduce.blocks import block_nonzero
    from omnireduce.dtypes import DType
    from omnireduce.engines.collective import _Job
    from omnireduce.engines.numpy_kernels import _take
    from omnireduce.engines.reducer import Reduction

    t = torch.zeros(numel)
    g = torch.Generator().manual_seed(1)
    for b in torch.randperm(numel // 256, generator=g)[:blocks].tolist():
        t[b * 256:(b + 1) * 256] = torch.randn(256, generator=g)
    raw = t.numpy()
    n = max(3, number // (numel >> 16))
    for _ in range(10):
        engine.allreduce_async(t.clone()).wait()
    flags = block_nonzero(raw, DType.FLOAT32, 256)
    ids = np.flatnonzero(flags)
    rows = np.empty((max(4, blocks + blocks // 4 + 1), 256), np.float32)
    view = t.clone().view(-1, 256)
    tid, src = torch.from_numpy(ids), torch.from_numpy(rows[: ids.size])
    steps = {
        "scan (block_nonzero: one read of the bucket)": lambda: block_nonzero(raw, DType.FLOAT32, 256),
        "this rank's blocks (flatnonzero)": lambda: np.flatnonzero(flags),
        "the record: bitmap (packbits) and rows (take)": lambda: (np.packbits(flags), _take(raw, 256, ids, rows)),
        "the union's count (count_nonzero)": lambda: np.count_nonzero(flags),
        "the sums in place (index_fill_, index_add_)": lambda: (view.index_fill_(0, tid, -0.0),
                                                                view.index_add_(0, tid, src)),
    }
    row: dict[str, Any] = {"numel": numel, "blocks": blocks,
                           "steps_us": {name: _us(fn, n, repeats) for name, fn in steps.items()}}
    clones = [t.clone() for _ in range(2 * (n * repeats + 5))]  # (fresh inputs, made before the clock runs)
    ns0, calls = TIMED.ns if TIMED else 0, n * repeats
    row["direct_us"] = _us(lambda: engine._reduce_on_device(_Job(clones.pop(), True, 256, Reduction())), n, repeats)
    row["kernel_bodies_us"] = (TIMED.ns - ns0) / calls / 1e3 if TIMED else 0.0  # (the mean: a median needs each)
    before = engine.stats()
    row["engine_us"] = _us(lambda: engine.allreduce_async(clones.pop(), average=True).wait(), n, repeats)
    after = engine.stats()
    done = after["reductions"] - before["reductions"]
    row["engine_thread_cpu_us"] = (after["host_s"] - before["host_s"]) / done * 1e6
    row["reductions"] = done
    row["kernel_reductions"] = after.get("kernel_reductions", 0) - before.get("kernel_reductions", 0)
    fresh = [t.clone() for _ in range(n * repeats + 5)]  # (the floor: one read of a bucket as freshly written)
    row["scan_fresh_us"] = _us(lambda: block_nonzero(fresh.pop().numpy(), DType.FLOAT32, 256), n, repeats)
    return row


ENGINE_KEYS = ("direct_us", "engine_us", "engine_thread_cpu_us", "scan_fresh_us", "kernel_bodies_us")
PATHS = ("host", "device", "kernels")


def use_host_kernels(tree: Path) -> None:
    """Every CPU bucket of the device path through the kernel exchange, its four calls made by ``tree``'s
    host build of the CUDA kernels' steps (``tests/exchange_host.py``: compiled by the C++ compiler once),
    as ``OMNIREDUCE_ENGINE_KERNELS=1`` sends a CUDA bucket to the CUDA extension's."""
    sys.path.insert(0, str(tree))
    from omnireduce.engines import exchange_kernels
    from tests.exchange_host import HostKernels

    global TIMED
    TIMED = _Timed(HostKernels())
    exchange_kernels.kernels_for = lambda flat, threshold, world: None if threshold > 0 else TIMED


class _Timed:
    """Kernels whose four calls add up the nanoseconds spent in them (``ns``): on a GPU those bodies
    run on the device behind a few launches each, so the kernel path's own host time is the
    reduction's minus these."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.ns = kernels, 0
        for name in ("record", "rows", "counts", "sum_blocks"):
            setattr(self, name, self._timed(getattr(kernels, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                self.ns += time.perf_counter_ns() - t0
        return call

    def __getattr__(self, name: str) -> Any:  # (what the exchange asks of the kernels besides the calls)
        return getattr(self.kernels, name)


TIMED: _Timed | None = None
"""The kernel path's kernels, timed (:func:`use_host_kernels`; None on the other paths)."""


def rounds(before: Path, count: int, number: int, repeats: int, port: int) -> dict[str, Any]:
    """The engine's table, this tree and ``before``'s, host and device path, ``count`` rounds in turn (see
    the module): every turn's rows, and per (tree, path, size) the medians over the rounds."""
    turns: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(count):
            for tree in ("this", "before"):
                for path in PATHS:
                    out = Path(tmp) / f"{r}-{tree}-{path}.json"
                    cmd = [sys.executable, __file__, "--engine-only", "--number", str(number), "--repeats",
                           str(repeats), "--port", str(port + r), "--json", str(out)]
                    cmd += ["--tree", str(before)] if tree == "before" else []
                    cmd += ["--host-kernels"] if path == "kernels" else []
                    env = dict(os.environ, OMNIREDUCE_DEVICE_PATH="0" if path == "host" else "1",
                               OMNIREDUCE_ENGINE_KERNELS="1" if path == "kernels" else "auto")
                    subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
                    for row in json.loads(out.read_text())["engine"]:
                        turns.append({"round": r, "tree": tree, "path": path,
                                      "numel": row["numel"], "blocks": row["blocks"],
                                      **{k: row.get(k, 0.0) for k in ENGINE_KEYS}})  # (an older tree's lack some)
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for t in turns:
        groups.setdefault((t["tree"], t["path"], t["numel"]), []).append(t)
    summary = [{"tree": tree, "path": path, "numel": numel, "blocks": rows[0]["blocks"], "rounds": len(rows),
                **{k: statistics.median(x[k] for x in rows) for k in ENGINE_KEYS}}
               for (tree, path, numel), rows in groups.items()]
    return {"turns": turns, "summary": summary}


def render_rounds(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'elements':>10} {'blocks':>6} {'path':<7} {'tree':<7} {'engine':>7} {'thread':>7} {'direct':>7} "
             f"{'bodies':>7} {'floor':>6} {'thread/floor':>12}"]
    for r in sorted(summary, key=lambda r: (r["numel"], r["path"], r["tree"] != "this")):
        bodies = f"{r['kernel_bodies_us']:>7.0f}" if r["path"] == "kernels" else f"{'':>7}"
        lines.append(f"{r['numel']:>10,} {r['blocks']:>6} {r['path']:<7} {r['tree']:<7} {r['engine_us']:>7.0f} "
                     f"{r['engine_thread_cpu_us']:>7.0f} {r['direct_us']:>7.0f} {bodies} {r['scan_fresh_us']:>6.0f} "
                     f"{r['engine_thread_cpu_us'] / r['scan_fresh_us']:>11.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--engine-only", action="store_true", help="the engine's table only")
    ap.add_argument("--tree", type=Path, default=None,
                    help="another source tree's omnireduce (an older commit's, for a before/after on one machine)")
    ap.add_argument("--port", default="29593")
    ap.add_argument("--before", type=Path, default=None,
                    help="an older source tree: the engine's table of both, in turns (see the module)")
    ap.add_argument("--rounds", type=int, default=4, help="with --before: how many turns of each")
    ap.add_argument("--host-kernels", action="store_true",
                    help="the device path's kernel exchange, its calls made by the tests' host build of the kernels")
    args = ap.parse_args()
    if args.before is not None:
        result = rounds(args.before, args.rounds, args.number, args.repeats, int(args.port))
        print("The collective engine at W=1, us per reduction (medians over the rounds): engine = the call to "
              "the future's value; thread = its thread's CPU; direct = the reduction called on this thread; "
              "bodies = of direct, the time in the kernel path's four calls (on a GPU: device work behind "
              "about ten launches); floor = one scan of a freshly written copy")
        print(render_rounds(result["summary"]))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            meta = {"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit()}
            args.json.write_text(json.dumps({"meta": meta, **result}, indent=1))
        return
    if args.tree is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_hook_cost import load_tree

        load_tree(args.tree)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    if args.host_kernels:
        use_host_kernels(args.tree or Path(__file__).resolve().parents[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        hook = [] if args.engine_only else hook_steps(args.number, args.repeats)
        engine = engine_steps(args.number, args.repeats)
    finally:
        dist.destroy_process_group()
    if hook:
        print("The hook's steps, one bucket of 65,536 float32 (us per call, median):")
    for name, us in hook:
        print(f"  {us:8.1f}  {name}")
    print("\nThe collective engine's steps on the host, W=1 (us per call, median):")
    for r in engine:
        print(f"  {r['numel']:,} elements, {r['blocks']} non-zero block(s): engine {r['engine_us']:.0f} "
              f"(its thread's CPU {r['engine_thread_cpu_us']:.0f}), called directly {r['direct_us']:.0f}"
              + (f" (in the kernels' calls {r['kernel_bodies_us']:.0f})" if TIMED else "")
              + f", the scan of a freshly written copy {r['scan_fresh_us']:.0f}")
        for name, us in r["steps_us"].items():
            print(f"  {us:8.1f}  {name}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit()}
        args.json.write_text(json.dumps({"meta": meta, "hook": hook, "engine": engine}, indent=1))


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
