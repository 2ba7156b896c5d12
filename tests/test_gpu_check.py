"""scripts/gpu_check.sh and its helpers, on a machine without a GPU (the GPU parts skip themselves).

The script runs with no heavy part: part 1 alone (every step skipped, and why), and part 5 with
budgets it cannot meet (each step is reported failed by timeout, the script moves on, exits 1 and
leaves no process behind). The helpers' pure logic is checked against hand-worked answers: the trace
reading of gpu_trace_overlap.py, and gpu_sync_check.py's rule for which synchronisation fails.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
MIB = 1 << 20
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: parts 1-4 would run")


def _run(results: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    full = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_INSTALL="0", **env)
    full.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(results)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)
    summary = (results / "summary.txt").read_text()
    steps = {line.split()[0]: line for line in summary.splitlines() if line[:1].isdigit()}
    return proc, steps


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")]).returncode == 0


@no_gpu_only
def test_part_1_is_skipped_without_a_gpu_and_says_why(tmp_path: Path) -> None:
    proc, steps = _run(tmp_path, GPU_CHECK_PARTS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    part1 = {k: v for k, v in steps.items() if k.startswith("1.")}
    assert sorted(part1) == ["1.1", "1.2", "1.3", "1.4", "1.5", "1.6"], steps
    for line in part1.values():
        assert line.split()[2] == "skipped", line
        assert "no CUDA device: torch.cuda.is_available() is False" in line, line
    assert not any(k[0] in "2345" for k in steps), steps  # only the parts asked for
    assert "# PASSED: 0 passed, 0 failed" in (tmp_path / "summary.txt").read_text()


@no_gpu_only
def test_the_nccl_part_is_skipped_without_a_gpu_and_says_why(tmp_path: Path) -> None:
    proc, steps = _run(tmp_path, GPU_CHECK_PARTS="nccl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(steps, key=lambda s: [int(p) for p in s.split(".")]) == ["0.1"] + [f"6.{i}" for i in range(0, 16)], \
        steps  # nothing of parts 1-5
    for step in (f"6.{i}" for i in range(0, 16)):
        assert steps[step].split()[2] == "skipped", steps[step]
        assert "no CUDA device: torch.cuda.is_available() is False" in steps[step], steps[step]
    assert "# PASSED: 0 passed, 0 failed, 17 skipped" in (tmp_path / "summary.txt").read_text()


@no_gpu_only
def test_the_nccl_helper_exits_skipped_without_a_gpu() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), "parity"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 77, proc.stdout + proc.stderr  # gpu_check.sh reports it skipped
    assert "RESULT: no CUDA device" in proc.stdout and "the NCCL check (parity) needs a GPU" in proc.stdout


def test_the_nccl_variant_reaches_the_later_steps(tmp_path: Path) -> None:
    def variant_env(content: str | None) -> tuple[int, str]:
        f = tmp_path / "nccl_collectives.json"
        f.unlink(missing_ok=True)
        if content is not None:
            f.write_text(content)
        proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), "variant-env", str(f)],
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout

    worked = {"variant": {"name": "p2p-shm-off", "env": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}}
    assert variant_env(json.dumps(worked)) == (0, "NCCL_P2P_DISABLE=1\nNCCL_SHM_DISABLE=1\n")
    assert variant_env(json.dumps({"variant": {"name": "default", "env": {}}})) == (0, "")
    assert variant_env(json.dumps({"variant": None, "attempts": []})) == (3, "")  # none worked: skip the rest
    assert variant_env(None) == (0, "")  # 6.1 left out: NCCL as it is


def _marked(marker: str) -> list[psutil.Process]:
    """The processes whose environment holds ``GPU_CHECK_TEST_MARK=marker`` (the script's descendants)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("GPU_CHECK_TEST_MARK") == marker:
                found.append(p)
    return found


def test_a_step_past_its_budget_fails_and_the_script_moves_on(tmp_path: Path) -> None:
    marker = f"{os.getpid()}-{tmp_path.name}"
    proc, steps = _run(tmp_path, GPU_CHECK_PARTS="5", GPU_CHECK_QUICK="1", GPU_CHECK_BUDGET_5_1="1",
                       GPU_CHECK_BUDGET_5_2="1", GPU_CHECK_TEST_MARK=marker)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for step in ("5.1", "5.2"):
        assert steps[step].split()[2] == "failed" and "timeout after 1 s" in steps[step], steps[step]
        assert (tmp_path / "logs" / f"{step}_loopback-W{4 * int(step[2])}.log").is_file()
    assert "# FAILED: 0 passed, 2 failed" in (tmp_path / "summary.txt").read_text()
    _assert_none_left(marker)


def _assert_none_left(marker: str) -> None:
    deadline = time.monotonic() + 15
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _marked(marker), [p.cmdline() for p in _marked(marker)]


def test_steps_left_out_are_reported_skipped_and_the_others_run(tmp_path: Path) -> None:
    marker = f"{os.getpid()}-{tmp_path.name}"
    proc, steps = _run(tmp_path, GPU_CHECK_PARTS="5", GPU_CHECK_QUICK="1", GPU_CHECK_SKIP="5.2",
                       GPU_CHECK_BUDGET_5_1="1", GPU_CHECK_TEST_MARK=marker)
    assert steps["5.2"].split()[2] == "skipped" and "left out: GPU_CHECK_SKIP=5.2" in steps["5.2"], steps["5.2"]
    assert not (tmp_path / "logs" / "5.2_loopback-W8.log").exists()  # nothing of it ran
    assert steps["5.1"].split()[2] == "failed" and "timeout after 1 s" in steps["5.1"], steps["5.1"]  # it ran
    assert proc.returncode == 1 and "# FAILED: 0 passed, 1 failed" in (tmp_path / "summary.txt").read_text()
    _assert_none_left(marker)


def test_the_compact_profile_runs_on_cpu_and_counts_the_blocks(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_profile_compact.py"), "--device", "cpu", "--sizes-mb",
                           "0.25", "--densities", "0.2,1", "--repeats", "3", "--block-size", "100", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    nb = -(-(MIB // 4 // 4) // 100)  # 0.25 MiB of float32 in blocks of 100, the last one short
    assert [r["density"] for r in rows] == [0.2, 1.0] and rows[1]["k"] == nb, rows
    assert 0.1 * nb < rows[0]["k"] < 0.3 * nb, rows  # about a fifth of the blocks drawn non-zero
    assert all(r["compact_wall_ms"] > 0 and r["flags_sync_wall_ms"] > 0 for r in rows), rows
    assert all(r["device_us"] == {} for r in rows), rows  # on CPU: no device activity to attribute
    assert "RESULT: 0.25 MiB d=1: compact" in proc.stdout, proc.stdout


def _span(cat: str, name: str, ts: float, dur: float, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1, "args": args}


def test_overlap_of_device_to_host_copies_with_the_backward_pass() -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        overlap = importlib.import_module("gpu_trace_overlap")
    finally:
        sys.path.remove(str(SCRIPTS))
    events = [
        _span("user_annotation", "bw", 100, 100),                       # backward on the host: 100-200
        _span("cuda_runtime", "cudaLaunchKernel", 110, 2, correlation=1),
        _span("cuda_runtime", "cudaLaunchKernel", 190, 2, correlation=2),
        _span("cuda_runtime", "cudaLaunchKernel", 250, 2, correlation=3),  # after the backward: the optimizer
        _span("kernel", "bw_a", 120, 30, stream=7, correlation=1),
        _span("kernel", "bw_b", 200, 40, stream=7, correlation=2),       # backward on the device: 120-240
        _span("kernel", "sgd", 260, 20, stream=7, correlation=3),
        _span("cuda_runtime", "cudaLaunchKernel", 140, 2, correlation=4),  # omnireduce's thread, meanwhile
        _span("cuda_runtime", "cudaLaunchKernel", 195, 2, correlation=5),
        _span("kernel", "compact", 150, 5, stream=9, correlation=4),     # omnireduce's side stream: not backward
        _span("kernel", "scatter", 250, 20, stream=9, correlation=5),
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 230, 20, stream=9),  # 10 us inside
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 160, 30, stream=9),  # 30 us inside
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 300, 10, stream=9),  # after
        _span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 235, 10, stream=9),  # 5 us inside
    ]
    s = overlap.overlap_summary({"traceEvents": events}, "bw")
    assert s["backward_kernels"] == 2 and s["backward_device_us"] == 120 and s["backward_host_us"] == 100
    assert s["dtoh"] == {"count": 3, "total_us": 60, "inside_backward_us": 40, "started_before_backward_ended": 2}
    assert s["htod"]["inside_backward_us"] == 5 and s["dtoh_overlaps_backward"]
    assert "2 start before its last kernel ends" in overlap.describe(s)
    late = [e for e in events if e["cat"] != "gpu_memcpy"] + [_span("gpu_memcpy", "Memcpy DtoH", 245, 10, stream=9)]
    s = overlap.overlap_summary({"traceEvents": late}, "bw")
    assert not s["dtoh_overlaps_backward"] and "none overlaps" in overlap.describe(s)
    with pytest.raises(ValueError, match="no user_annotation"):
        overlap.overlap_summary({"traceEvents": events}, "forward")


def test_sync_check_fails_only_on_omnireduces_own_calls_off_its_threads() -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        check = importlib.import_module("gpu_sync_check")
    finally:
        sys.path.remove(str(SCRIPTS))
    import omnireduce.ddp

    ours, theirs = omnireduce.ddp.__file__, torch.amp.grad_scaler.__file__

    def sync_from(filename: str, thread: str) -> None:
        def warn() -> None:
            warnings.warn_explicit(f"{check.SYNC_MESSAGE} (test)", UserWarning, filename, 1)
        t = threading.Thread(target=warn, name=thread)
        t.start()
        t.join()

    with check.SyncWatch() as watch:
        watch.step, watch.phase = 14, "backward"
        sync_from(theirs, "MainThread-ish")      # the GradScaler: reported, allowed
        sync_from(ours, "omnireduce-io-r0")      # omnireduce's own thread: allowed
    rank = {"rank": 0, "param_checksum": 1.0, "syncs": watch.found, "stats": {"buckets_sparse": 3}}
    ok, line = check.verdict("amp", [rank, dict(rank, rank=1)], 3)
    assert ok, line
    assert [(s["by_omnireduce"], s["omnireduce_thread"]) for s in watch.found] == [(False, False), (True, True)]
    with check.SyncWatch() as watch:
        watch.step, watch.phase = 15, "backward"
        sync_from(ours, "Dummy-1")               # omnireduce on autograd's thread: the failure
    ok, line = check.verdict("hook", [dict(rank, syncs=watch.found)], 3)
    assert not ok and "rank 0 step 15 (backward)" in line and "ddp/__init__.py:1" in line, line
