"""The compressed path: block top-k with error feedback, the chosen blocks carried by any of the three ways.

A bucket the router sends compressed (``OmniReduceState(compression=BlockTopK(...))``, after the
warm-up) is added to its residual (:mod:`omnireduce.ddp.residuals`); every rank takes the same ``k``
blocks: the block scores are all-reduced on the process group first (``nb = n / B`` floats, issued
from the training thread so that every rank issues its collectives in the same order), then the
top-k of the sums (:class:`omnireduce.compression.BucketCompressor`). The ``k * B`` compacted values
(the *payload*) then take the way the router chose for the compressed bucket, as any bucket would:
the process group's all-reduce (valid because the blocks are the same on every rank), the
aggregators, or the collective engine, flat or through the hierarchy (summed in the node, across
the nodes by rail one of those ways, shared in the node); each averages them, records the bytes
against the bucket's dense size, and the average is scattered back into DDP's buffer (zero elsewhere). Which way is
fastest for the payload is timed and agreed like any bucket's (:mod:`omnireduce.ddp.path_choice`),
against a fourth way, ``"uncompressed"``: the whole bucket with its residual through the dense
all-reduce, no selection (where compressing costs more time than it saves: fast links, small
buckets; exact, and the residual is emptied).
On CUDA nothing here synchronises the host: every size follows from the density.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.recorder import Recorder, ring_bytes
from omnireduce.ddp.residuals import Residuals

Transport = Callable[[Bucket], "torch.futures.Future[torch.Tensor]"]


def loss_scale(scaler: Any) -> torch.Tensor | None:
    """A ``torch.amp.GradScaler``'s current scale as a device tensor, without synchronising (None when
    it has none yet, or is disabled)."""
    scale = getattr(scaler, "_scale", None)  # (private: the public get_scale() reads it on the host)
    return scale if isinstance(scale, torch.Tensor) and scaler.is_enabled() else None


def compressed_allreduce(bucket: Bucket, params: Sequence[torch.Tensor], residuals: Residuals, group: Any,
                         world_size: int, recorder: Recorder,
                         transport: Transport, whole: bool = False, scale: torch.Tensor | None = None,
                         step: int | None = None) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` (a DDP bucket of ``params``) compressed: select, compact, hand the payload to
    ``transport`` (one of the paths, bound to its engine), scatter its average into the bucket.
    ``whole``: every block (the residual emptied into this step), no selection. ``scale``: the loss
    scale the bucket's gradients carry (a GradScaler's, a device tensor): the residual is kept unscaled.
    ``step``: the compressed step (0: the first after the warm-up), for the density's ramp."""
    comp = residuals.compressor(bucket.index, params, bucket.buffer)
    if whole:  # the bucket itself, its residual added once: nothing copied after that
        comp.flush_into(bucket.buffer, scale)
        return transport(bucket)
    comp.accumulate(bucket.buffer, None if scale is None else torch.reciprocal(scale))
    if comp.dense:
        idx = torch.arange(comp.nb, device=comp.residual.device)
    else:
        summed = comp.scores()
        dist.all_reduce(summed, group=group)  # (waits here on Gloo; on NCCL only orders the streams)
        scores = ring_bytes(summed.numel() * summed.element_size(), world_size)
        recorder.count(bytes_sent=scores, bytes_received=scores)
        idx = comp.select(summed, None if step is None else residuals.options.k_at(comp.nb, step))
    values = comp.compact(idx, scale).reshape(-1)
    payload = bucket.payload(values, comp.B)

    def scatter(f: torch.futures.Future[Any]) -> torch.Tensor:
        result = f.value()
        return comp.scatter(result[0] if isinstance(result, list) else result, idx, bucket.buffer)

    return transport(payload).then(scatter)
