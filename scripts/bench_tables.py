"""Write the benchmark tables of the docs from the JSON results under docs/bench.

Every table lives between markers in a Markdown page::

    <!-- table:allreduce-1gbit -->
    ... generated, do not edit ...
    <!-- /table -->

Each block starts with a line saying when the run was made, at which commit, and the command that
reruns it, so prose around the tables never restates numbers that drift. ``--check`` exits 1 when
any block differs from what the JSON gives (tests/test_docs.py runs it).

    python scripts/bench_tables.py          # rewrite the blocks in place
    python scripts/bench_tables.py --check  # exit 1 if a block is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from seed_spread import against_dense, over_seeds  # (scripts/: this script's folder)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "bench"
PAGES = [ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md", *sorted(BENCH.glob("*.md")),
         *sorted((ROOT / "docs" / "howto").glob("*.md"))]
MARKER = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
DROP_ARGS = {"--json", "--plot", "--out", "--out-dir"}  # where a run wrote its files: not part of the rerun


@dataclass
class Table:
    """One generated table: the JSON files it reads and the function that renders their rows."""

    files: list[str]
    render: Callable[[list[dict]], list[str]]
    # For result files that carry no date or commit (the first runs', the GPU runs'): the
    # date, and the commit that recorded them, from `git log -- FILE` when the table was set up.
    date: str = ""
    commit: str = ""
    rerun: str = ""
    caption: str = ""  # replaces the generated first line (the README's summary: each row's page has it)


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def rows_of(doc: dict, part: str = "rows") -> list[dict]:
    return doc.get(part, [doc])


def machine(doc: dict) -> dict:
    meta = doc.get("meta", {})
    return meta.get("machine") or doc.get("machine") or {}


def rerun_command(doc: dict) -> str:
    argv = list(doc.get("meta", {}).get("argv", []))
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in DROP_ARGS:
            skip = True
            continue
        out.append(arg.replace("/work/main/", ""))
    root = " (as root)" if "--net" in out or ("--nets" in out and not _loopback_only(out)) else ""
    return f"`python {' '.join(out)}`{root}" if out else ""


def _loopback_only(argv: list[str]) -> bool:
    i = argv.index("--nets")
    return argv[i + 1] == "loopback"


def header(table: Table, docs: list[dict]) -> str:
    if table.caption:
        return table.caption
    dates = sorted({d.get("meta", {}).get("time", "")[:10] for d in docs} - {""}) or [table.date]
    commits = sorted({(machine(d).get("git_commit") or d.get("meta", {}).get("commit", ""))[:7]
                      for d in docs} - {"", "unknown"}) or [table.commit]
    files = ", ".join(f"`docs/bench/{f}`" for f in table.files)
    rerun = table.rerun or "; ".join(dict.fromkeys(c for c in map(rerun_command, docs) if c))
    return f"*Measured {', '.join(dates)} at commit {', '.join(f'`{c}`' for c in commits)}; from {files}. " \
           f"Rerun: {rerun}.*"


def md_table(head: list[str], body: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "" if not a or not b else f"{a / b:.2f}x"


def pct(x: float) -> str:
    return f"{x * 100:g}%"


# --- the all-reduce micro-benchmark ---------------------------------------------------------------

def allreduce(docs: list[dict]) -> list[str]:
    rows = [dict(r, network=d["meta"]["net"]) for d in docs for r in rows_of(d)]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    omni = [lab for lab in labels if lab.startswith("omnireduce")]
    nets = list(dict.fromkeys(r["network"] for r in rows))
    head = [*(["network"] if len(nets) > 1 else []), "density", *(f"{lab} ms" for lab in labels),
            "Gloo / best omnireduce"]
    by = {(r["network"], r["density"], r["label"]): r["median_s"] for r in rows}
    body = []
    for net in nets:
        for density in sorted({r["density"] for r in rows if r["network"] == net}, reverse=True):
            best = min((by[(net, density, lab)] for lab in omni if (net, density, lab) in by), default=None)
            body.append([*([net] if len(nets) > 1 else []), pct(density),
                         *(ms(by.get((net, density, lab))) for lab in labels),
                         ratio(by.get((net, density, "gloo")), best)])
    return md_table(head, body)


def allreduce_cpu(docs: list[dict]) -> list[str]:
    rows = [r for d in docs for r in rows_of(d)]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["density"], r["label"]): r for r in rows}
    head = ["density", *(f"{lab} ms" for lab in labels), *(f"{lab} CPU ms" for lab in labels)]
    body = []
    for density in sorted({r["density"] for r in rows}, reverse=True):
        cells = [ms(by[(density, lab)]["median_s"]) if (density, lab) in by else "" for lab in labels]
        cpu = []
        for lab in labels:
            r = by.get((density, lab))
            cpu.append(ms(r["worker_cpu_s_per_op"] + r.get("aggregator_cpu_s_per_op", 0.0)) if r else "")
        body.append([pct(density), *cells, *cpu])
    return md_table(head, body)


# --- training ------------------------------------------------------------------------------------

def training(docs: list[dict]) -> list[str]:
    rows = [r for d in docs for r in rows_of(d)]
    head = ["model", "network", "hook", "median step ms", "MB sent per step and rank", "CPU ms per step and rank",
            "final loss", "step vs all-reduce"]
    base = {(r["model"], r["network"]): r["median_step_s"] for r in rows if r["hook"] == "allreduce"}
    body = []
    for r in rows:
        cpu = r.get("cpu_ms_per_step")
        body.append([r["model"], r["network"], r["hook"], ms(r["median_step_s"]), f"{r['mb_per_step']:.2f}",
                     "" if cpu is None else f"{cpu:.1f}", f"{r['final_loss']:.4f}",
                     ratio(base.get((r["model"], r["network"])), r["median_step_s"])])
    return md_table(head, body)


def training_floor(docs: list[dict]) -> list[str]:
    """Two runs of the same hooks in opposite orders: each run's median step, their mean, and the mean
    over plain DDP's mean (above 1x the hook is slower)."""
    times: dict[tuple[str, str, str], list[float]] = {}
    for d in docs:
        for r in rows_of(d):
            times.setdefault((r["model"], r["network"], r["hook"]), []).append(r["median_step_s"])
    head = ["model", "network", "hook", *(f"run {i + 1} ms" for i in range(len(docs))), "mean ms",
            "hook / all-reduce"]
    body = []
    for (model, net, hook), ts in times.items():
        mean = sum(ts) / len(ts)
        base = times[(model, net, "allreduce")]
        body.append([model, net, hook, *(ms(t) for t in ts), ms(mean), ratio(mean, sum(base) / len(base))])
    order = {"allreduce": 0, "omnireduce-dense": 1, "omnireduce": 2}
    body.sort(key=lambda row: (row[1] != "loopback", row[0], order.get(row[2], 9)))
    return md_table(head, body)


def only(render: Callable[[list[dict]], list[str]], keep: Callable[[dict], bool],
         part: str = "rows") -> Callable[[list[dict]], list[str]]:
    """``render`` over the rows ``keep`` accepts (a short table of the current results' page)."""
    def short(docs: list[dict]) -> list[str]:
        return render([{**d, part: [r for r in d[part] if keep(r)]} for d in docs])
    return short


# --- the hierarchy -------------------------------------------------------------------------------

def hierarchy_micro(docs: list[dict]) -> list[str]:
    head = ["nodes x ranks", "network", "density", "method", "ms", "MB on the busiest node link"]
    body = []
    for d in docs:
        topo = f"{d['meta']['nodes']} x {d['meta']['ranks_per_node']}"
        for r in d["micro"]:
            body.append([topo, r["network"], pct(r["density"]), r["method"], ms(r["median_s"]),
                         f"{r['link']['busiest'] / 1e6:.1f}"])
    return md_table(head, body)


def hierarchy_train(docs: list[dict]) -> list[str]:
    head = ["nodes x ranks", "network", "hook", "median step ms", "MB on the busiest node link per step"]
    body = []
    for d in docs:
        topo = f"{d['meta']['nodes']} x {d['meta']['ranks_per_node']}"
        for r in d["train"]:
            body.append([topo, r["network"], r["hook"], ms(r["median_step_s"]), f"{r['link']['busiest'] / 1e6:.1f}"])
    return md_table(head, body)


# --- GPU -----------------------------------------------------------------------------------------

def gpu_kernels(docs: list[dict]) -> list[str]:
    head = ["dtype", "op", "density", "kernels ms", "torch ops ms", "speedup"]
    body = []
    for d in docs:
        for r in d["rows"]:
            if r["density"] in (0.01, 1.0):
                body.append([d["dtype"], r["op"], pct(r["density"]), f"{r['kernels_ms']:.3f}", f"{r['torch_ms']:.3f}",
                             f"{r['speedup']:.2f}x"])
    return md_table(head, body)


def gpu_recsys(docs: list[dict]) -> list[str]:
    head = ["hook", "path choice", "fused optimizer", "median step ms", "MB sent per step (median)",
            "MB sent per step (mean, measuring steps included)", "CPU ms per step"]
    base = next(d["median_step_s"] for d in docs if d["hook"] == "allreduce")
    body = []
    for d, name in zip(docs, GPU_RECSYS, strict=True):
        path = "threshold" if "threshold" in name else "measure" if d["hook"] != "allreduce" else "(none)"
        fused = "yes" if d["fused_optimizer"] else "no"
        body.append([d["hook"], path, fused, ms(d["median_step_s"]), f"{d['mb_sent_per_step']:.2f}",
                     f"{d['mb_sent_mean_per_step']:.2f}", f"{d['cpu_ms_per_step']:.1f}"])
    return [*md_table(head, body), "", f"Step time, DDP's all-reduce over omnireduce (measure): "
            f"{ratio(base, docs[1]['median_step_s'])}."]


GPU_RECSYS = ["gpu/recsys150_allreduce_measure.json", "gpu/recsys150_omnireduce_measure.json",
              "gpu/recsys150_omnireduce_measure_fused.json", "gpu/recsys150_omnireduce_threshold.json"]


def nccl_bench(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py bench: the collective engine against NCCL's all-reduce, time and bytes."""
    head = ["W", "dtype", "density", "engine ms", "NCCL all_reduce ms", "engine faster by", "engine MB sent",
            "ring MB sent", "equal"]
    body = [[str(r["world"]), r["dtype"], pct(r["density"]), f"{r['engine_ms']:.1f}", f"{r['all_reduce_ms']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['engine_bytes_sent'] / 1e6:.2f}", f"{r['ring_bytes_sent'] / 1e6:.1f}",
             "yes" if r["agree"] else "NO"] for d in docs for r in d["rows"]]
    return [*md_table(head, body), "", f"{docs[0]['size_mib']:g} MiB per rank; {docs[0]['label']}."]


def nccl_recsys(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py recsys: the default hook against plain DDP on NCCL."""
    head = ["W", "omnireduce ms/step", "plain DDP ms/step", "speedup", "omnireduce MB/step", "DDP MB/step",
            "largest parameter difference"]
    body = [[str(r["world"]), f"{r['omnireduce_ms']:.1f}", f"{r['ddp_ms']:.1f}", f"{r['speedup']:.2f}x",
             f"{r['omnireduce_mb']:.2f}", f"{r['ddp_mb']:.2f}", f"{r['largest_diff']:.2g}"]
            for d in docs for r in d["rows"]]
    return [*md_table(head, body), "", f"{docs[0]['steps']} steps, median; {docs[0]['label']}."]


def nccl_profile(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py profile: each phase's host and device time per bucket (rank 0)."""
    buckets = docs[0]["buckets"]
    names = list(buckets[0]["phases"])
    head = ["phase", *(f"{b['bytes'] / 2**20:g} MiB d={pct(b['density'])}: host / device us" for b in buckets)]
    body = [[n, *(f"{b['phases'][n]['host_us']:.0f} / {b['phases'][n]['device_us']:.0f}" for b in buckets)]
            for n in names]
    body.append(["whole reduction (host)", *(f"{b['reduction_host_us']:.0f}" for b in buckets)])
    return [*md_table(head, body), "", f"W={docs[0]['world_size']}, {docs[0]['transport']}."]


def nccl_recsys_paths(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py recsys: each bucket's measured ways (engine="auto" on NCCL) and the one it kept."""
    head = ["W", "bucket", "elements", "aggregators ms", "collective engine ms", "dense all-reduce ms", "kept"]
    # (the aggregators' way was named "omnireduce" in runs before it was named "aggregators")
    names = {"aggregators": "aggregators", "omnireduce": "aggregators", "collective": "collective engine",
             "dense": "dense all-reduce"}
    body = [[str(r["world"]), b, f"{p['numel']:,}", f"{p.get('aggregators_ms', p.get('omnireduce_ms')):.1f}",
             f"{p['collective_ms']:.1f}",
             f"{p['dense_ms']:.1f}", names.get(p["path"], p["path"])]
            for d in docs for r in d["rows"] for b, p in sorted(r["paths"].items(), key=lambda kv: int(kv[0]))]
    decided = docs[0]["rows"][0]["paths"]["0"]["decided_at"]
    return [*md_table(head, body), "", f"Each way timed in the first iterations (decided at iteration {decided}), "
            f"the median of its trials; {docs[0]['label']}."]


def nccl_other_ops(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py profile: the host ops that make up the engine's 'other' time, by name."""
    buckets = docs[0]["buckets"]
    names = list(dict.fromkeys(n for b in buckets for n in b["other_ops_us"]))
    head = ["host op", *(f"{b['bytes'] / 2**20:g} MiB d={pct(b['density'])}: us per bucket" for b in buckets)]
    body = [[f"`{n}`", *(f"{b['other_ops_us'][n]:.0f}" if n in b["other_ops_us"] else "" for b in buckets)]
            for n in names]
    return [*md_table(head, body), "", f"The ten largest of each size, the median per bucket over "
            f"{buckets[0]['profiled_reductions']} profiled reductions; W={docs[0]['world_size']}, "
            f"{docs[0]['transport']}."]


def nccl_crossover(docs: list[dict]) -> list[str]:
    """cost_model.py collective: the PREDICTED crossovers and times, with what they rest on."""
    from ombench import collcost  # (scripts/: this script's folder)

    return collcost.markdown(docs[0])


def nccl_host_crossover(docs: list[dict]) -> list[str]:
    """cost_model.py host: the PREDICTED crossovers per host time per bucket, 25 and 100 MiB."""
    from ombench import hostcost  # (scripts/: this script's folder)

    return hostcost.markdown(docs[0])


def nccl_engine(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py engine: the rebuilt engine's own choice per world, bucket and density, in ms,
    latency units and against the dense all-reduce, with its thread's host time per bucket and how much
    of it went on waiting for the counts (runs before that was counted: -)."""
    out = ["| W | elements | density | engine ms | units | / dense | host ms | of which waiting | exchange taken |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in docs[0]["rows"]:
        counts = r.get("exchanges") or {}
        took = max(counts, key=counts.get) if counts and max(counts.values()) else ""
        dens = "one block" if r["density"] == 0.0 else f"{r['density']:g}"
        wait = r.get("host_wait_s_per_reduction")
        waiting = "-" if wait is None else f"{wait * 1e3:.2f}"
        host = r.get("host_s_per_reduction", float("nan")) * 1e3
        out.append(f"| {r['world']} | {r['elements']:,} | {dens} | {r['engine_ms']:.2f} | {r['units']:.1f} | "
                   f"{r['vs_dense']:.2f} | {host:.2f} | {waiting} | {took} |")
    return out


def nccl_engine_forced(docs: list[dict]) -> list[str]:
    """gpu_nccl_check.py engine --exchanges union,owners,gather: each exchange forced, ms (units)."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in docs[0]["rows"]:
        cells.setdefault((r["world"], r["elements"], r["density"]), {})[r["exchange"]] = r
    out = ["| W | elements | density | dense ms | union ms (units) | owners ms (units) | gather ms (units) |",
           "|---|---|---|---|---|---|---|"]
    for (w, n, d), by in cells.items():
        dense = next(iter(by.values()))["dense_ms"]
        row = [f"{by[e]['engine_ms']:.1f} ({by[e]['units']:.1f})" if e in by else "" for e in ("union", "owners",
                                                                                               "gather")]
        out.append(f"| {w} | {n:,} | {d:g} | {dense:.1f} | " + " | ".join(row) + " |")
    return out


NCCL_H100 = "gpu_nccl/h100_c4b4e92"
NCCL_H200 = "gpu_nccl/h200_2b5f2cb"
NCCL_RERUN = "`GPU_CHECK_PARTS=nccl bash scripts/gpu_check.sh` on a CUDA machine (its NCCL part)"
NCCL_PROFILE_RERUN = "`python scripts/gpu_nccl_check.py profile` on a CUDA machine"


# --- memory --------------------------------------------------------------------------------------

def engine_cost(docs: list[dict]) -> list[str]:
    """The collective engine's fixed cost (bench_engine.py): per world, bucket and density on the host
    path, the engine before its rebuild, its own choice now (and the exchange it took), and the
    sparse gather forced, each in ms and in units of the group's 1-element all-reduce."""
    rows = [r for r in docs[0]["rows"] if r.get("path", "host").split("@")[0] == "host"]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["world"], r["elements"], r["density"])
        cells.setdefault(key, {})["before" if "@" in r.get("path", "") else r["exchange"]] = r

    def cell(r: dict | None) -> str:
        return "" if r is None else f"{r['engine_ms']:.2f} ({r['units']:.1f})"

    def took(r: dict | None) -> str:
        counts = (r or {}).get("exchanges") or {}
        return max(counts, key=counts.get) if counts and max(counts.values()) else ""

    body = []
    for key in sorted(cells):
        c = cells[key]
        dense = next(iter(c.values()))["dense_ms"]
        auto = c.get("auto")
        body.append([str(key[0]), f"{key[1]:,}", "one block" if key[2] == 0 else pct(key[2]), f"{dense:.2f}",
                     cell(c.get("before")), f"{cell(auto)} {took(auto)}".strip(), cell(c.get("gather")),
                     ratio(auto["engine_ms"] if auto else None, dense)])
    return md_table(["W", "elements", "density", "dense all-reduce ms", "before the rebuild ms (units)",
                     "engine now ms (units), exchange", "gather forced ms (units)", "now / dense"], body)


def host_cost_hook(docs: list[dict]) -> list[str]:
    """bench_hook_cost.py: per world and model, each variant's step (this tree and the one before), its
    extra per bucket over torch's Python allreduce_hook, and its step over plain DDP's."""
    from bench_hook_cost import LINEAR32  # (scripts/: this script's folder)

    rows = sorted(docs[0]["summary"], key=lambda r: (r["world"], r["model"] != "linear32", r["model"],
                                                     LINEAR32.index(r["variant"]), r["tree"] != "this"))
    body = []
    for r in rows:
        extra = r["us_per_bucket_over_torch_hook"]
        body.append([str(r["world"]), r["model"], r["variant"], r["tree"], f"{r['ms']:.2f}", f"{r['cpu_ms']:.2f}",
                     "" if extra is None or r["variant"] in ("plain", "torch_hook") else f"{extra:+.0f}",
                     "" if r["vs_plain"] is None else f"{r['vs_plain']:.3f}x"])
    return md_table(["W", "model", "variant", "code", "ms/step", "CPU ms/step", "us/bucket over torch's hook",
                     "vs plain DDP"], body)


def host_cost_engine(docs: list[dict]) -> list[str]:
    """profile_host_cost.py --before: the collective engine at W=1 per bucket, path and code, in us per
    reduction (medians over the rounds), against the floor (one scan of a freshly written copy)."""
    rows = sorted(docs[0]["summary"], key=lambda r: (r["numel"], r["path"], r["tree"] != "this"))
    body = [[f"{r['numel']:,}", str(r["blocks"]), r["path"], r["tree"], f"{r['engine_us']:.0f}",
             f"{r['engine_thread_cpu_us']:.0f}", f"{r['direct_us']:.0f}",
             f"{r['kernel_bodies_us']:.0f}" if r["path"] == "kernels" and "kernel_bodies_us" in r else "",
             f"{r['scan_fresh_us']:.0f}", f"{r['engine_thread_cpu_us'] / r['scan_fresh_us']:.2f}x"] for r in rows]
    return md_table(["elements", "non-zero blocks", "path", "code", "call to value us", "engine thread CPU us",
                     "called directly us", "of it in the kernels' calls us", "floor: one scan us",
                     "thread CPU / floor"], body)


def fsdp_hsdp(docs: list[dict]) -> list[str]:
    """HSDP with FSDP2, native against omnireduce (scripts/bench_fsdp.py renders its own summary)."""
    from bench_fsdp import table as fsdp_table  # (scripts/: this script's folder)

    return fsdp_table(docs[0]["summary"]).splitlines()


def memory(docs: list[dict]) -> list[str]:
    head = ["density", "configuration", "peak RSS per rank MiB", "over plain DDP MiB", "over DDP, % of the gradient"]
    body = []
    for r in rows_of(docs[0]):
        body.append([pct(r["density"]), r["config"], f"{max(r['peak_rss_mib']):.0f}", f"{r['vs_ddp_mib']:.1f}",
                     f"{r['vs_ddp_pct_of_gradient']:.1f}%"])
    return md_table(head, body)


# --- the README's one table ----------------------------------------------------------------------

def summary(docs: list[dict]) -> list[str]:
    loop, one, ten, paths, gpu_base, gpu_omni, nccl = docs
    head = ["what (W = 4 on a 2-core VM unless said)", "omnireduce", "baseline", "speedup", "details"]

    def micro(doc: dict, density: float, label: str) -> tuple[float, float]:
        by = {(r["density"], r["label"]): r["median_s"] for r in rows_of(doc)}
        omni = min(v for (dd, lab), v in by.items() if dd == density and lab.startswith("omnireduce"))
        return omni, by[(density, label)]

    def step(doc: dict, model: str, net: str, hook: str) -> tuple[float, float]:
        by = {(r["model"], r["network"], r["hook"]): r["median_step_s"] for r in rows_of(doc)}
        return by[(model, net, hook)], by[(model, net, "allreduce")]

    items = [
        ("100 MiB all-reduce, 1% non-zero, loopback", micro(loop, 0.01, "gloo"), "Gloo", "docs/bench/allreduce.md"),
        ("same, emulated 1 Gbit/s", micro(one, 0.01, "gloo"), "Gloo", "docs/bench/allreduce.md"),
        ("same, emulated 10 Gbit/s", micro(ten, 0.01, "gloo"), "Gloo", "docs/bench/allreduce.md"),
        ("recommender training step, 1 Gbit/s", step(paths, "recsys", "1gbit", "omnireduce"), "DDP all-reduce",
         "docs/bench/training.md"),
        ("language model (100k words) step, 1 Gbit/s", step(paths, "lstm", "1gbit", "omnireduce"), "DDP all-reduce",
         "docs/bench/training.md"),
        ("dense MLP step, 1 Gbit/s (path choice goes dense)", step(paths, "mlp", "1gbit", "omnireduce"),
         "DDP all-reduce", "docs/bench/training.md"),
        ("recommender step, 2 ranks on one NVIDIA H200", (gpu_omni["median_step_s"], gpu_base["median_step_s"]),
         "DDP all-reduce", "docs/bench/gpu.md"),
        *((f"recommender step over NCCL, {r['world']} ranks on one H100 (NCCL's sockets on loopback)",
           (r["omnireduce_ms"] / 1e3, r["ddp_ms"] / 1e3), "DDP on NCCL", "docs/bench/gpu_nccl.md")
          for r in nccl["rows"]),
    ]
    body = [[what, f"{ms(o)} ms", f"{ms(b)} ms ({name})", ratio(b, o), f"[{Path(link).stem}]({link})"]
            for what, (o, b), name, link in items]
    return md_table(head, body)


def compression(docs: list[dict]) -> list[str]:
    """bench_compression.py's results: validation loss against dense fp32's, bytes against its bytes."""
    rows = [r for d in docs for r in d["results"]]
    head = ["model", "method", "val loss", "vs dense", "bytes per step and rank", "of dense", "loopback step ms"]
    body = []
    for r, rel in against_dense(rows):
        body.append([r["model"], r["method"], f"{r['val_loss']:.4f}", f"{rel:+.2f}%",
                     f"{r['bytes_per_step_rank'] / 2**20:.3f} MiB",
                     f"{100 * r['bytes_per_step_rank'] / r['dense_bytes_per_step_rank']:.2f}%", ms(r["median_step_s"])])
    return md_table(head, body)


def compression_seeds(docs: list[dict]) -> list[str]:
    """Runs of several seeds (``--seeds``), one file per model or optimizer: each method's validation loss against
    dense fp32's of the same seed, its mean and spread over the seeds."""
    head = ["model (optimizer)", "method", "seeds", "mean val loss", "vs dense: mean", "smallest", "largest",
            "seeds within 1%", "of dense bytes"]
    body = []
    for d in docs:
        m = d["args"].get("lstm_momentum", 0.0)
        sgd = f"SGD, momentum {m:g}" if m else "SGD"
        for s in over_seeds(d["results"]):
            body.append([f"{s['model']} ({sgd if s['model'] == 'lstm' else 'Adam'})", s["method"], str(len(s["seeds"])),
                         f"{s['val_loss']:.4f}", f"{s['gap_mean']:+.2f}%", f"{s['gap_min']:+.2f}%",
                         f"{s['gap_max']:+.2f}%", f"{s['within_1pct']} of {len(s['seeds'])}",
                         f"{100 * s['of_dense_bytes']:.2f}%"])
    return md_table(head, body)


def compression_floor(docs: list[dict]) -> list[str]:
    """The recommender through OmniReduceState (tables exact, path="omnireduce") at several min_blocks:
    each compressed bucket's k, the validation loss against dense's (the first file's dense row)."""
    rows = [r for d in docs for r in d["results"]]
    dense = next(r for r in rows if r["method"] == "dense")
    head = ["method", "k of bucket 0 (1,193 blocks)", "k of bucket 3 (8 blocks)", "val loss", "vs dense",
            "of dense bytes"]

    def name(method: str) -> str:  # (these runs predate the default: a spec without mN meant min_blocks 0)
        return method if "m" in method[5:] else method + "m0"

    body = [[name(r["method"]), str(r["buckets"]["0"]["k"]), str(r["buckets"]["3"]["k"]), f"{r['val_loss']:.4f}",
             f"{100 * (r['val_loss'] / dense['val_loss'] - 1):+.2f}%",
             f"{100 * r['bytes_per_step_rank'] / r['dense_bytes_per_step_rank']:.2f}%"]
            for r in rows if r["method"].startswith("omnix")]
    return md_table(head, body)


def _with(doc: dict, more: dict) -> dict:
    """A seeds run with another run's rows added (not its dense rows: dense training is deterministic per seed,
    and the first run's serve as the reference of both)."""
    return dict(doc, results=doc["results"] + [r for r in more["results"] if r["method"] != "dense"])


def _without_mlp(doc: dict) -> dict:
    """The links run without its mlp rows (they shared the CPU with a test run; links_mlp.json reran them)."""
    return {**doc, "rows": [r for r in doc["rows"] if r["model"] != "mlp"]}


def distributed_bench(docs: list[dict]) -> list[str]:
    """omnireduce-bench's rows (``--json``): torch's all-reduce against omnireduce.distributed's engine (and
    the DDP hook's, with ``--vs-hook``)."""
    rows = [r for d in docs for r in d["rows"]]
    hook = any("hook_ms" in r for r in rows)
    head = ["bytes", "density", "placement", "unit us", "torch ms", "engine ms", "speedup", "engine units",
            "bytes sent"] + (["DDP hook ms", "hook / engine"] if hook else []) + ["#wrong"]
    body = []
    for r in rows:
        cells = [f"{r['bytes'] / 2**20:g} MiB", f"{r['density']:g}", r["placement"], f"{r['unit_us']:.0f}",
                 f"{r['dense_ms']:.2f}", f"{r['engine_ms']:.2f}", f"{r['engine_speedup']:.2f}x",
                 f"{r['engine_units']:.0f}", f"{r['engine_bytes'] / r['ring_bytes']:.1%}"]
        if hook:
            cells += [f"{r['hook_ms']:.2f}", f"{r['hook_ms'] / r['engine_ms']:.2f}x"]
        cells.append(str(sum(v for k, v in r.items() if k.endswith("_wrong"))))
        body.append(cells)
    h = docs[0]["header"]
    return [*md_table(head, body), "", f"{h['backend']}, W = {h['world_size']} on {h['nodes']} node(s), {h['device']}; "
            f"torch {h['torch']}; op {rows[0]['op']}, {rows[0]['dtype']}; median of the slowest rank, the methods "
            "taking turns; bytes sent per rank against the dense ring's."]


TABLES: dict[str, Table] = {
    "compression": Table(["compression_large.json"], compression, date="2026-11-27", commit="1043503",
                         rerun="`python scripts/bench_compression.py --models lstm,gpt2 --steps 800 --methods "
                               "dense,bf16,powersgd1,powersgd4,ours0.1,ours0.01,ours0.01r100,ours0.001,omni0.01r100,"
                               "omnix0.01r100`"),
    "compression-recsys": Table(["compression_recsys.json"], compression, date="2026-11-27", commit="3755e21",
                                rerun="`python scripts/bench_compression.py --models recsys --recsys-steps 300 "
                                      "--methods dense,bf16,powersgd1,powersgd4,ours0.1,ours0.01,ours0.01r100,"
                                      "ours0.001,omni,omni0.01r100,omnix0.01r100`"),
    "compression-floor": Table(["compression_recsys_min_blocks0.json", "compression_min_blocks/m8_m32.json",
                                "compression_min_blocks/m64_m128_d0.1.json"], compression_floor, date="2026-11-27",
                               commit="b262558",
                               rerun="`python scripts/bench_compression.py --models recsys --recsys-steps 300 "
                                     "--methods dense,omnix0.01r100m0,omnix0.01r100m8,omnix0.01r100m32,"
                                     "omnix0.01r100m64,omnix0.01r100m128,omnix0.1r100m0`"),
    "compression-heldout": Table(["compression_sgd_seeds_large.json", "compression_sgd_baselines_seeds_large.json",
                                  "compression_momentum_seeds_large.json", "compression_gpt2_seeds_large.json",
                                  "compression_gpt2_bf16_seeds_large.json", "compression_recsys_seeds.json"],
                                 lambda docs: compression_seeds([_with(docs[0], docs[1]), docs[2],
                                                                 _with(docs[3], docs[4]), docs[5]]),
                                 date="2026-11-27", commit="6f222d3 (bf16 and PowerSGD rows: 1043503; recommender: "
                                                           "cdb487c)",
                                 rerun="`python scripts/bench_compression.py --models lstm --steps 800 --seeds "
                                       "0,1,2,3,4 --methods dense,ours0.01r100,omnix0.01r100,bf16,powersgd4`; "
                                       "`--models lstm --steps 800 --lstm-momentum 0.9 --seeds 0,1,2 --methods dense,"
                                       "ours0.01r100,powersgd4`; `--models gpt2 --steps 800 --seeds 0,1,2 --methods "
                                       "dense,ours0.01r100,"
                                       "ours0.1r100,powersgd4,bf16`; `--models recsys --recsys-steps 300 --seeds "
                                       "0,1,2,3,4 --methods dense,omnix0.01r100`"),
    "compression-links": Table(["compression_links/links.json", "compression_links/links_mlp.json"],
                               lambda docs: training([_without_mlp(docs[0]), docs[1]])),
    "summary": Table(["cpu/final_after_1.json", "allreduce_1gbit_W4.json", "allreduce_10gbit_W4.json",
                      "bench_train_paths_checked.json", *GPU_RECSYS[:2], f"{NCCL_H100}/nccl_recsys.json"], summary,
                     caption="*Generated from the JSON under `docs/bench`; each row's page gives the run's date, "
                             "commit and the command that reruns it.*"),
    "allreduce-loopback": Table(["cpu/final_after_1.json"], allreduce_cpu),
    "allreduce-loopback-mpi": Table(["allreduce_loopback_W4.json"], allreduce, commit="b0a70ff"),
    "allreduce-1gbit": Table(["allreduce_1gbit_W4.json"], allreduce, commit="b0a70ff"),
    "allreduce-10gbit": Table(["allreduce_10gbit_W4.json"], allreduce, commit="b0a70ff"),
    "allreduce-colocated-1gbit": Table(["allreduce_1gbit_W4_colocated.json"], allreduce),
    "train-hooks": Table(["bench_train.json"], training),
    "train-paths": Table(["bench_train_paths_checked.json", "bench_train_paths_checked_10gbit.json"], training),
    "train-paths-short": Table(["bench_train_paths_checked.json", "bench_train_paths_checked_10gbit.json"],
                               only(training, lambda r: r["network"] != "loopback" and "threshold" not in r["hook"])),
    "train-floor": Table(["bench_train_floor_agreement_after_1.json", "bench_train_floor_agreement_after_2.json"],
                         training_floor),
    "train-sparse": Table(["bench_train_sparse.json"], training),
    "collective-micro": Table(["collective_loopback_W4.json", "collective_1gbit_W4.json",
                               "collective_10gbit_W4.json"], allreduce),
    "collective-train": Table(["collective_train_recsys.json"], training),
    "hierarchy-micro": Table([f"hierarchy/hierarchy_{t}.json" for t in ("2x2", "4x2", "2x4")], hierarchy_micro),
    "hierarchy-train": Table([f"hierarchy/hierarchy_{t}.json" for t in ("2x2", "4x2", "2x4")], hierarchy_train),
    "hierarchy-train-compressed": Table(["hierarchy/compressed/hierarchy_2x2.json"], hierarchy_train),
    "hierarchy-train-short": Table([f"hierarchy/hierarchy_{t}.json" for t in ("2x2", "4x2", "2x4")],
                                   only(hierarchy_train, lambda r: r["network"] == "1gbit", part="train")),
    "gpu-kernels": Table([f"gpu/bench_gpu_100_{t}_run9.json" for t in ("float32", "float16", "bfloat16")],
                         gpu_kernels, date="2026-11-26", commit="1b6f4c5",
                         rerun="`python scripts/bench_gpu.py` on a CUDA machine (part of `bash scripts/gpu_check.sh`)"),
    "gpu-recsys": Table(GPU_RECSYS, gpu_recsys, date="2026-11-26", commit="d4c048b",
                        rerun="`bash scripts/gpu_check.sh` on a CUDA machine (its end-to-end part)"),
    "nccl-bench": Table([f"{NCCL_H100}/nccl_bench.json"], nccl_bench, date="2026-11-27", commit="c4b4e92",
                        rerun=NCCL_RERUN),
    "nccl-recsys": Table([f"{NCCL_H100}/nccl_recsys.json"], nccl_recsys, date="2026-11-27", commit="c4b4e92",
                         rerun=f"{NCCL_RERUN}, GPU_CHECK_NCCL_STEPS=60"),
    "nccl-recsys-paths": Table([f"{NCCL_H100}/nccl_recsys.json"], nccl_recsys_paths, date="2026-11-27",
                               commit="c4b4e92", rerun=f"{NCCL_RERUN}, GPU_CHECK_NCCL_STEPS=60"),
    "nccl-profile": Table([f"{NCCL_H100}/nccl_profile.json"], nccl_profile, date="2026-11-27",
                          commit="c4b4e92", rerun=NCCL_PROFILE_RERUN),
    "nccl-other-ops": Table([f"{NCCL_H100}/nccl_profile.json"], nccl_other_ops, date="2026-11-27",
                            commit="c4b4e92", rerun=NCCL_PROFILE_RERUN),
    "nccl-crossover": Table(["cost_model/collective_measured.json"], nccl_crossover,
                            caption="*PREDICTION (cost model output, not a measurement), written 2026-11-28 by "
                                    "`scripts/cost_model.py collective` into `docs/bench/cost_model/"
                                    "collective_measured.json`. Rerun: `python scripts/cost_model.py collective "
                                    "--docs`, then `python scripts/bench_tables.py`.*"),
    "nccl-host-crossover": Table(["cost_model/collective_host.json"], nccl_host_crossover,
                                 caption="*PREDICTION (cost model output, not a measurement), written by "
                                         "`scripts/cost_model.py host` into `docs/bench/cost_model/"
                                         "collective_host.json`. Rerun: `python scripts/cost_model.py host --docs` "
                                         "(after a GPU run: "
                                         "`--measured <results>/logs/nccl_graphs.json`), which rewrites this table.*"),
    "memory": Table(["bench_memory.json"], memory),
    "host-cost-hook": Table(["host_cost/hook_W12.json"], host_cost_hook),
    "host-cost-engine": Table(["host_cost/engine_W1.json"], host_cost_engine),
    "fsdp-hsdp": Table(["fsdp/hsdp_2x2.json"], fsdp_hsdp),
    "fsdp-hsdp-measure": Table(["fsdp/hsdp_2x2_measure.json"], fsdp_hsdp),
    "engine-cost": Table(["engine/engine_gloo.json"], engine_cost),
    "distributed-default": Table(["distributed/default_W4.json"], distributed_bench, date="2026-11-29",
                                 commit="0ec759b",
                                 rerun="`torchrun --nproc-per-node 4 -m omnireduce.bench --check --placement "
                                       "random,overlap`"),
    "distributed-vs-hook": Table(["distributed/vs_hook_W4.json"], distributed_bench, date="2026-11-29",
                                 commit="d61f488",
                                 rerun="`torchrun --nproc-per-node 4 -m omnireduce.bench -b 16M -e 16M -d "
                                       "0.001,0.01,0.1 --vs-hook --check -n 21 -w 5`"),
    "nccl-engine": Table([f"{NCCL_H200}/nccl_engine.json"], nccl_engine, date="2026-11-27", commit="2b5f2cb",
                         rerun=NCCL_RERUN),
    "nccl-engine-forced": Table([f"{NCCL_H200}/nccl_engine_forced.json"], nccl_engine_forced, date="2026-11-27",
                                commit="2b5f2cb",
                                rerun="`python scripts/gpu_nccl_check.py engine --worlds 2,4 --engine-sizes "
                                      "1048576,16777216 --engine-densities 0.001,0.01,0.1 --exchanges "
                                      "union,owners,gather` on a CUDA machine"),
}


def render(name: str) -> str:
    table = TABLES[name]
    docs = [load(f) for f in table.files]
    return "\n".join([header(table, docs), "", *table.render(docs)]) + "\n"


def update(page: Path) -> tuple[str, str, list[str]]:
    """The page's text, the text with its blocks regenerated, and the names of unknown blocks."""
    text = page.read_text()
    unknown: list[str] = []

    def block(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in TABLES:
            unknown.append(name)
            return m.group(0)
        return m.group(1) + render(name) + m.group(4)

    return text, MARKER.sub(block, text), unknown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table differs from the JSON")
    args = parser.parse_args(argv)
    stale, used = [], set()
    for page in PAGES:
        if not page.exists():
            continue
        old, new, unknown = update(page)
        used.update(MARKER_NAMES.findall(old))
        if unknown:
            print(f"{page.relative_to(ROOT)}: unknown table(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        if old != new:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    for name in sorted(set(TABLES) - used):
        print(f"table {name} is on no page", file=sys.stderr)
    if args.check and stale:
        print(f"stale tables in {', '.join(stale)}: run `python scripts/bench_tables.py`", file=sys.stderr)
        return 1
    for page in stale:
        print(f"updated {page}")
    return 0


MARKER_NAMES = re.compile(r"<!-- table:([\w-]+) -->")

if __name__ == "__main__":
    sys.exit(main())
