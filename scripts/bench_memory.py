#!/usr/bin/env python3
"""Peak memory per rank of DDP training: plain DDP against omnireduce's DDP hook.

What it measures
----------------
W = 2 ranks (real processes on this machine, a Gloo process group on loopback,
``torch.set_num_threads(1)`` each) train, for ``--steps`` steps, a model of one ``--rows`` x
``--dim`` ``nn.EmbeddingBag`` (mode sum, ``sparse=False``: its gradient is a dense tensor the size
of the table, 256 MiB with the defaults) and a small dense head (``dim -> 16 -> 1``, MSE loss),
with ``DistributedDataParallel`` (default settings: 25 MB buckets, ``gradient_as_bucket_view=False``)
and plain SGD (no momentum: no optimizer state). At the end each rank reads its peak resident set
size, ``VmHWM`` of ``/proc/self/status``. Every setting runs in fresh processes.

Settings (``--configs``)
    ``ddp``: plain DDP (Gloo's all-reduce of every bucket); omnireduce is not imported.
    ``hook``: the default ``OmniReduceState()`` + ``omnireduce_hook``: ``path="measure"`` with
    ``engine="auto"``, which on Gloo times three paths per bucket (the aggregators, the collective
    engine, the dense all-reduce: with 1 + 3 calls of each, a bucket takes them in turn for 12
    steps), in the zero-setup mode (no aggregator addresses: rank 0 starts a colocated aggregator,
    a separate process whose memory does not count in the ranks'), restart recovery on (finished
    tensors' sums retained for replays, the default ``OMNIREDUCE_RETAIN_MB``).
    ``hook-omnireduce``: ``path="omnireduce"`` (every bucket through the aggregators).
    ``hook-threshold``: ``path="threshold"`` (the union-density rule, ``dense_threshold`` 0.6).
    ``hook-measure-aggregators``, ``hook-measure-collective``: ``path="measure"`` with
    ``engine="aggregators"`` or ``"collective"`` (that engine against the dense all-reduce; the
    latter starts no aggregator). Not run by default.
    ``hook-noretain``: the default state with ``OMNIREDUCE_RETAIN_MB=0`` (nothing retained for replays).
    ``hook-nomalloc``: the default state with ``OMNIREDUCE_MALLOC_TUNE=0`` (glibc's default mmap and trim
    thresholds in the ranks: see ``omnireduce/_malloc.py``). Not run by default.
    ``hook-dedicated``: the default state with a dedicated aggregator: one ``omnireduce-agg`` started by the
    benchmark for the setting (outside the ranks), its address given to the ranks in
    ``$OMNIREDUCE_AGGREGATORS``; its memory does not count either. ``hook-dedicated-noretain``,
    ``hook-dedicated-nomalloc``, ``hook-dedicated-omnireduce``, ``hook-dedicated-measure-aggregators``:
    the same with the settings above. Not run by default.
    Other ``OMNIREDUCE_*`` variables of the environment reach the ranks (e.g. ``OMNIREDUCE_LANES``).

Gradient block density (``--densities``)
    In each step every rank looks up one row in each of ``round(density * blocks)`` blocks of the
    table, the same blocks on every rank (drawn per step), a different row of the block per rank.
    A block is the hook's block for this table: ``256 // dim`` rows (the hook aligns a dense
    bucket's blocks to its table's rows), so the fraction of non-zero blocks of the embedding's
    gradient, on every rank and in the union, is the requested density. The measured one, from
    the hook's ``state.stats()["density"]`` (the embedding bucket's last union density), is
    reported for the hook's settings. The head's few parameters share the table's bucket (DDP fills
    a bucket until it holds 25 MB). At 100% the hook's first reduction goes through omnireduce (no
    density known yet), the later ones through its dense fallback.

Reported per setting: peak RSS of each rank (MiB = 2**20 bytes); its difference to plain DDP's,
each rank's peak minus the same rank's under plain DDP (the larger of the two), in MiB and as a
percentage of the gradient's bytes (all parameters, float32); and whether that is within
``--target`` percent. The JSON also has each rank's RSS and peak after every step, its RSS before
the first step, and, for the hook, its stats and the bytes its worker retained at the end.

    python scripts/bench_memory.py                                  # defaults: 5 settings x 4 densities
    python scripts/bench_memory.py --densities 0.002 --configs ddp,hook,hook-omnireduce --steps 12
    python scripts/bench_memory.py --densities 0.02 --configs ddp,hook-dedicated --steps 12 --phases

``--phases`` also records, per step and rank, the peak of its forward pass, its backward pass (where
DDP calls the hook, whose reductions complete before ``backward()`` returns) and its optimizer step
(``VmHWM`` reset before each through ``/proc/self/clear_refs``), and after each step glibc's
``mallinfo2()`` (the bytes the arenas hold, in use and free) and the resident bytes by kind of
mapping (the heap, anonymous maps, files): where a peak over plain DDP's sits.

Output: a table on stdout, ``<out-dir>/bench_memory.json`` (every row, and metadata: machine,
versions, arguments, model sizes) and ``<out-dir>/bench_memory.md`` (the table in Markdown). The
ranks share the machine's CPUs; peaks do not depend on timing much, but run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ombench.machine import machine_info
from ombench.network import LOOPBACK, Network, exit_on_signals, print_log_tails

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
HIDDEN = 16
BAG = 8  # lookups per bag
CONFIGS: dict[str, tuple[str, dict[str, str], dict[str, str]]] = {  # name: (what, environment, state options)
    "ddp": ("plain DDP (Gloo all-reduce)", {}, {}),
    "hook": ("omnireduce_hook, the default state (path='measure', engine='auto': the aggregators, the collective "
             "engine and the dense all-reduce timed), recovery on (default retention)", {}, {}),
    "hook-omnireduce": ("omnireduce_hook, path='omnireduce' (every bucket through the aggregators)", {},
                        {"path": "omnireduce"}),
    "hook-threshold": ("omnireduce_hook, path='threshold' (the union-density rule)", {}, {"path": "threshold"}),
    "hook-measure-aggregators": ("omnireduce_hook, path='measure', engine='aggregators' (aggregators against dense)",
                                 {}, {"engine": "aggregators"}),
    "hook-measure-collective": ("omnireduce_hook, path='measure', engine='collective' (collective engine against "
                                "dense; no aggregator)", {}, {"engine": "collective"}),
    "hook-noretain": ("omnireduce_hook (default state), OMNIREDUCE_RETAIN_MB=0", {"OMNIREDUCE_RETAIN_MB": "0"}, {}),
    "hook-nomalloc": ("omnireduce_hook (default state), OMNIREDUCE_MALLOC_TUNE=0", {"OMNIREDUCE_MALLOC_TUNE": "0"},
                      {}),
    "hook-dedicated": ("omnireduce_hook, the default state, a dedicated aggregator ($OMNIREDUCE_AGGREGATORS)", {}, {}),
    "hook-dedicated-noretain": ("omnireduce_hook (default state), a dedicated aggregator, OMNIREDUCE_RETAIN_MB=0",
                                {"OMNIREDUCE_RETAIN_MB": "0"}, {}),
    "hook-dedicated-nomalloc": ("omnireduce_hook (default state), a dedicated aggregator, OMNIREDUCE_MALLOC_TUNE=0",
                                {"OMNIREDUCE_MALLOC_TUNE": "0"}, {}),
    "hook-dedicated-omnireduce": ("omnireduce_hook, path='omnireduce', a dedicated aggregator", {},
                                  {"path": "omnireduce"}),
    "hook-dedicated-measure-aggregators": ("omnireduce_hook, path='measure', engine='aggregators', a dedicated "
                                           "aggregator", {}, {"engine": "aggregators"}),
}
DEDICATED = "hook-dedicated"
"""Settings whose name starts with this run beside an aggregator of their own, started by the benchmark."""
DEFAULT_CONFIGS = ("ddp", "hook", "hook-omnireduce", "hook-threshold", "hook-noretain")
MIB = 2**20
STATS_KEPT = ("buckets_sparse", "buckets_dense", "buckets_failed", "bytes_sent", "bytes_received", "density",
              "iteration", "path", "engine", "collective_reductions", "collective_exchanges", "paths")
"""The hook's ``stats()`` a rank reports (the rest says nothing about memory)."""


# ------------------------------------------------------------------------------------------------
# one rank


def proc_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def heap_info() -> dict[str, int] | None:
    """glibc's ``mallinfo2()``, over every arena: the bytes the arenas hold (``arena``), those in use
    (``used``) and those free but kept (``free``), and the bytes of ``mmap``ed chunks (``mmapped``);
    None where the C library is not glibc 2.33 or later."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                           "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = Mallinfo2
    m = fn()
    return {"arena": m.arena, "used": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def smaps() -> dict[str, int]:
    """Resident bytes by kind of mapping (``/proc/self/smaps``): the heap, anonymous maps, files, the rest."""
    out: dict[str, int] = {}
    kind = "other"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 6)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else ""
                kind = "heap" if name == "[heap]" else "anon" if not name else "stack" if name.startswith("[stack") \
                    else "file" if name.startswith("/") else "other"
            elif head and head[0] == "Rss:":
                out[kind] = out.get(kind, 0) + int(head[1]) * 1024
    return out


def reset_peak() -> None:
    """Set this process's ``VmHWM`` to its present RSS (``/proc/self/clear_refs``, Linux 4.0 on)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rows_per_block(dim: int, block: int = 256) -> int:
    """Rows in one of the hook's blocks of a ``dim``-wide table (blocks aligned to rows)."""
    return max(1, block // dim)


def make_batch(step: int, rank: int, density: float, rows: int, dim: int, seed: int) -> tuple[Any, ...]:
    """``(indices, offsets, target)`` of one step on one rank: one row in each of the step's blocks."""
    import numpy as np
    import torch

    per = rows_per_block(dim)
    blocks = -(-rows // per)
    k = max(1, round(density * blocks))
    rng = np.random.default_rng([seed, step])  # the same blocks on every rank
    chosen = np.arange(blocks) if k >= blocks else rng.choice(blocks, size=k, replace=False)
    idx = np.minimum(chosen * per + rank % per, rows - 1)  # a different row of the block per rank
    idx = torch.from_numpy(idx.astype(np.int64))
    offsets = torch.arange(0, idx.numel(), BAG, dtype=torch.int64)
    target = torch.from_numpy(np.random.default_rng([seed, step, rank]).standard_normal((offsets.numel(), 1))
                              .astype(np.float32))
    return idx, offsets, target


def rank_main(cfg: dict[str, Any]) -> None:
    """Train for ``cfg["steps"]`` steps with ``cfg["config"]``; rank 0 writes every rank's numbers to ``cfg["out"]``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from omnireduce.launch import init_distributed
    from omnireduce.lifetime import exit_with_parent

    exit_with_parent()  # SIGTERM when the benchmark is gone (Network.run_ranks: stdin is a pipe from it)
    torch.set_num_threads(1)
    rank, world = init_distributed("gloo")
    torch.manual_seed(cfg["seed"])
    rows, dim = cfg["rows"], cfg["dim"]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=False)
            self.head = nn.Sequential(nn.Linear(dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

        def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.head(self.table(idx, offsets))

    model = DistributedDataParallel(Model())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = None
    table_bucket: list[int] = []
    if cfg["config"] != "ddp":
        from omnireduce.ddp import OmniReduceState, omnireduce_hook

        # no addresses: $OMNIREDUCE_AGGREGATORS (the dedicated settings) or the job's own (colocated) aggregator
        state = OmniReduceState(**CONFIGS[cfg["config"]][2])
        table_numel = rows * dim

        def hook(s, bucket):  # unannotated: DDP checks a hook's annotations when it has some
            if bucket.buffer().numel() >= table_numel and not table_bucket:
                table_bucket.append(bucket.index())  # the embedding's bucket (for its density)
            return omnireduce_hook(s, bucket)

        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    start = proc_status()
    rss, hwm, losses, heaps, phases = [], [], [], [], []
    phased = cfg.get("phases", False)
    top = start["VmHWM"]  # (with phases: the peak so far, VmHWM being reset before each phase)
    t0 = time.monotonic()
    for step in range(cfg["steps"]):
        idx, offsets, target = make_batch(step, rank, cfg["density"], rows, dim, cfg["seed"])
        peaks: dict[str, int] = {}
        if phased:
            reset_peak()
        opt.zero_grad()
        loss = loss_fn(model(idx, offsets), target)
        if phased:
            peaks["forward"] = proc_status()["VmHWM"]
            reset_peak()
        loss.backward()
        if phased:
            peaks["backward"] = proc_status()["VmHWM"]
            reset_peak()
        opt.step()
        losses.append(loss.item())
        now = proc_status()
        rss.append(now["VmRSS"])
        if phased:
            peaks["step"] = now["VmHWM"]
            phases.append(peaks)
            top = max(top, *peaks.values())
        hwm.append(max(top, now["VmHWM"]))
        if phased:
            heaps.append({"malloc": heap_info(), "resident": smaps()})
    wall = time.monotonic() - t0
    end = proc_status()
    end["VmHWM"] = max(end["VmHWM"], top)
    mine: dict[str, Any] = {"rank": rank, "peak_rss": end["VmHWM"], "rss_end": end["VmRSS"],
                            "rss_before_steps": start["VmRSS"], "peak_before_steps": start["VmHWM"],
                            "rss_after_step": rss, "peak_after_step": hwm, "train_s": wall}
    if phased:
        mine.update(peak_in_phase=phases, memory_after_step=heaps)
    if state is not None:
        stats = state.stats()
        mine["hook_stats"] = {k: v for k, v in stats.items() if k in STATS_KEPT}
        if table_bucket:
            mine["table_bucket"] = table_bucket[0]
            mine["density_measured"] = stats["density"].get(table_bucket[0])
        io = getattr(state.worker, "_io", None)  # internal: what the worker keeps for replays
        if io is not None and hasattr(io, "_retained_bytes"):
            mine["retained_bytes_end"] = int(io._retained_bytes)
            mine["retained_tensors_end"] = len(io._retained)
        from omnireduce.worker import op as op_module

        mine["worker_op_module"] = op_module.__file__  # which checkout's code ran
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"ranks": everyone, "gradient_bytes": grad_bytes,
                                                "losses": losses}))
    dist.barrier()
    if state is not None:
        state.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# one setting, in its own processes


def run_setting(net: Network, config: str, density: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start the two ranks of one (setting, density), wait, return its row (with ``error`` on failure)."""
    tag = f"{config}-{density:g}"
    out = tmp / f"{tag}.json"
    cfg = {"config": config, "density": density, "rows": args.rows, "dim": args.dim, "steps": args.steps,
           "seed": args.seed, "out": str(out), "phases": args.phases}
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMNIREDUCE_AGGREGATORS", "OMNIREDUCE_JOB", "OMNIREDUCE_RETAIN_MB", "OMNIREDUCE_MALLOC_TUNE")}
    env.update(CONFIGS[config][1], WORLD_SIZE=str(WORLD), MASTER_ADDR=net.master_addr,
               MASTER_PORT=str(net.master_port()), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank", json.dumps(cfg)]
    row: dict[str, Any] = {"config": config, "density": density}
    logs = [tmp / f"{tag}-rank{rank}.log" for rank in range(WORLD)]
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if config.startswith(DEDICATED):  # an omnireduce-agg of the setting's own, outside the ranks
            agg_net = stack.enter_context(Network(LOOPBACK, WORLD, 1))
            env["OMNIREDUCE_AGGREGATORS"] = ",".join(agg_net.start_aggregators(logdir=tmp))
        error = net.run_ranks(cmd, [dict(env, RANK=str(r), LOCAL_RANK=str(r)) for r in range(WORLD)], logs,
                              args.setting_timeout)
    row["wall_s"] = time.monotonic() - t0
    if error is None and not out.exists():
        error = "rank 0 wrote no result"
    if error is not None:
        row["error"] = error
        print(f"  FAILED: {config} at density {density:g}: {error}", file=sys.stderr)
        print_log_tails(logs)
        return row
    row.update(json.loads(out.read_text()))
    row["peak_rss_mib"] = [r["peak_rss"] / MIB for r in row["ranks"]]
    return row


def compare(rows: list[dict[str, Any]], target_pct: float) -> None:
    """Add to each row its difference to plain DDP at the same density, in MiB and as % of the
    gradient's bytes: each rank's peak minus the same rank's under plain DDP, the larger of the two."""
    base = {r["density"]: r["peak_rss_mib"] for r in rows if r["config"] == "ddp" and "error" not in r}
    for r in rows:
        if "error" in r or r["density"] not in base:
            continue
        diff = max(p - q for p, q in zip(r["peak_rss_mib"], base[r["density"]], strict=True))
        r["vs_ddp_mib"] = diff
        r["vs_ddp_pct_of_gradient"] = 100 * diff * MIB / r["gradient_bytes"]
        if r["config"] != "ddp":
            r["within_target"] = r["vs_ddp_pct_of_gradient"] <= target_pct


def measured_density(r: dict[str, Any]) -> str:
    values = [x["density_measured"] for x in r.get("ranks", []) if x.get("density_measured") is not None]
    return f"{100 * values[0]:.2f}%" if values else "-"


def text_table(rows: list[dict[str, Any]], target_pct: float) -> str:
    out = [f"{'density':>8} {'measured':>9} {'setting':<24} {'rank 0 MiB':>10} {'rank 1 MiB':>10} "
           f"{'vs DDP MiB':>10} {'% of grad':>9}  target (<= {target_pct:g}%)"]
    for r in rows:
        if "error" in r:
            out.append(f"{100 * r['density']:>7g}% {'':>9} {r['config']:<24} FAILED: {r['error']}")
            continue
        peaks = " ".join(f"{p:>10.0f}" for p in r["peak_rss_mib"])
        diff = f"{r['vs_ddp_mib']:>+10.0f} {r['vs_ddp_pct_of_gradient']:>+8.1f}%" if "vs_ddp_mib" in r else \
            f"{'-':>10} {'-':>9}"
        ok = "" if "within_target" not in r else ("met" if r["within_target"] else "MISSED")
        out.append(f"{100 * r['density']:>7g}% {measured_density(r):>9} {r['config']:<24} {peaks} {diff}  {ok}")
    return "\n".join(out)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    out = ["| block density (measured) | setting | peak RSS rank 0, MiB | peak RSS rank 1, MiB | vs plain DDP, MiB "
           "| % of gradient bytes |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {100 * r['density']:g}% | {r['config']} | failed: {r['error']} | | | |")
            continue
        m = measured_density(r)
        dens = f"{100 * r['density']:g}%" + (f" ({m})" if m != "-" else "")
        diff = (f"{r['vs_ddp_mib']:+.0f} | {r['vs_ddp_pct_of_gradient']:+.1f}%" if r["config"] != "ddp" and
                "vs_ddp_mib" in r else "- | -")
        out.append(f"| {dens} | {r['config']} | " + " | ".join(f"{p:.0f}" for p in r["peak_rss_mib"])
                   + f" | {diff} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# main


def _floats(s: str) -> list[float]:
    try:
        values = [float(v) for v in s.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities are fractions in (0, 1]; got {s!r}")
    return values


def _configs(s: str) -> list[str]:
    items = [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in items if v not in CONFIGS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(CONFIGS)}; got {s!r}")
    return items


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="training steps per setting (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=1 << 20, help="embedding rows (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=64, help="embedding width (default: %(default)s)")
    ap.add_argument("--densities", type=_floats, default=[0.002, 0.02, 0.1, 1.0],
                    help="gradient block densities, comma-separated fractions (default: 0.002,0.02,0.1,1)")
    ap.add_argument("--configs", type=_configs, default=list(DEFAULT_CONFIGS),
                    help=f"settings, from {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--target", type=float, default=5.0,
                    help="allowed excess over plain DDP's peak, %% of the gradient's bytes (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", action="store_true",
                    help="also each step's peak in its forward pass, backward pass (the hook's reductions) and "
                         "optimizer step (VmHWM reset before each through /proc/self/clear_refs)")
    ap.add_argument("--setting-timeout", type=float, default=300.0, help="seconds per setting (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "results" / "bench_memory",
                    help="where bench_memory.json and bench_memory.md go (default: results/bench_memory)")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rank is not None:
        rank_main(json.loads(args.rank))
        return 0
    if args.steps < 2:
        sys.exit("bench_memory: need --steps >= 2 (DDP rebuilds its buckets after the first)")
    configs = ["ddp"] + [c for c in args.configs if c != "ddp"]  # the baseline always runs
    exit_on_signals("bench_memory")
    gradient_mib = (args.rows * args.dim + args.dim * HIDDEN + HIDDEN + HIDDEN + 1) * 4 / MIB
    print(f"bench_memory: W={WORLD}, EmbeddingBag {args.rows:,} x {args.dim} (sparse=False) + head, "
          f"gradient {gradient_mib:.1f} MiB, {args.steps} steps, densities "
          f"{','.join(f'{d:g}' for d in args.densities)}", flush=True)
    meta: dict[str, Any] = {
        "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(ROOT),
        "workers": WORLD, "steps": args.steps, "seed": args.seed, "mib": "2**20 bytes",
        "model": {"rows": args.rows, "dim": args.dim, "embedding": "EmbeddingBag(mode=sum, sparse=False)",
                  "head": f"Linear({args.dim},{HIDDEN})-ReLU-Linear({HIDDEN},1)", "bag": BAG,
                  "rows_per_block": rows_per_block(args.dim), "gradient_mib": gradient_mib},
        "ddp": {"backend": "gloo", "defaults": "bucket_cap_mb 25, gradient_as_bucket_view False",
                "optimizer": "SGD(lr=0.01)", "threads_per_rank": 1},
        "configs": {c: {"what": CONFIGS[c][0], "env": CONFIGS[c][1], "state": CONFIGS[c][2]}
                    for c in configs},
        "peak": "VmHWM of /proc/self/status at the end of each rank",
        "target_pct_of_gradient": args.target,
    }
    rows: list[dict[str, Any]] = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out_dir / "bench_memory.json", args.out_dir / "bench_memory.md"
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmpdir, Network("loopback", WORLD, 0) as net:
        for density in args.densities:
            for config in configs:
                print(f"  density {density:g}, {config} ...", flush=True)
                row = run_setting(net, config, density, args, Path(tmpdir))
                rows.append(row)
                compare(rows, args.target)
                json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = text_table(rows, args.target)
    print("\npeak RSS per rank (VmHWM), MiB; vs DDP: each rank's peak minus the same rank's under plain DDP (the "
          f"larger of the two), in MiB and as % of the gradient's {gradient_mib:.0f} MiB\n" + table)
    md_path.write_text(markdown_table(rows) + "\n")
    print(f"\nwrote {json_path} and {md_path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
