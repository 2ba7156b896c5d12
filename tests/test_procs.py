"""omnireduce.procs: ports, starting an aggregator (and failing to), stopping processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

import omnireduce.run
from omnireduce.procs import free_port, start_aggregator, stop_processes

AGG = [sys.executable, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://127.0.0.1:0", "--log-level", "WARNING"]
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_start_aggregator_returns_its_address() -> None:
    p, address = start_aggregator(AGG)
    try:
        assert address.startswith("tcp://127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
        assert p.poll() is None
    finally:
        stop_processes([p])
    assert p.returncode is not None


def test_start_aggregator_reports_what_a_failing_one_said() -> None:
    cmd = [sys.executable, "-c", "import sys; print('no such option'); sys.stderr.write('bad things'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="agg 7 did not start: printed 'no such option': bad things"):
        start_aggregator(cmd, name="agg 7", stderr=subprocess.PIPE)


def test_start_aggregator_gives_up_on_a_silent_one() -> None:
    procs: list[subprocess.Popen[str]] = []

    def popen(*args: object, **kw: object) -> subprocess.Popen[str]:
        procs.append(subprocess.Popen(*args, **kw))
        return procs[-1]

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"printed nothing in 0\.5 s"):
        start_aggregator([sys.executable, "-c", "import time; time.sleep(60)"], popen, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert procs[0].returncode is not None  # stopped and reaped


def test_stop_processes_kills_after_one_shared_grace_period() -> None:
    procs = [subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    stop_processes(procs, grace=1.0)
    assert time.monotonic() - t0 < 2.5  # not 1 s per process
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3
    stop_processes(procs)  # already stopped: nothing to do


def test_omnireduce_run_stops_the_aggregators_it_started_when_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[str]] = []

    def second_fails(cmd: list[str], *args: object, **kw: object) -> tuple[subprocess.Popen[str], str]:
        if started:
            raise RuntimeError("aggregator 1 did not start")
        p, address = start_aggregator(cmd, *args, **kw)
        started.append(p)
        return p, address

    monkeypatch.setattr(omnireduce.run, "start_aggregator", second_fails)
    with pytest.raises(RuntimeError, match="aggregator 1"):
        omnireduce.run._start_aggregators(2, "WARNING")
    assert len(started) == 1 and started[0].returncode is not None
