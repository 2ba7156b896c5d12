"""The compressed buckets: block top-k with error feedback around any reducer, the *carrier*.

A bucket the router sends compressed (``OmniReduceState(compression=BlockTopK(...))``, after the
warm-up) is added to its residual (:mod:`omnireduce.ddp.residuals`) and every rank takes the same
``k`` blocks (:class:`omnireduce.compression.BucketCompressor`): with ``selection="shared"`` the
block scores are all-reduced on the process group first (``nb = n / B`` floats, issued from the
training thread so that every rank issues its collectives in the same order), then the top-k of
the sums; with ``selection="stale"`` the previous step's summed scores choose (no collective of
their own: this step's scores travel behind this step's values, through the carrier; the first
compressed step is shared). The ``k * B`` compacted values (the *payload*) then take the carrier
the router chose for the compressed bucket, as any bucket would: the process group's all-reduce
(valid because the blocks are the same on every rank), the aggregators, or the collective engine,
flat or through the hierarchy. Each averages them; the average is scattered back into DDP's buffer
(zero elsewhere). With ``whole`` (the router's ``"uncompressed"``: where compressing costs more
time than it saves) the whole bucket with its residual takes the carrier, no selection (exact, and
the residual is emptied). Every block sent (``density=1``) sends the bucket's own values, no padding,
so that the dense all-reduce sums them as plain DDP does.

:class:`Compressed` is one bucket's compressed reduction as a :class:`~omnireduce.engines.reducer.Reducer`;
its info is its carrier's, plus the scores' bytes. On CUDA nothing here synchronises the host:
every size follows from the density.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from omnireduce.compression import BucketCompressor
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.residuals import Residuals
from omnireduce.engines.reducer import Reducer, Reduction, ring_bytes


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """A ``torch.amp.GradScaler``'s current scale as a device tensor, without synchronising (None when
    it has none yet, or is disabled)."""
    scale = getattr(scaler, "_scale", None)  # (private: the public get_scale() reads it on the host)
    return scale if isinstance(scale, torch.Tensor) and scaler.is_enabled() else None


class Compression:
    """The compressed buckets' part of a bound state: their residuals (the state's, kept across binds),
    the group the scores are all-reduced on, and the ``torch.amp.GradScaler`` whose scale the
    gradients carry (None: none; residuals are kept unscaled)."""

    def __init__(self, residuals: Residuals, group: dist.ProcessGroup | None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.residuals, self.group, self.grad_scaler = residuals, group, grad_scaler
        self.world_size = dist.get_world_size(group)

    def reducer(self, bucket: Bucket, carrier: Reducer, *, whole: bool = False) -> Compressed:
        """The compressed reduction of ``bucket`` (a DDP bucket's) through ``carrier``."""
        return Compressed(self, bucket.index, bucket.params, bucket.iteration, carrier, whole)


class Compressed:
    """One bucket's compressed reduction (see the module): ``index`` and ``params`` name its
    compressor, ``iteration`` its place in the density's ramp."""

    def __init__(self, compression: Compression, index: int, params: Sequence[torch.Tensor], iteration: int,
                 carrier: Reducer, whole: bool) -> None:
        self.compression, self.index, self.params, self.carrier, self.whole = compression, index, params, carrier, whole
        self.step = iteration - compression.residuals.options.warmup_steps  # (0: the first compressed step)

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool, block_size: int | None = None) -> Reduction:
        c = self.compression
        scaler = c.grad_scaler
        scale = loss_scale(scaler) if scaler is not None else None
        comp = c.residuals.compressor(self.index, self.params, tensor)
        if self.whole:  # the bucket itself, its residual added once: nothing copied after that
            comp.flush_into(tensor, scale)
            return self.carrier.allreduce_async(tensor, average=average, block_size=block_size)
        comp.accumulate(tensor, None if scale is None else torch.reciprocal(scale))
        idx, scores, sent = self._select(comp)
        values = comp.compact(idx, scale).reshape(-1)
        if comp.dense:
            values = values[: comp.numel]  # (the bucket's own values: a dense all-reduce sums them as DDP's)
        payload = values if scores is None else torch.cat([values, scores])
        out = Reduction(tensor)
        reduction = self.carrier.allreduce_async(payload, average=average, block_size=comp.B)

        def scatter(f: torch.futures.Future[torch.Tensor]) -> None:
            try:
                result = f.value()
                if scores is not None:  # (stale: the scores' average, for the next step's selection)
                    comp.stale_scores = result[values.numel():]
                    result = result[: values.numel()]
                out.complete(comp.scatter(result, idx, tensor), reduction.info.plus(sent, sent))
            except BaseException as e:
                out.fail(e)

        reduction.add_done_callback(scatter)
        return out

    def _select(self, comp: BucketCompressor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The blocks to send, the scores to send behind them (stale selection), and the bytes the
        selection itself sent (the shared scores' all-reduce)."""
        c = self.compression
        opts = c.residuals.options
        if comp.dense:
            return torch.arange(comp.nb, device=comp.residual.device), None, 0
        k = opts.k_at(comp.nb, self.step)
        if opts.selection == "stale":
            idx = comp.select_stale(k)
            if idx is not None:
                return idx, comp.scores(), 0
        summed = comp.scores()
        dist.all_reduce(summed, group=c.group)  # (waits here on Gloo; on NCCL only orders the streams)
        comp.stale_scores = summed
        return comp.select(summed, k), None, ring_bytes(summed.numel() * summed.element_size(), c.world_size)
