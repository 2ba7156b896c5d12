"""Soak (slow; `make soak`): 10,000 all-reduces of random sizes, dtypes and densities through one
aggregator process, the worker processes restarted every 1,000; every result exact, and the
aggregator's memory flat. Writes results/soak.json."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
AGG = str(Path(sys.executable).with_name("omnireduce-agg"))


@pytest.mark.slow
def test_soak_ten_thousand_reductions_with_worker_restarts() -> None:
    agg = subprocess.Popen([AGG, "--listen", "tcp://127.0.0.1:0", "--log-level", "WARNING"], stdout=subprocess.PIPE,
                           text=True)
    address = agg.stdout.readline().split()[-1]
    proc = psutil.Process(agg.pid)
    world, per_round, rounds = 2, 1000, 10
    rss, done, t0 = [], 0, time.monotonic()
    try:
        for r in range(rounds):
            ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "soak_rank.py"), address,
                                       f"soak-{r}", str(rank), str(world), str(per_round), str(r)],
                                      stdout=subprocess.PIPE, text=True) for rank in range(world)]
            outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in ranks]
            for out in outs:
                assert not out["failures"], out["failures"][:3]
                assert out["tensors"] == per_round
            done += per_round
            rss.append(proc.memory_info().rss)
            print(f"round {r}: {done} reductions, aggregator RSS {rss[-1] / 2**20:.1f} MiB", flush=True)
        assert agg.poll() is None
    finally:
        agg.terminate()
        agg.wait()
    growth = rss[-1] - rss[0]
    Path(ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "soak.json").write_text(json.dumps({
        "reductions": done, "worker_restarts": rounds - 1, "seconds": time.monotonic() - t0,
        "aggregator_rss_mib": [round(v / 2**20, 1) for v in rss]}, indent=1))
    assert growth < 16 << 20, f"aggregator RSS grew {growth / 2**20:.1f} MiB over the soak: {rss}"
