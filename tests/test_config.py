"""Configuration from the environment and files: token files, bad values, key files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import omnireduce
from omnireduce.config import WorkerConfig


def test_embedded_aggregator_reads_the_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    monkeypatch.delenv("OMNIREDUCE_TOKEN", raising=False)
    monkeypatch.setenv("OMNIREDUCE_TOKEN_FILE", str(token))
    with omnireduce.Aggregator() as agg:
        with omnireduce.Worker([agg.address], rank=0, world_size=1, job=job, timeout=5) as w:  # token from file
            assert w.allreduce(np.full(3, 2.0, np.float32)).tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(omnireduce.OmniReduceRefused, match="wrong token"):
            omnireduce.Worker([agg.address], rank=0, world_size=1, job=job + "x", token="other", timeout=5)


@pytest.mark.parametrize("name, value", [("OMNIREDUCE_RETAIN_MB", "lots"), ("OMNIREDUCE_TIMEOUT", "1m"),
                                         ("OMNIREDUCE_CURVE_SERVER_KEY", "short")])
def test_bad_environment_values_are_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        WorkerConfig.resolve("tcp://127.0.0.1:1", rank=0, world_size=1)


def test_retain_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIREDUCE_RETAIN_MB", "1.5")
    assert WorkerConfig.resolve("tcp://127.0.0.1:1", rank=0, world_size=1).retain_bytes == 3 << 19


def test_curve_keygen_writes_a_private_secret(tmp_path: Path) -> None:
    key = tmp_path / "agg.key"
    key.write_text("old")
    key.chmod(0o644)  # an existing file with wider permissions is narrowed too
    subprocess.run([sys.executable, "-m", "omnireduce.aggregator.cli", "--curve-keygen", str(key)], check=True,
                   capture_output=True, timeout=60)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert len(key.read_text().strip()) == 40 and len((tmp_path / "agg.key.pub").read_text().strip()) == 40
