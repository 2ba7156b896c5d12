"""The error-feedback residuals of a DDP model's compressed buckets: one compressor per bucket, by parameter.

Design. A :class:`omnireduce.compression.BucketCompressor` holds one bucket's residual, back to back
in the order of the bucket's parameters. DDP rebuilds its buckets after its first iteration (and a
resumed run starts from the initial layout again), so a residual must outlive the bucket it was made
for: :class:`Residuals` keeps each bucket's compressor with the parameters it covers, and when a
bucket index comes back with other parameters it parks every not-yet-visited bucket's residual per
parameter and hands those pieces to the new buckets as they come. Checkpoints name residuals by
parameter (``{name: float32 CPU tensor}``), never by bucket, so they load into any bucket layout.

Used by :func:`omnireduce.ddp.omnireduce_hook` with ``OmniReduceState(compression=...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from omnireduce.compression import BlockTopK, BucketCompressor


class Residuals:
    """The compressors of one DDP model's buckets (see the module)."""

    def __init__(self, options: BlockTopK) -> None:
        self.options = options
        self._lock = threading.Lock()  # stats() reads from other threads
        self._comp: dict[int, BucketCompressor] = {}
        self._params: dict[int, tuple[int, ...]] = {}  # bucket index -> ids of its parameters
        self._param_refs: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, torch.Tensor] = {}  # id(param) -> residual not yet in a compressor

    def compressor(self, index: int, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> BucketCompressor:
        """Bucket ``index``'s compressor (``params``: its parameters, back to back in ``buffer``); made,
        with any parked residuals of its parameters, on first use and after DDP rebuilt the buckets."""
        ids = tuple(id(p) for p in params)
        with self._lock:
            if self._params.get(index) == ids:
                return self._comp[index]
            # a rebuild (or the first use): buckets >= index have not run in this iteration (DDP calls the
            # hook in bucket order), so their residuals are parked per parameter
            for j in [j for j in self._comp if j >= index]:
                self._spill(j)
            if sum(p.numel() for p in params) != buffer.numel():
                raise ValueError(f"bucket {index}: its buffer ({buffer.numel()} values) is not its parameters "
                                 f"back to back ({sum(p.numel() for p in params)} values)")
            comp = BucketCompressor(buffer.numel(), self.options, buffer.device)
            offset = 0
            for p in params:
                res = self._pending.pop(id(p), None)
                if res is not None:
                    comp.put(offset, res)
                offset += p.numel()
            self._comp[index], self._params[index], self._param_refs[index] = comp, ids, list(params)
            return comp

    def _spill(self, j: int) -> None:
        comp, params = self._comp.pop(j), self._param_refs.pop(j)
        del self._params[j]
        offset = 0
        for p in params:
            self._pending[id(p)] = comp.residual[offset: offset + p.numel()].clone()
            offset += p.numel()

    def state_dict(self, names: Mapping[int, str]) -> dict[str, torch.Tensor]:
        """Every residual by parameter name (``names``: ``id(parameter) -> name``), float32 on the CPU."""
        with self._lock:
            out = {names[k]: v.detach().cpu().reshape(-1).clone() for k, v in self._pending.items() if k in names}
            for j, comp in self._comp.items():
                offset = 0
                for p in self._param_refs[j]:
                    out[names[id(p)]] = comp.residual[offset: offset + p.numel()].detach().cpu().clone()
                    offset += p.numel()
            return out

    def load_state_dict(self, names: Mapping[int, str], residuals: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual with :meth:`state_dict`'s (used by the buckets as they come)."""
        by_name = {name: pid for pid, name in names.items()}
        unknown = sorted(set(residuals) - set(by_name))
        if unknown:
            raise ValueError(f"residuals of parameters the model does not have: {unknown[:5]}")
        with self._lock:
            self._comp.clear()
            self._params.clear()
            self._param_refs.clear()
            self._pending = {by_name[n]: t.to(torch.float32) for n, t in residuals.items()}

    def stats(self) -> dict[int, dict[str, object]]:
        """Per bucket index: values, blocks, ``k``, density sent (the fraction of the bucket's values
        sent per compressed step), union (blocks sent by any rank / blocks: the same blocks on every
        rank, so ``k / blocks``), the residual's L2 norm (reading it synchronises on CUDA), and the
        compressed steps its compressor took (``steps_compressed``)."""
        with self._lock:
            comps = sorted(self._comp.items())
        return {i: {"numel": c.numel, "blocks": c.nb, "k": c.k, "density_sent": min(1.0, c.k * c.B / max(1, c.numel)),
                    "union": c.k / max(1, c.nb), "residual_norm": float(c.residual_norm()),
                    "steps_compressed": c.steps} for i, c in comps}


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of a model (a DDP model's names are its module's)."""
    inner = getattr(module, "module", module)
    return {id(p): n for n, p in inner.named_parameters()}
