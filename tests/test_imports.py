"""What each side loads: an aggregator process (``omnireduce-agg``, or a job's own aggregator run as
``python -m omnireduce.aggregator.colocated``) never imports torch or any part of the worker, and the
package's public names are there without importing both sides up front."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

import omnireduce
from omnireduce.launch.procs import AGGREGATOR_MODULE, COLOCATED_MODULE

# Runs the aggregator module as ``python -m MODULE`` would, and on the way out (after SIGTERM stopped it
# cleanly) prints which of the modules it must not load it loaded.
_WRAPPER = """
import atexit, json, runpy, sys
def report():
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "omnireduce.worker")))
    print("LOADED " + json.dumps(loaded), file=sys.stderr, flush=True)
atexit.register(report)
sys.argv = ["omnireduce-agg", "--listen", "tcp://127.0.0.1:0", "--log-level", "WARNING"]
runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", [AGGREGATOR_MODULE, COLOCATED_MODULE])
def test_the_aggregator_process_loads_no_torch_and_no_worker(module: str) -> None:
    code = _WRAPPER.replace("MODULE", repr(module))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # stdin: a colocated one stops when it ends
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("omnireduce-agg listening on tcp://127.0.0.1:"), line
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err
    reports = [ln for ln in err.splitlines() if ln.startswith("LOADED ")]
    assert len(reports) == 1, err  # the process ran to its end and reported
    assert json.loads(reports[0][len("LOADED "):]) == []


def test_the_hook_does_not_load_statistics() -> None:
    """Importing the DDP hook loads neither ``statistics`` nor, with it, ``decimal`` and ``fractions``
    (0.4 MiB of every rank's memory: docs/bench/memory.md), where torch has not loaded them already."""
    pytest.importorskip("torch")  # (the torch-free runs of this file: no hook to import)
    code = ("import sys, torch, torch.distributed, torch.nn.parallel\n"
            "before = {m for m in ('statistics', 'decimal', 'fractions') if m in sys.modules}\n"
            "import omnireduce.ddp\n"
            "print(sorted(m for m in ('statistics', 'decimal', 'fractions') if m in sys.modules and m not in before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_public_names_resolve_lazily() -> None:
    for name in omnireduce.__all__:
        assert getattr(omnireduce, name) is not None
    assert omnireduce.Aggregator.__module__ == "omnireduce.aggregator.service"
    assert omnireduce.Worker.__module__ == "omnireduce.worker.client"
    assert set(omnireduce.__all__) <= set(dir(omnireduce))
