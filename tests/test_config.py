"""Configuration from the environment and files: token files, bad values, key files, the launchers' readers."""

from __future__ import annotations

import importlib
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import omnireduce
from omnireduce.config import WorkerConfig
from omnireduce.launch.settings import (
    RUN_DIR_VAR,
    env_aggregators_per_node,
    env_ifname,
    env_run_dir,
    env_socket_buffer,
)


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


def test_every_omnireduce_variable_is_read_in_config_alone() -> None:
    """No library module but config (and credentials, for secrets) reads an OMNIREDUCE_* variable itself."""
    root = Path(__file__).resolve().parents[1]
    readers = []
    for path in [*root.glob("omnireduce/**/*.py"), *root.glob("worker/*.py"), *root.glob("aggregator/*.py")]:
        if path.name in ("config.py", "credentials.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""(environ\.get\(|getenv\(|environ\[)\s*["']OMNIREDUCE_""", line):
                readers.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not readers, "\n".join(readers)


def _reader(spec: str) -> Callable[[], object]:
    """The reader ``module:function`` (each layer reads its own settings)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# (omnireduce.cuda imports torch: its readers are marked so)
@pytest.mark.parametrize("reader, name, good, expected, default", [
    pytest.param("omnireduce.cuda.build:cuda_kernels_mode", "OMNIREDUCE_CUDA_KERNELS", "Require", "require", "auto",
                 marks=pytest.mark.torch),
    pytest.param("omnireduce.cuda.build:cuda_kernels_mode", "OMNIREDUCE_CUDA_KERNELS", "0", "off", "auto",
                 marks=pytest.mark.torch),
    pytest.param("omnireduce.cuda.build:cuda_build_lock_timeout", "OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", "2.5", 2.5,
                 600.0, marks=pytest.mark.torch),
    pytest.param("omnireduce.cuda.build:cuda_build_dir", "OMNIREDUCE_CUDA_BUILD_DIR", "/tmp/k", "/tmp/k", None,
                 marks=pytest.mark.torch),
    ("omnireduce.sources.adapt:device_path_for_cpu", "OMNIREDUCE_DEVICE_PATH", "1", True, False),
    ("omnireduce._malloc:malloc_tune", "OMNIREDUCE_MALLOC_TUNE", "0", False, True),
    ("omnireduce.config:env_job", "OMNIREDUCE_JOB", "j1", "j1", None),
    ("omnireduce.config:env_aggregators", "OMNIREDUCE_AGGREGATORS", "tcp://h:1", "tcp://h:1", None),
])
def test_readers_give_the_value_or_the_default(monkeypatch: pytest.MonkeyPatch, reader: str, name: str, good: str,
                                               expected: object, default: object) -> None:
    read = _reader(reader)
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "")
    assert read() == default  # set but empty: unset
    monkeypatch.setenv(name, good)
    assert read() == expected


@pytest.mark.parametrize("reader, name, bad", [
    pytest.param("omnireduce.cuda.build:cuda_kernels_mode", "OMNIREDUCE_CUDA_KERNELS", "sometimes",
                 marks=pytest.mark.torch),
    pytest.param("omnireduce.cuda.build:cuda_build_lock_timeout", "OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", "-1",
                 marks=pytest.mark.torch),
    pytest.param("omnireduce.cuda.build:cuda_build_lock_timeout", "OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", "a minute",
                 marks=pytest.mark.torch),
])
def test_readers_name_the_variable_of_a_bad_value(monkeypatch: pytest.MonkeyPatch, reader: str, name: str,
                                                  bad: str) -> None:
    read = _reader(reader)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        read()
# The launchers' environment readers (config.py's last block): a good value, the default when unset
# (or empty), and a bad value raising ValueError that names the variable.

@pytest.mark.parametrize("reader, name, good, value, default, bad", [
    (env_socket_buffer, "OMNIREDUCE_SOCKET_BUFFER", "131072", 131072, 0, "128k"),
    (env_aggregators_per_node, "OMNIREDUCE_AGGREGATORS_PER_NODE", "3", 3, 1, "two"),
    (env_aggregators_per_node, "OMNIREDUCE_AGGREGATORS_PER_NODE", "1", 1, 1, "0"),
    (env_ifname, "OMNIREDUCE_IFNAME", "eth1", "eth1", None, "a-name-longer-than-15"),
    (env_ifname, "OMNIREDUCE_IFNAME", "lo", "lo", None, "eth0:1"),
])
def test_launcher_environment_readers(monkeypatch: pytest.MonkeyPatch, reader: Callable[[], object], name: str,
                                      good: str, value: object, default: object, bad: str) -> None:
    monkeypatch.delenv(name, raising=False)
    assert reader() == default
    monkeypatch.setenv(name, "")
    assert reader() == default
    monkeypatch.setenv(name, good)
    assert reader() == value
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        reader()


def test_run_dir_reader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(RUN_DIR_VAR, raising=False)
    assert RUN_DIR_VAR == "OMNIREDUCE_RUN_DIR" and env_run_dir() is None
    monkeypatch.setenv(RUN_DIR_VAR, str(tmp_path))
    assert env_run_dir() == str(tmp_path)
    monkeypatch.setenv(RUN_DIR_VAR, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"OMNIREDUCE_RUN_DIR=.*is not a directory"):
        env_run_dir()


def test_a_bad_socket_buffer_fails_the_worker_and_the_colocated_start_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # colocate.py once ignored what the workers rejected; now both read it the same way (omnireduce.envvars)
    monkeypatch.setenv("OMNIREDUCE_SOCKET_BUFFER", "lots")
    with pytest.raises(ValueError, match="OMNIREDUCE_SOCKET_BUFFER='lots'") as worker_error:
        WorkerConfig.resolve("tcp://127.0.0.1:1", rank=0, world_size=1)
    with pytest.raises(ValueError) as reader_error:
        env_socket_buffer()
    assert str(reader_error.value) == str(worker_error.value)


def test_a_bad_run_dir_stops_the_child_before_the_script_runs(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, OMNIREDUCE_RUN_DIR=str(tmp_path / "missing"))
    r = subprocess.run([sys.executable, "-m", "omnireduce.launch.child", str(script)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "ran" not in r.stdout
    assert "OMNIREDUCE_RUN_DIR" in r.stderr and "is not a directory" in r.stderr
