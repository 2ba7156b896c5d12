"""scripts/gpu_nccl_check.py (gpu_check.sh's NCCL part) without a GPU: every subcommand's code path on
Gloo and CPU tensors (``--backend gloo --device cpu``), judged from the JSON it writes, and the
profile's reading of a torch.profiler trace against hand-worked answers.

The NCCL trick itself (several ranks on one GPU, each its own NCCL_HOSTID) needs the GPU; here the
launcher, the ranks' cases, the references and verdicts, and the output formats run for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
CPU = ["--backend", "gloo", "--device", "cpu"]


def _check(tmp_path: Path, command: str, *args: str, timeout: float = 280) -> tuple[dict[str, Any], str]:
    out = tmp_path / f"{command}.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), command, *CPU, "--json", str(out),
                           *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] is True and f"RESULT: {res['result']}" in proc.stdout, res["result"]
    return res, proc.stdout


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_collectives_against_float64_references(tmp_path: Path) -> None:
    res, _ = _check(tmp_path, "collectives", "--worlds", "2,3", "--sizes", "1000,70000")
    assert res["variant"] == {"name": "default", "env": {}}  # the first variant worked: no fallback tried
    tried = [(a["variant"], a["world"], a["ok"]) for a in res["attempts"]]
    assert tried == [("default", 2, True), ("default", 3, True)]
    for a in res["attempts"]:
        ops = [(o["op"], o["elements"]) for o in a["ops"]]
        per_rank = [(op, n) for n in (1000, 70000) for op in ("all_reduce", "all_gather_into_tensor",
                                                                "all_to_all_single")]
        assert ops == per_rank * a["world"], ops
        assert all(o["ok"] for o in a["ops"]) and all(r["rc"] == 0 and r["end"] is not None for r in a["ranks"])
        assert max(o["max_err"] for o in a["ops"] if o["op"] == "all_reduce") > 0  # float32 sums, not float64
        assert all(o["max_err"] == 0 for o in a["ops"] if o["op"] != "all_reduce")  # copies: exact


def test_a_failing_backend_is_recorded_and_stops_the_later_steps(tmp_path: Path) -> None:
    out = tmp_path / "collectives.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="omr-no-such-interface")  # every rank's init fails
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), "collectives", *CPU, "--worlds", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["variant"] is None and res["passed"] is False
    (attempt,) = res["attempts"]  # (on Gloo there are no NCCL variables to fall back on)
    assert not attempt["ok"] and [r["rc"] for r in attempt["ranks"]] == [1, 1]
    said = "\n".join(attempt["nccl_said"])
    assert "omr-no-such-interface" in said and "(tail)" in said  # what the ranks printed, and each one's last lines
    assert "RESULT: GLOO failed in every variant tried (default); first: rank 0:" in proc.stdout
    variant = subprocess.run([sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), "variant-env", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert variant.returncode == 3 and variant.stdout == ""  # gpu_check.sh skips 6.2-6.8


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_parity_configs_and_a_clean_end(tmp_path: Path) -> None:
    configs = "default,collective,sparse-coo-collective,bf16,amp,compressed-collective"
    res, out = _check(tmp_path, "parity", "--worlds", "2", "--configs", configs)
    rows = {r["config"]: r for r in res["rows"]}
    assert sorted(rows) == sorted(configs.split(",")) and all(r["ok"] and r["error"] is None for r in rows.values())
    assert rows["collective"]["stats"]["engine"] == "collective"
    st = rows["collective"]["stats"]  # (small buckets take the dense all-reduce whole: counted dense)
    assert st["collective_reductions"] == st["buckets_sparse"] + st["collective_exchanges"]["whole"]
    assert st["buckets_sparse"] > 0
    assert rows["sparse-coo-collective"]["stats"]["buckets_coo"] > 0
    assert rows["bf16"]["stats"]["buckets_sparse"] > 0 and rows["bf16"]["stats"]["buckets_dense"] == 0
    assert rows["collective"]["largest_diff"] < 1e-5
    assert rows["compressed-collective"]["stats"]["buckets_compressed"] > 0
    assert res["ends"] == [res["ends"][0]] and "W=2: every rank exited 0" in res["ends"][0]
    assert "W=2 collective" in out and "destroy_process_group took at most" in res["result"]


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_a_rank_that_dies_stops_the_others(tmp_path: Path) -> None:
    res, _ = _check(tmp_path, "dies", "--worlds", "3", "--pg-timeout", "15", "--margin", "20")
    assert [row["state"] for row in res["rows"]] == ["default", "collective"]
    for row in res["rows"]:
        assert row["victim"]["rank"] == 2 and row["victim"]["step"] == 3
        assert [r["rank"] for r in row["ranks"]] == [0, 1]
        for r in row["ranks"]:  # on Gloo the error reaches Python: the connection to the dead rank resets
            assert r["error"] and not r["hung"] and 0 <= r["ended_after_s"] < res["limit_s"], r


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_bench_runs_omnireduce_bench(tmp_path: Path) -> None:
    """``bench`` is omnireduce-bench itself (its ranks started by the check), per world size and dtype."""
    res, out = _check(tmp_path, "bench", "--worlds", "1,2", "--size-mib", "1", "--densities", "0.01,1", "--repeats",
                      "2", "--warmup", "1")
    rows = res["rows"]
    assert [(r["world"], r["dtype"], r["density"]) for r in rows] == [
        (w, d, p) for w in (1, 2) for d in ("float32", "bfloat16") for p in (0.01, 1.0)]
    for r in rows:
        assert r["engine_wrong"] == 0 and r["engine_ms"] > 0 and r["dense_ms"] > 0 and r["bytes"] == 1 << 20, r
        assert r["ring_bytes"] == (r["bytes"] if r["world"] == 2 else 0), r  # 2 (W-1)/W of 1 MiB
        if r["world"] == 2 and r["density"] < 1:  # about 1% of the blocks, and 1% of the sums back
            assert r["engine_bytes"] < 0.05 * r["ring_bytes"], r
    assert res["label"].startswith("gloo on cpu") and "speedup" in out and "# check: every result agrees" in out


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_engine_cost_in_latency_units(tmp_path: Path) -> None:
    """The engine's fixed-cost benchmark (6.6 on a GPU) on Gloo: one row per world, size, density and
    exchange, every result equal to the dense all-reduce's, with its units, waits and collectives."""
    res, out = _check(tmp_path, "engine", "--worlds", "1,2", "--engine-sizes", "4096,70001", "--engine-densities",
                      "one,0.1,1", "--exchanges", "auto,owners", "--repeats", "2", "--warmup", "1")
    rows = res["rows"]
    assert sorted({(r["world"], r["elements"], r["density"], r["exchange"]) for r in rows}) == sorted(
        (w, n, d, e) for w in (1, 2) for n in (4096, 70001) for d in (0.0, 0.1, 1.0) for e in ("auto", "owners"))
    for r in rows:
        assert r["agree"] and r["units"] > 0 and r["vs_dense"] > 0 and r["unit_ms"] > 0, r
        small = r["exchange"] == "auto" and r["elements"] == 4096  # (16 KB: the dense all-reduce, no bitmaps)
        if r["world"] > 1 and small:
            assert r["exchanges"]["whole"] > 0 and r["host_waits_per_reduction"] == 0.0, r
            assert r["collectives_per_reduction"] == 1.0, r
            continue
        assert r["host_waits_per_reduction"] == 1.0, r  # every reduction: one wait for the counts
        # (auto: the dense all-reduce after the bitmaps where every block is non-zero)
        took = r["exchanges"]["owners" if r["exchange"] == "owners" else "gather"]
        assert took > 0 or r["density"] == 1.0 or (r["exchange"] == "auto" and r["exchanges"]["dense"] > 0), r
        if r["exchange"] == "owners" and r["density"] > 0:  # bitmaps, then two all-to-alls
            # (one rank on the host: its bitmap's all-gather has no other rank to reach, and is skipped)
            assert r["collectives_per_reduction"] == (3.0 if r["world"] > 1 else 2.0), r
    auto_one = [r for r in rows if r["exchange"] == "auto" and r["density"] == 0.0]
    assert all(r["collectives_per_reduction"] < 1.5 for r in auto_one), auto_one  # fused or dense: one collective
    assert "units" in out and res["unit_ms"]


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_profile_costs_per_phase_feed_the_cost_model(tmp_path: Path) -> None:
    from gpu_nccl_profile import PHASES

    from ombench import collcost

    # (0.5 MiB: a bucket of 256 KiB or less would take the dense all-reduce whole, with no phases to time)
    res, _ = _check(tmp_path, "profile", "--worlds", "2", "--profile-mib", "0.5,1", "--repeats", "3",
                    "--trace-dir", str(tmp_path))
    assert [b["bytes"] for b in res["buckets"]] == [1 << 19, 1 << 20]
    for b in res["buckets"]:
        assert b["profile_all_threads"] and b["profiled_reductions"] == 3, b  # the engine's thread in the trace
        # (a fused gather moves every block in the bitmaps' all-gather: no "blocks" phase of its own; on
        # the host a float32 bucket's sums are made in place: no "scatter" phase either)
        assert {"flags", "bitmap all-gather", "counts", "sums", "other"} <= set(b["phases"]) <= {*PHASES, "other"}
        assert b["other_ops_us"] and all(v >= 0 for v in b["other_ops_us"].values()), b["other_ops_us"]
        assert all(c["host_us"] > 0 and c["device_us"] == 0 for c in b["phases"].values()), b  # CPU: no device
    assert res["fixed_from"]["bytes"] == 1 << 19 and set(res["per_bucket_fixed_us"]) == set(res["buckets"][0]["phases"])
    assert len(list(tmp_path.glob("nccl_profile_trace_*.json"))) == 2
    # the cost model's measured host work: the smallest bucket's phases, less the wait for the counts
    measured = collcost.load_measured(tmp_path / "profile.json")
    small = res["buckets"][0]["phases"]
    assert measured.host_us == pytest.approx(sum(c["host_us"] for p, c in small.items() if p != "counts"))
    assert measured.detail["per_bucket_fixed_us"] == res["per_bucket_fixed_us"]


@pytest.mark.slow
def test_hierarchy_on_two_nodes_of_two(tmp_path: Path) -> None:
    res, _ = _check(tmp_path, "hierarchy", timeout=400)
    assert sorted((r["rank"], r["config"]) for r in res["rows"]) == sorted(
        (rank, c) for rank in range(4) for c in ("dense", "sparse", "collective", "compressed"))
    assert {r["node"] for r in res["rows"]} == {"0", "1"} and all(r["hierarchical"] for r in res["rows"])


@pytest.mark.slow
def test_recsys_hook_against_plain_ddp(tmp_path: Path) -> None:
    res, _ = _check(tmp_path, "recsys", "--worlds", "2", "--steps", "3", timeout=400)
    (row,) = res["rows"]
    assert row["largest_diff"] == 0 and row["differ"] == [] and row["ddp_mb"] > row["omnireduce_mb"]


def _span(cat: str, name: str, ts: float, dur: float, tid: int = 5, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_phase_costs_from_a_trace() -> None:
    from gpu_nccl_profile import PREFIX, REDUCTION, fixed_costs, other_ops, phase_costs, summarize

    ann = "user_annotation"
    events = [
        _span(ann, REDUCTION, 100, 100),
        _span(ann, PREFIX + "flags", 105, 10), _span(ann, PREFIX + "bitmap all-gather", 120, 20),
        _span(ann, PREFIX + "counts", 145, 5), _span(ann, PREFIX + "sums", 150, 10),
        _span(ann, PREFIX + "blocks", 162, 8), _span(ann, PREFIX + "blocks", 175, 8),
        _span(ann, PREFIX + "scatter", 190, 5),
        _span("gpu_user_annotation", PREFIX + "flags", 105, 99),  # the device-side copy of a span: not counted
    ]
    launches = [(1, 106, "cuda_runtime"), (2, 125, "cuda_driver"), (3, 146, "cuda_runtime"), (4, 152, "cuda_runtime"),
                (5, 172, "cuda_runtime"), (6, 165, "cuda_driver"), (7, 180, "cuda_driver"), (8, 192, "cuda_runtime")]
    events += [_span(cat, "launch", ts, 1, correlation=c) for c, ts, cat in launches]
    device = [(1, "kernel", 3), (2, "kernel", 15), (3, "gpu_memcpy", 2), (4, "kernel", 4), (4, "kernel", 1),
              (5, "kernel", 6), (6, "kernel", 7), (7, "kernel", 7), (8, "kernel", 4)]
    events += [_span(cat, "k", 0, dur, tid=7, correlation=c) for c, cat, dur in device]
    events += [_span("cuda_runtime", "launch", 150, 1, tid=9, correlation=9),  # another thread's launch
               _span("kernel", "bw", 0, 50, correlation=9)]
    events += [_span(ann, REDUCTION, 300, 50), _span(ann, PREFIX + "flags", 305, 6)]  # a second, smaller reduction
    first, second = phase_costs(events)
    assert first == {"flags": {"host_us": 10, "device_us": 3}, "bitmap all-gather": {"host_us": 20, "device_us": 15},
                     "counts": {"host_us": 5, "device_us": 2}, "sums": {"host_us": 10, "device_us": 5},
                     "blocks": {"host_us": 16, "device_us": 14},  # (two spans of one phase: the owners' all-to-alls)
                     "scatter": {"host_us": 5, "device_us": 4}, "other": {"host_us": 34, "device_us": 6}}
    assert second == {"flags": {"host_us": 6, "device_us": 0}, "other": {"host_us": 44, "device_us": 0}}
    launch = ("cuda_runtime", "cuda_driver")
    moved = [dict(e, tid=11) if e["cat"] in launch else e for e in events if e["args"].get("correlation") != 9]
    assert phase_costs(moved)[0] == first  # launches under another thread id than the spans': those in the span
    # what "other" is made of: the outermost host ops on the reduction's thread outside the phases' spans
    events += [_span("cpu_op", "aten::sort", 196, 3), _span("cpu_op", "aten::nonzero", 170.5, 1),
               _span("cpu_op", "aten::item", 101, 3), _span("cpu_op", "aten::_local_scalar_dense", 102, 1),
               _span("cpu_op", "aten::sort", 320, 7), _span("cpu_op", "aten::index", 106, 2),  # (inside flags)
               _span("cpu_op", "aten::cat", 101, 30, tid=9)]  # (another thread)
    assert other_ops(events) == {"aten::sort": 5.0, "aten::item": 1.5, "aten::nonzero": 0.5}
    assert other_ops(events, top=1) == {"aten::sort": 5.0}
    both = summarize([first, second])
    assert both["flags"] == {"host_us": 8, "device_us": 1.5} and both["scatter"] == {"host_us": 2.5, "device_us": 2}
    assert fixed_costs(summarize([first])) == {"flags": 10, "bitmap all-gather": 20, "counts": 5, "blocks": 16,
                                               "sums": 10, "scatter": 5, "other": 34}


@pytest.mark.e2e  # (the GPU check's script on Gloo ranks: make test-e2e)
def test_graphs_with_and_without_on_the_cpu_stand_in(tmp_path: Path) -> None:
    """6.13 on Gloo: the engine with graphs (the CPU stand-in) against the engine without, per world and
    bucket: the same bits, a replayed steady state, the overflow finished uncaptured; the report."""
    res, out = _check(tmp_path, "graphs", "--worlds", "1,2", "--graph-buckets", "65536:one,1048576:0.01",
                      "--warmup", "3", "--repeats", "2")
    rows = res["rows"]
    assert [(r["world"], r["elements"], r["density"]) for r in rows] == [
        (w, n, d) for w in (1, 2) for n, d in ((65536, 0.0), (1 << 20, 0.01))]
    for r in rows:
        assert r["equal_steady"] and r["equal_overflow"] and r["equal_after"] and r["agree"], r
        unc, gra = r["uncaptured"], r["graphs"]
        assert unc["graph_replays"] == 0, unc
        if r["world"] == 2 and r["elements"] == 65536:  # (256 KiB at W=2: the dense all-reduce, whole)
            assert unc["whole"] > 0 and unc["fused"] == 0 and gra["graph_replays"] == 0, r
            continue
        assert unc["kernel_reductions"] == gra["kernel_reductions"] > 0, r
        # 3 + 2 reductions: bitmaps first, fused uncaptured, captured and replayed, replayed twice
        assert gra["graph_captures"] >= 1 and gra["steady_replays"] == 3 and gra["overflow_fallbacks"] == 1, gra
        assert gra["overflows"] == unc["overflows"] == 1 and gra["cpu_us"] > 0 and gra["host_us"] > 0, r
    assert "| 2 | 64K elements one block (taken whole: no graph) |" in out and "W=1: uncaptured" in res["targets"]
    assert "the CPU stand-in" in res["label"]


def test_the_graphs_verdict_and_report() -> None:
    """gpu_nccl_graphs.py's judge on hand-made rows: bits that differ, sums off the dense all-reduce's,
    a failed capture, graphs that never replayed and an overflow not finished uncaptured are each a
    problem; a bucket taken whole is none; the W=1 targets are reported, met or not."""
    from gpu_nccl_graphs import problems_of, table_lines, targets_line

    def way(cpu: float, **kw: float) -> dict[str, Any]:
        return {"cpu_us": cpu, "wall_us": cpu + 5, "host_us": cpu, "host_wait_us": 10.0, "fused": 10, "whole": 0,
                "overflows": 1, "graph_failures": 0, "steady_replays": 0, "overflow_fallbacks": 0, **kw}

    good = {"world": 1, "elements": 1 << 20, "density": 0.01, "equal_steady": True, "equal_overflow": True,
            "equal_after": True, "agree": True, "max_err": 0.0, "uncaptured": way(280.0),
            "graphs": way(90.0, steady_replays=11, overflow_fallbacks=1)}
    assert problems_of([good]) == []
    whole = dict(good, world=2, uncaptured=way(50.0, fused=0, whole=13), graphs=way(50.0, fused=0, whole=13))
    assert problems_of([whole]) == []
    bad = [dict(good, equal_overflow=False), dict(good, agree=False, max_err=0.5),
           dict(good, graphs=way(90.0, graph_failures=1)), dict(good, graphs=way(90.0)),
           dict(good, graphs=way(90.0, steady_replays=11, overflow_fallbacks=0))]
    found = problems_of(bad)
    assert len(found) == 5, found
    for words, problem in zip(("bits differ", "dense all-reduce", "capture(s) failed", "no reduction of the steady",
                               "the overflow"), found, strict=True):
        assert words in problem and problem.startswith("W=1 4 MiB 0.01"), problem
    assert "target 300: met" in targets_line([good]) and "target 100: met" in targets_line([good])
    slow = dict(good, graphs=way(140.0, steady_replays=11, overflow_fallbacks=1))
    assert "target 100: not met" in targets_line([slow, whole]) and targets_line([whole]) == "no W=1 rows"
    lines = table_lines([good, whole], "label")
    assert lines[2].startswith("| 1 | 4 MiB 0.01 | 280 | 280 (10) | - | 90 | 90 (10) | - | 285 / 95 | yes |"), lines[2]
    assert "(taken whole: no graph)" in lines[3] and lines[-1].endswith("label.")
