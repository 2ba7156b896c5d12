"""The collective engine's GPU/NCCL prediction (``ombench.collcost``, ``cost_model.py collective``):
its arithmetic against sums worked out here from the definitions, the crossover against a direct
comparison of the two times, and the subcommand's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_dense_engine_is_the_ring_plus_its_passes_and_latencies() -> None:
    from ombench import collcost as cc

    N, W, R = 8 << 20, 8, 100 * cc.GBIT
    nccl = cc.NcclParams(ring_fraction=0.5, latency_s=1e-5)
    gpu = cc.GpuRates(flags=1e12, compact=0.5e12, scatter=2e12)
    ring = cc.ring_time(N, W, R, nccl)
    assert ring == pytest.approx(2 * 7 / 8 * N / (0.5 * R))
    # dense, every rank: 7/8 N to the owners and 7/8 N of sums back (the ring's bytes), 7 bitmaps of
    # N/1024/8 bytes, 3 collectives' latency; on the device: flags (N), compact (2N), owner sums
    # (N + N/8), scatter (2N)
    bitmap = 7 * (N / 1024 / 8)
    device = N / 1e12 + 2 * N / 0.5e12 + (N + N / 8) / 0.5e12 + 2 * N / 2e12
    expect = ring + bitmap / (0.5 * R) + 3e-5 + device
    assert cc.engine_time(N, W, 1.0, "random", R, nccl, gpu) == pytest.approx(expect)
    # nothing non-zero: bitmaps, latencies, the flags and compaction passes over the tensor
    empty = bitmap / (0.5 * R) + 3e-5 + N / 1e12 + N / 0.5e12
    assert cc.engine_time(N, W, 0.0, "overlap", R, nccl, gpu) == pytest.approx(empty)


def test_crossover_is_where_the_times_meet() -> None:
    from ombench import collcost as cc

    N, R = 100 << 20, 400 * cc.GBIT
    nccl, gpu = cc.NcclParams(a2a_fraction=0.6), cc.GpuRates()
    for W in (8, 64):
        ring = cc.ring_time(N, W, R, nccl)
        for placement in ("random", "overlap"):
            d = cc.crossover(N, W, placement, R, nccl, gpu)
            assert d is not None and 0 < d < 1
            assert cc.engine_time(N, W, d * 0.99, placement, R, nccl, gpu) < ring
            assert cc.engine_time(N, W, min(1.0, d * 1.01), placement, R, nccl, gpu) > ring
        # overlapping blocks leave a smaller union: the engine pays off up to a higher density
        assert cc.crossover(N, W, "overlap", R, nccl, gpu) > cc.crossover(N, W, "random", R, nccl, gpu)
    # a slow all-to-all still pays off at small enough densities (it moves only the non-zero blocks)
    slow = cc.crossover(N, 8, "random", R, cc.NcclParams(a2a_fraction=1e-4), gpu)
    assert slow is not None and slow < 1e-4
    # collectives costing more than the ring even with nothing to send: never; free ones: always
    assert cc.crossover(N, 8, "random", R, cc.NcclParams(latency_s=1.0), gpu) is None
    fast = cc.GpuRates(flags=1e18, compact=1e18, scatter=1e18)
    assert cc.crossover(N, 8, "overlap", R, cc.NcclParams(a2a_fraction=10.0, latency_s=0.0), fast) == 1.0


def test_cost_model_collective_subcommand(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cost_model.py"), "collective", "--out",
                          str(tmp_path), "--densities", "1,0.1,0.01"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "PREDICTION" in out and "PREDICTED crossover" in out
    res = json.loads((tmp_path / "collective.json").read_text())
    assert res["meta"]["prediction"] is True and res["meta"]["nccl"]["ring_fraction"] == 0.94
    settings = {(c["rate_gbit"], c["workers"], c["placement"]) for c in res["crossovers"]}
    assert settings == {(r, w, p) for r in (100.0, 400.0) for w in (8, 64) for p in ("random", "overlap")}
    assert all("a2a at 0.5" in c for c in res["crossovers"])


# What `gpu_nccl_check.py profile` writes (trimmed): per-bucket fixed costs of each phase, in us, as an
# H100 with NCCL's loopback sockets might give them (made up for the test, of a plausible size).
MEASURED = {"measured": True, "device": "NVIDIA H100 80GB HBM3", "world_size": 2, "backend": "nccl",
            "transport": "emulated network: NCCL socket transport on loopback, not NVLink",
            "fixed_from": {"bytes": 1 << 20, "density": 0.01},
            "per_bucket_fixed_us": {"flags": 12.0, "bitmap all-gather": 45.0, "split sizes": 30.0, "compact": 25.0,
                                    "blocks to owners": 60.0, "sums back": 55.0, "scatter": 8.0, "other": 90.0}}


def test_measured_fixed_costs_replace_the_latencies(tmp_path: Path) -> None:
    from ombench import collcost as cc

    path = tmp_path / "nccl_profile.json"
    path.write_text(json.dumps(MEASURED))
    fixed = cc.load_measured(path)
    assert fixed.as_dict() == pytest.approx({k: v * 1e-6 for k, v in MEASURED["per_bucket_fixed_us"].items()})
    assert "H100" in fixed.source and "loopback" in fixed.source
    N, W, R, d = 100 << 20, 8, 400 * cc.GBIT, 0.05
    nccl, gpu = cc.NcclParams(latency_s=1e-3), cc.GpuRates()  # (a latency the measured costs must replace)
    u = cc.union_density(d, W, "random")
    assumed = cc.engine_steps(N, W, d, u, R, nccl, gpu)
    measured = cc.engine_steps(N, W, d, u, R, nccl, gpu, fixed=fixed)
    # every modelled step: its bandwidth term (the latency gone) plus the phase's measured cost; the
    # phases the model has no term for are steps of their own
    assert measured["blocks to owners"] == pytest.approx(assumed["blocks to owners"] - 1e-3 + 60e-6)
    assert measured["bitmap all-gather"] == pytest.approx(assumed["bitmap all-gather"] - 1e-3 + 45e-6)
    assert measured["flags"] == pytest.approx(assumed["flags"] + 12e-6)
    assert measured["owner sums"] == assumed["owner sums"]  # (measured inside "other")
    assert measured["split sizes"] == pytest.approx(30e-6) and measured["other"] == pytest.approx(90e-6)
    total = sum(MEASURED["per_bucket_fixed_us"].values()) * 1e-6
    assert cc.engine_time(N, W, d, "random", R, nccl, gpu, fixed=fixed) == pytest.approx(
        cc.engine_time(N, W, d, "random", R, cc.NcclParams(latency_s=0.0), gpu) + total)
    # 325 us per bucket against the assumed 3 x 25 us: the engine pays off up to a lower density
    default = cc.NcclParams()
    assert cc.crossover(N, W, "random", R, default, gpu, fixed=fixed) < cc.crossover(N, W, "random", R, default, gpu)
    with pytest.raises(ValueError, match="per_bucket_fixed_us"):
        path.write_text(json.dumps({"buckets": []}))
        cc.load_measured(path)


def test_cost_model_collective_takes_measured_costs(tmp_path: Path) -> None:
    path = tmp_path / "nccl_profile.json"
    path.write_text(json.dumps(MEASURED))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cost_model.py"), "collective", "--out",
                          str(tmp_path), "--densities", "1,0.01", "--measured", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "MEASURED fixed costs per bucket" in out and "split sizes 30.0" in out
    res = json.loads((tmp_path / "collective_measured.json").read_text())
    assert res["meta"]["fixed_costs"]["us"] == pytest.approx(MEASURED["per_bucket_fixed_us"])
    assert "split sizes" in res["rows"][0]["steps_ms_at_1"]
