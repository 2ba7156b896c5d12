"""scripts/bench_train.py: the dense ``mlp`` model and the hook's two path rules, smallest setting.

One run on loopback (W=2, a 3-layer MLP 128 wide, 30 steps; ~20 s): ``omnireduce-threshold`` and
``omnireduce`` (``path="measure"``). Checked against references of their own: every step's loss
against the same training computed here in one process (each rank's gradient from its batches,
averaged, then the same fused Adam: no communication involved), and the paths against what each
rule must do with buckets whose every element is non-zero:
the threshold rule sends every bucket dense from the first step; ``measure`` takes the three paths
in turn while it measures (the aggregators, the collective engine, the dense all-reduce: Gloo),
then every step follows the agreed decisions in ``paths`` (after the step check, if it ran).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_train import build_mlp, make_mlp_batch

from ombench import child_env

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_train.py"
WIDTH, LAYERS, BATCH, WORLD, STEPS, SEED = 128, 3, 16, 2, 30, 0


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench_train")
    cmd = [sys.executable, str(SCRIPT), "--models", "mlp",
           "--hooks", "omnireduce-threshold,omnireduce,omnireduce-collective", "--nets", "loopback",
           "--workers", str(WORLD), "--steps", str(STEPS), "--warmup", "10",
           "--mlp-width", str(WIDTH), "--mlp-layers", str(LAYERS), "--mlp-batch", str(BATCH), "--seed", str(SEED),
           "--json", str(out / "rows.json"), "--plot", str(out / "rows.png")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=child_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "omnireduce-threshold" in p.stdout  # the table was printed
    data = json.loads((out / "rows.json").read_text())
    assert data["meta"]["models"]["mlp"]["parameters"] == sum(p.numel() for p in build_mlp(WIDTH, LAYERS).parameters())
    return {r["hook"]: r for r in data["rows"]}


def reference_losses() -> list[float]:
    """The loss of every step (mean over the ranks) of DDP's training, computed in this process."""
    torch.manual_seed(SEED)  # what every rank does before building the model
    model = build_mlp(WIDTH, LAYERS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for step in range(STEPS):
        grads, loss = [torch.zeros_like(p) for p in model.parameters()], 0.0
        for rank in range(WORLD):
            x, y = (torch.from_numpy(a) for a in make_mlp_batch(rank, step, BATCH, WIDTH, SEED))
            model.zero_grad()
            rank_loss = torch.nn.functional.mse_loss(model(x), y)
            rank_loss.backward()
            loss += rank_loss.item() / WORLD
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad / WORLD
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
        losses.append(loss)
    return losses


def test_every_steps_loss_matches_the_reference_training(rows: dict[str, dict]) -> None:
    reference = reference_losses()
    assert reference[-1] < reference[0]  # it trains
    for hook in ("omnireduce-threshold", "omnireduce", "omnireduce-collective"):
        assert rows[hook]["losses"] == pytest.approx(reference, rel=1e-4), hook
    engine = rows["omnireduce-collective"]["omnireduce"]  # (no aggregators: the details from the state)
    assert engine["engine"] == "collective" and engine["block_size"] == 256, engine


def test_threshold_sends_every_dense_bucket_dense(rows: dict[str, dict]) -> None:
    info = rows["omnireduce-threshold"]["omnireduce"]
    assert info["path"] == "threshold" and info["paths"] == {}
    assert info["bucket_density"] and all(d == 1.0 for _, _, d in info["bucket_density"])  # GELU: no zero
    steps = info["buckets_per_step"]["steps"]
    assert len(steps) == STEPS and all(dense >= 1 and omni == 0 for dense, omni in steps)


def test_measure_times_both_paths_then_follows_the_agreed_decision(rows: dict[str, dict]) -> None:
    info = rows["omnireduce"]["omnireduce"]
    assert info["path"] == "measure" and info["paths"]
    steps = info["buckets_per_step"]["steps"]
    decided_at = set()
    for p in info["paths"].values():
        assert p["phase"] == "decided" and p["measurements"] == 1
        times = {path: p[f"{path}_ms"] for path in ("aggregators", "collective", "dense")}
        assert all(t > 0 for t in times.values()), p
        fastest = min(times, key=lambda path: (times[path], path != "dense"))
        assert p["path"] == ("dense" if p["vetoed_by_step_check"] else fastest), p
        decided_at.add(p["decided_at"])
    checks = info["step_checks"]
    assert all(c["buckets"] and c["plan_ms"] > 0 for c in checks)
    for p in info["paths"].values():  # vetoed: by a step check that did not keep its plan
        assert not p["vetoed_by_step_check"] or (checks and not checks[-1]["kept"] and p["path"] == "dense"), p
    start = min(decided_at)
    settled = max(decided_at | {c["at"] for c in checks})
    assert settled < STEPS
    assert any(omni for _, omni in steps[1:start]) and any(dense for dense, _ in steps[1:start])  # all timed
    dense = sum(_counted_dense(p) for p in info["paths"].values())
    assert all(s == [dense, len(info["paths"]) - dense] for s in steps[settled:])


def _counted_dense(decision: dict) -> bool:
    """Whether a decided bucket counts as dense in the steps: the dense all-reduce, or the collective
    engine on a bucket so small that the engine takes the dense all-reduce whole (float32)."""
    from omnireduce.engines.plan import goes_dense

    return decision["path"] == "dense" or (decision["path"] == "collective"
                                           and goes_dense(decision["numel"], 4, WORLD))


def test_path_choice_table_reports_the_rows(rows: dict[str, dict]) -> None:
    from ombench.tables import path_choice_markdown

    thr, mea = rows["omnireduce-threshold"], rows["omnireduce"]
    line = path_choice_markdown({"meta": {"warmup": 25}, "rows": [thr, mea]}).splitlines()[2]  # (measured, checked)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["mlp", "loopback", "-", f"{thr['median_step_s'] * 1e3:.1f}",
                         f"{mea['median_step_s'] * 1e3:.1f}"]  # (no allreduce row in this run)
    assert cells[6] == f"{mea['median_step_s'] / thr['median_step_s']:.2f}"
    assert cells[7] == "1 / 0"  # the threshold rule: the one bucket dense in every timed step
    (decision,) = mea["omnireduce"]["paths"].values()
    assert cells[8] == ("1 / 0" if _counted_dense(decision) else "0 / 1")
    assert cells[9].startswith(f"0 {decision['path']} (")
