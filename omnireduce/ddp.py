"""PyTorch DDP communication hook: all-reduce gradient buckets through omnireduce.

    state = OmniReduceState()                              # before or after init_process_group
    ddp_model.register_comm_hook(state, omnireduce_hook)   # averages, like DDP's default

Aggregators: ``aggregators=[...]`` or ``$OMNIREDUCE_AGGREGATORS``; with neither, the job starts its
own, one per node (:mod:`omnireduce.colocate`), when the state binds (see ``OmniReduceState``).

The hook hands each bucket to the worker's background I/O thread and returns a
``torch.futures.Future`` at once, so communication overlaps the rest of the backward pass; the I/O
thread writes the averaged gradient into ``bucket.buffer()`` in place and completes the future with
that buffer. Only the blocks that are non-zero on some rank travel.

Path choice. A bucket whose gradient is mostly non-zero, or a cluster whose network is fast, can
make the process group's own all-reduce the faster path. By default each bucket's path is chosen
by timing both on the bucket (:mod:`omnireduce.path_choice`); ``OmniReduceState(path=...)`` keeps
the older union-density threshold, or forces one path. Which path a bucket takes must be the same
on every rank, or ranks wait for each other forever; so the decision is made from information every
rank shares bit for bit: timings agreed through an all-reduce (the slowest rank's medians), and the
union density of the same bucket's previous reduction (identical on every rank). No rank's local
view enters alone.

Streams. On CUDA the worker writes the result on its side stream and, asked with
``synchronize=False``, completes its future as soon as the writes are queued; the hook completes
its CUDA-aware torch future on that stream (``ReduceFuture.stream``), so DDP's stream waits for the
writes on the device, and no thread waits for them on the host.

Shape. This module is the hook, a dispatcher: per bucket it picks the path (sparse COO batch,
dense all-reduce or omnireduce) and hands off. What it reads and writes is the state's
(``OmniReduceState``, defined in :mod:`omnireduce.hook_state` and re-exported here: knobs, binding,
decisions, counters); binding to the job is :mod:`omnireduce.hook_binding`; the paths are
:mod:`omnireduce.hook_paths` and :mod:`omnireduce.hook_coo`; the union densities that steer the
decision, :mod:`omnireduce.hook_decisions`. They all log as ``omnireduce.ddp``.

``fuse_optimizer(hook, optimizer)`` (from :mod:`omnireduce.fusion`, re-exported here) wraps a hook
so that the optimizer step of a bucket's parameters runs as soon as that bucket's reduced gradient
arrives.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import logging

import torch
import torch.distributed as dist

from omnireduce.fusion import HookType, fuse_optimizer
from omnireduce.hook_paths import collective_allreduce, dense_allreduce, fail, omnireduce_allreduce
from omnireduce.hook_state import OmniReduceState
from omnireduce.path_choice import COLLECTIVE, DENSE

__all__ = ["HookType", "OmniReduceState", "fuse_optimizer", "omnireduce_hook"]

log = logging.getLogger("omnireduce.ddp")

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def omnireduce_hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over all ranks through omnireduce; never raises.

    Algorithm, per bucket:

    1. Take the bucket's flat buffer. Count the iteration when DDP hands over its last bucket. Bind
       the state if it is not bound yet (collective). At the first bucket of an iteration, hand the
       worker the aggregators the ranks agreed to use; at the last, once the bucket is on its way,
       start the next agreement (:mod:`omnireduce.membership`).
    2. Pick the path, identically on every rank, and hand the bucket to it:

       - a sparse COO gradient (``nn.Embedding(sparse=True)`` & co) joins the state's batch
         (``state._pending_coo``, :mod:`omnireduce.hook_coo`), reduced through omnireduce by its
         rows, the batch at once, when a dense bucket or the last one comes; its future gets the
         averaged sum as a new tensor, whatever the process group's backend;
       - dense: the process group's all-reduce, of the buffer divided by the world size first as
         torch's ``allreduce_hook`` (:func:`omnireduce.hook_paths.dense_allreduce`), for dtypes omnireduce does
         not carry (float64, ...), every bucket while the ranks agree that no aggregator is
         reachable, and a bucket whose path (``state.path``, :meth:`OmniReduceState.choose`) is
         dense: with ``"measure"`` (the default) the faster of the two as timed on the bucket
         (:mod:`omnireduce.path_choice`: alternate paths for a few iterations after DDP's bucket
         rebuild and now and then, the ranks agreeing on the slowest rank's medians); with
         ``"threshold"`` a bucket whose last union density reached ``state.dense_threshold`` (a
         host bucket seen for the first time: the ranks' largest local density; there the
         callback also counts the result's union density, so the bucket can come back);
       - hierarchical (``state.hierarchical``, nodes of several ranks): sum inside the node, each
         shard across the nodes through omnireduce or the rail's dense all-reduce, share inside the
         node (:mod:`omnireduce.hook_hierarchy`); which way the shards cross is ``state.path``'s:
         measured on the whole bucket and agreed by every rank like the flat path's (``"measure"``),
         forced, or (``"threshold"``) each rail's own rule on its shard's union density;
       - the collective engine (``state.engine == "collective"``): the same blocks
         summed by the ranks themselves through the process group's collectives, on the engine's
         own thread and group (:func:`omnireduce.hook_paths.collective_allreduce`);
       - omnireduce: the worker's I/O thread (``allreduce_async(average=True,
         synchronize=False)``) finds the non-zero blocks, streams them to the aggregators, writes
         the averaged sums into the buffer in place, records the bucket's union density, and
         completes the returned future with the buffer (on CUDA, on the stream that wrote it: see
         "Streams" in the module docstring). The block size is aligned to the bucket's largest
         table's rows (``state.align_blocks``) (:func:`omnireduce.hook_paths.omnireduce_allreduce`).

    3. On any failure, complete the future with an :class:`~omnireduce.OmniReduceError` naming the
       iteration, the bucket and the cause (DDP raises it from ``backward()``), and log it.
    """
    index = iteration = -1
    last = agreeing = False
    try:
        buffer = bucket.buffer()
        index, iteration, last = bucket.index(), state.iteration, bucket.is_last()
        if last:
            state.iteration += 1
        if not state.bound:  # made before init_process_group, or unpickled: bind now (collective)
            state.bind()
        agreeing = True  # (from here on, this rank's part of the iteration's agreement is owed)
        state._agreement.at_bucket(state.worker, iteration, state._paths)
        if state.path == "measure":
            state._paths.mark(iteration, buffer)  # (times whole steps when a plan is checked)
        return _reduce(state, bucket, buffer, (index, buffer.numel()), iteration, last)
    except BaseException as e:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fail(state, fut, e, iteration, index)
        return fut
    finally:  # after the last bucket is on its way, so that its all-reduce does not queue behind this one
        if last and agreeing:
            try:
                state._agreement.after_last_bucket(state.worker, state.process_group, iteration,
                                                   bucket.buffer().device, state._paths)
            except BaseException as e:  # (DDP raises the bucket's error, if any; this one is logged)
                log.error("omnireduce: the agreement of iteration %d could not start: %s", iteration, e)


def _reduce(state: OmniReduceState, bucket: dist.GradBucket, buffer: torch.Tensor, key: tuple[int, int],
            iteration: int, last: bool) -> torch.futures.Future[torch.Tensor]:
    """Step 2 of :func:`omnireduce_hook`: the bucket handed to its path."""
    if _is_coo(state, buffer):
        return state._pending_coo.add(state, buffer, key, iteration, last)
    state._pending_coo.flush(state)  # the sparse buckets gathered so far go first (the same order on every rank)
    if state._hierarchy is not None and buffer.dtype in _SUPPORTED and not state._agreement.none_usable:
        rail_path, trial = state.choose(key, buffer, iteration)  # (threshold: None, each rail decides)
        fut = state._hierarchy.reduce(state, bucket, buffer, key, iteration, state._agreement.usable, rail_path)
        return fut if trial is None else trial.watch(fut)
    scan = state.path == "threshold"  # only the threshold rule reads a dense bucket's union density
    if _goes_dense(state, buffer):
        return dense_allreduce(state, buffer, key, iteration, measure=scan and buffer.dtype in _SUPPORTED)
    path, trial = state.choose(key, buffer, iteration)
    if path == DENSE:
        fut = dense_allreduce(state, buffer, key, iteration, measure=scan)
    elif path == COLLECTIVE:
        fut = collective_allreduce(state, bucket, buffer, key, iteration)
    else:
        fut = omnireduce_allreduce(state, bucket, buffer, key, iteration)
    return fut if trial is None else trial.watch(fut)


def _is_coo(state: OmniReduceState, buffer: torch.Tensor) -> bool:
    """A sparse COO gradient omnireduce carries, while some aggregator is usable."""
    return buffer.layout != torch.strided and buffer.dtype in _SUPPORTED and not state._agreement.none_usable


def _goes_dense(state: OmniReduceState, buffer: torch.Tensor) -> bool:
    """Whether the bucket must go through the process group's all-reduce whatever ``state.path``
    says: a dtype omnireduce does not carry, or no aggregator usable."""
    if buffer.dtype not in _SUPPORTED:
        state.warn_once(str(buffer.dtype), f"omnireduce_hook: {buffer.dtype} buckets go through the process "
                        "group's all-reduce (omnireduce carries float32, float16 and bfloat16)")
        return True
    return state._agreement.none_usable
