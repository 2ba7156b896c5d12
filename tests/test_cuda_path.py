"""CUDA tensors through the worker and the DDP hook (needs a CUDA device; skipped without one).

Without a GPU the same code path runs with torch ops on CPU tensors in test_allreduce.py,
test_ddp.py and test_device_path.py (OMNIREDUCE_DEVICE_PATH=1); these tests add the real streams,
events, pinned copies and kernels: stream ordering (a late producer stream, a late side-stream
scatter, under DDP and fuse_optimizer), no host-device sync on the training thread, omnireduce's
own side stream, no CUDA context on another GPU, a sticky CUDA error, and the worker and the hook
across dtypes, thresholds, averaging, non-contiguous inputs, the dense fallback and replays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.launch.procs import free_port
from tests.device_cases import check_device_ddp
from tests.harness import Case, RankPool, assert_matches, make_values, run_in_threads

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


# -- stream ordering ------------------------------------------------------------------------------

SLEEP = 200_000_000  # cycles of torch.cuda._sleep: about 0.1 s


def test_the_side_stream_waits_for_a_late_producer_stream(aggregator, job: str) -> None:
    """Each rank's tensor is written on a producer stream that is still sleeping when the tensor is
    submitted: compaction must see the written values, not the stale ones."""
    values = [np.random.default_rng(r).standard_normal(300_000).astype(np.float32) for r in range(2)]
    values[0][:100_000] = 0.0

    def rank_main(r: int) -> np.ndarray:
        with omnireduce.Worker([aggregator.address], rank=r, world_size=2, job=job, timeout=30) as w:
            src = torch.from_numpy(values[r]).cuda()
            x = torch.full_like(src, 7.0)  # stale contents
            torch.cuda.synchronize()
            producer = torch.cuda.Stream()
            with torch.cuda.stream(producer):
                torch.cuda._sleep(SLEEP)
                x.copy_(src)
                future = w.allreduce_async(x)
            future.result(60)
            return x.cpu().numpy()

    got = run_in_threads(rank_main, 2, timeout=120)
    for r in range(2):
        np.testing.assert_array_equal(got[r], values[0] + values[1])


def test_the_io_thread_serves_other_tensors_while_a_cuda_tensor_waits_for_its_producer(aggregator, job: str) -> None:
    """The CUDA tensor's compaction waits (on the device's own thread) for a producer stream that
    sleeps about a second; host tensors submitted after it complete meanwhile."""
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=30) as w:
        w.allreduce(torch.ones(1000, device="cuda"))  # kernels and streams ready
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(10 * SLEEP)
        x.fill_(3.0)
        late = w.allreduce_async(x)
        for i in range(5):
            y = np.full(10_000, float(i), np.float32)
            assert np.array_equal(w.allreduce(y), np.full(10_000, float(i), np.float32))
        assert not late.done(), "the GPU finished sleeping before the host tensors: make the sleep longer"
        late.result(60)
        assert torch.equal(x, torch.full((1 << 20,), 3.0, device="cuda"))


def test_hook_and_fused_optimizer_wait_for_late_streams(pool: RankPool, aggregator) -> None:
    """DDP with the hook, and with fuse_optimizer around it: the producer stream sleeps in the middle
    of backward (the embedding's gradients come late) and every scatter of the sums starts late on
    the side stream. DDP's stream must wait for the scatter through the hook's CUDA-aware future, and
    the fused step must wait for it too (it reads the reduced gradient): gradients and parameters
    as with the reference at every step."""
    configs = [{"slow": SLEEP, "delay_scatter": SLEEP // 4, "steps": 4},
               {"slow": SLEEP, "delay_scatter": SLEEP // 4, "steps": 4, "fused": True},
               {"slow": SLEEP, "delay_scatter": SLEEP // 4, "steps": 4, "fused": True, "bucket_view": True}]
    check_device_ddp(pool.call("tests.device_cases:device_ddp", 2, port=free_port(), aggregator=aggregator.address,
                              configs=configs))


# -- no host-device sync on the training thread ---------------------------------------------------


def test_no_host_device_sync_on_the_training_thread(pool: RankPool, aggregator) -> None:
    """A DDP step (the hook runs on the autograd thread) under torch.cuda.set_sync_debug_mode: no
    synchronising CUDA call from omnireduce's code outside its own threads. (13 steps first: DDP
    times its first iterations with CUDA events itself.) The third config decides from densities
    counted on the device (the last step's embedding bucket reads one and goes sparse; the dense
    layers' buckets go through Gloo: a warning at ``_dense``'s all_reduce would be Gloo's CUDA
    path, not the decision). The fourth measures paths with CUDA events and re-measures a bucket
    every other iteration, so its last step times trials and reads earlier ones. The last two compress
    (BlockTopK: density 1, exact against the reference; 0.05, measured among the ways)."""
    configs = [{"sync_debug": True, "steps": 13}, {"sync_debug": True, "steps": 13, "fused": True},
               {"sync_debug": True, "steps": 13, "dense_threshold": 0.5, "alternate": True},
               {"sync_debug": True, "steps": 13, "path": "measure", "measure_trials": 1, "remeasure_every": 2},
               {"sync_debug": True, "steps": 13, "engine": "collective"},
               {"sync_debug": True, "steps": 13, "compression": 1.0},
               {"sync_debug": True, "steps": 13, "compression": 0.05, "lossy": True, "path": "measure",
                "measure_trials": 1}]
    check_device_ddp(pool.call("tests.device_cases:device_ddp", 2, port=free_port(), aggregator=aggregator.address,
                              configs=configs))


def test_the_dense_decision_reads_a_device_density_without_syncing() -> None:
    from omnireduce.config import WorkerConfig
    from omnireduce.ddp.densities import Densities, DeviceDensity, union_density

    cfg = WorkerConfig.resolve(aggregators=["tcp://127.0.0.1:1"], rank=0, world_size=1, job="j", block_size=64)
    t = torch.zeros(64 * 100, device="cuda")
    t[: 64 * 30] = 1.0
    density = union_density(t, cfg)
    assert isinstance(density, DeviceDensity)
    assert density.host.is_pinned() and not density.host.is_cuda
    torch.cuda.synchronize()
    decisions = Densities()
    decisions.remember((0, t.numel()), density)
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert decisions.reaches((0, t.numel()), 0.25) is True  # 0.3 >= 0.25, read from host memory
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert density.value() == 0.3


def test_the_step_check_times_cuda_steps_with_events_and_never_syncs() -> None:
    """The step check's marks on CUDA: events recorded on the current stream, read with query() only
    (under the sync debug mode "error", which raises at a synchronising call); a step whose events
    have not completed is missing, not waited for; once the device is done, both medians are the
    events' elapsed times."""
    from omnireduce.ddp.routing.step_check import StepCheck

    x = torch.ones(1 << 22, device="cuda")

    def steps(read: bool) -> tuple[StepCheck, list[int] | None]:
        check = StepCheck(0, frozenset({(0, 1)}), trials=2)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for it in range(5):  # iterations 0-3 are the check (plan, dense, plan, dense); 4 ends it
                check.mark(it, x)
                for _ in range(20 if check.dense_at(it) else 2):  # the "dense" steps: 10x the work
                    x.mul_(1.0000001)
            return check, (check.proposal() if read else None)  # (query() and elapsed_time() only)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    steps(read=True)  # read at once: whatever has completed (not asserted), without a sync
    check, _ = steps(read=False)
    torch.cuda.synchronize()
    plan, dense = check.proposal()
    assert plan < 0 and dense < 0 and -dense > 3 * -plan, (plan, dense)  # negated microseconds


# -- the worker on CUDA -----------------------------------------------------------------------------


def _thresholded(values: list[np.ndarray], block_size: int, threshold: float) -> np.ndarray:
    total = np.zeros(values[0].size)
    for v in values:
        x = v.astype(np.float64)
        for b in range(0, x.size, block_size):
            if np.all(np.abs(x[b:b + block_size]) <= threshold):
                x[b:b + block_size] = 0.0
        total += x
    return total


def test_worker_averages_thresholds_and_keeps_several_in_flight(aggregator, job: str) -> None:
    """Three ranks (threads) on one GPU, a lossy threshold, averaging: fp32/fp16/bf16 tensors, a
    non-contiguous view, a tensor that is zero on every rank (empty union) and an empty one, all in
    flight at once; each result is the thresholded average, the view's other elements untouched."""
    W, B, threshold = 3, 256, 0.5
    cases = [Case(70_001, density=0.3, seed=1, small=0.5),
             Case(30_000, dtype="float16", density=0.5, seed=2, small=0.5),
             Case(30_000, dtype="bfloat16", density=0.2, seed=3, small=0.5), Case(5_000, density=0.0, seed=4),
             Case(0, density=0.0, seed=5), Case(200 * 300, density=0.4, seed=6, small=0.5)]
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    def rank_main(r: int) -> list:
        with omnireduce.Worker([aggregator.address], rank=r, world_size=W, job=job, timeout=30, block_size=B,
                               threshold=threshold) as w:
            xs = [torch.from_numpy(make_values(c, r)).to(tdtype[c.dtype]).cuda() for c in cases[:-1]]
            wide = torch.full((200, 600), 1000.0 + r, device="cuda")  # the view: every other column
            wide[:, ::2] = torch.from_numpy(make_values(cases[-1], r)).cuda().view(200, 300)
            view = wide[:, ::2]
            assert not view.is_contiguous()
            futures = [w.allreduce_async(x, average=True) for x in [*xs, view]]
            for f in futures:
                f.result(60)
            return [x.float().cpu().numpy() for x in xs] + [wide.cpu().numpy()]

    got = run_in_threads(rank_main, W, timeout=180)
    for i, case in enumerate(cases):
        values = [make_values(case, r) for r in range(W)]
        want = _thresholded(values, B, threshold) / W
        # rounding: of the float32 sum (relative to the addends) and of the result's dtype, which
        # below its normal range is absolute: half its subnormal step (fp16: 3e-8)
        finfo = torch.finfo(tdtype[case.dtype])
        tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[case.dtype] * (
            sum(np.abs(v.astype(np.float64)) for v in values) / W) + finfo.tiny * finfo.eps / 2 if case.numel else 0.0
        for r in range(W):
            out = got[r][i]
            if i == len(cases) - 1:
                assert np.array_equal(out[:, 1::2], np.full((200, 300), 1000.0 + r, np.float32)), "view: untouched"
                out = out[:, ::2]
            err = np.abs(out.reshape(-1).astype(np.float64) - want)
            assert (err <= tol).all(), f"{case} rank {r}: max error {err.max() if err.size else 0:.3g}"
    assert not np.any(got[0][3]), "the empty union: all zero"


def test_a_result_lost_with_the_aggregator_is_replayed_on_cuda(job: str) -> None:
    from tests.test_device_path import replay_after_restart

    replay_after_restart(job, "cuda")


def test_hook_with_half_buckets_dense_fallback_and_copied_gradients(pool: RankPool, aggregator) -> None:
    """DDP on CUDA: fp16 and bf16 buckets (gradient_as_bucket_view off and on), and the dense
    fallback crossing its threshold both ways: the densities it decides from are host copies."""
    configs = [{"dtype": "float16"}, {"dtype": "bfloat16", "bucket_view": True}, {"dtype": "bfloat16"},
               {"dense_threshold": 0.5, "alternate": True, "steps": 6},
               {"dense_threshold": 0.5, "alternate": True, "steps": 6, "fused": True}]
    results = pool.call("tests.device_cases:device_ddp", 2, port=free_port(), aggregator=aggregator.address,
                        configs=configs)
    check_device_ddp(results)
    for per_config in results:
        for r in per_config[3:]:
            assert r["stats"]["buckets_dense"] > 0, r
            assert "DeviceDensity" in r["stored"] and r["pinned"] and all(r["pinned"]), r


# -- omnireduce's own side stream ---------------------------------------------------------------------


def test_the_side_stream_is_omnireduces_own_and_non_blocking() -> None:
    from omnireduce.cuda.runtime import side_stream

    device = torch.device("cuda", 0)
    side = side_stream(torch, device)
    assert isinstance(side, torch.cuda.ExternalStream), "the driver API stream was not created (see the debug log)"
    assert side_stream(torch, device) is side
    pooled = {torch.cuda.Stream(device=device, priority=p).cuda_stream for p in (0, -1, -2, -3, -5) for _ in range(40)}
    assert side.cuda_stream not in pooled, "the side stream is one of torch's pooled streams"
    assert side.cuda_stream != torch.cuda.default_stream(device).cuda_stream
    # non-blocking: it runs while the legacy default stream is busy
    x = torch.ones(10, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(5 * SLEEP)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        y = x * 2
        done.record(side)
    done.synchronize()
    assert not torch.cuda.default_stream(device).query(), "the side stream waited for the default stream"
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((10,), 2.0, device=device))


# -- no CUDA context on another GPU; a sticky CUDA error ---------------------------------------------


ROOT = Path(__file__).resolve().parent.parent

_CONTEXT_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np, torch
    import omnireduce

    address, job = sys.argv[1], sys.argv[2]
    torch.cuda.set_device(1)
    with omnireduce.Worker([address], rank=0, world_size=1, job=job, timeout=30, threshold=0.1) as w:
        x = torch.randn(1 << 20, device="cuda:1")
        x[: 1 << 18] = 0
        want = x.clone()
        w.allreduce(x)  # synchronize=True: the I/O thread polls an event
        f = w.allreduce_async(x, synchronize=False, average=True)
        f.result(60)
        torch.cuda.current_stream(1).wait_stream(f.stream)
        view = torch.randn(300, 400, device="cuda:1")[:, ::2]
        w.allreduce(view)
        ok = bool(torch.equal(x[: 1 << 18].cpu(), torch.zeros(1 << 18)))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    print(json.dumps({"gpu0_context": bool(active.value), "ok": ok}))
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tensor_on_cuda1_makes_no_context_on_gpu0(aggregator, job: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", _CONTEXT_SCRIPT, aggregator.address, job], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"gpu0_context": False, "ok": True}, out


_STICKY_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import omnireduce
    from omnireduce.errors import OmniReduceTimeout

    address, job = sys.argv[1], sys.argv[2]
    with omnireduce.Worker([address], rank=0, world_size=1, job=job, timeout=30) as w:
        w.allreduce(torch.ones(1000, device="cuda"))  # kernels ready, streams made
        x = torch.randn(1 << 20, device="cuda")
        torch.cuda._sleep(400_000_000)
        bad = torch.zeros(4, device="cuda")[torch.full((1,), 1 << 30, device="cuda")]  # device-side assert
        t0 = time.monotonic()
        try:
            f = w.allreduce_async(x)
        except Exception as e:  # the error surfaced already: raised to the caller, fine too
            print(json.dumps({"completed": True, "raised_at_once": True, "error": repr(e)[:300]}))
            sys.exit(0)
        error = f.exception(25)  # raises TimeoutError if it never completes
        print(json.dumps({"completed": True, "raised_at_once": False, "error": repr(error)[:300],
                          "timeout": isinstance(error, OmniReduceTimeout), "elapsed": time.monotonic() - t0,
                          "io_thread_alive": w._io._thread.is_alive()}))
        sys.stdout.flush()
        import os
        os._exit(0)  # the CUDA context is dead: skip the teardown
""")


def test_a_sticky_cuda_error_fails_the_tensor_instead_of_hanging(aggregator, job: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _STICKY_SCRIPT, aggregator.address, job], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}): {proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    assert out["completed"], out
    if not out["raised_at_once"]:
        assert out["error"] != "None" and not out["timeout"], out
        assert out["elapsed"] < 25 and out["io_thread_alive"], out


@pytest.mark.parametrize("options", [{"order": "rank"}, {"exchange": "owners"}, {"exchange": "union"}],
                         ids=["rank-order", "owners", "union"])
def test_collective_engine_on_cuda_gives_the_aggregators_bits(pool: RankPool, aggregator, job: str,
                                                             options: dict[str, str]) -> None:
    """The collective engine on CUDA tensors (2 ranks on one GPU, Gloo between them), each case twice
    (the second gather fuses its bitmap with its blocks): the aggregators' bits through the rank-order
    exchanges, their values through the union's all-reduce (at 2 ranks one addition per element: only
    zeros' signs may differ), and the float64 reference within the dtype's rounding."""
    cases = [Case(70_001, density=0.3, seed=71, specials=True), Case(33_333, dtype="float16", density=0.5, seed=72),
             Case(25_000, dtype="bfloat16", density=0.05, seed=73, kind="torch"), Case(5_000, density=0.0, seed=74)]
    results = pool.call("tests.collective_cases:both_engines", 2, port=free_port(), aggregator=aggregator.address,
                        job=job, cases=cases, average=True, device="cuda:0", options=options, repeat=2)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            for r in per_rank[2 * i: 2 * i + 2]:
                if options.get("exchange") == "union":
                    assert np.array_equal(r["values"], r["aggregators_values"], equal_nan=True), f"rank {rank} {case}"
                else:
                    assert r["collective"] == r["aggregators"], f"rank {rank} {case}"
                assert_matches(case, 2, r["values"], average=True)
        stats = per_rank[-1]["stats"]
        assert stats["device_reductions"] == 2 * len(cases) and stats["host_waits"] == 2 * len(cases), stats

