"""One gradient bucket as the hook's layers see it, and how DDP's buckets become such values.

DDP hands the hook a ``GradBucket``; the runtime turns it into a :class:`Bucket` once, through the
model's :class:`Intake`, and everything below (the router, the path choice, the reducers' callers)
takes that value. A bucket is identified by its :data:`BucketKey`, ``(index, numel)``: DDP rebuilds
its buckets after the first iteration, and a rebuilt bucket is a new one. A bucket that goes
compressed (``OmniReduceState(compression=...)``) is a new one too, ``(index, numel, 1)``: its ways
are timed again, on its compacted blocks.

The intake counts the iterations (DDP's last bucket ends one), checks that each bucket belongs to
the model the state serves (one state serves one DDP model: :class:`SecondModelError` otherwise),
and finds the block size aligned to the bucket's dominant table (:func:`aligned_block_size`): from
the bucket's parameters while DDP may still rebuild its buckets (once, within its first iterations:
a rebuilt bucket may reuse its buffer's memory with its parameters in another order), and after
:data:`SETTLED` iterations once per bucket: a bucket whose buffer it has seen at that index before
then costs a dictionary lookup and the check of DDP's bucket order.

Any tensor the ranks reduce in the same order with a stable index can be a bucket
(:meth:`Bucket.of_tensor`: an FSDP reduce-scatter's output, say): the router then routes it and hands
it a reducer as it does a DDP bucket's. A DDP bucket is averaged over the ranks; such a tensor may
ask to be summed instead (``average=False``: FSDP2 with a gradient divide factor).

Alignment. A bucket is the flat concatenation of its parameters' gradients. With a fixed block size
B, an embedding whose row width w does not divide B has rows that straddle block boundaries: a
touched row of 200 floats on a 256 grid lands in two blocks most of the time. With ``B = k * w``
and the table starting on the grid, every block holds k whole rows. The dominant width is the one
with the most elements among the bucket's 2-D (or wider) parameters (tables, and the weights of
linear layers, whose gradients are dense anyway); the block is its largest multiple that is at most
the configured size (the width itself if wider). A table that starts off the grid (after a bias of
odd length) still moves no more than the fixed grid for ``w <= B``; a row wider than the configured
size off the grid keeps that size; a bucket without 2-D parameters keeps it too. The choice reads
only shapes, so every rank makes the same one (what it saves: docs/bench/training.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from omnireduce.errors import OmniReduceError
from omnireduce.wire import MAX_BLOCK_SIZE

BucketKey = tuple[int, ...]  # (bucket index, numel), or (bucket index, numel, 1) compressed


def is_compressed(key: BucketKey) -> bool:
    """Whether ``key`` is a compressed bucket's (see the module)."""
    return len(key) > 2


class Bucket:
    """A gradient bucket on its way through the hook (a value: never changed once made)."""

    __slots__ = ("average", "block_size", "buffer", "compressed", "index", "iteration", "key", "last", "nbytes",
                 "params")

    def __init__(self, buffer: torch.Tensor, index: int, iteration: int, last: bool, block_size: int,
                 compressed: bool = False, params: Sequence[torch.Tensor] = (), average: bool = True) -> None:
        self.buffer = buffer
        self.index = index
        self.iteration = iteration
        self.last = last  # DDP's last bucket of the backward pass
        self.block_size = block_size  # blocks of this bucket (aligned to its table's rows, or the configured size)
        self.compressed = compressed  # it goes compressed (its key says so)
        self.params = params  # the parameters whose gradients it holds, back to back
        self.average = average  # averaged over the ranks (False: summed)
        numel = buffer.numel()
        self.key: BucketKey = (index, numel, 1) if compressed else (index, numel)  # (what the routing knows it by)
        self.nbytes = numel * buffer.element_size()  # bytes of the buffer (what a dense all-reduce would reduce)

    def as_compressed(self) -> Bucket:
        """This bucket, going compressed (a key of its own)."""
        return Bucket(self.buffer, self.index, self.iteration, self.last, self.block_size, True, self.params,
                      self.average)

    @property
    def coo(self) -> bool:
        """A sparse COO gradient (``nn.Embedding(sparse=True)`` and the like)."""
        return self.buffer.layout != torch.strided

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, index: int, iteration: int, block_size: int, *, last: bool = False,
                  params: Sequence[torch.Tensor] = (), average: bool = True) -> Bucket:
        """Any tensor as a bucket: ``index`` its stable place in the order every rank reduces them in
        (its key is ``(index, numel)``), ``last`` the last of an iteration, ``average`` False to sum it
        over the ranks instead of averaging it."""
        return cls(tensor, index, iteration, last, block_size, params=params, average=average)

    def __repr__(self) -> str:
        return f"Bucket(index={self.index}, iteration={self.iteration}, numel={self.buffer.numel()})"


class SecondModelError(OmniReduceError, ValueError):
    """An :class:`~omnireduce.ddp.OmniReduceState` was registered on a second DDP model."""


SETTLED = 3
"""Iterations an intake has seen after which DDP's buckets no longer change but for a new buffer (DDP
rebuilds them once, before its second iteration's backward pass; with ``static_graph``, its third)."""


class Intake:
    """DDP's buckets of one model as :class:`Bucket` values (see the module): ``block_size`` the configured
    one, aligned per bucket with ``align``; ``iteration``: the iterations completed so far."""

    def __init__(self, block_size: int, align: bool, iteration: int = 0) -> None:
        self.block_size, self.align, self.iteration = block_size, align, iteration
        self._seen = 0  # iterations this intake has seen end
        self._known: dict[int, tuple[int, int, int, Sequence[torch.Tensor]]] = {}  # index -> ptr, numel, block, params
        self._guard = ModelGuard()

    def take(self, grad_bucket: dist.GradBucket) -> Bucket:
        """``grad_bucket`` as a :class:`Bucket` of the iteration under way (counted on at DDP's last
        bucket); raises :class:`SecondModelError` for a bucket of a second DDP model."""
        index, buffer, last = grad_bucket.index(), grad_bucket.buffer(), grad_bucket.is_last()
        strided = buffer.layout == torch.strided
        known = self._known.get(index) if strided and self._seen >= SETTLED else None
        if known is None or known[0] != buffer.data_ptr() or known[1] != buffer.numel():
            params = grad_bucket.parameters()
            self._guard.check(index, params, last)
            block = aligned_block_size([tuple(p.shape) for p in params], self.block_size) \
                if self.align and strided else self.block_size
            known = (buffer.data_ptr(), buffer.numel(), block, params) if strided else (0, 0, block, params)
            if strided:
                self._known[index] = known
        else:
            self._guard.follow(index, last)
        iteration = self.iteration
        if last:
            self.iteration += 1
            self._seen += 1
        return Bucket(buffer, index, iteration, last, known[2], params=known[3])


class ModelGuard:
    """The one-model check (see the module). DDP hands a model's buckets to the hook in index order,
    0 to the last, and every bucket holds parameters of that model only; so the guard learns the
    model's parameters over its first complete iteration and then refuses a bucket whose first
    parameter is not among them, or (during that first iteration) a bucket 0 of other parameters
    while another bucket 0's iteration is under way. A repeated bucket 0 of the same parameters is
    an iteration started again after one that failed midway: accepted."""

    def __init__(self) -> None:
        self._params: set[int] | None = None  # the model's parameters, once one iteration completed
        self._collecting: set[int] = set()
        self._expected = 0  # the next bucket index of the iteration under way
        self._first: int | None = None  # the first parameter of this iteration's bucket 0

    def check(self, index: int, params: Sequence[torch.Tensor], last: bool) -> None:
        """Raise :class:`SecondModelError` if the bucket ``index`` of ``params`` belongs to another DDP model."""
        first = id(params[0]) if params else None
        if self._params is not None and first is not None and first not in self._params:
            raise _error(index)
        restarted = index == 0 and (self._first is None or first == self._first)  # (a failed iteration's)
        if index != self._expected and not restarted:
            raise _error(index)
        if index == 0:
            self._first = first
        if self._params is None:
            self._collecting.update(id(p) for p in params)
        self._advance(index, last)

    def follow(self, index: int, last: bool) -> None:
        """A bucket already checked at ``index`` (the same buffer): only DDP's order is checked."""
        if index != self._expected and index != 0:
            raise _error(index)
        self._advance(index, last)

    def _advance(self, index: int, last: bool) -> None:
        self._expected = index + 1
        if last:
            self._expected, self._first = 0, None
            if self._params is None:
                self._params, self._collecting = self._collecting, set()


def _error(index: int) -> SecondModelError:
    return SecondModelError(
        f"this OmniReduceState already serves another DDP model (bucket {index} holds parameters of a second "
        "model): one state serves one DDP model. Register a state of its own on each model "
        "(ddp.register_comm_hook(OmniReduceState(), omnireduce_hook) per model; state.sibling() shares the "
        "first one's aggregators), or for TorchRec call omnireduce.integrations.use_omnireduce(dmp)")


def aligned_block_size(shapes: Sequence[Sequence[int]], base: int) -> int:
    """The block size of a bucket holding tensors of ``shapes`` back to back (see the module);
    ``base`` is the configured block size, for buckets without a dominant row width."""
    mass: dict[int, int] = {}  # row width -> elements of the parameters with rows of that width
    aligned: dict[int, bool] = {}  # row width -> every such parameter starts on a row of the grid
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2 and shape[0] > 0 and numel > 0:
            width = numel // shape[0]
            mass[width] = mass.get(width, 0) + numel
            aligned[width] = aligned.get(width, True) and offset % width == 0
        offset += numel
    if not mass:
        return base
    width = max(mass, key=lambda w: (mass[w], w))
    block = width * max(1, base // width)
    if block > MAX_BLOCK_SIZE or (block > base and not aligned[width]):
        return base
    return block
