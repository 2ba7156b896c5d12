"""omnireduce.launch.procs: ports, aggregator command lines, starting an aggregator (and failing to), stopping
processes, and children that go when their parent is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omnireduce.launch.run
from omnireduce.launch.procs import COLOCATED_MODULE, aggregator_command, free_port, start_aggregator, stop_processes

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

    monkeypatch.setattr(omnireduce.launch.run, "start_aggregator", second_fails)
    with pytest.raises(RuntimeError, match="aggregator 1"):
        omnireduce.launch.run._start_aggregators(2, "WARNING")
    assert len(started) == 1 and started[0].returncode is not None


def test_aggregator_command_is_what_each_starter_wrote_by_hand(tmp_path: Path) -> None:
    # the command lines run.py, colocate.py, the benchmarks and the tests assembled themselves before
    py = sys.executable
    assert aggregator_command("tcp://127.0.0.1:0") == AGG
    assert aggregator_command("tcp://127.0.0.1:0", log_level="INFO") == [
        py, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://127.0.0.1:0", "--log-level", "INFO"]
    assert aggregator_command("tcp://10.0.0.1:0", module=COLOCATED_MODULE, drain=10.0, log_interval=0,
                              socket_buffer=65536) == [
        py, "-m", "omnireduce.aggregator.colocated", "--drain", "10.0", "--listen", "tcp://10.0.0.1:0",
        "--log-level", "WARNING", "--log-interval", "0", "--socket-buffer", "65536"]
    assert aggregator_command("tcp://10.0.0.1:7000", insecure=True, socket_buffer=0, log_level=None) == [
        py, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://10.0.0.1:7000", "--insecure"]
    assert aggregator_command("tcp://127.0.0.1:1", token_file=tmp_path / "t", io_threads=3,
                              extra=["--max-jobs", "64"]) == [
        py, "-m", "omnireduce.aggregator.cli", "--listen", "tcp://127.0.0.1:1", "--token-file", str(tmp_path / "t"),
        "--log-level", "WARNING", "--io-threads", "3", "--max-jobs", "64"]
    with pytest.raises(ValueError, match="drain"):
        aggregator_command("tcp://127.0.0.1:0", drain=1.0)


def test_a_colocated_aggregator_command_starts() -> None:
    cmd = aggregator_command("tcp://127.0.0.1:0", module=COLOCATED_MODULE, drain=1.0, log_interval=0,
                             socket_buffer=65536, io_threads=1)
    p, address = start_aggregator(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert address.startswith("tcp://127.0.0.1:") and p.poll() is None
        assert p.stdin is not None
        p.stdin.close()  # its starter is done and no worker is connected: it stops by itself, well within 10 s
        assert p.wait(10) == 0
    finally:
        stop_processes([p])


# A parent that starts an aggregator and a child of its own, both by the library's policy (a pipe as
# standard input, watched), prints their pids, then waits to be killed.
_PARENT = """
import subprocess, sys, time
from omnireduce.launch.procs import COLOCATED_MODULE, aggregator_command, start_aggregator
agg, _ = start_aggregator(aggregator_command("tcp://127.0.0.1:0", module=COLOCATED_MODULE), stdin=subprocess.PIPE)
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert rank.stdout.readline().strip() == "watching"
print(agg.pid, rank.pid, flush=True)
time.sleep(120)
"""
_RANK = ("import time; from omnireduce.lifetime import exit_with_parent; assert exit_with_parent() is not None; "
         "print('watching', flush=True); time.sleep(120)")


def _gone(pid: int) -> bool:
    """Exited (no /proc entry, or a zombie its new parent has not reaped yet)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_children_go_when_their_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _RANK], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids += [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(pid) for pid in pids)
        parent.kill()  # no chance to stop them itself
        parent.wait()
        deadline = time.monotonic() + 15
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in pids if not _gone(pid)]
        assert not left, f"orphaned: {left} (aggregator, rank)"
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_exit_with_parent_watches_nothing_without_a_pipe() -> None:
    code = "from omnireduce.lifetime import exit_with_parent; print(exit_with_parent())"
    r = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "None"  # /dev/null would read as end-of-file at once: the process would stop itself
