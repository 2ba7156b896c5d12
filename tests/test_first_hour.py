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
