"""CUDA graphs of the collective engine on a GPU (``OMNIREDUCE_CUDA_GRAPHS=1``): the guarded sum kernel,
and the engine with graphs against the engine without, every dtype, through an overflow of the
capacity, at one rank and at two sharing the GPU through NCCL's sockets. Skipped without a GPU; the
GPU check's NCCL part runs it (with tests/test_cuda_exchange.py), and ``gpu_nccl_check.py graphs``
times it. tests/test_graphs.py checks the same on the host with a stand-in for the graphs."""

from __future__ import annotations

import pytest
import torch

from omnireduce.launch.procs import free_port
from tests.harness import RankPool
from tests.test_graphs import _CASES, _check_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: no CUDA graph")


def test_the_guarded_sum_kernel_writes_nothing_past_the_limit() -> None:
    from omnireduce.cuda import build

    x0 = torch.zeros(256 * 40 + 17, device="cuda")
    k = build.extension_for(x0)
    if k is None or not hasattr(k, "sum_blocks_within"):
        pytest.skip("the CUDA extension (with sum_blocks_within) is not built here")
    W, B, n, cap = 2, 256, x0.numel(), 41
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [(torch.randn(n, generator=g, device="cuda") * (torch.rand(n, generator=g, device="cuda") < 0.05))
          for _ in range(W)]
    nb = -(-n // B)
    head = 16 * -(-nb // 128)
    gathered = torch.zeros(W, head + cap * B * 4, dtype=torch.uint8, device="cuda")
    for r in range(W):
        k.record(xs[r], B, 0.0, gathered[r], head, cap)
    bits, prefix, counts = k.counts(gathered, nb, 1024, False)
    first = gathered[:, head:].view(torch.float32).view(W, cap, B)
    plain = xs[0].clone()
    k.sum_blocks(plain, B, bits, prefix, W, 0, W, first, None, 0.5)
    most = int(counts[:W].max())
    for limit, writes in ((most, True), (cap, True), (most - 1, False), (0, False)):
        got = xs[0].clone()
        k.sum_blocks_within(got, B, bits, prefix, W, 0, W, first, None, 0.5, counts, limit)
        assert torch.equal(got, plain if writes else xs[0]), (limit, most)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_graphs_give_the_uncaptured_bits(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.graph_cases:with_and_without", world_size, port=free_port(), cases=_CASES,
                        graphs_on=list(range(world_size)), device="cuda",
                        env={"OMNIREDUCE_ENGINE_KERNELS": "1", "OMNIREDUCE_CUDA_KERNELS": "require"})
    _check_same(results, world_size, _CASES)
    for res in results:
        st = res["stats"]["on"]
        assert st["graph_failures"] == 0 and st["graph_captures"] > 0 and st["graph_replays"] > 0, st
        assert st["graph_fallbacks"] == len(_CASES), st  # (one overflow a case)
