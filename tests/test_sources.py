"""Every block source keeps the one contract the worker relies on (``sources.base.Source``): dense host
arrays, tensors on the device path, sparse COO rows and a refused tensor's stand-in. The I/O loop reads
``defer`` and ``device`` from any of them without asking whether they exist."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.sources.adapt import adapt
from omnireduce.sources.base import Source
from omnireduce.sources.device import DeviceSource
from omnireduce.sources.host import HostSource
from omnireduce.sources.sparse import SparseSource, rejection

torch = pytest.importorskip("torch")

MEMBERS = ("layout", "dtype", "device", "defer", "nonzero", "gather", "finish", "release")


def _sources() -> dict[str, object]:
    rng = np.random.default_rng()
    dense = rng.standard_normal(1000).astype(np.float32)
    coo = torch.sparse_coo_tensor(torch.tensor([[3, 1, 3]]), torch.randn(3, 8), (10, 8))
    return {"numpy": adapt(dense), "cpu tensor": adapt(torch.from_numpy(dense)),
            "sparse COO": adapt(coo), "refused": rejection(ValueError("bad"), 2)}


def test_every_source_keeps_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIREDUCE_DEVICE_PATH", "1")  # a CPU tensor takes the device path
    sources = _sources()
    assert isinstance(sources["numpy"], HostSource) and isinstance(sources["cpu tensor"], DeviceSource)
    assert isinstance(sources["sparse COO"], SparseSource)
    for name, src in sources.items():
        assert isinstance(src, Source), name
        missing = [m for m in MEMBERS if not hasattr(src, m)]
        assert not missing, f"{name} lacks {missing}"
    # Only the device path prepares off the I/O thread.
    assert [name for name, src in sources.items() if src.defer is not None] == ["cpu tensor"]


def test_a_class_without_a_member_is_not_a_source() -> None:
    class NoDefer:
        layout = dtype = device = None

        def nonzero(self, threshold: float) -> np.ndarray:
            return np.zeros(0, bool)

        def gather(self, ids: np.ndarray) -> np.ndarray:
            return np.zeros(0, np.float32)

        def finish(self, staged: list, divisor: int) -> None:
            return None

        def release(self) -> None:
            return None

    assert not isinstance(NoDefer(), Source)
    NoDefer.defer = None
    assert isinstance(NoDefer(), Source)
    for src in _sources().values():
        src.release()
