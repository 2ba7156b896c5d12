"""scripts/netem.py: shaped links carry their rate, and teardown leaves nothing behind.

Needs root and ``ip netns``; skipped (with :func:`netem.available`'s reason) otherwise.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
netem = importlib.import_module("netem")


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


def _leftovers(cluster_id: str) -> tuple[list[str], list[str]]:
    return netem.list_namespaces(cluster_id + "-"), netem.list_links(netem.PREFIX)


def test_1gbit_link_carries_its_rate_and_teardown_is_clean() -> None:
    with netem.Cluster(workers=1, aggregators=1, rate="1gbit") as c:
        w, a = c.workers[0], c.aggregators[0]
        assert w.address != a.address and w.address.startswith("10.")
        assert set(netem.list_namespaces(c.id + "-")) == {w.name, a.name, c.bridge_ns}
        addr = c.run(w, ["ip", "-o", "-4", "addr", "show", "dev", w.interface], capture_output=True, text=True,
                     check=True).stdout
        assert f"{w.address}/16" in addr
        assert netem.list_links(netem.PREFIX) == []  # nothing in the root namespace
        # a process started through the API and a background one started behind its back
        sleeper = a.popen(["sleep", "60"])
        c.run(w, ["sh", "-c", "sleep 60 >/dev/null 2>&1 &"], check=True)
        orphans = [int(p) for p in subprocess.run(["ip", "netns", "pids", w.name], capture_output=True,
                                                  text=True).stdout.split()]
        assert orphans

        bps = netem.measure_throughput(w, a, seconds=2.0)
        assert 0.8e9 <= bps <= 1.05e9, f"1gbit link carried {bps / 1e9:.3f} Gbit/s"

    assert _leftovers(c.id) == ([], [])
    assert sleeper.poll() is not None
    deadline = time.monotonic() + 2
    while not all(_gone(p) for p in orphans) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in orphans)


def test_teardown_on_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), netem.Cluster(workers=2, aggregators=0, rate=None) as c:
        assert len(netem.list_namespaces(c.id + "-")) == 3
        raise RuntimeError("boom")
    assert _leftovers(c.id) == ([], [])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_signal(sig: signal.Signals) -> None:
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(SCRIPTS)!r})
        import netem
        with netem.Cluster(workers=1, aggregators=1, rate="1gbit") as c:
            c.workers[0].popen(["sleep", "60"])
            print(c.id, flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        cluster_id = p.stdout.readline().strip()
        assert cluster_id.startswith(netem.PREFIX), p.stderr.read() if p.stderr else ""
        assert len(netem.list_namespaces(cluster_id + "-")) == 3
        os.kill(p.pid, sig)
        p.wait(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert _leftovers(cluster_id) == ([], [])


def test_cleanup_removes_orphans() -> None:
    # Simulate a SIGKILLed owner: a namespace named after a pid that no longer exists.
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netem.PREFIX}{dead.pid}-0-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netem.cleanup()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert name not in netem.list_namespaces()
