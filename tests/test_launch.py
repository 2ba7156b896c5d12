"""Launchers: omnireduce-run (torchrun; dedicated aggregators with --aggregators) and mpiexec (MPI ranks, no torch
launcher)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SMALL = str(ROOT / "tests" / "scripts" / "ddp_small.py")


def _run(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


def _env_without_aggregators() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OMNIREDUCE_AGGREGATORS"}


def test_omnireduce_run_trains_with_rank_prefixes() -> None:
    r = _run([str(BIN / "omnireduce-run"), "--nproc", "2", SMALL], env=_env_without_aggregators())
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"[rank {rank}] done, world 2, sent"))
        assert line.endswith("own aggregators True"), line  # omnireduce-run started none: the job ran its own
        assert f"[rank {rank}] step 2 loss" in r.stdout


def test_omnireduce_run_starts_dedicated_aggregators_only_when_asked() -> None:
    r = _run([str(BIN / "omnireduce-run"), "--aggregators", "2", "--nproc", "2", SMALL],
             env=_env_without_aggregators())
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"[rank {rank}] done"))
        assert line.endswith("own aggregators False"), line
    r = _run([str(BIN / "omnireduce-run"), "--aggregators", "0", "--nproc", "2", SMALL])
    assert r.returncode == 2 and "must be >= 1" in r.stderr


def test_omnireduce_run_exits_with_the_failing_workers_code() -> None:
    t0 = time.monotonic()
    r = _run([str(BIN / "omnireduce-run"), "--nproc", "2", SMALL, "--fail-rank", "1", "--code", "7"])
    assert r.returncode == 7, r.stdout + r.stderr
    assert "[rank 1] failing on purpose" in r.stdout
    assert "[rank 0] done" not in r.stdout  # rank 0 was stopped, not left waiting for its peer
    assert time.monotonic() - t0 < 90


def test_omnireduce_run_passes_torchrun_options_after_a_double_dash() -> None:
    r = _run([str(BIN / "omnireduce-run"), "--", "--nproc-per-node", "2", "--standalone", "--max-restarts", "0",
              SMALL])
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] done, world 2, sent" in r.stdout, r.stdout
    both = _run([str(BIN / "omnireduce-run"), "--nproc", "2", "--", "--nproc-per-node", "2", SMALL])
    assert both.returncode == 2 and "--nproc-per-node instead of --nproc" in both.stderr


def test_omnireduce_run_stops_everything_on_ctrl_c() -> None:
    p = subprocess.Popen([str(BIN / "omnireduce-run"), "--nproc", "2", SMALL, "--hang"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env_without_aggregators())
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)  # a full pipe would stall it
    reader.start()
    try:
        hanging = 0
        deadline = time.monotonic() + 90
        while hanging < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            hanging += "hanging" in line
        assert hanging == 2, "the workers did not start"
        family = psutil.Process(p.pid).children(recursive=True)
        assert len(family) >= 4  # torchrun, 2 workers, the job's own aggregator (rank 0's child)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
        _gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"left running: {[q.cmdline() for q in alive]}"
        reader.join(10)
        text = "".join(err)
        assert "Traceback" not in text, text  # torchrun's SignalException and the workers' interrupts: not shown
        assert err and err[-1].startswith("omnireduce-run: interrupted"), text
    finally:
        p.kill()


def test_omnireduce_run_rejects_bad_arguments() -> None:
    r = _run([str(BIN / "omnireduce-run"), "--nproc", "2", "/nonexistent.py"])
    assert r.returncode == 2 and "no such script" in r.stderr
    r = _run([str(BIN / "omnireduce-run"), SMALL])
    assert r.returncode == 2 and "give --nproc N" in r.stderr


def test_omnireduce_run_help_and_version() -> None:
    from omnireduce.version import __version__

    r = _run([str(BIN / "omnireduce-run"), "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"omnireduce-run {__version__}"
    r = _run([str(BIN / "omnireduce-run"), "--help"])
    assert r.returncode == 0 and "torchrun options" in r.stdout and "examples:" in r.stdout


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("mpiexec", path=str(BIN)) is None, reason="mpiexec not installed (pip install mpich)")
def test_mpiexec_launches_a_training_run(aggregator, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    env = dict(os.environ, OMNIREDUCE_AGGREGATORS=aggregator.address, PATH=f"{BIN}:{os.environ['PATH']}")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(ROOT / "examples" / "train_recsys.py"),
              "--steps", "3", "--batch-size", "32", "--warmup", "0", "--summary-json", str(summary),
              "--path", "omnireduce"], env=env)  # (3 steps: all of them would be path="measure"'s trials)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(summary.read_text())
    assert out["world_size"] == 2 and out["hook"] == "omnireduce" and len(out["losses"]) == 3
    assert 0 < out["mb_sent_per_step"] < 0.1 * out["dense_mb_per_step"]
