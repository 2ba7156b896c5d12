"""The DDP hook's state on its own: counters under concurrent adds, and pickling derived from the
state's field declarations (what travels, what an unpickled state starts again from)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch.distributed as dist

from omnireduce.ddp import OmniReduceState
from omnireduce.hook_coo import CooBatch
from omnireduce.hook_counters import COUNTERS, HookCounters
from omnireduce.path_choice import PathChoice


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


def test_state_pickles_its_declared_fields_and_no_binding() -> None:
    assert not dist.is_initialized()  # (else the state would bind as it is made)
    state = OmniReduceState(aggregators="tcp://127.0.0.1:1", job="j", token="s3cret", dense_threshold=0.4,
                            align_blocks=False)
    state.world_size = 4  # (as binding would set it; record() counts ring bytes with it)
    state.iteration = 3
    state.record((0, 100), 0.25, False, 10, 20, 400)
    state.record((1, 50), None, True, 30, 30, 200, coo=True)
    assert state.first_sight((2, 8)) and not state.first_sight((2, 8))
    state._pending_coo._pending.append(object())  # a sparse bucket in flight: not pickled

    blob = pickle.dumps(state)
    assert b"s3cret" not in blob
    assert set(state.__getstate__()) == {"worker_options", "job", "path", "dense_fallback", "dense_threshold",
                                         "measure_trials", "remeasure_every", "align_blocks", "hierarchical", "engine",
                                         "_decisions", "iteration", "_counters", "_warned"}
    clone = pickle.loads(blob)
    assert (clone.job, clone.iteration, clone.dense_threshold, clone.align_blocks) == ("j", 3, 0.4, False)
    assert clone.path == "threshold" and isinstance(clone._paths, PathChoice) and clone._paths is not state._paths
    assert clone.worker_options == {**state.worker_options, "token": None}
    assert clone.rank is None and clone.world_size is None and clone.worker is None and not clone.bound
    assert isinstance(clone._pending_coo, CooBatch) and len(clone._pending_coo) == 0
    stats = clone.stats()
    ring = 2 * 3 * 400 // 4 + 2 * 3 * 200 // 4  # the ring all-reduce's bytes of both buckets, 4 ranks
    assert (stats["buckets_sparse"], stats["buckets_dense"], stats["buckets_coo"]) == (1, 1, 1)
    assert (stats["bytes_sent"], stats["bytes_received"], stats["dense_equivalent_bytes"]) == (40, 50, ring)
    assert stats["density"] == {0: 0.25}
    assert clone.use_dense((0, 100)) is False and not clone.first_sight((2, 8)) and clone.first_sight((3, 8))
    clone.dense_threshold = 0.25
    assert clone.use_dense((0, 100)) is True


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

