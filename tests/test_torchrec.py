"""TorchRec with omnireduce: examples/torchrec_dlrm.py under torchrun (2 CPU ranks, Gloo), a DLRM whose
tables are sharded DATA_PARALLEL, with ``use_omnireduce(dmp)`` and without it.

Parameters after training must equal TorchRec's own run bit for bit, and that run must equal an
independent reference: the unsharded DLRM trained in one process on both ranks' batches at once (to
1e-6). The tables' DDP (inside the sharded collection's lookups) must have reduced its buckets through
the sparse path, the ranks must exit 0, and no process of the run (aggregators included) may survive
it. Skipped where TorchRec is not importable (``make torchrec`` installs it and runs this file)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from tests.harness import finish_session

try:
    import torchrec  # noqa: F401
except Exception as e:  # not installed, or its fbgemm library does not load here
    pytest.skip(f"torchrec is not importable: {e}", allow_module_level=True)

import torch

pytestmark = pytest.mark.torchrec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrec_dlrm.py"
STEPS = 10
MARKER = "OMNIREDUCE_TORCHREC_TEST"
_LAUNCHER_VARS = ("OMNIREDUCE_AGGREGATORS", "OMNIREDUCE_JOB", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                  "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
_DDP_LINE = re.compile(r"^rank (\d): (\S+): (\d+) sparse, (\d+) dense, (\d+) failed, sent (\d+) of (\d+)$", re.M)


def _run(args: list[str], save: Path) -> tuple[str, str]:
    """The example under torchrun with ``args``; its output and the marker its processes carry."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARKER: marker})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--steps", str(STEPS), "--save", str(save), *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    return finish_session(p, timeout=240), marker


def _left_behind(marker: str) -> list[str]:
    """The processes still alive (not zombies) whose environment carries ``marker``."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (psutil.Error, OSError):
            continue
    return out


def _assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 10.0
    while (left := _left_behind(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after the job ended: {left}"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(initial: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The unsharded DLRM from ``initial``, trained in this process on both ranks' batches together
    (DDP's average of two 32-sample means is the mean over the 64)."""
    from torchrec import KeyedJaggedTensor

    ex = _example()
    model = ex.make_model(seed)
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        parts = [ex.batch(step, rank, seed) for rank in (0, 1)]
        keys = parts[0][1].keys()
        values = [p[1][k].values() for k in keys for p in parts]
        lengths = [p[1][k].lengths() for k in keys for p in parts]
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        dense, labels = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TorchRec's own run (no hook) on a fresh seed, checked against the one-process reference."""
    seed = int.from_bytes(os.urandom(2), "little")
    save = tmp_path_factory.mktemp("torchrec") / "plain.pt"
    _, marker = _run(["--plain", "--seed", str(seed)], save)
    _assert_nothing_left(marker)
    saved = torch.load(save)
    reference = _reference(saved["initial"], seed)
    assert saved["final"].keys() == reference.keys()
    for k, v in saved["final"].items():
        assert torch.allclose(v, reference[k], rtol=0, atol=1e-6), f"seed {seed}: TorchRec's {k} is not the reference's"
    tables = [k for k in saved["final"] if "embedding_bags" in k]
    assert len(tables) == 3 and all(not torch.equal(saved["final"][k], saved["initial"][k]) for k in tables)
    return {"seed": seed, **saved}


@pytest.mark.parametrize("path", ["omnireduce", "measure"])
def test_dlrm_with_data_parallel_tables_trains_like_torchrec(plain: dict[str, Any], path: str,
                                                             tmp_path: Path) -> None:
    out, marker = _run(["--path", path, "--seed", str(plain["seed"])], tmp_path / "hook.pt")
    _assert_nothing_left(marker)  # the ranks, torchrun, and the colocated aggregator rank 0 started
    hooked = torch.load(tmp_path / "hook.pt")
    assert hooked["final"].keys() == plain["final"].keys()
    for k, v in hooked["final"].items():
        assert torch.equal(v, plain["final"][k]), f"{path}: {k} differs from TorchRec's own run"

    lines = [m.groups() for m in _DDP_LINE.finditer(out)]
    assert sorted({(rank, name) for rank, name, *_ in lines}) == [
        (rank, name) for rank in "01" for name in
        ("_dmp_wrapped_module", "_dmp_wrapped_module.module.sparse_arch.embedding_bag_collection._lookups[0]")], out
    for _rank, name, sparse, dense, failed, sent, equivalent in lines:
        sparse, dense, failed, sent, equivalent = int(sparse), int(dense), int(failed), int(sent), int(equivalent)
        assert failed == 0 and sparse + dense == STEPS, out  # one bucket per DDP and step
        if "_lookups" not in name:
            continue
        if path == "omnireduce":  # every bucket of the tables through the aggregators, a few percent of the bytes
            assert sparse == STEPS and sent < 0.15 * equivalent, out
        else:  # measured: at least the sparse path's trials
            assert sparse >= 4 and sent < equivalent, out
