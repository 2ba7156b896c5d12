"""Where the CPU of one all-reduce goes: a breakdown per thread and per kind of work.

W rank processes (each an ``omnireduce.Worker``, ``torch``-free, one thread of numpy) all-reduce a
block-sparse float32 tensor (100 MiB by default, blocks of 256, ``int(blocks * d)`` random
non-zero blocks per rank, as in ``scripts/bench_allreduce.py``) against one aggregator process on
loopback, ``--iters`` times per density after ``--warmup``. Two runs per density:

1. Unprofiled: every thread's CPU time over the timed all-reduces, from ``/proc/PID/task/*/schedstat``
   (nanoseconds, user + system): the rank's caller thread (minus the time it spends refilling the
   tensor between all-reduces, timed with its own thread clock), its I/O thread, libzmq's I/O
   thread (the kernel's TCP copies and libzmq), and the aggregator's loop and libzmq I/O thread.
   Page faults per all-reduce from ``/proc/PID/stat`` (minor faults, the whole process).
2. Profiled: ``cProfile`` with the thread CPU clock (``time.thread_time``, so time other
   processes hold the core is not counted) on rank 0's I/O thread and on the aggregator's loop. The
   share of each kind of work in the profiled thread (the cumulative time of the functions that do
   it, which do not call one another) is applied to that thread's CPU measured in run 1. The
   profiler's own cost falls mostly on Python-heavy code, so the "Python" remainder is an upper
   bound and the numpy terms (scan, gather, scatter, sums) lower bounds.

The scan floor is one pass of ``omnireduce.blocks.block_nonzero`` over the tensor, timed in each
rank with its thread clock (the median of 5), summed over ranks.

Usage::

    python scripts/profile_allreduce.py --workers 4 --densities 0.01,0.1,1 --iters 40
    python scripts/profile_allreduce.py --size-mib 25 --densities 0.01 --json results/profile.json

Prints a table per density (ms of CPU per all-reduce, all ranks together, and the aggregator) and
writes the rows to ``--json`` (default ``results/profile_allreduce.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ombench.cpu import thread_cpu
from ombench.machine import machine_info
from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType
from omnireduce.launch.procs import stop_processes

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 256

#: Kinds of work, and the functions (file suffix, name) whose cumulative time is that work; none of
#: the functions of one kind calls a function of another.
KINDS: dict[str, list[tuple[str, str]]] = {
    "scan": [("blocks.py", "block_nonzero")],
    "lane index": [("blocks.py", "__init__"), ("blocks.py", "advance"), ("blocks.py", "from_ids")],
    "gather": [("blocks.py", "gather_blocks")],
    "scatter": [("blocks.py", "scatter_blocks"), ("blocks.py", "zero_blocks")],
    "sums": [("slot.py", "_sum_dense"), ("slot.py", "_sum_sparse"), ("wire.py", "to_wire"), ("dtypes.py", "narrow"),
             ("wire.py", "unwire")],
    "slot state": [("slot.py", "__init__"), ("slot.py", "_check_rows"), ("slot.py", "_start_round")],
    "serialisation": [("wire.py", "encode_rows"), ("wire.py", "decode"), ("wire.py", "pack"),
                      ("wire.py", "unpack_header"), ("wire.py", "frame_bytes")],
    "zmq calls": [("transport.py", "send_frames"), ("transport.py", "recv_frames"), ("poll.py", "poll")],
}


def minor_faults(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def kinds_of(stats: pstats.Stats) -> tuple[dict[str, float], float]:
    """Seconds of each kind of work in a profile, and the profile's total."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    out = dict.fromkeys(KINDS, 0.0)
    for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in table.items():
        for kind, names in KINDS.items():
            if any(filename.endswith(suffix) and func == name for suffix, name in names):
                out[kind] += ct
    return out, float(stats.total_tt)  # type: ignore[attr-defined]


def make_input(rank: int, numel: int, density: float, seed: int) -> np.ndarray:
    nb = -(-numel // BLOCK)
    k = int(nb * density)
    rng = np.random.default_rng(seed + 7919 * (rank + 1))
    idx = rng.choice(nb, k, replace=False) if k < nb else np.arange(nb)
    x = np.zeros(nb * BLOCK, dtype=np.float32)
    x.reshape(nb, BLOCK)[idx] = rng.standard_normal((k, BLOCK), dtype=np.float32)
    return x[:numel]


# -- processes ----------------------------------------------------------------------------------


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank: warm up, then time ``iters`` all-reduces; print one JSON line with its counters."""
    import omnireduce
    import omnireduce.worker.io_loop as io_loop

    rank, profile = cfg["rank"], cfg["profile"] and cfg["rank"] == 0
    prof = cProfile.Profile(time.thread_time) if profile else None
    if prof is not None:  # (from the I/O thread's start: the warm-up is profiled too)
        run = io_loop.IOLoop._run

        def profiled(self: Any) -> None:
            prof.enable()
            try:
                run(self)
            finally:
                prof.disable()

        io_loop.IOLoop._run = profiled  # type: ignore[method-assign]
    w = omnireduce.Worker([cfg["address"]], rank=rank, world_size=cfg["workers"], job=cfg["job"], timeout=120)
    base = make_input(rank, cfg["numel"], cfg["density"], cfg["seed"])
    x = base.copy()
    scans = []
    for _ in range(5):
        t0 = time.thread_time()
        block_nonzero(base, DType.FLOAT32, BLOCK)
        scans.append(time.thread_time() - t0)
    for _ in range(cfg["warmup"]):
        np.copyto(x, base)
        w.allreduce(x)
    me, io_thread = threading.get_native_id(), w._io._thread.native_id
    print(json.dumps({"event": "start", "rank": rank}), flush=True)
    refill = 0.0
    cpu0, faults0, t0 = thread_cpu(), minor_faults(), time.perf_counter()
    for _ in range(cfg["iters"]):
        c = time.thread_time()
        np.copyto(x, base)
        refill += time.thread_time() - c
        w.allreduce(x)
    cpu, faults, wall = delta(thread_cpu(), cpu0), minor_faults() - faults0, time.perf_counter() - t0
    print(json.dumps({"event": "end", "rank": rank}), flush=True)
    w.close()
    threads: dict[str, float] = {"caller": 0.0, "io": 0.0, "zmq": 0.0, "other": 0.0}
    for key, ns in cpu.items():
        name, tid = key.rsplit(":", 1)
        kind = ("caller" if int(tid) == me else "io" if int(tid) == io_thread else
                "zmq" if name.startswith("ZMQbg/IO") else "other")
        threads[kind] += ns / 1e9
    threads["caller"] -= refill
    row: dict[str, Any] = {"event": "rank", "rank": rank, "threads_s": threads, "minor_faults": faults,
                           "wall_s": wall, "scan_s": statistics.median(scans)}
    if prof is not None:
        kinds, total = kinds_of(pstats.Stats(prof))
        row["profile"] = {"kinds_s": kinds, "total_s": total}
    print(json.dumps(row), flush=True)


def aggregator_main(cfg: dict[str, Any]) -> None:
    """The aggregator, serving from this process's main thread (profiled with ``--profile``)."""
    from omnireduce._malloc import keep_freed_memory
    from omnireduce.aggregator import Aggregator

    keep_freed_memory()
    agg = Aggregator(cfg["listen"], insecure=True)
    print(json.dumps({"event": "listening", "address": agg.bind()}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: agg.request_stop())
    prof = cProfile.Profile(time.thread_time) if cfg["profile"] else None
    if prof is not None:
        prof.enable()
    agg.serve_forever()
    if prof is not None:
        prof.disable()
        kinds, total = kinds_of(pstats.Stats(prof))
        print(json.dumps({"event": "profile", "kinds_s": kinds, "total_s": total}), flush=True)


# -- driver -------------------------------------------------------------------------------------


def _spawn(mode: str, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, mode, json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
                            env=env)


def _events(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


def one_run(args: argparse.Namespace, density: float, profile: bool) -> dict[str, Any]:
    """One run of all ranks against one aggregator; per-thread CPU of every process, per all-reduce."""
    numel = int(args.size_mib * 2**20) // 4
    agg = _spawn("--aggregator-main", {"listen": "tcp://127.0.0.1:0", "profile": profile})
    procs = [agg]
    try:
        agg_events = _events(agg)
        address = next(agg_events)["address"]
        ranks = [_spawn("--rank-main", {"rank": r, "workers": args.workers, "address": address, "numel": numel,
                                         "density": density, "seed": args.seed, "warmup": args.warmup,
                                         "iters": args.iters, "profile": profile, "job": f"profile-{os.getpid()}"})
                 for r in range(args.workers)]
        procs += ranks
        first = _events(ranks[0])
        assert next(first)["event"] == "start"
        agg0 = thread_cpu(agg.pid)
        assert next(first)["event"] == "end"
        agg_cpu = delta(thread_cpu(agg.pid), agg0)
        rows = [next(e for e in first if e["event"] == "rank")]
        rows += [next(e for e in _events(p) if e["event"] == "rank") for p in ranks[1:]]
        for p in ranks:
            p.wait(timeout=120)
        agg.send_signal(signal.SIGTERM)
        agg_profile = next((e for e in agg_events if e["event"] == "profile"), None) if profile else None
        agg.wait(timeout=30)
    finally:
        stop_processes(procs)
    n = args.iters
    agg_threads = {"loop": 0.0, "zmq": 0.0, "other": 0.0}
    for key, ns in agg_cpu.items():
        name = key.rsplit(":", 1)[0]
        kind = "zmq" if name.startswith("ZMQbg/IO") else "other" if name.startswith("ZMQbg") else "loop"
        agg_threads[kind] += ns / 1e9
    return {
        "ranks": {k: sum(r["threads_s"][k] for r in rows) / n for k in rows[0]["threads_s"]},
        "aggregator": {k: v / n for k, v in agg_threads.items()},
        "minor_faults_per_op": sum(r["minor_faults"] for r in rows) / n,
        "scan_floor_s": sum(r["scan_s"] for r in rows),
        "wall_s_per_op": max(r["wall_s"] for r in rows) / n,
        "rank0_profile": rows[0].get("profile"), "aggregator_profile": agg_profile,
    }


def breakdown(plain: dict[str, Any], prof: dict[str, Any]) -> dict[str, float]:
    """ms of CPU per all-reduce for each term: profile shares applied to the unprofiled threads."""
    agg_loop = plain["aggregator"]["loop"]
    rp, ap = prof["rank0_profile"], prof["aggregator_profile"]
    # The ranks' scan is the scan floor's work (the same function on the same tensor), measured without
    # a profiler; the profile's shares split the rest of their I/O threads' CPU.
    scan = min(plain["scan_floor_s"], plain["ranks"]["io"])
    rest = plain["ranks"]["io"] - scan
    others = rp["total_s"] - rp["kinds_s"]["scan"]
    rank_share = {k: (0.0 if k == "scan" else v / others) for k, v in rp["kinds_s"].items()}
    agg_share = {k: v / ap["total_s"] for k, v in ap["kinds_s"].items()}
    terms: dict[str, float] = {}
    for kind in KINDS:
        terms[kind] = (rank_share[kind] * rest + agg_share[kind] * agg_loop) * 1e3
    terms["scan"] += scan * 1e3
    terms["Python: dispatch, messages, futures (ranks' I/O threads)"] = (1 - sum(rank_share.values())) * rest * 1e3
    terms["Python: dispatch, messages (aggregator loop)"] = (1 - sum(agg_share.values())) * agg_loop * 1e3
    terms["ranks' callers (submit, wait; minus the refill)"] = plain["ranks"]["caller"] * 1e3
    terms["kernel TCP + libzmq (ranks' zmq I/O threads)"] = plain["ranks"]["zmq"] * 1e3
    terms["kernel TCP + libzmq (aggregator's zmq I/O threads)"] = plain["aggregator"]["zmq"] * 1e3
    terms["other threads"] = (plain["ranks"]["other"] + plain["aggregator"]["other"]) * 1e3
    return terms


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--rank-main", "--aggregator-main"):
        cfg = json.loads(sys.argv[2])
        (rank_main if sys.argv[1] == "--rank-main" else aggregator_main)(cfg)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size-mib", type=float, default=100.0)
    ap.add_argument("--densities", default="0.01,0.1,1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "results" / "profile_allreduce.json"))
    args = ap.parse_args()
    rows = []
    for d in [float(x) for x in args.densities.split(",")]:
        plain = one_run(args, d, profile=False)
        prof = one_run(args, d, profile=True)
        terms = breakdown(plain, prof)
        total = sum(terms.values())
        floor = plain["scan_floor_s"] * 1e3
        print(f"\nW={args.workers}, {args.size_mib:g} MiB fp32, density {d:g}: CPU per all-reduce, all ranks and the "
              f"aggregator (median wall {plain['wall_s_per_op'] * 1e3:.1f} ms per all-reduce)")
        for name, ms in sorted(terms.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<58} {ms:8.2f} ms  {ms / total * 100:5.1f}%")
        print(f"  {'total':<58} {total:8.2f} ms   ({total / floor:.2f}x the scan floor of {floor:.1f} ms)")
        print(f"  minor page faults per all-reduce (all processes of the ranks): {plain['minor_faults_per_op']:.0f}")
        rows.append({"density": d, "terms_ms": terms, "total_ms": total, "scan_floor_ms": floor,
                     "plain": plain, "profiled": prof})
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"workers": args.workers, "size_mib": args.size_mib, "iters": args.iters,
                                        "warmup": args.warmup, "machine": machine_info(ROOT)}, "rows": rows},
                              indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
