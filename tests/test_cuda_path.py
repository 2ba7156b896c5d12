"""CUDA tensors through the worker and the DDP hook (needs a CUDA device; skipped without one).

Without a GPU the same code path runs with torch ops on CPU tensors in test_allreduce.py and
test_ddp.py (OMNIREDUCE_DEVICE_PATH=1); these tests add the real streams, events, pinned copies
and kernels.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.procs import free_port
from tests.harness import Case, assert_matches, make_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _reduce_on_gpu(aggregator, job: str, cases: list[Case], world_size: int, average: bool = False) -> list:
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            side = torch.cuda.Stream()
            with omnireduce.Worker([aggregator.address], rank=r, world_size=world_size, job=job, timeout=30) as w:
                outs = []
                for c in cases:
                    with torch.cuda.stream(side):  # produced on a non-default stream
                        x = torch.from_numpy(make_values(c, r)).to(
                            {"float32": torch.float32, "float16": torch.float16,
                             "bfloat16": torch.bfloat16}[c.dtype]).cuda(non_blocking=True) * 1
                        w.allreduce(x, average=average)
                    outs.append(x.float().cpu().numpy().astype(np.float64))
                results[r] = outs
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    return [results[r] for r in range(world_size)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_tensors_match_reference(aggregator, job: str, dtype: str) -> None:
    cases = [Case(n, dtype=dtype, density=d, seed=i, specials=True)
             for i, (n, d) in enumerate([(1, 1.0), (1000, 0.3), (262_147, 0.01), (1 << 20, 1.0), (0, 0.0)])]
    for per_rank in _reduce_on_gpu(aggregator, job, cases, 3):
        for case, got in zip(cases, per_rank, strict=True):
            assert_matches(case, 3, got)


def test_result_stream_with_and_without_synchronize(aggregator, job: str) -> None:
    """``future.stream`` is the side stream that wrote the result. By default the future completes
    once the writes are done; with ``synchronize=False`` as soon as they are queued, and a reader
    makes its stream wait for ``future.stream``. Host inputs have no stream."""
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=30) as w:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        want = x.clone()
        queued = w.allreduce_async(x, synchronize=False)
        queued.result(60)
        assert isinstance(queued.stream, torch.cuda.Stream) and queued.stream != torch.cuda.current_stream()
        torch.cuda.current_stream().wait_stream(queued.stream)
        assert torch.equal(x, want)
        done = w.allreduce_async(x)
        done.result(60)
        assert done.stream == queued.stream and done.stream.query()  # its writes have run
        assert torch.equal(x, want)
        host = w.allreduce_async(np.ones(10, np.float32))
        host.result(60)
        assert host.stream is None and "cuda_stream" not in host.info


def test_cuda_hook_matches_ddp(aggregator) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, aggregator.address, q)) for r in range(2)]
    [p.start() for p in procs]
    out = [q.get(timeout=300) for _ in procs]
    [p.join(60) for p in procs]
    for r in out:
        assert r["ok"], r
        assert r["stats"]["buckets_sparse"] > 0 and r["stats"]["buckets_failed"] == 0, r


def _ddp_rank(rank: int, world: int, port: int, address: str, q) -> None:
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from omnireduce.ddp import OmniReduceState, omnireduce_hook

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.EmbeddingBag(50_000, 32, mode="sum"), torch.nn.Linear(32, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
        ref = DistributedDataParallel(copy.deepcopy(base))
        mine = DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)
        state = OmniReduceState(aggregators=[address], dense_fallback=False)
        mine.register_comm_hook(state, omnireduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, mine)]
        g = torch.Generator().manual_seed(rank)
        ok = True
        for _ in range(5):
            x = torch.randint(0, 50_000, (64, 8), generator=g).cuda()
            for m, o in zip((ref, mine), opts, strict=True):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
            ok &= all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref.parameters(),
                                                                                 mine.parameters(), strict=True))
        q.put({"rank": rank, "ok": bool(ok), "stats": {k: v for k, v in state.stats().items() if k != "density"}})
        state.worker.close()
        dist.destroy_process_group()
    except BaseException as e:
        q.put({"rank": rank, "ok": False, "error": repr(e)})
