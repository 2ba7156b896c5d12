#!/usr/bin/env python3
"""The hierarchy on nodes of several ranks: Gloo ring, hierarchical dense, flat and hierarchical omnireduce.

N nodes of L ranks each (``--nodes``, ``--ranks-per-node``; default 2 x 2). On an emulated network
(``--nets 1gbit,10gbit``, root) every node is one network namespace holding its L ranks
(``ombench.network.Network(ranks_per_node=L)``): the ranks of a node talk over the namespace's
loopback (unlimited), the nodes over their links, shaped to the rate both ways (tbf). Each rank has
``GROUP_RANK=<node>`` (so the hierarchy's topology and the colocated aggregators see the nodes) and
``GLOO_SOCKET_IFNAME``/``OMNIREDUCE_IFNAME`` set to the node's interface, ``MASTER_ADDR`` to node 0's
address. ``--nets loopback`` runs the same on this machine's loopback (N "nodes" by ``GROUP_RANK``
only; no link to count): the quick check the test runs.

Methods, in the same run, one after the other in the same processes (or the same network):

* Gloo ring: plain DDP's all-reduce (``torch.distributed.all_reduce`` over all W ranks);
* hierarchical dense: reduce-scatter in the node, the rail's Gloo all-reduce across nodes,
  all-gather in the node (what NCCL does), from ``omnireduce.engines.hierarchy.Hierarchy``;
* flat omnireduce: every rank a worker of one job at the colocated aggregators (one per node), as
  ``OmniReduceState(hierarchical=False)``;
* hierarchical omnireduce: the hierarchy with an omnireduce rail, as ``hierarchical=True``;
* (micro-benchmark only) the hierarchy's in-node steps alone, nothing across nodes: what the
  node's interconnect costs here (TCP over loopback on shared cores, not NVLink).

Parts (``--parts``):

* ``micro``: a DDP-free driver (``ombench.nodemethods``) sums a float32 tensor (``--size-mib``,
  default 100 MiB) in which each rank has ``int(blocks * d)`` random non-zero blocks of 256
  (bench_allreduce.py's workload) at each density d of ``--densities`` (default 0.01,0.05,0.1);
  ``--warmup`` then ``--iters`` timed operations, the slowest rank's time, the median reported.
  Every method's sum is compared with the ring's (``numpy.allclose``, rtol = atol = 1e-5; the
  row's ``checksum`` is the float64 sum of rank 0's result).
* ``train``: bench_train.py's recommender (``recsys``) under DDP, the hooks ``allreduce`` (no
  hook), ``hier-dense``, ``omnireduce-flat``, ``omnireduce-hier`` and ``omnireduce-auto`` (the
  default state: flat or hierarchical measured per bucket; ``ombench.hooks``),
  ``--steps`` steps of which ``--train-warmup`` untimed.

Measured, per operation or step: the median time; the bytes that crossed each node's link (the
veth's kernel counters inside the node's namespace, read after a barrier before the first timed
operation and after the last: ``ombench.linkbytes``; frames with their headers, barriers
included), up and down, and the busiest node-link direction; the wire floor = busiest bytes / link
rate; ratios against the Gloo ring and flat omnireduce; the library's own counters (bytes the
node's ranks sent inside the node and in the reduction, summed over the node's ranks; the ring's a
formula). Tables (Markdown) are printed and written with every row to
``<out>/hierarchy_<N>x<L>.json`` and a plot ``.png`` beside it (if matplotlib is installed:
``make bench``).

    python scripts/bench_hierarchy.py --nets loopback --size-mib 4 --parts micro          # seconds
    python scripts/bench_hierarchy.py --nets 1gbit,10gbit --out docs/bench/hierarchy      # root, ~10 min
    python scripts/bench_hierarchy.py --nets 1gbit --nodes 4 --ranks-per-node 2 --parts micro
    python scripts/bench_hierarchy.py --report docs/bench/hierarchy/hierarchy_2x2.json    # the tables again

All ranks and aggregators share this machine's CPUs (2 cores on the development VM for 4 ranks and
2 aggregators): keep runs short, run nothing else meanwhile, and rerun a setting that looks disturbed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ombench import linkbytes, netem, nodereport
from ombench.machine import machine_info
from ombench.network import LOOPBACK, Network, exit_on_signals, print_log_tails
from ombench.nodemethods import METHODS

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("allreduce", "hier-dense", "omnireduce-flat", "omnireduce-hier", "omnireduce-auto")
TOL = 1e-5


# --------------------------------------------------------------------------------------------
# one rank of the micro-benchmark (hidden --rank-main mode)


def rank_main(cfg: dict[str, Any]) -> None:
    """Run every method at every density as one rank; rank 0 writes the rows to ``cfg["rows_path"]``."""
    import torch
    import torch.distributed as dist
    from bench_allreduce import make_input

    from ombench.nodemethods import PARTIAL, SETUPS, NodeSetup
    from omnireduce.blocks import block_nonzero
    from omnireduce.dtypes import DType
    from omnireduce.engines.hierarchy import discover
    from omnireduce.lifetime import exit_with_parent

    exit_with_parent()  # SIGTERM when the driver is gone (stdin is a pipe from it)
    torch.set_num_threads(1)
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
    topo = discover()
    numel, block, warmup, iters = cfg["numel"], cfg["block"], cfg["warmup"], cfg["iters"]
    setup = NodeSetup(rank=rank, world=W, block=block, job=cfg["job"], timeout=cfg["op_timeout"], dist=dist,
                      topology=topo)
    methods = {m: SETUPS[m](setup) for m in cfg["methods"]}  # in the same order on every rank
    link = linkbytes.link_name()
    rows: list[dict[str, Any]] = []
    for density in cfg["densities"]:
        base = make_input(rank, numel, density, block, "random", cfg["seed"])
        mask = torch.from_numpy(block_nonzero(base, DType.FLOAT32, block).astype(np.uint8))
        gathered = [torch.empty_like(mask) for _ in range(W)]
        dist.all_gather(gathered, mask)
        masks = np.stack([g.numpy().astype(bool) for g in gathered])
        node_union = statistics.fmean(masks[list(n)].any(axis=0).mean() for n in topo.nodes)
        ref = None
        for name, m in methods.items():
            times: list[float] = []
            start = counted0 = None
            for it in range(warmup + iters):
                x = torch.from_numpy(base.copy())
                dist.barrier()
                if it == warmup:
                    start, counted0 = (linkbytes.read(link) if link else None), m.counted(numel)
                t0 = time.perf_counter()
                m.run(x)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if it >= warmup:
                    times.append(dt.item())
            dist.barrier()
            delta = linkbytes.read(link) - start if link and start is not None else None
            counted1 = m.counted(numel)
            counted = {k: (counted1[k] - counted0[k]) / iters for k in counted1} if counted0 else counted1
            result = x.numpy()
            if ref is None:
                ref = result.copy()
            diff = torch.tensor([float(np.abs(result - ref).max())], dtype=torch.float64)
            agrees = np.allclose(result, ref, rtol=TOL, atol=TOL)
            ok = torch.tensor([1.0 if agrees or name in PARTIAL else 0.0], dtype=torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            everyone: list[Any] = [None] * W
            dist.all_gather_object(everyone, (topo.node, delta, counted))
            if rank == 0:
                nodes = len(topo.nodes)
                row = {"part": "micro", "network": cfg["network"], "method": name, "density": density,
                       "size_mib": cfg["size_mib"], "topology": topo.describe(), "median_s": statistics.median(times),
                       "times_s": times, "max_abs_diff_vs_ring": diff.item(),
                       "agrees": None if name in PARTIAL else bool(ok.item()),
                       "node_union": float(node_union), "global_union": float(masks.any(axis=0).mean()),
                       "rank_density": float(masks.mean()), "checksum": float(result.sum(dtype=np.float64)),
                       "link": linkbytes.summary(linkbytes.per_node([(n, d) for n, d, _ in everyone]), iters),
                       "lib_in_node": sum(c["in_node"] for _, _, c in everyone) / nodes,
                       "lib_across": sum(c["across"] for _, _, c in everyone) / nodes}
                rows.append(row)
                busiest = row["link"]["busiest"] if row["link"] else None
                print(f"  {cfg['network']:<8} d={density:<5} {name:<10} median {row['median_s'] * 1e3:8.1f} ms  "
                      f"busiest link {busiest / 2**20 if busiest else float('nan'):7.1f} MB  "
                      f"library in node {row['lib_in_node'] / 2**20:7.1f} MB, reduction "
                      f"{row['lib_across'] / 2**20:7.1f} MB per node  max |diff| {row['max_abs_diff_vs_ring']:.2e}",
                      flush=True)
    for m in methods.values():
        m.close()
    dist.barrier()  # every worker has left its jobs: the colocated aggregators may go
    if setup.colocated is not None:
        setup.colocated.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(cfg["rows_path"]).write_text(json.dumps(rows))


# --------------------------------------------------------------------------------------------
# driver


def run_micro(net: Network, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The micro-benchmark's rows on ``net`` (one process per rank, every method and density)."""
    W = args.nodes * args.ranks_per_node
    rows_path = tmp / f"micro-{net.name}.json"
    cfg = {"numel": int(args.size_mib * 2**20) // 4, "block": args.block, "densities": args.densities,
           "methods": args.methods, "warmup": args.warmup, "iters": args.iters, "seed": args.seed,
           "op_timeout": args.op_timeout, "rows_path": str(rows_path), "job": f"hierbench-{os.getpid()}-{net.name}",
           "network": net.name, "size_mib": args.size_mib}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-main", json.dumps(cfg)]
    port = net.master_port()
    base = {k: v for k, v in os.environ.items() if k not in ("OMNIREDUCE_AGGREGATORS", "OMNIREDUCE_JOB")}
    base.update(WORLD_SIZE=str(W), MASTER_ADDR=net.master_addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                GLOO_SOCKET_IFNAME=net.interface, OMP_NUM_THREADS="1")
    envs = [dict(base, RANK=str(r), **net.rank_env(r)) for r in range(W)]
    logs = [tmp / f"micro-{net.name}-rank{r}.log" for r in range(W)]
    error = net.run_ranks(cmd, envs, logs, args.setting_timeout, rank0_stdout=True)
    if error is None and not rows_path.exists():
        error = "rank 0 wrote no rows"
    if error is not None:
        print(f"  FAILED: micro-benchmark on {net.name}: {error}", file=sys.stderr)
        print_log_tails(logs)
        return [{"part": "micro", "network": net.name, "method": m, "density": d, "error": error}
                for d in args.densities for m in args.methods]
    return json.loads(rows_path.read_text())


def run_train(net: Network, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The recommender under DDP with each of :data:`HOOKS` on ``net`` (bench_train.py's settings)."""
    import bench_train

    W = args.nodes * args.ranks_per_node
    targs = bench_train.build_parser().parse_args(
        ["--workers", str(W), "--steps", str(args.steps), "--warmup", str(args.train_warmup),
         "--setting-timeout", str(args.setting_timeout), "--seed", str(args.seed)])
    rows = []
    for hook in args.hooks:
        row = bench_train.run_setting(net, "recsys", hook, targs, tmp)
        row["part"] = "train"
        row.pop("model_info", None)
        if "error" not in row:  # per node: the rows' bytes are per rank (means over the ranks), times L
            details = row.get("omnireduce") or row.get("hierarchy") or {}
            in_node = (details.get("bytes_in_node") or 0) / args.steps  # rank 0's whole-run count: the same each step
            sent = row["mb_per_step"] * 2**20  # hier-dense counts its in-node bytes in it too
            row["lib_in_node"] = in_node * args.ranks_per_node
            row["lib_across"] = (sent - (in_node if hook == "hier-dense" else 0)) * args.ranks_per_node
        rows.append(row)
    return rows


def report(micro: list[dict[str, Any]], train: list[dict[str, Any]], meta: dict[str, Any], png: Path) -> None:
    """Print the tables of a run's rows and draw its plot to ``png``."""
    rates = {n: info.get("rate_bps") for n, info in meta["networks"].items()}
    if micro:
        print("\n## micro-benchmark" + nodereport.micro_tables(micro, rates))
    if train:
        print("\n## recommender" + nodereport.train_tables(train, rates))
    drew = nodereport.plot(micro, train, png, f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks: median time "
                           "and busiest node-link bytes")
    plot = f"plot {png}" if drew else "no plot (matplotlib is not installed)"
    print(f"\nrows in {png.with_suffix('.json')}; {plot} ({meta.get('elapsed_s', 0):.0f} s)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [v.strip() for v in s.split(",") if v.strip()]  # noqa: E731
    ap.add_argument("--nets", type=csv, default=["loopback"],
                    help="loopback and/or link rates (1gbit,10gbit: emulated, root) (default: loopback)")
    ap.add_argument("--nodes", type=int, default=2, help="N nodes (default 2)")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="L ranks per node (default 2)")
    ap.add_argument("--parts", type=csv, default=["micro", "train"], help="micro,train (default both)")
    ap.add_argument("--methods", type=csv, default=list(METHODS),
                    help=f"micro-benchmark methods, the ring first (default {','.join(METHODS)})")
    ap.add_argument("--hooks", type=csv, default=list(HOOKS), help=f"recommender hooks (default {','.join(HOOKS)})")
    ap.add_argument("--size-mib", type=float, default=100.0, help="micro-benchmark tensor (default 100 MiB)")
    ap.add_argument("--densities", type=lambda s: [float(v) for v in csv(s)], default=[0.01, 0.05, 0.1])
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1, help="untimed micro-benchmark operations (default 1)")
    ap.add_argument("--iters", type=int, default=3, help="timed micro-benchmark operations (default 3)")
    ap.add_argument("--steps", type=int, default=8, help="recommender steps (default 8)")
    ap.add_argument("--train-warmup", type=int, default=3, help="untimed recommender steps (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--op-timeout", type=float, default=300.0, help="seconds per collective before giving up")
    ap.add_argument("--setting-timeout", type=float, default=900.0, help="seconds one part may take per network")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "hierarchy", help="directory of the JSON and PNG")
    ap.add_argument("--report", type=Path, metavar="JSON", help="print the tables and draw the plot of a saved run")
    ap.add_argument("--rank-main", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main or args.report:
        return args
    if args.nodes < 2 or args.ranks_per_node < 2:
        ap.error("the hierarchy needs --nodes >= 2 and --ranks-per-node >= 2")
    if set(args.parts) - {"micro", "train"} or args.methods[0] != "ring":
        ap.error("--parts: micro and/or train; --methods: the ring first (the sums are checked against it)")
    if args.iters < 1 or args.warmup < 0 or not 0 <= args.train_warmup < args.steps:
        ap.error("need --iters >= 1, --warmup >= 0 and 0 <= --train-warmup < --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_main:
        rank_main(json.loads(args.rank_main))
        return 0
    if args.report:
        data = json.loads(args.report.read_text())
        report(data["micro"], data["train"], data["meta"], args.report.with_suffix(".png"))
        return 0
    if any(n != LOOPBACK for n in args.nets):
        ok, why = netem.available()
        if not ok:
            sys.exit(f"bench_hierarchy: cannot emulate {','.join(args.nets)}: {why} (--nets loopback runs without)")
    exit_on_signals("bench_hierarchy")
    N, L = args.nodes, args.ranks_per_node
    stem = args.out / f"hierarchy_{N}x{L}"
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "nodes": N,
                            "ranks_per_node": L, "machine": machine_info(ROOT), "loadavg_start": os.getloadavg(),
                            "networks": {}, "micro": {"size_mib": args.size_mib, "densities": args.densities,
                                                      "warmup": args.warmup, "iters": args.iters,
                                                      "driver": "DDP-free (ombench.nodemethods)"},
                            "train": {"model": "recsys", "steps": args.steps, "warmup": args.train_warmup}}
    micro: list[dict[str, Any]] = []
    train: list[dict[str, Any]] = []

    def save() -> None:
        meta["loadavg_end"] = os.getloadavg()
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "micro": micro, "train": train}, indent=1))

    t0 = time.monotonic()
    print(f"bench_hierarchy: {N} nodes x {L} ranks, networks {','.join(args.nets)}, parts {','.join(args.parts)}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_hierarchy-") as tmpdir:
        tmp = Path(tmpdir)
        for name in args.nets:
            with Network(name, N * L, 0, ranks_per_node=L, grace=5.0) as net:
                meta["networks"][name] = net.info
                if "micro" in args.parts:
                    micro += run_micro(net, args, tmp)
                    save()
                if "train" in args.parts:
                    train += run_train(net, args, tmp)
                    save()
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    save()
    report(micro, train, meta, stem.with_suffix(".png"))
    failed = any("error" in r for r in micro + train) or any(r.get("agrees") is False for r in micro)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
