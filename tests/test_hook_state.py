"""The DDP hook's state on its own: counters under concurrent adds, and pickling (what travels: the
options without the token, the recorder's counts and densities, the iteration; what an unpickled
state starts again from: no runtime)."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.ddp import OmniReduceState
from omnireduce.ddp.options import Mode, Options
from omnireduce.ddp.recorder import COUNTERS, HookCounters
from omnireduce.engines.reducer import ReductionInfo


def test_counters_add_under_one_lock_from_many_threads() -> None:
    counters = HookCounters()
    threads, per_thread = 8, 2000

    def work(t: int) -> None:
        for _ in range(per_thread):
            counters.add(buckets_dense=1, bytes_sent=t, bytes_received=2 * t)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    want = dict.fromkeys(COUNTERS, 0)
    want["buckets_dense"] = threads * per_thread
    want["bytes_sent"] = per_thread * sum(range(threads))
    want["bytes_received"] = 2 * want["bytes_sent"]
    assert counters.snapshot() == want
    with pytest.raises(KeyError):
        counters.add(buckets_dense=1, bucket_dense=1)  # misspelt: nothing is added
    assert counters.snapshot() == want
    clone = pickle.loads(pickle.dumps(counters))
    clone.add(buckets_failed=3)
    assert clone.snapshot() == {**want, "buckets_failed": 3} and counters.snapshot() == want


def test_state_pickles_its_options_and_recorder_and_no_runtime() -> None:
    assert not dist.is_initialized()  # (else the state would bind as it is made)
    state = OmniReduceState(aggregators="tcp://127.0.0.1:1", job="j", token="s3cret", dense_threshold=0.4,
                            align_blocks=False)
    state.iteration = 3
    state.recorder.reduced((0, 100), ReductionInfo(blocks_total=4, blocks_union=1, bytes_sent=10, bytes_received=20),
                           nbytes=400, world_size=4)  # (union density 0.25)
    state.recorder.reduced((1, 50), ReductionInfo(bytes_sent=30, bytes_received=30, dense=True), nbytes=200,
                           world_size=4, coo=True)
    densities = state.recorder.densities
    assert densities.first_sight((2, 8)) and not densities.first_sight((2, 8))
    state.warn_once("float64", "float64 buckets go dense")

    blob = pickle.dumps(state)
    assert b"s3cret" not in blob
    assert set(state.__getstate__()) == {"options", "recorder", "iteration", "warned"}
    clone = pickle.loads(blob)
    assert isinstance(clone.options, Options) and clone.options == Options(**{**state.options.__getstate__()})
    assert (clone.job, clone.iteration, clone.options.dense_threshold, clone.options.align_blocks) == ("j", 3, 0.4,
                                                                                                          False)
    assert clone.path == "threshold" and clone.options.token is None and state.options.token == "s3cret"
    assert clone.options.worker_options() == {k: v for k, v in state.options.worker_options().items() if k != "token"}
    assert clone.rank is None and clone.world_size is None and clone.worker is None and not clone.bound
    assert clone._warned == {"float64"}
    stats = clone.stats()
    ring = 2 * 3 * 400 // 4 + 2 * 3 * 200 // 4  # the ring all-reduce's bytes of both buckets, 4 ranks
    assert (stats["buckets_sparse"], stats["buckets_dense"], stats["buckets_coo"]) == (1, 1, 1)
    assert (stats["bytes_sent"], stats["bytes_received"], stats["dense_equivalent_bytes"]) == (40, 50, ring)
    assert stats["density"] == {0: 0.25} and stats["paths"] == {} and stats["iteration"] == 3
    clone_densities = clone.recorder.densities
    assert clone_densities.reaches((0, 100), 0.4) is False and clone_densities.reaches((0, 100), 0.25) is True
    assert not clone_densities.first_sight((2, 8)) and clone_densities.first_sight((3, 8))


def test_path_knob_resolves_from_the_older_knobs_and_refuses_contradictions() -> None:
    assert not dist.is_initialized()
    assert OmniReduceState().path == "measure"
    assert OmniReduceState(dense_threshold=0.3).path == "threshold"
    assert OmniReduceState(dense_fallback=False).path == "omnireduce"
    assert OmniReduceState(path="dense", dense_threshold=0.3).path == "dense"
    with pytest.raises(ValueError, match="path must be one of"):
        OmniReduceState(path="fastest")
    with pytest.raises(ValueError, match="contradicts path='measure'"):
        OmniReduceState(path="measure", dense_fallback=False)
    with pytest.raises(ValueError, match="trials >= 1"):
        OmniReduceState(measure_trials=0)
    with pytest.raises(ValueError, match="engine must be one of"):
        OmniReduceState(engine="nccl")
    with pytest.raises(ValueError, match="remeasure_every"):
        OmniReduceState(remeasure_every=-1)



def test_a_state_pickled_by_the_previous_release_still_loads() -> None:
    """tests/data/state_a599527.pickle: an OmniReduceState pickled at commit a599527 (its path a plain string,
    no rail densities in its recorder): it loads, with its options, counts, densities and iteration."""
    assert not dist.is_initialized()
    clone = pickle.loads((Path(__file__).resolve().parent / "data" / "state_a599527.pickle").read_bytes())
    assert clone.path == "threshold" and isinstance(clone.options.path, Mode) and not clone.bound
    assert (clone.job, clone.iteration, clone.options.dense_threshold) == ("j", 7, 0.4)
    assert clone.options.compression == BlockTopK(density=0.05, warmup_steps=3) and clone.residuals is not None
    stats = clone.stats()
    assert (stats["bytes_sent"], stats["dense_equivalent_bytes"], stats["buckets_sparse"]) == (40, 900, 1)
    assert stats["density"] == {0: 0.25} and clone._warned == {"float64"}
    assert clone.recorder.rail_densities.latest() == {}


def test_an_older_compression_checkpoint_loads_into_the_one_state() -> None:
    """A checkpoint in the older format ({"step", "options", "residuals"}: the deprecated
    CompressionState.state_dict()) restores the iteration and the residuals of OmniReduceState(compression=...)."""
    model = torch.nn.Linear(3, 2)
    saved = {"step": 12, "options": {"density": 0.05},
             "residuals": {"weight": torch.arange(6, dtype=torch.float32), "bias": torch.ones(2)}}
    state = OmniReduceState(aggregators="tcp://127.0.0.1:1", compression=BlockTopK(density=0.05))
    state.load_compression_state_dict(model, saved)
    assert state.iteration == 12
    back = state.compression_state_dict(model)
    assert back["iteration"] == 12 and set(back["residuals"]) == {"weight", "bias"}
    assert all(torch.equal(back["residuals"][n], t) for n, t in saved["residuals"].items())
