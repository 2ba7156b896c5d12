"""The hierarchy under DDP as a user runs it: real torchrun, one invocation per node sharing a c10d
rendezvous on loopback (so that every node has its own torchrun node rank), colocated aggregators.
For each layout, plain DDP, the hook on the flat path and the hook on the hierarchy train the same
model on the same data (tests/scripts/hier_ddp.py); their parameters must agree within 1e-5 after
every step (half precision: within its rounding), for dense and sparse COO gradients, fp16 and bf16
buckets, ``no_sync``, ``find_unused_parameters`` and ``fuse_optimizer``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from omnireduce.launch.procs import free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "hier_ddp.py")
# Every case is several trainings under real torchrun (one invocation per node): make test-e2e
pytestmark = pytest.mark.e2e

TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}  # (half: relative to the largest parameter)
ALL = [{"name": "dense"}, {"name": "sparse", "sparse": True}, {"name": "fp16", "dtype": "float16"},
       {"name": "bf16", "dtype": "bfloat16"}, {"name": "no_sync", "accumulate": 2},
       {"name": "unused", "find_unused": True}, {"name": "fused", "fused": True}]
BASIC = [{"name": "dense"}, {"name": "sparse", "sparse": True}]


def run_layout(nodes: list[int], configs: list[dict], tmp: Path, timeout: float = 420.0) -> list[dict]:
    """One torchrun per node (``nodes[i]`` ranks on node i); returns every rank's JSON."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("OMNIREDUCE_AGGREGATORS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "OMNIREDUCE_HIERARCHICAL"):
        env.pop(k, None)
    rdzv = ["--nnodes", str(len(nodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", uuid.uuid4().hex]
    cmds = [[sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(k), SCRIPT, str(tmp),
             *[json.dumps(c) for c in configs]] for k in nodes]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    log = "\n".join(outputs)
    assert [p.returncode for p in procs] == [0] * len(nodes), log[-6000:]
    ranks = [json.loads(f.read_text()) for f in sorted(tmp.glob("rank*.json"))]
    assert len(ranks) == sum(nodes), log[-3000:]
    return ranks


def _check(ranks: list[dict], *, hierarchical: bool) -> None:
    for r in ranks:
        for res in r["results"]:
            cfg, tol = res["config"], TOL[res["config"].get("dtype", "float32")]
            assert max(res["flat"]) <= tol, (r["rank"], cfg, "flat", res["flat"])
            assert max(res["hier"]) <= tol, (r["rank"], cfg, "hierarchical", res["hier"])
            assert res["flat_vs_hier"] <= 2 * tol, (r["rank"], cfg, res["flat_vs_hier"])
            assert res["hier_stats"]["hierarchical"] is hierarchical, (r["rank"], cfg, res["hier_stats"])
            assert not res["flat_stats"]["hierarchical"]
            if hierarchical:
                assert res["hier_stats"]["bytes_in_node"] > 0
                assert res["hier_stats"]["bytes_across_nodes"] < res["flat_stats"]["bytes_sent"], (r["rank"], cfg)


def test_two_nodes_of_two_every_kind_of_bucket(tmp_path: Path) -> None:
    _check(run_layout([2, 2], ALL, tmp_path), hierarchical=True)


@pytest.mark.parametrize("nodes", [[2, 2, 2], [3, 3]], ids=["3x2", "2x3"])
def test_three_nodes_of_two_and_two_of_three(tmp_path: Path, nodes: list[int]) -> None:
    _check(run_layout(nodes, BASIC, tmp_path), hierarchical=True)


def test_the_collective_engine_on_the_rails_and_flat(tmp_path: Path) -> None:
    """engine="collective": the rails' members (and, flat, all ranks) sum each other's blocks through
    the process group; the same parameters as plain DDP, and nothing through the aggregators."""
    configs = [{"engine": "collective", **c} for c in ALL if c["name"] in ("dense", "bf16", "no_sync")]
    ranks = run_layout([2, 2], configs, tmp_path)
    _check(ranks, hierarchical=True)
    for r in ranks:
        for res in r["results"]:
            flat, hier = res["flat_stats"], res["hier_stats"]
            assert flat["engine"] == "collective" and flat["collective_reductions"] == flat["buckets_sparse"] > 0, flat
            assert hier["rail_collective_reductions"] == hier["buckets_sparse"] > 0, hier


def test_the_path_choice_on_the_rails(tmp_path: Path) -> None:
    """path="measure": each bucket's shards cross the nodes both ways while it is measured, then the
    way every rank agreed on (the same decisions on every rank, flat and hierarchical); path="dense":
    the rails' dense all-reduce only. The same parameters as plain DDP either way."""
    configs = [{"name": "measure", "path": "measure", "steps": 12}, {"name": "dense-rails", "path": "dense"}]
    ranks = run_layout([2, 2], configs, tmp_path)
    _check(ranks, hierarchical=True)
    for r in ranks:
        measured, dense = r["results"]
        hier = measured["hier_stats"]
        assert hier["buckets_dense"] > 0 and hier["buckets_sparse"] > 0, hier
        assert hier["iterations_measuring"] >= 4, hier
        for name in ("flat", "hier"):
            paths = measured[name + "_paths"]
            assert paths == ranks[0]["results"][0][name + "_paths"], (r["rank"], name, "decided alike on every rank")
            # engine="auto" on Gloo measures the collective engine too: any of the three ways may win
            assert paths["paths"] and all(p["path"] in ("aggregators", "collective", "dense")
                                          for p in paths["paths"].values()), paths
        assert dense["hier_stats"]["buckets_sparse"] == 0 < dense["hier_stats"]["buckets_dense"], dense["hier_stats"]


def test_auto_measures_flat_against_hierarchical_on_whole_steps(tmp_path: Path) -> None:
    """hierarchical left to auto (None) with path="measure": the buckets' paths are measured flat, then
    whole steps with every bucket through the hierarchy, flat and dense are timed, and the buckets go
    the way every rank agreed on (the same decisions and step checks on every rank, recorded in
    stats()); the parameters equal plain DDP's throughout."""
    configs = [{"name": "auto", "path": "measure", "runs": ["auto"], "steps": 18}]
    ranks = run_layout([2, 2], configs, tmp_path)
    ways = {"aggregators", "collective", "dense"}
    for r in ranks:
        (res,) = r["results"]
        assert max(res["auto"]) <= TOL["float32"], (r["rank"], res["auto"])
        stats, paths = res["auto_stats"], res["auto_paths"]
        assert stats["hierarchical"] is True and stats["hierarchy"] == "measured", stats
        assert paths == ranks[0]["results"][0]["auto_paths"], (r["rank"], "decided alike on every rank")
        # 3 paths x 2 calls from iteration 1 (DDP's rebuild), agreed at 8; the check's 3 x 1 steps, agreed at 12
        check = paths["step_checks"][0]
        assert check["chosen"] in ("hierarchical", "flat", "dense") and check["hierarchical_ms"] > 0, check
        for p in paths["paths"].values():
            assert p["phase"] == "decided" and all(p[f"{w}_ms"] for w in ways), p
            assert p["path"].startswith("hier:") == (check["chosen"] == "hierarchical"), (p, check)
            assert p["path"].removeprefix("hier:") in ways, p
        assert stats["bytes_in_node"] > 0, "the hierarchy ran in the check"


def test_compressed_buckets_take_the_hierarchy(tmp_path: Path) -> None:
    """OmniReduceState(compression=BlockTopK(...)) on the hierarchy: every bucket compressed after one
    dense step, its compacted blocks summed in the node, across the nodes by rail (the aggregators, or
    the rails' dense all-reduce), shared in the node. At density 1 the parameters equal plain DDP's; at
    0.1 the same blocks go flat and hierarchical (the selection's scores are all-reduced over every
    rank either way), so the two runs agree within float rounding."""
    configs = [{"name": "density1", "compression": 1.0, "steps": 4},
               {"name": "density0.1", "compression": 0.1, "steps": 6},
               {"name": "density0.1-dense-rails", "compression": 0.1, "steps": 6, "path": "dense"}]
    ranks = run_layout([2, 2], configs, tmp_path)
    for r in ranks:
        for res in r["results"]:
            name, hier, in_node = res["config"]["name"], res["hier_stats"], res["hier_in_node"]
            assert hier["hierarchical"] is True, (r["rank"], name, hier)
            grew = [b > a for a, b in zip([0, *in_node[:-1]], in_node, strict=True)]
            assert all(grew), (name, "every step summed in the node", in_node)
            comp = res["hier_compression"]
            shape = {i: (c["blocks"], c["k"]) for i, c in comp.items()}
            assert shape and shape == {i: (c["blocks"], c["k"]) for i, c in res["flat_compression"].items()}, comp
            if name == "density1":
                assert max(res["hier"]) <= TOL["float32"] and max(res["flat"]) <= TOL["float32"], (r["rank"], res)
                continue
            assert all(c["k"] < c["blocks"] for c in comp.values()), comp
            assert max(res["hier"]) > 1e-3, (r["rank"], name, "compressed: not plain DDP's parameters")
            assert res["flat_vs_hier"] <= 2 * TOL["float32"], (r["rank"], name, res["flat_vs_hier"])
            assert hier["bytes_across_nodes"] < res["flat_stats"]["bytes_sent"], (hier, res["flat_stats"])
            if name.endswith("dense-rails"):
                assert hier["buckets_sparse"] == 0 < hier["buckets_dense"], hier


def test_uneven_nodes_take_the_flat_path(tmp_path: Path) -> None:
    _check(run_layout([2, 1], BASIC, tmp_path), hierarchical=False)
