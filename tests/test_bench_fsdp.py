"""scripts/bench_fsdp.py: native HSDP against HSDP with omnireduce, the smallest run on loopback
(2 "nodes" by ``GROUP_RANK``, 2 ranks each; make test-e2e): both modes train to the same losses,
omnireduce sends a few percent of the dense bytes for the table; and the summary's arithmetic
on rows made here (make test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fsdp import summary, table

from ombench import child_env
from tests.fsdp_cases import needs_fsdp_torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_fsdp.py"


def _row(network: str, model: str, mode: str, repeat: int, step_s: float, busiest: float,
         losses: list[float]) -> dict:
    row = {"network": network, "model": model, "mode": mode, "repeat": repeat, "median_step_s": step_s,
           "losses": losses, "link": {"busiest": busiest}, "network_info": {"loadavg_1min": [1.0, 2.0]}}
    if mode == "omnireduce":
        row["omnireduce"] = {"sent_fraction": 0.05}
    return row


def test_summary_takes_medians_over_repeats_and_compares_within_a_repeat() -> None:
    rows = [_row("1gbit", "recsys", "native", 0, 0.6, 1000.0, [1.0, 0.5]),
            _row("1gbit", "recsys", "omnireduce", 0, 0.3, 50.0, [1.0, 0.5]),
            _row("1gbit", "recsys", "native", 1, 0.5, 1000.0, [1.0, 0.5]),
            _row("1gbit", "recsys", "omnireduce", 1, 0.35, 60.0, [1.0, 0.5 + 1e-6]),
            _row("1gbit", "recsys", "native", 2, 0.7, 1000.0, [1.0, 0.5]),
            _row("1gbit", "recsys", "omnireduce", 2, 0.4, 40.0, [1.0, 0.5]),
            {"network": "10gbit", "error": "rank 1 exited with code 1"}]
    by = {s["mode"]: s for s in summary(rows)}
    assert by["native"]["median_step_s"] == 0.6 and by["omnireduce"]["median_step_s"] == 0.35
    assert by["omnireduce"]["link_busiest_bytes_per_step"] == 50.0 and by["omnireduce"]["repeats"] == 3
    assert by["omnireduce"]["max_loss_diff"] == pytest.approx(1e-6)
    line = table(summary(rows)).splitlines()[-1]
    assert "| 1gbit | recsys | 600.0 | 350.0 | 1.71x |" in line and "| 5.0% |" in line and "| 1.0-2.0 |" in line


@pytest.mark.e2e
@needs_fsdp_torch
def test_loopback_both_modes_train_alike(tmp_path: Path) -> None:
    # (the threshold rule: the default path="measure" would still be timing the ways after 4 steps)
    cmd = [sys.executable, str(SCRIPT), "--nets", "loopback", "--steps", "4", "--warmup", "1", "--repeats", "1",
           "--rows", "5000", "--batch", "16", "--path", "threshold", "--name", "run", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["meta"]["path"] == "threshold", doc["meta"]
    by = {(s["model"], s["mode"]): s for s in doc["summary"]}
    assert set(by) == {(m, mode) for m in ("recsys", "dense") for mode in ("native", "omnireduce")}
    for model in ("recsys", "dense"):
        assert by[(model, "omnireduce")]["max_loss_diff"] == 0.0, by
    table_row = next(r for r in doc["rows"] if r["model"] == "recsys" and r["mode"] == "omnireduce")
    table = table_row["omnireduce"]["per_module"]["table"]
    # the engine's sparse exchanges: the shard's union density is about 0.15 here (16 bags a rank, 256-element blocks)
    assert table["path"] == "collective" and table["sent_fraction"] < min(0.5, 2 * table["union_density"]), table
