"""The engine's kernel exchange on a GPU: the CUDA kernels (``csrc/exchange.cu``) give the bits of the
engine's torch ops on CUDA tensors, and (NaN payloads aside) of the same steps run on the host, which
every machine tests (tests/test_engine_exchange.py); at one rank (no transport), and at two and three
ranks sharing the GPU through NCCL's sockets. Skipped without a GPU; the GPU check's NCCL part runs it."""

from __future__ import annotations

import pytest
import torch

from omnireduce.launch.procs import free_port
from tests.harness import RankPool
from tests.test_engine_exchange import _KERNEL_CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernels cannot run")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_cuda_kernel_exchange_gives_the_torch_ops_and_the_hosts_bits(pool: RankPool, world_size: int) -> None:
    cases = [dict(c, **way) for c in _KERNEL_CASES for way in ({"in_place": False}, {"kernels": True})]
    on_gpu = pool.call("tests.engine_cases:dispatched", world_size, port=free_port(), cases=cases, device="cuda")
    on_host = pool.call("tests.engine_cases:dispatched", world_size, port=free_port(), cases=cases)
    for rank, (gpu, host) in enumerate(zip(on_gpu, on_host, strict=True)):
        for case, ops_way, kernels_way, host_way in zip(_KERNEL_CASES, gpu[::2], gpu[1::2], host[1::2], strict=True):
            where = f"W={world_size} rank {rank} {case}"
            assert kernels_way["digest"] == ops_way["digest"], f"{where}: the CUDA kernels' bits differ from torch ops'"
            # (a float16 NaN's payload differs: __float2half_rn makes 0x7FFF, the host 0x7E00, as torch on each)
            assert kernels_way["digest_nan"] == host_way["digest_nan"], \
                f"{where}: the CUDA kernels' bits differ from the host steps' (NaN payloads aside)"
            for key in ("exchange", "overflow", "collectives", "counts"):
                assert kernels_way[key] == ops_way[key] == host_way[key], (where, key)
            assert kernels_way["reads"] == ["the blocks' counts"], where
            assert kernels_way["specials"], where
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[case["dtype"]]
            assert kernels_way["err"] <= tol * max(kernels_way["scale"], 1e-30) + 1e-30, (where, kernels_way["err"])
