"""The collective engine (:mod:`omnireduce.engines.collective`): the ranks sum each other's blocks through
the process group's collectives. Its results must be the aggregators' bit for bit (same blocks,
same rank-order float32 sums, same rounding), and the float64 reference's within the dtype's
rounding: at 2, 3 and 4 ranks, fp32/fp16/bf16, sizes off the block grid, empty and all-zero
tensors, NaN/Inf/-0.0, uneven densities, averaging and the lossy threshold."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from omnireduce.launch.procs import free_port
from tests.exchange_host import needs_cxx
from tests.harness import Case, RankPool, assert_matches, own_output

_seeds = itertools.count(500)


def _cases() -> list[Case]:
    s = lambda: next(_seeds)  # noqa: E731 (fresh inputs for every case)
    return [Case(10_000, density=0.1, seed=s()), Case(70_001, density=0.3, seed=s(), specials=True),
            Case(33_333, dtype="float16", density=0.5, seed=s(), specials=True),
            Case(25_000, dtype="bfloat16", density=0.05, seed=s(), kind="torch"),
            Case(4_097, density=1.0, seed=s(), placement="overlap"), Case(5_000, density=0.0, seed=s()),
            Case(0, density=0.0, seed=s()), Case(1, density=1.0, seed=s()),
            Case(300_000, density=0.01, seed=s(), kind="torch", shape=(600, 500)),
            Case(70_003, density=0.3, seed=s(), specials=True, placement="tail-one"),  # (each case its own shape)
            Case(70_005, density=0.004, seed=s(), specials=True, placement="tail-one")]  # rank 0: the tail alone


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("average", [False, True])
def test_collective_engine_gives_the_aggregators_bits(pool: RankPool, aggregator, job: str, world_size: int,
                                                      average: bool) -> None:
    cases = _cases()
    results = pool.call("tests.collective_cases:both_engines", world_size, port=free_port(),
                        aggregator=aggregator.address, job=job, cases=cases, average=average,
                        options={"order": "rank"})
    for rank, per_rank in enumerate(results):
        for case, r in zip(cases, per_rank[:-1], strict=True):
            assert r["collective"] == r["aggregators"], f"rank {rank} {case}: the engines' bits differ"
            assert_matches(case, world_size, r["values"], average=average)
            assert r["info"]["blocks_total"] == (case.numel + 255) // 256
        stats = per_rank[-1]["stats"]
        assert stats["reductions"] == sum(1 for c in cases if c.numel) and stats["bytes_sent"] > 0, stats
        assert stats["device_reductions"] == 0, stats
    # (bits may differ: a block of zeros and -0.0 counts as zero and keeps each rank's own signs)
    assert all(np.array_equal(results[0][i]["values"], results[r][i]["values"], equal_nan=True)
               for r in range(1, world_size) for i in range(len(cases))), "ranks hold different results"


@pytest.mark.parametrize("options", [{"exchange": "gather"}, {"exchange": "owners"}, {"order": "rank"}],
                         ids=["gather", "owners", "auto-rank-order"])
@pytest.mark.parametrize("average", [False, True])
def test_the_device_path_gives_the_same_bits(pool: RankPool, aggregator, job: str, average: bool,
                                             options: dict[str, str]) -> None:
    """The engine's device path (torch ops on the tensor's device: CUDA, or here CPU tensors with
    OMNIREDUCE_DEVICE_PATH=1) against the aggregators, at 3 ranks, through each exchange that sums in
    rank order; every case twice (the second gather sends its bitmap with its blocks, fused)."""
    cases = _cases()
    results = pool.call("tests.collective_cases:both_engines", 3, port=free_port(), aggregator=aggregator.address,
                        job=job, cases=cases, average=average, env={"OMNIREDUCE_DEVICE_PATH": "1"},
                        options=options, repeat=2)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            for r in per_rank[2 * i: 2 * i + 2]:
                assert r["collective"] == r["aggregators"], f"rank {rank} {case}: the engines' bits differ"
                assert_matches(case, 3, r["values"], average=average)
        stats = per_rank[-1]["stats"]
        reduced = 2 * sum(1 for c in cases if c.numel)
        assert stats["reductions"] == stats["device_reductions"] == reduced, stats
        assert stats["host_waits"] == reduced, stats  # one synchronisation per reduction
        assert 0.0 <= stats["host_wait_s"] <= stats["host_s"], stats  # (the waits' CPU, within the thread's)
        assert stats["exchanges"]["union"] == 0, stats
        if options.get("exchange") == "gather":  # every second reduction of a shape: one collective, fused
            empty = sum(1 for c in cases if c.numel and c.density == 0)  # (bitmaps alone the first time)
            assert stats["fused"] == reduced // 2 and stats["overflows"] == 0, stats
            assert stats["collectives"] == reduced * 2 - stats["fused"] - empty, stats


@needs_cxx
@pytest.mark.parametrize(("options", "average"), [({"exchange": "gather"}, False), ({"order": "rank"}, True)],
                         ids=["gather", "auto-rank-order-averaged"])
def test_the_kernel_exchange_gives_the_aggregators_bits(pool: RankPool, aggregator, job: str, average: bool,
                                                        options: dict[str, str]) -> None:
    """The whole engine through the kernel exchange (its steps run on the host, as the CUDA kernels
    run them on a GPU), every case twice (the second fused where the first went ``gather``), at 3
    ranks: the aggregators' bits, and every reduction that took the bitmaps went through it."""
    cases = _cases()
    results = pool.call("tests.collective_cases:both_engines", 3, port=free_port(), aggregator=aggregator.address,
                        job=job, cases=cases, average=average, env={"OMNIREDUCE_DEVICE_PATH": "1"},
                        options=options, repeat=2, host_kernels=True, timeout=240)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            for r in per_rank[2 * i: 2 * i + 2]:
                assert r["collective"] == r["aggregators"], f"rank {rank} {case}: the engines' bits differ"
                assert_matches(case, 3, r["values"], average=average)
        stats = per_rank[-1]["stats"]
        assert stats["kernel_reductions"] == stats["reductions"] - stats["exchanges"]["whole"] > 0, stats
        if options.get("exchange") == "gather":
            assert stats["fused"] > 0, stats


@pytest.mark.parametrize(("options", "average", "setting"),
                         [({"exchange": "gather"}, True, None), ({"order": "rank"}, False, None),
                          ({"order": "rank"}, True, "0")],
                         ids=["numpy-gather-averaged", "numpy-auto-rank-order", "torch-ops-auto-rank-order-averaged"])
def test_the_host_ways_give_the_aggregators_bits(pool: RankPool, aggregator, job: str, average: bool,
                                                 options: dict[str, str], setting: str | None) -> None:
    """The whole engine on host tensors, every case twice, at 3 ranks: the aggregators' bits, by
    default through numpy's kernel exchange (every reduction that took the bitmaps went through it)
    and with ``OMNIREDUCE_ENGINE_KERNELS=0`` through torch ops (none did)."""
    cases = _cases()
    env = {} if setting is None else {"OMNIREDUCE_ENGINE_KERNELS": setting}
    results = pool.call("tests.collective_cases:both_engines", 3, port=free_port(), aggregator=aggregator.address,
                        job=job, cases=cases, average=average, env=env, options=options, repeat=2, timeout=240)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            for r in per_rank[2 * i: 2 * i + 2]:
                assert r["collective"] == r["aggregators"], f"rank {rank} {case}: the engines' bits differ"
                assert_matches(case, 3, r["values"], average=average)
        stats = per_rank[-1]["stats"]
        kernel = stats["reductions"] - stats["exchanges"]["whole"] if setting is None else 0
        assert stats["kernel_reductions"] == kernel and stats["reductions"] > stats["exchanges"]["whole"], stats


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("average", [False, True])
def test_an_unfused_gather_in_parts_gives_the_aggregators_bits(pool: RankPool, aggregator, job: str, world_size: int,
                                                              average: bool) -> None:
    """Every ``gather`` of more than two blocks' bytes in parts (unfused), in up to 40 parts: each rank's
    blocks spread over them unevenly (a part's blocks are the union's, a rank may have none of them),
    the short last block in the last: the aggregators' bits, and the float64 reference's within
    rounding, for the bucket's first reduction and the one after it."""
    cases = [*_cases(), Case(200_000, density=0.05, seed=next(_seeds), specials=True, placement="tail-one"),
                        Case(131_072, density=0.2, seed=next(_seeds), placement="overlap")]
    results = pool.call("tests.collective_cases:both_engines", world_size, port=free_port(),
                        aggregator=aggregator.address, job=job, cases=cases, average=average,
                        options={"exchange": "gather"}, repeat=2, parts=(2 * 256 * 4, 40), timeout=240)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            for r in per_rank[2 * i: 2 * i + 2]:
                assert r["collective"] == r["aggregators"], f"rank {rank} {case}: the engines' bits differ"
                assert_matches(case, world_size, r["values"], average=average)
        stats = per_rank[-1]["stats"]
        assert stats["collectives"] > 4 * len(cases), stats  # (the parts' all-to-alls)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("exchange", ["union", "dense"])
def test_the_backends_all_reduce_sums_within_rounding(pool: RankPool, aggregator, job: str, world_size: int,
                                                     average: bool, exchange: str) -> None:
    """``exchange="union"`` (the union's blocks, compacted, summed by Gloo's all-reduce in its order)
    and ``"dense"`` (after the bitmaps, the whole bucket by Gloo's all-reduce):
    the float64 reference within the dtype's rounding, the same bits on every rank and on every run,
    and at 2 ranks (one addition per element) the aggregators' value for every element but zeros'
    signs (a rank that sent nothing adds its own +-0 here)."""
    cases = _cases()
    results = pool.call("tests.collective_cases:both_engines", world_size, port=free_port(),
                        aggregator=aggregator.address, job=job, cases=cases, average=average,
                        env={"OMNIREDUCE_DEVICE_PATH": "1"}, options={"exchange": exchange}, repeat=2)
    for rank, per_rank in enumerate(results):
        for i, case in enumerate(cases):
            first, second = per_rank[2 * i: 2 * i + 2]
            assert first["collective"] == second["collective"], f"rank {rank} {case}: two runs, two results"
            # (a block zero everywhere keeps each rank's own +-0: compared as values)
            assert np.array_equal(first["values"], results[0][2 * i]["values"], equal_nan=True), \
                f"rank {rank} {case}: ranks differ"
            # (Gloo adds in the dtype: W - 1 roundings, and one more to average)
            assert_matches(case, world_size, first["values"], average=average, roundings=world_size - 1 + average)
            if world_size == 2:  # (== holds for +0 and -0; NaN where the aggregators' is)
                got, agg = first["values"], first["aggregators_values"]
                assert np.array_equal(got, agg, equal_nan=True), f"rank {rank} {case}: the sums differ at 2 ranks"
        stats = per_rank[-1]["stats"]
        assert stats["exchanges"][exchange] == stats["reductions"] > 0 and stats["host_waits"] == stats["reductions"]


def test_collective_engine_lossy_threshold_matches_the_aggregators(pool: RankPool, aggregator, job: str) -> None:
    cases = [Case(20_000 + 7 * i, density=0.3, seed=next(_seeds), small=0.5) for i in range(3)]
    for env in ({}, {"OMNIREDUCE_DEVICE_PATH": "1"}):
        results = pool.call("tests.collective_cases:both_engines", 3, port=free_port(),
                            aggregator=aggregator.address, job=f"{job}{len(env)}", cases=cases, average=True,
                            threshold=0.5, env=env, options={"order": "rank"})
        for per_rank in results:
            for case, r in zip(cases, per_rank[:-1], strict=True):
                assert r["collective"] == r["aggregators"], (env, case)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_coo_rows_through_the_collective_engine(pool: RankPool, aggregator, job: str, world_size: int) -> None:
    """Sparse COO gradients: the engine's new coalesced tensor equals the aggregators' (indices, and
    value bits), and the float64 sum of every rank's dense equivalent within rounding."""
    specs = [{"rows": 5000, "dim": 16, "nnz": 700}, {"rows": 100_000, "dim": 64, "nnz": 300, "dtype": "bfloat16"},
             {"rows": 1000, "dim": 3, "nnz": 2000, "dtype": "float16"}, {"rows": 10, "dim": 8, "nnz": 0}]
    for average in (False, True):
        results = pool.call("tests.collective_cases:sparse_both_engines", world_size, port=free_port(),
                            aggregator=aggregator.address, job=f"{job}{average}", specs=specs, average=average)
        want = [sum(results[r][i]["mine"] for r in range(world_size)) / (world_size if average else 1)
                for i in range(len(specs))]
        for rank, per_rank in enumerate(results):
            for spec, r, ref in zip(specs, per_rank[:-1], want, strict=True):
                assert r["same_indices"] and r["bits"][0] == r["bits"][1], (rank, spec)
                assert r["coalesced"] and r["shape"] == (spec["rows"], spec["dim"]), (rank, spec, r["shape"])
                rtol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[spec.get("dtype", "float32")]
                assert np.allclose(r["values"], ref, rtol=rtol, atol=rtol * np.abs(ref).max() + 1e-30), (rank, spec)
            assert per_rank[-1]["stats"]["reductions"] == len(specs), per_rank[-1]


_RELEASED = """
import gc, sys, time, weakref
import torch
import torch.distributed as dist
from omnireduce.engines.collective import CollectiveEngine

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, 256, 1024, 2)
x = torch.zeros(100_000)
x[::997] = 3.0
engine.allreduce_async(x, average=True).wait()
assert torch.equal(x[::997], torch.full((101,), 3.0)) and int(torch.count_nonzero(x)) == 101
gone = weakref.ref(x)
del x
deadline = time.monotonic() + 5.0
while gone() is not None and time.monotonic() < deadline:
    gc.collect()
    time.sleep(0.01)
held = gone() is not None
y = torch.ones(1000)
engine.allreduce_async(y).wait()
engine.close()
print("held" if held else "released", float(y.sum()))
"""


def test_a_finished_tensor_is_not_kept_by_the_engine() -> None:
    """Once a reduction's future completed and the caller let its tensor go, nothing of the engine's
    holds it (the thread waiting for the next reduction kept the last one: a DDP bucket that DDP
    replaces after its first step, a whole gradient's bytes). In a process of its own (one rank)."""
    out = subprocess.run([sys.executable, "-c", _RELEASED, str(free_port())], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert own_output(out.stdout).split() == ["released", "1000.0"], out.stdout


@pytest.mark.parametrize("latency_bytes", [None, 0])
def test_a_block_every_rank_has_goes_gather_in_the_steady_state(pool: RankPool, latency_bytes: int | None) -> None:
    """4 ranks with the same one non-zero block: the union's all-reduce moves a block and a half
    fewer, but keeps the bitmaps' all-gather too, two collectives a bucket, where the fused gather
    needs one; the engine prices that and goes gather, fused after the first reduction. Priced at
    nothing (OMNIREDUCE_LATENCY_BYTES=0), a collective saves nothing and union wins on bytes. The
    sums are the float64 reference's within float32 rounding either way."""
    steps = 4
    results = pool.call("tests.collective_cases:shared_block", 4, port=free_port(), numel=300_000, block=256,
                        steps=steps, latency_bytes=latency_bytes)
    for r in results:
        for got, want in zip(r["results"], r["wants"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        exchanges = r["stats"]["exchanges"]
        if latency_bytes is None:  # (the default: 256 KiB a collective)
            assert exchanges["gather"] == steps and exchanges["union"] == 0, exchanges
            assert r["stats"]["fused"] == steps - 1 and r["stats"]["collectives"] == steps + 1, r["stats"]
        else:
            assert exchanges["union"] == steps and exchanges["gather"] == 0, exchanges


def test_a_reduction_waited_for_runs_on_the_waiting_thread_in_order(pool: RankPool) -> None:
    """wait() on a reduction not begun, with none before it, runs it on the waiting thread instead of
    waking the engine's; the ranks still issue their collectives in the same order whichever thread
    runs them: two ranks wait for each reduction at once, two ask for three and then wait. Every
    result is the float64 sum (or mean) of every rank's input within the dtype's rounding."""
    rounds = 4
    results = pool.call("tests.collective_cases:waiting_styles", 4, port=free_port(),
                        seed=int(np.random.default_rng().integers(1 << 30)), rounds=rounds)
    for rank, r in enumerate(results):
        for item in r["results"]:
            want = np.sum(item["every"], axis=0) / (4 if item["average"] else 1)
            tol = 1e-5 if item["dtype"] == "torch.float32" else 2e-2
            np.testing.assert_allclose(item["got"], want, rtol=tol, atol=tol, err_msg=f"rank {rank}")
        stats = r["stats"]
        assert stats["reductions"] == 3 * rounds, stats
        if rank % 2 == 0:  # (waited for at once: each ran on the caller's thread, the engine's never woke first)
            assert stats["waited_here"] >= 1, stats
