"""fuse_optimizer with a GradScaler: the same training as scaler.step() without fusion, inf steps included.

Real Gloo process groups of 2 ranks (tests.ddp_cases:amp_parity): autocast (bfloat16, float16) with
torch.amp.GradScaler and fused AdamW/SGD, through omnireduce_hook and through torch's default
all-reduce hook, each against plain DDP with ``scaler.step(opt)``; a step where rank 1's last bucket
holds an inf must be skipped on every rank and back the scale off as the reference's does.
"""

from __future__ import annotations

import pytest
import torch

from omnireduce.ddp import fuse_optimizer, omnireduce_hook
from omnireduce.launch.procs import free_port
from tests.harness import RankPool

INF_STEP = 3
CONFIGS = [
    {"dtype": "bfloat16", "optimizer": "adamw", "hook": "omnireduce", "inf_step": INF_STEP},
    {"dtype": "float16", "optimizer": "sgd", "hook": "omnireduce", "inf_step": INF_STEP},
    {"dtype": "float16", "optimizer": "adamw", "hook": "allreduce", "inf_step": INF_STEP},
    {"dtype": "bfloat16", "optimizer": "sgd", "hook": "allreduce", "inf_step": INF_STEP},
]


def _check(results: list[list[dict]]) -> None:
    for rank, per_config in enumerate(results):
        for r in per_config:
            cfg = r["config"]
            assert all(r["ok"]), f"rank {rank} {cfg}: parameters differ from unfused: {r['max_abs_diff']}"
            assert r["scales"] == r["ref_scales"], (rank, cfg, r["scales"], r["ref_scales"])
            # the inf step: skipped in the reference and here, on every rank; the other steps train
            expect = [i == INF_STEP for i in range(len(r["unchanged"]))]
            assert r["ref_unchanged"] == expect, (rank, cfg, r["ref_unchanged"])
            assert r["unchanged"] == expect, (rank, cfg, r["unchanged"])
            scales = r["scales"]
            assert scales[INF_STEP] == scales[INF_STEP - 1] / 2, (cfg, scales)  # backed off
            assert max(scales) > scales[0], (cfg, scales)  # and grown after growth_interval good steps
            assert r["buckets"] > 1, f"{cfg}: expected several buckets"
            if cfg["hook"] == "omnireduce":
                assert r["sparse"] > 0, f"{cfg}: no bucket went through omnireduce"


def test_scaled_fused_steps_match_scaler_step(pool: RankPool, aggregator) -> None:
    _check(pool.call("tests.ddp_cases:amp_parity", 2, port=free_port(), aggregator=aggregator.address,
                     configs=CONFIGS))


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused() -> None:
    params = torch.nn.Linear(4, 4).parameters()
    with pytest.raises(ValueError, match=r"AdamW does not.*fused=True"):
        fuse_optimizer(omnireduce_hook, torch.optim.AdamW(params), scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_fused_steps_match_scaler_step_on_cuda(pool: RankPool, aggregator) -> None:
    """Both ranks share GPU 0 through Gloo."""
    _check(pool.call("tests.ddp_cases:amp_parity", 2, port=free_port(), aggregator=aggregator.address,
                     configs=CONFIGS, device="cuda:0"))


def test_a_failed_bucket_fails_backward_without_a_step(pool: RankPool) -> None:
    try:
        for r in pool.call("tests.ddp_cases:amp_failed_bucket", 2, port=free_port(), timeout=120):
            assert r["error"] and "bucket 0 failed" in r["error"], r
            assert r["elapsed"] < 30 and r["unchanged"], r
    finally:
        for k in range(pool.size):  # these processes hold a DDP model and a process group after a failed backward
            pool._restart(k)
