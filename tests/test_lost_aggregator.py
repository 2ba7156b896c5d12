"""An aggregator lost for good does not stop training: its slots go to the live aggregators by the same
rule on every rank (omnireduce.worker.routing), and it is used again once every rank reaches it
(omnireduce.ddp.routing.agreement). Real aggregator processes, SIGKILL, real Gloo process groups, plain DDP as
the reference."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from pathlib import Path

from omnireduce.launch.procs import free_port
from tests.harness import AGG, RankPool, start_aggregator
from tests.test_faults import _loop_cases, _wait_for_slots

LOST = {"OMNIREDUCE_LOST_AFTER": "1"}


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def test_tensors_in_flight_move_to_the_live_aggregator_exactly(pool: RankPool, job: str) -> None:
    metrics = free_port()
    a0, addr0 = start_aggregator(0)
    a1, addr1 = start_aggregator(0, "--metrics-port", str(metrics))
    cases = _loop_cases(40, 100_000, 600_000)  # all in flight at once
    try:
        handle = pool.submit([addr0, addr1], 3, cases, job=job, timeout=20.0, verify=True, env=LOST)
        _wait_for_slots(metrics, 5)
        a1.send_signal(signal.SIGKILL)
        a1.wait()
        outs = pool.collect(handle, timeout=180)
    finally:
        for a in (a0, a1):
            a.kill()
            a.wait()
    for rank, out in enumerate(outs):
        for case, (status, *rest) in zip(cases, out["results"], strict=True):
            assert status == "ok", f"rank {rank}, {case}: {rest}"  # checked in the rank against float64
        st = out["stats"]
        assert st["aggregators_lost"] == 1 and st["slots_rerouted"] > 0, f"rank {rank}: {st}"
        assert st["aggregators_in_use"] == -1, f"rank {rank}: {st}"  # (a delta: from 2 to 1)


def _check_training(results: list[dict], steps: int = 40) -> None:
    for rank, r in enumerate(results):
        assert r["steps"] == steps, f"rank {rank}: {r['steps']} steps"
        assert r["max_abs_diff"] <= 1e-5, f"rank {rank}: parameters differ from plain DDP by {r['max_abs_diff']:.3g}"
        assert r["stats"]["buckets_failed"] == 0, f"rank {rank}: {r['stats']}"
    assert sum(r["killed"] for r in results) == 1


def test_ddp_trains_on_after_a_dedicated_aggregator_dies_for_good(pool: RankPool) -> None:
    a0, addr0 = start_aggregator(0)
    a1, addr1 = start_aggregator(0)
    try:
        res = pool.call("tests.ddp_cases:lost_aggregator", 3, port=free_port(), aggregators=[addr0, addr1],
                        kill={"rank": 0, "step": 10, "pid": a1.pid}, env=LOST, timeout=240)
    finally:
        for a in (a0, a1):
            a.kill()
            a.wait()
    _check_training(res)
    for rank, r in enumerate(res):
        # two aggregators until step 10, one from then on (the agreement follows an iteration later)
        assert r["in_use"][:9] == [2] * 9 and r["in_use"][12:] == [1] * 28, f"rank {rank}: {r['in_use']}"
        assert r["worker"]["aggregators_lost"] == 1 and r["worker"]["slots_rerouted"] > 0, r["worker"]
        assert r["stats"]["aggregators_in_use"] == [addr0]


def lost_and_back(pool: RankPool, tmp_path: Path, world_size: int, **options: object) -> tuple[list[dict], list[str],
                                                                                               float]:
    """``tests.ddp_cases:lost_aggregator`` with two dedicated aggregators, the second SIGKILLed at step 10
    and started again (same port) at step 25; returns the ranks' results, the addresses and how many
    slots the restarted one completed."""
    port, metrics = free_port(), free_port()
    a0, addr0 = start_aggregator(0)
    a1, addr1 = start_aggregator(port)
    pidfile = tmp_path / "restarted.pid"
    cmd = [AGG, "--listen", f"tcp://127.0.0.1:{port}", "--metrics-port", str(metrics), "--log-interval", "0"]
    try:
        res = pool.call("tests.ddp_cases:lost_aggregator", world_size, port=free_port(), aggregators=[addr0, addr1],
                        kill={"rank": 0, "step": 10, "pid": a1.pid},
                        restart={"rank": 1, "step": 25, "cmd": cmd, "pidfile": str(pidfile)}, env=LOST, timeout=300,
                        **options)
        used = _metric(metrics, "omnireduce_aggregator_slots_completed_total")
    finally:
        for a in (a0, a1):
            a.kill()
            a.wait()
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
    return res, [addr0, addr1], used


def test_ddp_uses_a_lost_aggregator_again_once_it_returns(pool: RankPool, tmp_path: Path) -> None:
    res, (addr0, addr1), used = lost_and_back(pool, tmp_path, 3)
    _check_training(res)
    for rank, r in enumerate(res):
        assert r["in_use"][12:25] == [1] * 13, f"rank {rank}: {r['in_use']}"
        assert r["in_use"][27:] == [2] * 13, f"rank {rank}: back to both after the restart: {r['in_use']}"
        assert r["stats"]["aggregators_in_use"] == [addr0, addr1]
    assert used > 0, "the restarted aggregator completed no slot"


def test_ddp_trains_on_after_a_colocated_aggregator_dies(pool: RankPool) -> None:
    # two nodes (ranks 0, 1 and rank 2); node 1's aggregator dies, its rank lives
    res = pool.call("tests.ddp_cases:lost_aggregator", 3, port=free_port(), aggregators=None, nodes=[0, 0, 1],
                    kill={"rank": 2, "step": 10, "colocated": True}, env=LOST, timeout=240)
    _check_training(res)
    for rank, r in enumerate(res):
        assert r["in_use"][12:] == [1] * 28, f"rank {rank}: {r['in_use']}"
        assert r["worker"]["aggregators_lost"] == 1, r["worker"]
