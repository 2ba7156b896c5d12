"""DDP with sparse embedding gradients: omnireduce_hook against default DDP, step by step, in real Gloo
process groups of 2 and 3 ranks (runs in tests/sparse_ddp_cases.py).

Every config checks, after every step, the reduced gradients and the parameters against default
DDP (its sparse gradients summed as dense tensors: Gloo's sparse all-reduce corrupts the heap, see
tests/sparse_ddp_cases.py) within rtol 1e-5, on CPU tensors and (with a GPU) CUDA tensors;
that the sparse buckets took omnireduce's path (``stats()["buckets_coo"]``) and that no sparse
tensor reached the process group (so the backend does not matter: NCCL has no sparse all-reduce).
"""

from __future__ import annotations

import pytest

from omnireduce.ddp.bucket import aligned_block_size
from omnireduce.launch.procs import free_port
from tests.harness import RankPool

CONFIGS_2 = [
    {"model": "bag_sum", "optimizer": "sgd"},
    {"model": "bag_mean", "optimizer": "sgd_momentum", "bucket_view": True},
    {"model": "padding", "optimizer": "sgd"},
    {"model": "mixed", "optimizer": "sgd_momentum", "find_unused": True},
    {"model": "mixed", "optimizer": "sparse_adam", "accumulate": 2},
    {"model": "mixed", "optimizer": "sparse_adam", "fused": True},
    {"model": "mixed", "optimizer": "sgd", "fused": True, "pickled": True, "dense_fallback": True},
    {"model": "mixed", "optimizer": "sgd_momentum", "engine": "collective", "find_unused": True},
    {"model": "mixed", "optimizer": "sparse_adam", "fused": True, "engine": "collective"},
]
CONFIGS_3 = [
    {"model": "bag_sum", "optimizer": "sgd_momentum"},
    {"model": "bag_mean", "optimizer": "sgd"},
    {"model": "padding", "optimizer": "sgd_momentum", "accumulate": 2},
    {"model": "mixed", "optimizer": "sgd", "find_unused": True, "fused": True},
    {"model": "mixed", "optimizer": "sparse_adam"},
    {"model": "mixed", "optimizer": "sgd", "engine": "collective"},  # (last: the seeds above stay theirs)
]


CONFIGS_CUDA = [dict(c, device="cuda") for c in (
    {"model": "bag_sum", "optimizer": "sgd"},
    {"model": "mixed", "optimizer": "sgd_momentum", "find_unused": True},
    {"model": "mixed", "optimizer": "sparse_adam", "fused": True},
    {"model": "mixed", "optimizer": "sgd", "fused": True, "dense_fallback": True},
    {"model": "mixed", "optimizer": "sgd_momentum", "engine": "collective"},
)]


@pytest.mark.parametrize("world_size,configs", [(2, CONFIGS_2), (3, CONFIGS_3)])
def test_sparse_gradients_match_default_ddp(pool: RankPool, aggregator, world_size: int, configs: list) -> None:
    _check_parity(pool, aggregator, world_size, configs)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_sparse_cuda_gradients_match_default_ddp(pool: RankPool, aggregator) -> None:
    # 2 ranks sharing one GPU through Gloo (whose sparse all-reduce takes CUDA tensors): the sparse
    # COO path on CUDA tensors, against default DDP on the same device
    _check_parity(pool, aggregator, 2, CONFIGS_CUDA)


def _check_parity(pool: RankPool, aggregator, world_size: int, configs: list) -> None:
    results = pool.call("tests.sparse_ddp_cases:parity", world_size, port=free_port(), aggregator=aggregator.address,
                        configs=configs)
    for rank, per_config in enumerate(results):
        for r in per_config:
            cfg, st = r["config"], r["stats"]
            assert all(r["grads_ok"]), f"rank {rank} {cfg}: reduced gradients differ from DDP's: {r['grad_diff']}"
            assert all(r["params_ok"]), f"rank {rank} {cfg}: parameters differ from DDP's: {r['params_ok']}"
            assert r["moved"] > 1e-3, f"{cfg}: the parameters did not train"
            assert st["buckets_failed"] == 0, (cfg, st)
            tables = 2 if cfg["model"] == "mixed" else 1
            steps = 5
            assert st["buckets_coo"] == tables * steps, (cfg, st)  # every sparse bucket, every step
            assert r["sparse_to_group"] == 0, f"{cfg}: a sparse gradient went through the process group"
            if cfg.get("engine") == "collective":  # every bucket through the engine, the sparse ones too
                assert st["collective_reductions"] >= steps and st["engine"] == "collective", (cfg, st)


def test_block_size_follows_the_largest_tables_rows() -> None:
    assert aligned_block_size([(100_000, 200)], 256) == 200
    assert aligned_block_size([(64,), (1000, 16)], 256) == 256  # 16 rows of 16 (the table at offset 64)
    assert aligned_block_size([(64,), (1000, 16)], 16) == 16  # one row per block, asked for
    assert aligned_block_size([(1,), (1000, 200)], 256) == 200  # off the grid: 2 blocks of 200 at most
    assert aligned_block_size([(1,), (1000, 400)], 256) == 256  # off the grid and wider than the block: as is
    assert aligned_block_size([(300, 400), (100, 200), (300, 200)], 256) == 400  # the width with most elements
    assert aligned_block_size([(1000,), (10,)], 256) == 256  # no table
    assert aligned_block_size([(3, 4, 5)], 64) == 60
    assert aligned_block_size([(1000, 3)], 256) == 255  # narrow rows: 85 per block
