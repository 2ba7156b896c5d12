"""ombench.netem: shaped links carry their rate, and teardown leaves nothing behind.

Needs root and ``ip netns``; skipped (with :func:`netem.available`'s reason) otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ombench import child_env, netem


@pytest.fixture(autouse=True)
def _needs_netns() -> None:
    ok, why = netem.available()
    if not ok:
        pytest.skip(f"network emulation unavailable: {why}")


def _gone(pid: int) -> bool:
    """The process has exited (no /proc entry, or a zombie nobody reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


def _root_links() -> set[str]:
    """Names of the links in this (the root) network namespace."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _wait_gone(pids: list[int], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_gone(p) for p in pids)


@pytest.fixture
def root_links_unchanged() -> Iterator[set[str]]:
    """The root namespace's links before the test; asserts after it that they are the same."""
    before = _root_links()
    yield before
    assert _root_links() == before, "the root namespace's links changed"


def test_1gbit_link_carries_its_rate_and_teardown_is_clean(root_links_unchanged: set[str]) -> None:
    with netem.Cluster(workers=1, aggregators=1, rate="1gbit") as c:
        w, a = c.workers[0], c.aggregators[0]
        assert w.address != a.address and w.address.startswith("10.")
        assert set(netem.list_namespaces(c.id + "-")) == {w.name, a.name, c.bridge_ns}
        addr = c.run(w, ["ip", "-o", "-4", "addr", "show", "dev", w.interface], capture_output=True, text=True,
                     check=True).stdout
        assert f"{w.address}/16" in addr
        assert _root_links() == root_links_unchanged  # nothing in the root namespace
        # a process started through the API and a background one started behind its back
        sleeper = a.popen(["sleep", "60"])
        c.run(w, ["sh", "-c", "sleep 60 >/dev/null 2>&1 &"], check=True)
        orphans = [int(p) for p in subprocess.run(["ip", "netns", "pids", w.name], capture_output=True,
                                                  text=True).stdout.split()]
        assert orphans

        bps = netem.measure_throughput(w, a, seconds=2.0)
        assert 0.8e9 <= bps <= 1.05e9, f"1gbit link carried {bps / 1e9:.3f} Gbit/s"

    assert netem.list_namespaces(c.id + "-") == []
    assert sleeper.poll() is not None
    assert _wait_gone(orphans)


def test_teardown_on_exception(root_links_unchanged: set[str], caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RuntimeError, match="boom"), netem.Cluster(workers=2, aggregators=0, rate=None) as c:
        assert len(netem.list_namespaces(c.id + "-")) == 3
        raise RuntimeError("boom")
    assert netem.list_namespaces(c.id + "-") == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_teardown_goes_on_after_a_failing_step(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    c = netem.Cluster(workers=2, aggregators=1, rate=None).start()
    real_ip = netem._ip
    failed: list[str] = []

    def flaky_ip(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("netns", "del") and not failed:  # the first deletion hangs
            failed.append(args[2])
            raise subprocess.TimeoutExpired(["ip", *args], 10)
        return real_ip(*args, **kw)

    def broken_kill(*_args: object, **_kw: object) -> None:
        raise OSError("cannot list the namespace's processes")

    monkeypatch.setattr(netem, "_ip", flaky_ip)
    monkeypatch.setattr(netem, "_kill_namespace_processes", broken_kill)
    try:
        c.close()
        assert netem.list_namespaces(c.id + "-") == failed  # every other namespace is gone
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "cannot list the namespace's processes" in messages and "left behind" in messages
        c.close()  # idempotent
    finally:
        monkeypatch.undo()
        netem.cleanup(prefix=c.id + "-", include_live=True)
    assert netem.list_namespaces(c.id + "-") == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_signal(sig: signal.Signals, root_links_unchanged: set[str]) -> None:
    code = textwrap.dedent("""
        import signal, time
        # a shell's background job starts its children with SIGINT ignored: this one must take it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from ombench import netem
        with netem.Cluster(workers=1, aggregators=1, rate="1gbit") as c:
            sleeper = c.workers[0].popen(["sleep", "60"])
            print(c.id, sleeper.pid, flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    cluster_id = ""
    try:
        assert p.stdout is not None
        cluster_id, _, sleeper = p.stdout.readline().strip().partition(" ")
        assert cluster_id.startswith(netem.PREFIX), p.stderr.read() if p.stderr else ""
        assert not _gone(int(sleeper))
        assert len(netem.list_namespaces(cluster_id + "-")) == 3
        os.kill(p.pid, sig)
        p.wait(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()  # (no teardown of its own then: the test's cleanup does it)
            p.wait()
            if cluster_id.startswith(netem.PREFIX):
                netem.cleanup(prefix=cluster_id + "-", include_live=True)
    assert p.returncode != 0
    assert netem.list_namespaces(cluster_id + "-") == []
    assert _wait_gone([int(sleeper)]), "the process started in the cluster outlived its teardown"



# A benchmark (ombench.network.Network) that starts an aggregator and a rank, prints their pids, and is
# then SIGKILLed: it cannot stop them, they must go by themselves (omnireduce.launch.procs's policy: a pipe as
# standard input, watched by the colocated aggregator and by the rank's exit_with_parent).
_BENCH = """
import json, os, sys
from pathlib import Path
from ombench.network import Network
name, log = sys.argv[1], Path(sys.argv[2])
with Network(name, 1, 1) as net:
    net.start_aggregators(port=7000 if net.cluster is not None else 0)
    print(net.cluster.id if net.cluster is not None else "-", net.aggregator_pids[0], flush=True)
    net.run_ranks([sys.executable, "-c", sys.argv[3]], [dict(os.environ)], [log], timeout=120)
"""
_RANK = ("import os, time; from omnireduce.lifetime import exit_with_parent; assert exit_with_parent() is not None; "
         "print(os.getpid(), flush=True); time.sleep(120)")


@pytest.mark.parametrize("name", ["loopback", "1gbit"])
def test_a_sigkilled_benchmark_leaves_no_aggregator_or_rank(name: str, tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    p = subprocess.Popen([sys.executable, "-c", _BENCH, name, str(log), _RANK], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env())
    cluster_id, pids = "", []
    try:
        assert p.stdout is not None
        cluster_id, _, agg = p.stdout.readline().strip().partition(" ")
        assert agg, p.stderr.read() if p.stderr else ""
        pids.append(int(agg))
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids.append(int(log.read_text().split()[0]))
        assert not any(_gone(pid) for pid in pids)
        p.kill()
        p.wait()
        assert _wait_gone(pids, 15.0), f"orphaned: {[pid for pid in pids if not _gone(pid)]} (aggregator, rank)"
    finally:
        p.kill()
        p.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if cluster_id.startswith(netem.PREFIX):  # the benchmark died before it could tear its network down
            netem.cleanup(prefix=cluster_id + "-", include_live=True)


def test_cleanup_removes_orphans() -> None:
    # Simulate a SIGKILLed owner: a namespace named after a pid that no longer exists.
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netem.PREFIX}{dead.pid}-0-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netem.cleanup()
        assert name not in netem.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_cleanup_keeps_namespaces_of_live_owners() -> None:
    # This process is alive: its namespace belongs to a running cluster and must survive cleanup().
    name = f"{netem.PREFIX}{os.getpid()}-cleanup{time.monotonic_ns()}-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name not in netem.cleanup(include_live=False)
        assert name in netem.list_namespaces()
        assert name in netem.cleanup(prefix=name, include_live=True)
        assert name not in netem.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
