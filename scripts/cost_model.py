#!/usr/bin/env python3
"""Fit, validate and use the all-reduce cost model of ``ombench.costmodel``.

The model (read its module docstring) turns bytes, messages and CPU costs into the time of one
all-reduce, for omnireduce with dedicated aggregators, with colocated ones, and for a ring. Its CPU
parameters are fitted from ``scripts/bench_allreduce.py`` JSON files measured on this machine (one
set for loopback runs, one for the emulated network, sharing the per-op and per-message costs);
then it is checked against those measurements and used to predict clusters we do not have.

Subcommands
-----------
``calibrate``: the calibration runs of bench_allreduce, one after the other (never in parallel),
into ``--out`` (default ``results/cost_model/``): loopback W = 2, 4, 8 with one aggregator
(100 MiB), three small loopback runs whose tensors have 4, 16 and 64 slots (so that the cost per
message can be told from the cost per all-reduce), W = 4 on emulated 1 and 10 Gbit/s links
(25 MiB; omnireduce with one aggregator, colocated aggregators, Gloo; needs root, skipped
otherwise), and the 1 Gbit/s run again with 64 KiB socket buffers (``--socket-buffer 65536``: fewer
incast losses at the aggregator's port). Before each run it waits (up to ``--max-wait`` seconds)
until other processes keep fewer than ``--quiet-cores`` cores busy, and it records how much CPU
other processes used during the run (``/proc/stat`` busy time minus the run's own processes and
minus interrupts, softirqs and ksoftirqd: the network stack's work for the run) in
``calibration.json`` next to the results: validation then gives each run the cores that were left
to it (``--cores auto``, the default).

``fit FILES``: fits the parameters from bench_allreduce JSON files (other JSON files are skipped),
prints them and how well they reproduce the CPU columns, and writes ``params.json``.

``validate FILES``: predicts every omnireduce, colocated and Gloo row of the files and prints the
predicted and measured median times and their ratio (target: within 25%). ``--cross``: each file is
also predicted with parameters fitted on the other files only. ``--params``: validate given
parameters instead of fitting the files (an out-of-sample check).

``predict``: 100 MiB of fp32 at 25 and 100 Gbit/s for W = 8, 16, 64: dedicated aggregators (A = W/2
and A = W) and colocated aggregators, one core per process, against a ring at its bandwidth floor
(and, for reference, a ring paying Gloo's fitted CPU costs), over densities 1 to 0.001 (random block
placement); prints a table and the density from which omnireduce stops paying off per
configuration (with each fitted path's CPU costs and with no CPU cost at all), and writes
``predictions.json`` and ``predictions.png`` (with ``--docs``, copied into ``docs/bench/cost_model/``
with ``params.json`` and ``validation.json``).

``all FILES``: fit, validate (in-sample and leave one file out) and predict.

``hierarchy``: nodes of ``--gpus`` GPUs (default 8) on NVLink (``--nvlink-gbyte-s`` per GPU and
direction, default 300) with one NIC per GPU at 100 and 400 Gbit/s, 2 to 64 nodes, 100 MiB of fp32:
hierarchical omnireduce (``omnireduce.engines.hierarchy``'s three steps) and flat omnireduce against the
hierarchical ring at its floor, per-GPU densities 0.5 to 0.001, independent and overlapping block
placement, two deployments of the aggregators (``ombench.hiercost``); prints the times and the
density from which each scheme stops paying off, writes ``hierarchy.json`` and ``hierarchy.png``
(with ``--docs``, also into ``docs/bench/cost_model/``); ``--markdown`` prints the documented tables.

``collective``: PREDICTION of the collective engine (``omnireduce.engines.collective``) on GPUs over NCCL
against NCCL's ring all-reduce (``ombench.collcost``, whose docstring gives the formulas): a 100 MiB
fp32 bucket, 8 and 64 GPUs each with its own NIC at 100 and 400 Gbit/s. Inputs: the engine's host
work per bucket MEASURED (``--measured FILE``: a ``gpu_nccl_check.py profile`` JSON, a
``bench_engine.py``/``gpu_nccl_check.py engine`` JSON or an ``omnireduce-bench --json`` file; default the
H200 profile under ``docs/bench/gpu_nccl/``), NCCL's published small-message latencies (its ``tuning.cc``
tables, ``--fabric``; or a measured latency unit, ``--unit-us``: omnireduce-bench's ``unit`` column on
the user's cluster), NCCL's achieved fraction of line rate ``--nccl-fraction`` (0.94) and the H200 kernel
rates. Prints the latencies, the times per density with the engine's plan, and the crossover density
per setting with the measured host work and with ``--hosts-us`` (300 and 100 us); writes
``collective_measured.json`` (with ``--docs``, also into ``docs/bench/cost_model/``).

``host``: PREDICTION of the same model for DDP's 25 MiB buckets and 100 MiB ones (``--sizes-mib``), 8 and
64 GPUs at 100 and 400 Gbit/s: the crossover density per host time per bucket (``ombench.hostcost``),
with the host time MEASURED at W=1 (``--measured FILE``: default the W=1 rows of the H200 engine run
under ``docs/bench/gpu_nccl/``; a ``gpu_nccl_check.py graphs`` JSON gives the uncaptured and the CUDA
graphs' host times both; ``--host-us US`` a number measured elsewhere) and at the targets (300 us
uncaptured, 100 us with CUDA graphs). Writes ``collective_host.json``; with ``--docs`` into
``docs/bench/cost_model/`` too, and the docs' tables are regenerated (``bench_tables.py``).

``markdown [FOLDER]``: the tables of the cost model section of docs/log/2026-11-23-memory-cost-model-cpu.md (parameters,
validation, predictions, crossovers) from the outputs in FOLDER (default ``docs/bench/cost_model``).

Usage
-----
    sudo .venv/bin/python scripts/cost_model.py calibrate --out results/cost_model/run4   # ~15 min
    .venv/bin/python scripts/cost_model.py fit results/cost_model/run4/*.json
    .venv/bin/python scripts/cost_model.py validate results/cost_model/run4/*.json --cross
    .venv/bin/python scripts/cost_model.py validate --params results/cost_model/params.json other_run/*.json
    .venv/bin/python scripts/cost_model.py predict --params results/cost_model/params.json
    .venv/bin/python scripts/cost_model.py all docs/bench/cost_model/*.json --docs    # the documented tables
    .venv/bin/python scripts/cost_model.py hierarchy --params docs/bench/cost_model/params.json --docs --markdown
    .venv/bin/python scripts/cost_model.py collective --docs
    .venv/bin/python scripts/cost_model.py host --docs
    .venv/bin/python scripts/cost_model.py host --measured results/gpu/logs/nccl_graphs.json --docs  # after a GPU run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ombench import collcost, hierpredict, hostcost  # noqa: E402
from ombench import costmodel as cm  # noqa: E402
from omnireduce.engines.plan import DEFAULT_LATENCY_BYTES  # noqa: E402

OUT = ROOT / "results" / "cost_model"
DOCS = ROOT / "docs" / "bench" / "cost_model"
BENCH = ROOT / "scripts" / "bench_allreduce.py"
DEFAULT_MEASURED = ROOT / "docs" / "bench" / "gpu_nccl" / "h200_3fb61be" / "nccl_profile.json"
"""The engine's profile on an H200 (NCCL sockets on loopback, under torch.profiler), relative to the checkout."""
DEFAULT_HOST_MEASURED = ROOT / "docs" / "bench" / "gpu_nccl" / "h200_2b5f2cb" / "nccl_engine.json"
"""The engine's cost on an H200 at W=1, 2 and 4 (its W=1 rows: the host time per bucket with no transport)."""

# name -> bench_allreduce arguments
LOOPBACK = ["--loopback", "--aggregators", "1", "--densities", "1,0.4,0.1,0.04,0.01", "--methods", "omnireduce,gloo",
            "--iters", "5", "--warmup", "1"]
SLOTS = ["--loopback", "--workers", "4", "--aggregators", "1", "--size-mib", "4", "--densities", "1,0.1,0.01",
         "--methods", "omnireduce", "--iters", "10", "--warmup", "2"]
NET = ["--workers", "4", "--aggregators", "1", "--size-mib", "25", "--densities", "1,0.4,0.1,0.04,0.01",
       "--methods", "omnireduce,colocated,gloo", "--iters", "5", "--warmup", "1"]
CALIBRATION: dict[str, list[str]] = {
    "loopback_W4": [*LOOPBACK, "--workers", "4"],
    "loopback_W2": [*LOOPBACK, "--workers", "2"],
    "loopback_W8": [*LOOPBACK, "--workers", "8"],
    "slots4_W4": SLOTS,
    "slots16_W4": [*SLOTS, "--lanes", "256", "--slots", "16"],
    "slots64_W4": [*SLOTS, "--lanes", "64", "--slots", "64"],
    "1gbit_W4": ["--net", "1gbit", *NET],
    "10gbit_W4": ["--net", "10gbit", *NET],
    "1gbit_W4_buf64k": ["--net", "1gbit", *NET, "--socket-buffer", "65536"],
}

# predictions
SIZE_MIB = 100
BLOCK = 256
RATES_GBIT = (25, 100)
WORLDS = (8, 16, 64)
DENSITIES = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)
CONFIGS = ("A=W/2", "A=W", "colocated")


# --------------------------------------------------------------------------------------------
# calibration runs


def _busy_jiffies() -> int:
    """Clock ticks the machine's cores were busy (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


def _kernel_net_jiffies() -> int:
    """Clock ticks spent in interrupts, softirqs and the ksoftirqd threads: mostly the network stack
    (loopback and the emulated links), work of the benchmark that is charged to no process of it."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    total = fields[5] + fields[6]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "(ksoftirqd/" in stat:
            rest = stat.rsplit(")", 1)[1].split()
            total += int(rest[11]) + int(rest[12])
    return total


def _busy_cores(seconds: float) -> float:
    """Cores busy on this machine over the next ``seconds`` (from /proc/stat)."""
    b0 = _busy_jiffies()
    time.sleep(seconds)
    return (_busy_jiffies() - b0) / os.sysconf("SC_CLK_TCK") / seconds


def run_calibration(names: Sequence[str], out: Path, quiet_cores: float, max_wait: float) -> None:
    """Run the calibration benchmarks one after the other, recording the CPU others used meanwhile."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "calibration.json"
    log: dict[str, Any] = json.loads(log_path.read_text()) if log_path.exists() else {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in names:
        args = CALIBRATION[name]
        if "--net" in args and os.geteuid() != 0:
            print(f"{name}: skipped (emulated networks need root)")
            continue
        waited, busy_now = 0.0, _busy_cores(5.0)
        while busy_now > quiet_cores and waited < max_wait:
            waited += 5.0
            busy_now = _busy_cores(5.0)
        json_path = out / f"{name}.json"
        cmd = [sys.executable, str(BENCH), *args, "--json", str(json_path)]
        print(f"=== {name} (waited {waited:.0f} s; other processes busy {busy_now:.2f} cores): "
              f"{' '.join(cmd[1:])}", flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, net0, t0, load0 = _busy_jiffies(), _kernel_net_jiffies(), time.monotonic(), os.getloadavg()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        elapsed = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy = (_busy_jiffies() - busy0) / tick
        net = (_kernel_net_jiffies() - net0) / tick
        own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        others = max(0.0, busy - own - net) / elapsed
        log[name] = {"command": cmd[1:], "rc": rc, "elapsed_s": round(elapsed, 1),
                     "busy_cores": round(busy / elapsed, 3),
                     "own_cores": round(own / elapsed, 3), "kernel_net_cores": round(net / elapsed, 3),
                     "other_cores": round(others, 3),
                     "busy_cores_before": round(busy_now, 3), "waited_s": waited,
                     "loadavg_start": load0, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(),
                     "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        log_path.write_text(json.dumps(log, indent=1))
        print(f"=== {name}: rc {rc}, {elapsed:.0f} s, others used {others:.2f} of {os.cpu_count()} cores", flush=True)


# --------------------------------------------------------------------------------------------
# reading measurements


def load_runs(paths: Sequence[str]) -> list[tuple[Path, dict[str, Any], list[cm.Observation]]]:
    """(path, meta, observations) of every bench_allreduce JSON among ``paths`` (others are skipped)."""
    runs = []
    for p in map(Path, paths):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or "rows" not in d or "workers" not in d.get("meta", {}):
            continue
        obs = [o for r in d["rows"] if (o := cm.observation(r, d["meta"])) is not None]
        if obs:
            runs.append((p, d["meta"], obs))
    return runs


Params = dict[str, cm.CostParams]  # path (loopback, network) -> parameters
Runs = Sequence[tuple[Path, dict[str, Any], list[cm.Observation]]]


def print_params(params: Params) -> None:
    print("fitted CPU parameters (MB = 10^6 bytes; per-op and per-message costs fitted on loopback, shared):")
    for path, p in params.items():
        r, a, g = p.rank, p.aggregator, p.ring
        print(f" {path}:")
        print(f"  rank:       {r.per_op_s * 1e3:7.3f} ms/op  {r.per_message_s * 1e6:7.1f} us/message  "
              f"{r.per_mb_sent_s * 1e3:6.3f} ms/MB sent  {r.per_mb_received_s * 1e3:6.3f} ms/MB received  "
              f"scan {r.scan_per_mb_s * 1e3:6.3f} ms/MB of tensor")
        print(f"  aggregator: {a.per_op_s * 1e3:7.3f} ms/op  {a.per_message_s * 1e6:7.1f} us/message  "
              f"{a.per_mb_received_s * 1e3:6.3f} ms/MB received+summed  {a.per_mb_sent_s * 1e3:6.3f} ms/MB sent")
        print(f"  ring:       {g.per_op_s * 1e3:7.3f} ms/op  {g.per_mb_s * 1e3:6.3f} ms/MB sent per rank")


def params_for(params: Params, o: cm.Observation) -> cm.CostParams:
    """The parameters of the row's path (the other path's if that one was not fitted)."""
    return params.get(cm.path_of(o)) or next(iter(params.values()))


def cpu_residuals(runs: Runs, params: Params) -> None:
    """How well the fitted CPU parameters reproduce the CPU columns (model / measured over the rows)."""
    ratios: dict[str, list[float]] = {}
    for _, _, obs in runs:
        for o in obs:
            ranks, aggs = cm.observation_cpu(o, params_for(params, o))
            key = f"{cm.path_of(o)} {'ring' if o.method == 'gloo' else 'rank'}"
            ratios.setdefault(key, []).append(ranks / o.rank_cpu_s)
            if o.method != "gloo" and o.agg_cpu_s > 0:
                ratios.setdefault(f"{cm.path_of(o)} aggregator", []).append(aggs / o.agg_cpu_s)
    for k, v in sorted(ratios.items()):
        a = np.array(v)
        print(f"  CPU {k:<19} model/measured over {a.size:3d} rows: median {np.median(a):.2f}, "
              f"range {a.min():.2f}-{a.max():.2f}")


def load_params(path: Path) -> Params:
    return {k: cm.CostParams.from_dict(v) for k, v in json.loads(path.read_text())["params"].items()}


def do_fit(runs: Runs, out: Path) -> Params:
    obs = [o for _, _, os_ in runs for o in os_]
    params = cm.fit_paths(obs)
    print(f"fitted from {len(obs)} rows of {len(runs)} files: {', '.join(str(r[0].name) for r in runs)}")
    print_params(params)
    cpu_residuals(runs, params)
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.json").write_text(json.dumps({"params": {k: p.to_dict() for k, p in params.items()},
                                                 "files": [str(r[0]) for r in runs], "rows": len(obs)}, indent=1))
    return params


# --------------------------------------------------------------------------------------------
# validation


def run_cores(path: Path, cores: str, log: dict[str, Any]) -> float:
    """Cores the run had: a number, or ``auto``: this machine's minus what other processes used
    during the run (from calibration.json; all of them when the run is not there)."""
    total = float(os.cpu_count() or 1)
    if cores != "auto":
        return float(cores)
    rec = log.get(path.stem)
    if rec and rec.get("other_cores") is not None:
        return max(0.25, total - float(rec["other_cores"]))
    return total


def validate(runs: Runs, params: dict[Path, Params], cores: str, latency_s: float,
             seed: int) -> list[dict[str, Any]]:
    """Predict every row; print predicted against measured; return the rows."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    logs: dict[Path, dict[str, Any]] = {}
    print(f"{'run':<14} {'W':>2} {'A':>2} {'method':<11} {'density':>7} {'cores':>5} {'measured ms':>11} "
          f"{'predicted ms':>12} {'pred/meas':>9}  bound")
    for path, meta, obs in runs:
        log_path = path.parent / "calibration.json"
        if log_path not in logs:
            logs[log_path] = json.loads(log_path.read_text()) if log_path.exists() else {}
        c = run_cores(path, cores, logs[log_path])
        for o in obs:
            pr = cm.predict_observation(o, params_for(params[path], o), c, latency_s, rng)
            ratio = pr.time_s / o.measured_s
            row = {"run": path.stem, "net": meta["net"], "size_mib": meta["size_mib"], "workers": o.workers,
                   "aggregators": o.aggregators, "method": o.method, "density": o.density, "cores": c,
                   "measured_s": o.measured_s, "predicted_s": pr.time_s, "ratio": ratio, "bound": pr.bound,
                   "terms_s": {k: float(v) for k, v in pr.terms.items()}, "within_25pct": bool(abs(ratio - 1) <= 0.25)}
            out.append(row)
            print(f"{path.stem:<14} {o.workers:>2} {o.aggregators or '-':>2} {o.method:<11} {o.density:>7g} {c:>5.2f} "
                  f"{o.measured_s * 1e3:>11.1f} {pr.time_s * 1e3:>12.1f} {ratio:>9.2f}  {pr.bound}"
                  f"{'' if row['within_25pct'] else '   <-- off by more than 25%'}")
    n_ok = sum(r["within_25pct"] for r in out)
    print(f"within 25%: {n_ok} of {len(out)} rows")
    for m in ("omnireduce", "colocated", "gloo"):
        mine = [r for r in out if r["method"] == m]
        if mine:
            rs = np.array([r["ratio"] for r in mine])
            print(f"  {m:<11} {sum(r['within_25pct'] for r in mine):3d} of {len(mine):3d} within 25%, "
                  f"pred/meas median {np.median(rs):.2f} (range {rs.min():.2f}-{rs.max():.2f})")
    return out


# --------------------------------------------------------------------------------------------
# predictions


def _crossing(fine: Sequence[float], ts: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """Where ``ts`` stops being below ``ref`` (see :func:`ombench.costmodel.crossover_density`)."""
    faster = [t < r for t, r in zip(ts, ref, strict=True)]
    return {"density": cm.crossover_density(fine, ts, ref), "always": all(faster), "never": not any(faster)}


def predict(params: Params, primary: str, latency_s: float, seed: int, grid: int) -> dict[str, Any]:
    """Predicted times of every configuration over the densities (and a finer grid for the crossovers).

    ``primary``: the path whose CPU costs the tables use; the crossovers are also computed with
    every other fitted path's. References: the ring at its bandwidth floor (the comparison asked for),
    and a ring whose ranks pay Gloo's fitted CPU costs on a core each (like against like: this
    machine's software on both sides). ``wire only``: omnireduce with no CPU cost, what the protocol
    allows on these links."""
    numel = SIZE_MIB * (1 << 20) // 4
    nb = -(-numel // BLOCK)
    nbytes = numel * 4.0
    fine = sorted(set(np.geomspace(1.0, 1e-3, grid).round(6).tolist()) | set(DENSITIES), reverse=True)
    rng = np.random.default_rng(seed)
    results: list[dict[str, Any]] = []
    crossovers: list[dict[str, Any]] = []
    p = params[primary]
    for W in WORLDS:
        per: dict[tuple[str, int, str], list[float]] = {}  # (path or "wire", rate, config) -> over fine
        for d in fine:
            masks = cm.random_masks(W, nb, d, rng)
            for cfg in CONFIGS:
                A = W // 2 if cfg == "A=W/2" else W
                t = cm.omnireduce_traffic(masks, numel, BLOCK, A, colocated=cfg == "colocated")
                for rate in RATES_GBIT:
                    m = cm.Machine(rate_bytes_s=rate * 1e9 / 8, latency_s=latency_s, cores=None)
                    for path, q in params.items():
                        per.setdefault((path, rate, cfg), []).append(cm.omnireduce_time(t, q, m).time_s)
                    per.setdefault(("wire", rate, cfg), []).append(cm.omnireduce_time(t, cm.CostParams(), m).time_s)
                    if d in DENSITIES:
                        pr = cm.omnireduce_time(t, p, m)
                        results.append({"workers": W, "rate_gbit": rate, "config": cfg, "aggregators": t.aggregators,
                                        "density": d, "union": float(masks.any(axis=0).mean()),
                                        "predicted_s": pr.time_s, "bound": pr.bound, "terms_s": pr.terms,
                                        "wire_only_s": per[("wire", rate, cfg)][-1],
                                        "by_path_s": {k: per[(k, rate, cfg)][-1] for k in params}})
        for rate in RATES_GBIT:
            m = cm.Machine(rate_bytes_s=rate * 1e9 / 8, latency_s=latency_s, cores=None)
            ring = cm.ring_floor(nbytes, W, m.rate_bytes_s)
            gloo = cm.ring_time(nbytes, W, p, m)
            for d in DENSITIES:
                results.append({"workers": W, "rate_gbit": rate, "config": "ring floor", "aggregators": 0,
                                "density": d, "predicted_s": ring, "bound": "link",
                                "ring_latency_s": 2 * (W - 1) * latency_s})
                results.append({"workers": W, "rate_gbit": rate, "config": "ring, Gloo CPU", "aggregators": 0,
                                "density": d, "predicted_s": gloo.time_s, "bound": gloo.bound, "terms_s": gloo.terms})
            n = len(fine)
            for cfg in CONFIGS:
                c: dict[str, Any] = {"workers": W, "rate_gbit": rate, "config": cfg}
                for path in params:
                    c[f"vs_ring_floor ({path} CPU)"] = _crossing(fine, per[(path, rate, cfg)], [ring] * n)
                c["wire_only_vs_ring_floor"] = _crossing(fine, per[("wire", rate, cfg)], [ring] * n)
                c[f"vs_ring_gloo_cpu ({primary} CPU)"] = _crossing(fine, per[(primary, rate, cfg)], [gloo.time_s] * n)
                crossovers.append(c)
    return {"meta": {"kind": "PREDICTION (cost model, not a measurement)", "size_mib": SIZE_MIB, "block": BLOCK,
                     "numel": numel, "latency_s": latency_s, "cores": "one per process", "seed": seed,
                     "cpu_path": primary, "placement": "random (each rank int(blocks * d) blocks, independently)",
                     "ring floor": "2 (W-1)/W N / R", "ring, Gloo CPU": "max(fitted Gloo CPU per rank, ring floor) "
                     "+ 2 (W-1) latency", "crossover": "density above which omnireduce is slower (fine grid of "
                     f"{len(fine)} densities, log-log interpolation)",
                     "params": {k: q.to_dict() for k, q in params.items()},
                     "time": time.strftime("%Y-%m-%d %H:%M:%S")},
            "rows": results, "crossovers": crossovers}


def crossover_text(c: dict[str, Any]) -> str:
    """A crossover for the tables: the density, or whether omnireduce is faster everywhere or nowhere."""
    if c["density"] is not None:
        return f"{c['density']:.3f}" if c["density"] > 0.95 else f"{c['density']:.2g}"
    return "all" if c["always"] else "none"


def print_predictions(res: dict[str, Any]) -> None:
    rows = res["rows"]
    print(f"\nPREDICTION (cost model, not measured): all-reduce of {SIZE_MIB} MiB fp32, ms; omnireduce with the "
          f"fitted CPU costs, one core per process; ring at its bandwidth floor, and with Gloo's fitted CPU costs")
    head = " ".join(f"{d:>7g}" for d in DENSITIES)
    for rate in RATES_GBIT:
        print(f"\n{rate} Gbit/s          density: {head}")
        for W in WORLDS:
            for cfg in ("ring floor", "ring, Gloo CPU", *CONFIGS):
                mine = {r["density"]: r for r in rows if r["workers"] == W and r["rate_gbit"] == rate
                        and r["config"] == cfg}
                cells = " ".join(f"{mine[d]['predicted_s'] * 1e3:>7.2f}" for d in DENSITIES)
                label = f"W={W:<2} {cfg}"
                print(f"  {label:<24} {cells}")
    print("\ncrossover: the density above which omnireduce is slower (interpolated on a fine grid); all: faster at "
          "every density down from 1; none: slower at every density down to 0.001")
    keys = [k for k in res["crossovers"][0] if k not in ("workers", "rate_gbit", "config")]
    print(f"  {'':<26} " + " ".join(f"{k:>28}" for k in keys))
    for c in res["crossovers"]:
        label = f"{c['rate_gbit']:>3} Gbit/s W={c['workers']:<2} {c['config']}"
        print(f"  {label:<26} " + " ".join(f"{crossover_text(c[k]):>28}" for k in keys))


def plot_predictions(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, axes = plt.subplots(len(RATES_GBIT), len(WORLDS), figsize=(13, 8), sharex=True)
    colors = {"A=W/2": "tab:blue", "A=W": "tab:orange", "colocated": "tab:green"}
    markers, sizes = {"A=W/2": "o", "A=W": "s", "colocated": "^"}, {"A=W/2": 3, "A=W": 6, "colocated": 3}
    for i, rate in enumerate(RATES_GBIT):
        for j, W in enumerate(WORLDS):
            ax = axes[i][j]
            for cfg in CONFIGS:
                mine = sorted((r for r in rows if r["workers"] == W and r["rate_gbit"] == rate and r["config"] == cfg),
                              key=lambda r: r["density"])
                xs = [r["density"] for r in mine]
                ax.plot(xs, [r["predicted_s"] * 1e3 for r in mine], marker=markers[cfg], ms=sizes[cfg],
                        color=colors[cfg], label=f"omnireduce {cfg}", alpha=0.85)
                ax.plot(xs, [r["wire_only_s"] * 1e3 for r in mine], linestyle=":", color=colors[cfg], alpha=0.7,
                        label=f"{cfg}, wire only (no CPU)" if (i, j) == (0, 0) else None)
            ring = next(r["predicted_s"] for r in rows if r["workers"] == W and r["rate_gbit"] == rate
                        and r["config"] == "ring floor")
            ax.axhline(ring * 1e3, color="black", linestyle="--", label="ring, bandwidth floor")
            gloo = next(r["predicted_s"] for r in rows if r["workers"] == W and r["rate_gbit"] == rate
                        and r["config"] == "ring, Gloo CPU")
            ax.axhline(gloo * 1e3, color="grey", linestyle="-.", label="ring, Gloo's CPU costs")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"W={W}, {rate} Gbit/s", fontsize=9)
            if i == len(RATES_GBIT) - 1:
                ax.set_xlabel("density (non-zero blocks per rank)")
            if j == 0:
                ax.set_ylabel("ms per all-reduce")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"PREDICTION (cost model fitted on a 2-core VM, not measured): {SIZE_MIB} MiB fp32 all-reduce, "
                 f"one core per process, CPU costs of the {res['meta']['cpu_path']} path", fontsize=11,
                 color="darkred")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(folder: Path) -> str:
    """The tables of the cost model section of docs/log/2026-11-23-memory-cost-model-cpu.md, from
    ``params.json``, ``validation.json`` and ``predictions.json`` in ``folder``."""
    params = load_params(folder / "params.json")
    val = json.loads((folder / "validation.json").read_text())
    pred = json.loads((folder / "predictions.json").read_text())
    out = ["| path | process | per op | per message | per MB sent | per MB received | scan per MB |",
           "|---|---|---|---|---|---|---|"]
    for path, p in params.items():
        r, a, g = p.rank, p.aggregator, p.ring
        out.append(f"| {path} | rank | {r.per_op_s * 1e3:.2f} ms | {r.per_message_s * 1e6:.0f} us | "
                   f"{r.per_mb_sent_s * 1e3:.3f} ms | {r.per_mb_received_s * 1e3:.3f} ms | "
                   f"{r.scan_per_mb_s * 1e3:.3f} ms |")
        out.append(f"| {path} | aggregator | {a.per_op_s * 1e3:.2f} ms | {a.per_message_s * 1e6:.0f} us | "
                   f"{a.per_mb_sent_s * 1e3:.3f} ms | {a.per_mb_received_s * 1e3:.3f} ms (and summed) | - |")
        out.append(f"| {path} | ring rank (Gloo) | {g.per_op_s * 1e3:.2f} ms | - | {g.per_mb_s * 1e3:.3f} ms "
                   "(received and reduced included) | - | - |")
    out += ["", "| run | W | A | method | density | cores | measured ms | predicted ms | pred/meas | "
            "leave-one-file-out pred/meas | bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    cross = {(r["run"], r["method"], r["density"]): r for r in val.get("leave_one_file_out", [])}
    for r in val["in_sample"]:
        c = cross.get((r["run"], r["method"], r["density"]))
        flag = "" if r["within_25pct"] else " **x**"
        lofo = "-" if c is None else f"{c['ratio']:.2f}" + ("" if c["within_25pct"] else " **x**")
        out.append(f"| {r['run']} | {r['workers']} | {r['aggregators'] or '-'} | {r['method']} | {r['density']:g} | "
                   f"{r['cores']:.2f} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                   f"{r['ratio']:.2f}{flag} | {lofo} | {r['bound']} |")
    out += ["", "| link | W | configuration | " + " | ".join(f"{d:g}" for d in DENSITIES) + " |",
            "|---|---|---|" + "---|" * len(DENSITIES)]
    rows = pred["rows"]
    for rate in RATES_GBIT:
        for W in WORLDS:
            for cfg in ("ring floor", "ring, Gloo CPU", *CONFIGS):
                mine = {r["density"]: r for r in rows if r["workers"] == W and r["rate_gbit"] == rate
                        and r["config"] == cfg}
                out.append(f"| {rate} Gbit/s | {W} | {cfg} | "
                           + " | ".join(f"{mine[d]['predicted_s'] * 1e3:.1f}" for d in DENSITIES) + " |")
    keys = [k for k in pred["crossovers"][0] if k not in ("workers", "rate_gbit", "config")]
    out += ["", "| link | W | configuration | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for c in pred["crossovers"]:
        out.append(f"| {c['rate_gbit']} Gbit/s | {c['workers']} | {c['config']} | "
                   + " | ".join(crossover_text(c[k]) for k in keys) + " |")
    return "\n".join(out)


def run_hierarchy(args: argparse.Namespace) -> None:
    """The ``hierarchy`` subcommand: sweep, print, save (see the module docstring)."""
    params = load_params(args.params)
    if args.path not in params:
        raise SystemExit(f"--path {args.path}: no such parameters in {args.params} (have {', '.join(params)})")
    setting = hierpredict.Setting(size_mib=args.size_mib, gpus=args.gpus, nvlink_gbyte_s=args.nvlink_gbyte_s,
                                  latency_s=args.latency_us * 1e-6, grid=args.grid, lanes=args.lanes)
    res = hierpredict.sweep(params, args.path, setting)
    res["meta"]["params_file"] = str(args.params)
    print(hierpredict.text_tables(res))
    folders = [args.out] + ([DOCS] if args.docs else [])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hierarchy.json").write_text(hierpredict.to_json(res))
        hierpredict.plot(res, folder / "hierarchy.png")
        print(f"wrote {folder / 'hierarchy.json'} and {folder / 'hierarchy.png'}")
    if args.markdown:
        print()
        print(hierpredict.markdown(res))


def run_collective(args: argparse.Namespace) -> None:
    """The ``collective`` subcommand: sweep, print, save (PREDICTION; see the module docstring)."""
    fabric = collcost.FABRICS[args.fabric]
    if args.unit_us is not None:  # the user's own latency unit for every collective (omnireduce-bench's unit)
        fabric = dataclasses.replace(fabric, unit_us=args.unit_us)
    nccl = collcost.NcclParams(fraction=args.nccl_fraction, fabric=fabric, a2a_fraction=args.a2a_fraction)
    gpu = collcost.GpuRates(flags=args.flags_tb_s * 1e12, compact=args.compact_tb_s * 1e12,
                            scatter=args.scatter_tb_s * 1e12)
    path = args.measured.resolve()
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    measured = collcost.load_measured(path, shown=shown)
    res = collcost.sweep(args.size_mib, args.workers, args.rates_gbit, args.densities, nccl, gpu, measured,
                         args.hosts_us, block_bytes=args.block * 4, latency_bytes=args.latency_bytes)
    res["meta"]["rerun"] = "python scripts/cost_model.py collective" + (
        f" --measured {shown}" if path != DEFAULT_MEASURED else "") + (
        f" --unit-us {args.unit_us:g}" if args.unit_us is not None else "")
    print(collcost.text(res))
    for folder in [args.out] + ([DOCS] if args.docs else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "collective_measured.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"{collcost.LABEL} | wrote {folder / 'collective_measured.json'}")


def run_host(args: argparse.Namespace) -> None:
    """The ``host`` subcommand: the crossovers per host time, printed and saved (PREDICTION)."""
    nccl = collcost.NcclParams(fraction=args.nccl_fraction, fabric=collcost.FABRICS[args.fabric],
                               a2a_fraction=args.a2a_fraction)
    gpu = collcost.GpuRates(flags=args.flags_tb_s * 1e12, compact=args.compact_tb_s * 1e12,
                            scatter=args.scatter_tb_s * 1e12)
    if args.host_us is not None:
        measured = collcost.Measured(args.host_us, args.host_source, "given", "given on the command line (--host-us)")
        rerun = f"python scripts/cost_model.py host --host-us {args.host_us:g}"
    else:
        path = args.measured.resolve()
        shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        measured = collcost.load_measured(path, shown=shown, world=args.world)
        rerun = "python scripts/cost_model.py host" + (f" --measured {shown}" if path != DEFAULT_HOST_MEASURED else "")
    targets = [(name, us) for name, us in zip(("target, uncaptured", "target, CUDA graphs"), args.targets_us,
                                               strict=False)]
    targets += [(f"{us:g} us", us) for us in args.targets_us[len(targets):]]
    res = hostcost.sweep(args.sizes_mib, args.workers, args.rates_gbit, nccl, gpu, measured, targets,
                         block_bytes=args.block * 4, latency_bytes=args.latency_bytes)
    res["meta"]["rerun"] = rerun
    print(hostcost.text(res))
    for folder in [args.out] + ([DOCS] if args.docs else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "collective_host.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"{collcost.LABEL} | wrote {folder / 'collective_host.json'}")
    if args.docs:
        import bench_tables  # (scripts/: this script's folder)

        bench_tables.main([])


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def _model_args(sp: argparse.ArgumentParser) -> None:
    """The options ``collective`` and ``host`` share: the cluster and NCCL's and the kernels' rates."""
    sp.add_argument("--block", type=int, default=BLOCK, help="elements per block (fp32)")
    sp.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")], default=[8, 64])
    sp.add_argument("--rates-gbit", type=_floats, default=[100.0, 400.0], help="NIC line rate per GPU")
    sp.add_argument("--nccl-fraction", type=float, default=0.94,
                    help="NCCL's achieved bytes/s over line rate, every collective (0.94 = 47 of 50 GB/s: published "
                         "nccl-tests all_reduce_perf busbw on 400 Gbit/s InfiniBand, ~46-48 GB/s per NIC)")
    sp.add_argument("--a2a-fraction", type=float, default=None,
                    help="NCCL all-to-all's fraction of line rate (default: --nccl-fraction; no published figure)")
    sp.add_argument("--fabric", choices=sorted(collcost.FABRICS), default="net",
                    help="whose NCCL latencies: net (each GPU a node with its own NIC) or nvlink (one node)")
    sp.add_argument("--unit-us", type=float, default=None,
                    help="a measured latency unit (omnireduce-bench's 'unit' column, us), taken as every collective's "
                         "small-message latency instead of NCCL's published model")
    sp.add_argument("--latency-bytes", type=float, default=DEFAULT_LATENCY_BYTES,
                    help="what the engine's choice counts one collective as, bytes (the engine's default)")
    sp.add_argument("--flags-tb-s", type=float, default=2.5, help="block flags kernel, TB/s (H200: ~2.5)")
    sp.add_argument("--compact-tb-s", type=float, default=1.1, help="compaction kernel, TB/s (H200: ~1.1-1.5)")
    sp.add_argument("--scatter-tb-s", type=float, default=2.9, help="scatter kernel, TB/s (H200: ~2.9 at 100 MiB)")
    sp.add_argument("--out", type=Path, default=OUT)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    cal = sub.add_parser("calibrate", help="run the calibration benchmarks, one after the other")
    cal.add_argument("--runs", default=",".join(CALIBRATION), help=f"subset of {','.join(CALIBRATION)}")
    cal.add_argument("--out", type=Path, default=OUT)
    cal.add_argument("--quiet-cores", type=float, default=0.3,
                     help="before each run, wait until other processes keep fewer cores than this busy (5 s samples)")
    cal.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for it at most, per run")
    mdp = sub.add_parser("markdown", help="print the documented tables from a folder of this script's outputs")
    mdp.add_argument("folder", type=Path, nargs="?", default=DOCS)
    for name in ("fit", "validate", "predict", "all"):
        sp = sub.add_parser(name)
        if name != "predict":
            sp.add_argument("files", nargs="+", help="bench_allreduce JSON files (others are skipped)")
        sp.add_argument("--out", type=Path, default=OUT)
        sp.add_argument("--seed", type=int, default=0)
        if name in ("validate", "all"):
            sp.add_argument("--cores", default="auto",
                            help="cores the measured runs had: a number, or auto (the machine's minus what other "
                                 "processes used during the run, from calibration.json next to the file)")
            sp.add_argument("--validation-latency-us", type=float, default=50.0,
                            help="one-way latency per message on this machine (loopback, veth), us")
            sp.add_argument("--params", type=Path, default=None,
                            help="params.json to validate (default: fit the files)")
            if name == "validate":
                sp.add_argument("--cross", action="store_true", help="predict each file with the others' fit")
        if name in ("predict", "all"):
            if name == "predict":
                sp.add_argument("--params", type=Path, default=OUT / "params.json")
            sp.add_argument("--latency-us", type=float, default=25.0,
                            help="one-way latency per message on the predicted clusters, us")
            sp.add_argument("--grid", type=int, default=31, help="densities of the fine grid for the crossovers")
            sp.add_argument("--path", choices=cm.PATHS, default="network",
                            help="whose CPU costs per MB the predicted clusters pay (default: the emulated "
                                 "network's; the crossovers are also given with the other path's)")
            sp.add_argument("--docs", action="store_true",
                            help="also copy the plot and the JSON files into docs/bench/cost_model/")
    hier = sub.add_parser("hierarchy", help="predict the hierarchy on nodes of several GPUs (PREDICTION)")
    hier.add_argument("--params", type=Path, default=DOCS / "params.json")
    hier.add_argument("--path", choices=cm.PATHS, default="network", help="whose CPU costs the time tables use")
    hier.add_argument("--gpus", type=int, default=8, help="GPUs (and NICs) per node")
    hier.add_argument("--nvlink-gbyte-s", type=float, default=300.0, help="NVLink GB/s per GPU and direction")
    hier.add_argument("--latency-us", type=float, default=25.0, help="one-way latency per message across nodes, us")
    hier.add_argument("--size-mib", type=float, default=100.0)
    hier.add_argument("--grid", type=int, default=31, help="densities of the fine grid for the crossovers")
    hier.add_argument("--lanes", type=int, default=cm.DEFAULT_LANES,
                      help="the Worker's lane limit (fewer lanes: more slots per tensor, up to max(4, A))")
    hier.add_argument("--out", type=Path, default=OUT)
    hier.add_argument("--docs", action="store_true",
                      help="also write hierarchy.json and hierarchy.png into docs/bench/cost_model/")
    hier.add_argument("--markdown", action="store_true", help="also print the tables of the cost model log (docs/log/)")
    col = sub.add_parser("collective", help="predict the collective engine on NCCL against the ring (PREDICTION)")
    col.add_argument("--size-mib", type=float, default=100.0)
    col.add_argument("--densities", type=_floats, default=[1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.001])
    col.add_argument("--hosts-us", type=_floats, default=[300.0, 100.0],
                     help="host work per bucket (us) the crossovers are also given at, besides the measured")
    col.add_argument("--measured", type=Path, default=DEFAULT_MEASURED,
                     help="the engine's measured host work: a gpu_nccl_check.py profile JSON or a bench_engine.py / "
                          "gpu_nccl_check.py engine JSON (default: %(default)s)")
    col.add_argument("--docs", action="store_true",
                     help="also write collective_measured.json into docs/bench/cost_model/")
    _model_args(col)
    host = sub.add_parser("host", help="the crossovers per host time per bucket, 25 and 100 MiB (PREDICTION)")
    host.add_argument("--sizes-mib", type=_floats, default=[25.0, 100.0], help="bucket sizes (DDP's default: 25)")
    host.add_argument("--measured", type=Path, default=DEFAULT_HOST_MEASURED,
                      help="the measured host time per bucket: a gpu_nccl_check.py graphs or engine JSON, or a "
                           "profile JSON (default: %(default)s)")
    host.add_argument("--world", type=int, default=1, help="the world size whose rows --measured is read from")
    host.add_argument("--host-us", type=float, default=None,
                      help="a host time per bucket measured elsewhere, us (instead of --measured)")
    host.add_argument("--host-source", default="given on the command line", help="where --host-us comes from")
    host.add_argument("--targets-us", type=_floats, default=[300.0, 100.0],
                      help="host times the crossovers are also given at (the targets: uncaptured, CUDA graphs)")
    host.add_argument("--docs", action="store_true",
                      help="also write collective_host.json into docs/bench/cost_model/, and regenerate the docs' "
                           "tables")
    _model_args(host)
    args = ap.parse_args(argv)

    if args.cmd == "collective":
        run_collective(args)
        return

    if args.cmd == "host":
        run_host(args)
        return

    if args.cmd == "hierarchy":
        run_hierarchy(args)
        return

    if args.cmd == "calibrate":
        names = [n for n in args.runs.split(",") if n]
        unknown = set(names) - set(CALIBRATION)
        if unknown:
            ap.error(f"unknown runs {sorted(unknown)}")
        run_calibration(names, args.out, args.quiet_cores, args.max_wait)
        return

    if args.cmd == "markdown":
        print(markdown(args.folder))
        return

    args.out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.files) if args.cmd != "predict" else []
    if args.cmd != "predict" and not runs:
        raise SystemExit("no bench_allreduce JSON among the files")

    params: Params | None = None
    if args.cmd in ("validate", "all") and args.params is not None:
        params = load_params(args.params)
        print(f"parameters from {args.params}")
        print_params(params)
    elif args.cmd in ("fit", "validate", "all"):
        params = do_fit(runs, args.out)
    if args.cmd in ("validate", "all"):
        assert params is not None
        print("\nvalidation (in-sample: the parameters were fitted on these rows)" if args.params is None
              else "\nvalidation")
        rows = validate(runs, {r[0]: params for r in runs}, args.cores, args.validation_latency_us * 1e-6, args.seed)
        result = {"in_sample": rows}
        if getattr(args, "cross", False) or args.cmd == "all":
            print("\nvalidation, leave one file out (each file predicted with the parameters of the others)")
            cross = {}
            for r in runs:
                others = [o for q in runs if q[0] != r[0] for o in q[2]]
                cross[r[0]] = cm.fit_paths(others)
            result["leave_one_file_out"] = validate(runs, cross, args.cores, args.validation_latency_us * 1e-6,
                                                    args.seed)
        (args.out / "validation.json").write_text(json.dumps(
            {"params": {k: p.to_dict() for k, p in params.items()}, "files": [str(r[0]) for r in runs],
             "cores": args.cores, "latency_us": args.validation_latency_us, **result}, indent=1))
    if args.cmd in ("predict", "all"):
        if params is None:
            params = load_params(args.params)
            print(f"parameters from {args.params}")
            print_params(params)
        if args.path not in params:
            raise SystemExit(f"--path {args.path}: no such parameters (have {', '.join(params)})")
        res = predict(params, args.path, args.latency_us * 1e-6, args.seed, args.grid)
        print_predictions(res)
        jpath, ppath = args.out / "predictions.json", args.out / "predictions.png"
        jpath.write_text(json.dumps(res, indent=1))
        plot_predictions(res, ppath)
        print(f"\nwrote {jpath} and {ppath}")
        if args.docs:
            DOCS.mkdir(parents=True, exist_ok=True)
            copied = []
            for name in ("predictions.json", "predictions.png", "validation.json", "params.json"):
                if (args.out / name).exists():
                    shutil.copy(args.out / name, DOCS / name)
                    copied.append(name)
            print(f"copied {', '.join(copied)} to {DOCS}")

if __name__ == "__main__":
    main()
