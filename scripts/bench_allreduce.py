#!/usr/bin/env python3
"""All-reduce micro-benchmark: omnireduce against the dense and sparse all-reduces users would run instead.

Workload (DESIGN.md section 6, from the OmniReduce artifact): a float32 tensor (100 MiB by default),
blocks of 256, each rank marks ``int(blocks * d)`` random blocks non-zero (``--placement overlap``:
the same blocks on every rank), over a sweep of densities ``d``. For each density and method: warm-up
iterations, then timed ones; an iteration's time is the slowest rank's, and the table reports the
median. Every method runs in the same processes in the same run.

Methods: ``omnireduce`` (A aggregators as real ``omnireduce-agg`` processes), ``gloo``
(torch.distributed all_reduce), ``agsparse`` (all-gather of each rank's non-zero blocks and their
indices through Gloo, then a local sum).

    python scripts/bench_allreduce.py --loopback                    # the issue-2 table, W=4, A=1
    python scripts/bench_allreduce.py --loopback --workers 2 --densities 0.01,0.1

Prints a table and writes JSON (``--json``, default results/bench_allreduce.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DENSITIES = [1.0, 0.8, 0.4, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_input(rank: int, numel: int, density: float, block: int, placement: str, seed: int) -> np.ndarray:
    """A block-sparse float32 tensor: ``int(blocks * density)`` random non-zero blocks."""
    nb = -(-numel // block)
    k = int(nb * density)
    pick = np.random.default_rng(seed if placement == "overlap" else seed + 7919 * (rank + 1))
    idx = pick.choice(nb, k, replace=False) if k < nb else np.arange(nb)
    x = np.zeros(nb * block, dtype=np.float32)
    vals = np.random.default_rng(seed + 104729 * (rank + 1)).standard_normal((k, block), dtype=np.float32)
    x.reshape(nb, block)[idx] = vals
    return x[:numel]


def agsparse(x, block: int, dist, torch):
    """All-gather of non-zero blocks and their indices (two all_gathers: counts, then padded payloads)."""
    nb = -(-x.numel() // block)
    padded = torch.nn.functional.pad(x, (0, nb * block - x.numel())).view(nb, block)
    idx = padded.ne(0).any(1).nonzero().view(-1)
    W = dist.get_world_size()
    count = torch.tensor([idx.numel()])
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(W)]
    dist.all_gather(counts, count)
    most = int(max(c.item() for c in counts))
    send_idx = torch.full((most,), -1, dtype=torch.long)
    send_idx[: idx.numel()] = idx
    send_val = torch.zeros(most, block)
    send_val[: idx.numel()] = padded[idx]
    all_idx = [torch.empty_like(send_idx) for _ in range(W)]
    all_val = [torch.empty_like(send_val) for _ in range(W)]
    dist.all_gather(all_idx, send_idx)
    dist.all_gather(all_val, send_val)
    out = torch.zeros_like(padded)
    for i, v, c in zip(all_idx, all_val, counts, strict=True):
        n = int(c.item())
        out.index_add_(0, i[:n], v[:n])
    x.copy_(out.view(-1)[: x.numel()])
    return x


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    with open(f"/proc/{pid or 'self'}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_main(rank: int, args: argparse.Namespace, aggregators: list[str], port: int, out_path: str,
                agg_pids: list[int]) -> None:
    import torch
    import torch.distributed as dist

    import omnireduce

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", args.master_addr)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    numel = int(args.size_mib * (1 << 20)) // 4
    methods = args.methods.split(",")
    w = None
    if "omnireduce" in methods:
        w = omnireduce.Worker(aggregators, rank=rank, world_size=args.workers, job=f"bench-{port}",
                              block_size=args.block, timeout=120, lanes=args.lanes, slots=args.slots)
    rows = []
    for density in args.densities:
        base = make_input(rank, numel, density, args.block, args.placement, args.seed)
        ref = None
        for method in methods:
            times, stats_before = [], (w.stats() if w else None)
            own_cpu = 0.0
            for it in range(args.warmup + args.iters):
                x = torch.from_numpy(base.copy())
                dist.barrier()
                if it == args.warmup:
                    agg0 = sum(cpu_seconds(p) for p in agg_pids)
                c0 = cpu_seconds()
                t0 = time.perf_counter()
                if method == "omnireduce":
                    w.allreduce(x)
                elif method == "gloo":
                    dist.all_reduce(x)
                elif method == "agsparse":
                    agsparse(x, args.block, dist, torch)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                if it >= args.warmup:
                    own_cpu += cpu_seconds() - c0
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if it >= args.warmup:
                    times.append(dt.item())
            spent = torch.tensor([own_cpu], dtype=torch.float64)
            dist.all_reduce(spent)  # CPU of all ranks inside the timed operations
            agg_cpu = sum(cpu_seconds(p) for p in agg_pids) - agg0 if method == "omnireduce" else 0.0
            if ref is None:
                ref = x.numpy().copy()
            elif not np.allclose(x.numpy(), ref, rtol=1e-5, atol=1e-5):
                raise SystemExit(f"{method} disagrees with {methods[0]} at density {density}")
            row = {"method": method, "density": density, "median_s": statistics.median(times),
                   "times_s": times, "worker_cpu_s_per_op": spent.item() / args.iters,
                   "aggregator_cpu_s_per_op": agg_cpu / args.iters}
            if method == "omnireduce" and w is not None:
                after = w.stats()
                n_ops = args.warmup + args.iters
                row["bytes_sent_per_op"] = (after["bytes_sent"] - stats_before["bytes_sent"]) / n_ops
                row["bytes_received_per_op"] = (after["bytes_received"] - stats_before["bytes_received"]) / n_ops
            rows.append(row)
            if rank == 0:
                print(f"  d={density:<5} {method:<11} median {row['median_s'] * 1e3:9.2f} ms   CPU per op: "
                      f"ranks {row['worker_cpu_s_per_op'] * 1e3:7.1f} ms, aggregators "
                      f"{row['aggregator_cpu_s_per_op'] * 1e3:6.1f} ms", flush=True)
    if w is not None:
        w.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def start_aggregators(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://127.0.0.1:0",
                              "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline().strip()
        if not line.startswith("omnireduce-agg listening on "):
            raise SystemExit(f"aggregator did not start: {line!r}")
        procs.append(p)
        addresses.append(line.rsplit(" ", 1)[1])
    return procs, addresses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loopback", action="store_true", help="run every process on this machine (127.0.0.1)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--aggregators", type=int, default=1)
    ap.add_argument("--size-mib", type=float, default=100.0)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--lanes", type=int, default=None)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=DENSITIES)
    ap.add_argument("--placement", choices=["random", "overlap"], default="random")
    ap.add_argument("--methods", default="omnireduce,gloo,agsparse")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--json", default="results/bench_allreduce.json")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    procs, addresses = start_aggregators(args.aggregators) if "omnireduce" in args.methods else ([], [])
    tmp = Path(args.json).with_suffix(".rows.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    print(f"W={args.workers} A={args.aggregators} {args.size_mib:g} MiB fp32, block {args.block}, "
          f"placement {args.placement}, {args.iters} timed iterations after {args.warmup} warm-up", flush=True)
    try:
        mp.spawn(worker_main, args=(args, addresses, free_port(), str(tmp), [p.pid for p in procs]),
                 nprocs=args.workers, join=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    by = {(r["method"], r["density"]): r for r in rows}
    methods = args.methods.split(",")
    print("\nmedian time per all-reduce (slowest rank), ms; CPU = all ranks + aggregators per all-reduce, ms")
    print(f"{'density':>8} " + " ".join(f"{m + ' ms':>14}" for m in methods)
          + " ".join(f"{m[:5] + ' CPU':>11}" for m in methods)
          + ("   gloo/omnireduce" if {"gloo", "omnireduce"} <= set(methods) else ""))
    for d in args.densities:
        line = f"{d:>8} " + " ".join(f"{by[(m, d)]['median_s'] * 1e3:>14.2f}" for m in methods)
        line += " ".join(f"{(by[(m, d)]['worker_cpu_s_per_op'] + by[(m, d)]['aggregator_cpu_s_per_op']) * 1e3:>11.0f}"
                         for m in methods)
        if {"gloo", "omnireduce"} <= set(methods):
            line += f"   {by[('gloo', d)]['median_s'] / by[('omnireduce', d)]['median_s']:>16.2f}x"
        print(line)
    meta = {"argv": sys.argv, "workers": args.workers, "aggregators": args.aggregators,
            "size_mib": args.size_mib, "block": args.block, "placement": args.placement,
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
