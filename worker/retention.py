"""The sums of finished tensors, kept for replays after an aggregator restart.

Design. When an aggregator restarts, a rank that had finished a slot sends its sums (FINAL), which
the aggregator replays to the ranks that lost them (:mod:`omnireduce.worker.core`). So a finished
tensor keeps its sums (copied once out of the buffers they arrived in:
:meth:`TensorOp.own_sums <omnireduce.worker.op.TensorOp.own_sums>` says why;
:meth:`TensorOp.retained_bytes <omnireduce.worker.op.TensorOp.retained_bytes>`) until every rank of
the job has finished it (the *watermark* the aggregators report with each RESULT, or the caller's
word: :meth:`omnireduce.Worker.release_kept`, which the DDP hook's per-iteration agreement gives),
so that a rank whose last result was lost with the aggregator can still be given it, or for at
most ``seconds`` (twice the timeout: a rank
that still needs the sums had sent its bootstrap before this rank could finish, so its own deadline
has passed by then; the watermark only moves when tensors follow, and a job whose buckets all went
to the dense all-reduce sends none), and while they fit in ``max_bytes`` (the oldest go first).
:class:`KeptSums` holds them in completion order and decides nothing else; it reads no clock.
"""

from __future__ import annotations

import collections

from omnireduce.worker.op import TensorOp


class KeptSums:
    """Finished tensors by sequence number, in completion order, and the bytes of their sums."""

    def __init__(self, max_bytes: int, seconds: float) -> None:
        self.max_bytes = max_bytes
        self.seconds = seconds
        self.tensors: collections.OrderedDict[int, TensorOp] = collections.OrderedDict()
        self.nbytes = 0
        self._until: dict[int, float] = {}  # seq -> when its sums are dropped in any case

    def keep(self, op: TensorOp, now: float) -> None:
        """Keep finished ``op`` (finished at ``now``); the oldest go while the bytes exceed the limit."""
        self.tensors[op.seq] = op
        self._until[op.seq] = now + self.seconds
        self.nbytes += op.retained_bytes()
        while self.nbytes > self.max_bytes and self.tensors:
            self._drop(next(iter(self.tensors)))

    def release(self, watermark: int, owned_only: bool = False) -> None:
        """Every rank has finished the tensors below ``watermark``: their sums are not needed again
        (``owned_only``: only those held in arrays of their own go now, see :meth:`TensorOp.own_sums
        <omnireduce.worker.op.TensorOp.own_sums>`)."""
        for seq in [s for s in self.tensors if s < watermark]:  # (completion order is not seq order)
            if not owned_only or self.tensors[seq].sums_owned:
                self._drop(seq)

    def expire(self, now: float) -> None:
        """Drop the sums kept for their time."""
        while self.tensors:  # (in completion order: the oldest first)
            seq = next(iter(self.tensors))
            if self._until[seq] > now:
                break
            self._drop(seq)

    def clear(self) -> None:
        self.tensors.clear()
        self._until.clear()
        self.nbytes = 0

    def _drop(self, seq: int) -> None:
        self._until.pop(seq, None)
        self.nbytes -= self.tensors.pop(seq).retained_bytes()
