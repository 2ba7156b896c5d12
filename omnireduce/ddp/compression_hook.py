"""The older names of block top-k compression, kept for code and checkpoints written against them.

    state = CompressionState(BlockTopK(density=0.01), module=ddp_model)   # the same as below
    ddp_model.register_comm_hook(state, compression_hook)

    state = OmniReduceState(compression=BlockTopK(density=0.01), path="dense", engine="collective")
    ddp_model.register_comm_hook(state, omnireduce_hook)

Compression has one state, :class:`omnireduce.ddp.OmniReduceState` (``compression=``, with the shared
or the stale selection; docs/howto/compression.md). :class:`CompressionState` is that state with the
compacted blocks on the process group's all-reduce (``path="dense"``), no aggregator
(``engine="collective"``: nothing starts, no port opens) and no hierarchy, as this hook always
sent them; :func:`compression_hook` is :func:`omnireduce.ddp.omnireduce_hook`. What this state had of
its own stays: ``module=`` with :meth:`~CompressionState.state_dict` and
:meth:`~CompressionState.load_state_dict` (its checkpoints, ``{"step", "options", "residuals"}``,
also load into any state's :meth:`~omnireduce.ddp.OmniReduceState.load_compression_state_dict`),
``step``, and ``stats()``' per-bucket ``steps_compressed`` beside the state's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.ddp.hook import omnireduce_hook
from omnireduce.ddp.state import OmniReduceState

__all__ = ["CompressionState", "compression_hook"]

compression_hook = omnireduce_hook


class CompressionState(OmniReduceState):
    """:class:`~omnireduce.ddp.OmniReduceState` with ``compression`` on the process group's all-reduce
    (see the module).

    Args:
        compression: the :class:`BlockTopK` options (default: ``BlockTopK()``).
        process_group: the group to reduce over (default: the default group).
        module: the model (DDP or its ``.module``); needed for :meth:`state_dict`/:meth:`load_state_dict`
            only, which name residuals by parameter.
        grad_scaler: a ``torch.amp.GradScaler`` when training with loss scaling (residuals kept unscaled).
    """

    def __init__(self, compression: BlockTopK | None = None, process_group: dist.ProcessGroup | None = None,
                 module: torch.nn.Module | None = None, grad_scaler: Any = None) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int, "options": dict, "residuals": {parameter name: float32 CPU tensor}}`` (between steps)."""
        saved = self.compression_state_dict(self._model())
        assert self.options.compression is not None
        return {"step": saved["iteration"], "options": dataclasses.asdict(self.options.compression),
                "residuals": saved["residuals"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: step count and residuals (used by the buckets as they come)."""
        self.load_compression_state_dict(self._model(), sd)

    def stats(self) -> dict[str, Any]:
        """:meth:`OmniReduceState.stats`, with ``step`` and, per compressed bucket index in ``buckets``,
        its compressor's ``numel``, ``blocks``, ``k``, ``density_sent``, ``union``, ``residual_norm`` and
        ``steps_compressed`` (reading the norms synchronises on CUDA)."""
        out = super().stats()
        out.update(step=self.iteration, buckets=out.get("compression", {}))
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "module": None}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        super().__setstate__(saved)
        self.module = saved.get("module")
