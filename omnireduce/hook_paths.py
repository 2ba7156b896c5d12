"""The two ways a dense DDP bucket is reduced once the hook has picked one, and how it fails.

Design. Each path is a function that starts the reduction and returns the future the hook hands
to DDP; neither decides anything (the hook in :mod:`omnireduce.ddp` does), both record what they
did on the state (:meth:`omnireduce.ddp.OmniReduceState.record`).

- :func:`dense_allreduce`: the process group's all-reduce of the bucket divided by the world size
  first (as torch's ``allreduce_hook`` does), then a callback chained with ``.then()`` that records it
  and, with the threshold rule, measures the result's union density so the bucket can come back
  to omnireduce. Every bucket that goes dense goes through it.
- :func:`omnireduce_allreduce`: the worker's I/O thread reduces the bucket in place and completes a
  CUDA-aware future (:func:`hook_future`) on the stream that wrote the result.
- :func:`collective_allreduce`: the same blocks summed by the ranks themselves, through the process
  group's collectives (``OmniReduceState(engine="collective")``, :mod:`omnireduce.collective`).

A failure becomes an :class:`~omnireduce.OmniReduceError` naming the iteration, the bucket and the
cause (:func:`failure`), counted and logged once; DDP raises it from ``backward()``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from omnireduce.alignment import aligned_block_size
from omnireduce.errors import OmniReduceError
from omnireduce.hook_counters import ring_bytes
from omnireduce.hook_decisions import BucketKey, union_density

if TYPE_CHECKING:
    from omnireduce.hook_state import OmniReduceState

log = logging.getLogger("omnireduce.ddp")


def hook_future(buffer: torch.Tensor) -> torch.futures.Future[Any]:
    """A CUDA-aware future for ``buffer``'s device: completed with a CUDA tensor, it records an event
    on the completing thread's current stream, and DDP's stream waits for that event, not for the
    host."""
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def dense_allreduce(state: OmniReduceState, buffer: torch.Tensor, key: BucketKey, iteration: int, *,
                    measure: bool) -> torch.futures.Future[torch.Tensor]:
    """The process group's all-reduce of ``buffer``, averaged (in place when strided; a sparse COO
    tensor's average is a new tensor); with ``measure``, the union density of the result is recorded
    (so the bucket can come back to the sparse path).

    A strided buffer is divided by the world size before the all-reduce, on the calling thread, as
    torch's ``allreduce_hook`` does: the division then overlaps the
    reductions of the buckets before it, instead of delaying the bucket's completion after its
    all-reduce (measured: a dense MLP's step 5-10% slower than plain DDP's with the division after)."""
    strided = buffer.layout == torch.strided
    if strided:
        buffer.div_(state.world_size)
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    nbytes = buffer.numel() * buffer.element_size() if strided else 0

    def average(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            result = f.value()[0]
            if not strided:  # sparse: DDP expects the averaged tensor back
                result = result / state.world_size
            density = union_density(result, state.worker.config) if measure else None
            ring = ring_bytes(nbytes, state.world_size)
            state.record(key, density, True, ring, ring, nbytes)
            return result
        except BaseException as e:
            raise failure(state, e, iteration, key[0]) from e

    return work.get_future().then(average)


def omnireduce_allreduce(state: OmniReduceState, bucket: dist.GradBucket, buffer: torch.Tensor, key: BucketKey,
                         iteration: int) -> torch.futures.Future[torch.Tensor]:
    """Hand ``buffer`` to the worker's I/O thread (``allreduce_async(average=True,
    synchronize=False)``) and return at once; the I/O thread writes the averaged sums into the
    buffer in place, and the returned future completes with it (on CUDA, on the stream that wrote
    it), after the bucket's union density was recorded."""
    fut = hook_future(buffer)
    block_size = bucket_block_size(state, bucket)
    reduction = state.worker.allreduce_async(buffer, average=True, synchronize=False, block_size=block_size)

    def done(f: Any) -> None:
        try:
            f.result()
            info = f.info
            density = info["blocks_union"] / info["blocks_total"] if info["blocks_total"] else 0.0
            state.record(key, density, False, info["bytes_sent"], info["bytes_received"],
                         buffer.numel() * buffer.element_size())
            stream = f.stream  # the side stream that wrote the result (None on the host path)
            if stream is None:
                fut.set_result(buffer)
            else:  # (under the buffer's device: leaving the stream context touches no other GPU)
                with torch.cuda.device(buffer.device), torch.cuda.stream(stream):
                    fut.set_result(buffer)
        except BaseException as e:
            fail(state, fut, e, iteration, key[0])

    reduction.add_done_callback(done)
    return fut


def collective_allreduce(state: OmniReduceState, bucket: dist.GradBucket, buffer: torch.Tensor, key: BucketKey,
                         iteration: int) -> torch.futures.Future[torch.Tensor]:
    """Hand ``buffer`` to the collective engine (``state._engine``, :mod:`omnireduce.collective`):
    the ranks sum each other's blocks through the process group on the engine's thread, in place,
    averaged, in blocks aligned as the aggregators' would be; the returned future completes with
    the buffer once the bucket's union density and bytes are recorded."""
    assert state._engine is not None
    reduction = state._engine.allreduce_async(buffer, average=True, block_size=bucket_block_size(state, bucket))

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            f.value()  # (raises the reduction's error)
            info = reduction.info
            density = info["blocks_union"] / info["blocks_total"] if info["blocks_total"] else 0.0
            state.record(key, density, False, info["bytes_sent"], info["bytes_received"],
                         buffer.numel() * buffer.element_size())
            return buffer
        except BaseException as e:
            raise failure(state, e, iteration, key[0]) from e

    return reduction.then(done)


def bucket_block_size(state: OmniReduceState, bucket: dist.GradBucket) -> int | None:
    """The bucket's block size with ``state.align_blocks``: aligned to the rows of its largest table
    (:func:`omnireduce.alignment.aligned_block_size`); None (the worker's) otherwise."""
    if not state.align_blocks:
        return None
    base = state.worker.config.block_size
    return aligned_block_size([tuple(p.shape) for p in bucket.parameters()], base)


def failure(state: OmniReduceState, cause: BaseException, iteration: int, index: int) -> OmniReduceError:
    """The error DDP raises for a failed bucket (the cause's kind if it is an OmniReduceError),
    counted in ``stats()["buckets_failed"]`` and logged."""
    kind = type(cause) if isinstance(cause, OmniReduceError) else OmniReduceError
    err = kind(f"omnireduce_hook failed at iteration {iteration}, bucket {index}: {cause}")
    err.__cause__ = cause
    with contextlib.suppress(Exception):
        state._counters.add(buckets_failed=1)
    log.error("%s", err)
    return err


def fail(state: OmniReduceState, fut: torch.futures.Future[Any], cause: BaseException, iteration: int,
         index: int) -> None:
    """Complete ``fut`` with the :func:`failure` of its bucket (if it is not complete yet)."""
    err = failure(state, cause, iteration, index)
    if not fut.done():
        fut.set_exception(err)
