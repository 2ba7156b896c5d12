"""The omnireduce-agg command: the listening line, --help, signals, tokens, refusals."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

import omnireduce
from omnireduce.aggregator.cli import build_parser
from tests.harness import AGG, start_aggregator


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_on_signal(sig: signal.Signals) -> None:
    # (start_aggregator checks the first line: "omnireduce-agg listening on tcp://127.0.0.1:PORT", PORT > 0)
    p, address = start_aggregator(0, stderr=subprocess.PIPE, log_level="INFO")  # INFO: the CLI's default
    try:
        with omnireduce.Worker([address], rank=0, world_size=1, job="cli", timeout=10) as w:
            assert w.allreduce(np.full(1000, 2.0, np.float32)).sum() == 2000
        p.send_signal(sig)
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()


def test_help_documents_every_flag() -> None:
    out = subprocess.run([AGG, "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    actions = build_parser()._actions
    options = {option for action in actions for option in action.option_strings}
    for flag in ("--listen", "--token-file", "--insecure", "--curve-secret-key-file", "--curve-keygen",
                 "--metrics-port", "--metrics-host", "--log-interval", "--max-jobs", "--max-peers",
                 "--max-slots-per-job", "--max-job-bytes", "--max-total-bytes", "--max-message-bytes", "--log-level"):
        assert flag in out and flag in options
    for action in actions:  # every flag the parser has, not only those listed above
        assert action.help and action.help.strip(), f"{action.option_strings} has no help text"
        for option in action.option_strings:
            assert option in out, f"{option} is missing from --help"


def test_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("letmein\n")
    p, address = start_aggregator(0, "--token-file", str(tmp_path / "token"), stderr=subprocess.PIPE,
                                  log_level="INFO")
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
    (["--io-threads", "0"], "io_threads must be >= 1, got 0"),
])
def test_refuses_to_start(args: list[str], message: str) -> None:
    r = subprocess.run([AGG, *args], capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and message in r.stderr
