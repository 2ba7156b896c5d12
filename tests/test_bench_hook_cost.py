"""scripts/bench_hook_cost.py and scripts/profile_host_cost.py run and say what they measure (tiny settings: the
numbers themselves are the benchmarks', never judged here). Each runs a benchmark's processes: make test-e2e."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.exchange_host import needs_cxx

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


def test_the_hook_cost_benchmark_runs_every_variant_and_counts_the_buckets(tmp_path: Path) -> None:
    out = tmp_path / "hook.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_hook_cost.py"), "--worlds", "1", "--repeats",
                        "1", "--steps", "4", "--warmup", "3", "--mid-steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["summary"]
    got = {(s["model"], s["variant"]) for s in rows}
    assert got == {("linear32", v) for v in ("plain", "torch_hook", "omni_dense", "omni_default")} | \
        {("mid", "plain"), ("mid", "omni_default")}, got
    hook = next(s for s in rows if s["variant"] == "torch_hook")
    assert hook["buckets"] == 32, "one bucket per layer (the weights; the biases ride with them)"
    assert all(s["ms"] > 0 and s["cpu_ms"] > 0 for s in rows), rows
    assert "us/bucket" in r.stdout and "omni_default" in r.stdout


def test_the_profile_times_each_step(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_host_cost.py"), "--number", "3",
                        "--repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads(out.read_text())
    names = [name for name, _ in saved["hook"]]
    assert any("Intake.take" in n for n in names) and any("allreduce_hook" in n for n in names), names
    assert [row["numel"] for row in saved["engine"]] == [65536, 1 << 20, 1 << 22]
    assert all(row["engine_us"] > 0 and row["steps_us"] for row in saved["engine"])


@needs_cxx
def test_the_profile_takes_the_kernel_exchange_with_host_kernels(tmp_path: Path) -> None:
    """``--host-kernels`` on the device path: every reduction through the kernel exchange, the other two
    paths' steps unchanged (the torch ops: none through kernels)."""
    runs = {}
    for name, extra, env in (("kernels", ["--host-kernels"], {"OMNIREDUCE_ENGINE_KERNELS": "1"}), ("device", [], {})):
        out = tmp_path / f"{name}.json"
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_host_cost.py"), "--engine-only", "--number",
                            "3", "--repeats", "2", "--json", str(out), *extra], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMNIREDUCE_DEVICE_PATH": "1", **env})
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = json.loads(out.read_text())["engine"]
    assert all(row["reductions"] > 0 and row["kernel_reductions"] == row["reductions"] for row in runs["kernels"])
    assert all(row["kernel_reductions"] == 0 for row in runs["device"]), runs["device"]
    # the kernels' calls are timed, a part of the direct reduction's time; no calls, no time
    assert all(0 < row["kernel_bodies_us"] < row["direct_us"] for row in runs["kernels"]), runs["kernels"]
    assert all(row["kernel_bodies_us"] == 0 for row in runs["device"]), runs["device"]
