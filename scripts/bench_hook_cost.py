#!/usr/bin/env python3
"""What the DDP hook costs per bucket on the host, against DDP's own all-reduce and torch's Python hook.

    python scripts/bench_hook_cost.py                          # W = 1, 2, 4 on Gloo, this tree
    python scripts/bench_hook_cost.py --before /tmp/old        # and an older tree's, in turns, same run
    python scripts/bench_hook_cost.py --worlds 1 --repeats 3   # quicker
    python scripts/bench_hook_cost.py --backend nccl           # on a GPU: the ranks share it, NCCL over sockets

Two models, each trained for a few hundred steps per variant, on W ranks of one Gloo group on this
machine:

* ``linear32``: 32 ``Linear(256, 256)`` layers, one DDP bucket each (``bucket_cap_mb=0.2``), a batch
  of 8: every bucket dense, little compute, so a step is mostly what each bucket costs. Variants:
  plain DDP (its C++ all-reduce), torch's ``allreduce_hook`` (a Python hook), the hook with
  ``path="dense"``, and the default state (``OmniReduceState()``: every way measured, then decided).
  The table's ``us/bucket`` is a variant's step over torch's hook's, per bucket: what our hook adds.
* ``mid``: an ``EmbeddingBag`` of 100,000 x 64 (40% of its rows touched per rank and step) and two
  ``Linear(64, 64)``: buckets of middle density, where no way wins by much. Plain DDP against the
  default state: the path choice must not make such a model slower (its ``vs plain``).

Per world size every rank runs every variant in turn, ``--repeats`` times, in a rotated order
(what drifts on a shared machine drifts for all of them alike); a variant's time is the median over
the repeats of rank 0's median step (the ranks step in lockstep), after ``--warmup`` untimed steps
that also let the default state decide. ``cpu ms`` is rank 0's process CPU per step (every thread:
the hook's, the completer's, Gloo's, the engines'). With ``--before DIR`` each repeat also runs the
variants through the omnireduce package of that source tree (its ``omnireduce``, ``aggregator`` and
``worker`` folders), in the same processes' turns: old and new code in one run. Output: the table,
and ``--json`` the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TREE = Path(__file__).resolve().parent.parent
LINEAR32 = ("plain", "torch_hook", "omni_dense", "omni_default")
MID = ("plain", "omni_default")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_tree(tree: Path) -> None:
    """Import ``omnireduce`` from a source tree (its ``aggregator`` and ``worker`` folders are the
    package's ``omnireduce.aggregator`` and ``omnireduce.worker``, as an install maps them)."""
    sys.path.insert(0, str(tree))
    import omnireduce

    assert Path(omnireduce.__file__).resolve().is_relative_to(tree.resolve()), omnireduce.__file__
    for sub in ("aggregator", "worker"):
        spec = importlib.util.spec_from_file_location(f"omnireduce.{sub}", tree / sub / "__init__.py",
                                                      submodule_search_locations=[str(tree / sub)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"omnireduce.{sub}"] = module
        spec.loader.exec_module(module)


# --- the rank side -------------------------------------------------------------------------------


def _linear32() -> Any:
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(32)])


class _Mid:
    """The ``mid`` model's module and batches (built lazily: torch is imported in the ranks only)."""

    @staticmethod
    def make() -> Any:
        import torch

        class Mid(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table = torch.nn.EmbeddingBag(100_000, 64, mode="sum")
                self.top = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                return self.top(self.table(idx))

        return Mid()


def _variant(name: str, model_name: str, steps: int, warmup: int, rank: int, world: int,
             device: str = "cpu") -> dict[str, float]:
    """Train ``model_name`` with hook variant ``name``: rank 0's median step (ms) and CPU per step (ms); on
    ``cuda`` each step ends with the device synchronised."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from omnireduce.ddp import OmniReduceState, omnireduce_hook

    torch.manual_seed(0)
    dev = torch.device(device)
    if model_name == "linear32":
        module, cap = _linear32().to(dev), 0.2
        x = torch.randn(8, 256, device=dev)
        batches = [x] * (steps + warmup)
    else:
        module, cap = _Mid.make().to(dev), 25.0
        g = torch.Generator().manual_seed(rank)
        batches = [torch.randperm(100_000, generator=g)[:40_000].view(100, 400).to(dev) for _ in range(8)]
        batches = [batches[i % 8] for i in range(steps + warmup)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ddp = DistributedDataParallel(module, bucket_cap_mb=cap)
    state = None
    calls = [0]
    if name == "torch_hook":
        def counted(state, bucket):  # (no annotations: DDP checks them as objects, and they are strings here)
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted)
    elif name == "omni_dense":
        state = OmniReduceState(path="dense")
        ddp.register_comm_hook(state, omnireduce_hook)
    elif name == "omni_default":
        state = OmniReduceState()
        ddp.register_comm_hook(state, omnireduce_hook)
    times: list[float] = []
    cpu = 0.0
    for i, batch in enumerate(batches):
        calls[0] = 0
        if i == warmup:
            cpu = time.process_time()
        t0 = time.perf_counter()
        ddp(batch).sum().backward()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        for p in module.parameters():
            p.grad = None
    cpu = (time.process_time() - cpu) / steps
    out = {"ms": statistics.median(times) * 1e3, "cpu_ms": cpu * 1e3}
    if name == "torch_hook":
        out["buckets"] = calls[0]  # (DDP's buckets in the last step: rebuilt after the first)
    if state is not None:
        st = state.stats()
        out["buckets_sparse"], out["buckets_dense"] = float(st["buckets_sparse"]), float(st["buckets_dense"])
        state.close()
    del ddp
    return out


def rank_side(args: argparse.Namespace) -> None:
    """One rank: every variant of both models once, in the order given (rank 0 prints the rows)."""
    if args.tree:
        load_tree(Path(args.tree))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl":  # (each rank a host of its own, on the one GPU, NCCL's sockets on loopback)
        os.environ.update(NCCL_HOSTID=f"host{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
        torch.cuda.set_device(0)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    try:
        for item in args.order.split(","):
            model_name, name = item.split(":")
            steps = args.steps if model_name == "linear32" else args.mid_steps
            r = _variant(name, model_name, steps, args.warmup, rank, world, "cuda" if args.backend == "nccl" else "cpu")
            if rank == 0:
                print("ROW " + json.dumps({"model": model_name, "variant": name, **r}), flush=True)
    finally:
        dist.destroy_process_group()


# --- the orchestrator ----------------------------------------------------------------------------


def run_world(world: int, order: list[str], tree: Path | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One job of ``world`` ranks running the variants of ``order``; rank 0's rows."""
    port = _free_port()
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                OMNIREDUCE_TIMEOUT="60", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--rank-side", "--order", ",".join(order), "--steps", str(args.steps),
           "--mid-steps", str(args.mid_steps), "--warmup", str(args.warmup), "--backend", args.backend] + \
        (["--tree", str(tree)] if tree else [])
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world)]
        procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r)), stderr=logs[r], text=True,
                                  stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL) for r in range(world)]
        try:
            out, _ = procs[0].communicate(timeout=args.timeout)
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                tails.append(f"rank {r}: " + "".join(log.readlines()[-8:]))
            codes = [p.returncode for p in procs]
            raise RuntimeError(f"W={world}: a rank failed (exit codes {codes})\n" + "\n".join(tails))
    return [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150, help="timed steps of linear32 per variant")
    ap.add_argument("--mid-steps", type=int, default=40, help="timed steps of mid per variant")
    ap.add_argument("--warmup", type=int, default=60, help="untimed steps first (the default state decides)")
    ap.add_argument("--models", default="linear32,mid")
    ap.add_argument("--before", type=Path, default=None, help="an older source tree, run in the same turns")
    ap.add_argument("--before-name", default="before")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="nccl: every rank on the one GPU, each a host of its own over NCCL's sockets (emulated)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--order", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_side:
        rank_side(args)
        return
    models = args.models.split(",")
    items = [f"linear32:{v}" for v in LINEAR32 if "linear32" in models] + [f"mid:{v}" for v in MID if "mid" in models]
    trees: list[tuple[str, Path | None]] = [("this", None)] + ([(args.before_name, args.before)] if args.before else [])
    rows: list[dict[str, Any]] = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for rep in range(args.repeats):
            for tree_name, tree in trees if rep % 2 == 0 else trees[::-1]:
                k = rep % len(items)
                for r in run_world(world, items[k:] + items[:k], tree, args):
                    rows.append({**r, "world": world, "tree": tree_name, "repeat": rep})
    summary = summarize(rows)
    print(render(summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world, tree, model and variant: the medians over the repeats, the per-bucket extra over torch's
    hook (its buckets counted by the torch_hook variant) and the step over plain DDP's, each the median of
    the repeats' own differences and ratios (a variant against the others of its turn: what drifts on a
    shared machine between turns drops out)."""
    groups: dict[tuple[int, str, str, str], list[dict[str, Any]]] = {}
    turns: dict[tuple[int, str, str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["tree"], r["model"], r["variant"]), []).append(r)
        turns.setdefault((r["world"], r["tree"], r["model"], r["repeat"]), {})[r["variant"]] = r
    out = []
    for (world, tree, model, variant), v in groups.items():
        extras, ratios = [], []
        for r in v:
            turn = turns[(world, tree, model, r["repeat"])]
            hook, plain = turn.get("torch_hook"), turn.get("plain")
            if hook is not None and hook.get("buckets"):
                extras.append((r["ms"] - hook["ms"]) * 1e3 / hook["buckets"])
            if plain is not None:
                ratios.append(r["ms"] / plain["ms"])
        out.append({"world": world, "tree": tree, "model": model, "variant": variant,
                    "ms": statistics.median(r["ms"] for r in v), "cpu_ms": statistics.median(r["cpu_ms"] for r in v),
                    "buckets": statistics.median(r.get("buckets", 0) for r in v),
                    "us_per_bucket_over_torch_hook": statistics.median(extras) if extras else None,
                    "vs_plain": statistics.median(ratios) if ratios else None, "repeats": len(v)})
    return out


def render(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'W':>2} {'tree':<8} {'model':<9} {'variant':<13} {'ms/step':>8} {'cpu ms':>7} "
             f"{'us/bucket':>9} {'vs plain':>8}"]
    for r in sorted(summary, key=lambda r: (r["world"], r["model"] != "linear32", r["model"], r["tree"] != "this",
                                           r["tree"], LINEAR32.index(r["variant"]))):
        extra = "" if r["us_per_bucket_over_torch_hook"] is None else f"{r['us_per_bucket_over_torch_hook']:+.0f}"
        vs = "" if r["vs_plain"] is None else f"{r['vs_plain']:.3f}x"
        lines.append(f"{r['world']:>2} {r['tree']:<8} {r['model']:<9} {r['variant']:<13} {r['ms']:>8.2f} "
                     f"{r['cpu_ms']:>7.2f} {extra:>9} {vs:>8}")
    return "\n".join(lines)


def _commit() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", str(TREE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    return "unknown"


if __name__ == "__main__":
    main()
