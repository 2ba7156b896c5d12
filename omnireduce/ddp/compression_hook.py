"""Deprecated: ``CompressionState`` and ``compression_hook``, kept so that code and checkpoints written
against them still run. Use ``OmniReduceState(compression=BlockTopK(...))`` with ``omnireduce_hook``.

:class:`CompressionState` is :class:`omnireduce.ddp.OmniReduceState` with the compacted blocks on the
process group's all-reduce (``path="dense"``), no aggregator (``engine="collective"``) and no hierarchy;
making one warns once per process. :func:`compression_hook` is :func:`omnireduce.ddp.omnireduce_hook`.
Its ``state_dict()`` (``{"step", "options", "residuals"}``) also loads into any state's
:meth:`~omnireduce.ddp.OmniReduceState.load_compression_state_dict`.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.ddp.hook import omnireduce_hook
from omnireduce.ddp.state import CompressionCheckpoint, HookStats, OmniReduceState, SavedState

__all__ = ["CompressionState", "compression_hook"]

compression_hook = omnireduce_hook

DEPRECATION = ("omnireduce.ddp.compression_hook.CompressionState is deprecated and will be removed: use "
               "OmniReduceState(compression=BlockTopK(...), path=\"dense\", engine=\"collective\") with "
               "omnireduce_hook (from omnireduce.ddp), which is what it is; "
               "OmniReduceState.compression_state_dict(model) replaces its state_dict()")

_warned = False
_warned_lock = threading.Lock()


def _warn_once() -> None:
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(DEPRECATION, FutureWarning, stacklevel=3)


class CompressionStats(HookStats):
    """What :meth:`CompressionState.stats` returns: :class:`~omnireduce.ddp.state.HookStats` with ``step``."""

    step: int


class _SavedCompressionState(SavedState):
    module: None  # (the model is never pickled)


class CompressionState(OmniReduceState):
    """Deprecated alias of ``OmniReduceState(compression=..., path="dense", engine="collective",
    hierarchical=False)`` (see the module); warns once per process.

    Args:
        compression: the :class:`BlockTopK` options (default: ``BlockTopK()``).
        process_group: the group to reduce over (default: the default group).
        module: the model (DDP or its ``.module``); needed for :meth:`state_dict`/:meth:`load_state_dict`
            only, which name residuals by parameter.
        grad_scaler: a ``torch.amp.GradScaler`` when training with loss scaling (residuals kept unscaled).
    """

    def __init__(self, compression: BlockTopK | None = None, process_group: dist.ProcessGroup | None = None,
                 module: torch.nn.Module | None = None, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        _warn_once()
        self.module = module
        super().__init__(process_group, compression=compression or BlockTopK(), path="dense", engine="collective",
                         hierarchical=False, grad_scaler=grad_scaler)

    @property
    def step(self) -> int:
        """Backward passes completed (the state's ``iteration``)."""
        return self.iteration

    @step.setter
    def step(self, value: int) -> None:
        self.iteration = int(value)

    def _model(self) -> torch.nn.Module:
        if self.module is None:
            raise ValueError("CompressionState(module=...) is needed to save or load residuals by parameter name")
        return self.module

    def state_dict(self) -> CompressionCheckpoint:
        """``{"step": int, "options": dict, "residuals": {parameter name: float32 CPU tensor}}`` (between steps)."""
        saved = self.compression_state_dict(self._model())
        assert self.options.compression is not None
        return {"step": saved["iteration"], "options": dataclasses.asdict(self.options.compression),
                "residuals": saved["residuals"]}

    def load_state_dict(self, sd: CompressionCheckpoint) -> None:
        """Restore a :meth:`state_dict`: step count and residuals (used by the buckets as they come)."""
        self.load_compression_state_dict(self._model(), sd)

    def stats(self) -> CompressionStats:
        """:meth:`OmniReduceState.stats`, with ``step`` and, in ``buckets``, the per-bucket compressor
        statistics of ``stats()["compression"]``."""
        out = super().stats()
        return {**out, "step": self.iteration, "buckets": out.get("compression", {})}

    def __getstate__(self) -> _SavedCompressionState:
        return {**super().__getstate__(), "module": None}

    def __setstate__(self, saved: SavedState) -> None:
        super().__setstate__(saved)
        self.module = None  # (never pickled)
