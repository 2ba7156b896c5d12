"""FSDP2 as HSDP with omnireduce across the replicas (omnireduce.integrations.fsdp), on 4 real Gloo ranks
as 2 "nodes" x 2: the parameters equal native HSDP's (``fully_shard`` on the 2-D mesh) within 1e-5
after each of 20 Adam steps, for a model dominated by an embedding table and for a dense model, each
unit's way chosen by the DDP side's path choice (measured, agreed on every rank of its replicate
group; a unit the collective engine would send whole goes dense unmeasured), by the threshold (the
table through omnireduce, a few percent of native HSDP's bytes) or forced; with the aggregators among
the ways; in fp32 and with bf16 (and fp16) reduce dtypes, with accumulation, ``reshard_after_forward``
both ways, one ``fully_shard`` per block and a gradient divide factor (a sum, trained with SGD, which
a wrong scale would move: Adam would not); the reducer against float64 sums on ugly inputs; the
backward passes' bookkeeping; the refusals and a node that stays away. The whole matrix is marked e2e
(make test-e2e); make test runs a cover of it. On a torch the integration refuses (tests/fsdp_cases.py's
marks; make test-oldest-torch's) what goes through it skips with the integration's own reason."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omnireduce.launch.procs import free_port
from tests.fsdp_cases import expected_rows, native_divide_factor_on_gloo, needs_fsdp_torch
from tests.harness import Case, RankPool, assert_matches
from tests.plain import problems

TOL = 1e-5


def _train(pool: RankPool, configs: list[dict], shape: tuple[int, int] = (2, 2)) -> list[list[dict]]:
    return pool.call("tests.fsdp_cases:train", 4, port=free_port(), configs=configs, shape=shape, timeout=300.0)


def _decisions(r: dict[str, Any]) -> dict[str, Any]:
    """What must be the same on every rank of a replicate group: each unit's path choice (agreed
    timings included), the ways its reductions took, and the step checks."""
    per = r["stats"]["per_module"]
    return {"paths": r["stats"]["paths"], "checks": r["stats"]["step_checks"],
            "ways": {n: (u["path"], u["reductions_sparse"], u["reductions_dense"]) for n, u in per.items()}}


def _check(ranks: list[list[dict]], shards: int = 2) -> None:
    for rank, results in enumerate(ranks):
        for i, r in enumerate(results):
            cfg, stats = r["config"], r["stats"]
            assert problems(stats) == [], (cfg, problems(stats))  # (plain values only: checkpoints, JSON)
            assert len(r["diffs"]) == cfg.get("steps", 20)
            assert max(r["diffs"]) <= TOL, (rank, cfg, r["diffs"])
            assert r["moved"] > 100 * TOL, (rank, cfg, "the parameters did not move", r["moved"])
            per, paths = stats["per_module"], stats["paths"]
            assert list(per) == [n or "(the model)" for n in r["names"]], (per, r["names"])
            measured = cfg.get("options", {}).get("path", "measure") == "measure"  # (the path choice's units)
            assert list(paths) == (list(per) if measured else []), (rank, cfg, paths)
            syncs = cfg.get("steps", 20)  # (one reduction per unit and optimizer step, accumulating or not)
            assert all(u["reductions"] == syncs for u in per.values()), (rank, cfg, per)
            assert _decisions(r) == _decisions(ranks[rank % shards][i]), (rank, cfg)  # (its replicate group's)
            _check_ways(cfg, stats, rank)


def _check_ways(cfg: dict[str, Any], stats: dict[str, Any], rank: int) -> None:
    options = cfg.get("options", {})
    path = options.get("path", "measure")
    per, paths = stats["per_module"], stats["paths"]
    table = "table" if "table" in per else "(the model)"
    if path == "measure":
        # a unit the collective engine would send whole (under 256 KiB) is dense, unmeasured: the dense model's
        # every unit, the recommender's MLP blocks
        small = [n for n in per if cfg["model"] == "dense" or n != table]
        assert all(paths[n]["phase"] == "whole" and per[n]["reductions_sparse"] == 0 for n in small), (rank, cfg)
        if cfg["model"] == "recsys":  # the table's way was timed (and agreed): whichever was faster here
            ways = ("aggregators", "collective", "dense") if "aggregators" in options else ("collective", "dense")
            t = paths[table]
            assert t["phase"] == "decided" and t["measurements"] >= 1 and t["path"] in ways, (rank, cfg, t)
            assert all(t[f"{w}_ms"] is not None for w in ways), (rank, cfg, t)
            assert per[table]["reductions_sparse"] >= 4 * (len(ways) - 1), (rank, cfg, per[table])  # (1 + 3 each)
            assert stats["engine"] == ("measured" if "aggregators" in options else "collective"), stats["engine"]
    if path == "threshold" and cfg["model"] == "recsys":  # probed once: sparse from the first reduction
        assert per[table]["path"] == "collective" and per[table]["reductions_dense"] == 0, (rank, cfg, per[table])
        assert per[table]["sent_fraction"] < 0.10 and stats["sent_fraction"] < 0.10, (rank, cfg, stats)
    if path == "omnireduce":
        assert stats["reductions_dense"] == 0, (rank, cfg, stats)
    if cfg["model"] == "dense" and path != "omnireduce":
        assert all(u["path"] == "dense" for u in per.values()), (rank, cfg, per)


RECSYS_BLOCKS = {"model": "recsys", "blocks": True}
DENSE_BF16_ACC = {"model": "dense", "reduce_dtype": "bfloat16", "accumulate": True, "reshard": False}
RECSYS_SUM = {"model": "recsys", "divide_factor": 2.0, "optimizer": "sgd"}
RECSYS_THRESHOLD = {"model": "recsys", "options": {"path": "threshold"}}

MATRIX = [
    {"model": "recsys"}, RECSYS_BLOCKS, {"model": "recsys", "blocks": True, "reshard": False},
    {"model": "recsys", "blocks": True, "reduce_dtype": "bfloat16"},
    {"model": "recsys", "blocks": True, "accumulate": True},
    {"model": "recsys", "blocks": True, "options": {"block_size": 64}}, RECSYS_SUM, RECSYS_THRESHOLD,
    {**RECSYS_SUM, "blocks": True}, {**RECSYS_SUM, "blocks": True, "options": {"path": "omnireduce"}},
    {"model": "recsys", "blocks": True, "options": {"path": "omnireduce"}},
    {"model": "recsys", "blocks": True, "reduce_dtype": "bfloat16", "options": {"path": "threshold"}},
    {"model": "dense"}, {"model": "dense", "blocks": True}, {"model": "dense", "reduce_dtype": "bfloat16"},
    {"model": "dense", "reduce_dtype": "float16", "blocks": True}, DENSE_BF16_ACC,
    {"model": "dense", "blocks": True, "options": {"path": "omnireduce"}},
    {"model": "dense", "options": {"path": "threshold"}},
    {"model": "dense", "blocks": True, "divide_factor": 2.0, "optimizer": "sgd"},
    {"model": "dense", "blocks": True, "divide_factor": 2.0, "optimizer": "sgd", "options": {"path": "omnireduce"}},
    {"model": "recsys", "blocks": "grouped"},
]


@needs_fsdp_torch
def test_recommender_and_dense_models_equal_native_hsdp_through_the_path_choice(pool: RankPool) -> None:
    """make test's cover: the recommender by block, measured (fp32, resharding after forward); the
    dense model in bf16 with accumulation and no resharding after forward, measured; the whole
    recommender under the threshold rule (summed with a divide factor: the next test)."""
    _check(_train(pool, [RECSYS_BLOCKS, DENSE_BF16_ACC, RECSYS_THRESHOLD]))


@native_divide_factor_on_gloo
@needs_fsdp_torch
def test_the_whole_recommender_summed_equals_native_hsdp(pool: RankPool) -> None:
    """make test's cover of a gradient divide factor: the whole recommender summed, measured."""
    _check(_train(pool, [RECSYS_SUM]))


@needs_fsdp_torch
def test_with_aggregators_the_path_choice_times_three_ways(pool: RankPool, aggregator: Any) -> None:
    """With an aggregator's address the table is timed on the aggregators, the collective engine and
    the dense all-reduce; each column of the mesh is a job of its own there."""
    _check(_train(pool, [{"model": "recsys", "options": {"aggregators": [aggregator.address]}}]))


@pytest.mark.e2e
@needs_fsdp_torch
def test_the_whole_matrix_equals_native_hsdp(pool: RankPool) -> None:
    """The matrix but its gradient divide factors (the next test)."""
    _check(_train(pool, [cfg for cfg in MATRIX if "divide_factor" not in cfg]))


@pytest.mark.e2e
@native_divide_factor_on_gloo
@needs_fsdp_torch
def test_the_whole_matrix_with_a_divide_factor_equals_native_hsdp(pool: RankPool) -> None:
    _check(_train(pool, [cfg for cfg in MATRIX if "divide_factor" in cfg]))


@pytest.mark.e2e
@needs_fsdp_torch
def test_four_nodes_of_one_rank_equal_native_hsdp(pool: RankPool) -> None:
    """4 replicas, no sharding: in fp32 the engine's sums (rank order) and Gloo's (its ring's order)
    round alike within 1e-5 of the parameters; the dense model takes Gloo's own all-reduce, so in
    bf16 too. (A table in bf16 or fp16 over 4 replicas is not compared with native HSDP: the engine
    sums in float32 and rounds once, Gloo rounds after each addition, and Adam amplifies the
    difference; the reducer's test holds the engine to the float64 sums there.)"""
    _check(_train(pool, [RECSYS_BLOCKS, {"model": "dense", "reduce_dtype": "bfloat16"}], shape=(4, 1)), shards=1)


@pytest.mark.e2e
@needs_fsdp_torch
def test_one_node_of_four_ranks_equals_native_hsdp(pool: RankPool) -> None:
    """One replica: nothing crosses a node, the parameters are FSDP's alone."""
    for rank in _train(pool, [RECSYS_BLOCKS], shape=(1, 4)):
        r = rank[0]
        assert max(r["diffs"]) <= TOL and r["moved"] > 100 * TOL, r
        assert r["stats"]["bytes_sent"] == 0 and r["stats"]["dense_equivalent_bytes"] == 0, r["stats"]


def test_the_recommender_touches_about_one_percent_of_its_rows() -> None:
    assert 0.005 <= expected_rows() <= 0.02, expected_rows()


CASES = [dict(numel=70_001, density=0.3, seed=11, specials=True), dict(numel=33_333, dtype="float16", seed=21,
         density=0.5, specials=True), dict(numel=25_000, dtype="bfloat16", density=0.05, seed=31),
         dict(numel=5_000, density=0.0, seed=41), dict(numel=0, density=0.0, seed=51),
         dict(numel=1, density=1.0, seed=61), dict(numel=4_097, density=1.0, seed=71, placement="overlap")]


@pytest.mark.parametrize(("path", "shape", "average"), [("omnireduce", (2, 2), True), ("dense", (2, 2), True),
                                                     ("omnireduce", (4, 1), True), ("omnireduce", (2, 2), False),
                                                     ("dense", (4, 1), False)])
def test_the_reducer_gives_the_float64_sums_of_the_replicas(pool: RankPool, path: str, shape: tuple[int, int],
                                                            average: bool) -> None:
    """Each shard's replicas (2 of 2 shards, or 4 of one) reduce their inputs (NaN, Inf, -0.0, empty,
    off the block grid, three dtypes), averaged or summed, through the collective engine (its sparse
    exchanges: nothing goes whole at OMNIREDUCE_LATENCY_BYTES=0) or the dense all-reduce: the float64
    sum over the replicas (divided by their number when averaging), within the dtype's rounding."""
    replicas, shards = shape
    results = pool.call("tests.fsdp_cases:replicas", 4, port=free_port(), cases=CASES, path=path, average=average,
                        shape=shape, env={"OMNIREDUCE_LATENCY_BYTES": "0"})
    for rank, (values, stats) in enumerate(results):
        for c, got in zip(CASES, values, strict=True):
            case = Case(**{**c, "seed": c["seed"] + rank % shards})
            assert_matches(case, replicas, np.asarray(got, dtype=np.float64), average=average)
        assert stats[f"reductions_{'sparse' if path == 'omnireduce' else 'dense'}"] == len(CASES), stats
        assert {u["path"] for u in stats["per_module"].values()} == {"collective" if path == "omnireduce" else "dense"}
        assert stats["bytes_sent"] > 0 and stats["dense_equivalent_bytes"] > 0, stats
    for i in range(len(CASES)):  # the replicas of a shard hold the same result
        for rank in range(shards, 4):
            assert np.array_equal(np.asarray(results[rank % shards][0][i]), np.asarray(results[rank][0][i]),
                                  equal_nan=True), (i, rank)


@needs_fsdp_torch
def test_what_is_not_supported_is_refused_clearly(pool: RankPool) -> None:
    errors = pool.call("tests.fsdp_cases:refusals", 4, port=free_port())
    for rank, e in enumerate(errors):
        expect = {
            "native_hsdp": ("ValueError", "native HSDP"),
            "other_1d_mesh": ("ValueError", "mesh['shard'] holds ranks"),
            "per_param_mesh": ("ValueError", "per-parameter meshes"),
            "one_d_mesh": ("ValueError", "2-D DeviceMesh"),
            "dim_names": ("ValueError", "mesh_dim_names=('replicate', 'shard')"),
            "not_fsdp": ("TypeError", "holds no module sharded with fully_shard"),
            "no_mesh": ("TypeError", "needs its 2-D DeviceMesh"),
            "ddp_state": ("ValueError", "takes no DDP state"),
            "bad_path": ("ValueError", "path must be one of"),
            "bad_engine": ("ValueError", "engine must be one of"),
            "aggregators_without_addresses": ("ValueError", "starts no aggregators of its own"),
            "hook_already": ("ValueError", "already has an all-reduce hook"),
            "after_close": ("OmniReduceError", "its cross-replica reduction was closed"),
        }
        if "per_param_mesh" not in e:  # (a torch without per-parameter meshes: nothing to refuse)
            del expect["per_param_mesh"]
        assert set(e) == set(expect), (rank, e)
        for name, (kind, words) in expect.items():
            assert e[name] is not None, (rank, name, "nothing was raised")
            assert e[name].startswith(kind) and words in e[name], (rank, name, e[name])
        assert "FSDP module '(the model)'" in e["after_close"], e["after_close"]


@needs_fsdp_torch
@pytest.mark.parametrize("path", ["omnireduce", "dense"])
def test_a_node_that_stays_away_fails_the_others_backward_at_the_timeout(pool: RankPool, path: str) -> None:
    results = pool.call("tests.fsdp_cases:a_node_stays_away", 4, port=free_port(), path=path, limit=3.0)
    for rank, r in enumerate(results[:2]):
        assert r["error"] is not None, (rank, r)
        assert r["error"].startswith("OmniReduceError: omnireduce: FSDP module"), (rank, r["error"])
        assert "the reduction across replicas failed" in r["error"], (rank, r["error"])
        assert "Timed out" in r["error"] and "callback" not in r["error"] and "\nAt:" not in r["error"], r["error"]
        assert 2.5 <= r["seconds"] <= 30.0, (rank, r)
    assert [r["error"] for r in results[2:]] == [None, None]


def test_a_callbacks_error_reads_as_what_went_wrong() -> None:
    import torch

    from omnireduce.errors import OmniReduceError
    from omnireduce.integrations.fsdp.hook import reason

    def fails(f: torch.futures.Future) -> None:
        f.value()
        raise OmniReduceError("collective engine: timed out")

    fut: torch.futures.Future = torch.futures.Future()
    chained = fut.then(fails)
    fut.set_result(None)
    with pytest.raises(RuntimeError) as e:
        chained.wait()
    assert "\nAt:\n" in str(e.value) or "callback" in str(e.value)  # (torch's wrapping, which reason() undoes)
    assert reason(e.value) == "OmniReduceError: collective engine: timed out"
    assert reason(ValueError("plain")) == "ValueError: plain"


def test_backward_passes_count_the_iterations_and_end_after_the_last_hook() -> None:
    """Each backward pass that calls hooks is one iteration, ended once after its last hook (hooks run
    from autograd and from a final callback queued before, as FSDP's root callback is); a pass whose
    end never ran (a final callback before it failed) is not ended, and the next one counts on; a
    call outside backward ends at once."""
    import torch
    from torch.autograd import Variable

    from omnireduce.integrations.fsdp.passes import BackwardPasses

    log: list[tuple[str, int]] = []
    passes = BackwardPasses(lambda it, device: log.append(("end", it)))

    def hook(g: torch.Tensor) -> torch.Tensor:
        log.append(("hook", passes.enter(g)))
        passes.leave()
        return g

    def fails() -> None:
        raise RuntimeError("a failing callback")

    def backward(fail: bool = False) -> None:
        x = torch.ones(3, requires_grad=True)
        a, b = x * 2, x * 3
        if fail:  # (queued before the pass's end: autograd stops at it)
            a.register_hook(lambda g: Variable._execution_engine.queue_callback(fails))
        a.register_hook(hook)
        b.register_hook(lambda g: Variable._execution_engine.queue_callback(lambda: hook(g)) or g)
        (a.sum() + b.sum()).backward()

    backward()
    backward()
    with pytest.raises(RuntimeError, match="a failing callback"):
        backward(fail=True)
    backward()
    hook(torch.zeros(1))  # (outside backward: a pass of its own)
    assert log == [("hook", 0), ("hook", 0), ("end", 0), ("hook", 1), ("hook", 1), ("end", 1),
                   ("hook", 2), ("hook", 2), ("hook", 3), ("hook", 3), ("end", 3), ("hook", 4), ("end", 4)], log
