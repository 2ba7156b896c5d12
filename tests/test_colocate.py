"""Colocated aggregators: the job starts its own, one per node, with nothing deployed (real processes,
a real Gloo process group, "nodes" told apart by torchrun's GROUP_RANK on this one machine).

Two jobs run at the same time once for the module (:func:`two_jobs`): one of two nodes with different
numbers of ranks, one of one node with two aggregators per node; three tests check them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from omnireduce.launch.procs import free_port
from tests.harness import GLOO_CONNECTED

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "colocated_rank.py")


def _launch(nodes: list[int], mode: str = "reduce", extra: dict[int, dict[str, str]] | None = None
            ) -> list[subprocess.Popen[str]]:
    """One process per rank; ``nodes[r]`` is rank r's node (its GROUP_RANK)."""
    port = free_port()
    procs = []
    for rank, node in enumerate(nodes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(nodes)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GROUP_RANK=str(node), **(extra or {}).get(rank, {}))
        env.pop("OMNIREDUCE_AGGREGATORS", None)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, mode], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _results(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int, dict]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        finally:
            p.kill()
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank printed nothing (exit {p.returncode}): {stderr[-3000:]}"
        out.append((p.returncode, {**json.loads(lines[-1]), "stderr": stderr}))
    return out


PER_NODE_2 = {"OMNIREDUCE_AGGREGATORS_PER_NODE": "2", "PYTHONWARNINGS": "always::ResourceWarning"}


@pytest.fixture(scope="module")
def two_jobs() -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """Two jobs started at once (the same job name, "colocated"): ranks on nodes [0, 0, 1] (two nodes
    with different numbers of ranks), and two ranks on one node with OMNIREDUCE_AGGREGATORS_PER_NODE=2
    (with every ResourceWarning shown)."""
    a, b = _launch([0, 0, 1]), _launch([0, 0], extra={0: PER_NODE_2, 1: PER_NODE_2})
    return _results(a), _results(b)


def test_one_aggregator_per_node_and_exact_sums(two_jobs: tuple) -> None:
    res, _ = two_jobs  # two nodes with different numbers of ranks
    for code, r in res:
        assert code == 0 and r["ok"], r
    assert len(res[0][1]["addresses"]) == 2 and all(r["addresses"] == res[0][1]["addresses"] for _, r in res)
    assert [len(r["pids"]) for _, r in res] == [1, 0, 1]  # each node's lowest rank started one
    for _, r in res:
        for pid in r["pids"]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_aggregators_per_node_setting(two_jobs: tuple) -> None:
    _, res = two_jobs
    for code, r in res:
        assert code == 0 and r["ok"] and len(r["addresses"]) == 2, r


def test_a_node_whose_aggregator_cannot_start_fails_every_rank_clearly() -> None:
    t0 = time.monotonic()
    res = _results(_launch([0, 1], extra={1: {"OMNIREDUCE_IFNAME": "no-such-if0"}}))
    for code, r in res:
        assert code == 3, r
        assert "colocated aggregators could not start" in r["error"] and "no-such-if0" in r["error"], r
        assert "node" in r["error"] and "#1" in r["error"], r  # names the node
    assert time.monotonic() - t0 < 60


def test_the_aggregator_dies_with_the_process_that_started_it() -> None:
    procs = _launch([0, 1], mode="hold")
    try:
        infos = []
        for p in procs:
            line = p.stdout.readline()
            while GLOO_CONNECTED.match(line.rstrip("\n")):  # (torch 2.8 to 2.10 print it at the group's start)
                line = p.stdout.readline()
            assert line.startswith("{"), p.stderr.read() if p.poll() is not None else line
            infos.append(json.loads(line))
        pids = [pid for info in infos for pid in info["pids"]]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
        for p in procs:
            p.send_signal(signal.SIGKILL)  # no chance to clean up
        _gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids], timeout=15)
        assert not alive, f"orphaned aggregators: {alive}"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_jobs_at_once_do_not_clash(two_jobs: tuple) -> None:
    ra, rb = two_jobs
    for code, r in ra + rb:
        assert code == 0 and r["ok"], r
    assert ra[0][1]["addresses"] != rb[0][1]["addresses"]
    assert not set(ra[0][1]["addresses"]) & set(rb[0][1]["addresses"])



def test_a_colocated_job_leaves_no_pipe_open(two_jobs: tuple) -> None:
    """The 2-rank job above ran with every ResourceWarning shown: none says "unclosed file" (the
    aggregators' pipes are closed once they have ended; before, such a job printed several)."""
    _, res = two_jobs
    for code, r in res:
        assert code == 0 and r["ok"], r
        assert "unclosed file" not in r["stderr"], r["stderr"][-3000:]
    # (the same filter does show a file left open: the check above can fail)
    leak = subprocess.run([sys.executable, "-c", "open(__import__('os').devnull)"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="always::ResourceWarning"), timeout=60)
    assert "unclosed file" in leak.stderr, leak.stderr
