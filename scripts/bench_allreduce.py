#!/usr/bin/env python3
"""All-reduce micro-benchmark: omnireduce against the dense and sparse all-reduces users would run instead.

Workload (DESIGN.md section 6, from the OmniReduce artifact): a float32 tensor (100 MiB by default,
26,214,400 elements), blocks of 256, each rank marks ``int(blocks * d)`` random blocks non-zero
(``--placement overlap``: the same blocks on every rank), over a sweep of densities ``d`` (default
1.0 0.8 0.4 0.2 0.1 0.08 0.04 0.02 0.01). For each density and method: ``--warmup`` iterations,
then ``--iters`` timed ones; an iteration's time is the slowest rank's (MAX over ranks), and the
table reports the median. Every method runs in the same processes in the same run, one after the
other for each density. One invocation is one world size W (``--workers``); run it once per W.

Methods (``--methods``):

* ``omnireduce``: the ranks' ``omnireduce.Worker`` against real ``omnireduce-agg`` processes, once
  per aggregator count in ``--aggregators`` (``1,4``: one Worker with A=1 and one with A=4 in every
  rank, both against the same aggregator processes: A=1 uses the first one).
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

``--net 1gbit|10gbit``: an emulated network (``scripts/netem.py``, needs root): W worker hosts and
max(A) aggregator hosts, each a network namespace on one bridge, each link shaped to the rate in both
directions. The aggregators listen on their 10.x addresses (``--insecure``: the namespaces are
private). Each rank runs this script in its hidden per-rank mode (``--rank-main CONFIG``) inside its
worker's namespace, with ``GLOO_SOCKET_IFNAME`` set to the host's interface and ``MASTER_ADDR`` to
worker 0's address; rank 0 writes the rows to a file that the driver reads. Without ``mpi`` the
ranks are started with ``Host.popen``. With ``mpi``, ``mpiexec`` runs in worker 0's namespace with
``-hosts <worker addresses> -ppn 1 -iface ornet0 -launcher ssh -launcher-exec <script>``, where the
script (written to a temporary directory by this one) turns hydra's ``ssh [-x] HOST CMD`` into
``ip netns exec <HOST's namespace> sh -c CMD``; the hydra proxies connect back to mpiexec over the
emulated network, and each rank checks that it is in its own host's namespace. MPI runs over UCX's
TCP transport on the emulated interface only (``UCX_TLS=tcp,self UCX_NET_DEVICES=ornet0``):
otherwise UCX would reach the other ranks through shared memory / CMA and bypass the shaped links
(measured: 8 MiB at "1gbit" in 4 ms instead of the 67 ms floor). Everything (processes and
namespaces) is torn down on exit, Ctrl-C or failure by the ``netem.Cluster`` context manager.

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
    python scripts/bench_allreduce.py --loopback                    # the issue-2 table, W=4, A=1
    python scripts/bench_allreduce.py --loopback --workers 2 --densities 0.01,0.1
    python scripts/bench_allreduce.py --net 1gbit --workers 4 --aggregators 1,4           # needs root
    python scripts/bench_allreduce.py --net 10gbit --workers 2 --placement overlap
    python scripts/bench_allreduce.py --net 1gbit --size-mib 8 --densities 0.01,1 --iters 2 --warmup 1

Prints a table and writes JSON (all rows and meta: W, A, net, placement, machine) to ``--json``
(default ``results/bench_allreduce.json`` for loopback, ``results/bench_allreduce_<net>_W<W>_<placement>.json``
for network runs) and a log-log plot of time against density per method (dashed: wire floors) to
``--plot`` (default: the JSON path with ``.png``).

Run time on the 2-core development VM, full sweep (9 densities, 2 + 7 iterations), estimated from
short runs: loopback W=4 (default methods) ~2-3 min; ``--net 1gbit`` W=4, A=1,4, all five methods
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchutil  # scripts/: on sys.path as this script's directory
import numpy as np
import report

from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType
from omnireduce.procs import free_port, start_aggregator, stop_processes

DENSITIES = [1.0, 0.8, 0.4, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]
METHODS = ("omnireduce", "gloo", "mpi", "agsparse")
MASTER_PORT_NET = 29500  # fresh namespaces: every port is free
INDEX_BYTES = 8  # agsparse sends int64 block indices

# hydra's ssh launcher runs `<launcher-exec> [-x] HOST CMD...`; run CMD inside HOST's namespace instead.
NETNS_LAUNCHER = r"""#!/bin/sh
# Written by scripts/bench_allreduce.py for mpiexec -launcher ssh -launcher-exec <this>.
# Called as: <this> [ssh options] HOST CMD...; runs CMD in the network namespace that
# $BENCH_NETNS_MAP ("addr=netns,addr=netns,...") gives for HOST.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
for pair in $(echo "$BENCH_NETNS_MAP" | tr ',' ' '); do
    if [ "${pair%%=*}" = "$host" ]; then
        exec ip netns exec "${pair#*=}" sh -c "$*"
    fi
done
echo "bench_allreduce netns launcher: no namespace for host '$host'" >&2
exit 1
"""


# --------------------------------------------------------------------------------------------
# workload and methods


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


def agsparse(x: Any, block: int, dist: Any, torch: Any) -> Any:
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


# --------------------------------------------------------------------------------------------
# wire floors (see the module docstring)


def block_bytes(numel: int, block: int, itemsize: int = 4) -> np.ndarray:
    """Bytes of each block's real elements (the short last block counts only its real elements)."""
    nb = -(-numel // block)
    sizes = np.full(nb, block * itemsize, dtype=np.int64)
    if numel % block:
        sizes[-1] = (numel % block) * itemsize
    return sizes


def omnireduce_link_bytes(masks: np.ndarray, numel: int, block: int, aggregators: int, lanes: int,
                          slots: int) -> dict[str, int]:
    """Payload bytes over every link direction of an omnireduce all-reduce (``masks``: W x blocks)."""
    from omnireduce.blocks import Layout

    W = masks.shape[0]
    sizes = block_bytes(numel, block)
    layout = Layout.for_tensor(numel, block, lanes, slots)
    lane = np.arange(sizes.size) % (layout.lanes * layout.slots)
    owner = (lane // layout.lanes) % aggregators  # slot s -> aggregator s mod A
    union = masks.any(axis=0)
    links: dict[str, int] = {}
    for w in range(W):
        links[f"w{w} up"] = int(sizes[masks[w]].sum())
        links[f"w{w} down"] = int(sizes[union].sum())
    for a in range(aggregators):
        mine = owner == a
        links[f"a{a} down"] = int(sum(sizes[masks[w] & mine].sum() for w in range(W)))
        links[f"a{a} up"] = int(W * sizes[union & mine].sum())
    return links


def wire_floor(method: str, masks: np.ndarray, numel: int, block: int, aggregators: int, lanes: int,
               slots: int) -> tuple[int, str]:
    """``(bytes, link)``: the bytes ``method`` must move over its busiest link direction, and which one.

    ``aggregators``, ``lanes`` and ``slots`` (the Worker's) matter to omnireduce only.
    """
    W = masks.shape[0]
    if method == "omnireduce":
        links = omnireduce_link_bytes(masks, numel, block, aggregators, lanes, slots)
        busiest = max(links, key=lambda k: links[k])
        return links[busiest], busiest
    if method in ("gloo", "mpi"):
        return round(2 * (W - 1) / W * numel * 4), "every worker, up and down (ring)"
    if method == "agsparse":
        most = int(masks.sum(axis=1).max())
        return (W - 1) * most * (block * 4 + INDEX_BYTES), "every worker down (padded all-gather)"
    raise ValueError(f"unknown method {method!r}")


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
    specs: list[dict[str, Any]] = cfg["specs"]
    comm = None
    mpi = None
    if any(s["method"] == "mpi" for s in specs):
        from mpi4py import MPI

        mpi, comm = MPI, MPI.COMM_WORLD
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

    import omnireduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
    numel: int = cfg["numel"]
    block: int = cfg["block"]
    warmup, iters = cfg["warmup"], cfg["iters"]
    rate_bps: int | None = cfg["rate_bps"]
    agg_addresses: list[str] = cfg["aggregator_addresses"]
    agg_pids: list[int] = cfg["aggregator_pids"]
    workers: dict[int, omnireduce.Worker] = {}
    if cfg.get("socket_buffer"):
        os.environ["OMNIREDUCE_SOCKET_BUFFER"] = str(cfg["socket_buffer"])
    for s in specs:
        if s["method"] == "omnireduce":
            A = s["aggregators"]
            workers[A] = omnireduce.Worker(agg_addresses[:A], rank=rank, world_size=W, job=f"{cfg['job']}-A{A}",
                                           block_size=block, timeout=cfg["op_timeout"], lanes=cfg["lanes"],
                                           slots=cfg["slots"])
    rows: list[dict[str, Any]] = []
    for density in cfg["densities"]:
        base = make_input(rank, numel, density, block, cfg["placement"], cfg["seed"])
        mask = torch.from_numpy(block_nonzero(base, DType.FLOAT32, block).astype(np.uint8))
        gathered = [torch.empty_like(mask) for _ in range(W)]
        dist.all_gather(gathered, mask)
        masks = np.stack([g.numpy().astype(bool) for g in gathered])
        ref = None
        for s in specs:
            method, label = s["method"], s["label"]
            w = workers.get(s.get("aggregators", 0)) if method == "omnireduce" else None
            pids = agg_pids[: s["aggregators"]] if w is not None else []
            stats_before = w.stats() if w is not None else None
            times: list[float] = []
            own_cpu = agg0 = 0.0
            for it in range(warmup + iters):
                x = torch.from_numpy(base.copy())
                dist.barrier()
                if it == warmup:
                    agg0 = sum(cpu_seconds(p) for p in pids)
                c0 = cpu_seconds()
                t0 = time.perf_counter()
                if w is not None:
                    w.allreduce(x)
                elif method == "gloo":
                    dist.all_reduce(x)
                elif method == "mpi":
                    assert comm is not None and mpi is not None
                    comm.Allreduce(mpi.IN_PLACE, x.numpy())
                elif method == "agsparse":
                    agsparse(x, block, dist, torch)
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
                "aggregator_cpu_s_per_op": agg_cpu / iters,
                "blocks_total": int(masks.shape[1]), "blocks_nonzero": [int(n) for n in masks.sum(axis=1)],
                "blocks_union": int(masks.any(axis=0).sum()),
            }
            if w is not None:
                row["aggregators"] = s["aggregators"]
                after = w.stats()
                assert stats_before is not None
                n_ops = warmup + iters
                row["bytes_sent_per_op"] = (after["bytes_sent"] - stats_before["bytes_sent"]) / n_ops
                row["bytes_received_per_op"] = (after["bytes_received"] - stats_before["bytes_received"]) / n_ops
            if rank == 0:
                A = s.get("aggregators", 1)
                lanes, slots = (w.config.lanes, w.config.slots) if w is not None else (0, 0)
                row["floor_bytes"], row["floor_link"] = wire_floor(method, masks, numel, block, A, lanes, slots)
                row["floor_s"] = row["floor_bytes"] * 8 / rate_bps if rate_bps else None
                row["time_over_floor"] = row["median_s"] / row["floor_s"] if row["floor_s"] else None
                floor = (f"  floor {row['floor_s'] * 1e3:9.2f} ms ({row['time_over_floor']:5.2f}x)"
                         if row["floor_s"] else "")
                print(f"  d={density:<5} {label:<16} median {row['median_s'] * 1e3:9.2f} ms{floor}   CPU per op: "
                      f"ranks {row['worker_cpu_s_per_op'] * 1e3:7.1f} ms, aggregators "
                      f"{row['aggregator_cpu_s_per_op'] * 1e3:6.1f} ms", flush=True)
            rows.append(row)
    for w in workers.values():
        w.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(cfg["rows_path"]).write_text(json.dumps(rows))


# --------------------------------------------------------------------------------------------
# driver


def start_aggregators(procs: list[subprocess.Popen[str]], n: int, hosts: list[Any] | None,
                      socket_buffer: int = 0) -> list[str]:
    """Start ``n`` aggregators (on 127.0.0.1, or inside ``hosts[i]``'s namespace on its address); returns
    their addresses.

    Each process is appended to ``procs`` as soon as it is started, so that the caller, which stops
    ``procs`` on the way out, also stops the ones started before a failure or Ctrl-C.
    """
    addresses: list[str] = []
    for i in range(n):
        cmd = [sys.executable, "-m", "omnireduce.aggregator.cli", "--log-level", "WARNING",
               "--socket-buffer", str(socket_buffer)]
        if hosts is None:
            cmd += ["--listen", "tcp://127.0.0.1:0"]
            popen = subprocess.Popen
        else:
            cmd += ["--listen", f"tcp://{hosts[i].address}:0", "--insecure"]
            popen = hosts[i].popen
        try:  # its standard error is ours: whatever it says on failure is already on the terminal
            p, address = start_aggregator(cmd, popen, name=f"aggregator {i}")
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        procs.append(p)
        addresses.append(address)
    return addresses


def mpi_environment(transport: str, interface: str | None) -> dict[str, str]:
    """Environment for MPICH/UCX: TCP only (on ``interface`` when given), or MPICH's defaults (``auto``)."""
    if transport == "auto":
        return {}
    env = {"MPIR_CVAR_CH4_NETMOD": "ucx", "MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if interface:
        env["UCX_NET_DEVICES"] = interface
    return env


def find_mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mpiexec not found: pip install mpi4py mpich (or leave 'mpi' out of --methods)")
    return found


def launch_ranks(cfg: dict[str, Any], cfg_path: Path, cluster: Any, use_mpi: bool, mpi_transport: str,
                 scratch: Path) -> list[subprocess.Popen[Any]]:
    """Start the W ranks (``--rank-main``): one mpiexec, or one process per rank."""
    W = cfg["workers"]
    rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-main", str(cfg_path)]
    if use_mpi:
        mpiexec = find_mpiexec()
        if cluster is None:
            env = {**os.environ, **mpi_environment(mpi_transport, None)}
            return [subprocess.Popen([mpiexec, "-n", str(W), *rank_cmd], env=env)]
        launcher = scratch / "netns_launcher.sh"
        launcher.write_text(NETNS_LAUNCHER)
        launcher.chmod(0o700)
        w0 = cluster.workers[0]
        env = {**os.environ, **mpi_environment("tcp", w0.interface),
               "BENCH_NETNS_MAP": ",".join(f"{h.address}={h.name}" for h in cluster.workers)}
        argv = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher), "-iface", w0.interface,
                "-hosts", ",".join(h.address for h in cluster.workers), "-ppn", "1", "-n", str(W), *rank_cmd]
        return [w0.popen(argv, env=env)]
    # rank_main takes W, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME from the configuration: only RANK differs
    procs: list[subprocess.Popen[Any]] = []
    try:
        for r in range(W):
            env = {**os.environ, "RANK": str(r)}
            procs.append(subprocess.Popen(rank_cmd, env=env) if cluster is None
                         else cluster.workers[r].popen(rank_cmd, env=env))
    except BaseException:
        stop_processes(procs)
        raise
    return procs


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


def print_loopback_table(rows: list[dict[str, Any]], labels: list[str], densities: list[float]) -> None:
    """The issue-2 table: median ms and CPU per all-reduce per method, and gloo over omnireduce."""
    by = {(r["label"], r["density"]): r for r in rows}
    omni = report.ratio_label(rows)  # the same column as report.py's: the omnireduce with the most aggregators
    print("\nmedian time per all-reduce (slowest rank), ms; CPU = all ranks + aggregators per all-reduce, ms")
    width = {m: max(14, len(m) + 3) for m in labels}
    short = {m: m[:5] if " A=" not in m else "om" + m.rsplit(" ", 1)[1] for m in labels}  # "omnir", "omA=4"
    print(f"{'density':>8} " + " ".join(f"{m + ' ms':>{width[m]}}" for m in labels)
          + " ".join(f"{short[m] + ' CPU':>11}" for m in labels)
          + (f"   gloo/{omni}" if omni else ""))
    for d in densities:
        line = f"{d:>8} " + " ".join(f"{by[(m, d)]['median_s'] * 1e3:>{width[m]}.2f}" for m in labels)
        line += " ".join(f"{report.cpu_ms(by[(m, d)]):>11.0f}" for m in labels)
        if omni:
            x = report.gloo_ratio(by, omni, d)
            line += f"   {'-' if x is None else f'{x:.2f}x':>{len(omni) + 7}}"
        print(line)


def print_net_table(rows: list[dict[str, Any]], labels: list[str], densities: list[float], net: str) -> None:
    """Time, wire floor and time/floor per method and density ('-' where the floor is 0); then CPU."""
    by = {(r["label"], r["density"]): r for r in rows}
    width = 26
    print(f"\nmedian time per all-reduce (slowest rank) | floor = busiest link direction's payload bytes / {net} "
          "| x = time / floor")
    print(f"{'':>8} " + " ".join(f"{lb:^{width}}" for lb in labels))
    print(f"{'density':>8} " + " ".join(f"{'time ms':>9} {'floor ms':>9} {'x':>6}" for _ in labels))
    for d in densities:
        cells = []
        for lb in labels:
            r = by[(lb, d)]
            floor, over = r.get("floor_s"), r.get("time_over_floor")
            floor_ms = f"{floor * 1e3:>9.1f}" if floor else f"{'-':>9}"
            x = f"{over:>5.2f}x" if floor and over is not None else f"{'-':>6}"
            cells.append(f"{r['median_s'] * 1e3:>9.1f} {floor_ms} {x}")
        print(f"{d:>8} " + " ".join(cells))
    print("floors: omnireduce from the actual non-zero blocks and the slot -> aggregator layout; gloo: ring, "
          "2 (W-1)/W N per rank;\n        mpi: the ring figure as a lower bound (MPICH picks its own algorithm); "
          "agsparse: (W-1) K (4 B + 8) per rank;\n        payload only (no headers, bitmaps or TCP/IP/Ethernet "
          "framing: tbf counts frames, so ~1.05x is the practical best); '-': nothing to move")
    print("\nCPU per all-reduce (all ranks + aggregators), ms")
    print(f"{'density':>8} " + " ".join(f"{lb:>16}" for lb in labels))
    for d in densities:
        print(f"{d:>8} " + " ".join(f"{report.cpu_ms(by[(lb, d)]):>16.0f}" for lb in labels))


def plot(rows: list[dict[str, Any]], labels: list[str], title: str, path: Path) -> None:
    """Log-log plot of median time against density per method (dashed: wire floors, when known)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for lb in labels:
        mine = sorted((r for r in rows if r["label"] == lb and r["density"] > 0), key=lambda r: r["density"])
        xs = [r["density"] for r in mine]
        (line,) = ax.plot(xs, [r["median_s"] * 1e3 for r in mine], marker="o", label=lb)
        if all(r.get("floor_s") for r in mine):
            ax.plot(xs, [r["floor_s"] * 1e3 for r in mine], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of non-zero blocks per rank)")
    ax.set_ylabel("median time per all-reduce, ms (slowest rank)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
                    help="comma-separated subset of omnireduce,gloo,mpi,agsparse (default: omnireduce,gloo,"
                         "agsparse on loopback, all four with --net)")
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
    methods = args.methods or ("omnireduce,gloo,mpi,agsparse" if args.net else "omnireduce,gloo,agsparse")
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
    benchutil.exit_on_signals("bench_allreduce")  # unwind (stop ranks, aggregators, namespaces) instead of dying
    W = args.workers
    numel = int(args.size_mib * (1 << 20)) // 4
    specs: list[dict[str, Any]] = []
    for m in args.methods:
        if m == "omnireduce":
            for A in args.aggregators:
                label = "omnireduce" if len(args.aggregators) == 1 else f"omnireduce A={A}"
                specs.append({"method": m, "label": label, "aggregators": A})
        else:
            specs.append({"method": m, "label": m})
    labels = [s["label"] for s in specs]
    use_omni = "omnireduce" in args.methods
    use_mpi = "mpi" in args.methods
    n_agg = max(args.aggregators) if use_omni else 0

    cluster = None
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
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import netem

            ok, why = netem.available()
            if not ok:
                raise SystemExit(f"--net: cannot emulate a network here: {why}")
            rate_bps = netem.parse_rate(args.net)
            if rate_bps is None:
                raise SystemExit(f"--net needs a link rate such as 1gbit or 10gbit, got {args.net!r}")
            cluster = stack.enter_context(netem.Cluster(workers=W, aggregators=n_agg, rate=args.net))
            print(f"netem cluster {cluster.id}: {cluster.subnet}, tbf {rate_bps / 1e9:g} Gbit/s both ways per "
                  f"link, burst {cluster.burst} B, limit {cluster.limit} B", flush=True)
        procs: list[subprocess.Popen[str]] = []
        stack.callback(stop_processes, procs)  # also those started before a failure or Ctrl-C
        addresses = start_aggregators(procs, n_agg, cluster.aggregators if cluster else None, args.socket_buffer)
        rows_path = scratch / "rows.json"
        cfg: dict[str, Any] = {
            "workers": W, "specs": specs, "numel": numel, "block": args.block, "densities": args.densities,
            "placement": args.placement, "seed": args.seed, "warmup": args.warmup, "iters": args.iters,
            "lanes": args.lanes, "slots": args.slots, "op_timeout": args.op_timeout, "rate_bps": rate_bps,
            "socket_buffer": args.socket_buffer,
            "aggregator_addresses": addresses, "aggregator_pids": [p.pid for p in procs],
            "master_addr": cluster.workers[0].address if cluster else args.master_addr,
            "master_port": MASTER_PORT_NET if cluster else free_port(),
            "job": f"bench-{os.getpid()}", "rows_path": str(rows_path), "rank_env": "PMI_RANK" if use_mpi else "RANK",
            "hosts": ([{"address": h.address, "interface": h.interface, "netns": h.name} for h in cluster.workers]
                      if cluster else [{} for _ in range(W)]),
        }
        cfg_path = scratch / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        wait_ranks(launch_ranks(cfg, cfg_path, cluster, use_mpi, args.mpi_transport, scratch))
        rows = json.loads(rows_path.read_text())
    elapsed = time.monotonic() - t_start

    machine = benchutil.machine_info()
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
        print_net_table(rows, labels, args.densities, args.net)
    else:
        print_loopback_table(rows, labels, args.densities)
    where = f"{args.net} emulated links" if args.net else "loopback"
    plot(rows, labels, f"all-reduce of {args.size_mib:g} MiB fp32, W={W}, {where}, placement {args.placement}"
         + (" (dashed: wire floors)" if args.net else ""), plot_path)
    print(f"\nwrote {json_path} and {plot_path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
