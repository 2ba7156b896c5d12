"""DDP: omnireduce_hook against DDP's own all-reduce, step by step, in real Gloo process groups."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnireduce.launch.procs import free_port
from tests.harness import RankPool


def _check(results: list[list[dict]], expect_dense: bool = False) -> None:
    for rank, per_config in enumerate(results):
        for r in per_config:
            cfg = r["config"]
            assert all(r["grads_allclose"]), f"rank {rank} {cfg}: reduced gradients differ from DDP's: {r}"
            assert all(r["allclose"]), f"rank {rank} {cfg}: relative differences per step {r['max_rel_diff']}"
            assert r["moved"] > 1e-3, f"{cfg}: the parameters did not train"
            st = r["stats"]
            assert r["unplain"] == [] and r["round_trips"], f"{cfg}: stats() must be plain values only: {r['unplain']}"
            assert st["buckets_failed"] == 0, (cfg, st)
            assert st["buckets_sparse"] > 0, f"{cfg}: no bucket went through omnireduce: {st}"
            assert r["buckets"] > 1, f"{cfg}: expected several buckets"
            if expect_dense:
                assert st["buckets_dense"] > 0, f"{cfg}: the dense fallback was never taken: {st}"


# Every DDP mode, with SGD (momentum): parameters within rtol 1e-5 of plain DDP at 2 and 3 ranks.
CONFIGS = [
    {"optimizer": "sgd"},
    {"optimizer": "sgd", "bucket_view": True},
    {"optimizer": "sgd", "static_graph": True},
    {"optimizer": "sgd", "find_unused": True, "bucket_view": True},
    {"optimizer": "sgd", "accumulate": 2},
    {"optimizer": "sgd", "uneven": True},
]
# Adam and AdamW: at 3 ranks the reduced gradients still match DDP's to rounding (checked at every
# step), but Adam turns a one-ulp difference in a gradient element near its eps into a visible
# parameter difference, whatever all-reduce produced it; so parameters are compared at 2 ranks, where
# a sum does not depend on its order.
ADAM = [
    {"optimizer": "adam", "static_graph": True},
    {"optimizer": "adamw", "uneven": True, "bucket_view": True},
    {"optimizer": "adam", "find_unused": True, "accumulate": 2},
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_matches_ddp_allreduce(pool: RankPool, aggregator, world_size: int) -> None:
    configs = CONFIGS + (ADAM if world_size == 2 else [])
    _check(pool.call("tests.ddp_cases:parity", world_size, port=free_port(), aggregator=aggregator.address,
                     configs=configs))


def test_adam_gradients_match_at_three_ranks(pool: RankPool, aggregator) -> None:
    results = pool.call("tests.ddp_cases:parity", 3, port=free_port(), aggregator=aggregator.address, configs=ADAM)
    for per_config in results:
        for r in per_config:
            assert all(r["grads_allclose"]), r
            assert r["stats"]["buckets_sparse"] > 0 and r["stats"]["buckets_failed"] == 0


@pytest.mark.parametrize("world_size,configs", [
    (2, [{"optimizer": "sgd", "fused": True}, {"optimizer": "adam", "fused": True, "bucket_view": True},
         {"optimizer": "adamw", "fused": True, "accumulate": 2}, {"optimizer": "adam", "fused": True,
                                                                   "uneven": True}]),
    # (static_graph with no_sync() aborts in plain DDP too, torch 2.13, so they are not combined)
    (3, [{"optimizer": "sgd", "fused": True, "bucket_view": True}, {"optimizer": "sgd", "fused": True,
                                                                    "static_graph": True},
         {"optimizer": "sgd", "fused": True, "accumulate": 2, "find_unused": True}]),
])
def test_fused_optimizer_matches_ddp_then_step(pool: RankPool, aggregator, world_size: int, configs: list) -> None:
    _check(pool.call("tests.ddp_cases:parity", world_size, port=free_port(), aggregator=aggregator.address,
                     configs=configs))


def test_dense_fallback_is_collective_and_exact(pool: RankPool, aggregator) -> None:
    cfgs = [{"optimizer": "sgd", "dense_fallback": True, "dense_threshold": 0.05, "steps": 8},
            {"optimizer": "sgd", "dense_fallback": True, "dense_threshold": 0.05, "fused": True, "steps": 8}]
    _check(pool.call("tests.ddp_cases:parity", 3, port=free_port(), aggregator=aggregator.address, configs=cfgs),
           expect_dense=True)


def test_aggregator_death_fails_backward_in_time(pool: RankPool) -> None:
    exe = Path(sys.executable).with_name("omnireduce-agg")
    agg = subprocess.Popen([exe, "--listen", "tcp://127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    address = agg.stdout.readline().split()[-1]
    timeout = 2.0
    try:
        t0 = time.monotonic()
        results = pool.call("tests.ddp_cases:aggregator_dies", 2, port=free_port(), aggregator=address,
                            agg_pid=agg.pid, hook_timeout=timeout)
        assert time.monotonic() - t0 < 60
    finally:
        agg.kill()
        agg.wait()
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank}: backward() did not fail"
        assert "omnireduce_hook failed at iteration 2, bucket" in r["error"], r["error"]
        # backward() raises the hook's own error, what went wrong first (not torch's "Unable to cast ... to Tensor")
        assert r["error"].startswith("OmniReduceTimeout: omnireduce_hook failed at iteration 2, bucket"), r["error"]
        assert "did not answer" in r["error"] and address in r["error"], r["error"]
        assert r["elapsed"] < timeout + 2, f"rank {rank} took {r['elapsed']:.1f} s"
        assert r["after"] == 3.0 and r["failed"] > 0


def test_state_pickles_without_sockets(aggregator) -> None:
    import torch.distributed as dist

    from omnireduce.ddp import OmniReduceState

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        state = OmniReduceState(aggregators=aggregator.address, job="pickled", dense_threshold=0.3)
        state.iteration = 7
        clone = pickle.loads(pickle.dumps(state))
        assert clone.worker is None and clone.process_group is None
        assert (clone.job, clone.iteration, clone.options.dense_threshold) == ("pickled", 7, 0.3)
        state.worker.close()
    finally:
        dist.destroy_process_group()


# The collective engine (the ranks sum each other's blocks through the process group) in every DDP mode;
# its buckets here (20 KB) would go whole through the dense all-reduce: OMNIREDUCE_LATENCY_BYTES=0 makes
# them take the sparse exchanges the engine chooses by bytes (at 3 ranks the union's all-reduce for the
# dense buckets), and one config asks for rank-order sums only
COLLECTIVE = [{"engine": "collective", **cfg} for cfg in
              ({"optimizer": "sgd", "bucket_view": True}, {"optimizer": "sgd", "find_unused": True},
               {"optimizer": "sgd", "accumulate": 2}, {"optimizer": "sgd", "fused": True},
               {"optimizer": "sgd", "uneven": True}, {"optimizer": "sgd", "sum_order": "rank"},
               {"optimizer": "adamw", "static_graph": True},
               {"optimizer": "sgd", "path": "measure", "measure_trials": 1, "steps": 8})]


@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_engine_matches_ddp_allreduce(pool: RankPool, aggregator, world_size: int) -> None:
    configs = COLLECTIVE if world_size == 2 else [c for c in COLLECTIVE if c["optimizer"] == "sgd"]
    results = pool.call("tests.ddp_cases:parity", world_size, port=free_port(), aggregator=aggregator.address,
                        configs=configs, env={"OMNIREDUCE_LATENCY_BYTES": "0"})
    _check(results)
    backend_sums = unions = 0
    for per_config in results:
        for r in per_config:  # what went through omnireduce went through the engine, not the aggregators
            st = r["stats"]
            assert st["engine"] == "collective" and st["bytes_sent"] > 0, st
            assert r["block_size"] == 64, r["block_size"]  # (the state's, with no worker to hold it)
            assert st["collective_reductions"] == st["buckets_sparse"] > 0, st
            assert st["collective_exchanges"]["whole"] == 0, st  # (nothing whole at OMNIREDUCE_LATENCY_BYTES=0)
            if r["config"].get("sum_order") == "rank":
                assert st["collective_exchanges"]["union"] == 0, st
            if r["config"].get("sum_order") == "rank":
                assert st["collective_exchanges"]["dense"] == 0, st
            backend_sums += st["collective_exchanges"]["union"] + st["collective_exchanges"]["dense"]
            unions += st["collective_exchanges"]["union"]
    # the backend's own sums after the bitmaps: the whole bucket's all-reduce where nearly every block is
    # non-zero, the union's at 3 ranks where they overlap (at 2 the gather moves as few bytes, and goes first)
    assert backend_sums > 0 and (unions == 0 if world_size == 2 else True), (backend_sums, unions)


def test_collective_engine_a_killed_rank_makes_every_other_rank_raise_in_time(pool: RankPool, tmp_path: Path) -> None:
    """No aggregator to route around: a rank that dies fails the other ranks' buckets at the engine
    group's timeout at the latest (Gloo may notice the closed connections sooner)."""
    import json

    timeout = 8.0
    try:
        with pytest.raises(TimeoutError, match="rank 2: its process died"):  # (the pool restarts it)
            pool.call("tests.ddp_cases:rank_dies", 3, port=free_port(), nodes=[0, 1, 2], victim=2, step=3,
                      hook_timeout=timeout, out=str(tmp_path), hierarchical=False, engine="collective", timeout=120)
    finally:
        for i in range(pool.size):  # the survivors still hold process groups with a dead member
            pool._restart(i)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["error"] is not None and "OmniReduceError" in r["error"], f"rank {rank}: {r}"
        assert r["elapsed"] < 3 * timeout, f"rank {rank} raised after {r['elapsed']:.1f} s: {r['error']}"


def test_measured_path_choice_is_collective_and_exact(pool: RankPool, aggregator) -> None:
    """path="measure": buckets alternate between both paths, then take the agreed faster one, and
    one at a time are measured again: every rank the same decisions, parameters those of plain DDP."""
    cfg = {"path": "measure", "measure_trials": 1, "remeasure_every": 3, "steps": 18, "engine": "aggregators"}
    results = pool.call("tests.ddp_cases:parity", 2, port=free_port(), aggregator=aggregator.address,
                        configs=[cfg])
    _check(results)
    st = [per_config[0]["stats"] for per_config in results]
    assert st[0]["paths"] == st[1]["paths"], "the ranks decided differently"
    paths = st[0]["paths"]
    assert len(paths) == results[0][0]["buckets"] > 1
    assert all(p["measurements"] >= 1 and p["path"] in ("aggregators", "dense") for p in paths.values()), paths
    assert all(p["aggregators_ms"] > 0 and p["dense_ms"] > 0 for p in paths.values()), paths
    assert sum(p["measurements"] >= 2 for p in paths.values()) >= 1, f"nothing measured again: {paths}"
    assert sum(p["phase"] != "decided" for p in paths.values()) <= 1, f"one bucket at a time: {paths}"
    assert st[0]["buckets_dense"] > 0 and st[0]["buckets_sparse"] > 0, st[0]
    # 18 iterations: 4 measuring calls per bucket (after the rebuild), a step check (2) where a bucket
    # went through omnireduce, then one bucket at a time
    assert 4 <= st[0]["iterations_measuring"] <= 17, st[0]
    assert all(c["buckets"] and c["plan_ms"] for c in st[0]["step_checks"]), st[0]["step_checks"]


def test_auto_measures_both_engines_and_the_dense_all_reduce(pool: RankPool, aggregator) -> None:
    """engine="auto" on Gloo: each bucket takes the aggregators, the collective engine and the dense
    all-reduce in turn, then the path every rank agreed on; parameters those of plain DDP."""
    cfg = {"path": "measure", "measure_trials": 1, "steps": 10}
    results = pool.call("tests.ddp_cases:parity", 2, port=free_port(), aggregator=aggregator.address,
                        configs=[cfg])
    _check(results)
    st = [per_config[0]["stats"] for per_config in results]
    assert st[0]["paths"] == st[1]["paths"], "the ranks decided differently"
    assert st[0]["engine"] == "measured", st[0]
    paths = st[0]["paths"]
    assert all(p["aggregators_ms"] > 0 and p["collective_ms"] > 0 and p["dense_ms"] > 0 for p in paths.values()), paths
    assert all(p["path"] in ("aggregators", "collective", "dense") for p in paths.values()), paths
    # 3 paths x (1 + 1) calls after DDP's rebuild: every way was taken by every bucket
    assert st[0]["collective_reductions"] >= len(paths) * 2, st[0]
    assert st[0]["buckets_sparse"] >= len(paths) * 4 and st[0]["buckets_dense"] >= len(paths) * 2, st[0]


def test_a_bucket_goes_dense_and_comes_back(pool: RankPool, aggregator) -> None:
    results = pool.call("tests.ddp_cases:dense_both_ways", 2, port=free_port(), aggregator=aggregator.address)
    for rank, r in enumerate(results):
        assert all(r["ok"]), f"rank {rank}: parameters differ from plain DDP: {r}"
        # step 0 has no density yet: the ranks' largest local density (95%) is all-reduced and it goes
        # dense at once; after a dense step the next goes dense, after a sparse one (its density
        # measured from the dense result) the next comes back to omnireduce
        assert r["paths"] == ["dense", "dense", "sparse", "dense", "sparse", "dense"], r
        assert r["probed"] == 1, r
    assert results[0]["paths"] == results[1]["paths"]


def test_an_unpickled_state_reconnects_as_each_rank_without_the_token(pool: RankPool, aggregator) -> None:
    results = pool.call("tests.ddp_cases:pickled_state", 2, port=free_port(), aggregator=aggregator.address)
    for rank, r in enumerate(results):
        assert all(r["ok"]), f"rank {rank}: parameters differ from plain DDP: {r}"
        assert (r["rank"], r["world_size"]) == (rank, 2), r
        assert r["iteration"] == 5 + 3 and r["sparse"] > 0, r
        assert not r["token_in_blob"], "the token was pickled"


def test_device_path_matches_ddp(pool: RankPool, aggregator) -> None:
    """The CUDA code path of the hook (compaction, one upload, scaled scatter), run with torch ops."""
    configs = [{"optimizer": "sgd", "bucket_view": True}, {"optimizer": "sgd", "fused": True},
               {"optimizer": "sgd", "dense_fallback": True, "dense_threshold": 0.05, "steps": 8}]
    results = pool.call("tests.ddp_cases:parity", 3, port=free_port(), aggregator=aggregator.address, configs=configs,
                        env={"OMNIREDUCE_DEVICE_PATH": "1"})
    _check([per[:2] for per in results])
    _check([per[2:] for per in results], expect_dense=True)


def test_sparse_coo_buckets_go_through_omnireduce(pool: RankPool, aggregator) -> None:
    for r in pool.call("tests.ddp_cases:sparse_gradients", 2, port=free_port(), aggregator=aggregator.address):
        assert all(r["ok"]), r
        assert r["stats"]["buckets_coo"] == 4 and r["stats"]["buckets_dense"] == 0, r  # (more: test_sparse_ddp.py)
        assert r["stats"]["buckets_failed"] == 0


def test_a_state_made_before_init_binds_in_the_hook_and_runs_its_own_aggregator(pool: RankPool) -> None:
    import psutil

    results = pool.call("tests.ddp_cases:late_binding", 3, port=free_port())
    for rank, r in enumerate(results):
        assert r["unbound"] == [True, True, True], r
        assert all(r["ok"]), f"rank {rank}: parameters differ from plain DDP: {r}"
        assert (r["rank"], r["world_size"]) == (rank, 3) and r["token"], r
        assert r["stats"]["buckets_sparse"] > 0 and r["stats"]["buckets_failed"] == 0, r
        assert r["stats"]["sent_fraction"] < 0.5, r
        assert r["addresses"] == results[0]["addresses"] and r["job"] == results[0]["job"], r
    assert len(results[0]["addresses"]) == 1  # one node: one aggregator, on loopback
    assert results[0]["addresses"][0].startswith("tcp://127.0.0.1:")
    assert len(results[0]["pids"]) == 1 and results[1]["pids"] == results[2]["pids"] == []
    pid = results[0]["pids"][0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "close() left it"


def test_a_colocated_aggregator_that_cannot_start_fails_every_rank(pool: RankPool) -> None:
    t0 = time.monotonic()
    results = pool.call("tests.ddp_cases:colocated_failure", 2, ports=[free_port(), free_port()],
                        ifname={0: "no-such-if0"})
    assert time.monotonic() - t0 < 60
    for rank, r in enumerate(results):
        assert r["constructor"] and "colocated aggregators could not start" in r["constructor"], r
        assert "no-such-if0" in r["constructor"] and "node" in r["constructor"], r
        first, second = r["errors"]
        assert first and "colocated aggregators could not start" in first and "no-such-if0" in first, (rank, r)
        assert "omnireduce_hook failed at iteration 0" in first, (rank, r)
        assert second and "no-such-if0" in second, (rank, r)
        assert r["times"][1] < 5, f"rank {rank}: the second step tried again: {r}"
        assert r["after"] == 3.0 and r["failed"] > 0, r


def test_join_divides_by_the_initial_world_size_with_the_hook_as_with_any_python_hook(pool: RankPool,
                                                                                       aggregator) -> None:
    """``join(divide_by_initial_world_size=False)``: plain DDP divides by the ranks still training once one has
    joined; a Python communication hook cannot see the join state, so torch's ``allreduce_hook`` and
    ``omnireduce_hook`` both go on dividing by the initial world size (docs/reference/reliability.md)."""
    results = pool.call("tests.ddp_cases:join_live_ranks", 2, port=free_port(), aggregator=aggregator.address)
    late = results[1]  # rank 1 trains 2 steps more than rank 0
    assert late["plain"] == [50.0] * 5, late
    assert late["allreduce_hook"] == [50.0] * 3 + [25.0] * 2, late
    assert late["omnireduce_hook"] == late["allreduce_hook"], late
    assert results[0]["omnireduce_hook"] == results[0]["allreduce_hook"] == [50.0] * 3, results[0]


def test_plain_tensors_take_the_same_routes_as_ddp_buckets(pool: RankPool, aggregator) -> None:
    """Any tensor with a stable index is a bucket (Bucket.of_tensor) the runtime routes and reduces as it does
    DDP's: every result equals the mean of the ranks' inputs, and both tensors were measured and decided."""
    results = pool.call("tests.ddp_cases:tensor_buckets", 2, port=free_port(), aggregator=aggregator.address,
                        iterations=12)
    for r in results:
        assert len(r["errors"]) == 24 and max(r["errors"]) < 1e-6, r["errors"]
        assert r["buckets"] == 24 and set(r["paths"]) == {0, 1}, r
        assert all(p is not None for p in r["paths"].values()), r["paths"]
    assert results[0]["paths"] == results[1]["paths"], "every rank took the same ways"


def test_one_state_on_two_models_fails_the_second_with_a_value_error(pool: RankPool) -> None:
    results = pool.call("tests.ddp_cases:two_models", 2, port=free_port(), mode="shared")
    for r in results:
        # every step's backward of the second model fails (DDP raises the hook's error, an OmniReduceError
        # carrying the ValueError's text), from its first bucket on
        assert len(r["errors"]) == 4, r["errors"]
        first = r["errors"][0]
        assert "failed at iteration 1, bucket 0: this OmniReduceState already serves another DDP model" in first
        assert all("one state serves one DDP model" in e and "sibling()" in e for e in r["errors"]), r["errors"]
        assert all(r["first_ok"]), r  # the first model trains on, exactly as plain DDP
        assert r["stats"][0]["iteration"] == 4, r  # counted once per step, not twice


def test_a_sibling_state_shares_the_aggregators_of_the_first(pool: RankPool) -> None:
    import psutil

    results = pool.call("tests.ddp_cases:two_models", 2, port=free_port(), mode="sibling")
    for r in results:
        assert not r["errors"], r["errors"]
        assert all(all(o) for o in r["ok"]), r["ok"]  # both models: plain DDP's parameters, bit for bit
        assert r["jobs"][0] != r["jobs"][1] and r["addresses"][0] == r["addresses"][1], r
        assert [s["iteration"] for s in r["stats"]] == [4, 4] and all(s["buckets_sparse"] for s in r["stats"]), r
    assert results[0]["colocated"] == results[1]["colocated"] == [True, False]  # (the sibling starts none)
    assert len(results[0]["pids"]) == 1 and results[1]["pids"] == []  # one node: one aggregator
    pid = results[0]["pids"][0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "close() left it"


def test_the_collective_engine_starts_no_aggregator_and_opens_no_port(pool: RankPool) -> None:
    results = pool.call("tests.ddp_cases:collective_without_aggregators", 3, port=free_port())
    for r in results:
        assert all(r["ok"]), r
        assert r["worker"] and r["colocated"] and r["children"] == [], r
        assert r["new_ports"] == r["per_group"], r  # the engine's own Gloo group's, and no aggregator's
        assert r["layout"] == [32, 64, 3, ()], r
        assert r["stats"]["engine"] == "collective" and r["stats"]["collective_reductions"] > 0, r
        assert r["stats"]["buckets_failed"] == 0, r


def test_the_agreement_tells_the_worker_what_every_rank_has_finished(pool: RankPool) -> None:
    """Each iteration's agreement carries every rank's ``finished_below``; at the next iteration's first
    bucket each rank's worker is handed the MIN (the kept sums below it go), only when it moves on,
    alongside the aggregators agreed on and the rider's values (the path choice's, unchanged)."""
    finished = [[5, 3], [7, 9], [6, 4], [12, 12]]  # per iteration, per rank
    results = pool.call("tests.ddp_cases:agreement_releases", 2, port=free_port(), finished=finished)
    for r in results:
        assert r["told"] == [[3], [3, 7], [3, 7], [3, 7, 12]], r  # (a MIN below the last one tells nothing)
        assert r["used"] == [[0]] * 4, r
        assert r["agreed"] == [[-2]] * 4, r


@pytest.mark.parametrize("late,deadline,waited", [(1.0, 30.0, True), (3.0, 0.5, False)], ids=["waits", "deadline"])
def test_closing_settles_the_agreement_in_flight(pool: RankPool, late: float, deadline: float, waited: bool) -> None:
    """A closing state waits for its last agreement's all-reduce (a rank that destroys its group with it
    still queued can leave the others' copies waiting in their teardown), at most its timeout."""
    results = pool.call("tests.ddp_cases:agreement_settles", 2, port=free_port(), late=late, deadline=deadline)
    assert results[0] == {"done_at_settle": waited, "round_left": False, "min": [1]}, results
    assert results[1] == {"done_at_settle": True, "round_left": False, "min": [1]}, results

