#!/usr/bin/env python3
"""GPU check, NCCL part: omnireduce over NCCL with several ranks sharing one GPU.

    python scripts/gpu_nccl_check.py collectives --json nccl_collectives.json   # the trick, and which variant works
    python scripts/gpu_nccl_check.py variant-env nccl_collectives.json         # KEY=VALUE lines for the later steps
    python scripts/gpu_nccl_check.py parity | hierarchy | dies | bench | profile | recsys | graphs --json OUT.json
    python scripts/gpu_nccl_check.py parity --backend gloo --device cpu       # the same code paths without a GPU

The trick. NCCL refuses two ranks on one device, and between ranks of one host it would use shared
memory or peer access. Each rank here claims a host of its own (``NCCL_HOSTID=host<RANK>``), every
rank runs on ``cuda:0``, and with ``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1`` NCCL moves the
bytes through its socket transport on loopback: a network between the ranks, emulated on one GPU
(``gpu_common.nccl_rank_env``). Timings here are labelled so: loopback sockets, not NVLink.

Design. Each subcommand starts its ranks itself (:func:`launch`: one process per rank with
torchrun's variables, each rank's output to the log, a deadline after which the ranks still
running are killed and reported hung), except ``hierarchy``, which runs two torchruns with
``--nnodes 2 --node-rank 0/1`` on one rendezvous at 127.0.0.1 (2 "nodes" x 2 ranks), and
``recsys``, which runs examples/train_recsys.py. The ranks run gpu_nccl_ranks.py's cases; this
side judges their JSON, prints the tables and a ``RESULT:`` line, writes ``--json``, and exits 0
(passed), 1 (failed) or 77 (skipped: NCCL asked for and no GPU).

* ``collectives``: all_reduce, all_gather_into_tensor and all_to_all_single at 2 and 4 ranks
  against float64 sums made on each rank; with ``NCCL_DEBUG=INFO`` in the log; where NCCL fails,
  again with ``NCCL_P2P_DISABLE=1``, then also ``NCCL_SHM_DISABLE=1``. The JSON says which variant
  worked (``variant``) and what NCCL printed when it failed; ``variant-env`` prints its variables,
  which gpu_check.sh exports for the later steps.
* ``parity``: per config (the default OmniReduceState(), engine="collective" on dense buckets and
  measured, sparse COO gradients with either engine, fp16 and bf16 parameters, fuse_optimizer,
  AMP with GradScaler), the hook's parameters against plain DDP's on NCCL after every step
  (float32: rtol 1e-5), at 2 and 4 ranks; every rank must then exit 0, its destroy_process_group
  returning (the time it took is reported).
* ``hierarchy``: tests/scripts/hier_ddp.py's comparison (plain DDP, the flat hook, the hierarchy) on
  2 nodes x 2 ranks, dense, sparse COO, engine="collective" on the rails, and compression at density 1.
* ``dies``: a rank SIGKILLed between its forward and backward pass; every other rank must stop
  (an error raised, or the process ended by NCCL's watchdog) within the process group's timeout
  plus a margin, none left hanging; with the default state and with engine="collective".
* ``bench``: ``omnireduce-bench --check`` (``python -m omnireduce.bench``): torch.distributed's
  all_reduce against omnireduce.distributed's, 100 MiB fp32 and bf16 at densities 0.001-1, per world
  size (the GPU check runs it at W = 1, 2 and 4).
* ``recsys``: examples/train_recsys.py --backend nccl, the default hook against plain DDP, at 2 and 4
  ranks: step times, bytes, and the parameters compared (rtol 1e-5).
* ``profile``: the engine's cost per bucket by phase from torch.profiler (gpu_nccl_profile.py),
  written for ``cost_model.py collective --measured``.
* ``graphs``: the collective engine with and without CUDA graphs (``OMNIREDUCE_CUDA_GRAPHS=1``) at each
  world size, per bucket: the same bits (the steady state, an overflow of the capacity, after it),
  host time per reduction and launches (gpu_nccl_graphs.py).
* ``fsdp``: HSDP with omnireduce across the replicas against native HSDP on 2 "nodes" x 2 ranks
  (tests/fsdp_cases.py on NCCL): parameters within 1e-5 after each of 20 Adam steps (the recommender
  by block and the dense model; bf16 reduce dtype with accumulation), and no synchronisation by
  omnireduce on the training thread from the third step on (gpu_sync_check.SyncWatch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from ombench.rankjobs import clean_end, free_port, launch, nccl_said, run_case, wait_all  # noqa: E402

VARIANTS = [("default", {}), ("p2p-off", {"NCCL_P2P_DISABLE": "1"}),
            ("p2p-shm-off", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})]
PARITY = [{"name": "default"}, {"name": "collective", "state": {"engine": "collective", "dense_fallback": False}},
          {"name": "collective-measure", "state": {"engine": "collective"}}, {"name": "sparse-coo", "sparse": True},
          {"name": "fp16", "dtype": "float16", "state": {"dense_fallback": False}},
          {"name": "bf16", "dtype": "bfloat16", "state": {"dense_fallback": False}},
          {"name": "fused", "fused": True, "state": {"dense_fallback": False}},
          {"name": "amp", "amp": True, "state": {"dense_fallback": False}},
          {"name": "sparse-coo-collective", "sparse": True, "state": {"engine": "collective"}},
          {"name": "compressed", "compression": 1.0},  # block top-k at density 1: exact, like the hierarchy's
          {"name": "compressed-collective", "compression": 1.0, "state": {"engine": "collective"}}]
HIERARCHY = [{"name": "dense"}, {"name": "sparse", "sparse": True, "dense_reference": True},
             {"name": "collective", "engine": "collective"},
             {"name": "compressed", "compression": 1.0}]  # (density 1: block top-k through the hierarchy, exact)
HIER_TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}  # as tests/test_hierarchy_ddp.py


def cmd_collectives(args: argparse.Namespace) -> tuple[bool, str, dict]:
    from ombench.rankside import label_for

    attempts, chosen = [], None
    for name, extra in VARIANTS:
        env = dict(extra, NCCL_DEBUG=os.environ.get("GPU_NCCL_DEBUG", "INFO"))
        ok_all = True
        for world in args.worlds:
            ranks, results, _ = run_case("collectives", args, world, {"sizes": args.sizes}, env=env)
            ops = [op for res in results if res for op in res["ops"]]
            ok = all(r["rc"] == 0 and not r["hung"] for r in ranks) and all(results) and all(o["ok"] for o in ops)
            attempts.append({"variant": name, "env": extra, "world": world, "ok": ok, "ops": ops,
                             "ranks": [{k: r[k] for k in ("rank", "rc", "hung", "seconds", "end")} for r in ranks],
                             "nccl_said": nccl_said(ranks, not ok)})
            ok_all &= ok
            if not ok:
                break
        if ok_all:
            chosen = {"name": name, "env": extra}
            break
        if args.backend != "nccl":
            break
    res = {"label": label_for(args.backend, args.device), "variant": chosen, "attempts": attempts}
    if chosen is None:
        said = [line for a in attempts for line in a["nccl_said"] if re.search(r"WARN|[Ee]rror|Duplicate", line)]
        first = f"; first: {said[0][:300]}" if said else ""
        tried = ", ".join(dict.fromkeys(a["variant"] for a in attempts))
        return False, f"{args.backend.upper()} failed in every variant tried ({tried}){first}", res
    worst = max((o["max_err"] for a in attempts if a["variant"] == chosen["name"] for o in a["ops"]), default=0.0)
    return True, (f"variant {chosen['name']} ({' '.join(f'{k}={v}' for k, v in chosen['env'].items()) or 'as is'}): "
                  f"all_reduce, all_gather_into_tensor, all_to_all_single equal the references at W="
                  f"{','.join(map(str, args.worlds))} (largest all_reduce error {worst:.2g})"), res


def cmd_variant_env(path: str) -> int:
    """Print the working variant's variables (KEY=VALUE lines) from ``collectives``' JSON; exit status
    0, or 3 when the file says no variant worked (no file: nothing printed, 0)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0
    variant = data.get("variant")
    if variant is None:
        return 3
    for k, v in variant.get("env", {}).items():
        print(f"{k}={v}")
    return 0


def _parity_problems(world: int, results: list[dict | None]) -> list[str]:
    problems = []
    kernels = os.environ.get("OMNIREDUCE_ENGINE_KERNELS") == "1"  # (the ranks run with the caller's environment)
    for res in results:
        if res is None:
            problems.append(f"W={world}: a rank wrote no result")
            continue
        for c in res["results"]:
            cfg, st, name = c["config"], c["stats"], c["config"]["name"]
            where = f"W={world} rank {res['rank']} {name}"
            if c["error"] or not c["ok"]:
                largest = max(c["diffs"], default=float("nan"))
                problems.append(f"{where}: {c['error'] or f'parameters differ (largest {largest:.3g})'}")
            elif st.get("buckets_failed"):
                problems.append(f"{where}: {st['buckets_failed']} bucket(s) failed")
            elif cfg.get("sparse") and not st.get("buckets_coo"):
                problems.append(f"{where}: no sparse COO bucket")
            elif cfg.get("state", {}).get("engine") == "collective" and not st.get("collective_reductions"):
                problems.append(f"{where}: the collective engine reduced nothing")
            elif cfg.get("state", {}).get("engine") == "collective" and kernels and \
                    not st.get("collective_kernel_reductions"):
                problems.append(f"{where}: OMNIREDUCE_ENGINE_KERNELS=1, but the kernel exchange reduced nothing")
            elif "compression" in cfg and not st.get("buckets_compressed"):
                problems.append(f"{where}: no bucket went compressed")
    return problems


def cmd_parity(args: argparse.Namespace) -> tuple[bool, str, dict]:
    configs = [c for c in PARITY if not args.configs or c["name"] in args.configs]
    problems, rows, ends = [], [], []
    for world in args.worlds:
        ranks, results, _ = run_case("parity", args, world, {"configs": configs})
        problems += _parity_problems(world, results)
        ok, words = clean_end(ranks)
        ends.append(f"W={world}: {words}")
        if not ok:
            problems.append(f"W={world}: {words}")
        for c in (results[0] or {}).get("results", []):
            rows.append({"world": world, "config": c["config"]["name"], "ok": c["ok"], "error": c["error"],
                         "largest_diff": max(c["diffs"], default=None), "stats": c["stats"]})
            st = c["stats"]
            print(f"W={world} {c['config']['name']:<22} {'ok' if c['ok'] else 'FAILED':<7} largest difference "
                  f"{max(c['diffs'], default=float('nan')):.3g}  sparse/dense/coo buckets {st.get('buckets_sparse')}"
                  f"/{st.get('buckets_dense')}/{st.get('buckets_coo')}  engine {st.get('engine')}"
                  f"{'  ' + c['error'] if c['error'] else ''}")
    res = {"rows": rows, "problems": problems, "ends": ends}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    return True, (f"{len(configs)} configs at W={','.join(map(str, args.worlds))} equal plain DDP's parameters "
                  f"every step; {'; '.join(ends)}"), res


FSDP = [{"model": "recsys", "blocks": True}, {"model": "dense", "blocks": True},
        {"model": "dense", "reduce_dtype": "bfloat16", "accumulate": True, "reshard": False}]


def cmd_fsdp(args: argparse.Namespace) -> tuple[bool, str, dict]:
    problems, rows = [], []
    world = 4
    ranks, results, _ = run_case("fsdp", args, world, {"configs": FSDP, "shape": [2, 2]})
    ok, words = clean_end(ranks)
    if not ok:
        problems.append(words)
    for rank, res in enumerate(results):
        if res is None:
            problems.append(f"rank {rank} wrote no result")
            continue
        for r in res["results"]:
            cfg, worst = r["config"], max(r["diffs"])
            own = [s for s in r["syncs"] if not s["omnireduce_thread"] and s["through_omnireduce"]]
            if worst > args.rtol or r["moved"] <= 100 * args.rtol:
                problems.append(f"rank {rank} {cfg}: largest difference {worst:.3g}, moved {r['moved']:.3g}")
            if own:
                problems.append(f"rank {rank} {cfg}: {len(own)} sync(s) by omnireduce on the training thread, "
                                f"first at {own[0]['where']}: {own[0]['stack'][-3:]}")
            rows.append({"rank": rank, "config": cfg, "largest_diff": worst, "moved": r["moved"],
                         "sent_fraction": r["stats"]["sent_fraction"], "times": r["times"],
                         "syncs_by_omnireduce": len(own), "syncs_other": len(r["syncs"]) - len(own)})
            if rank == 0:
                print(f"{json.dumps(cfg):<80} largest difference {worst:.3g}  sent {r['stats']['sent_fraction']:.3f}"
                      f"  s native/ours {r['times'][0]:.2f}/{r['times'][1]:.2f}  syncs ours/other {len(own)}/"
                      f"{len(r['syncs']) - len(own)}")
    res = {"rows": rows, "problems": problems, "end": words}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    frac = [f"{json.dumps(r['config'])}: sent {r['sent_fraction']:.3f}" for r in rows if r["rank"] == 0]
    return True, (f"HSDP 2x2 on {args.backend.upper()} equals native HSDP within {args.rtol:g} over 20 Adam steps in "
                  f"{len(FSDP)} configs, no sync by omnireduce on the training thread; {'; '.join(frac)}; "
                  f"{words}"), res


def cmd_hierarchy(args: argparse.Namespace) -> tuple[bool, str, dict]:
    out = Path(tempfile.mkdtemp(prefix="hierarchy-", dir=args.work))
    case_args = {"backend": args.backend, "device": args.device, "timeout": args.pg_timeout, "out": str(out),
                 "configs": HIERARCHY}
    port, procs, t0 = free_port(), [], time.time()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK",
                                                           "MASTER_ADDR", "MASTER_PORT", "OMNIREDUCE_AGGREGATORS")}
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(SCRIPTS / "gpu_nccl_check.py"), "rank", "hierarchy", str(out), json.dumps(case_args)]
        with open(out / f"node{node}.log", "w") as f:
            procs.append(subprocess.Popen(cmd, env=dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), stdout=f,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                          start_new_session=True))
    ended = wait_all(procs, t0 + args.launch_timeout)
    for node, p in enumerate(procs):
        print(f"--- node {node}: exit status {p.returncode}\n" + (out / f"node{node}.log").read_text(errors="replace"))
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank?.json"))]
    problems = [f"node {n}: exit status {p.returncode}{' (hung)' if e is None else ''}"
                for n, (p, e) in enumerate(zip(procs, ended, strict=True)) if p.returncode != 0 or e is None]
    if len(ranks) != 4:
        problems.append(f"{len(ranks)} of 4 ranks wrote a result")
    rows = []
    for r in ranks:
        for c in r["results"]:
            tol, name = HIER_TOL[c["config"].get("dtype", "float32")], c["config"]["name"]
            hs = c["hier_stats"]
            rows.append({"rank": r["rank"], "node": r["node"], "config": name, "flat": max(c["flat"]),
                         "hier": max(c["hier"]), "hierarchical": hs["hierarchical"],
                         "bytes_in_node": hs["bytes_in_node"],
                         "rail_collective_reductions": hs.get("rail_collective_reductions")})
            rails = hs.get("rail_collective_reductions", 0)
            if max(c["flat"]) > tol or max(c["hier"]) > tol or not hs["hierarchical"] or not hs["bytes_in_node"]:
                problems.append(f"rank {r['rank']} {name}: flat {max(c['flat']):.3g}, hierarchy {max(c['hier']):.3g} "
                                f"(tolerance {tol:g}), hierarchical {hs['hierarchical']}")
            elif c["config"].get("engine") == "collective" and not rails:
                problems.append(f"rank {r['rank']} {name}: the collective engine reduced no rail shard")
    res = {"rows": rows, "problems": problems}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    return True, (f"2 nodes x 2 ranks: {', '.join(c['name'] for c in HIERARCHY)}: flat and hierarchical hook equal "
                  "plain DDP every step, the hierarchy on"), res


def cmd_dies(args: argparse.Namespace) -> tuple[bool, str, dict]:
    limit, world = args.pg_timeout + args.margin, max(args.worlds)
    problems, rows = [], []
    for name, state in (("default", {}), ("collective", {"engine": "collective"})):
        ranks, results, out = run_case("dies", args, world, {"state": state, "step": 3},
                                       timeout=2 * args.pg_timeout + 30)  # (reported, not cut off by 6.5's budget)
        victim = json.loads((out / "victim.json").read_text()) if (out / "victim.json").is_file() else None
        row = {"state": name, "world": world, "victim": victim, "ranks": []}
        for r, res in zip(ranks, results, strict=True):
            if victim is not None and r["rank"] == victim["rank"]:
                continue
            after = (r["ended_at"] - victim["died_at"]) if victim and r["ended_at"] else None
            row["ranks"].append({"rank": r["rank"], "rc": r["rc"], "hung": r["hung"], "ended_after_s": after,
                                 "error": (res or {}).get("error"),
                                 "failed_after_s": (res["failed_at"] - victim["died_at"]) if res and victim else None})
            print(f"{name}: rank {r['rank']} exit status {r['rc']}, ended {after if after is None else round(after, 1)}"
                  f" s after the victim died; raised: {(res or {}).get('error') or '(nothing: ended by NCCL)'}")
            if victim is None:
                continue
            if r["hung"] or after is None or after > limit:
                problems.append(f"{name}: rank {r['rank']} still running {limit:g} s after rank {victim['rank']} died")
            elif res is not None and res.get("error") is None and r["rc"] == 0:
                problems.append(f"{name}: rank {r['rank']} trained on without an error")
        if victim is None:
            problems.append(f"{name}: the victim never reached its step (exit {[r['rc'] for r in ranks]})")
        rows.append(row)
    res = {"rows": rows, "problems": problems, "limit_s": limit}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    worst = max(r["ended_after_s"] for row in rows for r in row["ranks"])
    return True, (f"a rank SIGKILLed mid-step (W={world}, default state and engine=collective): every other rank "
                  f"stopped {worst:.1f} s after at most (limit {limit:g} s), none hung"), res


def _recsys_run(args: argparse.Namespace, world: int, hook: str, params: Path) -> dict[str, Any]:
    out = Path(args.work)
    cmd = [sys.executable, str(ROOT / "examples" / "train_recsys.py"), "--backend", args.backend, "--device",
           args.device, "--hook", hook, "--steps", str(args.steps), "--optimizer", "sgd", "--warmup",
           str(min(5, args.steps - 1)), "--summary-json", str(out / f"recsys_W{world}_{hook}.json"),
           "--save-params", str(params / f"recsys_W{world}_{hook}.pt")]
    ranks = launch(cmd, world, out, env={}, name=f"recsys-W{world}-{hook}", timeout=args.launch_timeout,
                   nccl=args.backend == "nccl")
    summary = out / f"recsys_W{world}_{hook}.json"
    return {"rc": [r["rc"] for r in ranks], "summary": json.loads(summary.read_text()) if summary.is_file() else None}


def cmd_recsys(args: argparse.Namespace) -> tuple[bool, str, dict]:
    """examples/train_recsys.py, omnireduce_hook (its default state) against plain DDP, per world size."""
    import torch
    from gpu_compare_runs import compare_params

    from ombench.rankside import label_for

    rows, problems = [], []
    with tempfile.TemporaryDirectory(prefix="recsys-params-", dir=args.work) as params:
        for world in args.worlds:
            runs = {hook: _recsys_run(args, world, hook, Path(params)) for hook in ("omnireduce", "allreduce")}
            if any(r["summary"] is None or any(r["rc"]) for r in runs.values()):
                problems.append(f"W={world}: exit status {({h: r['rc'] for h, r in runs.items()})}")
                continue
            a, b = (torch.load(Path(params, f"recsys_W{world}_{h}.pt")) for h in ("omnireduce", "allreduce"))
            worst, bad = compare_params(a, b, args.rtol, 1e-6)
            o, d = runs["omnireduce"]["summary"], runs["allreduce"]["summary"]
            rows.append({"world": world, "omnireduce_ms": o["median_step_s"] * 1e3, "ddp_ms": d["median_step_s"] * 1e3,
                         "omnireduce_mb": o["mb_sent_per_step"], "ddp_mb": d["mb_sent_per_step"],
                         "speedup": d["median_step_s"] / o["median_step_s"], "largest_diff": worst, "differ": bad,
                         "paths": o.get("paths"), "buckets_sparse_dense": [o.get("buckets_sparse"),
                                                                           o.get("buckets_dense")]})
            if bad:
                problems.append(f"W={world}: {len(bad)} tensors differ beyond rtol {args.rtol:g} (largest {worst:.3g})")
    for r in rows:
        print(f"W={r['world']}: omnireduce {r['omnireduce_ms']:.1f} ms/step, {r['omnireduce_mb']:.2f} MB/step; "
              f"plain DDP {r['ddp_ms']:.1f} ms/step, {r['ddp_mb']:.2f} MB/step ({r['speedup']:.2f}x); parameters: "
              f"largest difference {r['largest_diff']:.3g}")
    label = label_for(args.backend, args.device)
    res = {"label": label, "steps": args.steps, "rows": rows, "problems": problems}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    return True, f"recommender, {args.steps} steps ({label}): " + "; ".join(
        f"W={r['world']} {r['omnireduce_ms']:.1f} vs {r['ddp_ms']:.1f} ms/step ({r['speedup']:.2f}x), parameters "
        f"equal (largest difference {r['largest_diff']:.2g})" for r in rows), res


def cmd_bench(args: argparse.Namespace) -> tuple[bool, str, dict]:
    """``omnireduce-bench`` per world size (``python -m omnireduce.bench``, the ranks started here; on NCCL
    every rank on the one GPU with a host of its own, ``--emulate-hosts``), one size (``--size-mib``) over
    the densities, per dtype, with ``--check``: its rows, and a verdict (every result agrees; the times
    are measured, never judged)."""
    from ombench.rankside import label_for

    rows, problems = [], []
    size = f"{int(args.size_mib * (1 << 20))}"
    for world in args.worlds:
        for dtype in args.dtypes:
            out = Path(tempfile.mkdtemp(prefix=f"bench-W{world}-", dir=args.work))
            cmd = [sys.executable, "-m", "omnireduce.bench", "--backend", args.backend, "-b", size, "-e", size,
                   "-d", ",".join(f"{d:g}" for d in args.densities), "--dtype", dtype, "-n", str(args.repeats),
                   "-w", str(args.warmup), "--check", "--timeout", str(args.pg_timeout), "--json",
                   str(out / "bench.json")] + (["--emulate-hosts"] if args.backend == "nccl" else [])
            ranks = launch(cmd, world, out, name=f"bench-W{world}-{dtype}", timeout=args.launch_timeout)
            result = out / "bench.json"
            if any(r["rc"] != 0 for r in ranks) or not result.is_file():
                problems.append(f"W={world} {dtype}: exit status {[r['rc'] for r in ranks]}")
                continue
            doc = json.loads(result.read_text())
            rows += doc["rows"]
            problems += [f"W={world} {dtype} d={r['density']:g}: {r['engine_wrong']} elements differ from "
                         "all_reduce's" for r in doc["rows"] if r.get("engine_wrong")]
    label = label_for(args.backend, args.device)
    res = {"label": label, "size_mib": args.size_mib, "rows": rows, "problems": problems}
    if problems:
        return False, f"{len(problems)} problem(s), first: {problems[0]}", res
    cells = [f"W={r['world']} {r['dtype']} d={r['density']:g} {r['engine_speedup']:.2f}x" for r in rows]
    return True, f"omnireduce-bench ({label}), {args.size_mib:g} MiB: " + ", ".join(cells), res


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_engine import add_engine_args
    from gpu_nccl_graphs import BUCKETS as GRAPH_BUCKETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["collectives", "parity", "hierarchy", "dies", "bench", "recsys", "profile",
                                        "engine", "fsdp", "graphs"])
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--worlds", type=_ints, default=[2, 4], help="world sizes")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="the process group's (and the hook's) timeout, s")
    ap.add_argument("--launch-timeout", type=float, default=150.0, help="seconds a job may run before it is killed")
    ap.add_argument("--margin", type=float, default=30.0, help="dies: seconds past the timeout a rank may take")
    ap.add_argument("--sizes", type=_ints, default=[1000, 1 << 22], help="collectives: elements per rank")
    ap.add_argument("--configs", type=lambda s: s.split(","), default=None, help="parity: only these configs")
    ap.add_argument("--size-mib", type=float, default=100.0, help="bench: tensor size")
    ap.add_argument("--densities", type=_floats, default=[0.001, 0.01, 0.1, 1.0], help="bench: densities")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"], help="bench: dtypes")
    ap.add_argument("--repeats", type=int, default=7, help="bench, profile: timed reductions")
    ap.add_argument("--warmup", type=int, default=2, help="bench: untimed reductions first")
    ap.add_argument("--steps", type=int, default=20, help="recsys: training steps")
    ap.add_argument("--rtol", type=float, default=1e-5, help="recsys: parameters' relative tolerance")
    ap.add_argument("--profile-mib", type=_floats, default=[1.0, 100.0], help="profile: bucket sizes")
    ap.add_argument("--profile-densities", type=_floats, default=[0.01], help="profile: densities")
    ap.add_argument("--trace-dir", default=None, help="profile: copy rank 0's chrome traces here")
    ap.add_argument("--graph-buckets", default=GRAPH_BUCKETS,
                    help="graphs: elements:density,... ('one': a single non-zero block)")
    add_engine_args(ap, prefix="engine-")  # engine: --engine-sizes, --engine-densities, --exchanges, --dtype
    return ap.parse_args(argv)


def _gpu_name(device: str) -> str | None:
    """The GPU's name (every number goes with it), or None on the host."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:  # one rank of a job: rank CASE OUT_DIR ARGS_JSON
        from gpu_nccl_ranks import rank_main

        rank_main(argv[1], argv[2], json.loads(argv[3]))
        return 0
    if argv[:1] == ["variant-env"]:
        return cmd_variant_env(argv[1])
    args = parse_args(argv)
    if args.backend == "nccl":
        from gpu_common import require_cuda

        require_cuda(f"the NCCL check ({args.command})")
    from bench_engine import cmd_engine
    from gpu_nccl_graphs import cmd_graphs
    from gpu_nccl_profile import cmd_profile

    commands = {"collectives": cmd_collectives, "parity": cmd_parity, "hierarchy": cmd_hierarchy, "dies": cmd_dies,
                "recsys": cmd_recsys, "bench": cmd_bench,
                "profile": lambda a: cmd_profile(a, run_case), "engine": lambda a: cmd_engine(a, run_case),
                "fsdp": cmd_fsdp, "graphs": lambda a: cmd_graphs(a, run_case)}
    with tempfile.TemporaryDirectory(prefix="gpu_nccl_check-") as tmp:
        args.work = args.work or tmp
        ok, line, res = commands[args.command](args)
    res = dict(res, command=args.command, backend=args.backend, device=args.device, gpu=_gpu_name(args.device),
               passed=ok, result=line,
               nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})  # (the variant 6.1 chose)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"RESULT: {line}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
