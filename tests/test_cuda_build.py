"""Building and loading the CUDA kernels (omnireduce.cuda.build.prepare and what it relies on).

Runs here, without a GPU:

- the build cache key follows the nvcc version and the flags the environment gives nvcc;
- the build lock: a lock held by a live process gives a clear error within the bound; one left by a
  killed build is cleared at once (real processes holding and losing real locks);
- prepare() is idempotent and thread-safe (cpp_extension.load faked: nothing can be built here);
- without ninja on PATH (a real PATH with ninja shadowed, in a subprocess) prepare() returns the
  torch-ops fallback and logs the reason exactly once;
- every binding releases the GIL (read from csrc/bindings.cpp).

Needs a GPU (skipped without one): a cold build in a fresh cache, by two processes at once (one builds,
the other waits for it), timed, then a cached load in a third process, much faster; the no-ninja
fallback on real CUDA tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omnireduce.cuda import build, ops

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
FALLBACK = "CUDA kernels unavailable ("
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernels cannot run")
needs_flock = pytest.mark.skipif(sys.platform == "win32", reason="the build lock is a POSIX flock")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIREDUCE_CUDA")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _path_without(tool: str, shadow_root: Path) -> str:
    """$PATH with every directory holding ``tool`` replaced by a copy (of symlinks) without it."""
    dirs = []
    for i, d in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if d and (Path(d) / tool).exists():
            shadow = shadow_root / f"bin{i}"
            shadow.mkdir(parents=True)
            for entry in Path(d).iterdir():
                if entry.name != tool:
                    (shadow / entry.name).symlink_to(entry)
            d = str(shadow)
        dirs.append(d)
    path = os.pathsep.join(dirs)
    assert shutil.which(tool, path=path) is None
    return path


# --- the cache key ------------------------------------------------------------------------------


def test_cache_key_follows_nvcc_flags_and_version(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    sources = build._source_files()
    base = build._build_key(sources, [(9, 0)])
    assert build._build_key(sources, [(9, 0)]) == base
    keys = {base}
    for var, value in (("NVCC_APPEND_FLAGS", "-lineinfo"), ("NVCC_APPEND_FLAGS", "-G"),
                       ("NVCC_PREPEND_FLAGS", "-lineinfo"), ("TORCH_CUDA_ARCH_LIST", "9.0")):
        monkeypatch.setenv(var, value)
        keys.add(build._build_key(sources, [(9, 0)]))
        monkeypatch.delenv(var)
    assert len(keys) == 5, "each flag setting must get its own build directory"
    assert build._build_key(sources, [(9, 0)]) == base

    real = build._nvcc_version(build._nvcc_path())
    monkeypatch.setattr(build, "_nvcc_version", lambda nvcc: real + " (another release)")
    assert build._build_key(sources, [(9, 0)]) != base


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cache_key_holds_the_real_nvcc_version() -> None:
    nvcc = build._nvcc_path()
    assert nvcc is not None
    version = build._nvcc_version(nvcc)
    assert re.search(r"release \d+\.\d+", version), version
    assert version in build._toolchain()


# --- the build lock -----------------------------------------------------------------------------

_HOLD = """
import sys, time
from pathlib import Path
from omnireduce.cuda import build, ops
build_dir = Path(sys.argv[1])
with build._build_lock(build_dir, 0):
    if len(sys.argv) > 2:
        (build_dir / "lock").write_text("")  # what cpp_extension.load creates while it builds
    print("held", flush=True)
    time.sleep(300)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """A build directory, and the processes started to hold its lock (killed at the end)."""
    procs: list[subprocess.Popen[str]] = []
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    yield build_dir, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _hold(build_dir: Path, procs: list[subprocess.Popen[str]], baton: bool = False) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", _HOLD, str(build_dir), *(["baton"] if baton else [])]
    p = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "held", p.stderr.read() if p.stderr else ""
    return p


@needs_flock
def test_lock_held_by_a_live_process_fails_clearly_within_the_bound(holder: tuple) -> None:
    build_dir, procs = holder
    p = _hold(build_dir, procs)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err, build._build_lock(build_dir, 1.5):
        pass
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 4.0, waited
    message = str(err.value)
    lock = str(build_dir / build._LOCK_NAME)
    assert lock in message and f"pid {p.pid}" in message, message
    assert "OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT" in message and "kill it" in message, message
    assert p.poll() is None  # the holder is left alone


@needs_flock
def test_lock_left_by_a_killed_build_is_cleared_at_once(holder: tuple, caplog: pytest.LogCaptureFixture) -> None:
    build_dir, procs = holder
    p = _hold(build_dir, procs, baton=True)
    baton = build_dir / "lock"
    assert baton.exists()
    p.send_signal(signal.SIGKILL)  # a rank killed mid-build
    p.wait(30)
    t0 = time.monotonic()
    with build._build_lock(build_dir, 60):
        assert time.monotonic() - t0 < 5.0
        assert not baton.exists(), "cpp_extension.load would wait for this file forever"
        assert f"pid {os.getpid()}" in (build_dir / build._LOCK_NAME).read_text()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(baton) in m and "killed" in m for m in warnings), warnings
    with build._build_lock(build_dir, 0):  # released on exit
        pass


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[float]:
    """A loader that has not tried yet, prerequisites taken as present, and a slow fake load() (the
    times of its calls): the real one needs a CUDA build of torch."""
    from torch.utils import cpp_extension

    calls: list[float] = []

    def slow_load(**kwargs: object) -> object:
        calls.append(time.monotonic())
        time.sleep(0.3)
        return object()

    monkeypatch.setattr(build, "_state", build._LoadState())
    monkeypatch.setattr(build, "_capabilities", lambda: [(9, 0)])
    monkeypatch.setattr(build, "_missing_prerequisites", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", slow_load)
    monkeypatch.setenv("OMNIREDUCE_CUDA_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OMNIREDUCE_CUDA_KERNELS", raising=False)
    return calls


def test_prepare_is_idempotent_and_thread_safe(fake_build: list[float]) -> None:
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(build.prepare("cuda"))) for _ in range(8)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert results == ["cuda-kernels"] * 8 and len(fake_build) == 1
    assert build.prepare(0) == "cuda-kernels" and build.prepare("cpu") == "torch-ops" and len(fake_build) == 1
    assert ops.backend(torch.zeros(1)) == "torch-ops"


@needs_flock
def test_prepare_gives_up_on_a_held_lock_after_the_bound(
        fake_build: list[float], holder: tuple, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _, procs = holder
    sources = build._source_files()
    build_dir = build._cache_root() / f"{build._EXT_NAME}-{build._build_key(sources, [(9, 0)])}"
    build_dir.mkdir(parents=True)
    _hold(build_dir, procs)
    monkeypatch.setenv("OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", "1")
    t0 = time.monotonic()
    assert build.prepare("cuda") == "torch-ops"
    assert time.monotonic() - t0 < 4.0 and not fake_build
    assert build.prepare("cuda") == "torch-ops"  # the outcome is kept: no second wait
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(build_dir / build._LOCK_NAME) in warnings[0], warnings
    monkeypatch.setenv("OMNIREDUCE_CUDA_KERNELS", "require")
    with pytest.raises(RuntimeError, match="build lock"):
        build.prepare("cuda")


def test_lock_timeout_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", "2.5")
    assert build._lock_timeout() == 2.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT", bad)
        with pytest.raises(ValueError, match="OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT"):
            build._lock_timeout()


# --- missing prerequisites: the fallback and its reason, logged once ----------------------------

_PREPARE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import torch
from omnireduce.cuda import build, ops
out = {"prepare": [build.prepare("cuda"), build.prepare("cuda:0"), build.prepare()]}
if torch.cuda.is_available():
    x = torch.zeros(1000, device="cuda")
    x[300] = -2.0
    out["backend"] = ops.backend(x)
    idx, blocks = ops.compact(x, 256)
    out["indices"] = idx.tolist()
    out["row"] = blocks[0, 44].item()
print(json.dumps(out))
"""


def _fallback_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("WARNING omnireduce.cuda_kernels") and FALLBACK
            in line]


def _prepare_without_ninja(tmp_path: Path) -> tuple[dict, list[str]]:
    env = _env(PATH=_path_without("ninja", tmp_path / "path"), OMNIREDUCE_CUDA_BUILD_DIR=str(tmp_path / "cache"))
    proc = _python(_PREPARE, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), _fallback_warnings(proc.stderr)


def test_without_ninja_prepare_falls_back_and_says_why_once(tmp_path: Path) -> None:
    out, warnings = _prepare_without_ninja(tmp_path)
    assert out["prepare"][:2] == ["torch-ops", "torch-ops"]
    assert len(warnings) == 1, warnings
    assert "ninja not found: pip install ninja" in warnings[0] and "using torch ops, which synchronise" in warnings[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))

    env = _env(PATH=_path_without("ninja", tmp_path / "path2"), OMNIREDUCE_CUDA_KERNELS="require")
    proc = _python("from omnireduce.cuda import build, ops; build.prepare('cuda')", env, timeout=240)
    assert proc.returncode != 0 and "ninja not found" in proc.stderr and "RuntimeError" in proc.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch would build the kernels")
@pytest.mark.skipif(shutil.which("ninja") is None, reason="needs ninja on PATH")
def test_cpu_torch_falls_back_naming_only_what_is_missing(tmp_path: Path) -> None:
    proc = _python(_PREPARE, _env(OMNIREDUCE_CUDA_BUILD_DIR=str(tmp_path / "cache")), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["prepare"] == ["torch-ops"] * 3
    warnings = _fallback_warnings(proc.stderr)
    assert len(warnings) == 1 and "is a CPU build" in warnings[0] and "ninja" not in warnings[0], warnings


# --- the bindings -------------------------------------------------------------------------------


def test_every_binding_releases_the_gil() -> None:
    """compact() waits for the stream: with the GIL held that would stall every Python thread."""
    text = (CSRC / "bindings.cpp").read_text()
    module = text[text.index("PYBIND11_MODULE"):]
    defs = re.findall(r"m\.def\((.*?)\);", module, re.S)
    names = {re.findall(r'"(\w+)"', d)[0] for d in defs}
    assert names == {"block_flags", "compact", "scatter", "record", "rows", "counts", "sum_blocks",
                     "sum_blocks_within"}, names
    assert "using no_gil = py::call_guard<py::gil_scoped_release>;" in module
    for d in defs:
        assert d.rstrip().endswith("no_gil()"), d


# --- on a CUDA machine --------------------------------------------------------------------------

_TIMED = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import torch
from omnireduce.cuda import build, ops
torch.zeros(1, device="cuda")  # CUDA initialised outside the timing
t0 = time.perf_counter()
backend = build.prepare("cuda")
seconds = time.perf_counter() - t0
x = torch.zeros(1000, device="cuda")
x[700] = 1.0
idx, _ = ops.compact(x, 256)
print(json.dumps({"backend": backend, "seconds": seconds, "indices": idx.tolist()}))
"""


@needs_cuda
@pytest.mark.timeout(1500)
def test_cold_build_then_cached_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = _env(OMNIREDUCE_CUDA_BUILD_DIR=str(tmp_path / "cache"), OMNIREDUCE_CUDA_KERNELS="require")
    args = [sys.executable, "-c", _TIMED]
    t0 = time.monotonic()
    cold = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # two ranks at once: one builds, the other waits for it
    outs = [p.communicate(timeout=1200) for p in cold]
    cold_wall = time.monotonic() - t0
    for p, (_, err) in zip(cold, outs, strict=True):
        assert p.returncode == 0, err[-6000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["backend"] == "cuda-kernels" and r["indices"] == [2] for r in results), results
    logs = "\n".join(err for _, err in outs)
    assert logs.count("built the omnireduce CUDA kernels in") == 1, logs[-6000:]
    assert logs.count("loaded the omnireduce CUDA kernels from") == 1, logs[-6000:]

    proc = _python(_TIMED, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    warm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert warm["backend"] == "cuda-kernels" and warm["indices"] == [2]
    assert "loaded the omnireduce CUDA kernels from" in proc.stderr and "built the" not in proc.stderr
    cold_s = max(r["seconds"] for r in results)
    with capsys.disabled():
        print(f"\nomnireduce CUDA kernels: cold build {cold_s:.1f} s (two processes, {cold_wall:.1f} s wall), "
              f"cached load {warm['seconds']:.2f} s")
    assert warm["seconds"] < cold_s / 4, (warm, results)


@needs_cuda
def test_without_ninja_cuda_tensors_use_torch_ops(tmp_path: Path) -> None:
    out, warnings = _prepare_without_ninja(tmp_path)
    assert out["prepare"] == ["torch-ops"] * 3 and out["backend"] == "torch-ops"
    assert out["indices"] == [1] and out["row"] == -2.0
    assert len(warnings) == 1 and "ninja not found" in warnings[0], warnings
