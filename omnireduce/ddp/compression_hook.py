"""A DDP communication hook for block top-k sparsification with error feedback (:mod:`omnireduce.compression`).

    state = CompressionState(BlockTopK(density=0.01), module=ddp_model)
    ddp_model.register_comm_hook(state, compression_hook)

Per bucket and step: dense (DDP's all-reduce) for the first ``warmup_steps`` steps; then the gradient is
added to the bucket's residual, every rank takes the same ``k`` blocks (shared scores), and a dense
``all_reduce`` of the ``k * B`` compacted values (divided by the world size first, as DDP does) moves
about ``density`` of the bucket's bytes; the average is scattered back into the bucket (zero elsewhere).
It only changes gradients, so any optimizer works (momentum SGD, Adam; with ``fuse_optimizer`` too).
On CUDA nothing synchronises the host: sizes are fixed by the density.

Checkpoints: :meth:`CompressionState.state_dict` gives each parameter's residual by parameter name
(so it does not depend on DDP's bucket layout, which DDP rebuilds after its first iteration) and the
step count; save it next to the model and optimizer, and :meth:`CompressionState.load_state_dict` it
into a fresh state before training resumes: compression goes on where it stopped (no new warm-up).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import logging
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK, BucketCompressor
from omnireduce.ddp.paths.compressed import loss_scale
from omnireduce.ddp.residuals import Residuals, parameter_names

log = logging.getLogger(__name__)


class CompressionState:
    """State of :func:`compression_hook`: options, one :class:`BucketCompressor` per bucket, counters.

    Args:
        compression: the :class:`BlockTopK` options.
        process_group: the group to reduce over (default: the default group).
        module: the model (DDP or its ``.module``); needed for :meth:`state_dict`/:meth:`load_state_dict`
            only, which name residuals by parameter.
        grad_scaler: a ``torch.amp.GradScaler`` when training with loss scaling: residuals are then kept
            in unscaled units, so a changing scale never mixes scales in them.
    """

    def __init__(self, compression: BlockTopK | None = None, process_group: dist.ProcessGroup | None = None,
                 module: torch.nn.Module | None = None, grad_scaler: Any = None) -> None:
        self.options = compression or BlockTopK()
        self.process_group = process_group
        self.module = module
        self.grad_scaler = grad_scaler
        self.step = 0  # backward passes completed (counted on each one's last bucket)
        self.residuals = Residuals(self.options)
        self._bytes: dict[int, int] = {}  # per bucket: payload bytes all-reduced, summed over steps
        self._steps: dict[int, list[int]] = {}  # per bucket: [dense steps, compressed steps]

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    # -- per-bucket compressors, across bucket rebuilds and checkpoints -------------------------------

    def compressor(self, bucket: dist.GradBucket) -> BucketCompressor:
        """The bucket's compressor (:class:`omnireduce.ddp.residuals.Residuals`)."""
        return self.residuals.compressor(bucket.index(), bucket.parameters(), bucket.buffer())

    def _names(self) -> dict[int, str]:
        if self.module is None:
            raise ValueError("CompressionState(module=...) is needed to save or load residuals by parameter name")
        return parameter_names(self.module)

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int, "options": dict, "residuals": {parameter name: float32 CPU tensor}}`` (between steps)."""
        return {"step": self.step, "options": dict(vars(self.options)),
                "residuals": self.residuals.state_dict(self._names())}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: step count and residuals (used by the buckets as they come)."""
        self.residuals.load_state_dict(self._names(), sd["residuals"])
        self.step = int(sd["step"])

    # -- statistics ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per bucket: values, blocks, ``k``, density sent, union (blocks sent by any rank / blocks; the
        same blocks on every rank, so it equals the density), residual L2 norm (reading it synchronises
        on CUDA), payload bytes all-reduced per compressed step; totals: steps, ``bytes_allreduced``
        (payload bytes handed to all-reduce, summed over buckets and steps, this rank) and
        ``bytes_sent_ring`` (what a ring all-reduce sends for it: ``2 (W-1) / W`` of the payload)."""
        W = self.world_size
        buckets = self.residuals.stats()
        for i, b in buckets.items():
            scores = 0 if b["k"] == b["blocks"] else b["blocks"]
            b.update(payload_bytes=4 * (b["k"] * self.options.block_size + scores),
                     steps_dense=self._steps.get(i, [0, 0])[0], steps_compressed=self._steps.get(i, [0, 0])[1])
        total = sum(self._bytes.values())
        return {"step": self.step, "buckets": buckets, "bytes_allreduced": total,
                "bytes_sent_ring": total * 2 * (W - 1) / W}

    def _count(self, i: int, nbytes: int, compressed: bool) -> None:
        self._bytes[i] = self._bytes.get(i, 0) + nbytes
        self._steps.setdefault(i, [0, 0])[int(compressed)] += 1


def _allreduce(state: CompressionState, t: torch.Tensor) -> torch.futures.Future:
    return dist.all_reduce(t, group=state.process_group, async_op=True).get_future()


def _dense(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (divide, then sum): warm-up steps and small buckets."""
    buf = bucket.buffer()
    buf.div_(state.world_size)
    state._count(bucket.index(), buf.numel() * buf.element_size(), False)
    return _allreduce(state, buf).then(lambda f: f.value()[0])


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: block top-k with error feedback (see the module docstring)."""
    opts, buf = state.options, bucket.buffer()
    compressing = state.step >= opts.warmup_steps and buf.numel() >= max(1, opts.min_numel)
    k_step = state.step - opts.warmup_steps  # (the compressed step: the density's ramp)
    if bucket.is_last():
        state.step += 1
    if not compressing:
        return _dense(state, bucket)
    comp = state.compressor(bucket)
    scale = loss_scale(state.grad_scaler) if state.grad_scaler is not None else None
    comp.accumulate(buf, None if scale is None else torch.reciprocal(scale))
    W, i = state.world_size, bucket.index()
    if comp.dense:
        vals = comp.compact(torch.arange(comp.nb, device=buf.device), scale).reshape(-1)[: comp.numel].div_(W)
        state._count(i, 4 * comp.numel, True)
        return _allreduce(state, vals).then(lambda f: comp.scatter(f.value()[0], None, buf))
    k = opts.k_at(comp.nb, k_step)
    state._count(i, 4 * (k * comp.B + comp.nb), True)
    idx = comp.select_stale(k) if opts.selection == "stale" else None
    if idx is None:
        return _shared(state, comp, buf, scale, k)
    # stale: this step's scores travel with this step's values, for the next step's selection
    scores = comp.scores()
    payload = torch.cat([comp.compact(idx, scale).div_(W).reshape(-1), scores])
    kb = idx.numel() * comp.B

    def done(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        comp.stale_scores = out[kb:]
        return comp.scatter(out[:kb], idx, buf)

    return _allreduce(state, payload).then(done)


def _shared(state: CompressionState, comp: BucketCompressor, buf: torch.Tensor,
            scale: torch.Tensor | None, k: int) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the block scores, take the same top-k on every rank, all-reduce the compacted blocks.

    Both collectives are issued from the training thread, in the same order on every rank (issued from a
    future's callback they would interleave with the next bucket's, differently on each rank). Waiting
    for the scores blocks this thread on Gloo; on CUDA (NCCL) ``wait`` only orders the streams.
    """
    summed = comp.scores()
    dist.all_reduce(summed, group=state.process_group)
    comp.stale_scores = summed
    idx = comp.select(summed, k)
    vals = comp.compact(idx, scale).div_(state.world_size)
    return _allreduce(state, vals).then(lambda f: comp.scatter(f.value()[0], idx, buf))
