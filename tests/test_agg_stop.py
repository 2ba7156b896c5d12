"""How an aggregator process stops: at once on SIGTERM (however many arrive, however close together),
and, for a job's own (colocated) aggregator whose starter has ended, as soon as the last worker has
said goodbye, or after its drain deadline when one never does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import omnireduce
from omnireduce.launch.procs import COLOCATED_MODULE, aggregator_command, start_aggregator, stop_processes

AGG = [sys.executable, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://127.0.0.1:0", "--log-interval", "0"]


def _exit_time(p: subprocess.Popen[str], limit: float = 10.0) -> float:
    start = time.monotonic()
    try:
        p.wait(limit)
    except subprocess.TimeoutExpired:
        stop_processes([p], grace=0)
        pytest.fail(f"pid {p.pid} still running {limit} s later")
    return time.monotonic() - start


def test_sigterm_twice_in_a_row_stops_promptly() -> None:
    # The signal handler only sets a flag; it once took an Event's lock, which a second signal arriving
    # inside the first handler's Event.set() took again: the process hung until SIGKILL.
    procs = [start_aggregator(AGG)[0] for _ in range(12)]
    try:
        for p in procs:
            for _ in range(3):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            assert _exit_time(p) < 5.0
            assert p.returncode == 0, f"exit {p.returncode}"
    finally:
        stop_processes(procs, grace=0)


def test_sigterm_while_it_ends_is_ignored() -> None:
    # SIGTERMs keep coming while the aggregator stops: once its loop has ended it is leaving anyway,
    # and a signal then (Python restores the default action as it finalizes) must not kill it.
    for _ in range(3):
        p, _address = start_aggregator(AGG)
        try:
            start = time.monotonic()
            while p.poll() is None and time.monotonic() - start < 5.0:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
                time.sleep(0.0005)
            assert _exit_time(p) < 5.0
            assert p.returncode == 0, f"exit {p.returncode}"
        finally:
            stop_processes([p], grace=0)


def _colocated(drain: float) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, OMNIREDUCE_TOKEN="t0k3n")
    cmd = aggregator_command("tcp://127.0.0.1:0", module=COLOCATED_MODULE, drain=drain, log_level=None,
                             log_interval=0)
    return start_aggregator(cmd, env=env, stdin=subprocess.PIPE)


def test_colocated_aggregator_waits_for_its_workers_then_stops() -> None:
    p, address = _colocated(drain=30.0)
    try:
        with omnireduce.Worker([address], rank=0, world_size=1, job="drain", token="t0k3n", timeout=10) as w:
            x = np.random.default_rng().standard_normal(1000).astype(np.float32)
            assert p.stdin is not None
            p.stdin.close()  # the starter is gone: the aggregator serves on while a worker is connected
            time.sleep(1.0)
            assert p.poll() is None
            np.testing.assert_array_equal(w.allreduce(x), x)
        # the worker said goodbye: the aggregator goes within a sweep, long before its 30 s deadline
        assert _exit_time(p) < 5.0 and p.returncode == 0
    finally:
        stop_processes([p], grace=0)


def test_colocated_aggregator_stops_at_its_drain_deadline() -> None:
    p, address = _colocated(drain=2.0)
    w = omnireduce.Worker([address], rank=0, world_size=1, job="stuck", token="t0k3n", timeout=10)
    try:
        assert p.stdin is not None
        p.stdin.close()
        took = _exit_time(p)
        assert 1.5 < took < 6.0, f"stopped {took:.1f} s after end-of-file, its drain deadline is 2 s"
        assert p.returncode == 0
    finally:
        stop_processes([p], grace=0)
        w.close()
