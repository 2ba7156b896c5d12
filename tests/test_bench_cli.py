"""omnireduce-bench (:mod:`omnireduce.bench`): its sizes and inputs, and the command itself under torchrun on
real Gloo ranks, with the aggregators and the DDP hook beside the engine, every result checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnireduce.bench import cli, inputs, table


def test_sizes_as_nccl_tests_take_them() -> None:
    assert cli.size_bytes("1M") == 1 << 20 and cli.size_bytes("64k") == 65536 and cli.size_bytes("1000") == 1000
    assert cli.sizes(1 << 20, 16 << 20, 4) == [1 << 20, 4 << 20, 16 << 20]
    assert cli.sizes(1000, 1000, 2) == [1000]
    with pytest.raises(ValueError, match="-f"):
        cli.sizes(1, 10, 1)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--placement", "diagonal"])
    with pytest.raises(SystemExit):
        cli.parse_args(["-d", "0.5,2"])
    assert cli.parse_args(["--vs-hook"]).op == "avg"  # (DDP averages: the functional call is timed the same way)


@pytest.mark.parametrize("placement", ["random", "overlap"])
def test_inputs_have_their_density_and_placement(placement: str) -> None:
    numel, block = 100_003, 256  # 391 blocks, the last one short
    xs = [inputs.sparse(numel, 0.1, rank=r, block=block, placement=placement, seed=4) for r in range(3)]
    masks = [torch.nn.functional.pad(x, (0, 391 * block - numel)).reshape(391, block).ne(0).any(1) for x in xs]
    assert all(int(m.sum()) == 39 for m in masks)  # int(391 * 0.1) blocks on each rank
    same = all(torch.equal(masks[0], m) for m in masks)
    assert same == (placement == "overlap")
    assert not torch.equal(xs[0], xs[1])  # values of each rank's own
    assert torch.equal(xs[0], inputs.sparse(numel, 0.1, rank=0, block=block, placement=placement, seed=4))
    dense = inputs.sparse(1000, 1.0, rank=0, block=block)
    assert bool(dense.ne(0).all()) and not inputs.sparse(1000, 0.0, rank=0).any()
    one = [inputs.one_block(5000, rank=r) for r in range(2)]
    assert [int(x.ne(0).sum()) for x in one] == [256, 256] and torch.equal(one[0].ne(0), one[1].ne(0))


def test_a_row_prints_in_the_heading_columns() -> None:
    row = {"bytes": 16 << 20, "elements": 4 << 20, "dtype": "float32", "density": 0.01, "placement": "random",
           "unit_us": 600.0, "ring_bytes": 3 * (16 << 20) // 2, "dense_ms": 27.0, "dense_algbw": 0.62,
           "dense_busbw": 0.93, "engine_ms": 16.4, "engine_algbw": 1.02, "engine_busbw": 1.53, "engine_speedup": 1.65,
           "engine_units": 25.0, "engine_bytes": 0.025 * 3 * (16 << 20) // 2, "engine_wrong": 0}
    head = table.heading([row])
    line = table.line(row, table.methods([row]))
    assert table.methods([row]) == ["dense", "engine"]
    assert len(line) == len(head[1]), (line, head[1])
    assert "16M" in line and "1.65x" in line and "2.5%" in line and line.endswith("0")


@pytest.mark.e2e  # (torchrun and 2 ranks: make test-e2e)
def test_the_command_under_torchrun(tmp_path: Path, aggregator) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMNIREDUCE_AGGREGATORS=aggregator.address, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "omnireduce.bench", "-b", "64K", "-e", "1M", "-f", "16", "-d", "0.01,1",
                           "--placement", "random,overlap", "-n", "2", "-w", "1", "--check", "--vs-hook",
                           "--json", str(out)], capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    head, rows = doc["header"], doc["rows"]
    assert head["world_size"] == 2 and head["nodes"] == 1 and head["backend"] == "gloo" and head["aggregators"] == 1
    assert [(r["bytes"], r["density"], r["placement"]) for r in rows] == [
        (b, d, p) for b in (1 << 16, 1 << 20) for d in (0.01, 1.0) for p in ("random", "overlap")]
    for r in rows:
        assert r["op"] == "avg" and r["world"] == 2 and r["unit_us"] > 0
        for m in ("engine", "aggregators", "hook"):
            assert r[f"{m}_ms"] > 0 and r[f"{m}_busbw"] == pytest.approx(r[f"{m}_algbw"]), (m, r)  # W=2: busbw = algbw
        assert r["engine_wrong"] == 0 and r["aggregators_wrong"] == 0 and r["hook_wrong"] == 0, r
        assert r["ring_bytes"] == r["bytes"]  # 2 (W-1)/W = 1
        if r["density"] < 1 and r["bytes"] == 1 << 20:
            assert 0 < r["engine_bytes"] < 0.1 * r["ring_bytes"] and 0 < r["aggregators_bytes"] < 0.1 * r["ring_bytes"]
    text = proc.stdout
    assert "# backend gloo, world size 2, 1 node(s)" in text and "DDP hook" in text and "aggregators" in text
    assert "# check: every result agrees" in text
