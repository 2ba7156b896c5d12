#!/usr/bin/env python3
"""HSDP with FSDP2 on emulated nodes: native HSDP against HSDP with omnireduce across the nodes.

N nodes of L ranks (``--nodes``, ``--ranks-per-node``; default 2 x 2), a 2-D DeviceMesh
``("replicate", "shard")``: each node is a shard group, the nodes replicate. On an emulated
network (``--nets 1gbit,10gbit``, root) every node is one network namespace holding its L ranks
(``ombench.network.Network(ranks_per_node=L)``): the ranks of a node reach each other over the
namespace's loopback (unlimited: the reduce-scatter and all-gather inside the node), the nodes
over their links, shaped to the rate both ways (tbf). ``--nets loopback`` runs the same on this
machine's loopback (no link to count).

Modes, in the same processes, one after the other, alternating, ``--repeats`` times:

* ``native``: ``fully_shard`` on the 2-D mesh (FSDP2's own HSDP: its all-reduce of each FSDP
  module's reduce-scatter output across the nodes, Gloo);
* ``omnireduce``: ``fully_shard`` on ``mesh["shard"]`` and ``use_omnireduce(model, mesh=mesh)``
  (omnireduce.integrations.fsdp, with ``--path``, default ``"measure"``, its default): each module's
  reduce-scatter output across the nodes through the collective engine or the dense all-reduce,
  whichever its first steps timed faster on that network (agreed on every rank of its replicate
  group; a module the engine would send whole goes dense untimed). The measuring steps (8, then 6
  of the step check) fall in the warm-up only with ``--warmup`` 14 or more. ``--path threshold``:
  each module's way by its union density against 0.6 instead.

Models (one ``fully_shard`` per block, then the root; Adam, lr 1e-3):

* ``recsys``: an EmbeddingBag of ``--rows`` x ``--dim`` (100,000 x 64: 25.6 MB) under an MLP
  (dim -> 256 -> 256 -> 1); each rank's batch is ``--batch`` bags of 8 ids drawn from a Zipf law
  of exponent 1.2 over the rows (frequency ranks scattered over the table), Gaussian targets.
* ``dense``: an MLP of 4 ReLU layers 512 wide (0.8M parameters): nearly every gradient element
  non-zero, so omnireduce can save nothing: its modules should go dense once measured.

Measured per mode: the median step time (zero_grad, forward, backward, optimizer step; a step's time
is the slowest rank's), the bytes that crossed each node's link per timed step (the veth's kernel
counters inside the node's namespace, read after a barrier before the first timed step and after the
last: ``ombench.linkbytes``; frames with their headers, the barriers included), what omnireduce's
handle counted (``stats()``: bytes each rank sent, the fraction of native HSDP's ring bytes over
every step and over the timed ones, each module's path choice), and the loss after each step (the
two modes must agree: the same parameters). Medians over the repeats. The machine's cores are shared
by every rank (2 cores on the development VM for 4 ranks), and other load shows up in the times:
compare modes within one run.

    python scripts/bench_fsdp.py --nets loopback --steps 6 --warmup 2 --repeats 1    # seconds
    python scripts/bench_fsdp.py --nets 1gbit,10gbit --out docs/bench/fsdp            # root, ~10 min
    # the same with the path choice's measuring and checking steps in the warm-up, to another file:
    python scripts/bench_fsdp.py --nets 1gbit,10gbit --warmup 16 --steps 40 --name hsdp_2x2_measure
    python scripts/bench_fsdp.py --report docs/bench/fsdp/hsdp_2x2.json               # the table again

Writes ``<out>/hsdp_<N>x<L>.json`` (``--name``: another name; every run, and the meta: machine,
versions, arguments) and a plot ``.png`` beside it (with matplotlib: ``make bench``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ombench import linkbytes, netem
from ombench.machine import machine_info
from ombench.network import LOOPBACK, Network, exit_on_signals, print_log_tails

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("recsys", "dense")
MODES = ("native", "omnireduce")


# ------------------------------------------------------------------------------------------------
# the ranks (they import torch; the driver never does)


def build(model: str, cfg: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The model and its blocks (each gets a ``fully_shard`` of its own, before the root's)."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if model == "recsys":
                self.table: nn.Module | None = nn.EmbeddingBag(cfg["rows"], cfg["dim"], mode="sum")
                widths = [cfg["dim"], 256, 256, 1]
            else:
                self.table, widths = None, [512, 512, 512, 512, 1]
            layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
            self.mlp = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
            self.layers = layers

        def forward(self, x: Any) -> Any:
            return self.mlp(self.table(x) if self.table is not None else x).sum(-1)

    net = Net()
    return net, ([net.table] if net.table is not None else []) + net.layers


def loss_of(model: str, net: Any, cfg: dict[str, Any], rank: int, step: int) -> Any:
    """Rank ``rank``'s loss at ``step`` (the same inputs in both modes)."""
    import torch

    g = torch.Generator().manual_seed(7919 * rank + step)
    if model == "recsys":
        weights = 1.0 / torch.arange(1, cfg["rows"] + 1, dtype=torch.float64) ** 1.2
        ids = (torch.multinomial(weights, cfg["batch"] * 8, replacement=True, generator=g) * 7_927) % cfg["rows"]
        x = ids.view(cfg["batch"], 8)
    else:
        x = torch.randn(cfg["batch"], 512, generator=g)
    return ((net(x) - torch.randn(cfg["batch"], generator=g)) ** 2).mean()


def run_mode(model: str, mode: str, cfg: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """Train ``model`` in ``mode`` for ``cfg["steps"]`` steps; the row (rank 0's is the one kept)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from omnireduce.integrations import use_omnireduce

    torch.manual_seed(cfg["seed"])
    net, blocks = build(model, cfg)
    on = mesh if mode == "native" else mesh["shard"]
    for block in blocks:
        fully_shard(block, mesh=on)
    fully_shard(net, mesh=on)
    handle = use_omnireduce(net, mesh=mesh, path=cfg.get("path", "measure")) if mode == "omnireduce" else None
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    link, start, before, times, losses = linkbytes.link_name(), None, None, [], []
    for step in range(cfg["steps"]):
        if step == cfg["warmup"]:
            dist.barrier()
            start = linkbytes.read(link) if link else None
            before = handle.stats() if handle is not None else None
        t0 = time.perf_counter()
        loss = loss_of(model, net, cfg, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    dist.barrier()
    delta = linkbytes.read(link) - start if link and start is not None else None
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, (int(os.environ.get("GROUP_RANK", rank)), delta))
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    timed = cfg["steps"] - cfg["warmup"]
    row: dict[str, Any] = {"model": model, "mode": mode, "step_times_s": slowest.tolist(), "losses": losses,
                           "median_step_s": statistics.median(slowest.tolist()[cfg["warmup"]:]),
                           "link": linkbytes.summary(linkbytes.per_node(nodes), timed)}
    if handle is not None and before is not None:
        stats = handle.stats()
        dense_timed = stats["dense_equivalent_bytes"] - before["dense_equivalent_bytes"]
        row["omnireduce"] = {"bytes_sent_per_step": (stats["bytes_sent"] - before["bytes_sent"]) / timed,
                             "sent_fraction": stats["sent_fraction"],
                             "sent_fraction_timed": ((stats["bytes_sent"] - before["bytes_sent"]) / dense_timed
                                                     if dense_timed else None),
                             "per_module": {k: {f: v[f] for f in ("path", "union_density", "sent_fraction",
                                                                   "block_size", "numel")}
                                            for k, v in stats["per_module"].items()},
                             "paths": stats.get("paths", {}), "step_checks": stats.get("step_checks"),
                             "iterations_measuring": stats.get("iterations_measuring")}
        handle.close()
    row["parameters"] = sum(p.numel() for p in net.parameters()) * mesh.size(1)  # (the shards of one replica)
    del net, opt, handle
    gc.collect()
    return row


def worker_main(cfg: dict[str, Any]) -> None:
    """Every (repeat, model, mode) in this rank; rank 0 writes the rows to ``cfg["out"]``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from omnireduce.launch import init_distributed
    from omnireduce.lifetime import exit_with_parent

    exit_with_parent()  # SIGTERM when the benchmark is gone (Network.run_ranks: stdin is a pipe from it)
    torch.set_num_threads(1)
    rank, world = init_distributed("gloo")
    mesh = init_device_mesh("cpu", (world // cfg["ranks_per_node"], cfg["ranks_per_node"]),
                            mesh_dim_names=("replicate", "shard"))
    rows = []
    for repeat in range(cfg["repeats"]):
        for model in cfg["models"]:
            modes = MODES if repeat % 2 == 0 else MODES[::-1]  # (alternating: neither always runs first)
            for mode in modes:
                rows.append({**run_mode(model, mode, cfg, rank, mesh), "repeat": repeat})
                if rank == 0:
                    r = rows[-1]
                    print(f"    {model} {mode} repeat {repeat}: median step {r['median_step_s'] * 1e3:.1f} ms",
                          flush=True)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# the driver


def run_network(name: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every mode on network ``name``, in one set of rank processes; their rows, with the network's info."""
    workers = args.nodes * args.ranks_per_node
    out = tmp / f"{name}.json"
    cfg = {"models": args.models, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
           "seed": args.seed, "rows": args.rows, "dim": args.dim, "batch": args.batch,
           "ranks_per_node": args.ranks_per_node, "path": args.path, "out": str(out)}
    with Network(name, workers, 0, grace=5.0, ranks_per_node=args.ranks_per_node) as net:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIREDUCE_")}
        env.update(WORLD_SIZE=str(workers), MASTER_ADDR=net.master_addr, MASTER_PORT=str(net.master_port()),
                   GLOO_SOCKET_IFNAME=net.interface, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r % args.ranks_per_node), **net.rank_env(r)}
                for r in range(workers)]
        logs = [tmp / f"{name}-rank{r}.log" for r in range(workers)]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
        print(f"  {name}: {workers} ranks as {args.nodes} nodes x {args.ranks_per_node} ...", flush=True)
        load = os.getloadavg()[0]
        error = net.run_ranks(cmd, envs, logs, args.timeout, rank0_stdout=True)
        info = dict(net.info, loadavg_1min=[load, os.getloadavg()[0]])
    if error is None and not out.exists():
        error = "rank 0 wrote no result"
    if error is not None:
        print(f"  FAILED on {name}: {error}", file=sys.stderr)
        print_log_tails(logs)
        return [{"network": name, "error": error, "network_info": info}]
    return [dict(r, network=name, network_info=info) for r in json.loads(out.read_text())]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (network, model, mode): medians over the repeats of the step time and the link bytes per
    step (the busiest node-link direction), omnireduce's counted fraction (over every step, and over
    the timed ones where the rows have it), and the largest loss difference between the modes of one
    repeat."""
    out = []
    ok = [r for r in rows if "error" not in r]
    for key in dict.fromkeys((r["network"], r["model"], r["mode"]) for r in ok):
        runs = [r for r in ok if (r["network"], r["model"], r["mode"]) == key]
        busiest = [r["link"]["busiest"] for r in runs if r.get("link")]
        load = runs[0]["network_info"].get("loadavg_1min")
        s: dict[str, Any] = {"network": key[0], "model": key[1], "mode": key[2], "repeats": len(runs), "load": load,
                             "median_step_s": statistics.median(r["median_step_s"] for r in runs),
                             "link_busiest_bytes_per_step": statistics.median(busiest) if busiest else None}
        if key[2] == "omnireduce":
            s["sent_fraction"] = statistics.median(r["omnireduce"]["sent_fraction"] for r in runs)
            timed = [r["omnireduce"].get("sent_fraction_timed") for r in runs]
            s["sent_fraction_timed"] = statistics.median(timed) if None not in timed else None
            native = [r for r in ok if (r["network"], r["model"], r["mode"]) == (key[0], key[1], "native")]
            s["max_loss_diff"] = max((abs(a - b) for r in runs for n in native if n["repeat"] == r["repeat"]
                                      for a, b in zip(r["losses"], n["losses"], strict=True)), default=None)
        out.append(s)
    return out


def table(summaries: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`summary` (link bytes and the step time against native HSDP's)."""
    by = {(s["network"], s["model"], s["mode"]): s for s in summaries}
    lines = ["| network | model | native step ms | omnireduce step ms | speed-up | native link MiB/step | "
             "omnireduce link MiB/step | link bytes vs native | omnireduce counted | counted, timed steps | "
             "max loss diff | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (net, model, mode), o in by.items():
        n = by.get((net, model, "native"))
        if mode != "omnireduce" or n is None:
            continue
        nb, ob = n["link_busiest_bytes_per_step"], o["link_busiest_bytes_per_step"]
        mb = (lambda b: "" if b is None else f"{b / 2**20:.2f}")  # noqa: E731
        pct = (lambda f: "" if f is None else f"{f:.1%}")  # noqa: E731
        lines.append(f"| {net} | {model} | {n['median_step_s'] * 1e3:.1f} | {o['median_step_s'] * 1e3:.1f} | "
                     f"{n['median_step_s'] / o['median_step_s']:.2f}x | {mb(nb)} | {mb(ob)} | "
                     f"{'' if not nb or ob is None else f'{ob / nb:.1%}'} | {o['sent_fraction']:.1%} | "
                     f"{pct(o.get('sent_fraction_timed'))} | "
                     f"{o['max_loss_diff']:.1e} | {_load(o.get('load'))} |")
    return "\n".join(lines)


def _load(load: list[float] | None) -> str:
    """The machine's 1-minute load average before and after a network's runs."""
    return "" if not load else f"{load[0]:.1f}-{load[1]:.1f}"


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Step time and link bytes per step, by network and model, native against omnireduce."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((s["network"], s["model"]) for s in summaries))
    by = {(s["network"], s["model"], s["mode"]): s for s in summaries}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, field, scale, label in ((axes[0], "median_step_s", 1e3, "median step time (ms)"),
                                    (axes[1], "link_busiest_bytes_per_step", 2**-20, "busiest node link (MiB/step)")):
        for j, mode in enumerate(MODES):
            values = [(by.get((*g, mode)) or {}).get(field) for g in groups]
            xs = [i + (j - 0.5) * 0.4 for i in range(len(groups))]
            bars = ax.bar(xs, [0 if v is None else v * scale for v in values], 0.4, label=mode)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(groups)), [f"{n}\n{m}" for n, m in groups])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("HSDP, 2 nodes x 2 ranks: native (FSDP2's all-reduce) vs omnireduce across the nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", default="1gbit,10gbit", help="loopback and/or link rates (root): 1gbit,10gbit")
    ap.add_argument("--models", default="recsys,dense", help="recsys,dense")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating (default 3)")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128, help="bags (recsys) or rows (dense) per rank and step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one network's runs")
    ap.add_argument("--path", default="measure", choices=["measure", "threshold", "omnireduce", "dense"],
                    help="use_omnireduce's path (default measure: each module's way timed over its first steps)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "fsdp")
    ap.add_argument("--name", help="the result's file name, without .json (default hsdp_<nodes>x<ranks-per-node>)")
    ap.add_argument("--report", type=Path, help="print the table of an earlier run's JSON and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return 0
    if args.report is not None:
        print(table(json.loads(args.report.read_text())["summary"]))
        return 0
    args.nets = [n for n in args.nets.split(",") if n]
    args.models = [m for m in args.models.split(",") if m]
    if bad := [m for m in args.models if m not in MODELS]:
        sys.exit(f"bench_fsdp: unknown model(s) {bad}: choose from {', '.join(MODELS)}")
    if not 0 <= args.warmup < args.steps:
        sys.exit("bench_fsdp: need 0 <= --warmup < --steps")
    if any(n != LOOPBACK for n in args.nets):
        ok, why = netem.available()
        if not ok:
            sys.exit(f"bench_fsdp: cannot emulate {args.nets}: {why} (--nets loopback runs without it)")
    exit_on_signals("bench_fsdp")
    meta = {"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(ROOT),
            "loadavg_start": os.getloadavg(), "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
            "recsys": {"rows": args.rows, "dim": args.dim, "bags_per_rank": args.batch, "ids_per_bag": 8,
                       "zipf": 1.2, "mlp": [args.dim, 256, 256, 1]},
            "dense": {"mlp": [512, 512, 512, 512, 1], "rows_per_rank": args.batch},
            "optimizer": "Adam(lr=1e-3)", "omnireduce": f"use_omnireduce(model, mesh=mesh, path={args.path!r})",
            "path": args.path,
            "link": "busiest direction of a node's veth, kernel counters, per timed step"}
    rows: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name or f'hsdp_{args.nodes}x{args.ranks_per_node}'}.json"
    with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmp:
        for name in args.nets:
            rows += run_network(name, args, Path(tmp))
            summaries = summary(rows)
            path.write_text(json.dumps({"meta": meta, "summary": summaries, "rows": rows}, indent=1))
    meta["loadavg_end"] = os.getloadavg()
    path.write_text(json.dumps({"meta": meta, "summary": summaries, "rows": rows}, indent=1))
    print(table(summaries))
    try:
        plot(summaries, path.with_suffix(".png"))
        print(f"\nwrote {path} and {path.with_suffix('.png')}")
    except ImportError:
        print(f"\nwrote {path}; no plot (matplotlib is not installed: make bench)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
