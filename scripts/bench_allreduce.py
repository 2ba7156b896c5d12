#!/usr/bin/env python3
"""All-reduce micro-benchmark: omnireduce against the dense and sparse all-reduces users would run instead.

Workload (from the OmniReduce artifact): a float32 tensor (100 MiB by default, 26,214,400
elements), blocks of 256, each rank marks ``int(blocks * d)`` random blocks non-zero
(``--placement overlap``: the same blocks on every rank), over a sweep of densities ``d`` (default
1.0 0.8 0.4 0.2 0.1 0.08 0.04 0.02 0.01). For each density and method: ``--warmup`` iterations,
then ``--iters`` timed ones; an iteration's time is the slowest rank's (MAX over ranks), and the
table reports the median. Every method runs in the same processes in the same run, one after the
other for each density. One invocation is one world size W (``--workers``); run it once per W.

Methods (``--methods``):

* ``omnireduce``: the ranks' ``omnireduce.Worker`` against real ``omnireduce-agg`` processes, once
  per aggregator count in ``--aggregators`` (``1,4``: one Worker with A=1 and one with A=4 in every
  rank, both against the same aggregator processes: A=1 uses the first one). These are dedicated
  aggregators: on the emulated network, hosts of their own.
* ``colocated``: the job's own aggregators, started as the DDP hook starts them when it is given no
  addresses (``omnireduce.colocate.start_colocated``), each rank a node of its own: W aggregator
  processes, each a child of its rank on the rank's host (in its namespace, listening on its shaped
  interface), so aggregator and worker share the host's link.
* ``collective``: ``omnireduce.engines.collective.CollectiveEngine`` on a Gloo process group of its own: the
  ranks own the slots (slot s: rank ``s mod W``) and sum each other's blocks, with an all-gather of
  block bitmaps and two ``all_to_all_single`` (blocks to their owners, sums back); no aggregator
  process. Bytes per rank from the engine's ``stats()``.
* ``gloo``: ``torch.distributed.all_reduce`` (Gloo, ring).
* ``mpi``: ``MPI.COMM_WORLD.Allreduce(IN_PLACE)`` through mpi4py (mpich). With ``mpi`` in the
  methods every rank is started by ``mpiexec`` (hydra) and also runs the other methods.
* ``agsparse``: all-gather of each rank's non-zero blocks and their int64 indices through Gloo
  (padded to the largest count), then a local sum.

Where the ranks run
-------------------
``--loopback`` (the default): every process on this machine, on 127.0.0.1. MPI uses UCX over TCP
with MPICH's shared-memory path switched off (``MPIR_CVAR_NOLOCAL=1``, ``UCX_TLS=tcp,self``) so
that, like Gloo and omnireduce, it moves its bytes through the kernel's TCP stack;
``--mpi-transport auto`` leaves MPICH's defaults (shared memory between ranks).

``--net 1gbit|10gbit``: an emulated network (``ombench.netem``, needs root): W worker hosts
and max(A) aggregator hosts, each a network namespace on one bridge, each link shaped to the rate in
both directions. The aggregators listen on their 10.x addresses (``--insecure``: the namespaces are
private). Each rank runs this script in its hidden per-rank mode (``--rank-main CONFIG``) inside its
worker's namespace, with ``GLOO_SOCKET_IFNAME`` set to the host's interface and ``MASTER_ADDR`` to
worker 0's address; rank 0 writes the rows to a file that the driver reads. Without ``mpi`` the
ranks are started with ``Host.popen``. With ``mpi``, ``mpiexec`` runs in worker 0's namespace with
``-hosts <worker addresses> -ppn 1 -iface ornet0 -launcher ssh -launcher-exec <script>``, where the
script (written to a temporary directory by ``ombench.mpi``) turns hydra's ``ssh [-x] HOST
CMD`` into ``ip netns exec <HOST's namespace> sh -c CMD``; the hydra proxies connect back to mpiexec
over the emulated network, and each rank checks that it is in its own host's namespace. MPI runs
over UCX's TCP transport on the emulated interface only
(``UCX_TLS=tcp,self UCX_NET_DEVICES=ornet0``): otherwise UCX would reach the other ranks through shared memory / CMA and
bypass the shaped links (measured: 8 MiB at "1gbit" in 4 ms instead of the 67 ms floor). Everything
(processes and namespaces) is torn down on exit, Ctrl-C or failure by the
``ombench.network.Network`` context manager.

Wire floor (``--net`` runs; also recorded for loopback runs, without a time)
--------------------------------------------------------------------------
The least time the scheme needs on the emulated network: the bytes it must move over the busiest
link direction divided by the link rate R (bytes/s; each link is full duplex, an up and a down
direction, each at R). Computed from the actual inputs of each density (every rank's non-zero
block mask is all-gathered): ``s_b`` = bytes of block b (B * 4, the short last block less),
``M_w`` = blocks non-zero on rank w, ``U`` = union of all ``M_w``, N = tensor bytes.

* omnireduce with A aggregators: block b is in lane ``b mod T``, slot ``(b mod T) div L`` of
  ``omnireduce.blocks.Layout.for_tensor(numel, B, lanes, slots)`` (the Worker's lanes, default
  32768, and slots, default max(4, A)); slot s goes to aggregator ``s mod A`` (with A = 1, all
  blocks go to the one aggregator). Then, with ``G_a`` = the blocks of aggregator a's slots,

      worker w up:       sum(s_b, b in M_w)               (its non-zero blocks)
      worker w down:     sum(s_b, b in U)                 (every summed block comes back to every rank)
      aggregator a down: sum_w sum(s_b, b in M_w & G_a)   (its slots' blocks from every worker)
      aggregator a up:   W * sum(s_b, b in U & G_a)       (its slots' sums, to every worker)
      floor = max over all those link directions / R

* colocated: aggregator h runs on worker host h (A = W, slot s to aggregator ``s mod W``, ``G_h``
  its blocks); what worker h and aggregator h exchange never crosses host h's link:

      host h up:    sum(s_b, b in M_h - G_h) + (W-1) * sum(s_b, b in U & G_h)
      host h down:  sum(s_b, b in U - G_h) + sum_{v != h} sum(s_b, b in M_v & G_h)
      floor = max over all those link directions / R

* collective: the colocated figure with rank h as aggregator h (slot s to rank ``s mod W``, at
  least W slots), plus the bitmap all-gather, ``(W-1) * ceil(nb / 8)`` bytes each way per rank
  (``ombench.traffic.collective_link_bytes``):

      rank h up:    (W-1) ceil(nb/8) + sum(s_b, b in M_h - G_h) + (W-1) * sum(s_b, b in U & G_h)
      rank h down:  (W-1) ceil(nb/8) + sum(s_b, b in U - G_h) + sum_{v != h} sum(s_b, b in M_v & G_h)
      floor = max over all those link directions / R

* gloo (ring): every rank sends and receives ``2 (W-1)/W * N``; floor = that / R.
* mpi: the same ring figure as a lower bound (MPICH picks its own algorithm, e.g.
  reduce-scatter + all-gather, which moves the same bytes per rank for large messages).
* agsparse: every rank receives the other W-1 ranks' blocks padded to the largest count
  ``K = max_w |M_w|``, each B * 4 bytes of values plus an 8-byte int64 index:
  ``(W-1) * K * (4 B + 8)``; floor = that / R.

Floors count payload only: message headers, omnireduce's row bitmaps, and TCP/IP/Ethernet framing
(tbf counts whole frames: TCP goodput is at most ~95.6% of the rate) are left out, so even a perfect
implementation measures a little above 1.0x. The table prints time, floor and time/floor.

Usage
-----
    python scripts/bench_allreduce.py --loopback                    # the loopback table, W=4, A=1
    python scripts/bench_allreduce.py --loopback --workers 2 --densities 0.01,0.1
    python scripts/bench_allreduce.py --net 1gbit --workers 4 --aggregators 1,4           # needs root
    python scripts/bench_allreduce.py --net 1gbit --methods colocated,omnireduce,gloo --aggregators 4
    python scripts/bench_allreduce.py --net 10gbit --workers 2 --placement overlap
    python scripts/bench_allreduce.py --net 1gbit --size-mib 8 --densities 0.01,1 --iters 2 --warmup 1

Prints a table and writes JSON (all rows and meta: W, A, net, placement, machine) to ``--json``
(default ``results/bench_allreduce.json`` for loopback, ``results/bench_allreduce_<net>_W<W>_<placement>.json``
for network runs) and a log-log plot of time against density per method (dashed: wire floors) to
``--plot`` (default: the JSON path with ``.png``).

Run time on the 2-core development VM, full sweep (9 densities, 2 + 7 iterations), estimated from
short runs: loopback W=4 (default methods) ~2-3 min; ``--net 1gbit`` W=4, A=1,4, all methods
~12-15 min (a dense 100 MiB all-reduce alone takes 1.3-5.5 s per method); ``--net 10gbit`` W=4
~6 min; W=2 roughly half to two thirds of W=4. With 2 cores for W ranks + A aggregators, CPU
(not the link) limits many configurations, and the ranks' CPU columns show it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ombench import netem, plots, tables
from ombench.collectives import METHODS, RankSetup
from ombench.cpu import cpu_seconds
from ombench.machine import machine_info
from ombench.mpi import start_mpiexec
from ombench.network import LOOPBACK, Network, exit_on_signals
from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType
from omnireduce.launch.procs import stop_processes
from omnireduce.lifetime import exit_with_parent

ROOT = Path(__file__).resolve().parent.parent
DENSITIES = [1.0, 0.8, 0.4, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]


# --------------------------------------------------------------------------------------------
# workload


def make_input(rank: int, numel: int, density: float, block: int, placement: str, seed: int) -> np.ndarray:
    """A block-sparse float32 tensor: ``int(blocks * density)`` random non-zero blocks, as omnireduce-bench
    makes them (:func:`omnireduce.bench.inputs.sparse`), as a numpy array."""
    from omnireduce.bench.inputs import sparse

    return sparse(numel, density, rank=rank, block=block, placement=placement, seed=seed).numpy()


def scan_seconds(x: np.ndarray, block: int, repeats: int = 5) -> float:
    """The scan floor of one rank: the median CPU time (of this thread, so not the time other ranks
    hold the core) of one pass that finds the non-zero blocks of ``x``
    (``omnireduce.blocks.block_nonzero``: one read of every byte)."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        block_nonzero(x, DType.FLOAT32, block)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# one rank (hidden --rank-main mode)


def _in_namespace(name: str) -> bool:
    mine, theirs = os.stat("/proc/self/ns/net"), os.stat(f"/run/netns/{name}")
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def rank_main(config_path: str) -> None:
    """Run every method of the configuration as one rank; rank 0 writes the rows to ``cfg["rows_path"]``.

    The rank comes from ``$RANK`` (started by the driver) or ``$PMI_RANK`` (started by mpiexec):
    ``cfg["rank_env"]`` says which.
    """
    cfg: dict[str, Any] = json.loads(Path(config_path).read_text())
    W: int = cfg["workers"]
    rank = int(os.environ.get(cfg["rank_env"], "-1"))
    if not 0 <= rank < W:
        raise SystemExit(f"bench rank: no valid {cfg['rank_env']} in the environment (got {rank})")
    if cfg["rank_env"] == "RANK":  # started by the driver, stdin a pipe from it (mpiexec forwards its own)
        exit_with_parent()  # SIGTERM when the driver is gone, even SIGKILLed
    specs: list[dict[str, Any]] = cfg["specs"]
    if any(METHODS[s["method"]].needs_mpi for s in specs):
        from mpi4py import MPI  # MPI_Init before the Gloo process group

        comm = MPI.COMM_WORLD
        if (comm.Get_rank(), comm.Get_size()) != (rank, W):
            raise SystemExit(f"MPI rank {comm.Get_rank()} of {comm.Get_size()} != bench rank {rank} of {W}")
    host = cfg["hosts"][rank]
    if host.get("netns") and not _in_namespace(host["netns"]):
        raise SystemExit(f"rank {rank} is not in its network namespace {host['netns']}")
    if host.get("interface"):
        os.environ["GLOO_SOCKET_IFNAME"] = host["interface"]
    os.environ["MASTER_ADDR"] = cfg["master_addr"]
    os.environ["MASTER_PORT"] = str(cfg["master_port"])

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
    numel: int = cfg["numel"]
    block: int = cfg["block"]
    warmup, iters = cfg["warmup"], cfg["iters"]
    rate_bps: int | None = cfg["rate_bps"]
    if cfg.get("socket_buffer"):
        os.environ["OMNIREDUCE_SOCKET_BUFFER"] = str(cfg["socket_buffer"])
    setup = RankSetup(rank=rank, world=W, block=block, dist=dist, aggregators=cfg["aggregator_addresses"],
                      aggregator_pids=cfg["aggregator_pids"], job=cfg["job"], timeout=cfg["op_timeout"],
                      lanes=cfg["lanes"], slots=cfg["slots"])
    ops = [METHODS[s["method"]].setup(setup, s.get("aggregators", 1)) for s in specs]
    rows: list[dict[str, Any]] = []
    for density in cfg["densities"]:
        base = make_input(rank, numel, density, block, cfg["placement"], cfg["seed"])
        mask = torch.from_numpy(block_nonzero(base, DType.FLOAT32, block).astype(np.uint8))
        gathered = [torch.empty_like(mask) for _ in range(W)]
        dist.all_gather(gathered, mask)
        masks = np.stack([g.numpy().astype(bool) for g in gathered])
        scan = torch.tensor([scan_seconds(base, block)], dtype=torch.float64)
        dist.all_reduce(scan)  # the scan floor: one pass over every rank's tensor, summed over ranks
        ref = None
        for s, op in zip(specs, ops, strict=True):
            method, label, w, pids = s["method"], s["label"], op.worker, op.aggregator_pids
            stats_before = op.counters() if op.counters is not None else None
            times: list[float] = []
            own_cpu = agg0 = 0.0
            for it in range(warmup + iters):
                x = torch.from_numpy(base.copy())
                dist.barrier()
                if it == warmup:
                    agg0 = sum(cpu_seconds(p) for p in pids)
                c0 = cpu_seconds()
                t0 = time.perf_counter()
                op.run(x)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                if it >= warmup:
                    own_cpu += cpu_seconds() - c0
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if it >= warmup:
                    times.append(dt.item())
            spent = torch.tensor([own_cpu], dtype=torch.float64)
            dist.all_reduce(spent)  # CPU of all ranks inside the timed operations
            agg_cpu = sum(cpu_seconds(p) for p in pids) - agg0 if pids else 0.0
            if ref is None:
                ref = x.numpy().copy()
            elif not np.allclose(x.numpy(), ref, rtol=1e-5, atol=1e-5):
                raise SystemExit(f"{label} disagrees with {specs[0]['label']} at density {density}")
            row: dict[str, Any] = {
                "method": method, "label": label, "density": density, "median_s": statistics.median(times),
                "times_s": times, "worker_cpu_s_per_op": spent.item() / iters,
                "aggregator_cpu_s_per_op": agg_cpu / iters, "scan_floor_cpu_s": scan.item(),
                "blocks_total": int(masks.shape[1]), "blocks_nonzero": [int(n) for n in masks.sum(axis=1)],
                "blocks_union": int(masks.any(axis=0).sum()),
            }
            if w is not None:
                row["aggregators"] = s["aggregators"]
            if op.counters is not None:
                after = op.counters()
                assert stats_before is not None
                n_ops = warmup + iters
                for key in ("bytes_sent", "bytes_received", "messages_sent"):
                    if key in after:
                        row[f"{key}_per_op"] = (after[key] - stats_before[key]) / n_ops
            if rank == 0:
                A = s.get("aggregators", 1)
                row["floor_bytes"], row["floor_link"] = METHODS[method].floor(masks, numel, block, A, op.lanes,
                                                                              op.slots)
                row["floor_s"] = row["floor_bytes"] * 8 / rate_bps if rate_bps else None
                row["time_over_floor"] = row["median_s"] / row["floor_s"] if row["floor_s"] else None
                floor = (f"  floor {row['floor_s'] * 1e3:9.2f} ms ({row['time_over_floor']:5.2f}x)"
                         if row["floor_s"] else "")
                print(f"  d={density:<5} {label:<16} median {row['median_s'] * 1e3:9.2f} ms{floor}   CPU per op: "
                      f"ranks {row['worker_cpu_s_per_op'] * 1e3:7.1f} ms, aggregators "
                      f"{row['aggregator_cpu_s_per_op'] * 1e3:6.1f} ms", flush=True)
            rows.append(row)
    for op in ops:
        op.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(cfg["rows_path"]).write_text(json.dumps(rows))


# --------------------------------------------------------------------------------------------
# driver


def launch_ranks(net: Network, cfg_path: Path, world: int, use_mpi: bool, mpi_transport: str,
                 scratch: Path) -> list[subprocess.Popen[Any]]:
    """Start the W ranks (``--rank-main``) in ``net``: one mpiexec, or one process per rank."""
    rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-main", str(cfg_path)]
    if use_mpi:
        try:
            return [start_mpiexec(net, rank_cmd, world, mpi_transport, scratch)]
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
    # rank_main takes W, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME from the configuration: only RANK differs;
    # its standard input is a pipe from here, which it watches (omnireduce.lifetime.exit_with_parent)
    return [net.popen(r, rank_cmd, env={**os.environ, "RANK": str(r)}, stdin=subprocess.PIPE) for r in range(world)]


def wait_ranks(procs: list[subprocess.Popen[Any]]) -> None:
    """Wait for every process; if one fails, stop the others and exit with an error."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                raise SystemExit(f"a rank failed (exit status {failed[0]}); stopping the others")
            if all(c == 0 for c in codes):
                return
            time.sleep(0.2)
    finally:
        stop_processes(procs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--loopback", action="store_true",
                       help="run every process on this machine, 127.0.0.1 (the default)")
    where.add_argument("--net", metavar="RATE",
                       help="run in an emulated network of namespaces with links of RATE (1gbit, 10gbit); root")
    ap.add_argument("--workers", type=int, default=4, help="world size W (one per invocation; default 4)")
    ap.add_argument("--aggregators", type=lambda s: sorted({int(v) for v in s.split(",")}), default=None,
                    help="omnireduce aggregator counts, e.g. 1,4 (default: 1 on loopback, 1,W with --net)")
    ap.add_argument("--size-mib", type=float, default=100.0)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--lanes", type=int, default=None, help="omnireduce lanes per slot (Worker default 32768)")
    ap.add_argument("--slots", type=int, default=None, help="omnireduce slots (Worker default max(4, A))")
    ap.add_argument("--socket-buffer", type=int, default=0,
                    help="omnireduce TCP buffer per connection, bytes (0: kernel autotuning); 65536 avoids TCP "
                         "incast losses in the emulated switch's 4 ms queues when A > 1")
    ap.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=DENSITIES)
    ap.add_argument("--placement", choices=["random", "overlap"], default="random")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of omnireduce,colocated,collective,gloo,mpi,agsparse (default: "
                         "omnireduce,colocated,gloo,agsparse on loopback, and mpi with --net)")
    ap.add_argument("--mpi-transport", choices=["tcp", "auto"], default="tcp",
                    help="loopback MPI: tcp = UCX over TCP, no shared memory (default); auto = MPICH's "
                         "defaults. Network runs always use TCP on the emulated interface")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--op-timeout", type=float, default=300.0, help="seconds per collective before giving up")
    ap.add_argument("--master-addr", default="127.0.0.1", help="loopback: address of the Gloo rendezvous")
    ap.add_argument("--json", default=None, help="output JSON (default: see above)")
    ap.add_argument("--plot", default=None, help="output PNG (default: the JSON path with .png)")
    ap.add_argument("--rank-main", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:
        return args
    methods = args.methods or ("omnireduce,colocated,gloo,mpi,agsparse" if args.net
                               else "omnireduce,colocated,gloo,agsparse")
    args.methods = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown or not args.methods:
        ap.error(f"--methods: unknown {sorted(unknown)}; choose from {','.join(METHODS)}")
    if args.aggregators is None:
        args.aggregators = sorted({1, args.workers}) if args.net else [1]
    if min(args.aggregators) < 1 or args.workers < 1:
        ap.error("--workers and --aggregators must be >= 1")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if args.json is None:
        args.json = (f"results/bench_allreduce_{args.net}_W{args.workers}_{args.placement}.json" if args.net
                     else "results/bench_allreduce.json")
    if args.plot is None:
        args.plot = str(Path(args.json).with_suffix(".png"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank_main:
        rank_main(args.rank_main)
        return
    exit_on_signals("bench_allreduce")  # unwind (stop ranks, aggregators, namespaces) instead of dying
    W = args.workers
    numel = int(args.size_mib * (1 << 20)) // 4
    specs: list[dict[str, Any]] = []
    for m in args.methods:
        if m == "omnireduce":
            for A in args.aggregators:
                label = "omnireduce" if len(args.aggregators) == 1 else f"omnireduce A={A}"
                specs.append({"method": m, "label": label, "aggregators": A})
        elif m == "colocated":  # one aggregator per rank host
            specs.append({"method": m, "label": m, "aggregators": W})
        else:
            specs.append({"method": m, "label": m})
    labels = [s["label"] for s in specs]
    use_omni = "omnireduce" in args.methods
    use_mpi = any(METHODS[m].needs_mpi for m in args.methods)
    n_agg = max(args.aggregators) if use_omni else 0

    rate_bps = None
    mpi_note = None
    if use_mpi:
        mpi_note = ("mpiexec (hydra) in worker 0's namespace, each rank launched into its own worker's namespace "
                    "(ip netns exec via -launcher-exec); UCX over TCP on the emulated interface" if args.net else
                    "mpiexec on loopback; " + ("UCX over TCP, MPICH shared memory off" if args.mpi_transport == "tcp"
                                               else "MPICH defaults (shared memory between ranks)"))
    print(f"W={W} A={','.join(map(str, args.aggregators)) if use_omni else '-'} {args.size_mib:g} MiB fp32, "
          f"block {args.block}, placement {args.placement}, {args.iters} timed iterations after {args.warmup} "
          f"warm-up, {'network ' + args.net if args.net else 'loopback'}; methods {', '.join(labels)}", flush=True)
    if mpi_note:
        print(f"mpi: {mpi_note}", flush=True)
    json_path, plot_path = Path(args.json), Path(args.plot)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_allreduce-")))
        if args.net:
            ok, why = netem.available()
            if not ok:
                raise SystemExit(f"--net: cannot emulate a network here: {why}")
            rate_bps = netem.parse_rate(args.net)
            if rate_bps is None:
                raise SystemExit(f"--net needs a link rate such as 1gbit or 10gbit, got {args.net!r}")
        net = stack.enter_context(Network(args.net or LOOPBACK, W, n_agg))
        cluster = net.cluster
        if cluster is not None:
            print(f"netem cluster {cluster.id}: {cluster.subnet}, tbf {rate_bps / 1e9:g} Gbit/s both ways per "
                  f"link, burst {cluster.burst} B, limit {cluster.limit} B", flush=True)
        try:  # their standard error is ours: whatever one says on failure is already on the terminal
            addresses = net.start_aggregators(socket_buffer=args.socket_buffer)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        rows_path = scratch / "rows.json"
        cfg: dict[str, Any] = {
            "workers": W, "specs": specs, "numel": numel, "block": args.block, "densities": args.densities,
            "placement": args.placement, "seed": args.seed, "warmup": args.warmup, "iters": args.iters,
            "lanes": args.lanes, "slots": args.slots, "op_timeout": args.op_timeout, "rate_bps": rate_bps,
            "socket_buffer": args.socket_buffer,
            "aggregator_addresses": addresses, "aggregator_pids": net.aggregator_pids,
            "master_addr": net.master_addr if cluster else args.master_addr, "master_port": net.master_port(),
            "job": f"bench-{os.getpid()}", "rows_path": str(rows_path), "rank_env": "PMI_RANK" if use_mpi else "RANK",
            "hosts": ([{"address": h.address, "interface": h.interface, "netns": h.name} for h in cluster.workers]
                      if cluster else [{} for _ in range(W)]),
        }
        cfg_path = scratch / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        wait_ranks(launch_ranks(net, cfg_path, W, use_mpi, args.mpi_transport, scratch))
        rows = json.loads(rows_path.read_text())
    elapsed = time.monotonic() - t_start

    machine = machine_info(ROOT)
    machine["loadavg_start"], machine["loadavg_end"] = load_start, os.getloadavg()
    netem_info = ({"cluster": cluster.id, "subnet": cluster.subnet, "tbf_burst_bytes": cluster.burst,
                   "tbf_limit_bytes": cluster.limit} if cluster is not None else None)
    meta = {"argv": sys.argv, "workers": W, "aggregators": args.aggregators if use_omni else [],
            "net": args.net or "loopback", "rate_bps": rate_bps, "placement": args.placement,
            "size_mib": args.size_mib, "numel": numel, "block": args.block, "densities": args.densities,
            "methods": labels, "warmup": args.warmup, "iters": args.iters, "seed": args.seed,
            "mpi": mpi_note, "netem": netem_info, "machine": machine, "elapsed_s": round(elapsed, 1),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))  # first: the rows are safe now
    if args.net:
        print(tables.net_table(rows, labels, args.densities, args.net))
    else:
        print(tables.loopback_table(rows, labels, args.densities))
    where = f"{args.net} emulated links" if args.net else "loopback"
    if not plots.density_plot(rows, labels, f"all-reduce of {args.size_mib:g} MiB fp32, W={W}, {where}, placement "
                              f"{args.placement}" + (" (dashed: wire floors)" if args.net else ""), plot_path):
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(f"\nwrote {json_path} and {plot_path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
