"""A network partition between one rank and one aggregator, inside network namespaces (3 worker hosts,
2 aggregator hosts, packets between the pair dropped silently both ways): for 3 s (longer than a
round, shorter than the timeout) every result is exact; for good, every rank ends with a clear error
within the timeout, never a hang. Needs root and ``ip netns``; skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ombench import netem
from tests.harness import AGG

# Network namespaces and two runs of several seconds each: make test-e2e
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "partition_rank.py")
TIMEOUT = 10.0
LOST_AFTER = 5.0  # > the 3 s partition: the connection is kept (heartbeats time out after this too)


@pytest.fixture(autouse=True)
def _needs_netns() -> None:
    ok, why = netem.available()
    if not ok:
        pytest.skip(f"network emulation unavailable: {why}")


def _first_line(p: subprocess.Popen[str], timeout: float) -> str:
    line: list[str] = []
    t = threading.Thread(target=lambda: line.append(p.stdout.readline() if p.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    return line[0] if line else ""


def _partitioned_run(seconds: float | None, n: int) -> tuple[list[dict], float]:
    """Run the ranks; cut rank 0 from aggregator 1 once they are under way, for ``seconds`` (None: for
    good). Returns each rank's report and the time of the cut."""
    env = dict(os.environ, OMNIREDUCE_TOKEN="partition-t0k3n", OMNIREDUCE_LOST_AFTER=str(LOST_AFTER),
               PYTHONPATH=str(ROOT))
    env.pop("OMNIREDUCE_AGGREGATORS", None)
    with netem.Cluster(workers=3, aggregators=2, rate=None) as c:
        addresses = []
        for h in c.aggregators:
            p = h.popen([AGG, "--listen", f"tcp://{h.address}:7000", "--log-interval", "0"], env=env,
                        stdout=subprocess.PIPE, text=True)
            line = _first_line(p, 30)
            assert "listening" in line, f"aggregator {h.label} did not start: {line!r}"
            addresses.append(line.split()[-1])
        ranks = []
        for r, h in enumerate(c.workers):
            cfg = {"aggregators": addresses, "rank": r, "world_size": 3, "job": "partition", "timeout": TIMEOUT,
                   "n": n}
            ranks.append(h.popen([sys.executable, SCRIPT, json.dumps(cfg)], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for r, p in enumerate(ranks):
            assert _first_line(p, 60).strip() == "ready", f"rank {r} did not join"
        time.sleep(0.5)
        cut = time.time()
        c.cut(c.workers[0], c.aggregators[1])
        if seconds is not None:
            time.sleep(seconds)
            c.heal(c.workers[0], c.aggregators[1])
        reports = []
        for r, p in enumerate(ranks):
            try:
                out, err = p.communicate(timeout=TIMEOUT + 60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} hung: still running {TIMEOUT + 60:g} s after the cut")
            lines = [x for x in out.splitlines() if x.startswith("{")]
            assert lines, f"rank {r} exited {p.returncode} without a report: {err[-2000:]}"
            reports.append(json.loads(lines[-1]))
    return reports, cut


def test_a_3s_partition_is_survived_exactly() -> None:
    reports, _ = _partitioned_run(3.0, n=120)
    for r, rep in enumerate(reports):
        bad = [x for x in rep["results"] if x[0] != "ok"]
        assert not bad and len(rep["results"]) == 120, f"rank {r}: {bad[:1]}"
    # the partition was felt: some tensor of rank 0 waited through most of it
    longest = max(end - start for _, start, end in reports[0]["results"])
    assert longest > 2.0, f"rank 0's slowest tensor took {longest:.2f} s: the cut did not hit the loop"
    assert reports[0]["stats"]["aggregators_lost"] == 0


def test_a_lasting_partition_fails_every_rank_clearly_in_time() -> None:
    reports, cut = _partitioned_run(None, n=100_000)
    for r, rep in enumerate(reports):
        last = rep["results"][-1]
        assert last[0] == "error", f"rank {r} did not fail: {last}"
        _, _start, end, kind, message = last
        assert kind in ("OmniReduceTimeout", "OmniReduceError"), f"rank {r}: {kind}: {message}"
        assert "tensor" in message and ("timed out" in message or "abort" in message.lower()), message
        assert end - cut < TIMEOUT + 5, f"rank {r} failed {end - cut:.1f} s after the cut"
