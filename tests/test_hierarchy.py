"""The hierarchy's three steps (omnireduce.engines.hierarchy) in real processes over real Gloo groups: nodes
emulated by node names, the rail reduced by Gloo or by omnireduce; results against the float64 sum of
every rank's inputs, for sizes that are not a multiple of the node size, empty, fp16 and bf16."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.engines.hierarchy import Topology
from omnireduce.launch.procs import free_port
from tests.harness import RankPool

# many small buffers too: steps 1 and 3 of different buffers then overlap on every rank, in a
# different order on each (two threads issuing into one group interleave differently: a hang)
SIZES = [1, 3, 1000, 4099, 0, 65536 + 7, *range(5, 400, 13)]
ROWS = (0, 1, 37, 300)  # sparse COO gradients of a 500 x 8 table: rows looked up (duplicates included)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def test_topology_from_names() -> None:
    t = Topology.from_names(["b", "a", "b", "a"], rank=3)
    assert t.nodes == ((0, 2), (1, 3)) and t.node == 1 and t.local_rank == 1 and t.local_size == 2
    assert t.even and t.shared and t.rail(0) == (0, 1) and t.rail(1) == (2, 3)
    assert t.describe() == "2 node(s) x 2 rank(s)"
    u = Topology.from_names(["a", "a", "b"], rank=2)
    assert not u.even and u.describe() == "2 nodes of 2 + 1 ranks" and u.local_rank == 0
    assert not Topology.from_names(["a", "b"], 0).shared


def _check(out: list[dict], dtype: str) -> None:
    for r in out:
        assert r["on"], r["why"]
        assert all(r["coalesced"]), r["coalesced"]
        for got, want in zip(r["results"], r["expected"], strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_two_nodes_of_two_with_a_gloo_rail(pool: RankPool, dtype: str) -> None:
    out = pool.call("tests.hierarchy_cases:three_steps", 4, port=free_port(), nodes=[0, 1, 0, 1], sizes=SIZES,
                    seed=np.random.SeedSequence().entropy % 2**32, dtype=dtype, rail="gloo", rows=ROWS)
    assert [r["nodes"] for r in out] == [[[0, 2], [1, 3]]] * 4 and [r["local_rank"] for r in out] == [0, 0, 1, 1]
    _check(out, dtype)


@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 0, 0]])
def test_omnireduce_across_the_rails(pool: RankPool, aggregator, layout: list[int]) -> None:
    out = pool.call("tests.hierarchy_cases:three_steps", 4, port=free_port(), nodes=layout, sizes=SIZES,
                    seed=np.random.SeedSequence().entropy % 2**32, dtype="float32", rail="omnireduce",
                    aggregator=aggregator.address, job=f"hier{free_port()}", setting=True, rows=ROWS)
    _check(out, "float32")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rail", ["gloo", "omnireduce"])
def test_cuda_tensors_through_gloo_on_one_gpu(pool: RankPool, aggregator, rail: str) -> None:
    # 2 nodes x 2 ranks sharing one GPU through Gloo (NCCL needs a GPU per rank): the CUDA code path
    out = pool.call("tests.hierarchy_cases:three_steps", 4, port=free_port(), nodes=[0, 0, 1, 1], sizes=SIZES[:6],
                    seed=np.random.SeedSequence().entropy % 2**32, dtype="float32", rail=rail, rows=ROWS,
                    aggregator=aggregator.address, job=f"hiercuda{free_port()}", device="cuda")
    _check(out, "float32")


def test_uneven_nodes_and_one_rank_per_node_stay_flat(pool: RankPool) -> None:
    out = pool.call("tests.hierarchy_cases:three_steps", 3, port=free_port(), nodes=[0, 0, 1], sizes=[10], seed=1,
                    dtype="float32", rail="gloo")
    assert not any(r["on"] for r in out) and "2 + 1" in out[0]["why"]
    out = pool.call("tests.hierarchy_cases:three_steps", 2, port=free_port(), nodes=[0, 1], sizes=[10], seed=1,
                    dtype="float32", rail="gloo")
    assert not any(r["on"] for r in out) and "one rank" in out[0]["why"]
    out = pool.call("tests.hierarchy_cases:three_steps", 2, port=free_port(), nodes=[0, 0], sizes=[10], seed=1,
                    dtype="float32", rail="gloo")
    assert not any(r["on"] for r in out) and "one node" in out[0]["why"]


def test_one_node_forced_hierarchical_sums_inside_the_node(pool: RankPool, aggregator) -> None:
    # hierarchical=True on one host: reduce-scatter and all-gather only (no rail, no omnireduce job)
    out = pool.call("tests.ddp_cases:parity", 2, port=free_port(), aggregator=aggregator.address,
                    configs=[{"hierarchical": True, "steps": 3}, {"hierarchical": True, "fused": True, "steps": 3}])
    for r in out:
        for res in r:
            assert all(res["allclose"]) and all(res["grads_allclose"]), res
            assert res["stats"]["hierarchical"] and res["stats"]["bytes_in_node"] > 0, res["stats"]
            assert res["stats"]["buckets_sparse"] == 0 and res["stats"]["bytes_sent"] == 0, res["stats"]


def test_an_aggregator_lost_and_back_under_the_hierarchy_leaves_training_exact(pool: RankPool, tmp_path) -> None:
    # 2 nodes x 2 ranks, two dedicated aggregators: one dies at step 10 (lost, its slots rerouted on
    # the flat and the rail workers alike) and is started again at step 25 (taken back by all)
    from tests.test_lost_aggregator import _check_training, lost_and_back

    res, _addresses, used = lost_and_back(pool, tmp_path, 4, nodes=[0, 0, 1, 1], hierarchical=True, settle=True)
    _check_training(res)
    for rank, r in enumerate(res):
        assert r["stats"]["hierarchical"] and r["stats"]["bytes_in_node"] > 0, f"rank {rank}: {r['stats']}"
        assert r["in_use"][13:25] == [1] * 12 and r["in_use"][28:] == [2] * 12, f"rank {rank}: {r['in_use']}"
    assert used > 0, "the restarted aggregator completed no slot"


def test_a_killed_rank_makes_every_other_rank_raise_in_time(pool: RankPool, tmp_path) -> None:
    import json

    timeout = 8.0
    try:
        with pytest.raises(TimeoutError, match="rank 3: its process died"):  # (the pool restarts it)
            pool.call("tests.ddp_cases:rank_dies", 4, port=free_port(), nodes=[0, 0, 1, 1], victim=3, step=3,
                      hook_timeout=timeout, out=str(tmp_path), timeout=120)
    finally:
        for i in range(pool.size):  # the survivors still hold process groups with a dead member
            pool._restart(i)
    for rank in range(3):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["hierarchical"] and r["error"] is not None, f"rank {rank}: {r}"
        assert r["elapsed"] < 3 * timeout, f"rank {rank} raised after {r['elapsed']:.1f} s: {r['error']}"
