"""Faults: aggregator restarts and deaths, dead workers, GOODBYE, CURVE, metrics. Real processes."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import omnireduce
from omnireduce.launch.procs import free_port
from tests.harness import (
    AGG,
    Case,
    RankPool,
    RankThreads,
    assert_matches,
    drop_results,
    reference,
    start_aggregator,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent


def _loop_cases(n: int, small: int = 50_000, large: int = 400_000) -> list[Case]:
    rng = np.random.default_rng(11)
    return [Case(int(rng.integers(small, large)), dtype=["float32", "float16", "bfloat16"][i % 3],
                 density=float(rng.choice([0.01, 0.1, 0.5, 1.0])), seed=1000 + i, kind="torch", specials=i % 7 == 0)
            for i in range(n)]


def _slots_completed(metrics_port: int) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("omnireduce_aggregator_slots_completed_total "):
            return float(line.split()[1])
    return 0.0


def _wait_for_slots(metrics_port: int, n: int, timeout: float = 60.0) -> None:
    """Wait until the aggregator serving metrics on ``metrics_port`` has completed ``n`` slots."""
    done = wait_for(lambda: _slots_completed(metrics_port) >= n, timeout)
    assert done, f"the aggregator completed {_slots_completed(metrics_port):g} slots in {timeout} s, not {n}"


@pytest.mark.torch  # (_loop_cases: torch tensors, bfloat16 among them)
def test_aggregator_restarts_mid_loop_and_every_result_is_exact(pool: RankPool, job: str) -> None:
    port = free_port()
    metrics = free_port()
    agg, address = start_aggregator(port, "--metrics-port", str(metrics))
    cases = _loop_cases(60, 200_000, 1_000_000)  # all submitted at once: the loop is in flight throughout
    restarts = 2
    try:
        handle = pool.submit([address], 3, cases, job=job, timeout=30.0, verify=True)
        for _ in range(restarts):  # once some slots are done, SIGKILL it and start it again on the same port
            _wait_for_slots(metrics, 10)
            agg.send_signal(signal.SIGKILL)
            agg.wait()
            time.sleep(0.2)
            metrics = free_port()
            agg, _ = start_aggregator(port, "--metrics-port", str(metrics))
        outs = pool.collect(handle, timeout=300)
    finally:
        agg.kill()
        agg.wait()
    for rank, out in enumerate(outs):
        assert len(out["results"]) == len(cases)
        for case, (status, *rest) in zip(cases, out["results"], strict=True):
            assert status == "ok", f"rank {rank}, {case}: {rest}"  # checked in the rank against float64
    assert sum(o["stats"].get("tensors", 0) for o in outs) == 3 * len(cases)
    # Every restart hits every rank: each kill comes right after the aggregator completed 10 of the
    # loop's 179 slots, so every rank still has tensors in flight with it (a rank finishes a tensor
    # only once the aggregator completed all of its slots), and the new instance's WELCOME makes
    # the rank retry each of them.
    for rank, out in enumerate(outs):
        assert out["stats"]["retries"] >= restarts, f"rank {rank}: {out['stats']}"


@pytest.mark.torch  # (_loop_cases: torch tensors, bfloat16 among them)
def test_aggregator_killed_for_good_fails_every_rank_in_time(pool: RankPool, job: str) -> None:
    port, metrics = free_port(), free_port()
    agg, address = start_aggregator(port, "--metrics-port", str(metrics))
    timeout = 2.0
    cases = _loop_cases(200)
    try:
        handle = pool.submit([address], 3, cases, job=job, timeout=timeout, stop_on_error=True)
        # kill it mid-loop: once it completed some slots (in this sync loop a slot of tensor t
        # completes only after every rank finished tensor t - 1, so every rank has results)
        _wait_for_slots(metrics, 10)
    finally:
        agg.send_signal(signal.SIGKILL)
        killed = time.time()
        agg.wait()
    outs = pool.collect(handle, timeout=60)
    for rank, out in enumerate(outs):
        *oks, (status, kind, message, when) = out["results"]
        assert status == "error" and kind == "OmniReduceTimeout", (rank, kind, message)
        assert f"127.0.0.1:{port}" in message and "did not answer" in message, message
        assert oks, f"rank {rank} had no result before the kill"
        for case, (ok, values, _bits, _t) in zip(cases, oks, strict=False):
            assert ok == "ok"
            assert_matches(case, 3, values)
        # The failing tensor started before the kill, or (sync loop) right after the rank's last
        # result, which may be stamped after the kill; its deadline counts from its start, so it
        # fails within its timeout, plus the grace period of its QUERY, of the later of the two.
        start = max(killed, oks[-1][3])
        assert when - start < timeout + 2, f"rank {rank} failed {when - start:.2f} s after the kill or its last result"


def test_dead_worker_is_named_and_the_aggregator_serves_on(pool: RankPool, aggregator, job: str) -> None:
    victim = subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "victim.py"), aggregator.address,
                               job, "2", "3"], stdout=subprocess.PIPE, text=True)
    timeout = 3.0
    first = Case(10_000, density=1.0, seed=0)
    try:
        handle = pool.submit([aggregator.address], 3, [first, Case(20_000, density=0.5, seed=1)], job=job,
                             ranks=[0, 1], timeout=timeout)
        assert victim.stdout.readline().strip() == "ready"
        victim.send_signal(signal.SIGKILL)
        killed = time.time()
        outs = pool.collect(handle, timeout=60)
    finally:
        victim.kill()
        victim.wait()
    # the first tensor: ranks 0 and 1 reduce their inputs, the victim (rank 2) np.ones
    ref, mag = reference(first, 2)
    for out in outs:
        status, values, _bits, _when = out["results"][0]
        assert status == "ok"
        err = np.abs(values - (ref + 1.0))
        assert (err <= 1e-6 * (mag + 1.0)).all(), f"max error {err.max():.3g}"
        status, kind, message, when = out["results"][1]
        assert status == "error" and kind == "OmniReduceTimeout", message
        assert "[2]" in message, message  # names the dead rank
        assert when - killed < timeout + 2
    # the aggregator keeps serving: a new job on it succeeds
    outs = pool.run([aggregator.address], 2, [Case(30_000, density=0.2, seed=5)], job=job + "-next", verify=True)
    for out in outs:
        assert out["results"][0][0] == "ok", out["results"][0]  # checked in the rank against float64


def test_goodbye_frees_the_job_and_fails_waiting_ranks_at_once(aggregator, job: str) -> None:
    a = omnireduce.Worker([aggregator.address], rank=0, world_size=2, job=job, timeout=30)
    b = omnireduce.Worker([aggregator.address], rank=1, world_size=2, job=job, timeout=30)
    fut = a.allreduce_async(np.ones(1000, np.float32))
    time.sleep(0.3)
    t0 = time.monotonic()
    b.close()  # GOODBYE while rank 0 waits for it
    with pytest.raises(omnireduce.OmniReduceError, match="rank 1 left"):
        fut.result(10)
    assert time.monotonic() - t0 < 5
    a.close()
    deadline = time.monotonic() + 5
    while aggregator.gauges()["jobs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aggregator.gauges() == {"jobs": 0, "peers": 0, "slots_in_flight": 0, "held_bytes": 0}


def test_curve_encryption(tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "server.key"
    subprocess.run([AGG, "--curve-keygen", str(key)], check=True, capture_output=True)
    agg, address = start_aggregator(0, "--curve-secret-key-file", str(key))
    try:
        monkeypatch.setenv("OMNIREDUCE_CURVE_SERVER_KEY_FILE", f"{key}.pub")
        with omnireduce.Worker([address], rank=0, world_size=1, job=job, timeout=5) as w:
            assert w.allreduce(np.full(100, 2.0, np.float32)).sum() == 200
        monkeypatch.delenv("OMNIREDUCE_CURVE_SERVER_KEY_FILE")
        with pytest.raises(omnireduce.OmniReduceTimeout):  # a plain client cannot even say HELLO
            omnireduce.Worker([address], rank=0, world_size=1, job=job, timeout=1)
    finally:
        agg.terminate()
        agg.wait()


def test_metrics_endpoint_and_status_log(job: str, caplog: pytest.LogCaptureFixture) -> None:
    mport = free_port()
    agg, address = start_aggregator(0, "--metrics-port", str(mport))
    try:
        with omnireduce.Worker([address], rank=0, world_size=1, job=job, timeout=5) as w:
            w.allreduce(np.ones(100_000, np.float32))
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    finally:
        agg.terminate()
        agg.wait()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["omnireduce_aggregator_slots_completed_total"] >= 1
    assert values["omnireduce_aggregator_bytes_in_total"] > 400_000
    assert "omnireduce_aggregator_jobs" in values
    caplog.set_level(logging.INFO, logger="omnireduce.aggregator")
    with omnireduce.Aggregator(log_interval=0.3) as agg2, \
            omnireduce.Worker([agg2.address], rank=0, world_size=1, job=job, timeout=5) as w:
        w.allreduce(np.ones(1000, np.float32))
        time.sleep(0.8)
    assert any("slots/s" in r.getMessage() and "MB/s" in r.getMessage() for r in caplog.records)


def test_a_forgotten_job_is_joined_again_and_its_tensors_retried(job: str) -> None:
    """An aggregator that forgot the job (idle expiry) answers UNKNOWN_JOB: HELLO again, retry."""
    limits = omnireduce.AggregatorLimits(idle_job_seconds=0.5)
    with omnireduce.Aggregator(limits=limits) as agg, \
            omnireduce.Worker([agg.address], rank=0, world_size=1, job=job, timeout=10) as w:
        w.allreduce(np.ones(10, np.float32))
        deadline = time.monotonic() + 5
        while agg.gauges()["jobs"] and time.monotonic() < deadline:  # forgotten after 0.5 s idle
            time.sleep(0.1)
        assert agg.gauges()["jobs"] == 0
        x = np.arange(1000, dtype=np.float32)
        t0 = time.monotonic()
        assert np.array_equal(w.allreduce(x), np.arange(1000, dtype=np.float32))
        jobs = agg.gauges()["jobs"]  # (read at once: it is forgotten again after 0.5 s idle)
        assert time.monotonic() - t0 < 5 and w.stats()["tensors"] == 2
        assert jobs == 1, "joined again: the aggregator has the job once more"
        assert w.stats()["retries"] == 1, w.stats()  # the one tensor, retried once after the new WELCOME


def _close_all(workers: list, *aggregators: omnireduce.Aggregator | None) -> None:
    for w in workers:
        w.close()
    for agg in aggregators:
        if agg is not None:
            agg.stop()


def test_a_result_lost_with_the_aggregator_is_replayed_from_a_rank_that_got_it(job: str) -> None:
    """The aggregator dies after sending a slot's last result to rank 0 but not to rank 1: rank 0 has
    finished the tensor (its input is overwritten), rank 1 has not. After the restart, rank 0's
    FINAL is replayed to rank 1, which completes with the exact sum."""
    address = f"tcp://127.0.0.1:{free_port()}"
    first = omnireduce.Aggregator(address)
    lost = drop_results(first, lambda hdr, rank: rank == 1 and hdr.round == 1)  # "died" before these sends
    first.start()
    second = None
    xs = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(2)]
    want = xs[0].astype(np.float64) + xs[1]
    workers = []
    try:
        workers = [omnireduce.Worker([address], rank=r, world_size=2, job=job, timeout=20) for r in range(2)]
        ranks = RankThreads(lambda r: workers[r].allreduce(xs[r].copy()), 2).start()
        wait_for(lambda: ranks.finished(0), 10)
        assert 0 in ranks.results and not ranks.finished(1) and lost, "rank 0 should have finished, rank 1 not"
        first.stop()
        second = omnireduce.Aggregator(address).start()
        got = ranks.join(20)
        for r in range(2):
            np.testing.assert_allclose(got[r], want, rtol=1e-6)
            np.testing.assert_array_equal(got[r], xs[0] + xs[1])  # a sum of two float32 is rounded once
        # (the aggregator counts a replay after sending it: rank 1 may have it before it is counted)
        assert wait_for(lambda: second.counters["replays"] >= 1, 2.0), second.counters
        assert workers[1].stats()["tensors"] == 1
    finally:
        _close_all(workers, first, second)


def test_kept_sums_are_replayed_until_every_rank_has_finished_and_then_go(job: str) -> None:
    """The sums a rank keeps for replays are copies of their own (not the received messages' buffers),
    and go once every rank has finished the tensor, as the ranks' agreement tells (the MIN of
    ``finished_below``, handed to ``release_kept``), not before: rank 0 has finished, rank 1's last
    result died with the aggregator, so the MIN keeps rank 0's sums, and after the restart they are
    replayed to rank 1, which completes with the exact sum; then the MIN moves past the tensor and
    both ranks drop what they kept of it, long before the age limit. (Every other block non-zero: the
    blocks a rank sends are gathered into buffers of their own, which is what the copies may take.)"""
    address = f"tcp://127.0.0.1:{free_port()}"
    first = omnireduce.Aggregator(address)
    lost = drop_results(first, lambda hdr, rank: rank == 1 and hdr.round == 1)  # "died" before these sends
    first.start()
    second = None
    xs = [np.random.default_rng(10 + r).standard_normal(64 * 256).astype(np.float32) for r in range(2)]
    for x in xs:
        x.reshape(64, 256)[1::2] = 0.0
    workers = []
    try:
        workers = [omnireduce.Worker([address], rank=r, world_size=2, job=job, timeout=20) for r in range(2)]
        ranks = RankThreads(lambda r: workers[r].allreduce(xs[r].copy()), 2).start()
        wait_for(lambda: ranks.finished(0), 10)
        assert 0 in ranks.results and not ranks.finished(1) and lost, "rank 0 should have finished, rank 1 not"
        assert [w.finished_below() for w in workers] == [1, 0]
        kept = workers[0]._io._retained
        assert wait_for(lambda: 0 in kept, 5), "rank 0 keeps the finished tensor's sums"
        parts = [d for staged in kept[0]._staged.values() for _, d in staged]
        assert kept[0].gathered_bytes == 32 * 256 * 4, kept[0].gathered_bytes  # (its 32 blocks, gathered)
        assert parts and all(d.flags.owndata for d in parts), "the kept sums are copies of their own"
        below = min(w.finished_below() for w in workers)  # (the agreement: MIN over the ranks)
        for w in workers:
            w.release_kept(below)  # nothing below 0: rank 0 keeps tensor 0
        first.stop()
        second = omnireduce.Aggregator(address).start()
        got = ranks.join(20)
        for r in range(2):
            np.testing.assert_array_equal(got[r], xs[0] + xs[1])  # a sum of two float32 is rounded once
        assert wait_for(lambda: second.counters["replays"] >= 1, 2.0), second.counters
        below = min(w.finished_below() for w in workers)
        assert below == 1
        for w in workers:
            w.release_kept(below)
        assert wait_for(lambda: all(not w._io._retained and w._io._retained_bytes == 0 for w in workers), 5), \
            [dict(w._io._retained) for w in workers]
    finally:
        _close_all(workers, first, second)


def test_union_count_after_a_replay_is_the_same_on_every_rank(job: str) -> None:
    """The DDP hook decides dense vs sparse from ``info["blocks_union"]``; it must not depend on how
    a rank got its sums. Several rounds per lane: rank 1 takes part in round 1 only and loses every
    later RESULT with the aggregator; after the restart it gets the whole slot replayed, on top of
    the round it had already counted."""
    address = f"tcp://127.0.0.1:{free_port()}"
    first = omnireduce.Aggregator(address)
    drop_results(first, lambda hdr, rank: rank == 1 and hdr.round >= 2)
    first.start()
    second = None
    B = 256
    xs = [np.ones(64 * B, np.float32), np.zeros(64 * B, np.float32)]
    xs[1][: 4 * B] = 2.0  # row 0 of the 4 lanes only
    workers = []
    try:
        workers = [omnireduce.Worker([address], rank=r, world_size=2, job=job, timeout=20, lanes=4, slots=1)
                   for r in range(2)]
        futures = [workers[r].allreduce_async(xs[r].copy()) for r in range(2)]
        futures[0].result(10)
        assert not futures[1].done()
        first.stop()
        second = omnireduce.Aggregator(address).start()
        result = futures[1].result(20)
        assert workers[1].stats()["retries"] >= 1
        np.testing.assert_array_equal(result, xs[0] + xs[1])
        assert futures[0].info["blocks_union"] == futures[1].info["blocks_union"] == 64
    finally:
        _close_all(workers, first, second)
