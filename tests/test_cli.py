"""The omnireduce-agg command: the listening line, --help, signals, tokens, refusals."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import omnireduce

AGG = str(Path(sys.executable).with_name("omnireduce-agg"))


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([AGG, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    m = re.fullmatch(r"omnireduce-agg listening on (tcp://127\.0\.0\.1:(\d+))", line)
    assert m, f"unexpected first line {line!r}; stderr: {p.stderr.read() if p.poll() is not None else ''}"
    assert int(m.group(2)) > 0
    return p, m.group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_on_signal(sig: signal.Signals) -> None:
    p, address = _start("--listen", "tcp://127.0.0.1:0")
    try:
        with omnireduce.Worker([address], rank=0, world_size=1, job="cli", timeout=10) as w:
            assert w.allreduce(np.full(1000, 2.0, np.float32)).sum() == 2000
        p.send_signal(sig)
        assert p.wait(10) == 0
    finally:
        p.kill()


def test_help_documents_every_flag() -> None:
    out = subprocess.run([AGG, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--listen", "--token-file", "--insecure", "--curve-secret-key-file", "--curve-keygen",
                 "--metrics-port", "--metrics-host", "--log-interval", "--max-jobs", "--max-peers",
                 "--max-slots-per-job", "--max-job-bytes", "--max-total-bytes", "--max-message-bytes", "--log-level"):
        assert flag in out


def test_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("letmein\n")
    p, address = _start("--listen", "tcp://127.0.0.1:0", "--token-file", str(tmp_path / "token"))
    try:
        with omnireduce.Worker([address], rank=0, world_size=1, job="t", token="letmein", timeout=10) as w:
            w.allreduce(np.ones(3, np.float32))
        with pytest.raises(omnireduce.OmniReduceRefused):
            omnireduce.Worker([address], rank=0, world_size=1, job="t2", token="nope", timeout=10)
    finally:
        p.terminate()
        p.wait(10)
    assert "wrong token" in p.stderr.read()


@pytest.mark.parametrize("args,message", [
    (["--listen", "tcp://0.0.0.0:0"], "without a token"),
    (["--listen", "nonsense"], "omnireduce-agg:"),
    (["--token-file", "/nonexistent/token"], "cannot read --token-file"),
])
def test_refuses_to_start(args: list[str], message: str) -> None:
    t0 = time.monotonic()
    r = subprocess.run([AGG, *args], capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and message in r.stderr and time.monotonic() - t0 < 20
