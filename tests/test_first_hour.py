"""What a newcomer meets first: `python -m omnireduce`, versions, and error messages that say what to do."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.version import __version__


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_python_m_omnireduce_reports_the_installation() -> None:
    r = _run(["-m", "omnireduce"])
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines() if line and not line.startswith("CUDA"))
    assert lines["omnireduce"] == __version__
    assert lines["torch"].startswith(torch.__version__)
    cuda = next(line for line in r.stdout.splitlines() if line.startswith("CUDA tensors"))
    if torch.version.cuda is None:  # this machine: the fallback, and the reason
        assert "torch ops (torch" in cuda and "CPU build" in cuda, cuda
    assert _run(["-m", "omnireduce", "--version"]).stdout.strip() == f"omnireduce {__version__}"
    assert omnireduce.__version__ == __version__


def test_float64_input_says_how_to_convert(aggregator: omnireduce.Aggregator, job: str) -> None:
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=10) as w:
        x = np.ones(10)
        with pytest.raises(TypeError, match=r"float64.*astype\(numpy.float32\)"):
            w.allreduce(x)
        t = torch.ones(10, dtype=torch.float64)
        with pytest.raises(TypeError, match=r"float64.*x.float\(\)"):
            w.allreduce(t)
        assert x.tolist() == [1.0] * 10 and t.tolist() == [1.0] * 10  # untouched


def test_demo_report_labels_link_times_as_arithmetic_from_measured_bytes() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
    spec = importlib.util.spec_from_file_location("demo", path)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.link_ms(1.0, 1) == pytest.approx(2**20 * 8 / 1e9 * 1e3)
    run = {"mb_sent_per_step": 3.0, "cpu_ms_per_step": 100.0, "median_step_s": 0.2, "final_loss": 0.5,
           "losses": [0.7, 0.5]}
    dense = {**run, "mb_sent_per_step": 60.0, "losses": [0.7, 0.5 + 1e-7]}
    text = demo.report(run, dense, 4, 2)
    assert "5.0% of the dense all-reduce's bytes" in text and "at most 1.0e-07" in text
    assert "arithmetic from the measured bytes, not a measurement" in text
    one_gbit = next(line for line in text.splitlines() if line.strip().startswith("1 Gb/s"))
    assert f"{demo.link_ms(3.0, 1):.1f} ms" in one_gbit and f"{demo.link_ms(60.0, 1):.1f} ms" in one_gbit
    assert "Path choice" not in text  # (a run without the hook's paths says nothing of them)
    times = {"aggregators_ms": 2.0, "collective_ms": 3.0, "dense_ms": 1.0}
    paths = {"0": {"path": "dense", **times}, "1": {"path": "aggregators", **times},
             "2": {"path": "collective", **times}}
    text = demo.report({**run, "paths": paths, "iterations_measuring": 9, "mb_sent_mean_per_step": 12.0}, dense, 4, 40)
    assert "each of the 3 buckets was timed through each path first (aggregators, collective, dense; 9 of the 40 " \
           "steps measured); 1 then took the aggregators, 1 the collective engine and 1 the dense all-reduce" \
           in text, text
    assert "12.00 MB per step and rank on average (20.0% of the dense bytes)" in text, text


def test_aggregator_cli_says_what_an_address_needs_and_its_version() -> None:
    for extra in ([], ["--insecure"]):
        r = _run(["-m", "omnireduce.aggregator.cli", "--listen", "127.0.0.1:5557", *extra])
        assert r.returncode == 2 and "needs a transport: tcp://HOST:PORT" in r.stderr, r.stderr
        assert "tcp://127.0.0.1:5557" in r.stderr and "Invalid argument" not in r.stderr
    r = _run(["-m", "omnireduce.aggregator.cli", "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"omnireduce-agg {__version__}"
    helptext = " ".join(_run(["-m", "omnireduce.aggregator.cli", "--help"]).stdout.split())
    assert "OMNIREDUCE_CURVE_SERVER_KEY_FILE" in helptext and "(the token itself)" in helptext


def test_an_idle_aggregator_logs_no_status_lines(caplog: pytest.LogCaptureFixture, job: str) -> None:
    import logging
    import time

    caplog.set_level(logging.INFO, logger="omnireduce.aggregator")
    with omnireduce.Aggregator(log_interval=0.3) as agg:
        time.sleep(1.0)
        idle = [r for r in caplog.records if "slots in flight" in r.getMessage()]
        with omnireduce.Worker([agg.address], rank=0, world_size=1, job=job, timeout=10) as w:
            w.allreduce(np.ones(1000, np.float32))
            time.sleep(1.0)
    busy = [r for r in caplog.records if "slots in flight" in r.getMessage()]
    assert idle == [] and busy, [r.getMessage() for r in caplog.records]


def test_the_rank_left_waiting_hears_why_its_peer_was_refused(aggregator: omnireduce.Aggregator, job: str) -> None:
    import time

    with omnireduce.Worker([aggregator.address], rank=0, world_size=2, job=job, timeout=30) as w0:
        x = np.ones(1000, np.float32)
        fut = w0.allreduce_async(x)
        t0 = time.monotonic()
        with pytest.raises(omnireduce.OmniReduceMismatchError, match="world size 3 but the job has 2"):
            omnireduce.Worker([aggregator.address], rank=1, world_size=3, job=job, timeout=10)
        with pytest.raises(omnireduce.OmniReduceMismatchError, match=r"world size 3 .*that rank was refused"):
            fut.result(timeout=10)
        assert time.monotonic() - t0 < 10  # told at once, not at its 30 s deadline
        assert x.tolist() == [1.0] * 1000
        with pytest.raises(omnireduce.OmniReduceMismatchError):  # the job cannot go on: later tensors fail too
            w0.allreduce(np.ones(10, np.float32))


def test_a_worker_error_is_said_once() -> None:
    """Raised to the caller, and not also printed by logging's last-resort handler."""
    from omnireduce.launch.procs import start_aggregator, stop_processes

    agg, address = start_aggregator([sys.executable, "-m", "omnireduce.aggregator.cli", "--listen",
                                     "tcp://127.0.0.1:0", "--log-level", "ERROR"])
    script = (
        "import numpy as np, omnireduce\n"
        f"with omnireduce.Worker(['{address}'], rank=0, world_size=2, job='once', timeout=1) as w:\n"
        "    try:\n"
        "        w.allreduce(np.ones(10, np.float32))\n"
        "    except omnireduce.OmniReduceTimeout as e:\n"
        "        print('raised:', e)\n")
    try:
        r = _run(["-c", script])
    finally:
        stop_processes([agg])
    # (the worker's own deadline or the aggregator's, whichever is first: both name the tensor)
    assert r.returncode == 0 and "raised: " in r.stdout and "tensor 0 of job 'once'" in r.stdout, r.stdout + r.stderr
    assert (r.stdout + r.stderr).count("tensor 0 of job 'once'") == 1, r.stdout + r.stderr
